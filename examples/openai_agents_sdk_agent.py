"""An ordinary OpenAI Agents SDK agent. Nothing in it knows about trajgate except the
``base_url`` it is given: point it at ``http://GATEWAY/t/<trajectory_id>/v1`` and every model
call the run makes is captured as a step of that trajectory.

    python examples/openai_agents_sdk_agent.py --base-url http://127.0.0.1:8000/t/demo-1/v1

vLLM serves Chat Completions, not the Responses API, so the agent's model is
``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client. Tracing export is switched off:
it would send spans to OpenAI's servers. The first turn names ``get_weather`` in
``tool_choice`` (the SDK's ``function_tool`` schemas are strict and the argument is an enum, so
vLLM constrains the call to the schema, even from a random tiny model); after the tool ran, the
SDK resets ``tool_choice`` and the model answers freely, within ``max_turns``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    RunResult,
    RunResultStreaming,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI


@function_tool
def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
    """Current weather for a city.

    Args:
        city: The city to look up.
    """
    return json.dumps({"city": city, "temperature_c": 21, "sky": "sunny"})


def build_agent(base_url: str, model: str, seed: int, max_tokens: int) -> Agent[None]:
    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    return Agent(
        name="weather",
        instructions="You answer weather questions using tools.",
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        tools=[get_weather],
        model_settings=ModelSettings(
            tool_choice="get_weather",
            temperature=1.0,
            max_tokens=max_tokens,
            extra_args={"seed": seed},
        ),
    )


async def run(
    base_url: str,
    model: str = "tiny",
    question: str = "What is the weather in Paris?",
    seed: int = 0,
    max_tokens: int = 64,
    max_turns: int = 3,
    stream: bool = False,
) -> RunResult | RunResultStreaming:
    """Run the agent once; return the SDK's run result (items, raw model responses, output)."""
    set_tracing_disabled(True)
    agent = build_agent(base_url, model, seed, max_tokens)
    if not stream:
        return await Runner.run(agent, question, max_turns=max_turns)
    streamed = Runner.run_streamed(agent, question, max_turns=max_turns)
    async for _event in streamed.stream_events():
        pass
    return streamed


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
    result = asyncio.run(
        run(
            args.base_url,
            args.model,
            args.question,
            args.seed,
            args.max_tokens,
            args.max_turns,
            args.stream,
        )
    )
    print(json.dumps({"answer": str(result.final_output), "items": len(result.new_items)}))


if __name__ == "__main__":
    main()
