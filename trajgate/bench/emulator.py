"""A fast upstream that answers chat completions in vLLM 0.32's exact shapes, for benchmarks.

Owns: ``POST /v1/chat/completions`` (non-streaming and SSE streaming), ``GET /v1/models`` and
``GET /health`` on a raw asyncio HTTP/1.1 server, with configurable prompt and response lengths
(tokens), time to first token and inter-token delay (ms), and seeded, deterministic token ids and
logprobs. Never: tokenizes or runs a model. By default (``prompt_ids="fixed"``) the prompt's IDs
are ``prompt_tokens`` seeded ints whatever the messages say, so it measures a proxy, never an
engine; with ``prompt_ids="messages"`` they follow the messages the way a chat template's do
(``ResponseBook.prompt_of``), so a conversation that carries the emulator's previous answer
extends that call's prompt and response IDs, and the pool's lineage has something to check.

Shapes (checked against the real vLLM 0.32 server, see tests/test_bench_gateway.py):

- non-streaming: top-level ``prompt_token_ids`` and per-choice ``token_ids`` and ``logprobs``
  are always present, ``null`` unless asked with ``return_token_ids`` / ``logprobs``;
- streaming: per choice, a first chunk with ``delta: {role, content: ""}`` and top-level
  ``prompt_token_ids`` (``null`` unless asked), then one chunk per token with per-choice
  ``token_ids`` (``null`` unless asked) and ``logprobs``; the last token chunk carries
  ``finish_reason``, ``stop_reason`` and (without a usage chunk) ``system_fingerprint``; with
  ``stream_options.include_usage`` a final chunk with ``choices: []``, ``usage`` and
  ``system_fingerprint``; then ``data: [DONE]``.

Deliberately different from vLLM: ``top_logprobs`` is always ``[]``; ``n`` choices stream
round-robin, one token each; a response ends at ``response_tokens`` (``finish_reason: "stop"``) or
earlier at ``max_tokens`` / ``max_completion_tokens`` (``"length"``); with ``prompt_ids="messages"``
one that stops stopped on the end token, its last id, which is no text (``ResponseBook.text_of``),
so a chat answer, a derendered generate answer and their echo are one token sequence. Responses
are serialised once per shape and reused with a fresh ``id`` and ``created``, so the emulator
costs a few microseconds of CPU per request and per chunk (uvicorn's h11 stack was the
bottleneck; see docs/benchmarks.md).

``EmulatorThread.stall_streams`` makes every streamed answer stop after its first token until
``resume_streams`` (an engine that stopped sampling mid-answer), so a test that must cut a stream
mid-way knows the stream is still open whatever the machine's load (tests/test_pool_crash.py).

``EmulatorThread.hold_answers`` makes every unary answer (chat and generate) wait, sampled,
until ``release_answers`` (``held_answers`` says how many wait), so a test knows a call is in
flight upstream while it does something else (tests/test_weight_updates_failed.py). The
weight-update endpoints a full-weight update sends (``trajgate.bench.weight_endpoints``) answer
as vLLM's dev mode does. ``EmulatorThread.fail`` makes any path answer an error status, hang
(no byte ever) or trickle (a 200 head, then a body byte every 0.1 s that never ends: a peer
that beats every per-read timeout).

``ResponseBook.token_times`` keeps, for the latest streamed answers, when each token's chunk was
written (``time.monotonic()`` seconds, taken just before the write), so a test can compare when
a client received a token with when the engine sent it (tests/test_dialect_streaming.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable

from trajgate.bench import scale_out, weight_endpoints
from trajgate.bench.book import (
    _MAX_HEAD_BYTES,
    SYSTEM_FINGERPRINT,
    TRICKLE_S,
    EmulatorSettings,
    Fault,
    ResponseBook,
    _dumps,
    _Shape,
)

__all__ = ["SYSTEM_FINGERPRINT", "EmulatorSettings", "EmulatorThread", "ResponseBook", "serve"]


def _error(status: int, message: str) -> tuple[int, bytes]:
    error = {"message": message, "type": "BadRequestError", "param": None, "code": status}
    return status, _dumps({"error": error})


_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; requests on it are answered one after another."""

    def __init__(self, book: ResponseBook) -> None:
        self.book = book
        self.buffer = bytearray()
        self.busy = False
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        # A client that hangs up aborts its request, as vLLM aborts generation.
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.busy:
            self._next_request()

    def _next_request(self) -> None:
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            if len(self.buffer) > _MAX_HEAD_BYTES and self.transport is not None:
                self.transport.close()
            return
        lines = bytes(self.buffer[:head_end]).decode("latin-1").split("\r\n")
        method, target = lines[0].split(" ", 2)[:2]
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        if len(self.buffer) < head_end + 4 + length:
            return
        body = bytes(self.buffer[head_end + 4 : head_end + 4 + length])
        del self.buffer[: head_end + 4 + length]
        self.busy = True
        self.task = asyncio.ensure_future(self._answer(method, target.split("?", 1)[0], body))

    async def _answer(self, method: str, path: str, body: bytes) -> None:
        try:
            await self._route(method, path, body)
        finally:
            self.busy = False
        if self.buffer and self.transport is not None:
            self._next_request()

    async def _route(self, method: str, path: str, body: bytes) -> None:
        if path in weight_endpoints.PATHS:
            self.book.weights.asked.append(path)
        fault = self.book.faults.get(path)
        if fault is not None:
            await self._fail(path, fault)
        elif path == "/health" and method == "GET":
            self._send(200, b"")
        elif path == "/v1/models" and method == "GET":
            base = self.book.settings.model
            # The more names are listed as vLLM lists the LoRA adapters it loaded: with parent.
            entries = [{"id": base, "object": "model", "owned_by": "vllm"}] + [
                {"id": name, "object": "model", "owned_by": "vllm", "parent": base}
                for name in self.book.settings.also_serves
            ]
            self._send(200, _dumps({"object": "list", "data": entries}))
        elif path == "/v1/chat/completions" and method == "POST":
            await self._chat(body)
        elif path in scale_out.PATHS and self.book.settings.prompt_ids == "messages":
            if method != "POST":
                self._send(*_error(405, f"method {method} not allowed on {path}"))
            else:
                await self._scale_out(path, body)
        elif path in weight_endpoints.PATHS and method == "POST":
            status, answer = self.book.weights.answer(path, body)
            self._send(status, _dumps(answer))
        elif path in ("/health", "/v1/models", "/v1/chat/completions"):
            self._send(*_error(405, f"method {method} not allowed on {path}"))
        else:
            self._send(*_error(404, f"no route {path}; the emulator serves /v1/chat/completions"))

    async def _chat(self, raw: bytes) -> None:
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
            shape = self.book.shape_of(body)
            prompt = self.book.chat_prompt_of(body)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            self._send(*_error(400, str(exc)))
            return
        settings = self.book.settings
        started = time.monotonic()
        parts = self.book.render(shape, f"chatcmpl-{os.urandom(8).hex()}", int(time.time()), prompt)
        first_at = started + settings.ttft_ms / 1000.0
        gap_s = settings.inter_token_ms / 1000.0
        if not shape.stream:
            await _sleep_until(first_at + gap_s * (shape.completion_tokens - 1))
            await self._held()
            self._send(200, parts[0])
            return
        await self._stream(parts, shape, 2 * shape.n, first_at, gap_s)

    async def _scale_out(self, path: str, raw: bytes) -> None:
        """The token-in, token-out endpoints (``trajgate.bench.scale_out``)."""

        request_id = os.urandom(8).hex()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
            if path == scale_out.RENDER_PATH:
                self._send(200, _dumps(scale_out.render(self.book, body, request_id)))
                return
            if path == scale_out.DERENDER_PATH:
                self._send(200, _dumps(scale_out.derender(self.book, body, request_id)))
                return
            shape = scale_out.generate_shape(self.book, body)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            self._send(*_error(400, str(exc)))
            return
        parts = scale_out.generate_parts(self.book, shape, request_id, len(body["token_ids"]))
        settings = self.book.settings
        first_at = time.monotonic() + settings.ttft_ms / 1000.0
        gap_s = settings.inter_token_ms / 1000.0
        if not shape.stream:
            await _sleep_until(first_at + gap_s * (shape.completion_tokens - 1))
            await self._held()
            self._send(200, parts[0])
            return
        await self._stream(parts, shape, shape.n, first_at, gap_s)

    async def _fail(self, path: str, fault: Fault) -> None:
        """Answer as ``fault`` says (``EmulatorThread.fail``); a hang or a trickle ends when
        the client hangs up (``connection_lost`` cancels this task)."""
        if fault == "hang":
            await asyncio.Event().wait()
        elif fault == "trickle":
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            self._write(head + b"content-length: 1048576\r\n\r\n")
            while True:
                await asyncio.sleep(TRICKLE_S)
                self._write(b" ")
        elif isinstance(fault, int):
            message = f"{path} failed (the emulator was told to fail it)"
            self._send(fault, _dumps(weight_endpoints.error_body(fault, message)))
        else:
            raise ValueError(f"a fault is an HTTP status, 'hang' or 'trickle', got {fault!r}")

    async def _held(self) -> None:
        """Wait while unary answers are held (``EmulatorThread.hold_answers``)."""
        if self.book.answers_flow.is_set():
            return
        self.book.held_answers += 1
        try:
            await self.book.answers_flow.wait()
        finally:
            self.book.held_answers -= 1

    async def _stream(
        self, parts: list[bytes], shape: _Shape, first_batch: int, first_at: float, gap_s: float
    ) -> None:
        """Write SSE ``parts`` paced like an engine: the first ``first_batch`` (up to each
        choice's first token) at ``first_at``, then each token position ``gap_s`` apart."""
        await _sleep_until(first_at)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        head += b"transfer-encoding: chunked\r\n\r\n"
        token_times: list[float] = []
        self.book.token_times.append(token_times)
        flowing = self.book.streams_flow.is_set()
        if gap_s == 0 and flowing:
            token_times += [time.monotonic()] * shape.completion_tokens
            self._write(head + b"".join(_chunked(part) for part in parts) + b"0\r\n\r\n")
            return
        # Up to the first token chunk of every choice at once, then one position per gap.
        token_times.append(time.monotonic())
        self._write(head + b"".join(_chunked(part) for part in parts[:first_batch]))
        if not flowing:
            await self.book.streams_flow.wait()
        last_position = shape.completion_tokens - 1
        for offset, part in enumerate(parts[first_batch:]):
            # Token chunks at positions 1..T-1; the usage chunk and [DONE] follow the last one.
            position = min(1 + offset // shape.n, last_position)
            await _sleep_until(first_at + gap_s * position)
            if offset % shape.n == 0 and offset // shape.n < last_position:
                token_times.append(time.monotonic())  # choice 0's chunk of this position
            self._write(_chunked(part))
        self._write(b"0\r\n\r\n")

    def _send(self, status: int, payload: bytes) -> None:
        kind = b"application/json" if payload else b"text/plain"
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
            status,
            _REASONS.get(status, b"Error"),
            kind,
            len(payload),
        )
        self._write(head + payload)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


def _chunked(part: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(part), part)


async def _sleep_until(deadline: float) -> None:
    delay_s = deadline - time.monotonic()
    if delay_s > 0:
        await asyncio.sleep(delay_s)


async def serve(
    settings: EmulatorSettings,
    ready: threading.Event | None = None,
    book: ResponseBook | None = None,
) -> None:
    """Serve until cancelled, answering from ``book`` (a new one by default); sets ``ready``
    once listening (``settings.port`` must be fixed)."""
    book = book or ResponseBook(settings)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Connection(book), settings.host, settings.port)
    async with server:
        if ready is not None:
            ready.set()
        await server.serve_forever()


class EmulatorThread:
    """The emulator on its own event loop in a daemon thread (tests and in-process benches)."""

    def __init__(self, settings: EmulatorSettings) -> None:
        self.settings = settings
        self.url = f"http://{settings.host}:{settings.port}"
        self.book = ResponseBook(settings)
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(serve(self.settings, self._ready, self.book))
        with contextlib.suppress(asyncio.CancelledError):
            self._loop.run_until_complete(self._task)

    def start(self, timeout_s: float = 10.0) -> EmulatorThread:
        """Start and wait until listening; raise ``RuntimeError`` after ``timeout_s``."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"emulator did not start on {self.url} within {timeout_s} s")
        return self

    def stop(self) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(timeout=10)

    def stall_streams(self) -> None:
        """From now on (returns once in effect), every streamed answer that starts stops after
        its first token until ``resume_streams``: what an engine that stopped sampling looks
        like to the gateway. Streams already past their first token, and answers that are not
        streamed, are not held."""
        self._in_loop(self.book.streams_flow.clear)

    def resume_streams(self) -> None:
        """Stalled streams go on (their missed token times have passed: they flush at once)."""
        self._in_loop(self.book.streams_flow.set)

    def hold_answers(self) -> None:
        """From now on (returns once in effect), every unary answer waits, sampled, before it
        is sent, until ``release_answers``."""
        self._in_loop(self.book.answers_flow.clear)

    def release_answers(self) -> None:
        """The held unary answers are sent."""
        self._in_loop(self.book.answers_flow.set)

    def held_answers(self) -> int:
        """How many unary answers wait now (``hold_answers``)."""
        return self.book.held_answers

    def fail(self, path: str, fault: Fault | None) -> None:
        """From now on, requests to ``path`` (without its query) fail as ``fault`` says and
        change nothing: an HTTP status (vLLM's error envelope), "hang" or "trickle"; None:
        ``path`` answers as usual again."""
        faults = self.book.faults

        def set_fault() -> None:
            if fault is None:
                faults.pop(path, None)
            else:
                faults[path] = fault

        self._in_loop(set_fault)

    def _in_loop(self, action: Callable[[], None]) -> None:
        done = threading.Event()

        def run() -> None:
            action()
            done.set()

        self._loop.call_soon_threadsafe(run)
        if not done.wait(10):
            raise RuntimeError(f"emulator on {self.url} did not answer within 10 s")


def main() -> None:
    """``python -m trajgate.bench.emulator``: serve with settings from ``TRAJGATE_EMULATOR_*``."""
    asyncio.run(serve(EmulatorSettings()))


if __name__ == "__main__":
    main()
