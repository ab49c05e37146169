"""The gateway's own upstream transport and SSE reader, against a real socket server.

The emulator (``gateway.emulator``) serves vLLM-shaped answers over real HTTP/1.1: non-streaming
ones with ``content-length``, streams with ``transfer-encoding: chunked``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.emulator import EmulatorSettings, EmulatorThread
from gateway.streaming import sse_data
from gateway.transport import UpstreamTransport
from tests.tests_support import free_port


async def _chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _events(*parts: bytes) -> list[bytes]:
    return [data async for data in sse_data(_chunks(*parts))]


def test_sse_events_split_anywhere_read_the_same() -> None:
    body = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    whole = asyncio.run(_events(body))
    byte_by_byte = asyncio.run(_events(*(body[i : i + 1] for i in range(len(body)))))
    assert whole == byte_by_byte == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


def test_sse_line_endings_multiline_data_and_comments_follow_the_sse_rules() -> None:
    # CRLF split between two reads must not end the event early; two data lines join with LF;
    # a comment and an event name are ignored; an event without data is no event.
    events = asyncio.run(
        _events(b": keep-alive\r\nevent: x\r\ndata: one\r", b"\ndata:two\r\n\r\n", b"\n\nid: 3\n\n")
    )
    assert events == [b"one\ntwo"]


@pytest.fixture()
def emulator() -> AsyncIterator[EmulatorThread]:
    thread = EmulatorThread(
        EmulatorSettings(port=free_port(), prompt_tokens=5, response_tokens=7)
    ).start()
    yield thread
    thread.stop()


def test_answers_are_read_whole_and_connections_are_reused(emulator: EmulatorThread) -> None:
    async def run() -> tuple[list[int], int, int]:
        transport = UpstreamTransport()
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            body = {
                "model": "emulated",
                "messages": [{"role": "user", "content": "hi"}],
                "return_token_ids": True,
            }
            lengths = []
            for _ in range(3):
                answer = await client.post(f"{emulator.url}/v1/chat/completions", json=body)
                lengths.append(len(answer.json()["choices"][0]["token_ids"]))
            stream = await client.send(
                client.build_request(
                    "POST", f"{emulator.url}/v1/chat/completions", json={**body, "stream": True}
                ),
                stream=True,
            )
            events = [data async for data in sse_data(stream.aiter_bytes())]
            await stream.aclose()
            idle = sum(len(stack) for stack in transport._idle.values())
            return lengths, len(events), idle

    lengths, events, idle = asyncio.run(run())
    assert lengths == [7, 7, 7]
    assert events == 1 + 7 + 1  # role chunk, 7 token chunks, [DONE]
    assert idle == 1  # four calls, one after the other, on one kept-alive connection


def test_an_answer_closed_early_closes_its_connection(emulator: EmulatorThread) -> None:
    async def run() -> int:
        transport = UpstreamTransport()
        async with httpx.AsyncClient(transport=transport, timeout=10) as client:
            body = {"model": "emulated", "messages": [{"role": "user", "content": "hi"}]}
            stream = await client.send(
                client.build_request(
                    "POST", f"{emulator.url}/v1/chat/completions", json={**body, "stream": True}
                ),
                stream=True,
            )
            async for _ in sse_data(stream.aiter_bytes()):
                break
            await stream.aclose()
            return sum(len(stack) for stack in transport._idle.values())

    assert asyncio.run(run()) == 0  # never reused: the upstream must see the client go away


def test_silence_past_the_read_limit_is_a_read_timeout() -> None:
    slow = EmulatorThread(
        EmulatorSettings(port=free_port(), prompt_tokens=2, response_tokens=3, ttft_ms=2000)
    ).start()

    async def run() -> None:
        timeout = httpx.Timeout(10, read=0.2)
        async with httpx.AsyncClient(transport=UpstreamTransport(), timeout=timeout) as client:
            await client.post(
                f"{slow.url}/v1/chat/completions",
                json={"model": "emulated", "messages": [{"role": "user", "content": "hi"}]},
            )

    try:
        with pytest.raises(httpx.ReadTimeout):
            asyncio.run(run())
    finally:
        slow.stop()


def test_an_unreachable_upstream_is_a_connect_error() -> None:
    async def run() -> None:
        async with httpx.AsyncClient(transport=UpstreamTransport(), timeout=5) as client:
            await client.get(f"http://127.0.0.1:{free_port()}/health")

    with pytest.raises(httpx.ConnectError):
        asyncio.run(run())
