"""Liveness that stays prompt under load: ``GET /health`` on its own port, answered by a thread.

Owns: the event loop's heartbeat (``Heartbeat.beat``, a task of the app's loop that stamps
``time.monotonic()`` every ``BEAT_S``) and the liveness listener (``LivenessServer``, a daemon
thread on ``TRAJGATE_LIVENESS_PORT`` that answers from the heartbeat alone). Never: touches the
event loop, the pool or the upstreams from its thread.

Why a thread on a port of its own: ``/health`` on the main port is a request like any other, so it
waits behind every ready callback of the one event loop; under 300 fast streams it took up to 22 s,
and a probe with a 1 s timeout would restart a gateway that was only busy. The thread needs the GIL
for a few microseconds per probe and never waits on the loop, so it answers in milliseconds
whatever the loop's backlog. It still says whether the loop lives: 200 while the loop stamped its
heartbeat within ``STALL_S`` seconds, else 503 (a wedged loop, not a busy one: a loaded loop still
turns many times a second).

Answers: ``200 {"status": "ok", "loop_lag_s": x}`` or ``503 {"status": "stalled", "loop_lag_s": x}``
(``x``: seconds since the last beat) to ``GET /health``; 404 to any other path, 405 to any other
method. One request per connection (``Connection: close``).

With several workers (``trajgate serve --workers N``) the serving parent owns the port and answers
from ``gateway.workers.WorkerLag``: the slowest worker's lag (``null`` and 503 while no worker
answers), plus ``"workers"``, how many answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol, Self

log = logging.getLogger("trajgate.gateway.liveness")

BEAT_S = 0.5  # how often the loop stamps its heartbeat
STALL_S = 30.0  # a loop silent this long is wedged, not busy: liveness answers 503
_READ_TIMEOUT_S = 5.0  # a probe that sends nothing for this long is dropped


class Heartbeat:
    """The time the app's event loop last turned (``time.monotonic()`` seconds)."""

    def __init__(self) -> None:
        self.at = time.monotonic()

    async def beat(self) -> None:
        """Stamp ``at`` every ``BEAT_S`` seconds until cancelled (a task of the app's loop)."""
        while True:
            self.at = time.monotonic()
            await asyncio.sleep(BEAT_S)

    def lag_s(self) -> float:
        return time.monotonic() - self.at


class LoopLag(Protocol):
    """What liveness answers from: ``Heartbeat`` (one loop) or ``gateway.workers.WorkerLag``."""

    def lag_s(self) -> float: ...


class SocketThreadServer:
    """A listening socket served one connection at a time by one daemon thread, off the event
    loop: the skeleton of ``LivenessServer`` and ``gateway.workers.PeerServer``, which answer a
    connection in ``_answer``. A connection that fails (the peer went away) is logged and the
    next one served; ``stop`` unblocks ``accept`` and releases the socket."""

    def __init__(self, listener: socket.socket, name: str) -> None:
        self._socket = listener
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping = True
        # Unblock accept(): shutdown wakes it on Linux; close releases the socket.
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        self._thread.join(timeout=5)

    def _serve(self) -> None:
        while not self._stopping:
            try:
                connection, _address = self._socket.accept()
            except OSError:
                if self._stopping:
                    return
                time.sleep(0.01)  # e.g. too many open files: try again
                continue
            with connection:
                try:
                    self._answer(connection)
                except OSError as exc:  # the peer went away; the next one is served
                    log.debug("%s request failed: %r", self._thread.name, exc)

    def _answer(self, connection: socket.socket) -> None:
        raise NotImplementedError


class LivenessServer(SocketThreadServer):
    """``GET /health`` on ``host:port``, served by one daemon thread from ``heartbeat``."""

    def __init__(
        self,
        host: str,
        port: int,
        heartbeat: LoopLag,
        workers: Callable[[], int] | None = None,
    ) -> None:
        """Binds now: raises ``OSError`` when the port is taken. ``workers``: with several
        workers, how many answered the lag just read (shown as ``"workers"``)."""
        self.heartbeat = heartbeat
        self._workers = workers
        listener = socket.create_server((host, port), backlog=64)
        self.port = int(listener.getsockname()[1])
        super().__init__(listener, "liveness")

    def _answer(self, connection: socket.socket) -> None:
        connection.settimeout(_READ_TIMEOUT_S)
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 8192:
            chunk = connection.recv(4096)
            if not chunk:
                break
            head += chunk
        method, _, rest = head.partition(b" ")
        path = rest.partition(b" ")[0].partition(b"?")[0]
        payload: dict[str, str | float | int | None]
        if path != b"/health":
            status, payload = "404 Not Found", {"error": "only GET /health is served here"}
        elif method not in (b"GET", b"HEAD"):
            status, payload = "405 Method Not Allowed", {"error": "use GET /health"}
        else:
            lag_s = self.heartbeat.lag_s()
            stalled = lag_s > STALL_S
            status = "503 Service Unavailable" if stalled else "200 OK"
            shown = round(lag_s, 3) if math.isfinite(lag_s) else None
            payload = {"status": "stalled" if stalled else "ok", "loop_lag_s": shown}
            if self._workers is not None:
                payload["workers"] = self._workers()
        body = json.dumps(payload).encode()
        response = (
            f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode()
        connection.sendall(response if method == b"HEAD" else response + body)
