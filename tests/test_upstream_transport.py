"""The gateway's own HTTP/1.1 transport (``gateway.upstream.transport``) reads exactly the body
the upstream framed, wherever the reads cut it, and handles connections as httpx's does.

The framing is checked against h11 (the HTTP/1.1 library under httpx's default transport): the
same framed bytes are fed to an h11 client connection and to the transport's body reader, cut
into reads at every byte and at random offsets; both must give the body that was framed.
Connection handling (reuse, closes, time limits, errors) is checked against small asyncio servers
on real sockets; the transport's use against vLLM itself is every streaming and unary test that
compares the client's bytes with vLLM's own (e.g. ``tests/test_gateway_vllm.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import h11
import httpx
import pytest

from gateway.upstream.transport import HIGH_WATER_BYTES, UpstreamTransport, _Body, _Connection

# On uvloop, as ``trajgate serve`` runs (its transports are not asyncio's classes).
pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    return ("asyncio", {"use_uvloop": True})


# Bodies that contain what a framing reader could mistake for its own syntax.
BODIES = [
    b"",
    b"x",
    b'data: {"a":1}\n\ndata: [DONE]\n\n',
    b"0\r\n\r\n" * 3 + b"\r\n",
    bytes(range(256)) * 3,
]


def chunked(body: bytes, rng: random.Random) -> bytes:
    """``body`` in chunked framing: random chunk sizes, hex in either case, sometimes a chunk
    extension, and a trailer section."""
    out = []
    position = 0
    while position < len(body):
        size = rng.randint(1, 40)
        data = body[position : position + size]
        position += len(data)
        size_hex = format(len(data), "x")
        size_hex = size_hex.upper() if rng.random() < 0.5 else size_hex
        extension = b";name=value" if rng.random() < 0.2 else b""
        out.append(size_hex.encode() + extension + b"\r\n" + data + b"\r\n")
    trailer = b"X-Trailer: yes\r\n" if rng.random() < 0.5 else b""
    out.append(b"0\r\n" + trailer + b"\r\n")
    return b"".join(out)


def framed_body(body: bytes, framing: str, rng: random.Random) -> bytes:
    return chunked(body, rng) if framing == "chunked" else body


def head_of(body: bytes, framing: str) -> bytes:
    if framing == "chunked":
        return b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)


def h11_body(response: bytes) -> bytes:
    """The body h11 reads from ``response`` (the reference)."""
    connection = h11.Connection(h11.CLIENT)
    connection.send(h11.Request(method="POST", target="/", headers=[("host", "x")]))
    connection.send(h11.EndOfMessage())
    connection.receive_data(response)
    body = b""
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return body
        elif event is h11.NEED_DATA:
            raise AssertionError("h11 wants more data: the framing under test is incomplete")


def cut(data: bytes, offsets: list[int]) -> list[bytes]:
    bounds = [0, *sorted(set(offsets)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


class _Pool:
    """Stands in for the transport: records whether the body gave its connection back."""

    def __init__(self) -> None:
        self.given_back: list[_Connection] = []

    def _give_back(self, _key: tuple[str, int], connection: _Connection) -> None:
        self.given_back.append(connection)


async def read_body(framed: bytes, pieces: list[bytes], framing: str) -> tuple[bytes, bool]:
    """The body ``_Body`` reads when ``framed`` arrives as ``pieces`` (one read each), and
    whether the connection was given back for reuse."""
    connection = _Connection(asyncio.get_running_loop())
    pool = _Pool()
    body = _Body(
        pool,  # type: ignore[arg-type]
        ("upstream", 80),
        connection,
        length=None if framing == "chunked" else len(framed),
        chunked=framing == "chunked",
        keep_alive=True,
        read_limit_s=5.0,
    )

    async def feed() -> None:
        for piece in pieces:
            connection.data_received(piece)
            await asyncio.sleep(0)

    feeder = asyncio.create_task(feed())
    data = b"".join([piece async for piece in body])
    await feeder
    return data, pool.given_back == [connection]


@pytest.mark.parametrize("framing", ["chunked", "length"])
@pytest.mark.parametrize("body", BODIES, ids=range(len(BODIES)))
async def test_body_is_what_h11_reads_at_every_cut(body: bytes, framing: str) -> None:
    rng = random.Random(len(body))
    framed = framed_body(body, framing, rng)
    assert h11_body(head_of(body, framing) + framed) == body
    variants = [cut(framed, list(range(1, len(framed))))]  # every byte its own read
    for seed in range(20):
        cuts_rng = random.Random(seed)
        variants.append(cut(framed, [cuts_rng.randrange(1, max(2, len(framed))) for _ in range(8)]))
    variants.append([framed])  # one read
    for pieces in variants:
        assert await read_body(framed, pieces, framing) == (body, True)


async def test_bytes_after_the_end_of_a_body_make_the_connection_single_use() -> None:
    framed = chunked(b"hello", random.Random(0))
    data, reused = await read_body(framed, [framed + b"HTTP/1.1 200 OK\r\n"], "chunked")
    assert (data, reused) == (b"hello", False)


async def test_a_malformed_chunk_size_is_a_protocol_error() -> None:
    with pytest.raises(httpx.RemoteProtocolError, match="chunk-size"):
        await read_body(b"zz\r\nhello\r\n0\r\n\r\n", [b"zz\r\nhello\r\n0\r\n\r\n"], "chunked")


# -- real sockets ---------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A local server running ``handler`` per connection; yields its base URL and a list that
    counts the connections it accepted."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    srv = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    async with srv:
        yield f"http://127.0.0.1:{port}", accepted


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's body (its head must give a content-length); None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return await reader.readexactly(length)


def answer(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        b"".join(h + b"\r\n" for h in extra),
        body,
    )


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while (body := await read_request(reader)) is not None:
        writer.write(answer(b"echo:" + body))
        await writer.drain()


def client(**timeouts: float) -> httpx.AsyncClient:
    timeout = httpx.Timeout(5.0, **timeouts)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=UpstreamTransport(), timeout=timeout)


async def test_keep_alive_connections_are_reused_and_bodies_are_sent_whole() -> None:
    async with server(echo_forever) as (url, accepted), client() as http:
        for k in range(3):
            response = await http.post(f"{url}/v1/x?q=1", content=b"call %d" % k)
            assert (response.status_code, response.content) == (200, b"echo:call %d" % k)
        assert len(accepted) == 1


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"one"))
        await writer.drain()  # then the handler returns and the server closes the connection

    async with server(once) as (url, accepted), client() as http:
        for _ in range(3):
            assert (await http.post(url, content=b"x")).content == b"one"
            await asyncio.sleep(0.05)  # the close reaches the client's idle connection
        assert len(accepted) == 3


async def test_informational_heads_are_skipped_and_204_has_no_body() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\nx-a: b\r\n\r\n")
        await read_request(reader)
        writer.write(answer(b"second"))
        await writer.drain()

    async with server(handler) as (url, accepted), client() as http:
        first = await http.post(url, content=b"x")
        assert (first.status_code, first.headers["x-a"], first.content) == (204, "b", b"")
        assert (await http.post(url, content=b"x")).content == b"second"
        assert len(accepted) == 1


async def test_a_silent_upstream_raises_read_timeout() -> None:
    stalled = asyncio.Event()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await stalled.wait()

    async with server(stall) as (url, _), client(read=0.2) as http:
        async with http.stream("POST", url, content=b"x") as response:
            pieces = response.aiter_bytes()
            assert await pieces.__anext__() == b"hello"
            with pytest.raises(httpx.ReadTimeout):
                await pieces.__anext__()
        stalled.set()


async def test_leaving_a_stream_early_closes_its_connection() -> None:
    """vLLM aborts a request whose connection closes: that is how an abandoned stream stops
    generating."""
    server_saw_eof = asyncio.Event()

    async def endless_loop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:
            try:
                writer.write(b"6\r\nevent\n\r\n")
                await writer.drain()
                data = await asyncio.wait_for(reader.read(1), 0.01)
            except TimeoutError:
                continue
            except ConnectionError:
                data = b""
            if data == b"":
                server_saw_eof.set()
                return

    async with server(endless_loop) as (url, _), client() as http:
        async with http.stream("POST", url, content=b"x") as response:
            async for piece in response.aiter_bytes():
                assert piece.startswith(b"event")
                break
        await asyncio.wait_for(server_saw_eof.wait(), 5.0)


async def test_a_body_cut_short_is_a_protocol_error_and_errors_are_httpx_errors() -> None:
    async def short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await writer.drain()

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 200\r\n\r\n")
        await writer.drain()

    async with server(short) as (url, _), client() as http:
        with pytest.raises(httpx.RemoteProtocolError, match="before the end of the body"):
            await http.post(url, content=b"x")
    async with server(garbage) as (url, _), client() as http:
        with pytest.raises(httpx.RemoteProtocolError, match="bad status line"):
            await http.post(url, content=b"x")
    async with server(echo_forever) as (url, _):
        pass  # closed: nothing listens on its port now
    async with client() as http:
        with pytest.raises(httpx.ConnectError):
            await http.post(url, content=b"x")
        with pytest.raises(httpx.UnsupportedProtocol):
            await http.post("https://127.0.0.1:1/", content=b"x")


# -- connections handed back to the pool --------------------------------------------------


async def test_a_reused_connection_keeps_no_read_limit_of_the_call_before() -> None:
    """A unary call (read limit: the total one) and then a stream with a shorter one on the
    same connection: the stream's limit holds, not the longer one still armed from before."""
    stalled = asyncio.Event()

    async def then_stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"first"))
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await stalled.wait()

    async with server(then_stall) as (url, accepted), client() as http:
        long = httpx.Timeout(5.0, read=60.0)
        assert (await http.post(url, content=b"x", timeout=long)).content == b"first"
        async with http.stream("POST", url, content=b"x", timeout=0.2) as response:
            pieces = response.aiter_bytes()
            assert await pieces.__anext__() == b"hello"
            # 0.2 s is the limit; 60 s would be the first call's: wait_for tells them apart
            with pytest.raises(httpx.ReadTimeout):
                await asyncio.wait_for(pieces.__anext__(), 10.0)
        stalled.set()
        assert len(accepted) == 1


async def test_a_connection_paused_by_a_large_body_sees_its_close_once_idle() -> None:
    """A body that filled the buffer past the high-water mark pauses reading; the connection
    must read again once idle, or the replica's close of it goes unseen and the next call is
    written to a closed connection."""
    body = b"b" * (HIGH_WATER_BYTES + 1)
    sent = asyncio.Event()

    async def large_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(body))
        await writer.drain()
        sent.set()  # then the handler returns and the server closes the connection

    async with server(large_then_close) as (url, accepted), client() as http:
        async with http.stream("POST", url, content=b"x") as response:
            await sent.wait()
            await asyncio.sleep(0.2)  # all of the body is buffered: the socket is paused
            assert await response.aread() == body
        await asyncio.sleep(0.2)  # the close reaches the idle connection
        assert await (await http.post(url, content=b"x")).aread() == body
        assert len(accepted) == 2


async def test_an_idle_connection_that_received_bytes_is_not_reused() -> None:
    async def unsolicited(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (body := await read_request(reader)) is not None:
            writer.write(answer(b"echo:" + body))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(answer(b"unsolicited"))
            await writer.drain()

    async with server(unsolicited) as (url, accepted), client() as http:
        assert (await http.post(url, content=b"1")).content == b"echo:1"
        await asyncio.sleep(0.2)  # the unsolicited answer reaches the idle connection
        assert (await http.post(url, content=b"2")).content == b"echo:2"
        assert len(accepted) == 2


async def test_a_connection_reset_while_idle_is_not_reused_before_its_protocol_hears() -> None:
    """A reset closes the transport at once but tells the protocol one loop turn later; a call
    in between must not be written to it (it would fail with ``ReadError``)."""
    reset = asyncio.Event()

    async def answer_then_reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await read_request(reader) is None:
            return
        writer.write(answer(b"ok"))
        await writer.drain()
        if reset.is_set():
            return  # the second connection: a clean close
        await reset.wait()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # an RST, not a FIN

    transport = UpstreamTransport()
    async with (
        server(answer_then_reset) as (url, accepted),
        httpx.AsyncClient(transport=transport) as http,
    ):
        assert (await http.post(url, content=b"x")).content == b"ok"
        [idle] = next(iter(transport._idle.values()))
        reset.set()
        while not idle.transport.is_closing():  # type: ignore[union-attr]
            await asyncio.sleep(0)
        assert not idle.closed  # the window this test is about
        assert (await http.post(url, content=b"x")).content == b"ok"
        assert len(accepted) == 2


@pytest.mark.parametrize("size_line", [b"0x5", b"+5", b"5_", b"", b"-5", b"5 5"])
async def test_a_chunk_size_that_is_not_hex_digits_is_a_protocol_error(size_line: bytes) -> None:
    framed = size_line + b"\r\nhello\r\n0\r\n\r\n"
    with pytest.raises(httpx.RemoteProtocolError, match="chunk-size"):
        await read_body(framed, [framed], "chunked")


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\nabc",  # int() would take it
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok!",
    ],
    ids=["negative", "two values"],
)
async def test_a_content_length_h11_would_refuse_is_a_protocol_error(head: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head)
        await writer.drain()

    async with server(handler) as (url, _), client() as http:
        with pytest.raises(httpx.RemoteProtocolError, match="content-length"):
            await http.post(url, content=b"x")


@pytest.mark.parametrize(
    ("raw", "body", "server_closes"),
    [
        (b"HTTP/1.0 200 OK\r\n\r\nall of it", b"all of it", True),  # framed by the close
        (answer(b"") + answer(b"stale"), b"", False),  # bytes after an empty body
        (b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok", b"ok", False),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n"
            b"2\r\nok\r\n0\r\n\r\n",
            b"ok",
            False,
        ),
    ],
    ids=["until close", "bytes after an empty body", "HTTP/1.0 keep-alive", "both framings"],
)
async def test_answers_after_which_h11_would_not_reuse_a_connection_are_single_use(
    raw: bytes, body: bytes, server_closes: bool
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader) is not None:
            writer.write(raw)
            await writer.drain()
            if server_closes:
                return

    async with server(handler) as (url, accepted), client() as http:
        assert (await http.post(url, content=b"x")).content == body
        assert (await http.post(url, content=b"x")).content == body
        assert len(accepted) == 2
