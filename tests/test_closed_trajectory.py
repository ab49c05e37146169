"""A call to a closed trajectory is refused before it is sampled: 409 ``trajectory_closed`` in
each dialect's own envelope, nothing sent upstream, one ``rejected_calls`` per refused call;
the writer's ``KnownClosed`` keeps the most recent 65,536 (here: a few) closed ids, and one it
does not know (closed by another process, or evicted) is still refused at commit, which
teaches it. A real gateway in front of the vLLM-shaped emulator, through a transport that
writes down what reaches the upstream, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from gateway_helpers import gateway_with
from tests_support import free_port

from datapool.db import make_engine, make_sessionmaker
from datapool.lifecycle.transitions import close_trajectory
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.closed import KnownClosed
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread

WORDS = "find the capybara"
USER = [{"role": "user", "content": WORDS}]
# Per dialect: its path and a body it accepts.
CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "emulated", "messages": USER}),
    "completions": ("/v1/completions", {"model": "emulated", "prompt": WORDS}),
    "responses": ("/v1/responses", {"model": "emulated", "input": WORDS}),
    "messages": ("/v1/messages", {"model": "emulated", "max_tokens": 5, "messages": USER}),
}


class WatchedUpstream(httpx.AsyncBaseTransport):
    """The emulator over the network, with the path of every client call the gateway sends it
    written down (a request that carries the client's words: the gateway's own probes, GET or
    POST, carry none) and ``before_post`` run first."""

    def __init__(self) -> None:
        self.posts: list[str] = []
        self.before_post: Callable[[], None] | None = None
        self._network = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and WORDS.encode() in request.content:
            self.posts.append(request.url.path)
            if self.before_post is not None:
                self.before_post()
        return await self._network.handle_async_request(request)

    async def aclose(self) -> None:
        await self._network.aclose()


@pytest.fixture
def emulator() -> Iterator[EmulatorThread]:
    server = EmulatorThread(
        EmulatorSettings(port=free_port(), prompt_tokens=20, response_tokens=5)
    ).start()
    yield server
    server.stop()


def serve(pool_settings: PoolSettings, emulator: EmulatorThread, upstream: WatchedUpstream) -> Any:
    """A gateway in front of ``emulator`` through ``upstream`` (a context manager)."""
    return gateway_with(pool_settings, free_port(), upstream_url=emulator.url, transport=upstream)


def call(client: httpx.Client, dialect: str, trajectory_id: str, **extra: Any) -> httpx.Response:
    path, body = CALLS[dialect]
    return client.post(f"/t/{trajectory_id}{path}", json={**body, **extra})


def rejected_calls(client: httpx.Client, trajectory_id: str) -> int:
    detail = client.get(f"/api/trajectories/{trajectory_id}")
    assert detail.status_code == 200, detail.text
    count: int = detail.json()["rejected_calls"]
    return count


def close_elsewhere(pool_settings: PoolSettings, trajectory_id: str) -> None:
    """Complete ``trajectory_id`` straight in the database, as another gateway process would:
    this gateway's writer is not told."""
    engine = make_engine(pool_settings.resolved_database_url())
    try:
        close_trajectory(make_sessionmaker(engine), trajectory_id, TrajectoryStatus.COMPLETE)
    finally:
        engine.dispose()


def assert_refused_in_envelope(response: httpx.Response, dialect: str) -> str:
    """Assert a 409 ``trajectory_closed`` in ``dialect``'s envelope; returns its message."""
    assert response.status_code == 409, (dialect, response.text)
    body = response.json()
    if dialect == "messages":  # Anthropic's envelope: no code field, the code in brackets
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == "invalid_request_error"  # Anthropic's type for a 4xx
        message: str = body["error"]["message"]
        assert message.endswith("[trajectory_closed]"), message
        return message
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == ("conflict_error", "trajectory_closed")
    message = body["error"]["message"]
    return message


def test_a_call_to_a_closed_trajectory_is_409_in_each_dialect_and_never_reaches_the_upstream(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    upstream = WatchedUpstream()
    with (
        serve(pool_settings, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        assert call(client, "chat", "done").status_code == 200  # one step, one POST upstream
        assert upstream.posts == ["/v1/chat/completions"]
        completed = client.post("/api/trajectories/done/complete", json={"reward": 1.0})
        assert completed.status_code == 200, completed.text
        refused = 0
        for dialect in CALLS:
            for stream in (False, True):  # a stream is refused before its status line
                response = call(client, dialect, "done", stream=stream)
                message = assert_refused_in_envelope(response, dialect)
                assert "'done' is already complete" in message, message
                refused += 1
        # Nothing of the 8 refused calls reached the upstream; each counted once: 4 x 2 = 8.
        assert upstream.posts == ["/v1/chat/completions"]
        assert rejected_calls(client, "done") == refused == 8
        assert len(client.get("/api/trajectories/done").json()["steps"]) == 1
        summary = client.get("/api/summary").json()
        assert summary["rejected_calls"] == 8


def test_abandoned_and_failed_trajectories_are_refused_up_front_too(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    upstream = WatchedUpstream()
    with (
        serve(pool_settings, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        for trajectory_id, action, status in (
            ("gave-up", "abandon", "abandoned"),
            ("broke", "fail", "failed"),
        ):
            created = client.post("/api/trajectories", json={"id": trajectory_id})
            assert created.status_code in (200, 201), created.text
            closed = client.post(f"/api/trajectories/{trajectory_id}/{action}")
            assert closed.status_code == 200, closed.text
            message = assert_refused_in_envelope(call(client, "chat", trajectory_id), "chat")
            assert f"is already {status}" in message, message
            assert rejected_calls(client, trajectory_id) == 1
        assert upstream.posts == []


def test_a_closed_trajectory_still_gets_a_bad_body_400_and_a_token_count_uncounted(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    """The dialect reads the body before the closed check (docs/gateway.md, "A call to a closed
    trajectory"): a body it refuses is that 400, not a rejected call; ``count_tokens`` samples
    and stores nothing, so it is answered."""
    upstream = WatchedUpstream()
    with (
        serve(pool_settings, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        assert client.post("/api/trajectories", json={"id": "shut"}).status_code in (200, 201)
        assert client.post("/api/trajectories/shut/abandon").status_code == 200
        bad = client.post("/t/shut/v1/chat/completions", json={"model": "emulated"})
        assert bad.status_code == 400, bad.text
        counted = client.post(
            "/t/shut/v1/messages/count_tokens", json={"model": "emulated", "messages": USER}
        )
        # Passed on to the upstream's /tokenize (the emulator has none: its 404), not refused.
        assert counted.status_code == 404 and "/tokenize" in counted.text, counted.text
        assert rejected_calls(client, "shut") == 0
        assert client.get("/api/trajectories/shut").json()["steps"] == []


def test_a_trajectory_closed_elsewhere_is_refused_at_commit_then_before_sampling(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    upstream = WatchedUpstream()
    with (
        serve(pool_settings, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        assert call(client, "chat", "elsewhere").status_code == 200
        close_elsewhere(pool_settings, "elsewhere")
        # Not known to this gateway: sampled, then refused by the commit's own check.
        assert_refused_in_envelope(call(client, "chat", "elsewhere"), "chat")
        assert upstream.posts == ["/v1/chat/completions"] * 2
        # The refused commit taught the writer: the next call never goes upstream.
        assert_refused_in_envelope(call(client, "chat", "elsewhere"), "chat")
        assert upstream.posts == ["/v1/chat/completions"] * 2
        assert rejected_calls(client, "elsewhere") == 2  # one at commit, one up front


def test_a_streamed_responses_call_refused_at_commit_ends_in_response_failed_with_its_code(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    upstream = WatchedUpstream()
    with (
        serve(pool_settings, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        assert call(client, "responses", "mid-stream").status_code == 200
        # Closed by another process once the call has gone upstream: the status line (200)
        # goes out before the commit, so the refusal can only come as the stream's last event.
        upstream.before_post = lambda: close_elsewhere(pool_settings, "mid-stream")
        path, body = CALLS["responses"]
        with client.stream(
            "POST", f"/t/mid-stream{path}", json={**body, "stream": True}
        ) as response:
            assert response.status_code == 200
            text = response.read().decode()
        upstream.before_post = None
        events = [
            json.loads(line.removeprefix("data: "))
            for line in text.splitlines()
            if line.startswith("data: ")
        ]
        last = events[-1]
        assert last["type"] == "response.failed", [e["type"] for e in events]
        assert "response.completed" not in {e["type"] for e in events}
        # The SDK accepts only OpenAI's codes in ``error.code``; the gateway's leads the message.
        error = last["response"]["error"]
        assert error["code"] == "server_error"
        assert error["message"].startswith("trajectory_closed: refused this call"), error
        # Then the trajectory is known closed: refused before sampling.
        assert_refused_in_envelope(
            call(client, "responses", "mid-stream", stream=True), "responses"
        )
        assert upstream.posts == ["/v1/chat/completions"] * 2
        assert rejected_calls(client, "mid-stream") == 2


def test_an_evicted_closed_trajectory_is_refused_at_commit_and_known_again(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    """With room for 2: closing a, b, c evicts a, the oldest; a's next call is sampled and
    refused at commit (the backstop), which makes it known again (evicting b)."""
    pool = pool_settings.model_copy(update={"known_closed_trajectories": 2})
    upstream = WatchedUpstream()
    with (
        serve(pool, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        for trajectory_id in ("a", "b", "c"):
            assert client.post("/api/trajectories", json={"id": trajectory_id}).is_success
            assert client.post(f"/api/trajectories/{trajectory_id}/complete").is_success
        assert_refused_in_envelope(call(client, "chat", "c"), "chat")
        assert upstream.posts == []  # c is known
        assert_refused_in_envelope(call(client, "chat", "a"), "chat")
        assert upstream.posts == ["/v1/chat/completions"]  # a was evicted: sampled, refused
        assert_refused_in_envelope(call(client, "chat", "a"), "chat")
        assert upstream.posts == ["/v1/chat/completions"]  # a is known again
        assert_refused_in_envelope(call(client, "chat", "b"), "chat")
        assert upstream.posts == ["/v1/chat/completions"] * 2  # a's return evicted b
        assert [rejected_calls(client, t) for t in ("a", "b", "c")] == [2, 1, 1]


def test_known_closed_drops_the_least_recently_used_past_its_bound() -> None:
    known = KnownClosed(max_ids=3)
    for trajectory_id in ("a", "b", "c"):
        known.add(trajectory_id, "complete")
    assert known.status_of("a") == "complete"  # asked for: now the most recent
    known.add("d", "abandoned")  # 4 > 3: drops b, the least recently used
    assert [known.status_of(t) for t in ("a", "b", "c", "d")] == [
        "complete",
        None,
        "complete",
        "abandoned",
    ]
    assert len(known) == 3
    assert known.status_of("never-closed") is None


def test_known_closed_holds_65536_by_default_and_refuses_a_bound_below_one() -> None:
    assert PoolSettings().known_closed_trajectories == 65536
    known = KnownClosed(PoolSettings().known_closed_trajectories)
    for i in range(65536 + 1):
        known.add(f"t{i}", "complete")
    assert len(known) == 65536
    assert known.status_of("t0") is None and known.status_of("t65536") == "complete"
    with pytest.raises(ValueError, match="max_ids=0"):
        KnownClosed(0)


def test_a_call_naming_its_channel_finds_a_trajectory_closed_elsewhere_before_sampling(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    """A call that names a channel has its trajectory read anyway (its channel is checked):
    the read's status is enough to refuse it up front, even when closed by another process."""
    upstream = WatchedUpstream()
    with (
        serve(pool_settings, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        assert call(client, "chat", "named").status_code == 200
        close_elsewhere(pool_settings, "named")
        path, body = CALLS["chat"]
        refused = client.post(f"/t/named{path}", json=body, headers={"X-Trajgate-Channel": "train"})
        assert_refused_in_envelope(refused, "chat")
        assert upstream.posts == ["/v1/chat/completions"]  # the first call's only
        assert rejected_calls(client, "named") == 1


def test_a_replay_of_a_call_the_pool_kept_is_still_answered_after_close(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    """An Idempotency-Key replay is no new call: its step is in the pool, so it is answered
    (from the pool, not the engine) and not counted as refused."""
    upstream = WatchedUpstream()
    with (
        serve(pool_settings, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        path, body = CALLS["chat"]
        key = {"Idempotency-Key": "turn-1"}
        first = client.post(f"/t/kept{path}", json=body, headers=key)
        assert first.status_code == 200, first.text
        assert client.post("/api/trajectories/kept/complete").is_success
        replay = client.post(f"/t/kept{path}", json=body, headers=key)
        assert replay.status_code == 200, replay.text
        assert replay.headers["x-trajgate-replayed"] == "true"
        assert replay.json() == first.json()
        assert_refused_in_envelope(client.post(f"/t/kept{path}", json=body), "chat")
        assert upstream.posts == ["/v1/chat/completions"]
        assert rejected_calls(client, "kept") == 1  # the call without the key only


def test_a_trajectory_the_idle_timeout_completed_is_refused_before_sampling(
    pool_settings: PoolSettings, emulator: EmulatorThread
) -> None:
    pool = pool_settings.model_copy(
        update={"trajectory_idle_timeout_s": 0.3, "compaction_interval_s": 0.1}
    )
    upstream = WatchedUpstream()
    with (
        serve(pool, emulator, upstream) as gateway,
        httpx.Client(base_url=gateway.url, timeout=30) as client,
    ):
        assert call(client, "chat", "idle").status_code == 200
        deadline = time.monotonic() + 30
        detail = client.get("/api/trajectories/idle").json()
        while detail["status"] == "open" and time.monotonic() < deadline:
            time.sleep(0.1)
            detail = client.get("/api/trajectories/idle").json()
        assert (detail["status"], detail["completion_reason"]) == ("complete", "idle_timeout")
        assert_refused_in_envelope(call(client, "messages", "idle"), "messages")
        assert upstream.posts == ["/v1/chat/completions"]  # the first call's only
        assert rejected_calls(client, "idle") == 1
