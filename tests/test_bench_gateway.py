"""The benchmark's emulated upstream answers in the real vLLM's shapes, and a tiny bench run in
each dialect reports every field, answers every call (streamed or not) and persists one step per
call. No timing is asserted."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests_support import free_port

from trajgate.bench.emulator import EmulatorSettings, EmulatorThread, ResponseBook
from trajgate.bench.gateway import (
    STREAM_ENDS,
    BenchDialect,
    BenchSettings,
    Caller,
    percentile,
    process_cpu_s,
    request_body,
    run_benchmark,
)
from trajgate.vllm_server import VLLMServer

MESSAGES = [{"role": "user", "content": "Count to three."}]
RUN_FIELDS = {
    "dialect",
    "direct_dialect",
    "stream",
    "concurrency",
    "direct_p50_ms",
    "direct_p99_ms",
    "gateway_p50_ms",
    "gateway_p99_ms",
    "added_p50_ms",
    "added_p99_ms",
    "added_first_byte_p50_ms",
    "throughput_ratio",
    "steps_persisted",
    "steps_expected",
}


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorThread]:
    settings = EmulatorSettings(port=free_port(), prompt_tokens=12, response_tokens=8, model="tiny")
    server = EmulatorThread(settings).start()
    yield server
    server.stop()


class _AnyItem:
    """The item of an empty list: equal to any item's structure. vLLM sends ``bytes: []`` for a
    token that is not valid UTF-8 alone (its ``token`` is ""), where the emulator's ids have
    bytes; the list is still a list of ints."""

    def __eq__(self, other: object) -> bool:
        return True

    def __repr__(self) -> str:
        return "any"


def structure(value: Any) -> Any:
    """Keys and JSON types of ``value``, lists by their first item (an empty one matches any):
    what must match vLLM."""
    if isinstance(value, dict):
        return {key: structure(item) for key, item in value.items()}
    if isinstance(value, list):
        return [structure(value[0]) if value else _AnyItem()]
    return type(value).__name__


def sse_events(body: str) -> list[Any]:
    """The JSON chunks of an SSE body, with ``"[DONE]"`` kept as the string it is."""
    events = [line[len("data: ") :] for line in body.split("\n") if line.startswith("data: ")]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


@pytest.mark.parametrize("ask", [False, True], ids=["ids-not-asked", "ids-and-logprobs-asked"])
def test_emulator_answers_non_streaming_in_vllms_shape(
    vllm: VLLMServer, emulator: EmulatorThread, ask: bool
) -> None:
    # max_tokens 3 < response_tokens 8, so both stop on "length".
    body: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3}
    if ask:
        body |= {"return_token_ids": True, "logprobs": True}
    real = httpx.post(f"{vllm.url}/v1/chat/completions", json=body, timeout=120).json()
    emulated = httpx.post(f"{emulator.url}/v1/chat/completions", json=body, timeout=10).json()

    assert structure(emulated) == structure(real)
    assert list(emulated) == list(real)  # same key order, as vLLM serialises it
    if ask:
        choice = emulated["choices"][0]
        # 3 sampled tokens: 3 ids, 3 logprobs, usage.completion_tokens 3; the prompt has 12 ids.
        assert len(choice["token_ids"]) == len(choice["logprobs"]["content"]) == 3
        assert emulated["usage"]["completion_tokens"] == 3
        assert len(emulated["prompt_token_ids"]) == emulated["usage"]["prompt_tokens"] == 12
    else:
        assert emulated["prompt_token_ids"] is None
        assert emulated["choices"][0]["token_ids"] is None
        assert emulated["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("ask", [False, True], ids=["ids-not-asked", "ids-and-logprobs-asked"])
def test_emulator_streams_chunks_in_vllms_shape(
    vllm: VLLMServer, emulator: EmulatorThread, ask: bool
) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "max_tokens": 3,
        # greedy: the tiny model never ends a turn greedily, so vLLM always streams 3 tokens
        # and ends on "length" (sampled, it can end early and the chunk shapes differ)
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ask:
        body |= {"return_token_ids": True, "logprobs": True}
    real_response = httpx.post(f"{vllm.url}/v1/chat/completions", json=body, timeout=120)
    emulated_response = httpx.post(f"{emulator.url}/v1/chat/completions", json=body, timeout=10)
    real, emulated = sse_events(real_response.text), sse_events(emulated_response.text)

    assert emulated_response.headers["content-type"] == real_response.headers["content-type"]
    assert real[-1] == emulated[-1] == "[DONE]"
    # role chunk, first token chunk, last token chunk (finish_reason), usage chunk (choices: [])
    for position in (0, 1, -3, -2):
        assert structure(emulated[position]) == structure(real[position]), position
    assert emulated[-2]["choices"] == [] and emulated[-2]["usage"]["completion_tokens"] == 3
    token_chunks = emulated[1:-2]
    assert len(token_chunks) == 3  # one chunk per sampled token
    if ask:
        assert len(emulated[0]["prompt_token_ids"]) == 12
        assert sum(len(c["choices"][0]["token_ids"]) for c in token_chunks) == 3
    else:
        assert emulated[0]["prompt_token_ids"] is None
        assert all(c["choices"][0]["token_ids"] is None for c in token_chunks)


def test_emulator_tokens_are_seeded_and_repeatable(emulator: EmulatorThread) -> None:
    body = {"messages": MESSAGES, "return_token_ids": True, "logprobs": True}
    url = f"{emulator.url}/v1/chat/completions"
    first, second = (httpx.post(url, json=body, timeout=10).json() for _ in range(2))
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    assert first["choices"][0]["logprobs"] == second["choices"][0]["logprobs"]
    assert first["prompt_token_ids"] == second["prompt_token_ids"]
    assert first["id"] != second["id"]
    # No max_tokens: the full response_tokens=8, finished by "stop".
    assert len(first["choices"][0]["token_ids"]) == 8
    assert first["choices"][0]["finish_reason"] == "stop"


def test_emulator_with_messages_prompts_extends_a_turn_that_carries_its_answer() -> None:
    """prompt_ids='messages': 3 ids per message that is not the emulator's own answer, the
    answer's own ids for one that is, each turn closed by the end token E; an answer that
    stopped ends on E (R_0 = [r, E], its text " t<r>"), so turn 1 = P_0 + R_0 + 3 ids of its
    new question + E, both streamed and not, and usage counts them (4 + 2 + 4 = 10 prompt
    tokens)."""
    settings = EmulatorSettings(
        port=free_port(), prompt_tokens=3, response_tokens=2, prompt_ids="messages"
    )
    server = EmulatorThread(settings).start()
    try:
        url = f"{server.url}/v1/chat/completions"
        ask = {"return_token_ids": True}
        turn0 = httpx.post(url, json={"messages": MESSAGES, **ask}, timeout=10).json()
        p0, r0 = turn0["prompt_token_ids"], turn0["choices"][0]["token_ids"]
        answer = turn0["choices"][0]["message"]
        history = [*MESSAGES, answer, {"role": "user", "content": "And to four?"}]
        turn1 = httpx.post(url, json={"messages": history, **ask}, timeout=10).json()
        stream = httpx.post(
            url,
            json={
                "messages": history,
                "stream": True,
                "stream_options": {"include_usage": True},
                **ask,
            },
            timeout=10,
        )
        events = sse_events(stream.text)
        rewritten = [*MESSAGES, {"role": "assistant", "content": "three"}, history[-1]]
        turn1_rewritten = httpx.post(url, json={"messages": rewritten, **ask}, timeout=10).json()
    finally:
        server.stop()
    end = settings.vocab_size  # E: one past the sampled ids
    assert len(p0) == 4 and p0[-1] == end and turn0["usage"]["prompt_tokens"] == 4
    assert len(r0) == 2 and r0[1] == end and end not in r0[:1]
    assert answer["content"] == f" t{r0[0]}"  # the stop token is no text
    p1 = turn1["prompt_token_ids"]
    assert len(p1) == 10 and p1[:6] == [*p0, *r0] and p1[-1] == end
    assert turn1["usage"] == {**turn1["usage"], "prompt_tokens": 10, "total_tokens": 12}
    assert events[0]["prompt_token_ids"] == p1 and events[-2]["usage"]["prompt_tokens"] == 10
    # "three" is not the emulator's answer: 3 ids of its own (4 + 4 + 4 = 12), not R_0.
    p1_rewritten = turn1_rewritten["prompt_token_ids"]
    assert len(p1_rewritten) == 12 and p1_rewritten[:4] == p0 and p1_rewritten[8:] == p1[6:]
    assert p1_rewritten[4:6] != r0


def _burn_cpu(seconds: float) -> None:
    started = time.thread_time()
    while time.thread_time() - started < seconds:
        pass


def test_process_cpu_is_read_finer_than_a_clock_tick() -> None:
    """2 ms of CPU shows in a process's and a thread's reading: /proc's stat counts 10 ms
    ticks, in which a few short calls can read as no CPU at all (a bench run once reported
    0.0 ms of gateway CPU per call)."""
    pid, thread = os.getpid(), threading.get_native_id()
    for _ in range(5):
        before = process_cpu_s(pid), process_cpu_s(pid, thread)
        _burn_cpu(0.002)
        after = process_cpu_s(pid), process_cpu_s(pid, thread)
        assert None not in before + after
        assert all(0 < b - a < 1.0 for a, b in zip(before, after, strict=True))  # type: ignore[operator]
    assert process_cpu_s(None) is None


def test_percentile_takes_the_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    # rank ceil(100 * 50 / 100) = 50 -> 50.0; ceil(100 * 99 / 100) = 99 -> 99.0
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([7.0], 99) == 7.0


def test_request_body_is_the_same_request_in_each_dialect() -> None:
    settings = BenchSettings(prompt_tokens=3, response_tokens=7)
    words = "w0 w1 w2"  # prompt_tokens=3 words, w<i % 997>
    common = {"model": "emulated", "temperature": 1.0, "stream": True}
    assert request_body(settings, "chat", True) == {
        **common,
        "messages": [
            {"role": "system", "content": "You are a benchmark."},
            {"role": "user", "content": words},
        ],
        "max_tokens": 7,
    }
    assert request_body(settings, "responses", True) == {
        **common,
        "instructions": "You are a benchmark.",
        "input": words,
        "max_output_tokens": 7,
    }
    assert request_body(settings, "messages", True) == {
        **common,
        "system": "You are a benchmark.",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": 7,
    }
    with pytest.raises(ValueError, match="dialect must be one of"):
        request_body(settings, "completions", True)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dialect", "last_event", "answered"),
    [
        ("chat", "data: [DONE]", True),
        ("chat", 'data: {"choices":[]}', False),
        ("responses", 'event: response.completed\ndata: {"type":"response.completed"}', True),
        ("responses", 'event: response.failed\ndata: {"type":"response.failed"}', False),
        ("messages", 'event: message_stop\ndata: {"type":"message_stop"}', True),
        ("messages", 'event: error\ndata: {"type":"error"}', False),
    ],
)
def test_a_stream_counts_as_answered_only_when_it_ends_with_its_dialects_last_event(
    dialect: BenchDialect, last_event: str, answered: bool
) -> None:
    def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=f"event: ping\ndata: {{}}\n\n{last_event}\n\n")

    async def call() -> str | None:
        caller = Caller("http://gateway.test", "httpx", STREAM_ENDS[dialect])
        assert caller.client is not None
        await caller.client.aclose()
        caller.client = httpx.AsyncClient(transport=httpx.MockTransport(upstream))
        try:
            return await caller.call("/v1/x", b"{}", stream=True)
        finally:
            await caller.close()

    error = asyncio.run(call())
    assert (error is None) is answered, error


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_tiny_bench_run_answers_every_call_and_persists_one_step_per_call(
    dialect: BenchDialect,
) -> None:
    settings = BenchSettings(
        dialect=dialect,
        requests=6,
        warmup_requests=2,
        concurrencies=(1, 3),
        streams=(False, True),
        prompt_tokens=40,
        response_tokens=5,
        ttft_ms=0.0,
        inter_token_ms=0.0,
    )
    report = run_benchmark(settings)

    assert report["dialect"] == dialect
    assert [(run["stream"], run["concurrency"]) for run in report["runs"]] == [
        (False, 1),
        (False, 3),
        (True, 1),
        (True, 3),
    ]
    # Each run sends requests=6 measured calls of one choice each through the gateway, and every
    # one is answered (streamed or not): 6 steps expected, 6 in the pool. The warm-up calls
    # (max(2, concurrency) per run) go to "-w" trajectories, which are not counted.
    for run in report["runs"]:
        assert set(run) >= RUN_FIELDS, RUN_FIELDS - set(run)
        # The emulator speaks chat only: the direct run is chat whatever the gateway is sent.
        assert (run["dialect"], run["direct_dialect"]) == (dialect, "chat")
        assert run["direct_errors"] == 0, run.get("direct_error")
        assert run["errors"] == 0, run.get("error")
        assert run["steps_expected"] == 6
        assert run["steps_persisted"] == 6
    assert report["goals_met"]["every_step_persisted"] is True


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_emulator_serves_render_generate_and_derender_so_the_gateway_continues_exactly(
    pool_settings: Any, stream: bool
) -> None:
    """With prompt_ids='messages' the emulator answers vLLM's scale-out endpoints: the gateway
    probes them, finds the end token E, and three turns that echo its answers are one token
    sequence: each answer stopped on E (S_parent ends with it), every later prompt S_parent +
    the template's ids of the new user turn (4 = 3 ids + E), and each answer is the emulator's
    own text for the sampled ids."""
    from gateway_helpers import emulated_gateway, steps_of

    emulator = {"prompt_tokens": 3, "response_tokens": 2, "prompt_ids": "messages"}
    messages: list[Any] = [{"role": "user", "content": "Count to three."}]
    with emulated_gateway(pool_settings, **emulator) as server:
        url = f"{server.url}/t/emulated-exact/v1/chat/completions"
        for turn in range(3):
            body = {"model": "emulated", "messages": messages, "stream": stream}
            answer = httpx.post(url, json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            if stream:
                chunks = [e for e in sse_events(answer.text) if e != "[DONE]"]
                text = "".join(
                    c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
                )
            else:
                text = answer.json()["choices"][0]["message"]["content"]
            assert text.startswith(" t")
            messages = [
                *messages,
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"And {turn}?"},
            ]
    steps = steps_of(pool_settings, "emulated-exact")
    assert [s.continuation for s in steps] == ["template", "exact", "exact"]
    for parent, step in itertools.pairwise(steps):
        sequence = [*parent.prompt_token_ids, *parent.response_token_ids]
        assert sequence[-1] == 2048 and step.prompt_token_ids[: len(sequence)] == sequence  # E = V
        assert step.suffix_tokens == 4 and len(step.prompt_token_ids) == len(sequence) + 4
        assert step.extends_parent and "prefix_break" not in step.flags


def test_a_restarted_gateway_finds_the_turn_it_continues_in_the_pool(pool_settings: Any) -> None:
    """The turn memory goes with the gateway's process: a second gateway on the same pool
    continues the first one's turn exactly, found by its key (steps.turn_key)."""
    from gateway_helpers import emulated_gateway, steps_of

    emulator = {"prompt_tokens": 3, "response_tokens": 2, "prompt_ids": "messages"}
    messages: list[Any] = [{"role": "user", "content": "Count to three."}]
    for turn in range(2):
        with emulated_gateway(pool_settings, **emulator) as server:
            url = f"{server.url}/t/restarted/v1/chat/completions"
            answer = httpx.post(url, json={"model": "emulated", "messages": messages}, timeout=30)
            assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        messages = [
            *messages,
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"And {turn}?"},
        ]
    first, second = steps_of(pool_settings, "restarted")
    assert first.turn_key is not None and len(first.turn_key) == 64
    assert (second.continuation, second.suffix_tokens) == ("exact", 4)
    assert second.parent_step_id == first.id and second.extends_parent


def test_bench_compares_exact_and_template_continuation_side_by_side() -> None:
    """--continuation exact --continuation template: one gateway, a channel per mode, 4-turn
    conversations; 6 measured calls per mode = 1.5 trajectories of S = 4 turns, whose turns
    1..3 are exact in exact mode: the first trajectory's 3 and the second's 1 (turns 0, 1) = 4
    exact steps, none in template mode; every step persisted, and the comparison reported."""
    settings = BenchSettings(
        requests=6,
        warmup_requests=1,
        concurrencies=(1,),
        streams=(False, True),
        prompt_tokens=20,
        response_tokens=5,
        ttft_ms=0.0,
        inter_token_ms=0.0,
        steps_per_trajectory=4,
        continuations=("exact", "template"),
    )
    report = run_benchmark(settings)
    assert report["continuations"] == ["exact", "template"]
    for run in report["runs"]:
        modes = run["continuation"]
        assert set(modes) == {"exact", "template"}
        for mode, measured in modes.items():
            assert measured["errors"] == 0, measured.get("error")
            assert measured["steps_persisted"] == measured["steps_expected"] == 6
            assert measured["exact_steps"] == (4 if mode == "exact" else 0)
        compared = run["exact_over_template"]
        assert "gateway_cpu_per_call_ratio" in compared
        assert ("added_first_byte_ms" in compared) == run["stream"]
    assert report["goals_met"]["every_step_persisted"] is True
    assert "exact_cpu_ratio" in report["goals_met"]


def test_bench_layers_measures_own_and_library_gateways_side_by_side() -> None:
    """--layers: a second gateway on httpx's transport and uvicorn's h11, the two sent their
    calls in alternating rounds; 6 measured calls each, every one answered and persisted in
    its own gateway's pool, and each gateway's CPU per call reported."""
    settings = BenchSettings(
        requests=6,
        warmup_requests=1,
        concurrencies=(2,),
        streams=(False, True),
        prompt_tokens=20,
        response_tokens=5,
        ttft_ms=0.0,
        inter_token_ms=0.0,
        layers=True,
        library_protocol="h11",
    )
    report = run_benchmark(settings)
    for run in report["runs"]:
        library = run["layers"]["library"]
        assert (library["upstream_transport"], library["http_protocol"]) == ("httpx", "h11")
        assert run["errors"] == library["errors"] == 0, library.get("error")
        assert run["steps_persisted"] == run["steps_expected"] == 6
        assert library["steps_persisted"] == library["steps_expected"] == 6
        assert run["layers"]["own_gateway_cpu_ms_per_call"] > 0
        assert run["layers"]["library_gateway_cpu_ms_per_call"] > 0


def test_bench_layers_needs_a_gateway_process_and_single_turn_calls() -> None:
    with pytest.raises(ValueError, match="layers needs gateway_mode 'process'"):
        BenchSettings(layers=True, gateway_mode="thread")
    with pytest.raises(ValueError, match="drop continuations or layers"):
        BenchSettings(layers=True, continuations=("exact",))


def test_emulator_chat_answer_and_its_derendered_generate_answer_are_one_text() -> None:
    """An answer that stopped ends on the end token E, which is no text: the chat answer's
    text, the text derender gives for generate's ids without E (what the gateway sends it,
    ``engine._as_detokenized``) and the bench's echo (``emulator_answer``) are the same 3
    words for the 4 sampled ids, and the echo renders back to exactly those 4 ids (+ nothing:
    E closes the turn), so a bench turn continues the previous one exactly. Before, the chat
    answer had 4 words and the derendered one 3."""
    from trajgate.bench.continuation import emulator_answer

    settings = EmulatorSettings(
        port=free_port(), prompt_tokens=3, response_tokens=4, prompt_ids="messages"
    )
    server = EmulatorThread(settings).start()
    try:
        chat = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"messages": MESSAGES, "return_token_ids": True},
            timeout=10,
        ).json()
        rendered = httpx.post(
            f"{server.url}/v1/chat/completions/render", json={"messages": MESSAGES}, timeout=10
        ).json()
        generated = httpx.post(
            f"{server.url}/inference/v1/generate", json=rendered, timeout=10
        ).json()
        sampled = generated["choices"][0]["token_ids"]
        cut = {**generated["choices"][0], "token_ids": sampled[:-1]}
        derendered = httpx.post(
            f"{server.url}/v1/chat/completions/derender",
            json={"generate_response": {**generated, "choices": [cut]}},
            timeout=10,
        ).json()
    finally:
        server.stop()
    end = settings.vocab_size
    ids = chat["choices"][0]["token_ids"]
    assert ids == sampled and len(ids) == 4 and ids[-1] == end
    text = "".join(f" t{i}" for i in ids[:3])
    assert chat["choices"][0]["message"]["content"] == text
    assert derendered["choices"][0]["message"]["content"] == text
    assert emulator_answer(4) == text
    echo = {"messages": [{"role": "assistant", "content": text}]}
    assert ResponseBook(settings).prompt_of(echo) == ids
