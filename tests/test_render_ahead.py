"""The render sent ahead of an exact continuation ends with the call's lifetime.

A call extending a turn sends its render while it is still prepared
(``gateway.proxy.preparation.render_ahead_of``); the call's ``CallLifetime`` holds it, and
however the call ends (refused, answered as a re-send, failed upstream, cancelled) no render
task is left running once the call is over. The gateway cases run against the emulator
(trajgate/bench/emulator.py, whose scale-out endpoints serve the exact path) with every render
made slow (``RENDER_DELAY_S``): a render nothing ended would still be pending when the call's
answer arrives. The cancelled case drives a ``CallLifetime`` directly, with an upstream that
never answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from gateway_helpers import (
    assert_renders_ended,
    emulated_gateway,
    steps_of,
    wait_for_exact_probes,
)
from sqlalchemy.exc import OperationalError

from datapool.settings import PoolSettings
from gateway.engine import exact as engine
from gateway.engine.exact import RenderAhead, render_ahead
from gateway.proxy import preparation
from gateway.proxy.lifetime import CallLifetime
from gateway.server import BackgroundServer
from gateway.upstream.replicas import Replica
from trajgate.bench import scale_out

EMULATOR = {"prompt_tokens": 3, "response_tokens": 2, "prompt_ids": "messages"}
# Every render waits this long before it goes out: a render sent ahead that nothing cancelled
# is still pending ``ENDED_WITHIN_S`` after its call was answered (1 s > 0.5 s).
RENDER_DELAY_S = 1.0
ENDED_WITHIN_S = 0.5
COUNT = {"role": "user", "content": "Count."}


@pytest.fixture
def sent_ahead(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RenderAhead]]:
    """The renders the gateway sends ahead, in order, every render slowed by RENDER_DELAY_S."""
    sent: list[RenderAhead] = []
    original_ahead, original_render = preparation.render_ahead, engine._render

    def recorded(*args: Any) -> RenderAhead:
        ahead = original_ahead(*args)
        sent.append(ahead)
        return ahead

    async def slow_render(*args: Any) -> httpx.Response:
        await asyncio.sleep(RENDER_DELAY_S)
        return await original_render(*args)

    monkeypatch.setattr(preparation, "render_ahead", recorded)
    monkeypatch.setattr(engine, "_render", slow_render)
    yield sent


def assert_none_pending(sent: list[RenderAhead]) -> None:
    assert_renders_ended(sent, ENDED_WITHIN_S)


def first_turn(server: BackgroundServer, trajectory: str) -> list[dict[str, Any]]:
    """A first call (the template's: nothing to extend, no render ahead), then the messages of
    a second call that extends its answer, once the replica's exact probe has ended."""
    url = f"{server.url}/t/{trajectory}/v1/chat/completions"
    first = httpx.post(url, json={"model": "emulated", "messages": [COUNT]}, timeout=30)
    assert first.status_code == 200, first.text
    text = first.json()["choices"][0]["message"]["content"]
    wait_for_exact_probes(server)
    return [COUNT, {"role": "assistant", "content": text}, {"role": "user", "content": "Again."}]


def test_a_call_refused_after_its_render_left_leaves_no_render_pending(
    pool_settings: PoolSettings,
    sent_ahead: list[RenderAhead],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pool fails the re-send lookup, which runs after the render left: 'refuse' answers
    # 503 before anything is sampled, and the render nobody will take must not run on.
    refusing = pool_settings.model_copy(update={"on_write_failure": "refuse"})
    with emulated_gateway(refusing, **EMULATOR) as server:
        messages = first_turn(server, "refused-ahead")

        def unreachable_pool(*args: Any) -> str | None:
            raise OperationalError("SELECT", {}, psycopg.OperationalError("connection refused"))

        monkeypatch.setattr(preparation, "find_resend", unreachable_pool)
        answer = httpx.post(
            f"{server.url}/t/refused-ahead/v1/chat/completions",
            json={"model": "emulated", "messages": messages},
            timeout=30,
        )
        assert answer.status_code == 503, answer.text
        assert len(sent_ahead) == 1
        assert_none_pending(sent_ahead)
        assert sent_ahead[0].task.cancelled()  # never answered: the lifetime's end cut it


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_call_answered_as_a_resend_leaves_no_render_pending(
    pool_settings: PoolSettings, sent_ahead: list[RenderAhead], stream: bool
) -> None:
    # The same body twice: the second is a re-send, prepared again under the first's call id
    # to the same JSON, so its render sent ahead is the one it samples from.
    with emulated_gateway(pool_settings, **EMULATOR) as server:
        messages = first_turn(server, f"resend-ahead-{stream}")
        body = {"model": "emulated", "messages": messages, "stream": stream}
        url = f"{server.url}/t/resend-ahead-{stream}/v1/chat/completions"
        for _ in range(2):
            answer = httpx.post(url, json=body, timeout=30)
            assert answer.status_code == 200, answer.text
        assert len(sent_ahead) == 2
        assert_none_pending(sent_ahead)
        steps = steps_of(pool_settings, f"resend-ahead-{stream}")
    assert [s.continuation for s in steps] == ["template", "exact", "exact"]
    assert steps[2].call_id == steps[1].call_id and "resend" in steps[2].flags


def test_a_call_that_fails_upstream_after_its_render_left_leaves_no_render_pending(
    pool_settings: PoolSettings, sent_ahead: list[RenderAhead], monkeypatch: pytest.MonkeyPatch
) -> None:
    # generate answers a body the gateway cannot read: a 502 upstream_error after the render.
    with emulated_gateway(pool_settings, **EMULATOR) as server:
        messages = first_turn(server, "failed-ahead")
        monkeypatch.setattr(scale_out, "generate_parts", lambda *args: [b"not json"])
        answer = httpx.post(
            f"{server.url}/t/failed-ahead/v1/chat/completions",
            json={"model": "emulated", "messages": messages},
            timeout=30,
        )
        assert answer.status_code == 502, answer.text
        assert len(sent_ahead) == 1
        assert_none_pending(sent_ahead)
        steps = steps_of(pool_settings, "failed-ahead")
    assert [s.outcome for s in steps] == ["ok", "upstream_error"]


class InFlightCount:
    """A ``PoolWriter`` as far as ``CallLifetime`` uses it: the calls counted in flight."""

    def __init__(self) -> None:
        self.calls = 0

    def call_started(self, trajectory_id: str) -> None:
        self.calls += 1

    def call_ended(self, trajectory_id: str) -> None:
        self.calls -= 1


def silent_upstream() -> httpx.AsyncClient:
    """A client whose upstream takes every request and never answers."""

    async def never(request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return httpx.AsyncClient(transport=httpx.MockTransport(never))


BODY = {"model": "tiny", "messages": [COUNT]}


def test_a_call_cancelled_while_its_render_is_out_cancels_the_render() -> None:
    # The client goes while the call is still prepared (its pool lookups): the handler's task
    # is cancelled inside the lifetime, whose end cancels the render too.
    async def run() -> tuple[bool, int]:
        writer = InFlightCount()
        async with silent_upstream() as client:
            sent: list[RenderAhead] = []
            preparing = asyncio.Event()

            async def call() -> None:
                async with CallLifetime(writer, "t") as lifetime:  # type: ignore[arg-type]
                    lifetime.ahead = render_ahead(client, Replica("http://r.test"), BODY, None)
                    sent.append(lifetime.ahead)
                    preparing.set()
                    await asyncio.Event().wait()  # the pool lookups, until the client goes

            handler = asyncio.create_task(call())
            await preparing.wait()
            handler.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handler
            await asyncio.sleep(0)  # the render's cancel lands
            return sent[0].task.cancelled(), writer.calls

    assert asyncio.run(run()) == (True, 0)


def test_a_render_dropped_early_is_cancelled_and_let_go_and_the_end_is_idempotent() -> None:
    # A call that extends no turn drops its render before it samples (drop_ahead); the end
    # of the lifetime then has nothing left to cancel, and a second end does nothing.
    async def run() -> tuple[bool, RenderAhead | None, int]:
        writer = InFlightCount()
        async with silent_upstream() as client:
            lifetime = CallLifetime(writer, "t")  # type: ignore[arg-type]
            async with lifetime:
                ahead = lifetime.ahead = render_ahead(client, Replica("http://r.test"), BODY, None)
                lifetime.drop_ahead()
                await asyncio.sleep(0)
                dropped = ahead.task.cancelled()
                held = lifetime.ahead
            await lifetime.end()
            return dropped, held, writer.calls

    assert asyncio.run(run()) == (True, None, 0)
