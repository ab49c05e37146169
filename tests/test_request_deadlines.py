"""Read deadlines on a request's head and body (``gateway.http_protocol``).

On main a head dripped at 1 byte per 2 s was held 300 s and a body at 1 byte/s 45 s. Here the
gateway runs with both deadlines at 1 s, and a raw socket drips: the connection must get 408
``request_timeout`` and be closed, and nothing reach the upstream or the pool. The socket's own
timeout (15 s) only bounds the test: main, which never closes, fails it by timing out.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from gateway_helpers import gateway_with, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer

BODY = json.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
).encode()
HEAD = (
    b"POST /t/dripped/v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
    b"content-type: application/json\r\ncontent-length: " + str(len(BODY)).encode() + b"\r\n\r\n"
)
DRIP_S = 0.25  # between bytes: 4 bytes a second, far below any real client


@pytest.fixture
def upstream_seen() -> list[str]:
    return []


@pytest.fixture
def gateway(pool_settings: PoolSettings, upstream_seen: list[str]) -> Iterator[BackgroundServer]:
    def upstream(request: httpx.Request) -> httpx.Response:
        # The gateway's own probes aside (GET /health, GET /v1/models for the tokenizers):
        # a client's call would be a POST.
        if request.method != "GET":
            upstream_seen.append(request.url.path)
        return httpx.Response(500)

    with gateway_with(
        pool_settings,
        free_port(),
        transport=httpx.MockTransport(upstream),
        request_head_timeout_s=1.0,
        request_body_timeout_s=1.0,
    ) as server:
        yield server


def drip(server: BackgroundServer, whole: bytes, dripped: bytes) -> tuple[bytes, float]:
    """Send ``whole`` at once, then ``dripped`` a byte at a time every DRIP_S until the gateway
    closes; returns what it answered and the seconds until it closed."""
    host, port = server.url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=15) as client:
        client.sendall(whole)
        for byte in dripped:
            try:
                client.sendall(bytes([byte]))
            except OSError:  # closed by the gateway: read what it said
                break
            time.sleep(DRIP_S)
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer, time.monotonic() - started


def assert_timed_out(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"


def test_a_dripped_head_gets_408_and_the_connection_closed(
    gateway: BackgroundServer, pool_settings: PoolSettings, upstream_seen: list[str]
) -> None:
    answer, closed_after_s = drip(gateway, b"", HEAD + BODY)
    assert_timed_out(answer)
    # Closed at the 1 s deadline, long before the whole head (~30 s at this pace) came.
    assert closed_after_s < len(HEAD) * DRIP_S / 2
    assert upstream_seen == [] and steps_of(pool_settings, "dripped") == []


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(
    gateway: BackgroundServer,
) -> None:
    answer, _ = drip(gateway, b"", b"")
    assert_timed_out(answer)


def test_a_dripped_body_gets_408_the_connection_closed_and_nothing_recorded(
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    upstream_seen: list[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    answer, closed_after_s = drip(gateway, HEAD, BODY)
    assert_timed_out(answer)
    # One line, no traceback: main logged an ERROR with ClientDisconnect's traceback for each.
    time.sleep(0.2)  # the route ends after the connection closed
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    (line,) = [r.getMessage() for r in caplog.records if "body ended" in r.getMessage()]
    assert line.startswith("POST /t/dripped/v1/chat/completions:")
    assert closed_after_s < len(BODY) * DRIP_S / 2
    assert upstream_seen == [] and steps_of(pool_settings, "dripped") == []
    assert httpx.get(f"{gateway.url}/api/trajectories/dripped").status_code == 404


def test_a_keep_alive_connections_next_request_has_its_own_head_deadline(
    gateway: BackgroundServer,
) -> None:
    """A prompt request, 1.5 s idle (past the head deadline, within keep-alive: idle time
    between requests is not a head), another prompt request on the same connection, then a
    dripped one: only that one is cut."""
    ask = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as client:
        for pause_s in (0.0, 1.5):
            time.sleep(pause_s)
            client.sendall(ask)
            assert client.recv(65536).startswith(b"HTTP/1.1 200 ")
        answer = b""
        for byte in ask:
            try:
                client.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(DRIP_S)
        while chunk := client.recv(65536):
            answer += chunk
    assert_timed_out(answer)
