"""An ordinary LangChain tool-calling agent. Nothing in it knows about trajgate except the
``base_url`` it is given: point it at ``http://GATEWAY/t/<trajectory_id>/v1`` and every call its
``ChatOpenAI`` makes is captured as a step of that trajectory.

    python examples/langchain_agent.py --base-url http://127.0.0.1:8000/t/demo-1/v1 [--stream]

The tool loop: the model is bound to a ``get_weather`` tool and the first turn names it in
``tool_choice`` (with ``strict`` tools and an ``enum`` argument, vLLM then constrains the call to
the schema, so even the random tiny model emits a well-formed call; ``"required"`` is avoided
because an unconstrained model can loop on whitespace there). The agent runs each tool call,
sends the results back and lets the model answer freely, for at most ``max_turns`` calls.
"""

from __future__ import annotations

import argparse
import json
from typing import Literal

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

City = Literal["Paris", "London", "Tokyo"]


@tool
def get_weather(city: City) -> str:
    """Current weather for a city."""
    return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})


def run(
    base_url: str,
    model: str = "tiny",
    question: str = "What is the weather in Paris?",
    seed: int = 0,
    max_tokens: int = 64,
    max_turns: int = 3,
    stream: bool = False,
) -> list[BaseMessage]:
    """Run the agent; return the whole conversation (system, user, AI and tool messages)."""
    llm = ChatOpenAI(
        base_url=base_url,
        api_key="unused",  # type: ignore[arg-type]
        model=model,
        temperature=1.0,
        max_completion_tokens=max_tokens,
        seed=seed,
        streaming=stream,
    )
    forced = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    free = llm.bind_tools([get_weather], strict=True)
    messages: list[BaseMessage] = [
        SystemMessage("You answer weather questions using tools."),
        HumanMessage(question),
    ]
    for turn in range(max_turns):
        reply = (forced if turn == 0 else free).invoke(messages)
        assert isinstance(reply, AIMessage)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(get_weather.invoke(call))
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--question", default="What is the weather in Paris?")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    messages = run(
        args.base_url,
        args.model,
        args.question,
        args.seed,
        args.max_tokens,
        args.max_turns,
        args.stream,
    )
    print(json.dumps({"answer": messages[-1].content, "messages": len(messages)}))


if __name__ == "__main__":
    main()
