"""Capture cases C01-C13 and C18 (defined in docs/capture-cases.md) against the real vLLM, and
with a mock upstream only where vLLM cannot produce the shape (named in each test)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from gateway_helpers import (
    WEATHER_TOOL,
    chat_response,
    emulated_gateway,
    gateway_with,
    sse_body,
    sse_chunks,
    steps_of,
)
from openai import OpenAI
from tests_support import free_port

from datapool.settings import PoolSettings
from datapool.steps.prefix import TOOL_ARGUMENTS_CHANGED
from gateway.server import BackgroundServer
from trajgate.vllm_server import VLLMServer

NAMED_TOOL_CHOICE = {"type": "function", "function": {"name": "get_weather"}}


def _post(url: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120, **kwargs)


def _tool_call_turn(gateway: BackgroundServer, trajectory_id: str) -> dict[str, Any]:
    """Call 1 of a tool loop: the model is made to call get_weather; returns its message."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": NAMED_TOOL_CHOICE,
        "max_tokens": 64,
        "temperature": 0,
        "seed": 3,
    }
    response = _post(f"{gateway.url}/t/{trajectory_id}/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    message: dict[str, Any] = response.json()["choices"][0]["message"]
    assert message["tool_calls"], message
    return message


def _tool_loop_messages(message: dict[str, Any], arguments: Any) -> list[dict[str, Any]]:
    call = message["tool_calls"][0]
    echoed = {
        "role": "assistant",
        "content": message.get("content") or "",
        "tool_calls": [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments},
            }
        ],
    }
    return [
        {"role": "user", "content": "Weather in Paris?"},
        echoed,
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
    ]


# -- token fidelity ----------------------------------------------------------------------


def test_c01_every_later_step_records_whether_it_extends_its_parent(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    message = _tool_call_turn(gateway, "c01")
    messages = _tool_loop_messages(message, message["tool_calls"][0]["function"]["arguments"])
    body = {
        "model": "tiny",
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "max_tokens": 8,
        "temperature": 0,
        "seed": 3,
    }
    assert _post(f"{gateway.url}/t/c01/v1/chat/completions", body).status_code == 200
    first, second = steps_of(pool_settings, "c01")
    assert second.parent_step_id == first.id
    sequence = [*first.prompt_token_ids, *first.response_token_ids]
    prompt = second.prompt_token_ids
    if second.extends_parent:
        assert prompt[: len(sequence)] == sequence
    else:
        # A break is data: where it happens, why, and both sides, never a dropped trajectory.
        offset = second.divergence_offset
        assert offset is not None and offset < len(sequence)
        assert prompt[:offset] == sequence[:offset]
        assert offset >= len(prompt) or prompt[offset] != sequence[offset]
        assert "prefix_break" in second.flags
        assert second.divergence_kind is not None
        detail = second.divergence_detail
        start = detail["window_start"]
        assert detail["parent_ids"] == sequence[start : start + len(detail["parent_ids"])]
        assert detail["prompt_ids"] == prompt[start : start + len(detail["prompt_ids"])]
    # The response ids are the engine's: never rebuilt from the returned text.
    assert len(second.response_token_ids) == len(second.response_logprobs) == 8


@pytest.fixture
def template_gateway(vllm: VLLMServer, pool_settings: PoolSettings) -> Iterator[BackgroundServer]:
    """A gateway whose calls the template renders whole (``continuation='template'``): the
    breaks below are what re-rendering does to a history; exact continuation keeps the turn's
    own ids instead (tests/test_exact_continuation.py)."""
    with gateway_with(
        pool_settings, free_port(), upstream_url=vllm.url, continuation="template"
    ) as server:
        yield server


def test_c02_thinking_dropped_from_history_is_a_prefix_break_of_its_own_kind(
    template_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    gateway = template_gateway  # a re-rendered history (exact mode heals it)
    # vLLM's structured outputs make the random tiny model answer "<think>...</think>answer".
    first_body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "structured_outputs": {"regex": "<think>[a-z]{2,6}</think>[a-z]{2,6}"},
        "max_tokens": 40,
        "temperature": 0,
    }
    first = _post(f"{gateway.url}/t/c02/v1/chat/completions", first_body).json()
    answer = first["choices"][0]["message"]["content"]
    assert answer.startswith("<think>") and "</think>" in answer
    second_body = {
        "model": "tiny",
        "messages": [
            *first_body["messages"],
            {"role": "assistant", "content": answer},  # sent back as generated
            {"role": "user", "content": "And then?"},
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    assert _post(f"{gateway.url}/t/c02/v1/chat/completions", second_body).status_code == 200
    step1, step2 = steps_of(pool_settings, "c02")
    # The template drops the earlier <think> block, so P_2 cannot contain R_1's reasoning.
    assert step2.extends_parent is False
    assert step2.divergence_kind == "thinking_stripped"
    # Each call stays trainable against its own exact prompt.
    assert step1.flags == ["constrained", "narrowed"] and step1.response_token_ids  # greedy
    assert step2.prompt_token_ids is not None and step2.response_token_ids


def test_c02_reasoning_dropped_after_a_plain_turn_is_a_break_from_the_latest_step(
    template_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    gateway = template_gateway  # a re-rendered history (exact mode heals it)
    # Turn 0 plain, turn 1 "<think>...</think>answer", turn 2 plain. The template drops turn 1's
    # reasoning, so P_2 leaves S_1 but still extends S_0: the parent is turn 0 (P_2 extends it),
    # and the step also says it diverges from turn 1, where, and why.
    url = f"{gateway.url}/t/c02h/v1/chat/completions"
    history: list[dict[str, Any]] = []
    for turn, regex in enumerate(["[a-z]{2,6}", "<think>[a-z]{2,6}</think>[a-z]{2,6}", None]):
        history.append({"role": "user", "content": f"Turn {turn}: answer briefly."})
        body: dict[str, Any] = {"model": "tiny", "messages": history, "max_tokens": 40}
        body["temperature"] = 0
        if regex is not None:
            body["structured_outputs"] = {"regex": regex}
        else:
            body["max_tokens"] = 4
        response = _post(url, body)
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        history = [*history, {"role": "assistant", "content": answer}]
    turn0, turn1, turn2 = steps_of(pool_settings, "c02h")
    assert "<think>" not in turn0.response_message["content"]
    assert "</think>" in turn1.response_message["content"]
    s0 = [*turn0.prompt_token_ids, *turn0.response_token_ids]
    s1 = [*turn1.prompt_token_ids, *turn1.response_token_ids]
    p2 = turn2.prompt_token_ids
    assert turn1.parent_step_id == turn0.id and turn1.extends_parent is True
    assert p2[: len(s0)] == s0 and p2[: len(s1)] != s1  # extends turn 0, leaves turn 1
    assert turn2.parent_step_id == turn0.id and turn2.extends_parent is True
    offset = turn2.divergence_offset
    assert p2[:offset] == s1[:offset] and p2[offset] != s1[offset]
    assert "prefix_break" in turn2.flags
    assert turn2.divergence_kind == "thinking_stripped"
    detail = turn2.divergence_detail
    assert detail["step_id"] == turn1.id and detail["offset"] == offset
    start = detail["window_start"]
    assert detail["parent_ids"] == s1[start : start + len(detail["parent_ids"])]


@pytest.mark.parametrize("tool_turns", [1, 2, 5])
def test_c03_stored_prompt_ids_are_the_templates_rendering_for_tool_turns(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, tool_turns: int
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in three cities?"}]
    for turn in range(tool_turns):
        call_id = f"call-{turn}"
        messages.append(
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"{turn} C"})
    body = {
        "model": "tiny",
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "max_tokens": 2,
        "temperature": 0,
    }
    trajectory = f"c03-{tool_turns}"
    assert _post(f"{gateway.url}/t/{trajectory}/v1/chat/completions", body).status_code == 200
    rendered = _post(
        f"{vllm.url}/tokenize", {"model": "tiny", "messages": messages, "tools": [WEATHER_TOOL]}
    ).json()["tokens"]
    (step,) = steps_of(pool_settings, trajectory)
    # The separators between turns come from the engine's own prompt, never spliced by us.
    assert step.prompt_token_ids == rendered


def test_c04_reserialised_tool_arguments_are_reported_and_returned_byte_for_byte(
    template_gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    gateway = template_gateway  # a re-rendered history (exact mode heals it)
    message = _tool_call_turn(gateway, "c04")
    generated = message["tool_calls"][0]["function"]["arguments"]
    compact = json.dumps(json.loads(generated), separators=(",", ":"))
    assert compact != generated  # the model wrote '{"city": "..."}' with a space
    body = {
        "model": "tiny",
        "messages": _tool_loop_messages(message, compact),
        "tools": [WEATHER_TOOL],
        "max_tokens": 4,
        "temperature": 0,
    }
    assert _post(f"{gateway.url}/t/c04/v1/chat/completions", body).status_code == 200
    first, second = steps_of(pool_settings, "c04")
    assert first.response_message["tool_calls"][0]["function"]["arguments"] == generated
    assert second.extends_parent is False
    assert second.divergence_kind == TOOL_ARGUMENTS_CHANGED


def test_c05_streamed_tool_call_ids_add_up_to_the_usage_count(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": NAMED_TOOL_CHOICE,
        "max_tokens": 64,
        "temperature": 0,
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = _post(f"{gateway.url}/t/c05/v1/chat/completions", body)
    chunks = sse_chunks(response.text)
    usage = chunks[-1]["usage"]
    (step,) = steps_of(pool_settings, "c05")
    assert len(step.response_token_ids) == len(step.response_logprobs)
    assert len(step.response_token_ids) == usage["completion_tokens"]
    assert "ids_incomplete" not in step.flags and "ids_missing" not in step.flags
    # The tool call reassembled from deltas is the one the client reassembles.
    client_args = "".join(
        call["function"].get("arguments") or ""
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls") or []
    )
    assert step.response_message["tool_calls"][0]["function"]["arguments"] == client_args
    assert json.loads(client_args)["city"] in {"Paris", "London", "Tokyo"}


def test_c05_a_chunk_without_ids_flags_the_step_incomplete_instead_of_shifting(
    pool_settings: PoolSettings,
) -> None:
    # Mock upstream: an older server that dropped token_ids on a parser-held chunk (vLLM 0.32
    # never does this, so only a recorded stream can show it).
    def chunk(
        delta: dict[str, Any], ids: list[int] | None, finish: str | None = None
    ) -> dict[str, Any]:
        return {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "tiny",
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": finish,
                    "logprobs": {"content": [{"token": "t", "logprob": -0.5}] * 1},
                    "token_ids": ids,
                }
            ],
        }

    stream = [
        {**chunk({"role": "assistant", "content": ""}, []), "prompt_token_ids": [1, 2]},
        chunk({}, [7]),
        chunk({"content": "x"}, None),  # ids dropped here
        chunk({"content": "y"}, [9], "stop"),
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "tiny",
            "choices": [],
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
        },
    ]
    transport = httpx.MockTransport(
        lambda request: httpx.Response(
            200, content=sse_body(stream), headers={"content-type": "text/event-stream"}
        )
    )
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        assert _post(f"{gw.url}/t/c05b/v1/chat/completions", body).status_code == 200
    (step,) = steps_of(pool_settings, "c05b")
    assert step.response_token_ids is None  # not [7, 9]: a gap is never closed up
    assert "ids_missing" in step.flags


def test_c07_null_ids_with_sampled_tokens_are_missing_not_empty(
    pool_settings: PoolSettings,
) -> None:
    # Mock upstream: a reasoning parser with include_reasoning false returns null ids (C07);
    # the tiny model has no reasoning parser configured.
    body_out = chat_response(None, None, completion_tokens=5)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body_out))
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        assert _post(f"{gw.url}/t/c07/v1/chat/completions", body).status_code == 200
    (step,) = steps_of(pool_settings, "c07")
    assert step.response_token_ids is None and step.response_logprobs is None
    assert "ids_missing" in step.flags


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_c08_tool_arguments_as_string_or_object_pass_through_untouched(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings, arguments: Any
) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = {"model": "tiny", "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 2}
    through = _post(f"{gateway.url}/t/c08/v1/chat/completions", body)
    direct = _post(f"{vllm.url}/v1/chat/completions", body)
    assert through.status_code == direct.status_code  # whatever vLLM decides, the client sees
    (step,) = steps_of(pool_settings, "c08")
    assert step.request["messages"][1]["tool_calls"][0]["function"]["arguments"] == arguments
    assert step.upstream_request["messages"] == messages  # forwarded without reformatting
    if direct.status_code != 200:
        assert step.outcome == "upstream_error" and step.error


def test_c09_assistant_prefill_is_prompt_and_only_the_continuation_is_response(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    messages = [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "Hello, my name"},
    ]
    body = {
        "model": "tiny",
        "messages": messages,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 5,
        "temperature": 0,
    }
    assert _post(f"{gateway.url}/t/c09/v1/chat/completions", body).status_code == 200
    rendered = _post(
        f"{vllm.url}/tokenize",
        {
            "model": "tiny",
            "messages": messages,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    ).json()["tokens"]
    (step,) = steps_of(pool_settings, "c09")
    assert step.prompt_token_ids == rendered  # the prefill tokens are prompt (loss mask 0)
    assert len(step.response_token_ids) == 5  # only the continuation is response
    assert "prefill" in step.flags
    assert step.upstream_request["continue_final_message"] is True


# -- proxy behaviour ---------------------------------------------------------------------


def test_c10_each_event_is_flushed_as_it_arrives(pool_settings: PoolSettings) -> None:
    from trajgate.bench.emulator import EmulatorSettings, EmulatorThread

    emulator = EmulatorThread(
        EmulatorSettings(
            port=free_port(), prompt_tokens=10, response_tokens=12, inter_token_ms=50.0
        )
    ).start()
    try:
        with gateway_with(pool_settings, free_port(), upstream_url=emulator.url) as gw:
            body = {
                "model": "emulated",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            }
            arrivals: list[float] = []
            with httpx.stream(
                "POST", f"{gw.url}/t/c10/v1/chat/completions", json=body, timeout=30
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.perf_counter())
    finally:
        emulator.stop()
    gaps_ms = [(b - a) * 1000 for a, b in itertools.pairwise(arrivals[1:])]
    # 12 tokens 50 ms apart: buffered delivery would show near-zero gaps and one long wait.
    assert len(gaps_ms) >= 9
    assert sorted(gaps_ms)[len(gaps_ms) // 2] > 25.0


def test_c11_client_disconnect_aborts_vllm_and_keeps_the_partial_step(
    vllm: VLLMServer, gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Write a lot."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{gateway.url}/t/c11/v1/chat/completions", json=body, timeout=60
    ) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 4:
                break  # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    steps = []
    while time.monotonic() < deadline and not steps:
        steps = steps_of(pool_settings, "c11")
        time.sleep(0.2)
    (step,) = steps
    assert step.finish_reason == "client_disconnect"
    assert step.outcome == "client_disconnect"
    assert "aborted" in step.flags
    assert step.response_token_ids is not None and 0 < len(step.response_token_ids) < 1500
    # vLLM aborted the request: nothing is running long before 1,500 tokens could be sampled.
    running = 1.0
    while time.monotonic() < deadline and running > 0:
        metrics = httpx.get(f"{vllm.url}/metrics", timeout=10).text
        running = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
        time.sleep(0.2)
    assert running == 0


def test_c12_slow_first_byte_gets_504_once_and_a_recorded_timeout(
    pool_settings: PoolSettings,
) -> None:
    limits = {"upstream_first_byte_timeout_s": 0.5, "upstream_total_timeout_s": 0.5}
    with emulated_gateway(
        pool_settings, gateway=limits, prompt_tokens=4, response_tokens=4, ttft_ms=3000
    ) as gw:
        body = {"model": "emulated", "messages": [{"role": "user", "content": "hi"}]}
        unary = _post(f"{gw.url}/t/c12/v1/chat/completions", body)
        streamed = _post(f"{gw.url}/t/c12s/v1/chat/completions", {**body, "stream": True})
    assert unary.status_code == 504 and streamed.status_code == 504
    assert unary.json()["error"]["type"] == "upstream_timeout"
    for trajectory in ("c12", "c12s"):
        (step,) = steps_of(pool_settings, trajectory)
        assert step.outcome == "upstream_timeout"
        assert step.response_token_ids is None


def test_c12_a_stall_between_chunks_ends_the_stream_with_an_error_and_keeps_the_tokens(
    pool_settings: PoolSettings,
) -> None:
    with emulated_gateway(
        pool_settings,
        gateway={"upstream_between_chunks_timeout_s": 0.2},
        prompt_tokens=4,
        response_tokens=50,
        inter_token_ms=400,
    ) as gw:
        body = {
            "model": "emulated",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
        }
        response = _post(f"{gw.url}/t/c12b/v1/chat/completions", body)
    assert response.status_code == 200  # headers went out with the first chunk
    assert sse_chunks(response.text)[-1]["error"]["type"] == "upstream_timeout"
    (step,) = steps_of(pool_settings, "c12b")
    assert step.finish_reason == "upstream_timeout"
    assert "aborted" in step.flags


def test_c12_an_exact_stream_keeps_the_silence_limit_between_chunks(
    pool_settings: PoolSettings,
) -> None:
    # An exact continuation's stream is vLLM's chat endpoint given the spliced prompt: the same
    # read timeout between chunks as any stream (its earlier path had none).
    with emulated_gateway(
        pool_settings,
        gateway={"upstream_between_chunks_timeout_s": 0.2},
        prompt_tokens=4,
        response_tokens=3,
        inter_token_ms=400,
        prompt_ids="messages",
    ) as gw:
        url = f"{gw.url}/t/c12x/v1/chat/completions"
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        first = _post(url, {"model": "emulated", "messages": messages, "max_tokens": 1})
        answer = first.json()["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go"}]
        response = _post(url, {"model": "emulated", "messages": messages, "stream": True})
    assert response.status_code == 200
    assert sse_chunks(response.text)[-1]["error"]["type"] == "upstream_timeout"
    _, step = steps_of(pool_settings, "c12x")
    assert step.continuation == "exact"
    assert step.finish_reason == "upstream_timeout" and "aborted" in step.flags


def test_c13_a_503_then_200_is_one_step_with_both_attempts(pool_settings: PoolSettings) -> None:
    # Mock upstream: vLLM does not answer 503 on demand.
    answers = iter(
        [
            httpx.Response(
                503,
                json={"error": {"message": "overloaded", "type": "x", "param": None, "code": 503}},
            ),
            httpx.Response(200, json=chat_response([5, 6], [-0.1, -0.2], completion_tokens=2)),
        ]
    )
    transport = httpx.MockTransport(
        lambda request: (
            next(answers)
            if request.url.path == "/v1/chat/completions"
            else httpx.Response(200 if request.url.path == "/health" else 404)
        )
    )
    with gateway_with(
        pool_settings, free_port(), transport=transport, upstream_retry_backoff_ms=1
    ) as gw:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        response = _post(f"{gw.url}/t/c13/v1/chat/completions", body)
    assert response.status_code == 200
    (step,) = steps_of(pool_settings, "c13")
    assert step.response_token_ids == [5, 6]
    attempts = _attempts(pool_settings, step.call_id)
    assert [(a["status_code"], a["outcome"]) for a in attempts] == [
        (503, "upstream_error"),
        (200, "ok"),
    ]


def test_c13_same_idempotency_key_is_replayed_not_sampled_again(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 6,
        "temperature": 1.0,
    }
    headers = {"Idempotency-Key": "agent-retry-1"}
    first = _post(f"{gateway.url}/t/c13k/v1/chat/completions", body, headers=headers)
    again = _post(f"{gateway.url}/t/c13k/v1/chat/completions", body, headers=headers)
    assert again.json() == first.json()
    assert again.headers["x-trajgate-replayed"] == "true"
    assert again.headers["x-trajgate-call-id"] == first.headers["x-trajgate-call-id"]
    # A client replays because it lost the first answer: the replay names the same steps (to
    # attach rewards to) and version; it named neither.
    for name in ("x-trajgate-step-id", "x-trajgate-policy-version"):
        assert again.headers[name] == first.headers[name], name
    assert len(steps_of(pool_settings, "c13k")) == 1
    # The same key with another question: refused, not answered with the first one's reply.
    other = {**body, "messages": [{"role": "user", "content": "Something else entirely?"}]}
    reused = _post(f"{gateway.url}/t/c13k/v1/chat/completions", other, headers=headers)
    assert reused.status_code == 422, reused.text
    error = reused.json()["error"]
    assert (error["code"], error["param"]) == ("idempotency_key_reused", "Idempotency-Key")
    assert len(steps_of(pool_settings, "c13k")) == 1
    # Over Messages too, in Anthropic's envelope; a new key is a new call.
    messages_body = {"model": "tiny", "max_tokens": 4, "messages": other["messages"]}
    url = f"{gateway.url}/t/c13m/v1/messages"
    assert _post(url, {**messages_body, "max_tokens": 3}, headers=headers).status_code == 200
    refused = _post(url, messages_body, headers=headers)
    assert refused.status_code == 422, refused.text
    assert refused.json()["type"] == "error"
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "idempotency_key_reused" in refused.json()["error"]["message"]
    fresh = _post(
        f"{gateway.url}/t/c13k/v1/chat/completions", other, headers={"Idempotency-Key": "2"}
    )
    assert fresh.status_code == 200 and "x-trajgate-replayed" not in fresh.headers
    assert len(steps_of(pool_settings, "c13k")) == 2


def test_an_over_long_idempotency_key_is_refused_up_front_on_both_backends(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    """The key is stored in a 200-character column: 201 characters are a 400 before vLLM is
    asked (PostgreSQL used to fail the commit with a 503 after sampling; SQLite stored it)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    refused = _post(
        f"{gateway.url}/t/longkey/v1/chat/completions",
        body,
        headers={"Idempotency-Key": "k" * 201},
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "Idempotency-Key"
    assert "200" in refused.json()["error"]["message"]
    assert steps_of(pool_settings, "longkey") == []
    # 200 characters fit, and replay as any key does.
    headers = {"Idempotency-Key": "k" * 200}
    first = _post(f"{gateway.url}/t/longkey/v1/chat/completions", body, headers=headers)
    again = _post(f"{gateway.url}/t/longkey/v1/chat/completions", body, headers=headers)
    assert first.status_code == again.status_code == 200, first.text
    assert again.headers["x-trajgate-replayed"] == "true"
    assert len(steps_of(pool_settings, "longkey")) == 1


def test_max_completion_tokens_on_completions_is_honoured_as_max_tokens(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    """vLLM's completions endpoint ignores ``max_completion_tokens`` (its default is 16
    tokens); the gateway sends it as ``max_tokens`` when that is absent, and records it."""
    body = {
        "model": "tiny",
        "prompt": "hi",
        "max_completion_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
    }
    answer = _post(f"{gateway.url}/t/mct/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 20  # not vLLM's default 16
    (step,) = steps_of(pool_settings, "mct")
    assert step.upstream_request is not None
    assert step.upstream_request["max_tokens"] == 20
    assert "max_completion_tokens" not in step.upstream_request
    # max_tokens, when sent, is the limit (both sent: max_tokens wins, as vLLM reads it).
    both = _post(f"{gateway.url}/t/mct2/v1/completions", {**body, "max_tokens": 3})
    assert both.json()["usage"]["completion_tokens"] == 3


def test_c13_identical_resend_is_linked_to_the_earlier_call(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    first = _post(f"{gateway.url}/t/c13r/v1/chat/completions", body)
    again = _post(f"{gateway.url}/t/c13r/v1/chat/completions", body)
    assert again.headers["x-trajgate-call-id"] == first.headers["x-trajgate-call-id"]
    steps = steps_of(pool_settings, "c13r")
    assert "resend" not in steps[0].flags and "resend" in steps[1].flags
    assert steps[0].call_id == steps[1].call_id
    # A fork at the same prompt, not a rewritten history: the re-send is the
    # first step's sibling (both roots here), and no prefix break is recorded or counted.
    assert "prefix_break" not in steps[1].flags
    assert steps[1].parent_step_id == steps[0].parent_step_id is None
    assert steps[1].extends_parent is steps[0].extends_parent is None
    assert steps[1].divergence_offset is None and steps[1].divergence_kind is None


def _attempts(pool_settings: PoolSettings, call_id: str | None) -> list[dict[str, Any]]:
    from sqlalchemy import select

    from datapool.db import make_engine
    from datapool.models import CallAttempt

    engine = make_engine(pool_settings.resolved_database_url())
    with engine.connect() as conn:
        rows = conn.execute(
            select(CallAttempt.status_code, CallAttempt.outcome)
            .where(CallAttempt.call_id == call_id)
            .order_by(CallAttempt.attempt_index)
        ).all()
    engine.dispose()
    return [{"status_code": r[0], "outcome": r[1]} for r in rows]


# -- C18 context overflow and truncation ---------------------------------------------------


def test_c18_context_overflow_is_a_failed_step_with_the_lengths(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 200_000,
    }  # prompt + 200,000 > --max-model-len 131072
    response = _post(f"{gateway.url}/t/c18/v1/chat/completions", body)
    assert response.status_code == 400
    (step,) = steps_of(pool_settings, "c18")
    assert step.outcome == "upstream_error"
    assert "131072" in step.error  # vLLM's message names the model length


def test_c18_a_streamed_tool_call_cut_at_max_tokens_keeps_its_ids_and_is_flagged(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": NAMED_TOOL_CHOICE,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    response = _post(f"{gateway.url}/t/c18t/v1/chat/completions", body)
    assert response.status_code == 200
    (step,) = steps_of(pool_settings, "c18t")
    assert step.finish_reason == "length"
    assert len(step.response_token_ids) == len(step.response_logprobs) == 6
    assert "truncated" in step.flags


# A hermes tool call the tiny model is held to by vLLM's structured outputs (tools offered,
# tool_choice auto, so the hermes parser reads it): 12 tokens end inside '{"name"', 30 after
# the name, 45 in the arguments; 100 tokens finish the call. Not WEATHER_TOOL: a strict tool
# gets vLLM's own grammar instead of the regex.
_LOOSE_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
_HERMES_CALL = (
    '<tool_call>\\n\\{"name": "get_weather", '
    '"arguments": \\{"city": "[a-z]{40}"\\}\\}\\n</tool_call>'
)


@pytest.mark.parametrize("max_tokens", [12, 30, 45])
def test_c18_a_tool_call_cut_at_max_tokens_is_flagged_alike_streamed_and_unary(
    gateway: BackgroundServer, pool_settings: PoolSettings, max_tokens: int
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [_LOOSE_WEATHER_TOOL],
        "structured_outputs": {"regex": _HERMES_CALL},
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    for stream in (False, True):
        response = _post(f"{gateway.url}/t/c18h/v1/chat/completions", {**body, "stream": stream})
        assert response.status_code == 200, response.text
    unary, streamed = steps_of(pool_settings, "c18h")
    # The unary text holds the unclosed "<tool_call>"; the stream's message never does (the
    # parser held it back), yet both were cut in the call and both say so.
    assert "<tool_call>" in unary.response_message["content"]
    assert "<tool_call>" not in (streamed.response_message.get("content") or "")
    assert unary.response_token_ids == streamed.response_token_ids  # greedy, same tokens
    for step in (unary, streamed):
        assert step.finish_reason == "length"
        assert "truncated" in step.flags and "tool_call_truncated" in step.flags


def test_c18_a_finished_tool_call_is_not_flagged_truncated_streamed_or_unary(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [_LOOSE_WEATHER_TOOL],
        "structured_outputs": {"regex": _HERMES_CALL},
        "max_tokens": 100,
        "temperature": 0,
    }
    for stream in (False, True):
        response = _post(f"{gateway.url}/t/c18f/v1/chat/completions", {**body, "stream": stream})
        assert response.status_code == 200, response.text
    for step in steps_of(pool_settings, "c18f"):
        assert step.finish_reason == "tool_calls"
        assert step.response_message["tool_calls"]
        assert "tool_call_truncated" not in step.flags


def test_concurrent_calls_of_one_trajectory_get_distinct_step_indices(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    client = OpenAI(base_url=f"{gateway.url}/t/conc/v1", api_key="unused")
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2
            )
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(step.step_index for step in steps_of(pool_settings, "conc")) == list(range(6))
