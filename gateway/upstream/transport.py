"""The HTTP/1.1 transport under the gateway's model calls: plain-HTTP keep-alive connections to
the vLLM replicas on asyncio protocols, behind httpx's client API.

Owns: the connections to each replica (opened on demand, reused LIFO, dropped when the replica
closed them or they idled ``IDLE_EXPIRY_S``), writing a request, framing the answer's body
(``content-length``, ``chunked``, or until the replica closes), the connect and read time limits
and the httpx errors they and a broken connection raise. Never: retries (the proxy's attempt loop
decides what is safe), decodes ``content-encoding`` (httpx's ``Response`` does, as for any
transport), speaks TLS (``https://`` replicas go through httpx's own transport).

Why our own transport (the capture hot path is trajgate's core, ``docs/benchmarks.md``,
"Profile"): under the paced bench, httpx's default transport (httpcore's pool and HTTP/1.1
connection, h11's state machine, anyio's socket stream) cost about 18 us of CPU per read of a
stream and about 0.9 ms per unary call of the gateway's 6 ms. Here a read is one
``data_received`` into a buffer, a chunk-size line found with ``bytes.find`` and one future
woken; nothing is done per read that httpcore does per connection per request (walking the pool).
The bytes a client of this transport reads are exactly the body the replica sent, de-chunked
(``tests/test_upstream_transport.py`` checks them against h11, the reference, at fuzzed read
boundaries).
"""

from __future__ import annotations

import asyncio
import time
import typing
from collections.abc import AsyncIterator
from typing import Any

import httpx

# An idle connection older than this is not reused: uvicorn (vLLM's server) closes keep-alive
# connections after 5 s, and a request written as the replica closes the connection fails.
IDLE_EXPIRY_S = 4.0
# A response head larger than this is refused (vLLM's are a few hundred bytes).
MAX_HEAD_BYTES = 65_536
# A request body up to this size is written in one piece with its head; a larger one apart.
JOIN_BODY_BYTES = 65_536
# The socket is paused while this much of a body is buffered and unread (a slow client).
HIGH_WATER_BYTES = 1 << 20

_NO_BODY_STATUS = frozenset({204, 304})
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica, carrying one request at a time.

    The protocol's callbacks fill ``buffer`` and wake the one reader (``_waiter``). The read
    time limit is one timer per connection, re-armed lazily: a read that waits arms it only
    when none is pending, and a timer that fires early (data came meanwhile) re-arms itself, so
    a stream's reads create no timer each.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False  # the replica closed it, it broke, or we closed it
        self.error: BaseException | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._wait_started = 0.0
        self._read_limit_s: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._cancel_timer()
        self._wake()

    # -- reading ---------------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_for_data(self, read_limit_s: float | None) -> None:
        """Wait until more bytes arrived or the connection closed. Raises ``httpx.ReadTimeout``
        after ``read_limit_s`` seconds without either (None: no limit)."""
        self._resume_reading()
        waiter = self._waiter = self._loop.create_future()
        self._wait_started = self._loop.time()
        self._read_limit_s = read_limit_s
        if read_limit_s is not None and self._timer is None:
            self._timer = self._loop.call_at(self._wait_started + read_limit_s, self._on_timer)
        try:
            await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter, limit_s = self._waiter, self._read_limit_s
        if waiter is None or waiter.done() or limit_s is None:
            return  # no read is waiting: the next one arms the timer again
        due = self._wait_started + limit_s
        if self._loop.time() >= due:
            waiter.set_exception(httpx.ReadTimeout(f"no data from the upstream in {limit_s:g} s"))
        else:
            self._timer = self._loop.call_at(due, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _resume_reading(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def take(self, size: int) -> bytes:
        """The first ``size`` buffered bytes, removed from the buffer."""
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def make_idle(self) -> None:
        """Ready the connection to wait in the pool: no read limit of the call it carried stays
        armed (a later call's shorter one would wait for it), and the socket reads again (a
        paused one would not see the replica close it)."""
        self._cancel_timer()
        self._resume_reading()
        self.idle_since = time.monotonic()

    def close(self) -> None:
        self.closed = True
        self._cancel_timer()
        if self.transport is not None:
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    """A response body as the replica frames it, read from ``connection`` piece by piece (one
    piece per read of the socket, de-chunked); gives the connection back to ``pool`` once the
    body ended cleanly, closes it otherwise."""

    def __init__(
        self,
        pool: UpstreamTransport,
        key: tuple[str, int],
        connection: _Connection,
        *,
        length: int | None,
        chunked: bool,
        keep_alive: bool,
        read_limit_s: float | None,
    ) -> None:
        self._pool = pool
        self._key = key
        self._connection = connection
        self._length = length  # content-length left to read; None: chunked or until close
        self._chunked = chunked
        self._keep_alive = keep_alive
        self._read_limit_s = read_limit_s
        self._done = length == 0 and not chunked
        self._released = False
        # chunked framing: bytes left of the current chunk's data, or -1 while a size line is
        # expected, or -2 after the last chunk (reading the trailer section)
        self._chunk_left = -1

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        try:
            while not self._done:
                piece = self._decode()
                if piece:
                    yield piece
                    continue
                if self._done:
                    break
                if connection.closed:
                    if self._length is None and not self._chunked:
                        self._done = True  # framed by the close itself
                        self._keep_alive = False
                        break
                    raise httpx.RemoteProtocolError(
                        "the upstream closed the connection before the end of the body"
                    )
                await connection.wait_for_data(self._read_limit_s)
        except BaseException:
            self._release(reusable=False)
            raise
        self._release(reusable=self._keep_alive)

    def _decode(self) -> bytes:
        """Every body byte the buffer holds now (de-chunked); sets ``_done`` at the end."""
        connection = self._connection
        buffer = connection.buffer
        if not buffer:
            return b""
        if not self._chunked:
            if self._length is None:
                return connection.take(len(buffer))
            data = connection.take(min(self._length, len(buffer)))
            self._length -= len(data)
            if self._length == 0:
                self._done = True
                if buffer:  # bytes after the body: the connection cannot be trusted again
                    self._keep_alive = False
            return data
        pieces: list[bytes | bytearray] = []
        position = 0
        size = len(buffer)
        while position < size:
            left = self._chunk_left
            if left > 0:  # inside a chunk's data
                end = min(position + left, size)
                pieces.append(buffer[position:end])
                self._chunk_left = left - (end - position)
                position = end
                if self._chunk_left == 0:
                    self._chunk_left = -3  # the CRLF after the data comes next
                continue
            line_end = buffer.find(b"\r\n", position)
            if line_end < 0:
                if size - position > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError("chunk-size line too long")
                break
            line = bytes(buffer[position:line_end])
            position = line_end + 2
            if left == -3:  # the data's CRLF
                if line:
                    raise httpx.RemoteProtocolError("chunk data not followed by CRLF")
                self._chunk_left = -1
            elif left == -1:  # a size line, maybe with extensions
                size_hex = line.split(b";", 1)[0].strip()
                # hex digits only: int(..., 16) would also take "0x1f", "+1f", "1_f"
                if not size_hex or size_hex.translate(None, _HEX_DIGITS):
                    raise httpx.RemoteProtocolError(f"bad chunk-size line {line[:40]!r}")
                chunk_size = int(size_hex, 16)
                self._chunk_left = chunk_size if chunk_size else -2
            elif not line:  # left == -2: the empty line that ends the trailer section
                self._done = True
                break
        del buffer[:position]
        if self._done and buffer:
            self._keep_alive = False
        return b"".join(pieces)

    def _release(self, *, reusable: bool) -> None:
        if self._released:
            return
        self._released = True
        if reusable and self._done:
            self._pool._give_back(self._key, self._connection)
        else:
            self._connection.close()

    async def aclose(self) -> None:
        """Give the connection back if the body was read to its end, else close it (a stream
        left early: vLLM aborts the request when its connection closes)."""
        self._release(reusable=self._keep_alive)  # reused only once ``_done`` too


class UpstreamTransport(httpx.AsyncBaseTransport):
    """httpx's transport for plain-HTTP replicas (``http://host:port``): HTTP/1.1 keep-alive
    connections on asyncio protocols, any number per replica, reused last-in first-out.

    Time limits come from the request's httpx ``timeout`` extension: ``connect`` for opening a
    connection, ``read`` for each wait for bytes (the head and every piece of the body). Errors
    are httpx's: ``ConnectTimeout``, ``ConnectError``, ``ReadTimeout``, ``ReadError``,
    ``WriteError``, ``RemoteProtocolError`` (a malformed answer, or the connection closed before
    the answer ended), ``UnsupportedProtocol`` for a URL that is not ``http://``.
    """

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"UpstreamTransport speaks http:// only, not {url}")
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        read_limit_s = timeouts.get("read")
        key = (url.host, url.port or 80)
        connection = await self._connection(key, timeouts.get("connect"))
        try:
            body = await _body_of(request)
            head = _request_head(request, body)
            # One write (one syscall) for the usual small body; a large one apart, not copied
            # once more into a joined buffer (a call's body is already held several times over:
            # docs/gateway.md, "Large bodies").
            if len(body) <= JOIN_BODY_BYTES:
                connection.transport.write(head + body)  # type: ignore[union-attr]
            else:
                connection.transport.write(head)  # type: ignore[union-attr]
                connection.transport.write(body)  # type: ignore[union-attr]
            status, reason, headers, http_11 = await _read_head(connection, read_limit_s)
        except BaseException as exc:
            connection.close()
            if isinstance(exc, OSError):
                raise httpx.WriteError(repr(exc)) from exc
            raise
        return self._response(
            request, key, connection, status, reason, headers, http_11, read_limit_s
        )

    def _response(
        self,
        request: httpx.Request,
        key: tuple[str, int],
        connection: _Connection,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        http_11: bool,
        read_limit_s: float | None,
    ) -> httpx.Response:
        length: int | None = None
        chunked = False
        keep_alive = http_11
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"content-length":
                # digits only (int() would take "-1", "+1", "1_0"), and one value if repeated
                if not value.isdigit() or (length is not None and int(value) != length):
                    connection.close()
                    raise httpx.RemoteProtocolError(f"bad content-length {value!r}")
                length = int(value)
            elif lowered == b"transfer-encoding":
                chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            elif lowered == b"connection" and b"close" in _tokens(value):
                keep_alive = False  # (an HTTP/1.0 answer is never reused, as h11 does)
        if chunked and length is not None:
            keep_alive = False  # both framings given: read it chunked, then trust it no more
        if request.method == "HEAD" or status in _NO_BODY_STATUS:
            length, chunked = 0, False
        elif chunked:
            length = None
        elif length is None:
            keep_alive = False  # the body ends when the replica closes the connection
        body = _Body(
            self,
            key,
            connection,
            length=length,
            chunked=chunked,
            keep_alive=keep_alive,
            read_limit_s=read_limit_s,
        )
        return httpx.Response(
            status,
            headers=headers,
            stream=body,
            extensions={
                "http_version": b"HTTP/1.1" if http_11 else b"HTTP/1.0",
                "reason_phrase": reason,
            },
        )

    async def _connection(self, key: tuple[str, int], connect_limit_s: float | None) -> _Connection:
        """A live idle connection to ``key``, else a new one."""
        idle = self._idle.get(key)
        if idle:
            expired_before = time.monotonic() - IDLE_EXPIRY_S
            while idle:
                connection = idle.pop()
                # a reset closes the transport a loop turn before the protocol hears; bytes
                # that came while idle answer no request of ours
                if (
                    not connection.closed
                    and not connection.transport.is_closing()  # type: ignore[union-attr]
                    and not connection.buffer
                    and connection.idle_since > expired_before
                ):
                    return connection
                connection.close()
        loop = asyncio.get_running_loop()
        host, port = key
        try:
            async with asyncio.timeout(connect_limit_s):
                _transport, connection = await loop.create_connection(
                    lambda: _Connection(loop), host, port
                )
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} took too long") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return connection

    def _give_back(self, key: tuple[str, int], connection: _Connection) -> None:
        if self._closed or connection.closed or connection.buffer:
            connection.close()  # bytes after the body (an empty one too): not to be trusted
            return
        connection.make_idle()
        self._idle.setdefault(key, []).append(connection)

    async def aclose(self) -> None:
        self._closed = True
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()


def _tokens(value: bytes) -> set[bytes]:
    """The lower-cased tokens of a comma-separated header value."""
    return {token.strip() for token in value.lower().split(b",")}


async def _body_of(request: httpx.Request) -> bytes:
    try:
        return request.content  # a body given as bytes (all of the gateway's) is already read
    except httpx.RequestNotRead:
        return await request.aread()


def _request_head(request: httpx.Request, body: bytes) -> bytes:
    """The request head for ``body``. A streamed body httpx would send chunked is sent whole
    with its length instead (the gateway's bodies are bytes)."""
    url = request.url
    target = url.raw_path or b"/"
    lines = [request.method.encode("ascii"), b" ", target, b" HTTP/1.1\r\n"]
    has_length = False
    for name, value in request.headers.raw:
        lowered = name.lower()
        if lowered == b"transfer-encoding":
            continue
        if lowered == b"content-length":
            has_length = True
        lines += [name, b": ", value, b"\r\n"]
    if not has_length and (body or request.method in ("POST", "PUT", "PATCH")):
        lines.append(b"Content-Length: %d\r\n" % len(body))
    lines.append(b"\r\n")
    return b"".join(lines)


async def _read_head(
    connection: _Connection, read_limit_s: float | None
) -> tuple[int, bytes, list[tuple[bytes, bytes]], bool]:
    """The next final response head on ``connection``: status, reason, headers and whether
    it is HTTP/1.1; informational (1xx) heads are skipped. Raises ``httpx.RemoteProtocolError``
    for a malformed head or a connection closed before one, ``httpx.ReadTimeout``."""
    while True:
        buffer = connection.buffer
        end = buffer.find(b"\r\n\r\n")
        if end > MAX_HEAD_BYTES or (end < 0 and len(buffer) > MAX_HEAD_BYTES):
            # a head that came whole in one read is as refused as one still coming
            raise httpx.RemoteProtocolError("response head too large")
        if end < 0:
            if connection.closed:
                if connection.error is not None and not isinstance(connection.error, EOFError):
                    raise httpx.ReadError(repr(connection.error))
                raise httpx.RemoteProtocolError(
                    "the upstream closed the connection without sending a response"
                )
            await connection.wait_for_data(read_limit_s)
            continue
        head = connection.take(end + 4)
        status, reason, headers, http_11 = _parse_head(head[:-4])
        if 100 <= status < 200:
            continue  # 100 Continue and the like precede the real answer
        return status, reason, headers, http_11


def _parse_head(head: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]], bool]:
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise httpx.RemoteProtocolError(f"bad status line {lines[0][:80]!r}")
    headers: list[tuple[bytes, bytes]] = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise httpx.RemoteProtocolError(f"bad header line {line[:80]!r}")
        headers.append((name, value.strip()))
    return int(parts[1]), parts[2] if len(parts) > 2 else b"", headers, parts[0] == b"HTTP/1.1"
