"""Each streamed dialect reaches the client as the engine produces tokens, never as a replay.

The upstream is the emulator (``trajgate.bench.emulator``) with a slow first token (300 ms) and
paced tokens (50 ms apart), 10 tokens per answer: the engine writes token ``i`` at about
``300 + 50 i`` ms, the last at about 750 ms. It records when it wrote each token's chunk
(``ResponseBook.token_times``, taken just before the write); the client records when each content
event arrived, on the same monotonic clock (one process). A gateway that buffered the stream and
replayed it would deliver every event after the last token was written, all within a few ms of
each other.

The assertions are on order and spread, with margins of hundreds of ms, so they hold on a loaded
2-core machine: the lag of each event behind its token is reported in the failure message, not
asserted to a few ms (docs/gateway.md gives the measured figures).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests_support import free_port

from datapool import db
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread
from trajgate.bench.gateway import DIALECT_PATHS, BenchDialect, BenchSettings, request_body

TTFT_MS = 300.0
INTER_TOKEN_MS = 50.0
TOKENS = 10  # written at about 300, 350, ..., 750 ms


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorThread]:
    settings = EmulatorSettings(
        port=free_port(),
        prompt_tokens=12,
        response_tokens=TOKENS,
        ttft_ms=TTFT_MS,
        inter_token_ms=INTER_TOKEN_MS,
    )
    server = EmulatorThread(settings).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(emulator: EmulatorThread, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    data_dir: Path = tmp_path_factory.mktemp("pool")
    database_url = f"sqlite:///{data_dir / 'pool.sqlite3'}"
    db.upgrade(database_url)
    settings = GatewaySettings(
        upstream_url=emulator.url, port=free_port(), health_check_interval_s=3600
    )
    app = create_app(settings, PoolSettings(data_dir=data_dir, database_url=database_url))
    server = BackgroundServer(app, port=settings.port).start()
    yield server.url
    server.stop()


def is_content_event(dialect: BenchDialect, event: dict[str, Any]) -> bool:
    """Whether ``event`` (one SSE ``data`` object) carries response text to the client."""
    if dialect == "chat":
        choices = event.get("choices") or [{}]
        return bool(choices[0].get("delta", {}).get("content"))
    if dialect == "responses":
        return event.get("type") == "response.output_text.delta"
    if dialect == "messages":
        delta = event.get("delta") or {}
        return event.get("type") == "content_block_delta" and delta.get("type") == "text_delta"
    raise ValueError(f"dialect must be one of {tuple(DIALECT_PATHS)}, got {dialect!r}")


def content_arrivals(url: str, body: dict[str, Any], dialect: BenchDialect) -> list[float]:
    """Stream ``body`` to ``url``; the monotonic time (s) at which each content event arrived."""
    arrivals = []
    with httpx.stream("POST", url, json=body, timeout=30.0) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if is_content_event(dialect, json.loads(line[len("data: ") :])):
                arrivals.append(time.monotonic())
    return arrivals


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_streamed_dialect_delivers_each_token_as_the_engine_writes_it(
    emulator: EmulatorThread, gateway: str, dialect: BenchDialect
) -> None:
    body = request_body(BenchSettings(prompt_tokens=5, response_tokens=TOKENS), dialect, True)
    emulator.book.token_times.clear()
    sent_at = time.monotonic()
    arrivals = content_arrivals(
        f"{gateway}/t/stream-{dialect}/v1{DIALECT_PATHS[dialect]}", body, dialect
    )
    (written,) = emulator.book.token_times  # this test's one streamed answer

    lags_ms = [round((a - w) * 1000.0, 1) for a, w in zip(arrivals, written, strict=True)]
    report = f"lags behind the engine (ms): {lags_ms}"
    # One upstream chunk per token and one content event per chunk: 10 of each.
    assert len(written) == TOKENS and len(arrivals) == TOKENS, report
    # Causality on one clock: token i reaches the client after the engine wrote it.
    assert all(lag >= 0 for lag in lags_ms), report
    # The first content event waits for the slow first token (written >= 300 ms after sending)...
    assert arrivals[0] - sent_at >= TTFT_MS / 1000.0, report
    # ...and comes long before the last token is written (about 450 ms later): a buffered
    # replay would deliver it after written[-1].
    assert arrivals[0] < written[-1], report
    # Most events arrive while the engine is still writing: tokens 0-4 have 250 ms or more of
    # margin (5 gaps of 50 ms) before the last token is written.
    assert sum(a < written[-1] for a in arrivals) >= TOKENS // 2, report
    # Spread like the engine's pacing: the engine spends 9 x 50 = 450 ms between its first and
    # last token; a replay would deliver all 10 within a few ms. Half of it leaves room for load.
    engine_span_s, client_span_s = written[-1] - written[0], arrivals[-1] - arrivals[0]
    # (The engine's own pacing, checked with a gap to spare: asyncio may wake a timer early.)
    assert engine_span_s >= 8 * INTER_TOKEN_MS / 1000.0, report
    assert client_span_s >= engine_span_s / 2, report
    # The typical event trails its token by less than one token gap (50 ms).
    assert statistics.median(lags_ms) < INTER_TOKEN_MS, report
