"""``read_ahead``: the generate stream of an exact continuation is read on while a derender call
is in flight, and what arrived meanwhile is handed over in one piece, in order, with the
stream's error after the payloads read before it (gateway/proxy/continuation/engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.proxy.continuation.engine import read_ahead


class Engine:
    """A generate stream whose reads the test releases one at a time."""

    def __init__(self, reads: list[list[bytes]], error: Exception | None = None) -> None:
        self.reads = reads
        self.error = error
        self.released = asyncio.Semaphore(0)
        self.closed = False

    async def stream(self) -> AsyncIterator[list[bytes]]:
        try:
            for read in self.reads:
                await self.released.acquire()
                yield read
            if self.error is not None:
                await self.released.acquire()
                raise self.error
        finally:
            self.closed = True


async def _settle() -> None:
    for _ in range(20):  # let the reader task take every read released so far
        await asyncio.sleep(0)


def test_reads_that_arrive_while_the_consumer_is_busy_come_as_one_list_in_order() -> None:
    async def scenario() -> list[list[bytes]]:
        engine = Engine([[b"1"], [b"2", b"3"], [b"4"], [b"5"]])
        taken: list[list[bytes]] = []
        reads = read_ahead(engine.stream())
        engine.released.release()
        taken.append(await anext(reads))  # the consumer keeps up: one read
        for _ in range(3):  # three reads arrive during a "derender"
            engine.released.release()
        await _settle()
        taken.append(await anext(reads))
        assert await anext(reads, None) is None
        return taken

    assert asyncio.run(scenario()) == [[b"1"], [b"2", b"3", b"4", b"5"]]


def test_an_error_of_the_stream_comes_after_the_payloads_read_before_it() -> None:
    async def scenario() -> tuple[list[list[bytes]], BaseException]:
        engine = Engine([[b"1"], [b"2"]], error=httpx.ReadError("upstream hung up"))
        reads = read_ahead(engine.stream())
        for _ in range(3):
            engine.released.release()
        await _settle()
        taken = [await anext(reads)]
        with pytest.raises(httpx.ReadError) as raised:
            await anext(reads)
        return taken, raised.value

    taken, error = asyncio.run(scenario())
    assert taken == [[b"1", b"2"]]
    assert str(error) == "upstream hung up"


def test_closing_the_reader_early_stops_reading_the_stream() -> None:
    async def scenario() -> Engine:
        engine = Engine([[b"1"], [b"2"], [b"3"]])
        reads = read_ahead(engine.stream())
        engine.released.release()
        assert await anext(reads) == [b"1"]
        await reads.aclose()  # the client left: the reader task is cancelled
        await _settle()
        return engine

    engine = asyncio.run(scenario())
    assert engine.closed
