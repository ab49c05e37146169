"""``trajgate bench horizon``: what a call costs as its session's history grows.

Owns: running ``sessions`` concurrent coding-agent sessions of ``turns`` calls each
(``trajgate.bench.agent_session``: an 11-tool list of about 28 KB, ~450-character tool results,
the whole history re-sent every turn) through the gateway against the emulator with vLLM's
exact-continuation endpoints (``prompt_ids="messages"``), per dialect and per ``stream`` value,
and the report per tenth of the session. Never: asserts goals (``last_over_first`` gives the
ratios the goals of invariant 10 in DESIGN.md are stated in).

One emulator, one gateway (``trajgate serve`` in its own process,
``trajgate.bench.gateway.running_targets``) and one SQLite pool serve every configuration
(dialect × stream) in turn; each configuration first sends one unmeasured warm-up session of
``WARMUP_TURNS`` turns. The session's turns are cut in ten tenths
(``turns >= 10``); the sessions run concurrently, each sending its turns one after another,
and wait for each other at the end of every tenth. Per tenth ``k`` (turns ``[k T/10,
(k+1) T/10)``):

- ``direct_p50_ms``: the same conversations sent as chat completions straight to the emulator
  (what the gateway sends upstream for every dialect) just before the gateway's calls;
  ``gateway_p50_ms``: through the gateway; ``added_p50_ms`` = the difference of the two p50s
  (wall ms from sending the request to the last byte of the answer).
- ``gateway_cpu_ms_per_call``: the gateway process's user + system CPU (``/proc``) over the
  tenth's gateway calls ÷ those calls; ``gateway_loop_cpu_ms_per_call`` the same of its main
  thread alone (the event loop: what every call waits on; the rest is the pool's writer and
  the threads of its lookups).
- ``engine_direct_cpu_ms_per_call`` / ``engine_gateway_cpu_ms_per_call``: the emulator
  process's CPU over the tenth's direct calls ÷ those calls, and over the gateway's calls ÷
  those: what the engine side works per call when a chat call comes straight and when the
  gateway's exact continuation asks it (render, generate, derender), each carrying the history.
- ``request_bytes``: mean size of the client's body (bytes).
- ``stored_bytes_per_step``: mean over the tenth's steps of what the pool keeps per step: its
  ``steps`` row, every row of any table with a ``step_id`` column naming it
  (``step_payloads``...) and the ``call_attempts`` of its call; each value counted as stored
  (text and JSON as UTF-8 bytes, blobs as their length, numbers 8 bytes).
- ``step_read_p50_ms`` / ``step_read_bytes``: ``GET /api/steps/{id}`` of up to
  ``reads_per_tenth`` of session 0's steps of the tenth, read after the sessions ended.
- ``trajectory_view_ms`` / ``trajectory_view_bytes``: ``GET
  /api/inspector/trajectories/{id}`` of session 0 at the end of the tenth (its steps so far).
- ``exact_steps`` and ``prefix_breaks``: steps whose prompt exact continuation built, and
  steps that do not extend their parent.

Per run: ``stored_bytes_per_session`` (the steps' bytes above, summed, ÷ sessions) and
``pool_bytes_per_session`` (every row of every table plus the Parquet payload files, what the
measured sessions added after the warm-up, ÷ sessions: also rows shared by steps, such as
content-addressed bodies), and ``last_over_first``: each figure's last tenth ÷ first tenth.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field, field_validator
from sqlalchemy import inspect, text

from datapool import db
from trajgate.bench import agent_session
from trajgate.bench.continuation import emulator_answer
from trajgate.bench.gateway import (
    BENCH_DIALECTS,
    DIALECT_PATHS,
    STREAM_ENDS,
    BenchDialect,
    BenchSettings,
    Caller,
    Targets,
    percentile,
    process_cpu_s,
    running_targets,
)

TENTHS = 10
WARMUP_TURNS = 3
# Figures whose last tenth ÷ first tenth the report gives.
RATIO_FIGURES = (
    "gateway_cpu_ms_per_call",
    "gateway_loop_cpu_ms_per_call",
    "engine_direct_cpu_ms_per_call",
    "engine_gateway_cpu_ms_per_call",
    "direct_p50_ms",
    "gateway_p50_ms",
    "added_p50_ms",
    "request_bytes",
    "stored_bytes_per_step",
    "step_read_p50_ms",
    "step_read_bytes",
    "trajectory_view_ms",
    "trajectory_view_bytes",
)


class HorizonSettings(BaseModel):
    """One long-horizon benchmark: the sessions, the emulated engine and what to read back."""

    sessions: int = Field(default=4, ge=1, description="Concurrent sessions per configuration.")
    turns: int = Field(default=200, ge=TENTHS, description="Calls per session (at least 10).")
    dialects: tuple[BenchDialect, ...] = Field(
        default=BENCH_DIALECTS, description="Dialects spoken to the gateway, one run each."
    )
    streams: tuple[bool, ...] = Field(default=(False, True), description="stream values to run.")
    prompt_tokens: int = Field(
        default=60, ge=1, description="Tokens the emulator renders per message (tokens)."
    )
    response_tokens: int = Field(default=40, ge=1, description="Tokens sampled per call.")
    tool_result_chars: int = Field(default=450, ge=1, description="Size of a tool result.")
    ttft_ms: float = Field(default=0.0, ge=0, description="Emulated time to first token (ms).")
    inter_token_ms: float = Field(default=0.0, ge=0, description="Emulated token gap (ms).")
    reads_per_tenth: int = Field(
        default=5, ge=1, description="Steps of session 0 read back per tenth (GET /api/steps)."
    )
    pin_cores: bool = Field(
        default=False,
        description="The gateway on cores of its own (BenchSettings.pin_cores).",
    )
    data_dir: Path | None = Field(
        default=None, description="Keep the gateway's pool and logs here; default a temporary dir."
    )

    @field_validator("dialects", "streams")
    @classmethod
    def _each_once(cls, values: tuple[Any, ...]) -> tuple[Any, ...]:
        """A configuration named twice would run twice on the same trajectory ids, the second
        run continuing the first's sessions and its figures counting both."""
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated:
            raise ValueError(f"each value at most once; repeated: {', '.join(repeated)}")
        return values


def run_horizon(
    settings: HorizonSettings, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Every configuration (dialect × stream) and the report (a JSON object); ``progress`` is
    called after each tenth with a short description."""
    answer = emulator_answer(settings.response_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="trajgate-horizon-"))
    data_dir = settings.data_dir or log_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    bench = BenchSettings(
        prompt_tokens=settings.prompt_tokens,
        response_tokens=settings.response_tokens,
        ttft_ms=settings.ttft_ms,
        inter_token_ms=settings.inter_token_ms,
        # An "exact" channel makes running_targets start the emulator with prompt_ids="messages"
        # and the scale-out endpoints exact continuation needs; exact is also the default mode.
        continuations=("exact",),
        pin_cores=settings.pin_cores,
        data_dir=data_dir,
    )
    session = uuid.uuid4().hex[:8]
    runs = []
    failed = True
    try:
        with running_targets(bench, data_dir) as targets:
            for dialect in settings.dialects:
                for stream in settings.streams:
                    prefix = f"horizon-{session}-{dialect}-{'stream' if stream else 'unary'}"
                    runs.append(
                        asyncio.run(
                            _sessions(settings, targets, dialect, stream, answer, prefix, progress)
                        )
                    )
        failed = False
    finally:
        if failed and settings.data_dir is None:
            # the gateway's and emulator's logs say why: kept, not deleted with the temp dir
            if progress is not None:
                progress(f"the run failed: its logs and pool are kept in {log_dir}")
        else:  # a run that kept its pool and logs in data_dir leaves no empty temp dir either
            shutil.rmtree(log_dir, ignore_errors=True)
    return {
        "benchmark": "horizon",
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "sessions": settings.sessions,
        "turns": settings.turns,
        "emulator": {
            "prompt_tokens_per_message": settings.prompt_tokens,
            "response_tokens": settings.response_tokens,
            "ttft_ms": settings.ttft_ms,
            "inter_token_ms": settings.inter_token_ms,
            "prompt_ids": "messages",
        },
        "tool_list_bytes": {d: agent_session.tool_list_bytes(d) for d in settings.dialects},
        "system_prompt_bytes": len(agent_session.SYSTEM_PROMPT.encode()),
        "tool_result_chars": settings.tool_result_chars,
        "runs": runs,
    }


def _bodies(
    settings: HorizonSettings,
    dialect: BenchDialect,
    stream: bool,
    answer: str,
    session: int,
    turns: range,
) -> list[bytes]:
    """The JSON bodies of ``turns`` of ``session`` in ``dialect``, built before they are sent
    so the load generator's JSON work stays out of the measured window."""
    return [
        json.dumps(
            agent_session.body(
                dialect,
                session,
                turn,
                answer,
                stream=stream,
                response_tokens=settings.response_tokens,
                tool_result_chars=settings.tool_result_chars,
            )
        ).encode()
        for turn in turns
    ]


async def _send_all(
    callers: Sequence[Caller],
    paths: Sequence[str],
    bodies: Sequence[Sequence[bytes]],
    stream: bool,
) -> tuple[list[float], list[str]]:
    """Each caller sends its bodies one after another to its path, the callers concurrently;
    the latencies of the answered calls (ms) and the errors."""
    latencies: list[float] = []
    errors: list[str] = []

    async def session(caller: Caller, path: str, sent: Sequence[bytes]) -> None:
        for body in sent:
            started = time.perf_counter()
            try:
                error = await caller.call(path, body, stream)
            except (OSError, httpx.HTTPError) as exc:
                error = f"{type(exc).__name__}: {exc}"
            if error is None:
                latencies.append((time.perf_counter() - started) * 1000.0)
            else:
                errors.append(error)

    await asyncio.gather(*(session(*args) for args in zip(callers, paths, bodies, strict=True)))
    return latencies, errors


async def _sessions(
    settings: HorizonSettings,
    targets: Targets,
    dialect: BenchDialect,
    stream: bool,
    answer: str,
    prefix: str,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    """Warm up, run the sessions tenth by tenth, then read back what the pool kept."""
    n, turns = settings.sessions, settings.turns
    gateway_path = f"/v1{DIALECT_PATHS[dialect]}"
    trajectories = [f"{prefix}-{s}" for s in range(n)]
    paths = [f"/t/{t}{gateway_path}" for t in trajectories]
    direct_paths = [f"/v1{DIALECT_PATHS['chat']}"] * n
    gateway_callers = [Caller(targets.gateway_url, "raw", STREAM_ENDS[dialect]) for _ in range(n)]
    direct_callers = [Caller(targets.emulator_url, "raw", STREAM_ENDS["chat"]) for _ in range(n)]
    view_client = httpx.AsyncClient(base_url=targets.gateway_url, timeout=600.0)
    try:
        warm = _bodies(settings, dialect, stream, answer, n, range(WARMUP_TURNS))
        _, warm_errors = await _send_all(
            gateway_callers[:1], [f"/t/{prefix}-warm-up{gateway_path}"], [warm], stream
        )
        if warm_errors:
            raise RuntimeError(f"the warm-up call failed: {warm_errors[0]}")
        # the view's first read in a process is cold (imports, caches): not the first tenth's
        await _timed_get(view_client, f"/api/inspector/trajectories/{prefix}-warm-up")
        pool_before = pool_bytes(targets.database_url)
        tenths: list[dict[str, Any]] = []
        errors: list[str] = []
        for k in range(TENTHS):
            span = range(k * turns // TENTHS, (k + 1) * turns // TENTHS)
            direct = [_bodies(settings, "chat", stream, answer, s, span) for s in range(n)]
            sent = [_bodies(settings, dialect, stream, answer, s, span) for s in range(n)]
            engine = targets.emulator_pid
            engine_direct_before = process_cpu_s(engine)
            direct_ms, direct_errors = await _send_all(direct_callers, direct_paths, direct, stream)
            engine_direct_after = process_cpu_s(engine)
            pid = targets.gateway_pid
            cpu_before, loop_before = process_cpu_s(pid), process_cpu_s(pid, pid)
            gateway_ms, gateway_errors = await _send_all(gateway_callers, paths, sent, stream)
            cpu_after, loop_after = process_cpu_s(pid), process_cpu_s(pid, pid)
            engine_gateway_after = process_cpu_s(engine)
            errors += direct_errors + gateway_errors
            view_ms, view_bytes = await _timed_get(
                view_client, f"/api/inspector/trajectories/{trajectories[0]}"
            )
            calls = len(span) * n
            tenths.append(
                {
                    "tenth": k + 1,
                    "turns": [span.start, span.stop],
                    "calls": calls,
                    "errors": len(direct_errors) + len(gateway_errors),
                    "request_bytes": round(statistics.fmean(len(b) for s in sent for b in s)),
                    "gateway_cpu_ms_per_call": _per_call_ms(cpu_before, cpu_after, calls),
                    "gateway_loop_cpu_ms_per_call": _per_call_ms(loop_before, loop_after, calls),
                    "engine_direct_cpu_ms_per_call": _per_call_ms(
                        engine_direct_before, engine_direct_after, calls
                    ),
                    "engine_gateway_cpu_ms_per_call": _per_call_ms(
                        engine_direct_after, engine_gateway_after, calls
                    ),
                    **_latencies(direct_ms, gateway_ms),
                    "trajectory_view_ms": view_ms,
                    "trajectory_view_bytes": view_bytes,
                }
            )
            if progress is not None:
                progress(f"{dialect} stream={stream}: tenth {k + 1} of {TENTHS} done")
        pool_after = pool_bytes(targets.database_url)
        steps = step_bytes(targets.database_url, trajectories)
        await _read_steps(settings, view_client, steps[trajectories[0]], tenths)
    finally:
        await view_client.aclose()
        for caller in [*gateway_callers, *direct_callers]:
            await caller.close()
    stored_total = 0
    for tenth in tenths:
        span = range(*tenth["turns"])
        of_tenth = [row for t in trajectories for row in steps[t] if row.turn in span]
        tenth["steps"] = len(of_tenth)
        tenth["stored_bytes_per_step"] = (
            round(statistics.fmean(row.stored_bytes for row in of_tenth)) if of_tenth else None
        )
        tenth["exact_steps"] = sum(row.continuation == "exact" for row in of_tenth)
        tenth["prefix_breaks"] = sum(row.extends_parent is False for row in of_tenth)
        stored_total += sum(row.stored_bytes for row in of_tenth)
    return {
        "dialect": dialect,
        "stream": stream,
        "sessions": n,
        "turns": turns,
        "steps_expected": n * turns,
        "steps_persisted": sum(len(steps[t]) for t in trajectories),
        "errors": len(errors),
        **({"first_error": errors[0]} if errors else {}),
        "stored_bytes_per_session": round(stored_total / n),
        "pool_bytes_per_session": round((pool_after - pool_before) / n),
        "tenths": tenths,
        "last_over_first": last_over_first(tenths),
    }


def _per_call_ms(before_s: float | None, after_s: float | None, calls: int) -> float | None:
    if before_s is None or after_s is None:
        return None
    return round((after_s - before_s) * 1000.0 / calls, 3)


def _latencies(direct_ms: list[float], gateway_ms: list[float]) -> dict[str, float | None]:
    direct = round(percentile(direct_ms, 50), 3) if direct_ms else None
    gateway = round(percentile(gateway_ms, 50), 3) if gateway_ms else None
    added = None if direct is None or gateway is None else round(gateway - direct, 3)
    return {"direct_p50_ms": direct, "gateway_p50_ms": gateway, "added_p50_ms": added}


async def _timed_get(client: httpx.AsyncClient, path: str) -> tuple[float, int]:
    """Wall ms and body bytes of ``GET path``; raises ``RuntimeError`` unless it is 200."""
    started = time.perf_counter()
    answer = await client.get(path)
    elapsed_ms = (time.perf_counter() - started) * 1000.0
    if answer.status_code != 200:
        raise RuntimeError(f"GET {path}: HTTP {answer.status_code}: {answer.text[:300]}")
    return round(elapsed_ms, 3), len(answer.content)


async def _read_steps(
    settings: HorizonSettings,
    client: httpx.AsyncClient,
    rows: Sequence[StepRow],
    tenths: list[dict[str, Any]],
) -> None:
    """``step_read_p50_ms`` and ``step_read_bytes`` (mean) of each tenth, from session 0."""
    for tenth in tenths:
        span = range(*tenth["turns"])
        chosen = [row for row in rows if row.turn in span][: settings.reads_per_tenth]
        reads = [await _timed_get(client, f"/api/steps/{row.step_id}") for row in chosen]
        tenth["step_read_p50_ms"] = (
            round(percentile([ms for ms, _ in reads], 50), 3) if reads else None
        )
        tenth["step_read_bytes"] = (
            round(statistics.fmean(size for _, size in reads)) if reads else None
        )


def last_over_first(tenths: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Each of ``RATIO_FIGURES``: its last tenth ÷ its first tenth (None where either is
    missing or the first is not positive)."""
    first, last = tenths[0], tenths[-1]
    ratios: dict[str, float | None] = {}
    for figure in RATIO_FIGURES:
        a, b = first.get(figure), last.get(figure)
        ratios[figure] = None if a is None or b is None or a <= 0 else round(b / a, 3)
    return ratios


# ---- what the pool keeps ----------------------------------------------------------------


class StepRow:
    """One step of a measured session: its id, turn (0-based), what built its prompt, whether
    it extends its parent, and the bytes stored for it (the module docstring)."""

    __slots__ = ("continuation", "extends_parent", "step_id", "stored_bytes", "turn")

    def __init__(
        self,
        step_id: str,
        turn: int,
        continuation: str | None,
        extends_parent: bool | None,
        stored_bytes: int,
    ) -> None:
        self.step_id, self.turn, self.stored_bytes = step_id, turn, stored_bytes
        self.continuation, self.extends_parent = continuation, extends_parent


def value_bytes(value: Any) -> int:
    """Bytes a column value takes as stored: text and JSON as UTF-8, blobs as their length,
    numbers 8, NULL 0."""
    if value is None:
        return 0
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bool | int | float):
        return 8
    if isinstance(value, dict | list):
        return len(json.dumps(value).encode())
    return len(str(value).encode())


def _row_bytes(row: Sequence[Any]) -> int:
    return sum(value_bytes(value) for value in row)


def pool_bytes(database_url: str) -> int:
    """Every row of every table of the pool, plus its Parquet payload files (bytes)."""
    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            total = 0
            for table in inspect(conn).get_table_names():
                for row in conn.execute(text(f'SELECT * FROM "{table}"')):
                    total += _row_bytes(row)
            if "payload_files" in inspect(conn).get_table_names():
                files = conn.execute(text("SELECT COALESCE(SUM(size_bytes), 0) FROM payload_files"))
                total += int(files.scalar_one())
            return total
    finally:
        engine.dispose()


def step_bytes(database_url: str, trajectories: Sequence[str]) -> dict[str, list[StepRow]]:
    """Per trajectory, its steps in order (``StepRow``) with what each keeps: its ``steps``
    row, every row naming it in a ``step_id`` column and its call's ``call_attempts``."""
    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            tables = inspect(conn).get_table_names()
            linked: dict[str, int] = defaultdict(int)
            for table in tables:
                columns = [c["name"] for c in inspect(conn).get_columns(table)]
                if "step_id" in columns and table != "steps":
                    for row in conn.execute(text(f'SELECT step_id, * FROM "{table}"')):
                        linked[row[0]] += _row_bytes(row[1:])
            by_call: dict[str, int] = defaultdict(int)
            if "call_attempts" in tables:
                for row in conn.execute(text("SELECT call_id, * FROM call_attempts")):
                    by_call[row[0]] += _row_bytes(row[1:])
            result: dict[str, list[StepRow]] = {}
            for trajectory in trajectories:
                query = text(
                    "SELECT id, call_id, continuation, extends_parent, * FROM steps "
                    "WHERE trajectory_id = :t ORDER BY step_index, choice_index"
                )
                rows = conn.execute(query, {"t": trajectory}).all()
                result[trajectory] = [
                    StepRow(
                        step_id=row[0],
                        turn=turn,
                        continuation=row[2],
                        extends_parent=None if row[3] is None else bool(row[3]),
                        stored_bytes=(
                            _row_bytes(row[4:]) + linked[row[0]] + by_call.get(row[1] or "", 0)
                        ),
                    )
                    for turn, row in enumerate(rows)
                ]
            return result
    finally:
        engine.dispose()


def side_by_side(report: dict[str, Any]) -> list[str]:
    """The report as text: per run, each ratio figure's first tenth, last tenth and ratio."""
    lines = []
    for run in report["runs"]:
        mode = "streamed" if run["stream"] else "unary"
        exact = sum(t["exact_steps"] for t in run["tenths"])
        breaks = sum(t["prefix_breaks"] for t in run["tenths"])
        lines.append(
            f"{run['dialect']} {mode}, {run['sessions']} x {run['turns']} turns: "
            f"{run['steps_persisted']}/{run['steps_expected']} steps ({exact} exact, "
            f"{breaks} prefix breaks), {run['errors']} errors, "
            f"{run['stored_bytes_per_session']:,} stored bytes per session "
            f"({run['pool_bytes_per_session']:,} in the whole pool)"
        )
        lines.append(f"  {'figure':<32}{'first tenth':>14}{'last tenth':>14}{'last/first':>12}")
        first, last = run["tenths"][0], run["tenths"][-1]
        for figure in RATIO_FIGURES:
            ratio = run["last_over_first"][figure]
            lines.append(
                f"  {figure:<32}{_cell(first.get(figure)):>14}{_cell(last.get(figure)):>14}"
                f"{_cell(ratio):>12}"
            )
    return lines


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) and abs(value) < 1000 else f"{value:,.0f}"
