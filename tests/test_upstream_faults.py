"""A replica that answers 200 but breaks the answer: events or bodies the capture cannot read
(issue 29 item 1), answers past the size limits (item 3), and HTTP protocol errors (item 9).

vLLM never sends any of these, so the upstream is scripted: ``httpx.MockTransport`` where the
answer is well-framed HTTP, a raw socket server where the framing itself is broken. Every case
must end the same way: the client gets the dialect's error (an error event ending the stream,
or a 502), and the call is one step with outcome ``upstream_error``, flagged, never trained on.
"""

from __future__ import annotations

import json
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

# Events (and bodies) the capture cannot read, as the replica would send them.
UNREADABLE: dict[str, bytes] = {
    "not_json": b"this is not json",
    "not_utf8": b'{"id": "c", "choices": [], "x": "\xff\xfe"}',
    "not_an_object": b"[1, 2, 3]",
    "choices_not_a_list": b'{"id": "c", "object": "chat.completion.chunk", "choices": 5}',
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
    assert step.id in verdict.excluded_steps


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


@pytest.mark.parametrize("fault", sorted(UNREADABLE))
@pytest.mark.parametrize("dialect", sorted(DIALECT_CALLS))
def test_an_unreadable_unary_answer_is_502_and_records_upstream_error(
    pool_settings: PoolSettings, dialect: str, fault: str
) -> None:
    path, body = DIALECT_CALLS[dialect]
    transport = answering(UNREADABLE[fault], "application/json")
    trajectory_id = f"bad-body-{dialect}-{fault}".replace("_", "-")
    with gateway_with(pool_settings, free_port(), transport=transport) as gw:
        response = httpx.post(f"{gw.url}/t/{trajectory_id}/v1/{path}", json=body, timeout=30)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["type"] == ("api_error" if dialect == "messages" else "upstream_error")
    assert_failed_and_never_trained(pool_settings, trajectory_id)
