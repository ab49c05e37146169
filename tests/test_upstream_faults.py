"""A replica that answers 200 but breaks the answer: events or bodies the capture cannot read,
answers past the size limits, and HTTP protocol errors.

vLLM never sends any of these, so the upstream is scripted: ``httpx.MockTransport`` where the
answer is well-framed HTTP, a raw socket server where the framing itself is broken. Every case
must end the same way: the client gets the dialect's error (an error event ending the stream,
or a 502), and the call is one step with outcome ``upstream_error``, flagged, never trained on.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_with, sse_body, steps_of
from tests_support import free_port

from datapool.curation import readiness
from datapool.db import make_engine
from datapool.lifecycle import transitions as lifecycle
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.settings import GatewaySettings
from trajgate.bench.raw_upstream import RawUpstream

# One body per dialect; all three are chat completions upstream.
DIALECT_CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    ),
    "responses": ("responses", {"model": "tiny", "input": "hi"}),
    "messages": (
        "messages",
        {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    ),
}


def _choice_event(fields: bytes, index: bytes = b"0") -> bytes:
    """A chat chunk (or, answered whole, an answer) of one choice with ``fields``."""
    return (
        b'{"id": "c", "object": "chat.completion.chunk", "model": "tiny", "choices": [{"index": '
        + index
        + b', "delta": {"content": "x"}, "message": {"role": "assistant", "content": "x"}, '
        + fields
        + b', "logprobs": null, "finish_reason": null}]}'
    )


def _wrong_kind(
    choice: dict[str, Any] | None = None,
    message: dict[str, Any] | None = None,
    top: dict[str, Any] | None = None,
) -> bytes:
    """A chat chunk (or, answered whole, an answer) of one choice, with one sampled token (6),
    every field of the right kind but those given: none of it may be captured or relayed."""
    message_fields = {"role": "assistant", "content": "x", **(message or {})}
    choice_fields = {
        "index": 0,
        "delta": message_fields,
        "message": message_fields,
        "token_ids": [6],
        "logprobs": {"content": [{"token": "x", "logprob": -0.5}]},
        "finish_reason": None,
        **(choice or {}),
    }
    answer = {"id": "c", "object": "chat.completion.chunk", "model": "tiny", **(top or {})}
    return json.dumps({**answer, "choices": [choice_fields]}).encode()


# Events (and bodies) the capture cannot read, as the replica would send them.
UNREADABLE: dict[str, bytes] = {
    "not_json": b"this is not json",
    "not_utf8": b'{"id": "c", "choices": [], "x": "\xff\xfe"}',
    "not_an_object": b"[1, 2, 3]",
    "choices_not_a_list": b'{"id": "c", "object": "chat.completion.chunk", "choices": 5}',
    # ids that are no token ids: stored, they would be tokens the policy never sampled
    # (booleans read as 1 and 0; a negative id), or lose the step at the pool's int32 payloads
    "token_ids_bool": _choice_event(b'"token_ids": [true, false]'),
    "token_ids_negative": _choice_event(b'"token_ids": [-3]'),
    "token_ids_not_ints": _choice_event(b'"token_ids": ["a"]'),
    "token_ids_past_int32": _choice_event(b'"token_ids": [2147483648]'),
    "choice_index_out_of_range": _choice_event(b'"token_ids": [7]', index=b"-1"),
    # a field of the wrong kind: main cut the stream with no error event and lost the step
    # (a number joined into the content), stored finish_reason 5 as '5' in an ok step, and
    # gave a Messages client content 5 as text
    "content_a_number": _wrong_kind(message={"content": 5}),
    "role_a_number": _wrong_kind(message={"role": 5}),
    "reasoning_a_list": _wrong_kind(message={"reasoning": ["x"]}),
    "tool_call_arguments_an_object": _wrong_kind(
        message={
            "tool_calls": [
                {"id": "t", "type": "function", "index": 0, "function": {"arguments": {}}}
            ]
        }
    ),
    "finish_reason_a_number": _wrong_kind(choice={"finish_reason": 5}),
    "stop_reason_a_list": _wrong_kind(choice={"stop_reason": [1]}),
    "logprob_a_string": _wrong_kind(
        choice={"logprobs": {"content": [{"token": "x", "logprob": "-0.5"}]}}
    ),
    "usage_tokens_a_string": _wrong_kind(top={"usage": {"prompt_tokens": "2"}}),
    "model_a_number": _wrong_kind(top={"model": 5}),
}
# A whole answer must hold at least one choice (a stream's usage chunk legitimately holds none):
# a 200 without one was answered 200 with no step at all.
UNREADABLE_ANSWERS: dict[str, bytes] = {
    **UNREADABLE,
    "no_choices": b'{"id": "c", "object": "chat.completion", "model": "tiny"}',
    "empty_choices": b'{"id": "c", "object": "chat.completion", "choices": []}',
}


def chunk(ids: list[int], content: str, finish: str | None = None) -> dict[str, Any]:
    """One chat completion chunk in vLLM 0.32's shape, with ``token_ids`` and logprobs."""
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {"content": content},
                "finish_reason": finish,
                "logprobs": {"content": [{"token": "t", "logprob": -0.5} for _ in ids]},
                "token_ids": ids,
            }
        ],
    }


def broken_stream(bad_event: bytes) -> bytes:
    """A role chunk, one token, ``bad_event``, then two more tokens, usage and [DONE]: the
    gateway must stop at the bad event (1 of the 3 tokens captured)."""
    role = {**chunk([], ""), "prompt_token_ids": [1, 2]}
    role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    head = sse_body([role, chunk([7], "a")]).removesuffix(b"data: [DONE]\n\n")
    usage = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
    }
    tail = sse_body([chunk([8], "b"), chunk([9], "c", "stop"), usage])
    return head + b"data: " + bad_event + b"\n\n" + tail


def answering(content: bytes, content_type: str) -> httpx.MockTransport:
    """A replica that answers every chat call with ``content`` (200) and is healthy."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, content=content, headers={"content-type": content_type})
        return httpx.Response(200 if request.url.path == "/health" else 404)

    return httpx.MockTransport(handle)


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event of an SSE body, in order."""
    events = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
        if data is not None:
            events.append((name, data))
    return events


def assert_ends_in_error_event(dialect: str, text: str) -> None:
    """The stream's last event is the dialect's error event, and no normal end was sent."""
    events = sse_events(text)
    assert events, "the stream sent nothing"
    name, data = events[-1]
    assert all(data != "[DONE]" for _, data in events)
    if dialect == "chat":
        assert json.loads(data)["error"]["code"] == "upstream_error"
    elif dialect == "responses":
        assert name == "response.failed"
        error = json.loads(data)["response"]["error"]  # the SDK's fixed code, ours leads
        assert (error["code"], error["message"].split(":")[0]) == ("server_error", "upstream_error")
        assert all(n != "response.completed" for n, _ in events)
    elif dialect == "messages":
        assert name == "error"
        assert json.loads(data)["error"]["type"] == "api_error"
        assert all(n != "message_stop" for n, _ in events)
    else:
        raise AssertionError(f"unknown dialect {dialect!r}: chat, responses or messages")


def assert_failed_and_never_trained(pool_settings: PoolSettings, trajectory_id: str) -> None:
    """One step, ``upstream_error``, flagged; its trajectory, closed complete with a reward, is
    not ready for batches (its only step is excluded)."""
    (step,) = steps_of(pool_settings, trajectory_id)
    assert step.outcome == "upstream_error"
    assert step.flags, "an upstream_error step carries a flag"
    assert_never_ready(pool_settings, trajectory_id, step.id)


def assert_never_ready(pool_settings: PoolSettings, trajectory_id: str, step_id: str) -> None:
    """Closed complete with a reward, the trajectory is not ready: ``step_id`` is excluded."""
    engine = make_engine(pool_settings.resolved_database_url())
    try:
        store = PoolStore(engine, pool_settings)
        lifecycle.close_trajectory(
            store.sessions, trajectory_id, TrajectoryStatus.COMPLETE, final_reward=1.0
        )
        verdict = readiness.trajectory_readiness(store.sessions, trajectory_id, ["final"])
    finally:
        engine.dispose()
    assert not verdict.ready
    assert step_id in verdict.excluded_steps


@pytest.mark.parametrize("fault", sorted(UNREADABLE))
@pytest.mark.parametrize("dialect", sorted(DIALECT_CALLS))
def test_an_unreadable_event_mid_stream_ends_it_in_error_and_records_upstream_error(
    pool_settings: PoolSettings, dialect: str, fault: str
) -> None:
    path, body = DIALECT_CALLS[dialect]
    transport = answering(broken_stream(UNREADABLE[fault]), "text/event-stream")
    trajectory_id = f"bad-event-{dialect}-{fault}".replace("_", "-")
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        response = httpx.post(
            f"{gw.url}/t/{trajectory_id}/v1/{path}", json={**body, "stream": True}, timeout=30
        )
    assert response.status_code == 200  # the status line went out with the first event
    assert_ends_in_error_event(dialect, response.text)
    (step,) = steps_of(pool_settings, trajectory_id)
    assert step.response_token_ids == [7]  # what came before the bad event, kept for inspection
    assert step.finish_reason == "upstream_error"
    assert "aborted" in step.flags
    assert_failed_and_never_trained(pool_settings, trajectory_id)


@pytest.mark.parametrize("fault", sorted(UNREADABLE_ANSWERS))
@pytest.mark.parametrize("dialect", sorted(DIALECT_CALLS))
def test_an_unreadable_unary_answer_is_502_and_records_upstream_error(
    pool_settings: PoolSettings, dialect: str, fault: str
) -> None:
    path, body = DIALECT_CALLS[dialect]
    transport = answering(UNREADABLE_ANSWERS[fault], "application/json")
    trajectory_id = f"bad-body-{dialect}-{fault}".replace("_", "-")
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        response = httpx.post(f"{gw.url}/t/{trajectory_id}/v1/{path}", json=body, timeout=30)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == ("api_error" if dialect == "messages" else "upstream_error")
    assert_failed_and_never_trained(pool_settings, trajectory_id)


def raw_gateway_call(
    pool_settings: PoolSettings,
    answer: Callable[[], Iterator[bytes]],
    trajectory_id: str,
    *,
    stream: bool,
    **settings: Any,
) -> httpx.Response:
    """One chat call through a gateway in front of a ``RawUpstream`` sending ``answer``."""
    replica = RawUpstream(answer)
    path, body = DIALECT_CALLS["chat"]
    try:
        with gateway_with(
            pool_settings,
            free_port(),
            upstream_url=replica.url,
            upstream_max_attempts=1,
            **settings,
        ) as gw:
            response = httpx.post(
                f"{gw.url}/t/{trajectory_id}/v1/{path}", json={**body, "stream": stream}, timeout=60
            )
    finally:
        replica.close()
    return response


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunked_piece(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# Answers from a reachable replica that break HTTP/1.1 (item 9), each at the head or in the body.
PROTOCOL_ERRORS: dict[str, bytes] = {
    "bad_status_line": b"HTTP/1.1 OK 200\r\ncontent-length: 2\r\n\r\n{}",
    "head_too_large": b"HTTP/1.1 200 OK\r\nx-filler: " + b"x" * 70_000 + b"\r\n\r\n",
    "bad_chunk_size": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("fault", sorted(PROTOCOL_ERRORS))
def test_a_protocol_error_of_a_reachable_replica_is_upstream_error_unary_and_streamed(
    pool_settings: PoolSettings, fault: str, stream: bool
) -> None:
    trajectory_id = f"protocol-{fault}-{stream}".replace("_", "-").lower()
    response = raw_gateway_call(
        pool_settings, lambda: iter([PROTOCOL_ERRORS[fault]]), trajectory_id, stream=stream
    )
    # nothing reached the client before the fault: a 502 in both modes
    assert response.status_code == 502
    assert response.json()["error"]["code"] == "upstream_error"
    (step,) = steps_of(pool_settings, trajectory_id)
    assert step.outcome == "upstream_error"  # not upstream_unreachable: the replica answered


def test_a_protocol_error_mid_stream_is_upstream_error(pool_settings: PoolSettings) -> None:
    role = {**chunk([], ""), "prompt_token_ids": [1, 2]}
    first = sse_body([role, chunk([7], "a")]).removesuffix(b"data: [DONE]\n\n")

    def answer() -> Iterator[bytes]:
        yield SSE_HEAD + chunked_piece(first)
        time.sleep(0.3)  # a read of its own: the first events reach the client before the fault
        yield b"zz\r\n"

    response = raw_gateway_call(pool_settings, answer, "protocol-mid", stream=True)
    assert response.status_code == 200
    assert_ends_in_error_event("chat", response.text)
    (step,) = steps_of(pool_settings, "protocol-mid")
    assert (step.outcome, step.response_token_ids) == ("upstream_error", [7])


MIB = 1024 * 1024


def endless_chunked() -> Iterator[bytes]:
    """A stream of valid one-token events that never ends (64 KiB per write)."""
    yield SSE_HEAD + chunked_piece(
        sse_body([{**chunk([], ""), "prompt_token_ids": [1, 2]}]).removesuffix(b"data: [DONE]\n\n")
    )
    event = sse_body([chunk([7], "a")]).removesuffix(b"data: [DONE]\n\n")
    piece = chunked_piece(event * (65536 // len(event)))
    while True:
        yield piece


def one_endless_line() -> Iterator[bytes]:
    """A stream whose second event is one line that never ends."""
    yield SSE_HEAD + chunked_piece(
        sse_body([{**chunk([], ""), "prompt_token_ids": [1, 2]}]).removesuffix(b"data: [DONE]\n\n")
    )
    yield chunked_piece(b'data: {"id": "c", "x": "')
    piece = chunked_piece(b"x" * 65536)
    while True:
        yield piece


def unary_body(declared: bool) -> Callable[[], Iterator[bytes]]:
    """A unary 200 of 8 MiB, with its length declared or sent until close."""

    def answer() -> Iterator[bytes]:
        length = b"content-length: %d\r\n" % (8 * MIB) if declared else b""
        yield b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + length + b"\r\n"
        yield b'{"id": "' + b"x" * (8 * MIB - 10) + b'"}'

    return answer


@pytest.mark.parametrize(
    ("answer", "stream"),
    [
        (unary_body(declared=True), False),
        (unary_body(declared=False), False),
        (endless_chunked, True),
    ],
    ids=["unary_declared", "unary_until_close", "endless_stream"],
)
def test_an_answer_past_upstream_max_answer_bytes_is_upstream_error(
    pool_settings: PoolSettings, answer: Callable[[], Iterator[bytes]], stream: bool
) -> None:
    trajectory_id = f"too-long-{stream}-{answer.__name__}".replace("_", "-").lower()
    response = raw_gateway_call(
        pool_settings, answer, trajectory_id, stream=stream, upstream_max_answer_bytes=2 * MIB
    )
    if stream:  # the first events went out: the stream ends in its error event
        assert response.status_code == 200
        assert_ends_in_error_event("chat", response.text)
        assert "upstream_max_answer_bytes" in response.text
    else:
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_error"
    (step,) = steps_of(pool_settings, trajectory_id)
    assert step.outcome == "upstream_error" and step.flags
    assert "upstream_max_answer_bytes" in (step.error or "")


def test_an_event_past_upstream_max_event_bytes_is_upstream_error(
    pool_settings: PoolSettings,
) -> None:
    response = raw_gateway_call(
        pool_settings,
        one_endless_line,
        "too-long-event",
        stream=True,
        upstream_max_event_bytes=1 * MIB,
    )
    assert response.status_code == 200
    assert_ends_in_error_event("chat", response.text)
    assert "upstream_max_event_bytes" in response.text
    (step,) = steps_of(pool_settings, "too-long-event")
    assert step.outcome == "upstream_error" and "aborted" in step.flags


def test_answer_limits_must_be_positive() -> None:
    for name in ("upstream_max_answer_bytes", "upstream_max_event_bytes"):
        with pytest.raises(ValueError, match=name):
            GatewaySettings(**{name: 0})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("dialect", sorted(DIALECT_CALLS))
def test_an_answer_without_a_finish_reason_is_flagged_unfinished_and_never_trained(
    pool_settings: PoolSettings, dialect: str, stream: bool
) -> None:
    # A stream that ends early (two tokens, no finish_reason; [DONE] or not) and a unary
    # finish_reason null: the tokens may be a prefix of the sample, so never ok for training.
    if stream:
        role = {**chunk([], ""), "prompt_token_ids": [1, 2]}
        role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        content = sse_body([role, chunk([7], "a"), chunk([8], "b")])
        transport = answering(content, "text/event-stream")
    else:
        answer = {
            "id": "c",
            "object": "chat.completion",
            "model": "tiny",
            "prompt_token_ids": [1, 2],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ab"},
                    "token_ids": [7, 8],
                    "logprobs": {"content": [{"token": "a", "logprob": -0.5}] * 2},
                    "finish_reason": None,
                }
            ],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
        }
        transport = answering(json.dumps(answer).encode(), "application/json")
    path, body = DIALECT_CALLS[dialect]
    trajectory_id = f"unfinished-{dialect}-{stream}".lower()
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        httpx.post(
            f"{gw.url}/t/{trajectory_id}/v1/{path}", json={**body, "stream": stream}, timeout=30
        )
    (step,) = steps_of(pool_settings, trajectory_id)
    assert step.response_token_ids == [7, 8]  # what the engine sent is kept, never padded
    assert "unfinished" in step.flags
    assert_never_ready(pool_settings, trajectory_id, step.id)


def vllm_error_mid_stream() -> bytes:
    """A role chunk, one token, then what vLLM's chat stream generator sends when the engine
    fails mid-stream (vllm/entrypoints/openai/chat_completion/serving.py): its error object as
    an event, then ``[DONE]`` all the same."""
    role = {**chunk([], ""), "prompt_token_ids": [1, 2]}
    role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
    error = {"error": {"message": "engine failed", "type": "InternalServerError", "code": 500}}
    return sse_body([role, chunk([7], "a"), error])


@pytest.mark.parametrize("dialect", sorted(DIALECT_CALLS))
def test_a_vllm_error_event_mid_stream_is_upstream_error_and_the_last_event(
    pool_settings: PoolSettings, dialect: str
) -> None:
    """The error ends the stream: no [DONE] after it (main sent vLLM's), the step keeps the
    token before it with finish reason upstream_error and the flag aborted (main: finish
    reason null, flagged only unfinished)."""
    path, body = DIALECT_CALLS[dialect]
    trajectory_id = f"vllm-error-{dialect}"
    transport = answering(vllm_error_mid_stream(), "text/event-stream")
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        response = httpx.post(
            f"{gw.url}/t/{trajectory_id}/v1/{path}", json={**body, "stream": True}, timeout=30
        )
    events = sse_events(response.text)
    name, data = events[-1]
    assert all(data != "[DONE]" for _, data in events)
    if dialect == "chat":
        # vLLM's message as it sent it; our type and code, not its InternalServerError and 500
        assert json.loads(data)["error"] == {
            "message": "engine failed",
            "type": "upstream_error",
            "param": None,
            "code": "upstream_error",
        }
    else:
        assert name == ("error" if dialect == "messages" else "response.failed")
        assert "engine failed" in data
    (step,) = steps_of(pool_settings, trajectory_id)
    assert (step.outcome, step.finish_reason) == ("upstream_error", "upstream_error")
    assert step.response_token_ids == [7]
    assert "aborted" in step.flags
    assert_never_ready(pool_settings, trajectory_id, step.id)


# A 200 that answers a stream request with no event at all.
NO_EVENTS: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "text/event-stream"),
    "json_body": (
        json.dumps({**json.loads(_wrong_kind()), "object": "chat.completion"}).encode(),
        "application/json",
    ),
}


@pytest.mark.parametrize("fault", sorted(NO_EVENTS))
@pytest.mark.parametrize("dialect", sorted(DIALECT_CALLS))
def test_a_stream_answered_without_events_is_upstream_error(
    pool_settings: PoolSettings, dialect: str, fault: str
) -> None:
    """Main answered it as a normal end and stored an ok step with no tokens."""
    path, body = DIALECT_CALLS[dialect]
    trajectory_id = f"no-events-{dialect}-{fault}".replace("_", "-")
    transport = answering(*NO_EVENTS[fault])
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        response = httpx.post(
            f"{gw.url}/t/{trajectory_id}/v1/{path}", json={**body, "stream": True}, timeout=30
        )
    assert response.status_code == 200
    assert_ends_in_error_event(dialect, response.text)
    assert "no event" in response.text
    assert_failed_and_never_trained(pool_settings, trajectory_id)


def test_events_read_with_an_event_past_the_limit_keep_their_tokens(
    pool_settings: PoolSettings,
) -> None:
    """One upstream write holds a role chunk, a chunk with token 7, and an event past
    ``upstream_max_event_bytes``: the first two are one read with the oversized one, and main
    lost token 7 with them."""
    role = {**chunk([], ""), "prompt_token_ids": [1, 2]}
    events = sse_body([role, chunk([7], "a")]).removesuffix(b"data: [DONE]\n\n")
    oversized = b'data: {"id": "c", "x": "' + b"x" * 3000 + b'"}\n\n'

    def answer() -> Iterator[bytes]:
        yield SSE_HEAD + chunked_piece(events + oversized) + b"0\r\n\r\n"

    response = raw_gateway_call(
        pool_settings, answer, "too-long-after-events", stream=True, upstream_max_event_bytes=2000
    )
    assert_ends_in_error_event("chat", response.text)
    (step,) = steps_of(pool_settings, "too-long-after-events")
    assert (step.outcome, step.response_token_ids) == ("upstream_error", [7])


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_encoded_answer_is_upstream_error_whatever_it_decodes_to(
    pool_settings: PoolSettings, stream: bool
) -> None:
    """A gzip body of a few KiB that decodes to 8 MiB: the answer limit (2 MiB) counts framed
    bytes, so main decoded and answered it whole (200). vLLM never compresses and the gateway
    asks for identity, so any content-encoding is refused."""
    answer = json.loads(_wrong_kind())
    answer.update({"object": "chat.completion", "prompt_token_ids": [1, 2], "x": "x" * 8 * MIB})
    answer["choices"][0]["finish_reason"] = "stop"
    bomb = gzip.compress(json.dumps(answer).encode())
    assert len(bomb) < 64 * 1024
    asked: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/chat/completions":
            return httpx.Response(200 if request.url.path == "/health" else 404)
        asked.append(request.headers.get("accept-encoding"))
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        return httpx.Response(200, content=bomb, headers=headers)

    path, body = DIALECT_CALLS["chat"]
    trajectory_id = f"gzip-bomb-{stream}".lower()
    with gateway_with(
        pool_settings,
        free_port(),
        transport=httpx.MockTransport(handle),
        upstream_max_answer_bytes=2 * MIB,
        upstream_max_attempts=1,
    ) as gw:
        response = httpx.post(
            f"{gw.url}/t/{trajectory_id}/v1/{path}", json={**body, "stream": stream}, timeout=30
        )
    assert asked == ["identity"]
    assert response.status_code == 502
    assert "encoded (gzip)" in response.json()["error"]["message"]
    assert_failed_and_never_trained(pool_settings, trajectory_id)
