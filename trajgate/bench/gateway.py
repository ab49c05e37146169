"""``trajgate bench gateway``: what the gateway adds to a call's latency and takes from throughput.

Owns: starting the emulated upstream (``trajgate.bench.emulator``) and the gateway (``trajgate
serve`` in
its own process by default, so it never shares the load generator's GIL), driving the same load
directly at the emulator, through the gateway and through any other proxy given, and the one
JSON report. Never: asserts goals; it measures and reports, ``goals_met`` says how it went.

``dialect`` picks the API the load generator speaks to the gateway: ``chat`` (``POST
/v1/chat/completions``), ``responses`` (``POST /v1/responses``: ``instructions``, ``input``,
``max_output_tokens``) or ``messages`` (``POST /v1/messages``: ``system``, ``messages``,
``max_tokens``), the same logical request in each (a system prompt, one user turn of
``prompt_tokens`` words, ``response_tokens`` asked, temperature 1). The emulator speaks chat
completions only, which is what the gateway sends upstream for every dialect, so the direct run
is always the chat request: for ``responses`` and ``messages`` the ``added_*`` figures are the
gateway's dialect call against the emulator's own chat call (translation, rendering and capture
together; ``direct_dialect`` says so in each run), and ``cpu_ms_per_call`` gives the gateway's
CPU per call. A stream counts as answered when its last event is the dialect's end (``data:
[DONE]``, ``response.completed``, ``message_stop``).

Per configuration (``stream`` × ``concurrency``) and per target, ``requests`` calls are sent by
``concurrency`` workers, each with its own keep-alive connection, after a warm-up of
``max(warmup_requests, concurrency)`` calls on the same connections. Latency is wall time from
sending the request to the last byte of the answer (ms); throughput is answered calls ÷ wall
time of the run (req/s).

- ``added_p50_ms = gateway_p50_ms - direct_p50_ms`` (same for p99): a difference of percentiles,
  not a percentile of differences; it can be slightly negative when the gateway adds nothing.
- ``throughput_ratio = gateway req/s ÷ direct req/s``.
- ``steps_expected`` = calls the gateway answered with 200 (one choice each);
  ``steps_persisted`` = rows in ``steps`` for the run's trajectories, counted after the run.
- Worker ``w`` sends its ``k``-th call to trajectory ``bench-<run>-<w>-<k // S>`` with
  ``S = steps_per_trajectory``, so the pool sees multi-step trajectories of realistic length.
- CPU milliseconds per call of the gateway and emulator processes (from ``/proc``) and of the
  load generator (this process) show which process the run's time went to.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
from pydantic import BaseModel, Field, model_validator
from sqlalchemy import func, select

from datapool import db
from datapool.models import Step
from trajgate.bench.continuation import (
    ContinuationMode,
    channel_settings,
    compare_modes,
    continuation_goals_met,
    conversation_bodies,
    mode_headers,
)

GatewayMode = Literal["process", "thread"]
GATEWAY_MODES: tuple[GatewayMode, ...] = get_args(GatewayMode)
Loadgen = Literal["raw", "httpx"]
LOADGENS: tuple[Loadgen, ...] = get_args(Loadgen)
BenchDialect = Literal["chat", "responses", "messages"]
BENCH_DIALECTS: tuple[BenchDialect, ...] = get_args(BenchDialect)
# uvicorn's own protocols, what a --layers run's library gateway may serve with.
LibraryProtocol = Literal["httptools", "h11"]
LIBRARY_PROTOCOLS: tuple[LibraryProtocol, ...] = get_args(LibraryProtocol)

# Per dialect: the client's path under /v1, and how the last event of a whole stream begins.
DIALECT_PATHS: dict[BenchDialect, str] = {
    "chat": "/chat/completions",
    "responses": "/responses",
    "messages": "/messages",
}
STREAM_ENDS: dict[BenchDialect, bytes] = {
    "chat": b"data: [DONE]",
    "responses": b"event: response.completed\n",
    "messages": b"event: message_stop\n",
}
SYSTEM_PROMPT = "You are a benchmark."

# The gateway's goals on the 2-core reference machine (docs/benchmarks.md): at concurrency 1 it
# adds at most 1 ms at the median and 5 ms at p99; at 64 it keeps 70 % of the direct throughput.
GOAL_ADDED_P50_MS = 1.0
GOAL_ADDED_P99_MS = 5.0
GOAL_THROUGHPUT_RATIO = 0.7


class BenchSettings(BaseModel):
    """One benchmark: the load, the emulated engine's speed, and what to measure."""

    requests: int = Field(default=100, ge=1, description="Measured calls per run and target.")
    warmup_requests: int = Field(default=10, ge=0, description="Unmeasured calls first.")
    concurrencies: tuple[int, ...] = Field(default=(1, 64), description="Workers per run.")
    streams: tuple[bool, ...] = Field(default=(False, True), description="stream values to run.")
    prompt_tokens: int = Field(default=1000, ge=1, description="Prompt length (tokens).")
    response_tokens: int = Field(default=200, ge=1, description="Response length (tokens).")
    # 20 ms to first token and 5 ms between tokens (200 tokens/s per stream) is a fast GPU engine
    # at batch 64; the 2 cores cannot emulate faster streams at concurrency 64 (the emulator and
    # load generator would need more than a core; docs/benchmarks.md). 0 and 0 measure pure cost.
    ttft_ms: float = Field(default=20.0, ge=0, description="Emulated time to first token (ms).")
    inter_token_ms: float = Field(default=5.0, ge=0, description="Emulated token gap (ms).")
    steps_per_trajectory: int = Field(default=8, ge=1, description="Calls per trajectory.")
    dialect: BenchDialect = Field(
        default="chat",
        description="API the load generator speaks to the gateway: 'chat', 'responses' or "
        "'messages'; the direct run (and the upstream) is always chat.",
    )
    loadgen: Loadgen = Field(
        default="raw",
        description="'raw': a minimal asyncio HTTP/1.1 client (cheap); 'httpx': httpx clients.",
    )
    gateway_mode: GatewayMode = Field(
        default="process",
        description="'process': `trajgate serve` in a child process (no GIL shared with the "
        "load generator); 'thread': the gateway app in a thread of this process.",
    )
    proxy_urls: tuple[str, ...] = Field(
        default=(),
        description="Other proxies to measure the same way: base URLs ending in /v1, already "
        "pointed at the emulator (see --emulator-port).",
    )
    emulator_port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port.")
    gateway_port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port.")
    data_dir: Path | None = Field(
        default=None, description="Where the gateway's pool lives; default a temporary dir."
    )
    continuations: tuple[ContinuationMode, ...] = Field(
        default=(),
        description="Continuation modes to measure side by side (chat only): each run sends "
        "multi-turn conversations that echo the emulator's answers through the gateway once "
        "per mode, on a channel set to it (trajgate.bench.continuation); empty: one "
        "single-turn request, the gateway's default mode.",
    )
    pin_cores: bool = Field(
        default=False,
        description="Run the gateway on cores of its own and the emulator and the load "
        "generator on the last core (needs 2 cores and gateway_mode 'process'). Unpinned on a "
        "2-core machine, the scheduler wakes the emulator on the gateway's core and lets it "
        "preempt the gateway while the emulated engine works (a render, say): time the "
        "gateway then waits for a core, not work it does. A real engine runs elsewhere.",
    )
    mode_rounds: int = Field(
        default=6,
        ge=1,
        description="With continuations: each mode's measured calls are sent in this many "
        "rounds, the modes alternating (A B, B A, ...), so the gateway's background work (group "
        "commits, health checks) and the machine's drift fall on every mode alike; 1 measures "
        "each mode in one window.",
    )

    layers: bool = Field(
        default=False,
        description="Measure the gateway's speed layers against the libraries they replace, "
        "side by side in one run: a second gateway process with TRAJGATE_UPSTREAM_TRANSPORT="
        "httpx and TRAJGATE_HTTP_PROTOCOL=library_protocol (its own pool), the two sent their "
        "calls in alternating rounds (mode_rounds) like continuation modes (process mode, "
        "single-turn calls only).",
    )
    library_protocol: LibraryProtocol = Field(
        default="httptools",
        description="With layers: uvicorn's protocol the library gateway serves with, "
        "'httptools' or 'h11'.",
    )

    @model_validator(mode="after")
    def _layers_can_run(self) -> BenchSettings:
        if self.layers and self.gateway_mode != "process":
            raise ValueError("layers needs gateway_mode 'process' (CPU is read per process)")
        if self.layers and self.continuations:
            raise ValueError("layers measures single-turn calls: drop continuations or layers")
        return self

    @model_validator(mode="after")
    def _pinning_can_run(self) -> BenchSettings:
        if self.pin_cores and self.gateway_mode != "process":
            raise ValueError("pin_cores needs gateway_mode 'process' (a thread shares its cores)")
        if self.pin_cores and not hasattr(os, "sched_setaffinity"):
            raise ValueError("pin_cores needs Linux (os.sched_setaffinity)")
        if self.pin_cores and len(os.sched_getaffinity(0)) < 2:
            raise ValueError("pin_cores needs at least 2 cores: one for the gateway, one beside")
        return self


@dataclass
class Sample:
    """What one run against one target measured."""

    latencies_ms: list[float] = field(default_factory=list)
    # Send to the first byte of the answer's body (ms): for a stream, its first event.
    first_byte_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0
    first_error: str | None = None
    loadgen_cpu_s: float = 0.0

    @property
    def ok(self) -> int:
        return len(self.latencies_ms)

    @property
    def rps(self) -> float:
        return self.ok / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile (``q`` in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


def request_body(settings: BenchSettings, dialect: BenchDialect, stream: bool) -> dict[str, Any]:
    """The bench's request in ``dialect``: a system prompt and a user turn of ``prompt_tokens``
    words, asking for ``response_tokens`` at temperature 1. Raises ``ValueError`` on an unknown
    dialect."""
    words = " ".join(f"w{i % 997}" for i in range(settings.prompt_tokens))
    common = {"model": "emulated", "temperature": 1.0, "stream": stream}
    if dialect == "chat":
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": words},
        ]
        return {**common, "messages": messages, "max_tokens": settings.response_tokens}
    if dialect == "responses":
        return {
            **common,
            "instructions": SYSTEM_PROMPT,
            "input": words,
            "max_output_tokens": settings.response_tokens,
        }
    if dialect == "messages":
        return {
            **common,
            "system": SYSTEM_PROMPT,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": settings.response_tokens,
        }
    raise ValueError(f"dialect must be one of {BENCH_DIALECTS}, got {dialect!r}")


class RawConnection(asyncio.Protocol):
    """The load generator's HTTP/1.1 client: one keep-alive connection, one call at a time.

    Why not httpx: on 2 cores, httpx spent 0.6 ms of CPU per non-streaming call and 14 to 20 ms
    per 200-chunk stream (70 to 100 us per SSE chunk), so at concurrency 64 the load generator
    used most of a core and was the bottleneck of the direct runs (see docs/benchmarks.md). This
    client only frames the answer (``content-length`` or chunked) and keeps its bytes.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.last_first_body_at: float | None = None  # of the answer ``call`` returned last
        self._reset()

    def _reset(self) -> None:
        # Parse state of the answer being read, so each byte is looked at once.
        self.status = 0  # 0 until the head has arrived
        self.length: int | None = None  # content-length; None when chunked
        self.position = 0  # where the next chunk-size line starts (chunked)
        self.parts: list[bytes] = []
        self.first_body_at: float | None = None  # perf_counter when the body began to arrive

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection closed mid-answer: {exc!r}"))

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.waiter is not None and not self.waiter.done():
            answer = self._answer()
            if answer is not None:
                self.last_first_body_at = self.first_body_at
                self._reset()
                self.waiter.set_result(answer)

    def _answer(self) -> tuple[int, bytes] | None:
        """``(status, body)`` once the whole answer is buffered; None while it is not."""
        if not self.status:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return None
            head = bytes(self.buffer[:head_end]).lower()
            del self.buffer[: head_end + 4]
            self.status = int(head[9:12])
            if b"transfer-encoding: chunked" not in head:
                marker = head.find(b"content-length:")
                end = head.find(b"\r\n", marker)
                self.length = (
                    int(head[marker + 15 : end if end > 0 else None]) if marker >= 0 else 0
                )
        if self.first_body_at is None and self.buffer:
            self.first_body_at = time.perf_counter()
        if self.length is not None:
            if len(self.buffer) < self.length:
                return None
            body = bytes(self.buffer[: self.length])
            del self.buffer[: self.length]
            return self.status, body
        while True:
            line_end = self.buffer.find(b"\r\n", self.position)
            if line_end < 0:
                return None
            size = int(self.buffer[self.position : line_end].split(b";", 1)[0], 16)
            if len(self.buffer) < line_end + 2 + size + 2:
                return None
            if size == 0:
                del self.buffer[: line_end + 4]
                return self.status, b"".join(self.parts)
            self.parts.append(bytes(self.buffer[line_end + 2 : line_end + 2 + size]))
            self.position = line_end + 2 + size + 2

    async def call(self, request: bytes) -> tuple[int, bytes]:
        """Send one request (bytes of head and body) and wait for the whole answer."""
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return await self.waiter


class Caller:
    """One worker's way to a target (``base_url`` without ``/v1``): a raw or an httpx client;
    ``stream_end`` is how the last event of a whole stream begins (``STREAM_ENDS``)."""

    def __init__(self, base_url: str, loadgen: Loadgen, stream_end: bytes) -> None:
        url = httpx.URL(base_url)
        self.base_url, self.loadgen, self.stream_end = base_url.rstrip("/"), loadgen, stream_end
        self.host, self.port = url.host, url.port or 80
        self.raw: RawConnection | None = None
        self.client: httpx.AsyncClient | None = None
        self.first_body_at: float | None = None  # of the last call: perf_counter, first body byte
        if loadgen == "httpx":
            # One single-connection client per worker: one shared pool of 64 connections cost
            # 8.2 ms of CPU per call at concurrency 64 (httpcore's pool scans its waiters).
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            timeout = httpx.Timeout(600.0, connect=30.0)
            self.client = httpx.AsyncClient(limits=limits, timeout=timeout)
        elif loadgen != "raw":
            raise ValueError(f"loadgen must be one of {LOADGENS}, got {loadgen!r}")

    async def call(
        self, path: str, body: bytes, stream: bool, headers: dict[str, str] | None = None
    ) -> str | None:
        """POST ``body`` to ``path`` with any extra ``headers``; None when it answered 200
        (and, streaming, its last event begins with ``stream_end``), else the error as text."""
        headers = headers or {}
        self.first_body_at = None
        if self.client is not None:
            parts: list[bytes] = []
            async with self.client.stream(
                "POST",
                self.base_url + path,
                content=body,
                headers={"content-type": "application/json", **headers},
            ) as response:
                async for piece in response.aiter_bytes():
                    self.first_body_at = self.first_body_at or time.perf_counter()
                    parts.append(piece)
            status, content = response.status_code, b"".join(parts)
        else:
            if self.raw is None or self.raw.transport is None or self.raw.transport.is_closing():
                loop = asyncio.get_running_loop()
                _transport, self.raw = await loop.create_connection(
                    RawConnection, self.host, self.port
                )
            head = f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            status, content = await self.raw.call(head.encode() + body)
            self.first_body_at = self.raw.last_first_body_at
        if status != 200:
            return f"HTTP {status}: {content[:300].decode(errors='replace')}"
        if stream and not content.rstrip().rsplit(b"\n\n", 1)[-1].startswith(self.stream_end):
            return f"stream's last event is not {self.stream_end!r}: {content[-80:]!r}"
        return None

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        if self.raw is not None and self.raw.transport is not None:
            self.raw.transport.close()


@asynccontextmanager
async def callers(
    base_url: str, loadgen: Loadgen, concurrency: int, stream_end: bytes
) -> AsyncIterator[list[Caller]]:
    """``concurrency`` callers, each with its own keep-alive connection to ``base_url``."""
    workers = [Caller(base_url, loadgen, stream_end) for _ in range(concurrency)]
    try:
        yield workers
    finally:
        for worker in workers:
            await worker.close()


async def drive(
    workers: list[Caller],
    path_of: Callable[[int, int], str],
    bodies: list[bytes],
    *,
    stream: bool,
    requests: int,
    headers: dict[str, str] | None = None,
    calls_made: list[int] | None = None,
) -> Sample:
    """Send ``requests`` calls from the workers; worker ``w``'s ``k``-th call sends
    ``bodies[k % len(bodies)]`` (turn ``k % S`` of a conversation, or the one body) to
    ``path_of(w, k)``. A call counts when ``Caller.call`` says it succeeded; otherwise it is an
    error, the first one kept as text. ``calls_made``: each worker's calls so far, where its
    ``k`` starts and is left (a later drive then continues its conversations)."""
    sample = Sample()
    next_call = 0

    async def work(caller: Caller, worker_index: int) -> None:
        nonlocal next_call
        k = 0 if calls_made is None else calls_made[worker_index]
        while next_call < requests:
            next_call += 1
            path, body = path_of(worker_index, k), bodies[k % len(bodies)]
            k += 1
            started = time.perf_counter()
            try:
                error = await caller.call(path, body, stream, headers)
            except (OSError, httpx.HTTPError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if error is None:
                sample.latencies_ms.append((time.perf_counter() - started) * 1000.0)
                if caller.first_body_at is not None:
                    sample.first_byte_ms.append((caller.first_body_at - started) * 1000.0)
            else:
                sample.errors += 1
                sample.first_error = sample.first_error or error
        if calls_made is not None:
            calls_made[worker_index] = k

    cpu_started, wall_started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(work(caller, w) for w, caller in enumerate(workers)))
    sample.wall_s = time.perf_counter() - wall_started
    sample.loadgen_cpu_s = time.process_time() - cpu_started
    return sample


def process_cpu_s(pid: int | None, thread: int | None = None) -> float | None:
    """User + system CPU seconds a process (or one of its threads: ``thread``, its id) has
    used so far, to the scheduler's nanosecond (Linux); None if unknown.

    The whole process is read from its CPU clock (``clock_getcpuclockid(3)``: the scheduler's
    runtime of every thread, the exited ones included); a thread from ``/proc/<pid>/task/<tid>/
    schedstat``. Both fall back to ``/proc``'s ``stat``, which counts whole clock ticks (10 ms):
    too coarse for a few calls of a few milliseconds each, which can read as no CPU at all."""
    if pid is None:
        return None
    if thread is None:
        try:
            # The kernel's id of a process's CPU clock: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED).
            return time.clock_gettime((~pid << 3) | 2)
        except (OSError, OverflowError):
            pass
    else:
        try:
            runtime_ns = Path(f"/proc/{pid}/task/{thread}/schedstat").read_text().split()[0]
            return int(runtime_ns) / 1e9
        except (OSError, IndexError, ValueError):
            pass
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # Fields 14 and 15 (utime, stime) of proc(5), counted after the ")" that ends field 2.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200; raise ``RuntimeError`` on exit or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode} before healthy")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not healthy within {timeout_s} s")


@dataclass
class Targets:
    """The running emulator and gateway: URLs, process ids (None in-process) and the pool."""

    emulator_url: str
    emulator_pid: int | None
    gateway_url: str
    gateway_pid: int | None
    database_url: str
    # With ``layers``: the gateway on the libraries' transport and protocol, and its own pool.
    library_gateway_url: str | None = None
    library_gateway_pid: int | None = None
    library_database_url: str | None = None


@contextmanager
def running_targets(settings: BenchSettings, log_dir: Path) -> Iterator[Targets]:
    """Start the emulator (child process) and the gateway (per ``gateway_mode``); stop both."""
    emulator_port = settings.emulator_port or free_port()
    gateway_port = settings.gateway_port or free_port()
    emulator_env = {
        **os.environ,
        "TRAJGATE_EMULATOR_PORT": str(emulator_port),
        "TRAJGATE_EMULATOR_PROMPT_TOKENS": str(settings.prompt_tokens),
        "TRAJGATE_EMULATOR_RESPONSE_TOKENS": str(settings.response_tokens),
        "TRAJGATE_EMULATOR_TTFT_MS": str(settings.ttft_ms),
        "TRAJGATE_EMULATOR_INTER_TOKEN_MS": str(settings.inter_token_ms),
    }
    gateway_env = dict(os.environ)
    channels = channel_settings(settings.continuations)
    if settings.continuations:
        # Conversations whose prompts follow their messages, and the scale-out endpoints.
        emulator_env["TRAJGATE_EMULATOR_PROMPT_IDS"] = "messages"
        gateway_env["TRAJGATE_CONTINUATION_CHANNELS"] = json.dumps(channels)
    emulator_url = f"http://127.0.0.1:{emulator_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    data_dir = settings.data_dir or log_dir / "pool"
    database_url = f"sqlite:///{(data_dir / 'pool.sqlite3').resolve()}"
    db.upgrade(database_url)
    children: list[subprocess.Popen[bytes]] = []
    thread_server: Any = None
    outside, gateway_cores = pinned_cores() if settings.pin_cores else (None, None)
    before = os.sched_getaffinity(0) if outside is not None else None
    try:
        if outside is not None:
            # this thread (the load generator's) and the emulator started from it; the
            # process's other threads, if any, keep their cores
            os.sched_setaffinity(0, outside)
        with open(log_dir / "emulator.log", "wb") as log:
            emulator = subprocess.Popen(
                [sys.executable, "-m", "trajgate.bench.emulator"],
                env=emulator_env,
                stdout=log,
                stderr=log,
            )
        children.append(emulator)
        wait_healthy(f"{emulator_url}/health", emulator, 30.0)
        gateway_pid: int | None = None
        library: tuple[str, int, str] | None = None
        if settings.gateway_mode == "process":
            own_env = gateway_env
            if settings.layers:  # whatever this environment sets: the lanes' names hold
                own_env = {
                    **gateway_env,
                    "TRAJGATE_UPSTREAM_TRANSPORT": "own",
                    "TRAJGATE_HTTP_PROTOCOL": "own",
                }
            gateway = _gateway_process(
                emulator_url,
                gateway_port,
                database_url,
                own_env,
                log_dir / "gateway.log",
                gateway_cores,
            )
            children.append(gateway)
            gateway_pid = gateway.pid
            wait_healthy(f"{gateway_url}/health", gateway, 180.0)  # loaded machines start slowly
            if settings.layers:
                library = _library_gateway(
                    settings,
                    emulator_url,
                    data_dir,
                    gateway_env,
                    log_dir,
                    gateway_cores,
                    children,
                )
        elif settings.gateway_mode == "thread":
            from datapool.settings import PoolSettings
            from gateway.app import create_app
            from gateway.server import BackgroundServer
            from gateway.settings import GatewaySettings

            app = create_app(
                GatewaySettings(
                    upstream_url=emulator_url,
                    port=gateway_port,
                    continuation_channels=channels,
                ),
                PoolSettings(data_dir=data_dir, database_url=database_url),
            )
            thread_server = BackgroundServer(app, port=gateway_port).start()
        else:
            raise ValueError(
                f"gateway_mode must be one of {GATEWAY_MODES}, got {settings.gateway_mode!r}"
            )
        targets = Targets(emulator_url, emulator.pid, gateway_url, gateway_pid, database_url)
        if library is not None:
            targets.library_gateway_url, targets.library_gateway_pid = library[0], library[1]
            targets.library_database_url = library[2]
        yield targets
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)
        if thread_server is not None:
            thread_server.stop()
        for child in reversed(children):
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def _library_gateway(
    settings: BenchSettings,
    emulator_url: str,
    data_dir: Path,
    env: dict[str, str],
    log_dir: Path,
    cores: set[int] | None,
    children: list[subprocess.Popen[bytes]],
) -> tuple[str, int, str]:
    """The ``layers`` run's second gateway, on httpx's transport and uvicorn's own protocol,
    with a pool of its own (two writers of one SQLite file would wait on each other), added to
    ``children`` once started; its URL, process id and database URL once healthy."""
    port = free_port()
    database_url = f"sqlite:///{(data_dir / 'library.sqlite3').resolve()}"
    db.upgrade(database_url)
    env = {
        **env,
        "TRAJGATE_UPSTREAM_TRANSPORT": "httpx",
        "TRAJGATE_HTTP_PROTOCOL": settings.library_protocol,
    }
    process = _gateway_process(
        emulator_url, port, database_url, env, log_dir / "library-gateway.log", cores
    )
    children.append(process)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(f"{url}/health", process, 180.0)
    return url, process.pid, database_url


def _gateway_process(
    emulator_url: str,
    port: int,
    database_url: str,
    env: dict[str, str],
    log_path: Path,
    cores: set[int] | None,
) -> subprocess.Popen[bytes]:
    """``trajgate serve`` in front of the emulator on ``port``, logging to ``log_path``, on
    ``cores`` when given; not yet healthy."""
    command = [sys.executable, "-m", "trajgate.cli", "serve", "--upstream", emulator_url]
    command += ["--port", str(port), "--database-url", database_url]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            command,
            stdout=log,
            stderr=log,
            env=env,
            # set in the child before it starts, so every thread it makes inherits it
            preexec_fn=None if cores is None else partial(os.sched_setaffinity, 0, cores),
        )


def pinned_cores() -> tuple[set[int], set[int]]:
    """``(outside, gateway)``: the last core of this process's for the emulator and the load
    generator, the others for the gateway (``BenchSettings.pin_cores``)."""
    cores = sorted(os.sched_getaffinity(0))
    return {cores[-1]}, set(cores[:-1])


def count_steps(database_url: str, trajectory_prefix: str, continuation: str | None = None) -> int:
    """Rows in ``steps`` whose trajectory id starts with ``trajectory_prefix`` (and, when
    given, whose prompt ``continuation`` built)."""
    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            query = select(func.count()).select_from(Step)
            query = query.where(Step.trajectory_id.startswith(trajectory_prefix, autoescape=True))
            if continuation is not None:
                query = query.where(Step.continuation == continuation)
            return int(conn.execute(query).scalar_one())
    finally:
        engine.dispose()


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _cpu_ms_per_call(before: float | None, after: float | None, calls: int) -> float | None:
    if before is None or after is None or calls == 0:
        return None
    return round((after - before) * 1000.0 / calls, 3)


async def _measure(
    targets: Targets,
    base_url: str,
    path_of: Callable[[int, int], str],
    bodies: list[bytes],
    stream: bool,
    concurrency: int,
    settings: BenchSettings,
    gateway: bool,
    stream_end: bytes,
    headers: dict[str, str] | None = None,
) -> tuple[Sample, dict[str, float | None]]:
    """Warm up, then one measured run on the same connections; also each process's CPU ms
    per call during the measured run."""
    pids = {"emulator": targets.emulator_pid, "gateway": targets.gateway_pid if gateway else None}
    async with callers(base_url, settings.loadgen, concurrency, stream_end) as workers:
        await _warm_up(workers, path_of, bodies, stream, settings, headers)
        before = {name: process_cpu_s(pid) for name, pid in pids.items()}
        sample = await drive(
            workers, path_of, bodies, stream=stream, requests=settings.requests, headers=headers
        )
    calls = sample.ok + sample.errors
    cpu = {
        f"{name}_cpu_ms_per_call": _cpu_ms_per_call(before[name], process_cpu_s(pid), calls)
        for name, pid in pids.items()
    }
    cpu["loadgen_cpu_ms_per_call"] = _cpu_ms_per_call(0.0, sample.loadgen_cpu_s, calls)
    return sample, cpu


async def _warm_up(
    workers: list[Caller],
    path_of: Callable[[int, int], str],
    bodies: list[bytes],
    stream: bool,
    settings: BenchSettings,
    headers: dict[str, str] | None,
) -> None:
    """The unmeasured calls before a measured run, on the same connections."""
    if settings.warmup_requests:
        await drive(
            workers,
            lambda w, k: path_of(-1 - w, k),  # negative workers: warm-up trajectories
            bodies,
            stream=stream,
            requests=max(settings.warmup_requests, len(workers)),
            headers=headers,
        )


@dataclass(frozen=True)
class Lane:
    """One of the ways a run measures side by side (continuation modes, or own layers against
    the libraries'): where its calls go, with which headers, and whose CPU they cost."""

    base_url: str
    path_of: Callable[[int, int], str]
    gateway_pid: int | None
    headers: dict[str, str] | None = None


async def _measure_lanes(
    targets: Targets,
    lanes: dict[str, Lane],
    bodies: list[bytes],
    stream: bool,
    concurrency: int,
    settings: BenchSettings,
    stream_end: bytes,
) -> dict[str, tuple[Sample, dict[str, float | None]]]:
    """``_measure`` of each lane, interleaved: after every lane's warm-up,
    ``settings.mode_rounds`` rounds, each sending every lane its share of the measured calls,
    in alternating order (``ABBA``); samples and each process's CPU are summed per lane over the
    rounds. Each lane keeps its own connections, and each worker's conversations continue from
    round to round."""
    names = list(lanes)
    rounds = settings.mode_rounds
    shares = [settings.requests // rounds + (r < settings.requests % rounds) for r in range(rounds)]
    samples = {name: Sample() for name in names}
    pids = {
        name: {"emulator": targets.emulator_pid, "gateway": lane.gateway_pid}
        for name, lane in lanes.items()
    }
    cpu_s: dict[str, dict[str, float | None]] = {n: dict.fromkeys(pids[n], 0.0) for n in names}
    made = {name: [0] * concurrency for name in names}
    async with AsyncExitStack() as stack:
        workers = {
            name: await stack.enter_async_context(
                callers(lane.base_url, settings.loadgen, concurrency, stream_end)
            )
            for name, lane in lanes.items()
        }
        for name, lane in lanes.items():
            await _warm_up(workers[name], lane.path_of, bodies, stream, settings, lane.headers)
        for index, share in enumerate(shares):
            for name in names if index % 2 == 0 else names[::-1]:
                lane = lanes[name]
                before = {process: process_cpu_s(pid) for process, pid in pids[name].items()}
                part = await drive(
                    workers[name],
                    lane.path_of,
                    bodies,
                    stream=stream,
                    requests=share,
                    headers=lane.headers,
                    calls_made=made[name],
                )
                for process, pid in pids[name].items():
                    after, spent = process_cpu_s(pid), cpu_s[name][process]
                    start = before[process]
                    cpu_s[name][process] = (
                        None
                        if after is None or start is None or spent is None
                        else spent + after - start
                    )
                _add(samples[name], part)
    result = {}
    for name, sample in samples.items():
        calls = sample.ok + sample.errors
        cpu = {
            f"{process}_cpu_ms_per_call": _cpu_ms_per_call(0.0, spent, calls)
            for process, spent in cpu_s[name].items()
        }
        cpu["loadgen_cpu_ms_per_call"] = _cpu_ms_per_call(0.0, sample.loadgen_cpu_s, calls)
        result[name] = (sample, cpu)
    return result


def _add(total: Sample, part: Sample) -> None:
    total.latencies_ms += part.latencies_ms
    total.first_byte_ms += part.first_byte_ms
    total.wall_s += part.wall_s
    total.errors += part.errors
    total.first_error = total.first_error or part.first_error
    total.loadgen_cpu_s += part.loadgen_cpu_s


def _stats(prefix: str, sample: Sample) -> dict[str, Any]:
    ok = bool(sample.latencies_ms)
    return {
        f"{prefix}_p50_ms": _ms(percentile(sample.latencies_ms, 50)) if ok else None,
        f"{prefix}_p99_ms": _ms(percentile(sample.latencies_ms, 99)) if ok else None,
        f"{prefix}_rps": round(sample.rps, 2),
    }


def _compare(direct: Sample, other: Sample, prefix: str) -> dict[str, Any]:
    """Latency and throughput of ``other`` against the direct run."""
    result = _stats(prefix, other)
    both = bool(direct.latencies_ms and other.latencies_ms)
    p50, p99 = (
        (
            percentile(other.latencies_ms, 50) - percentile(direct.latencies_ms, 50),
            percentile(other.latencies_ms, 99) - percentile(direct.latencies_ms, 99),
        )
        if both
        else (None, None)
    )
    result["added_p50_ms"] = _ms(p50)
    result["added_p99_ms"] = _ms(p99)
    if direct.first_byte_ms and other.first_byte_ms:
        # A stream's first event carries its first token (vLLM sends the role chunk with it).
        result["added_first_byte_p50_ms"] = _ms(
            percentile(other.first_byte_ms, 50) - percentile(direct.first_byte_ms, 50)
        )
    result["throughput_ratio"] = round(other.rps / direct.rps, 3) if direct.rps > 0 else None
    result["errors"] = other.errors
    if other.first_error is not None:
        result["error"] = other.first_error
    return result


def run_benchmark(
    settings: BenchSettings, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Run every configuration against every target and return the report (a JSON object);
    ``progress`` is called after each configuration with a short description."""
    log_dir = Path(tempfile.mkdtemp(prefix="trajgate-bench-"))
    session = uuid.uuid4().hex[:8]
    runs: list[dict[str, Any]] = []
    try:
        with running_targets(settings, log_dir) as targets:
            for stream in settings.streams:
                for concurrency in settings.concurrencies:
                    runs.append(_run_one(settings, targets, stream, concurrency, session))
                    if progress is not None:
                        progress(
                            f"{settings.dialect} stream={stream} concurrency={concurrency} done"
                        )
    finally:
        if settings.data_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)
    return {
        "benchmark": "gateway",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "gateway_mode": settings.gateway_mode,
        "loadgen": settings.loadgen,
        "dialect": settings.dialect,
        "added_against": (
            "the emulator's chat completions, the same request as the gateway's"
            if settings.dialect == "chat"
            else f"the emulator's chat completions: the gateway's {settings.dialect} call "
            "(translated to chat upstream) minus the same request sent directly as chat"
        ),
        "emulator": {
            "prompt_tokens": settings.prompt_tokens,
            "response_tokens": settings.response_tokens,
            "ttft_ms": settings.ttft_ms,
            "inter_token_ms": settings.inter_token_ms,
        },
        "requests_per_run": settings.requests,
        "warmup_requests": settings.warmup_requests,
        "steps_per_trajectory": settings.steps_per_trajectory,
        "continuations": list(settings.continuations),
        "goals": {
            "added_p50_ms_at_c1": GOAL_ADDED_P50_MS,
            "added_p99_ms_at_c1": GOAL_ADDED_P99_MS,
            "throughput_ratio_at_c64": GOAL_THROUGHPUT_RATIO,
        },
        "goals_met": goals_met(runs),
        "runs": runs,
    }


def _run_one(
    settings: BenchSettings,
    targets: Targets,
    stream: bool,
    concurrency: int,
    session: str,
) -> dict[str, Any]:
    """One configuration: the chat request directly at the emulator, then the request in
    ``settings.dialect`` through the gateway and through each other proxy."""
    dialect = settings.dialect
    run_id = f"bench-{session}-{'s' if stream else 'p'}{concurrency}"
    spt = settings.steps_per_trajectory

    def gateway_path(w: int, k: int) -> str:
        phase = "m" if w >= 0 else "w"  # measured or warm-up; only "m" steps are counted
        return f"/t/{run_id}-{phase}{abs(w)}-{k // spt}/v1{DIALECT_PATHS[dialect]}"

    bodies = [httpx.Request("POST", "/", json=request_body(settings, dialect, stream)).content]
    if settings.continuations:
        bodies = conversation_bodies(
            request_body(settings, "chat", stream),
            settings.steps_per_trajectory,
            settings.response_tokens,
        )

    def measure(
        base_url: str,
        path_of: Callable[[int, int], str],
        spoken: BenchDialect,
        gateway: bool,
        headers: dict[str, str] | None = None,
    ) -> Any:
        sent = bodies
        if spoken != dialect:  # the direct run speaks chat
            sent = [httpx.Request("POST", "/", json=request_body(settings, spoken, stream)).content]
        end = STREAM_ENDS[spoken]
        return asyncio.run(
            _measure(
                targets,
                base_url,
                path_of,
                sent,
                stream,
                concurrency,
                settings,
                gateway,
                end,
                headers,
            )
        )

    direct, direct_cpu = measure(targets.emulator_url, _fixed_path("/v1", "chat"), "chat", False)
    if settings.continuations:

        def mode_path(mode: str) -> Callable[[int, int], str]:
            return lambda w, k: gateway_path(w, k).replace(f"{run_id}-", f"{run_id}-{mode}-", 1)

        lanes: dict[str, Lane] = {
            mode: Lane(
                targets.gateway_url, mode_path(mode), targets.gateway_pid, mode_headers(mode)
            )
            for mode in settings.continuations
        }
        measured = asyncio.run(
            _measure_lanes(
                targets,
                lanes,
                bodies,
                stream,
                concurrency,
                settings,
                STREAM_ENDS[dialect],
            )
        )
        modes: dict[str, dict[str, Any]] = {}
        for mode, (sample, cpu) in measured.items():
            prefix = f"{run_id}-{mode}-m"
            modes[mode] = {
                **_compare(direct, sample, "gateway"),
                "first_byte_p50_ms": (
                    _ms(percentile(sample.first_byte_ms, 50)) if sample.first_byte_ms else None
                ),
                "steps_persisted": count_steps(targets.database_url, prefix),
                "steps_expected": sample.ok,
                "exact_steps": count_steps(targets.database_url, prefix, "exact"),
                "cpu_ms_per_call": cpu,
            }
        return {
            "dialect": dialect,
            "direct_dialect": "chat",
            "stream": stream,
            "concurrency": concurrency,
            "requests": settings.requests,
            **_stats("direct", direct),
            "direct_errors": direct.errors,
            "direct_cpu_ms_per_call": direct_cpu,
            "continuation": modes,
            **compare_modes(modes, stream, settings.response_tokens),
        }
    layers: dict[str, Any] = {}
    if targets.library_gateway_url is not None and targets.library_database_url is not None:
        # Own layers and the libraries' in alternating rounds: the CPU of each per call.
        library_url, library_db = targets.library_gateway_url, targets.library_database_url
        measured = asyncio.run(
            _measure_lanes(
                targets,
                {
                    "own": Lane(targets.gateway_url, gateway_path, targets.gateway_pid),
                    "library": Lane(library_url, gateway_path, targets.library_gateway_pid),
                },
                bodies,
                stream,
                concurrency,
                settings,
                STREAM_ENDS[dialect],
            )
        )
        (via_gateway, gateway_cpu), (via_library, library_cpu) = (
            measured["own"],
            measured["library"],
        )
        layers = {
            "library": {
                "upstream_transport": "httpx",
                "http_protocol": settings.library_protocol,
                **_compare(direct, via_library, "gateway"),
                "steps_persisted": count_steps(library_db, f"{run_id}-m"),
                "steps_expected": via_library.ok,
                "cpu_ms_per_call": library_cpu,
            },
            "own_gateway_cpu_ms_per_call": gateway_cpu["gateway_cpu_ms_per_call"],
            "library_gateway_cpu_ms_per_call": library_cpu["gateway_cpu_ms_per_call"],
        }
    else:
        via_gateway, gateway_cpu = measure(targets.gateway_url, gateway_path, dialect, True)
    run: dict[str, Any] = {
        "dialect": dialect,
        "direct_dialect": "chat",  # the emulator speaks chat only: what the gateway sends it
        "stream": stream,
        "concurrency": concurrency,
        "requests": settings.requests,
        **_stats("direct", direct),
        "direct_errors": direct.errors,
        **_compare(direct, via_gateway, "gateway"),
        "steps_persisted": count_steps(targets.database_url, f"{run_id}-m"),
        "steps_expected": via_gateway.ok,
        "cpu_ms_per_call": {"direct": direct_cpu, "gateway": gateway_cpu},
    }
    if layers:
        run["layers"] = layers
    if direct.first_error is not None:
        run["direct_error"] = direct.first_error
    proxies = []
    for proxy_url in settings.proxy_urls:
        url = httpx.URL(proxy_url)
        base_url = str(url.copy_with(path="/", query=None)).rstrip("/")
        sample, _cpu = measure(base_url, _fixed_path(url.path, dialect), dialect, False)
        proxies.append({"url": proxy_url, **_compare(direct, sample, "proxy")})
    if proxies:
        run["proxies"] = proxies
    return run


def _fixed_path(prefix: str, dialect: BenchDialect) -> Callable[[int, int], str]:
    path = f"{prefix.rstrip('/')}{DIALECT_PATHS[dialect]}"
    return lambda _worker, _k: path


def goals_met(runs: list[dict[str, Any]]) -> dict[str, bool | None]:
    """Whether each goal (``GOAL_*``) holds in ``runs``; None when no run measured it."""

    def all_of(values: list[bool]) -> bool | None:
        return all(values) if values else None

    c1 = [r for r in runs if r["concurrency"] == 1 and r.get("added_p50_ms") is not None]
    c64 = [r for r in runs if r["concurrency"] == 64 and r.get("throughput_ratio") is not None]
    return {
        "added_p50_ms_at_c1": all_of([r["added_p50_ms"] <= GOAL_ADDED_P50_MS for r in c1]),
        "added_p99_ms_at_c1": all_of([r["added_p99_ms"] <= GOAL_ADDED_P99_MS for r in c1]),
        "throughput_ratio_at_c64": all_of(
            [r["throughput_ratio"] >= GOAL_THROUGHPUT_RATIO for r in c64]
        ),
        "every_step_persisted": all_of(
            [
                measured["steps_persisted"] == measured["steps_expected"]
                for r in runs
                for measured in [r, *r.get("continuation", {}).values()]
                if measured.get("steps_expected")
            ]
        ),
        **continuation_goals_met(runs),
    }
