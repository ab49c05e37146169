"""The official ``openai`` and ``anthropic`` SDKs and the OpenAI Agents SDK through the gateway's
Responses and Messages dialects, against the real vLLM.

Each client changes only its base URL: ``/t/<trajectory_id>/v1`` for ``openai`` and the Agents
SDK, ``/t/<trajectory_id>`` for ``anthropic`` (its SDK appends ``/v1/messages``). Both dialects
send chat completions to vLLM, so for every step recorded:

- the prompt ids are vLLM's own ``/tokenize`` of the stored upstream chat body (its messages,
  tools and the template switches it carries, with the generation prompt), or, for a call that
  continues the previous turn (exact continuation, the default: docs/gateway.md), that turn's
  prompt and sampled ids followed by the last ``suffix_tokens`` of that rendering;
- the response ids and logprobs are those vLLM samples when that stored body is asked again
  directly (an exact step: its stored prompt ids, with the sampling parameters vLLM renders
  for the body). Every call here decodes greedily (temperature 0), so the replay samples the same
  ids, compared exactly; logprobs agree to 1e-5, not bit for bit (``_assert_exact``);
- the text or tool call the client received is the one the step stores;
- the calls of one conversation are the steps of one trajectory, each on its predecessor.

The tiny model writes nonsense, so a tool call is forced by naming the tool in ``tool_choice``
with a strict schema (vLLM 0.32 constrains a named tool only when the function is ``strict``;
without it the model writes free text), and the assertions are on the protocol, never on words.
A forced call's sampled ids are the grammar's text while a re-rendered prompt would write the
call in the template's tool-call markup (a prefix break by construction); with exact
continuation the turn after it extends it, with no break, and that is asserted.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any, Literal

import anthropic
import httpx
import pytest
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelResponse,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI, OpenAI

from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore, StoredStep
from gateway.server import BackgroundServer
from trajgate.vllm_server import VLLMServer

MODEL = "tiny"
ANSWER_TOKENS = 12  # a free answer: the tiny model never stops this early, so all 12 are sampled
CALL_TOKENS = 160  # a forced call: the grammar lets the model pad the JSON with whitespace;
# greedy decoding of these prompts closes it after 72 to 80 tokens (measured on vLLM directly)
INSTRUCTIONS = "You are terse."
QUESTION = "What is the weather in Paris?"
CITIES = ("Paris", "London", "Tokyo")
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": list(CITIES)}},
    "required": ["city"],
    "additionalProperties": False,
}
RESPONSES_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": CITY_SCHEMA,
    "strict": True,
}
ANTHROPIC_TOOL: dict[str, Any] = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "input_schema": CITY_SCHEMA,
    "strict": True,
}
LOGPROB_ABS = 1e-5
WEATHER = json.dumps({"city": "Paris", "temperature_c": 21})
# Keys of a chat body that change the rendered prompt; /tokenize takes each of them.
RENDERING_KEYS = ("messages", "tools", "chat_template_kwargs", "continue_final_message")
INTEGRITY_FLAGS = {"ids_missing", "ids_incomplete", "prompt_ids_missing", "aborted"}


def _steps(pool_settings: PoolSettings, trajectory_id: str) -> list[StoredStep]:
    engine = make_engine(pool_settings.resolved_database_url())
    try:
        return PoolStore(engine).steps_of(trajectory_id)
    finally:
        engine.dispose()


def _vllm_tokenize(vllm: VLLMServer, upstream: dict[str, Any]) -> list[int]:
    """vLLM's ``/tokenize`` of the prompt the chat body ``upstream`` renders (no sampling)."""
    assert "reasoning_effort" not in upstream, "the template's reasoning switch is not replayed"
    payload: dict[str, Any] = {"model": upstream["model"]}
    payload.update({key: upstream[key] for key in RENDERING_KEYS if key in upstream})
    # A prefill (continue_final_message) has no generation prompt; every other call has one.
    payload["add_generation_prompt"] = not upstream.get("continue_final_message", False)
    response = httpx.post(f"{vllm.url}/tokenize", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def _vllm_direct(vllm: VLLMServer, upstream: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own unary answer to the stored upstream body, asked again with the capture
    fields (a stored stream is asked unstreamed: greedy decoding samples the same ids)."""
    body = {
        key: value for key, value in upstream.items() if key not in ("stream", "stream_options")
    }
    body.update(return_token_ids=True, logprobs=True)
    response = httpx.post(f"{vllm.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _vllm_generate(
    vllm: VLLMServer, upstream: dict[str, Any], prompt_ids: list[int]
) -> dict[str, Any]:
    """vLLM's sampling from ``prompt_ids`` with the parameters it renders for ``upstream``
    (``/v1/chat/completions/render``, then ``/inference/v1/generate``), in the chat answer's
    shape the checks read: ``choices[0]`` with ``token_ids``, ``logprobs.content``,
    ``finish_reason``; ``usage``."""
    body = {
        key: value for key, value in upstream.items() if key not in ("stream", "stream_options")
    }
    render = httpx.post(f"{vllm.url}/v1/chat/completions/render", json=body, timeout=60)
    assert render.status_code == 200, render.text
    request = {**render.json(), "token_ids": prompt_ids}
    response = httpx.post(f"{vllm.url}/inference/v1/generate", json=request, timeout=120)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _assert_exact(vllm: VLLMServer, step: StoredStep) -> dict[str, Any]:
    """Check that ``step`` holds exactly what vLLM renders and samples for its upstream body;
    return vLLM's direct choice for further checks."""
    assert step.outcome == "ok", (step.step_index, step.outcome, step.error)
    assert not INTEGRITY_FLAGS & set(step.flags), (step.step_index, step.flags)
    upstream: dict[str, Any] = step.upstream_request
    assert upstream["temperature"] == 0  # greedy: the replay below must sample the same ids
    rendered = _vllm_tokenize(vllm, upstream)
    if step.continuation == "exact":
        suffix = step.suffix_tokens
        assert suffix, step.step_index
        assert step.prompt_token_ids[-suffix:] == rendered[-suffix:], step.step_index
        direct = _vllm_generate(vllm, upstream, step.prompt_token_ids)
    else:
        assert step.prompt_token_ids == rendered, step.step_index
        direct = _vllm_direct(vllm, upstream)
        assert step.prompt_token_ids == direct["prompt_token_ids"]
    choice: dict[str, Any] = direct["choices"][0]
    assert step.response_token_ids == choice["token_ids"], step.step_index
    direct_logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    # Logprobs to 1e-5, not bit for bit: a replay meets another prefix-cache state and batch
    # shape, which reorders float sums on the CPU (seen: -0.67831999 vs -0.67831969). A
    # misaligned or missing logprob differs by far more.
    assert step.response_logprobs == pytest.approx(direct_logprobs, rel=0, abs=LOGPROB_ABS)
    assert step.finish_reason == choice["finish_reason"]
    assert step.response_token_ids is not None
    assert len(step.response_token_ids) == step.completion_tokens
    assert step.completion_tokens == direct["usage"]["completion_tokens"]
    assert step.prompt_tokens == len(step.prompt_token_ids)
    return choice


def _assert_forced_call_then_extension(steps: list[StoredStep]) -> dict[str, Any]:
    """The first step is one whole forced ``get_weather`` call, every later step hangs on its
    predecessor, and the one right after the call extends it exactly (module docstring); return
    the stored call."""
    assert [step.step_index for step in steps] == list(range(len(steps)))
    assert steps[0].finish_reason == "stop"  # the strict schema closed the JSON, not max tokens
    assert steps[0].response_message is not None
    (call,) = steps[0].response_message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in CITIES
    for previous, step in itertools.pairwise(steps):
        assert step.parent_step_id == previous.id, step.step_index
        assert step.extends_parent is not None, step.step_index
    assert steps[1].continuation == "exact"
    assert steps[1].extends_parent is True
    assert "prefix_break" not in steps[1].flags
    assert steps[1].divergence_kind is None
    stored: dict[str, Any] = call
    return stored


def _tool_messages(step: StoredStep) -> list[dict[str, Any]]:
    return [m for m in step.upstream_request["messages"] if m["role"] == "tool"]


# -- the official openai SDK, Responses API -------------------------------------------------


def _responses_text(client: OpenAI, mode: str) -> tuple[str, int | None, list[str]]:
    """One Responses call in ``mode``; return the text the client assembled, the output token
    count it was told, and the event types it consumed (none when unary)."""
    request: dict[str, Any] = {
        "model": MODEL,
        "instructions": INSTRUCTIONS,
        "input": "Name three colours.",
        "max_output_tokens": ANSWER_TOKENS,
        "temperature": 0,
    }
    if mode == "create":
        response = client.responses.create(**request)
        return response.output_text, response.usage and response.usage.output_tokens, []
    if mode == "create_stream":
        types: list[str] = []
        deltas: list[str] = []
        sequence: list[int] = []
        final = None
        for event in client.responses.create(**request, stream=True):
            types.append(event.type)
            sequence.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert sequence == list(range(len(sequence)))  # every event numbered, none skipped
        assert final is not None
        assert final.output_text == "".join(deltas)
        return final.output_text, final.usage and final.usage.output_tokens, types
    raise ValueError(f"mode must be one of create, create_stream, got {mode!r}")


@pytest.mark.parametrize("mode", ["create", "create_stream"])
def test_responses_call_stores_the_ids_vllm_samples_and_the_text_the_client_got(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, mode: str
) -> None:
    trajectory_id = f"responses-{mode}"
    with OpenAI(base_url=f"{gateway.url}/t/{trajectory_id}/v1", api_key="unused") as client:
        text, output_tokens, types = _responses_text(client, mode)

    (step,) = _steps(pool_settings, trajectory_id)
    choice = _assert_exact(vllm, step)
    assert step.request["input"] == "Name three colours."  # the client's body, as sent
    assert step.upstream_request["messages"] == [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Name three colours."},
    ]
    # 12 tokens asked, none of them the end token: finish "length", 12 ids, 12 logprobs.
    assert step.finish_reason == "length"
    assert step.response_logprobs is not None
    assert len(step.response_logprobs) == output_tokens == ANSWER_TOKENS
    assert step.response_message is not None
    assert text == step.response_message["content"] == choice["message"]["content"]
    if mode != "create":
        assert types[:2] == ["response.created", "response.in_progress"]
        assert types[-1] == "response.incomplete"  # max_output_tokens reached
        assert types.count("response.output_text.delta") >= 1
        for done in ("response.output_text.done", "response.content_part.done"):
            assert types.count(done) == 1, done
        assert types[-2] == "response.output_item.done"


def _responses_turn(client: OpenAI, stream: bool, **request: Any) -> Any:
    """One Responses call; unary, or streamed to its terminal event and the final response
    returned. A streamed call that must complete (a forced tool call) goes through the SDK's
    ``responses.stream`` helper and ``get_final_response()``, which raises unless the stream
    sends ``response.completed``; one that may stop at ``max_output_tokens`` ends in
    ``response.incomplete`` (as OpenAI's does), so it is read event by event."""
    if not stream:
        return client.responses.create(**request)
    if request.get("tool_choice"):
        with client.responses.stream(**request) as events:
            types = [event.type for event in events]
            completed = events.get_final_response()
        assert "response.function_call_arguments.done" in types
        assert types[-1] == "response.completed"
        return completed
    final = None
    for event in client.responses.create(**request, stream=True):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None, "the stream ended without a completed or incomplete event"
    return final


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_responses_function_tool_loop_lands_as_one_trajectory_of_exact_steps(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    trajectory_id = f"responses-tools-{'stream' if stream else 'unary'}"
    conversation: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    common = {"model": MODEL, "tools": [RESPONSES_TOOL], "temperature": 0}
    with OpenAI(base_url=f"{gateway.url}/t/{trajectory_id}/v1", api_key="unused") as client:
        first = _responses_turn(
            client,
            stream,
            input=conversation,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=CALL_TOKENS,
            **common,
        )
        calls = [item for item in first.output if item.type == "function_call"]
        assert len(calls) == 1, first.output
        conversation += [item.model_dump(exclude_none=True) for item in first.output]
        conversation.append(
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": WEATHER}
        )
        second = _responses_turn(
            client, stream, input=conversation, max_output_tokens=ANSWER_TOKENS, **common
        )

    steps = _steps(pool_settings, trajectory_id)
    assert len(steps) == 2  # one step per call
    for step in steps:
        _assert_exact(vllm, step)
    stored_call = _assert_forced_call_then_extension(steps)
    assert calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == json.loads(stored_call["function"]["arguments"])
    # The function_call_output went upstream as the tool message answering that very call.
    (tool_message,) = _tool_messages(steps[1])
    assert tool_message["content"] == WEATHER
    (assistant,) = [m for m in steps[1].upstream_request["messages"] if m["role"] == "assistant"]
    assert assistant["tool_calls"][0]["id"] == tool_message["tool_call_id"]
    assert assistant["tool_calls"][0]["function"]["name"] == "get_weather"
    assert steps[1].request["input"][-1]["type"] == "function_call_output"
    assert steps[1].response_message is not None
    assert second.output_text == (steps[1].response_message["content"] or "")


# -- the OpenAI Agents SDK, its default Responses model ------------------------------------


@function_tool
def get_weather(city: Literal["Paris", "London", "Tokyo"]) -> str:
    """Current weather for a city.

    Args:
        city: The city to look up.
    """
    return json.dumps({"city": city, "temperature_c": 21})


async def _agents_run(base_url: str, max_turns: int) -> list[ModelResponse]:
    """One Agents SDK run on its default model provider (the Responses API); return the raw
    model responses of every call it made.

    The SDK treats a response that ends ``incomplete`` (the tiny model's free answers run to
    the token limit) as an error, so every turn is a forced ``get_weather`` call
    (``reset_tool_choice=False``) and the run ends with the SDK's own ``MaxTurnsExceeded``
    after ``max_turns`` calls; the error carries the responses.
    """
    set_tracing_disabled(True)
    set_default_openai_api("responses")
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="unused"), False)
    agent: Agent[None] = Agent(
        name="weather",
        instructions="You answer weather questions using tools.",
        model=MODEL,
        tools=[get_weather],
        model_settings=ModelSettings(
            tool_choice="get_weather", temperature=0, max_tokens=CALL_TOKENS
        ),
        reset_tool_choice=False,
    )
    with pytest.raises(MaxTurnsExceeded) as raised:
        await Runner.run(agent, QUESTION, max_turns=max_turns)
    assert raised.value.run_data is not None
    return list(raised.value.run_data.raw_responses)


def test_openai_agents_sdk_default_responses_model_lands_every_call_as_an_exact_step(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    trajectory_id = "agents-sdk-responses"
    raw_responses = asyncio.run(_agents_run(f"{gateway.url}/t/{trajectory_id}/v1", max_turns=2))

    steps = _steps(pool_settings, trajectory_id)
    assert len(steps) == len(raw_responses) == 2  # max_turns 2: two model calls, then the error
    for step, raw in zip(steps, raw_responses, strict=True):
        _assert_exact(vllm, step)
        assert "input" in step.request  # it spoke the Responses API, not chat completions
        assert raw.usage.output_tokens == step.completion_tokens
        calls = [item for item in raw.output if item.type == "function_call"]
        assert len(calls) == 1
        assert step.response_message is not None
        (stored,) = step.response_message["tool_calls"]
        assert calls[0].name == stored["function"]["name"] == "get_weather"
        assert json.loads(calls[0].arguments) == json.loads(stored["function"]["arguments"])
    _assert_forced_call_then_extension(steps)
    assert steps[1].request["input"][-1]["type"] == "function_call_output"


# -- the official anthropic SDK, Messages API ------------------------------------------------


def _anthropic(gateway: BackgroundServer, trajectory_id: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{gateway.url}/t/{trajectory_id}", api_key="unused")


def _messages_turn(client: anthropic.Anthropic, stream: bool, **request: Any) -> Any:
    """One Messages call; unary, or through ``messages.stream`` to ``get_final_message()``.
    anthropic 2.15 dropped ``temperature`` from its signature: it goes in ``extra_body``."""
    request["extra_body"] = {"temperature": 0}
    if not stream:
        return client.messages.create(**request)
    with client.messages.stream(**request) as events:
        types = [event.type for event in events]
        final = events.get_final_message()
    assert types[0] == "message_start"
    assert types[-1] == "message_stop"
    assert "message_delta" in types
    assert types.count("content_block_start") == types.count("content_block_stop")
    return final


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_anthropic_message_stores_the_ids_vllm_samples_and_the_text_the_client_got(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    trajectory_id = f"anthropic-{'stream' if stream else 'create'}"
    with _anthropic(gateway, trajectory_id) as client:
        message = _messages_turn(
            client,
            stream,
            model=MODEL,
            system=INSTRUCTIONS,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=ANSWER_TOKENS,
        )

    (step,) = _steps(pool_settings, trajectory_id)
    choice = _assert_exact(vllm, step)
    assert step.request["system"] == INSTRUCTIONS  # the client's body, as sent
    assert step.upstream_request["messages"][0] == {"role": "system", "content": INSTRUCTIONS}
    # 12 tokens asked, none of them the end token: Anthropic's "max_tokens", chat's "length".
    assert message.stop_reason == "max_tokens"
    assert step.finish_reason == "length"
    assert message.usage.output_tokens == step.completion_tokens == ANSWER_TOKENS
    assert message.usage.input_tokens == step.prompt_tokens
    (block,) = message.content
    assert block.type == "text"
    assert step.response_message is not None
    assert block.text == step.response_message["content"] == choice["message"]["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_anthropic_tool_use_tool_result_loop_lands_as_one_trajectory_of_exact_steps(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    trajectory_id = f"anthropic-tools-{'stream' if stream else 'create'}"
    conversation: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    common = {"model": MODEL, "system": INSTRUCTIONS, "tools": [ANTHROPIC_TOOL]}
    with _anthropic(gateway, trajectory_id) as client:
        first = _messages_turn(
            client,
            stream,
            messages=conversation,
            tool_choice={"type": "tool", "name": "get_weather"},
            max_tokens=CALL_TOKENS,
            **common,
        )
        assert first.stop_reason == "tool_use"
        uses = [block for block in first.content if block.type == "tool_use"]
        assert len(uses) == 1, first.content
        conversation.append(
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in first.content],
            }
        )
        conversation.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": WEATHER}],
            }
        )
        second = _messages_turn(
            client, stream, messages=conversation, max_tokens=ANSWER_TOKENS, **common
        )

    steps = _steps(pool_settings, trajectory_id)
    assert len(steps) == 2  # one step per call
    for step in steps:
        _assert_exact(vllm, step)
    stored_call = _assert_forced_call_then_extension(steps)
    assert uses[0].name == "get_weather"
    assert uses[0].input == json.loads(stored_call["function"]["arguments"])
    # The tool_result went upstream as the tool message answering the call vLLM made.
    (tool_message,) = _tool_messages(steps[1])
    assert tool_message["content"] == WEATHER
    assert tool_message["tool_call_id"] == stored_call["id"]
    assert steps[1].request["messages"][-1]["content"][0]["type"] == "tool_result"
    assert second.usage.output_tokens == steps[1].completion_tokens
    assert steps[1].response_message is not None
    text = "".join(block.text for block in second.content if block.type == "text")
    assert text == (steps[1].response_message["content"] or "")
