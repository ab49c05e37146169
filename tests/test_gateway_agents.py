"""Real client SDKs and real agent frameworks through the real gateway, against the real vLLM.

The only change each client makes is its ``base_url`` (``/t/<trajectory_id>/v1``). For the
official ``openai`` client (sync and async, streaming and not) the stored step must hold exactly
the IDs and logprobs vLLM samples for the same request asked directly (temperature 0, same
seed), while the client sees none of the capture fields it did not ask for. For a LangChain
``ChatOpenAI`` agent and an OpenAI Agents SDK agent (``examples/``), the trajectory must be
complete: every call an ``ok`` step with exact IDs, the tool call parsed, the lineage recorded.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
from agents import ToolCallItem, ToolCallOutputItem
from langchain_core.messages import AIMessage, ToolMessage
from openai import AsyncOpenAI, OpenAI

from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore, StoredStep
from gateway.server import BackgroundServer
from trajgate.vllm_server import VLLMServer

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
MAX_TOKENS = 16
REQUEST: dict[str, Any] = {
    "model": "tiny",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ],
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "seed": 11,
}
CITIES = {"Paris", "London", "Tokyo"}  # the enum of the examples' get_weather tool
INTEGRITY_FLAGS = {"ids_missing", "ids_incomplete", "prompt_ids_missing", "aborted"}


def _steps(pool_settings: PoolSettings, trajectory_id: str) -> list[StoredStep]:
    engine = make_engine(pool_settings.resolved_database_url())
    try:
        return PoolStore(engine).steps_of(trajectory_id)
    finally:
        engine.dispose()


def _vllm_direct(vllm: VLLMServer, request: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own non-streaming answer to ``request`` with the capture fields asked for."""
    response = httpx.post(
        f"{vllm.url}/v1/chat/completions",
        json={**request, "return_token_ids": True, "logprobs": True},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _vllm_tokenize(vllm: VLLMServer, request: dict[str, Any]) -> list[int]:
    """The IDs vLLM's chat template gives ``request``'s messages and tools (no sampling)."""
    payload: dict[str, Any] = {"model": request["model"], "messages": request["messages"]}
    if request.get("tools"):
        payload["tools"] = request["tools"]
    response = httpx.post(f"{vllm.url}/tokenize", json=payload, timeout=60)
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def _load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as users run it: a plain script, not part of a package."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the official openai client ----------------------------------------------------------


@dataclass
class ClientView:
    """What the client received: the JSON payloads (one, or one per SSE chunk), the text it
    assembled, the usage it was given and the step id header."""

    payloads: list[dict[str, Any]] = field(default_factory=list)
    content: str = ""
    completion_tokens: int | None = None
    step_id_header: str = ""


def _call_sync(base_url: str, stream: bool, **extra: Any) -> ClientView:
    view = ClientView()
    with OpenAI(base_url=base_url, api_key="unused") as client:
        if not stream:
            raw = client.chat.completions.with_raw_response.create(**REQUEST, **extra)
            completion = raw.parse()
            view.step_id_header = raw.headers["x-trajgate-step-id"]
            view.payloads.append(completion.to_dict())
            view.content = completion.choices[0].message.content or ""
            view.completion_tokens = (
                completion.usage.completion_tokens if completion.usage else None
            )
            return view
        raw_stream = client.chat.completions.with_raw_response.create(
            **REQUEST, **extra, stream=True
        )
        view.step_id_header = raw_stream.headers["x-trajgate-step-id"]
        for chunk in raw_stream.parse():
            view.payloads.append(chunk.to_dict())
            view.content += "".join(choice.delta.content or "" for choice in chunk.choices)
            if chunk.usage is not None:
                view.completion_tokens = chunk.usage.completion_tokens
    return view


async def _call_async(base_url: str, stream: bool) -> ClientView:
    view = ClientView()
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        if not stream:
            raw = await client.chat.completions.with_raw_response.create(**REQUEST)
            completion = raw.parse()
            view.step_id_header = raw.headers["x-trajgate-step-id"]
            view.payloads.append(completion.to_dict())
            view.content = completion.choices[0].message.content or ""
            view.completion_tokens = (
                completion.usage.completion_tokens if completion.usage else None
            )
            return view
        raw_stream = await client.chat.completions.with_raw_response.create(**REQUEST, stream=True)
        view.step_id_header = raw_stream.headers["x-trajgate-step-id"]
        async for chunk in raw_stream.parse():
            view.payloads.append(chunk.to_dict())
            view.content += "".join(choice.delta.content or "" for choice in chunk.choices)
    return view


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_openai_client_call_stores_the_ids_and_logprobs_vllm_samples_for_that_request(
    vllm: VLLMServer,
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    client_kind: str,
    stream: bool,
) -> None:
    trajectory_id = f"openai-{client_kind}-{'stream' if stream else 'unary'}"
    base_url = f"{gateway.url}/t/{trajectory_id}/v1"
    if client_kind == "sync":
        view = _call_sync(base_url, stream)
    else:
        view = asyncio.run(_call_async(base_url, stream))
    direct = _vllm_direct(vllm, REQUEST)
    direct_choice = direct["choices"][0]
    direct_ids = direct_choice["token_ids"]
    direct_logprobs = [entry["logprob"] for entry in direct_choice["logprobs"]["content"]]

    steps = _steps(pool_settings, trajectory_id)
    assert len(steps) == 1
    step = steps[0]
    assert view.step_id_header == step.id  # streamed steps are named before the first token
    assert step.outcome == "ok"
    # Greedy decoding of this prompt does not reach the end token within 16 tokens.
    assert step.flags == ["truncated", "narrowed"]  # greedy: a narrowed distribution
    assert step.finish_reason == direct_choice["finish_reason"] == "length"
    assert step.prompt_token_ids == direct["prompt_token_ids"]
    assert step.response_token_ids == direct_ids
    assert step.response_logprobs == direct_logprobs
    # max_tokens 16, finish "length": 16 sampled ids, 16 logprobs, 16 completion tokens.
    assert step.response_token_ids is not None and step.response_logprobs is not None
    assert len(step.response_token_ids) == len(step.response_logprobs) == MAX_TOKENS
    assert step.completion_tokens == direct["usage"]["completion_tokens"] == MAX_TOKENS
    assert step.response_message is not None
    assert view.content == direct_choice["message"]["content"]
    assert step.response_message["content"] == view.content
    if not stream:
        assert view.completion_tokens == MAX_TOKENS

    # The client asked for neither ids nor logprobs nor a usage chunk: it sees none of them.
    assert view.payloads
    for payload in view.payloads:
        assert payload.get("prompt_token_ids") is None
        assert payload["choices"], f"a chunk without choices (a usage chunk?): {payload}"
        for choice in payload["choices"]:
            assert choice.get("token_ids") is None
            assert choice.get("prompt_token_ids") is None
            assert choice.get("logprobs") is None
        if stream:
            assert payload.get("usage") is None


def test_openai_client_stream_that_asks_for_usage_gets_one_last_usage_chunk_like_vllms(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    view = _call_sync(
        f"{gateway.url}/t/openai-usage/v1", True, stream_options={"include_usage": True}
    )
    direct = _vllm_direct(vllm, REQUEST)

    usage_chunks = [payload for payload in view.payloads if payload.get("usage") is not None]
    assert usage_chunks == [view.payloads[-1]]  # exactly one, and last
    assert view.payloads[-1]["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    # vLLM's unary usage adds null *_details keys its stream usage lacks: compare the counts.
    assert {key: view.payloads[-1]["usage"][key] for key in counts} == {
        key: direct["usage"][key] for key in counts
    }
    (step,) = _steps(pool_settings, "openai-usage")
    assert step.id == view.step_id_header
    assert step.response_token_ids == direct["choices"][0]["token_ids"]
    # 16 sampled ids, as the usage chunk the client got says.
    assert step.response_token_ids is not None
    assert len(step.response_token_ids) == view.completion_tokens == MAX_TOKENS
    for payload in view.payloads:
        assert payload.get("prompt_token_ids") is None
        for choice in payload["choices"]:
            assert choice.get("token_ids") is None
            assert choice.get("logprobs") is None


# -- agent frameworks --------------------------------------------------------------------


def _assert_complete_trajectory(
    steps: list[StoredStep], vllm: VLLMServer, question: str
) -> dict[str, Any]:
    """Check what every agent trajectory must hold; return the first call's stored tool call."""
    assert len(steps) >= 2  # the forced tool call, then the answer after the tool result
    assert [step.step_index for step in steps] == list(range(len(steps)))
    by_id = {step.id: step for step in steps}
    for step in steps:
        assert step.outcome == "ok", (step.step_index, step.outcome)
        assert not INTEGRITY_FLAGS & set(step.flags), (step.step_index, step.flags)
        assert step.prompt_token_ids, step.step_index
        assert step.response_token_ids, step.step_index
        assert step.response_logprobs is not None
        assert len(step.response_token_ids) == len(step.response_logprobs)
        assert len(step.response_token_ids) == step.completion_tokens
        rendered = _vllm_tokenize(vllm, step.request)
        if step.continuation == "exact":
            # Exact continuation: the parent's own prompt + sampled ids, then the template's
            # rendering of only the new messages, which is the tail of the whole rendering.
            parent = by_id[step.parent_step_id]
            base = [*parent.prompt_token_ids, *parent.response_token_ids]
            assert step.prompt_token_ids[: len(base)] == base, step.step_index
            suffix = step.suffix_tokens
            assert suffix and step.prompt_token_ids[-suffix:] == rendered[-suffix:]
        else:
            # The chat template's rendering of the request as sent, which vLLM's /tokenize
            # gives without sampling.
            assert step.prompt_token_ids == rendered, step.step_index
    first_messages = steps[0].request["messages"]
    assert first_messages[-1]["role"] == "user"
    assert first_messages[-1]["content"] == question

    # The first call names get_weather in tool_choice: vLLM constrains it to one whole call
    # (finish "stop", not "length") whose arguments are JSON with a city from the enum.
    assert steps[0].response_message is not None
    tool_calls = steps[0].response_message["tool_calls"]
    assert len(tool_calls) == 1
    assert steps[0].finish_reason == "stop"
    assert tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(tool_calls[0]["function"]["arguments"])["city"] in CITIES

    earlier_ids = {steps[0].id}
    for step in steps[1:]:
        assert step.parent_step_id in earlier_ids, step.step_index
        assert step.extends_parent is not None, step.step_index
        if step.extends_parent is False:
            assert step.divergence_kind, step.step_index
            assert step.divergence_detail, step.step_index
            assert "prefix_break" in step.flags
        earlier_ids.add(step.id)
    first_call: dict[str, Any] = tool_calls[0]
    return first_call


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_langchain_chat_openai_agent_produces_a_complete_trajectory(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    agent = _load_example("langchain_agent")
    trajectory_id = f"langchain-{'stream' if stream else 'unary'}"
    question = "What is the weather in Paris?"
    messages = agent.run(
        f"{gateway.url}/t/{trajectory_id}/v1",
        question=question,
        seed=3,
        max_tokens=192,  # the forced call pads with whitespace for up to ~130 tokens
        max_turns=3,
        stream=stream,
    )

    steps = _steps(pool_settings, trajectory_id)
    stored_call = _assert_complete_trajectory(steps, vllm, question)
    replies = [message for message in messages if isinstance(message, AIMessage)]
    assert len(replies) == len(steps)  # one step per model call the agent made
    assert replies[0].tool_calls[0]["id"] == stored_call["id"]
    assert replies[0].tool_calls[0]["args"] == json.loads(stored_call["function"]["arguments"])
    tool_results = [message for message in messages if isinstance(message, ToolMessage)]
    assert tool_results[0].tool_call_id == stored_call["id"]
    assert steps[-1].response_message is not None
    assert steps[-1].response_message["content"] == replies[-1].content


@pytest.mark.parametrize("stream", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_sdk_agent_produces_a_complete_trajectory(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, stream: bool
) -> None:
    agent = _load_example("openai_agents_sdk_agent")
    trajectory_id = f"agents-sdk-{'stream' if stream else 'unary'}"
    question = "What is the weather in Paris?"
    result = asyncio.run(
        agent.run(
            f"{gateway.url}/t/{trajectory_id}/v1",
            question=question,
            seed=3,
            max_tokens=192,  # the forced call pads with whitespace for up to ~130 tokens
            max_turns=3,
            stream=stream,
        )
    )

    steps = _steps(pool_settings, trajectory_id)
    stored_call = _assert_complete_trajectory(steps, vllm, question)
    assert len(result.raw_responses) == len(steps)  # one step per model call the SDK made
    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert getattr(calls[0], "call_id", None) == stored_call["id"]
    assert getattr(calls[0], "name", None) == "get_weather"
    outputs = [item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert (
        json.loads(str(outputs[0].output))["city"]
        == json.loads(stored_call["function"]["arguments"])["city"]
    )
    assert steps[-1].response_message is not None
    assert steps[-1].response_message["content"] == result.final_output
