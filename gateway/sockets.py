"""The upstream calls' sockets: httpcore's network backend on plain asyncio protocols.

Owns: ``AsyncioBackend`` (connect, with the connect timeout and socket options) and the stream
it hands httpcore (read with the read timeout, write with flow control, TLS upgrade, liveness),
and ``use_asyncio_sockets``, which puts it under an httpx transport. HTTP itself stays
httpcore's and h11's: this module only moves bytes. Never: parses, buffers beyond what one read
returns, or retries.

Why: an upstream stream is read once per SSE event, and httpcore's default backend (anyio)
spends per read a checkpoint (one more event-loop turn), a cancel scope for the timeout and an
event to wake the reader. On the 2-core machine a 290-byte chunked read cost 48 us of CPU
(client and test server) through it and 30 us through this one. A read arms a timer only when
it has to wait.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import typing
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

# httpcore's SOCKET_OPTION: (level, option, value) or (level, option, None, length)
SocketOption = tuple[Any, ...]


# Bytes held for a reader that does not read (its client is slow) before the socket stops
# reading, so the upstream's own send buffer fills and TCP slows it down.
MAX_BUFFERED_BYTES = 1 << 20


class _Protocol(asyncio.Protocol):
    """The receiving end: buffers what arrives until the stream's ``read`` takes it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.received: list[bytes] = []
        self.buffered_bytes = 0
        self.reading_paused = False
        self.closed = False  # the peer ended the stream, or the connection was lost
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None  # a ``read`` waiting for data
        self.drained: asyncio.Future[None] | None = None  # a ``write`` waiting for room

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received.append(data)
        self.buffered_bytes += len(data)
        if self.buffered_bytes > MAX_BUFFERED_BYTES and self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True
        self._wake()

    def taken(self, remaining: list[bytes]) -> None:
        """The reader took what was buffered but ``remaining``."""
        self.received = remaining
        self.buffered_bytes = sum(len(part) for part in remaining)
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        if self.drained is None:
            self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None:
            if not self.drained.done():
                self.drained.set_result(None)
            self.drained = None

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One connection to an upstream, as httpcore reads and writes it."""

    def __init__(self, protocol: _Protocol) -> None:
        self._protocol = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """What has arrived (at most ``max_bytes``), waiting up to ``timeout`` s for something;
        ``b""`` once the peer closed. Raises ``httpcore.ReadTimeout``, ``httpcore.ReadError``."""
        protocol = self._protocol
        if not protocol.received and not protocol.closed:
            loop = asyncio.get_running_loop()
            waiter = protocol.waiter = loop.create_future()
            timer = None if timeout is None else loop.call_later(timeout, _time_out, waiter)
            try:
                await waiter
            except TimeoutError:
                raise httpcore.ReadTimeout(f"no data within {timeout} s") from None
            finally:
                protocol.waiter = None
                if timer is not None:
                    timer.cancel()
        received = protocol.received
        if received:
            data = received[0] if len(received) == 1 else b"".join(received)
            if len(data) > max_bytes:
                protocol.taken([data[max_bytes:]])
                return data[:max_bytes]
            protocol.taken([])
            return data
        if protocol.error is not None:
            raise httpcore.ReadError(str(protocol.error)) from protocol.error
        return b""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """Send ``buffer``, waiting up to ``timeout`` s while the socket's buffer is full.
        Raises ``httpcore.WriteError`` on a closed connection, ``httpcore.WriteTimeout``."""
        protocol = self._protocol
        transport = protocol.transport
        if transport is None or transport.is_closing():
            raise httpcore.WriteError("connection closed")
        transport.write(buffer)
        drained = protocol.drained
        if drained is not None:
            try:
                await asyncio.wait_for(asyncio.shield(drained), timeout)
            except TimeoutError:
                raise httpcore.WriteTimeout(f"could not send within {timeout} s") from None
        if protocol.error is not None:
            raise httpcore.WriteError(str(protocol.error)) from protocol.error

    async def aclose(self) -> None:
        if self._protocol.transport is not None:
            self._protocol.transport.close()

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """The same connection after a TLS handshake (an ``https`` upstream)."""
        protocol = self._protocol
        assert protocol.transport is not None, "connected before the handshake"
        try:
            tls = await asyncio.get_running_loop().start_tls(
                protocol.transport,
                protocol,
                ssl_context,
                server_hostname=server_hostname,
                ssl_handshake_timeout=timeout,
            )
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"TLS handshake took over {timeout} s") from exc
        except (OSError, ssl.SSLError) as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        if tls is None:
            raise httpcore.ConnectError("TLS handshake failed: the connection closed")
        protocol.transport = tls
        return self

    def get_extra_info(self, info: str) -> Any:
        """What httpcore asks: ``is_readable`` (an idle keep-alive connection the server
        closed, or sent something on, must not be reused), and the transport's own keys."""
        protocol = self._protocol
        if info == "is_readable":
            return protocol.closed or bool(protocol.received)
        if protocol.transport is None:
            return None
        if info == "ssl_object":
            return protocol.transport.get_extra_info("ssl_object")
        if info == "client_addr":
            return protocol.transport.get_extra_info("sockname")
        if info == "server_addr":
            return protocol.transport.get_extra_info("peername")
        if info == "socket":
            return protocol.transport.get_extra_info("socket")
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """TCP connections as ``AsyncioStream``; Unix sockets are not served (an upstream is a URL)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        """Raises ``httpcore.ConnectTimeout`` past ``timeout`` s, ``httpcore.ConnectError``."""
        loop = asyncio.get_running_loop()
        local = None if local_address is None else (local_address, 0)
        try:
            _transport, protocol = await asyncio.wait_for(
                loop.create_connection(_Protocol, host, port, local_addr=local), timeout
            )
        except TimeoutError as exc:
            raise httpcore.ConnectTimeout(f"no connection within {timeout} s") from exc
        except OSError as exc:
            raise httpcore.ConnectError(str(exc)) from exc
        sock = protocol.transport.get_extra_info("socket") if protocol.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
        return AsyncioStream(protocol)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[SocketOption] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError(f"unix sockets are not served by this backend ({path})")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def use_asyncio_sockets(transport: httpx.AsyncHTTPTransport) -> bool:
    """Put ``AsyncioBackend`` under ``transport``'s connection pool; False (and the transport
    unchanged, on anyio's backend) when the pool is not httpcore's own (a proxy, another
    httpx version). httpx takes no backend as a parameter, so its pool's is replaced."""
    pool = getattr(transport, "_pool", None)
    if type(pool) is not httpcore.AsyncConnectionPool or not hasattr(pool, "_network_backend"):
        return False
    pool._network_backend = AsyncioBackend()
    return True
