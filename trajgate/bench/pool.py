"""``trajgate bench pool``: write synthetic agent trajectories through the pool's writer and
measure commit rate, storage per token, amplification and exact reconstruction.

Owns: the synthetic traffic and the measurements. Never: used by the gateway.

Traffic (per trajectory, T = 20 turns): a 1,000-token system prompt and a 50-token task, then per
turn a 150-token response and a 300-token tool result (+ 4 template tokens) appended to the next
prompt, so turn k's prompt extends turn k-1's prompt + response. Token IDs are Zipf(1.1) draws
over a 151,936-token vocabulary (the shape of real text, not uniform noise); logprobs are float32
values. Each call carries every row the gateway writes for it through ``PoolStore.record_calls``:
the step (request, upstream request with ``return_token_ids``/``logprobs``, response message,
call id, request hash), its payload, one upstream attempt with the client's answer in vLLM's
shape (kept for Idempotency-Key replays), and the trajectory's counters. Message texts are short
placeholders by default, so the figures are those of the token payload path; with
``message_chars_per_token`` > 0 every request carries the agent's whole history as text, as a
real chat agent resends it (the pool stores each message once, as a delta on the parent step's
messages, and the upstream request as a merge patch: ``datapool.steps.messages``).

Measured: ``steps_per_s`` (steps committed per wall second through ``PoolWriter``, ``C``
concurrent agents), ``cpu_ms_per_step`` (CPU of the whole process, writer thread and agents, per
step while writing: the steadier figure when other jobs share the cores),
``ack_ms_p50/p99`` (time until ``record`` returned, i.e. durable),
``amplification`` (stored payload bytes after compaction ÷ 4 bytes × tokens of each trajectory's
final sequence ``P_T + R_T``), ``amplification_before_compaction`` (the SQL blobs), and
``bytes_per_token`` (stored bytes ÷ those final-sequence tokens, the distinct tokens),
``sql_bytes`` (the database's size once every step is committed, before compaction: SQLite's
pages after a WAL checkpoint, PostgreSQL's ``pg_database_size``), ``request_bytes`` (the JSON
text of the steps' stored requests, upstream requests, patches and body deltas, and of the
``json_blobs`` they share, part of ``sql_bytes``),
``read_tokens_per_s`` (prompt tokens reconstructed per second reading every step back) and
``exact`` (every prompt, response, logprob and request equal to what was written).

The write-path comparison (``spool``) appends the same calls as JSON lines to a per-process file
from one writer thread with the same batching, flushing (kill -9 durable) or fsyncing (power-loss
durable) once per batch, to price the alternative of a write-ahead spool.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import queue
import tempfile
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Engine, Text, cast, func, inspect, select, text
from sqlalchemy.engine import make_url

from datapool import db
from datapool.db import make_engine
from datapool.models import JsonBlob, PayloadFile, Step, StepPayload
from datapool.settings import PoolSettings
from datapool.steps.records import AttemptRecord, CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from datapool.steps.writer import PoolWriter

VOCAB_TOKENS = 151_936
SYSTEM_TOKENS, TASK_TOKENS, RESPONSE_TOKENS, TOOL_TOKENS = 1000, 50, 150, 300
_FILLER = "the agent reads the tool's output and decides what to call next; "


def synthetic_trajectory(
    rng: np.random.Generator,
    turns: int = 20,
    system_tokens: int = SYSTEM_TOKENS,
    response_tokens: int = RESPONSE_TOKENS,
    tool_tokens: int = TOOL_TOKENS,
) -> list[tuple[list[int], list[int], list[float]]]:
    """``[(P_k, R_k, L_k)]`` for k < turns, each prompt extending the previous prompt + response."""

    def draw(n: int) -> list[int]:
        return [int(x) for x in (rng.zipf(1.1, n) - 1) % VOCAB_TOKENS]

    prompt = draw(system_tokens) + draw(TASK_TOKENS)
    calls = []
    for _ in range(turns):
        response = draw(response_tokens)
        logprobs = (-rng.exponential(1.0, response_tokens)).astype(np.float32).tolist()
        calls.append((prompt, response, logprobs))
        prompt = prompt + response + draw(tool_tokens + 4)
    return calls


def _text(tokens: int, chars_per_token: int) -> str:
    n = tokens * chars_per_token
    return (_FILLER * (n // len(_FILLER) + 1))[:n]


def synthetic_messages(turn: int, chars_per_token: int = 0) -> list[dict[str, Any]]:
    """The request messages of turn ``turn`` (0-based): a placeholder when ``chars_per_token`` is
    0, else the whole history a chat agent resends on every call, as ASCII text of
    ``chars_per_token`` characters per token (system prompt, task, then per earlier turn its
    answer and its tool result)."""
    if chars_per_token == 0:
        return [{"role": "user", "content": f"turn {turn}"}]
    answer = {"role": "assistant", "content": _text(RESPONSE_TOKENS, chars_per_token)}
    tool = {
        "role": "tool",
        "tool_call_id": "call-0",
        "content": _text(TOOL_TOKENS, chars_per_token),
    }
    return [
        {"role": "system", "content": _text(SYSTEM_TOKENS, chars_per_token)},
        {"role": "user", "content": _text(TASK_TOKENS, chars_per_token)},
        *[message for _ in range(turn) for message in (answer, tool)],
    ]


def synthetic_call(
    trajectory_id: str,
    prompt: list[int],
    response: list[int],
    logprobs: list[float],
    turn: int,
    chars_per_token: int = 0,
) -> CallRecord:
    """One non-streaming chat call as the gateway records it (client asked for no token IDs);
    ``chars_per_token`` as in ``synthetic_messages`` (the answer's text too)."""
    request = {"model": "bench", "messages": synthetic_messages(turn, chars_per_token)}
    call_id = str(uuid.uuid4())
    message = {
        "role": "assistant",
        "content": _text(len(response), chars_per_token) if chars_per_token else f"answer {turn}",
    }
    usage = {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + len(response),
        "completion_tokens": len(response),
    }
    client_answer = {  # what the attempt row keeps: vLLM's answer with the IDs nulled
        "id": f"chatcmpl-{call_id}",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": None,
            }
        ],
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
    }
    return CallRecord(
        request=request,
        upstream_request={**request, "return_token_ids": True, "logprobs": True},
        model="bench",
        upstream="bench://",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        choices=[ChoiceRecord(0, response, logprobs, message, "stop")],
        call_id=call_id,
        request_hash=hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest(),
        attempts=(
            AttemptRecord(
                id=str(uuid.uuid4()),
                call_id=call_id,
                trajectory_id=trajectory_id,
                attempt_index=0,
                upstream="bench://",
                status_code=200,
                outcome="ok",
                error=None,
                latency_ms=1.0,
                response_body=client_answer,
            ),
        ),
    )


async def _drive(
    record: Any, trajectories: list[list[CallRecord]], concurrency: int
) -> tuple[float, list[float]]:
    """Run every trajectory's calls in order, ``concurrency`` trajectories at a time."""
    pending = list(enumerate(trajectories))
    acks_ms: list[float] = []

    async def agent() -> None:
        while pending:
            index, calls = pending.pop()
            for call in calls:
                started = time.perf_counter()
                await record(f"bench-{index}", call)
                acks_ms.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(agent() for _ in range(concurrency)))
    return time.perf_counter() - started, acks_ms


class BenchDatabaseNotEmptyError(ValueError):
    """The benchmark was pointed at a database that already holds tables."""


def refuse_non_empty(database_url: str) -> None:
    """Raise ``BenchDatabaseNotEmptyError`` unless the database has no tables at all."""
    engine = make_engine(database_url)
    try:
        tables = sorted(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    if tables:
        shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
        raise BenchDatabaseNotEmptyError(
            f"refusing to benchmark {make_url(database_url).render_as_string()}: it holds "
            f"tables ({shown}); expected an empty database (the benchmark writes, compacts and "
            "deletes payloads, which would destroy a live pool's token data)"
        )


def bench_pool(
    database_url: str,
    data_dir: Path,
    trajectories: int = 100,
    turns: int = 20,
    concurrency: int = 64,
    seed: int = 0,
    message_chars_per_token: int = 0,
) -> dict[str, Any]:
    """One measurement on one database, which must be empty; returns the figures named above.

    Raises ``BenchDatabaseNotEmptyError`` when the database already holds tables: the benchmark
    compacts every pending payload into files under its own temporary directory, which would
    take a live pool's payloads with it.
    """
    # Over 80 lines on purpose: a benchmark reads as one script (set-up, load, measurement,
    # report) in the order it runs; pieces would hide what is timed.
    refuse_non_empty(database_url)
    db.upgrade(database_url)
    settings = PoolSettings(data_dir=data_dir, database_url=database_url, compaction_interval_s=0)
    rng = np.random.default_rng(seed)
    shapes = [synthetic_trajectory(rng, turns) for _ in range(trajectories)]
    calls = [
        [
            synthetic_call(f"bench-{i}", p, r, lp, k, message_chars_per_token)
            for k, (p, r, lp) in enumerate(shape)
        ]
        for i, shape in enumerate(shapes)
    ]
    store = PoolStore(make_engine(database_url), settings)
    writer = PoolWriter(store, settings).start()
    # The traffic is built up front (2,000 calls: ~11 M list slots of token IDs); a gateway only
    # holds the calls in flight. Frozen, the collector stops rescanning it in every full
    # collection, pauses of ~70 ms that belong to this harness, not to the write path.
    gc.freeze()
    try:
        cpu_started_s = time.process_time()
        wall_s, acks_ms = asyncio.run(_drive(writer.record, calls, concurrency))
        cpu_s = time.process_time() - cpu_started_s
    finally:
        gc.unfreeze()
        writer.close()
    steps = trajectories * turns
    final_tokens = sum(len(s[-1][0]) + len(s[-1][1]) for s in shapes)
    with store.sessions() as session:
        blob_bytes = session.scalar(
            select(
                func.sum(
                    func.coalesce(func.length(StepPayload.prompt_delta), 0)
                    + func.coalesce(func.length(StepPayload.response_token_ids), 0)
                    + func.coalesce(func.length(StepPayload.response_logprobs), 0)
                )
            )
        )
    sql_bytes = _database_bytes(store.engine)
    with store.sessions() as session:
        request_bytes = session.scalar(
            select(
                func.sum(
                    func.coalesce(func.length(cast(Step.request, Text)), 0)
                    + func.coalesce(func.length(cast(Step.upstream_request, Text)), 0)
                    + func.coalesce(func.length(cast(Step.upstream_request_patch, Text)), 0)
                    + func.coalesce(func.length(cast(Step.body_deltas, Text)), 0)
                )
            )
        )
        # Values the steps share (tool lists, system prompts) are stored once, there.
        request_bytes = (request_bytes or 0) + (
            session.scalar(select(func.sum(func.length(JsonBlob.body)))) or 0
        )
    while store.payloads.compact(settings.compaction_max_steps) is not None:
        pass
    with store.sessions() as session:
        stored_bytes = int(session.scalar(select(func.sum(PayloadFile.size_bytes))) or 0)
    started = time.perf_counter()
    exact = True
    read_tokens = 0
    fresh = PoolStore(make_engine(database_url), settings)
    for index, shape in enumerate(shapes):
        for step, (prompt, response, logprobs), call in zip(
            fresh.steps_of(f"bench-{index}"), shape, calls[index], strict=True
        ):
            read_tokens += len(step.prompt_token_ids or [])
            exact &= (
                step.prompt_token_ids == prompt
                and step.response_token_ids == response
                and step.response_logprobs == logprobs
                and step.request == call.request
                and step.upstream_request == call.upstream_request
            )
    read_s = time.perf_counter() - started
    store.engine.dispose()
    fresh.engine.dispose()
    return {
        "backend": make_engine(database_url).dialect.name,
        "trajectories": trajectories,
        "turns": turns,
        "steps": steps,
        "concurrency": concurrency,
        "message_chars_per_token": message_chars_per_token,
        "steps_per_s": round(steps / wall_s, 1),
        "cpu_ms_per_step": round(cpu_s * 1000 / steps, 3),
        "ack_ms_p50": round(float(np.percentile(acks_ms, 50)), 2),
        "ack_ms_p99": round(float(np.percentile(acks_ms, 99)), 2),
        "final_sequence_tokens": final_tokens,
        "stored_payload_bytes": stored_bytes,
        "sql_bytes": sql_bytes,
        "request_bytes": int(request_bytes or 0),
        "bytes_per_token": round(stored_bytes / final_tokens, 3),
        "amplification": round(stored_bytes / (4 * final_tokens), 3),
        "amplification_before_compaction": round(int(blob_bytes or 0) / (4 * final_tokens), 3),
        "read_tokens_per_s": round(read_tokens / read_s),
        "exact": bool(exact),
    }


def _database_bytes(engine: Engine) -> int:
    """The database's size: SQLite's pages once the WAL is checkpointed into the file,
    PostgreSQL's ``pg_database_size``."""
    with engine.connect() as connection:
        if connection.dialect.name == "sqlite":
            connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            pages = connection.exec_driver_sql("PRAGMA page_count").scalar_one()
            page_size = connection.exec_driver_sql("PRAGMA page_size").scalar_one()
            return int(pages) * int(page_size)
        return int(
            connection.execute(text("SELECT pg_database_size(current_database())")).scalar_one()
        )


def bench_spool(
    directory: Path,
    trajectories: int,
    turns: int,
    concurrency: int,
    fsync: bool,
    seed: int = 0,
    message_chars_per_token: int = 0,
) -> dict[str, Any]:
    """The write-ahead-spool alternative: same traffic, JSON lines, one flush/fsync per batch."""
    rng = np.random.default_rng(seed)
    calls = [
        [
            synthetic_call(f"bench-{i}", p, r, lp, k, message_chars_per_token)
            for k, (p, r, lp) in enumerate(synthetic_trajectory(rng, turns))
        ]
        for i in range(trajectories)
    ]
    path = directory / f"spool-{uuid.uuid4().hex}.jsonl"
    items: queue.Queue[Any] = queue.Queue()

    def run() -> None:
        with path.open("ab") as sink:
            while True:
                first = items.get()
                if first is None:
                    return
                batch = [first]
                while len(batch) < 512:
                    try:
                        batch.append(items.get_nowait())
                    except queue.Empty:
                        break
                for line, _loop, _future in batch:
                    sink.write(line)
                sink.flush()
                if fsync:
                    os.fsync(sink.fileno())
                for _line, loop, future in batch:
                    loop.call_soon_threadsafe(future.set_result, [])

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    async def record(trajectory_id: str, call: CallRecord) -> list[str]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[str]] = loop.create_future()
        line = json.dumps({"trajectory_id": trajectory_id, "call": asdict(call)}).encode() + b"\n"
        items.put((line, loop, future))
        return await future

    gc.freeze()  # as in bench_pool: the prepared traffic is the harness's, not the spool's
    try:
        wall_s, acks_ms = asyncio.run(_drive(record, calls, concurrency))
    finally:
        gc.unfreeze()
    items.put(None)
    thread.join()
    return {
        "option": "spool+fsync" if fsync else "spool+flush",
        "steps_per_s": round(trajectories * turns / wall_s, 1),
        "ack_ms_p50": round(float(np.percentile(acks_ms, 50)), 2),
        "ack_ms_p99": round(float(np.percentile(acks_ms, 99)), 2),
        "spool_bytes": path.stat().st_size,
    }


def run_pool_benchmark(
    database_urls: list[str],
    trajectories: int = 100,
    turns: int = 20,
    concurrency: int = 64,
    compare_spool: bool = False,
    message_chars_per_token: int = 0,
) -> dict[str, Any]:
    """Every database URL (empty, migrated here) and optionally the spool alternative."""
    report: dict[str, Any] = {"runs": []}
    with tempfile.TemporaryDirectory(prefix="trajgate-bench-pool-") as tmp:
        for i, url in enumerate(database_urls):
            report["runs"].append(
                bench_pool(
                    url,
                    Path(tmp) / f"pool-{i}",
                    trajectories,
                    turns,
                    concurrency,
                    message_chars_per_token=message_chars_per_token,
                )
            )
        if compare_spool:
            report["spool"] = [
                bench_spool(
                    Path(tmp),
                    trajectories,
                    turns,
                    concurrency,
                    fsync=f,
                    message_chars_per_token=message_chars_per_token,
                )
                for f in (False, True)
            ]
    return report
