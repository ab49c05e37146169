"""The upstream sockets (``gateway.sockets``) under httpx, against a real asyncio server: the bytes
arrive whole and in order, silences and refusals raise httpx's own errors, and a keep-alive
connection the server closed is never reused."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from gateway.sockets import AsyncioBackend, use_asyncio_sockets

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
EVENTS = [f'data: {{"n":{n},"text":"é漢😀"}}\n\n'.encode() for n in range(50)]


def client() -> httpx.AsyncClient:
    transport = httpx.AsyncHTTPTransport()
    assert use_asyncio_sockets(transport)
    return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, read=0.3))


async def serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def chunked_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers each request with ``EVENTS`` as a chunked stream, one write per event."""
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in EVENTS:
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                await writer.drain()
                await asyncio.sleep(0.001)
            writer.write(b"0\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def test_a_chunked_stream_arrives_whole_and_in_order_on_a_reused_connection() -> None:
    async def run() -> list[bytes]:
        server, url = await serve(chunked_events)
        bodies = []
        async with server, client() as http:
            for _ in range(3):  # the same keep-alive connection each time
                async with http.stream("GET", url) as response:
                    bodies.append(b"".join([piece async for piece in response.aiter_bytes()]))
        return bodies

    assert asyncio.run(run()) == [b"".join(EVENTS)] * 3


def test_a_silence_past_the_read_timeout_raises_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await asyncio.sleep(2)  # longer than the client's read timeout of 0.3 s
        writer.close()

    async def run() -> bytes:
        server, url = await serve(silent)
        received = b""
        async with server, client() as http, http.stream("GET", url) as response:
            with pytest.raises(httpx.ReadTimeout):
                async for piece in response.aiter_bytes():
                    received += piece
        return received

    assert asyncio.run(run()) == b"hello"


def test_a_refused_connection_raises_connect_error() -> None:
    async def run() -> None:
        server, url = await serve(chunked_events)
        server.close()
        await server.wait_closed()
        async with client() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(url)

    asyncio.run(run())


def test_a_keep_alive_connection_the_server_closed_is_not_reused() -> None:
    connections = 0

    async def one_answer_then_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal connections
        connections += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # without "connection: close": the client must notice on its own

    async def run() -> list[int]:
        server, url = await serve(one_answer_then_close)
        async with server, client() as http:
            first = await http.get(url)
            await asyncio.sleep(0.05)  # the close reaches the client's idle connection
            second = await http.get(url)
        return [first.status_code, second.status_code, connections]

    assert asyncio.run(run()) == [200, 200, 2]


def test_the_backend_is_used_only_under_httpcores_own_pool() -> None:
    plain = httpx.AsyncHTTPTransport()
    assert use_asyncio_sockets(plain)
    assert isinstance(plain._pool._network_backend, AsyncioBackend)
    proxied = httpx.AsyncHTTPTransport(proxy="http://127.0.0.1:9")
    assert not use_asyncio_sockets(proxied)


def test_a_reader_slower_than_the_upstream_gets_every_byte_in_order() -> None:
    # 4 MiB sent at once, more than the 1 MiB the socket buffers before it stops reading.
    blob = bytes(range(256)) * (4 * 4096)

    async def burst(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(blob) + blob)
        await writer.drain()
        writer.close()

    async def run() -> bytes:
        server, url = await serve(burst)
        parts = []
        async with server, client() as http, http.stream("GET", url) as response:
            async for piece in response.aiter_raw():
                parts.append(piece)
                await asyncio.sleep(0.001)  # the client this stream is relayed to is slow
        return b"".join(parts)

    assert asyncio.run(run()) == blob
