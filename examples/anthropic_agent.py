"""An ordinary tool loop on the official ``anthropic`` SDK (the Messages API, which Claude Code
also speaks). Nothing in it knows about trajgate except the base URL: point it at
``http://GATEWAY/t/<trajectory_id>`` (the SDK appends ``/v1/messages``) and every call lands as a
step of that trajectory.

    python examples/anthropic_agent.py --base-url http://127.0.0.1:8000/t/demo-1

The gateway translates each Messages call to chat completions for vLLM and records the ids and
logprobs vLLM sampled (docs/gateway.md); the client sees an ordinary Anthropic ``message``. The
first turn forces ``get_weather`` (``tool_choice`` ``{"type": "tool", ...}``) with a strict
schema, so even a random tiny model writes a valid ``tool_use``; the loop answers it with a
``tool_result`` and the model replies freely within ``--max-turns``. The installed SDK takes no
``temperature`` argument; the gateway applies its per-channel sampling defaults, or pass it in
``extra_body``.

What lands in the pool: one step per call, in one trajectory; each step's ``request`` is the
Messages body as sent (``system``, content blocks), its ``upstream_request`` the chat body vLLM
got, the ``tool_use`` as a chat tool call in ``response_message``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import anthropic
from anthropic.types import Message

TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]


def get_weather(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})


def run(
    base_url: str,
    model: str = "tiny",
    question: str = "What is the weather in Paris?",
    max_tokens: int = 160,
    max_turns: int = 3,
    stream: bool = False,
) -> list[Message]:
    """Run the loop; return every message the model sent, in order."""
    client = anthropic.Anthropic(base_url=base_url, api_key="unused")
    history: list[dict[str, Any]] = [{"role": "user", "content": question}]
    messages: list[Message] = []
    tool_choice: dict[str, Any] = {"type": "tool", "name": "get_weather"}
    for _turn in range(max_turns):
        request: dict[str, Any] = {
            "model": model,
            "system": "You answer weather questions using tools.",
            "messages": history,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "max_tokens": max_tokens,
        }
        if stream:
            with client.messages.stream(**request) as events:
                for _event in events:
                    pass  # a UI would render the text deltas here
                message = events.get_final_message()
        else:
            message = client.messages.create(**request)
        messages.append(message)
        uses = [block for block in message.content if block.type == "tool_use"]
        if not uses:
            break
        history.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in message.content],
            }
        )
        results: list[dict[str, Any]] = []
        for use in uses:
            arguments = use.input if isinstance(use.input, dict) else {}
            output = get_weather(str(arguments.get("city")))
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": output})
        history.append({"role": "user", "content": results})
        tool_choice = {"type": "auto"}
    return messages


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--question", default="What is the weather in Paris?")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    messages = run(
        args.base_url, args.model, args.question, args.max_tokens, args.max_turns, args.stream
    )
    text = "".join(block.text for block in messages[-1].content if block.type == "text")
    print(json.dumps({"answer": text, "calls": len(messages)}))


if __name__ == "__main__":
    main()
