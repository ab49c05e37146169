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
earlier at ``max_tokens`` / ``max_completion_tokens`` (``"length"``). Responses are serialised
once per shape and reused with a fresh ``id`` and ``created``, so the emulator costs a few
microseconds of CPU per request and per chunk (uvicorn's h11 stack was the bottleneck; see
docs/benchmarks.md).

``EmulatorThread.stall_streams`` makes every streamed answer stop after its first token until
``resume_streams`` (an engine that stopped sampling mid-answer), so a test that must cut a stream
mid-way knows the stream is still open whatever the machine's load (tests/test_pool_crash.py).

``ResponseBook.token_times`` keeps, for the latest streamed answers, when each token's chunk was
written (``time.monotonic()`` seconds, taken just before the write), so a test can compare when
a client received a token with when the engine sent it (tests/test_dialect_streaming.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from trajgate.config import ConfigFileSettings

SYSTEM_FINGERPRINT = "vllm-0.32.0-emulated"
_ID_MARK = "@@TRAJGATE_ID@@"
_CREATED_MARK = "@@TRAJGATE_CREATED@@"
# With prompt_ids="messages" the prompt differs per request: its IDs and counts are marks in the
# cached templates, filled in per answer like the id.
_PROMPT_MARK = "@@TRAJGATE_PROMPT@@"
_PROMPT_TOKENS_MARK = "@@TRAJGATE_PROMPT_TOKENS@@"
_TOTAL_TOKENS_MARK = "@@TRAJGATE_TOTAL_TOKENS@@"
_SAMPLED_TEXT = re.compile(r"(?: t\d+)+")  # an answer of this emulator: " t<id>" per token
_MAX_HEAD_BYTES = 64 * 1024


class EmulatorSettings(ConfigFileSettings):
    """What the emulated engine answers and how fast (``TRAJGATE_EMULATOR_*`` variables)."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_EMULATOR_", extra="ignore")
    config_section = "emulator"

    host: str = Field(default="127.0.0.1", description="Address the emulator binds to.")
    port: int = Field(default=8200, ge=0, le=65535, description="Port; 0 picks a free one.")
    model: str = Field(default="emulated", description="Model name reported in responses.")
    prompt_tokens: int = Field(
        default=1000,
        ge=1,
        description="Length of every prompt's token ids (tokens); with prompt_ids='messages', "
        "of each message that is not one of the emulator's own answers.",
    )
    prompt_ids: Literal["fixed", "messages"] = Field(
        default="fixed",
        description="'fixed': every prompt is the same prompt_tokens seeded ids (a proxy "
        "benchmark: nothing is rendered per request). 'messages': the ids follow the messages "
        "like a chat template's, message by message: an assistant message whose content is "
        "one of the emulator's own answers (' t<id>' per token) renders to exactly those ids, "
        "any other message to prompt_tokens ids seeded by its role and content; so a next turn "
        "extends the previous prompt + response and a rewritten history breaks it, as with a "
        "real engine (the fleet audit of trajgate.bench.fleet needs this).",
    )
    response_tokens: int = Field(
        default=200,
        ge=1,
        description="Tokens sampled per choice unless max_tokens cuts it shorter (tokens).",
    )
    ttft_ms: float = Field(
        default=0.0, ge=0, description="Delay before the first token (ms), per request."
    )
    inter_token_ms: float = Field(
        default=0.0,
        ge=0,
        description="Delay between tokens (ms); a non-streaming answer waits for all of them.",
    )
    seed: int = Field(default=0, description="Seed of the token ids and logprobs.")
    vocab_size: int = Field(default=2048, ge=2, description="Token ids are drawn in [0, V).")


@dataclass(frozen=True)
class _Shape:
    """What a request asked for that changes the bytes of the answer."""

    stream: bool
    return_token_ids: bool
    logprobs: bool
    include_usage: bool
    completion_tokens: int
    n: int
    finish_reason: str


class ResponseBook:
    """Seeded tokens and the serialised answers for every shape asked so far.

    ``prompt_ids [P]``; per choice ``c``: ``ids[c] [T]`` and ``logprobs[c] [T]`` with
    ``P = prompt_tokens`` and ``T = response_tokens``; choice ``c`` is seeded by ``(seed, c)``.
    ``token_times``: per streamed answer (the latest 64), the monotonic time (s) at which the
    chunk of each token position ``[T']`` was written (``T'`` = tokens sent so far).
    """

    def __init__(self, settings: EmulatorSettings) -> None:
        self.settings = settings
        rng = random.Random(f"{settings.seed}:prompt")
        self.prompt_ids = [
            rng.randrange(settings.vocab_size) for _ in range(settings.prompt_tokens)
        ]
        self._choices: dict[int, tuple[list[int], list[float]]] = {}
        self._templates: dict[_Shape, list[bytes]] = {}
        self.token_times: collections.deque[list[float]] = collections.deque(maxlen=64)
        # Cleared: streams wait after their first token (``EmulatorThread.stall_streams``);
        # touched only from the serving loop.
        self.streams_flow = asyncio.Event()
        self.streams_flow.set()

    def prompt_of(self, body: dict[str, Any]) -> list[int]:
        """The prompt's IDs ``[P]`` for a request ``body`` (see ``prompt_ids``); raises
        ``ValueError`` when ``prompt_ids="messages"`` and ``messages`` is not a list of objects."""
        if self.settings.prompt_ids == "fixed":
            return self.prompt_ids
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of objects")
        ids: list[int] = []
        for message in messages:
            role, content = message.get("role"), message.get("content")
            sampled = isinstance(content, str) and _SAMPLED_TEXT.fullmatch(content)
            if role == "assistant" and sampled:  # the inverse of ``_text``
                ids += [int(word[1:]) for word in str(content).split()]
            else:
                rng = random.Random(f"{self.settings.seed}:{role}:{_dumps(content).decode()}")
                size, count = self.settings.vocab_size, self.settings.prompt_tokens
                ids += [rng.randrange(size) for _ in range(count)]
            ids.append(self.end_token)  # every turn closes with it, as ChatML's <|im_end|>
        return ids

    @property
    def end_token(self) -> int:
        """The id that closes every rendered turn with ``prompt_ids="messages"``: ``V``, one
        past the sampled ids ``[0, V)``, so a response never holds it (a special token)."""
        return self.settings.vocab_size

    def choice_tokens(self, choice_index: int) -> tuple[list[int], list[float]]:
        """Sampled ids ``[T]`` and their logprobs ``[T]`` (nats, < 0) of one choice."""
        if choice_index not in self._choices:
            rng = random.Random(f"{self.settings.seed}:choice:{choice_index}")
            size = self.settings.vocab_size
            ids = [rng.randrange(size) for _ in range(self.settings.response_tokens)]
            logprobs = [-round(rng.expovariate(0.5) + 1e-6, 6) for _ in ids]
            self._choices[choice_index] = (ids, logprobs)
        return self._choices[choice_index]

    def shape_of(self, body: dict[str, Any]) -> _Shape:
        """Read the fields that change the answer; raise ``ValueError`` on bad values."""
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"max_tokens must be a positive integer, got {limit!r}")
        n = body.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= 128:
            raise ValueError(f"n must be an integer in [1, 128], got {n!r}")
        completion_tokens = self.settings.response_tokens
        finish_reason = "stop"
        if limit is not None and limit < completion_tokens:
            completion_tokens, finish_reason = limit, "length"
        options = body.get("stream_options") or {}
        return _Shape(
            stream=body.get("stream") is True,
            return_token_ids=body.get("return_token_ids") is True,
            logprobs=body.get("logprobs") is True,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            completion_tokens=completion_tokens,
            n=n,
            finish_reason=finish_reason,
        )

    def render(
        self, shape: _Shape, request_id: str, created_s: int, prompt: list[int] | None = None
    ) -> list[bytes]:
        """The answer's bytes: one JSON body, or one ``data: ...\\n\\n`` event per SSE chunk;
        ``prompt`` (``prompt_of``) is needed when ``prompt_ids="messages"``."""
        templates = self._templates.get(shape)
        if templates is None:
            templates = self._build(shape)
            self._templates[shape] = templates
        id_bytes = request_id.encode()
        created = str(created_s).encode()
        mark_id, mark_created = _ID_MARK.encode(), f'"{_CREATED_MARK}"'.encode()
        parts = [
            t.replace(mark_id, id_bytes, 1).replace(mark_created, created, 1) for t in templates
        ]
        if self.settings.prompt_ids == "fixed":
            return parts
        if prompt is None:
            raise ValueError("prompt_ids='messages' renders each answer with its prompt")
        total = len(prompt) + shape.completion_tokens * shape.n
        fills = [
            (f'"{_PROMPT_MARK}"'.encode(), _dumps(prompt)),
            (f'"{_PROMPT_TOKENS_MARK}"'.encode(), str(len(prompt)).encode()),
            (f'"{_TOTAL_TOKENS_MARK}"'.encode(), str(total).encode()),
        ]
        for mark, value in fills:
            parts = [part.replace(mark, value) for part in parts]
        return parts

    def _prompt_fields(self, shape: _Shape) -> tuple[Any, Any, Any]:
        """``(prompt_token_ids, usage prompt_tokens, usage total_tokens)`` of a template: the
        values themselves, or with ``prompt_ids="messages"`` the marks ``render`` fills."""
        if self.settings.prompt_ids == "messages":
            marked = _PROMPT_MARK if shape.return_token_ids else None
            return marked, _PROMPT_TOKENS_MARK, _TOTAL_TOKENS_MARK
        prompt = self.settings.prompt_tokens
        ids = self.prompt_ids if shape.return_token_ids else None
        return ids, prompt, prompt + shape.completion_tokens * shape.n

    def _build(self, shape: _Shape) -> list[bytes]:
        if shape.stream:
            events = [_dumps(chunk) for chunk in self._chunks(shape)]
            return [b"data: " + event + b"\n\n" for event in [*events, b"[DONE]"]]
        return [_dumps(self._completion(shape))]

    def _head(self, kind: str) -> dict[str, Any]:
        return {
            "id": _ID_MARK,
            "object": kind,
            "created": _CREATED_MARK,
            "model": self.settings.model,
        }

    def _logprob_entries(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        return [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip((_text(i) for i in ids), logprobs, strict=True)
        ]

    def _completion(self, shape: _Shape) -> dict[str, Any]:
        choices = []
        for index in range(shape.n):
            ids, logprobs = self.choice_tokens(index)
            ids, logprobs = ids[: shape.completion_tokens], logprobs[: shape.completion_tokens]
            message = {
                "role": "assistant",
                "content": "".join(_text(i) for i in ids),
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": (
                        {"content": self._logprob_entries(ids, logprobs)}
                        if shape.logprobs
                        else None
                    ),
                    "finish_reason": shape.finish_reason,
                    "stop_reason": None,
                    "token_ids": ids if shape.return_token_ids else None,
                    "routed_experts": None,
                }
            )
        completion = shape.completion_tokens * shape.n
        prompt_ids, prompt, total = self._prompt_fields(shape)
        return {
            **self._head("chat.completion"),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": {
                "prompt_tokens": prompt,
                "total_tokens": total,
                "completion_tokens": completion,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
            "prompt_logprobs": None,
            "prompt_token_ids": prompt_ids,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    def _chunks(self, shape: _Shape) -> list[dict[str, Any]]:
        kind = "chat.completion.chunk"
        chunks: list[dict[str, Any]] = []
        prompt_ids, prompt, total = self._prompt_fields(shape)
        for index in range(shape.n):
            first = {"index": index, "delta": {"role": "assistant", "content": ""}}
            chunks.append(
                {
                    **self._head(kind),
                    "choices": [{**first, "logprobs": None, "finish_reason": None}],
                    "prompt_token_ids": prompt_ids,
                    "prompt_text": None,
                }
            )
        for position in range(shape.completion_tokens):
            last = position == shape.completion_tokens - 1
            for index in range(shape.n):
                ids, logprobs = self.choice_tokens(index)
                token_id, logprob = ids[position], logprobs[position]
                choice: dict[str, Any] = {
                    "index": index,
                    "delta": {"content": _text(token_id)},
                    "logprobs": (
                        {"content": self._logprob_entries([token_id], [logprob])}
                        if shape.logprobs
                        else None
                    ),
                    "finish_reason": shape.finish_reason if last else None,
                }
                if last:
                    choice["stop_reason"] = None
                choice["token_ids"] = [token_id] if shape.return_token_ids else None
                chunk: dict[str, Any] = {**self._head(kind), "choices": [choice]}
                if last and not shape.include_usage:
                    # vLLM puts the fingerprint on the usage chunk when there is one.
                    chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
                chunks.append(chunk)
        if shape.include_usage:
            completion = shape.completion_tokens * shape.n
            chunks.append(
                {
                    **self._head(kind),
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt,
                        "total_tokens": total,
                        "completion_tokens": completion,
                    },
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                }
            )
        return chunks


def _text(token_id: int) -> str:
    return f" t{token_id}"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


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
        from trajgate.bench import scale_out  # it builds on this module's book and shapes

        if path == "/health" and method == "GET":
            self._send(200, b"")
        elif path == "/v1/models" and method == "GET":
            entry = {"id": self.book.settings.model, "object": "model", "owned_by": "vllm"}
            self._send(200, _dumps({"object": "list", "data": [entry]}))
        elif path == "/v1/chat/completions" and method == "POST":
            await self._chat(body)
        elif path in scale_out.PATHS and self.book.settings.prompt_ids == "messages":
            if method != "POST":
                self._send(*_error(405, f"method {method} not allowed on {path}"))
            else:
                await self._scale_out(path, body)
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
            prompt = self.book.prompt_of(body)
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
            self._send(200, parts[0])
            return
        await self._stream(parts, shape, 2 * shape.n, first_at, gap_s)

    async def _scale_out(self, path: str, raw: bytes) -> None:
        """The token-in, token-out endpoints (``trajgate.bench.scale_out``)."""
        from trajgate.bench import scale_out

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
            self._send(200, parts[0])
            return
        await self._stream(parts, shape, shape.n, first_at, gap_s)

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
