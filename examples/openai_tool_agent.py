"""An ordinary OpenAI-SDK tool-calling agent. Nothing in it knows about trajgate except the
``base_url`` it is given: point it at ``http://GATEWAY/t/<trajectory_id>/v1`` and every call it
makes is captured as a step of that trajectory.

    python examples/openai_tool_agent.py --base-url http://127.0.0.1:8000/t/demo-1/v1

The tool loop: the model is asked a question with a ``get_weather`` tool; the first call uses
``tool_choice`` naming ``get_weather`` (with ``strict`` tools, vLLM then guarantees a well-formed
call even from a random tiny model),
the agent runs the tool, sends the result back, and asks for the final answer.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            # strict: vLLM then constrains the call to this schema (xgrammar structural tag),
            # so even the random tiny model emits a well-formed call.
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def get_weather(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})


def run(
    base_url: str,
    model: str = "tiny",
    question: str = "What is the weather in Paris?",
    seed: int | None = None,
    max_tokens: int = 96,
    answer_max_tokens: int | None = None,
    system: str = "You answer weather questions using tools.",
    tool_temperature: float = 1.0,
) -> str:
    """One episode: a forced tool call, the tool's result, the answer; returns the answer."""
    client = OpenAI(base_url=base_url, api_key="unused")
    messages: list[dict[str, object]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
    ]
    sampling: dict[str, Any] = {"temperature": 1.0}
    if seed is not None:
        sampling["seed"] = seed
    first = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=max_tokens,
        **{**sampling, "temperature": tool_temperature},
    )
    message = first.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
        result = get_weather(str(arguments.get("city", "")))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=answer_max_tokens or max_tokens,
        **sampling,
    )
    return final.choices[0].message.content or ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--question", default="What is the weather in Paris?")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    answer = run(args.base_url, args.model, args.question, args.seed, args.max_tokens)
    print(json.dumps({"answer": answer}))


if __name__ == "__main__":
    main()
