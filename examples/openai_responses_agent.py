"""An ordinary tool loop on the official ``openai`` SDK's Responses API. Nothing in it knows about
trajgate except the ``base_url`` it is given: point it at ``http://GATEWAY/t/<trajectory_id>/v1``
and every ``responses.create`` call lands as a step of that trajectory.

    python examples/openai_responses_agent.py --base-url http://127.0.0.1:8000/t/demo-1/v1

The gateway translates each Responses call to chat completions for vLLM and records the ids and
logprobs vLLM sampled (docs/gateway.md). The first turn names ``get_weather`` in
``tool_choice`` with a strict schema (vLLM constrains a named tool only when it is strict, so
even a random tiny model writes a valid call); the loop sends the call and its
``function_call_output`` back with the whole history, as a client without server-side state
does, and the model answers freely within ``--max-turns``.

What lands in the pool: one step per call, in one trajectory; each step's ``request`` is the
Responses body as sent (``input`` items), its ``upstream_request`` the chat body vLLM got.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI
from openai.types.responses import Response, ResponseFunctionToolCall

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
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


def _streamed(client: OpenAI, request: dict[str, Any]) -> Response:
    """Stream one call to its terminal event; return the final response it carries. (The SDK's
    ``responses.stream`` helper raises unless the stream ends in ``response.completed``, but a
    turn cut at ``max_output_tokens`` ends in ``response.incomplete``, as OpenAI's does.)"""
    final: Response | None = None
    for event in client.responses.create(**request, stream=True):
        # a UI would render the response.output_text.delta events here
        if event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    if final is None:
        raise RuntimeError("the stream ended without a terminal response event")
    return final


def run(
    base_url: str,
    model: str = "tiny",
    question: str = "What is the weather in Paris?",
    max_output_tokens: int = 160,
    max_turns: int = 3,
    stream: bool = False,
) -> list[Response]:
    """Run the loop; return every response the model gave, in order."""
    client = OpenAI(base_url=base_url, api_key="unused")
    history: list[Any] = [{"role": "user", "content": question}]
    responses: list[Response] = []
    tool_choice: Any = {"type": "function", "name": "get_weather"}
    for _turn in range(max_turns):
        request: dict[str, Any] = {
            "model": model,
            "instructions": "You answer weather questions using tools.",
            "input": history,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "max_output_tokens": max_output_tokens,
        }
        response = _streamed(client, request) if stream else client.responses.create(**request)
        responses.append(response)
        calls = [item for item in response.output if isinstance(item, ResponseFunctionToolCall)]
        if not calls:
            break
        history += [item.model_dump(exclude_none=True) for item in response.output]
        for call in calls:
            city = json.loads(call.arguments)["city"]
            output = get_weather(city)
            history.append(
                {"type": "function_call_output", "call_id": call.call_id, "output": output}
            )
        tool_choice = "auto"
    return responses


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--question", default="What is the weather in Paris?")
    parser.add_argument("--max-output-tokens", type=int, default=160)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args()
    responses = run(
        args.base_url,
        args.model,
        args.question,
        args.max_output_tokens,
        args.max_turns,
        args.stream,
    )
    print(json.dumps({"answer": responses[-1].output_text, "calls": len(responses)}))


if __name__ == "__main__":
    main()
