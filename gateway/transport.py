"""The gateway's HTTP/1.1 connections to its vLLM replicas: a lean ``httpx`` transport.

Owns: one stack of idle keep-alive connections per origin (last used, first reused), framing of
requests and answers (``content-length``, ``chunked``, or until close), and the connect and read
time limits httpx hands each request (``request.extensions["timeout"]``). Never: retries a
request, follows redirects, or decodes a body (httpx does that above the transport).

Why not httpx's default transport: httpcore's pool walks every pooled connection on each request
and each response close (``is_idle``, ``has_expired``, a ``getpeername`` per socket), and arms an
``anyio`` timer around every socket read. With 64 calls in flight that was about a quarter of the
gateway's CPU (docs/benchmarks.md). Here a request pops a connection off its origin's stack, and
the read limit is one timer per connection that is re-armed only when it fires early, so a
streamed chunk costs no timer work at all.

A connection goes back on the stack only when its answer was read to the end; closing an answer
early closes the connection, which is how vLLM learns that the client went away (it aborts the
request). Plain ``http://`` only; other schemes go to httpx's own transport.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import AsyncIterator
from typing import Any

import httpx

# Read at most this much ahead of the consumer before pausing the socket (backpressure).
_HIGH_WATER_BYTES = 1 << 20


class _Connection(asyncio.Protocol):
    """One TCP connection to an origin; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.paused = False
        self.read_timeout_s: float | None = None
        self.last_data_at = 0.0
        self.received_nothing = True
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport but have its methods.
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received_nothing = False
        self.buffer += data
        self.last_data_at = self.loop.time()
        if len(self.buffer) > _HIGH_WATER_BYTES and not self.paused and self.transport:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake()

    # -- waiting for bytes ---------------------------------------------------------------

    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_for_data(self) -> None:
        """Wait until more bytes arrived or the connection closed; ``httpx.ReadTimeout`` after
        ``read_timeout_s`` without a byte."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        waiter = self.loop.create_future()
        self.waiter = waiter
        if self.read_timeout_s is not None and self._timer is None:
            self._timer = self.loop.call_at(self.last_data_at + self.read_timeout_s, self._check)
        await waiter
        if self.error is not None:
            raise self.error

    def _check(self) -> None:
        # One timer per connection: when it fires early (bytes came since it was armed) it is
        # re-armed for the new silence limit; it never fires while nobody waits for bytes.
        self._timer = None
        waiter = self.waiter
        if waiter is None or waiter.done() or self.read_timeout_s is None:
            return
        due = self.last_data_at + self.read_timeout_s
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._check)
            return
        self.error = httpx.ReadTimeout(f"no data from the upstream for {self.read_timeout_s:g} s")
        self.waiter = None
        waiter.set_result(None)

    def start_request(self, read_timeout_s: float | None) -> None:
        self.read_timeout_s = read_timeout_s
        self.last_data_at = self.loop.time()
        self.error = None
        self.received_nothing = True

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True


class _Body(httpx.AsyncByteStream):
    """The answer's body as it arrives, de-chunked; hands the connection back when read fully."""

    def __init__(
        self,
        transport: UpstreamTransport,
        origin: tuple[str, int],
        conn: _Connection,
        framing: Any,
        keep_alive: bool,
    ) -> None:
        self._transport = transport
        self._origin = origin
        self._conn = conn
        self._framing = framing  # int: bytes left; "chunked"; None: until the connection closes
        self._done = False
        self._keep_alive = keep_alive

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        framing = self._framing
        if framing == "chunked":
            async for part in self._chunked():
                yield part
        elif isinstance(framing, int):
            left = framing
            while left > 0:
                if not conn.buffer:
                    if conn.closed:
                        raise httpx.RemoteProtocolError("upstream closed the connection mid-body")
                    await conn.wait_for_data()
                    continue
                part = bytes(conn.buffer[:left])
                del conn.buffer[: len(part)]
                left -= len(part)
                yield part
        else:
            self._keep_alive = False
            while True:
                if conn.buffer:
                    part = bytes(conn.buffer)
                    conn.buffer.clear()
                    yield part
                elif conn.closed:
                    break
                else:
                    await conn.wait_for_data()
        self._done = True

    async def _chunked(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            # One chunk: "<hex size>[;ext]\r\n<data>\r\n"; a zero size ends the body.
            end = conn.buffer.find(b"\r\n")
            while end < 0:
                await self._more()
                end = conn.buffer.find(b"\r\n")
            try:
                size = int(bytes(conn.buffer[:end]).split(b";", 1)[0], 16)
            except ValueError as exc:
                raise httpx.RemoteProtocolError("bad chunk size from the upstream") from exc
            if size == 0:
                trailer_end = conn.buffer.find(b"\r\n\r\n", end)
                while trailer_end < 0:
                    await self._more()
                    trailer_end = conn.buffer.find(b"\r\n\r\n", end)
                del conn.buffer[: trailer_end + 4]
                return
            while len(conn.buffer) < end + 2 + size + 2:
                await self._more()
            part = bytes(conn.buffer[end + 2 : end + 2 + size])
            del conn.buffer[: end + 2 + size + 2]
            yield part

    async def _more(self) -> None:
        if self._conn.closed:
            raise httpx.RemoteProtocolError("upstream closed the connection mid-body")
        await self._conn.wait_for_data()

    async def aclose(self) -> None:
        conn = self._conn
        if self._done and self._keep_alive and not conn.closed and not conn.buffer:
            self._transport._release(self._origin, conn)
        else:
            conn.close()


class UpstreamTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive connections, a stack of idle ones per origin.

    ``max_idle_per_origin`` bounds the idle connections kept per replica (the rest are closed when
    their answer ends); connections in use are not bounded (one per call in flight).
    """

    def __init__(self, max_idle_per_origin: int = 256) -> None:
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._fallback: httpx.AsyncHTTPTransport | None = None

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            if self._fallback is None:
                self._fallback = httpx.AsyncHTTPTransport()
            return await self._fallback.handle_async_request(request)
        timeouts = request.extensions.get("timeout", {})
        origin = (url.host, url.port or 80)
        body = await request.aread()
        head = [f"{request.method} {url.raw_path.decode('ascii')} HTTP/1.1\r\n".encode()]
        for name, value in request.headers.raw:
            head.append(name + b": " + value + b"\r\n")
        head.append(b"\r\n")
        payload = b"".join(head) + body
        for reuse_allowed in (True, False):
            conn, reused = await self._connection(origin, timeouts.get("connect"), reuse_allowed)
            conn.start_request(timeouts.get("read"))
            assert conn.transport is not None
            conn.transport.write(payload)
            try:
                status, headers, framing, keep_alive = await self._read_head(conn, request.method)
                break
            except httpx.RemoteProtocolError:
                conn.close()
                # A kept-alive connection the server closed just as it was reused (uvicorn drops
                # idle ones after 5 s): nothing was answered, so the request goes again, once,
                # on a new connection.
                if not (reused and conn.received_nothing):
                    raise
            except BaseException:
                conn.close()
                raise
        return httpx.Response(
            status,
            headers=headers,
            stream=_Body(self, origin, conn, framing, keep_alive),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _connection(
        self, origin: tuple[str, int], connect_timeout_s: Any, reuse_allowed: bool
    ) -> tuple[_Connection, bool]:
        """An idle connection to ``origin`` (True) or a new one (False)."""
        idle = self._idle.get(origin)
        while idle and reuse_allowed:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn, True
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop), origin[0], origin[1]
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {origin[0]}:{origin[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"{exc} ({origin[0]}:{origin[1]})") from exc
        return conn, False

    async def _read_head(
        self, conn: _Connection, method: str
    ) -> tuple[int, list[tuple[bytes, bytes]], Any, bool]:
        while True:
            end = conn.buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if conn.closed:
                raise httpx.RemoteProtocolError("upstream closed the connection without answering")
            await conn.wait_for_data()
        lines = bytes(conn.buffer[:end]).split(b"\r\n")
        del conn.buffer[: end + 4]
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError) as exc:
            raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}") from exc
        headers: list[tuple[bytes, bytes]] = []
        framing: Any = None
        keep_alive = True
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip(), value.strip()
            headers.append((name, value))
            lowered = name.lower()
            if lowered == b"content-length":
                framing = int(value)
            elif lowered == b"transfer-encoding" and b"chunked" in value.lower():
                framing = "chunked"
            elif lowered == b"connection" and value.lower() == b"close":
                keep_alive = False
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            framing = 0
        return status, headers, framing, keep_alive

    def _release(self, origin: tuple[str, int], conn: _Connection) -> None:
        conn.read_timeout_s = None
        idle = self._idle.setdefault(origin, [])
        if len(idle) < self.max_idle_per_origin:
            idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        if self._fallback is not None:
            await self._fallback.aclose()
