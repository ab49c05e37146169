"""``trajgate serve --workers 2``: two real worker processes on one port and one PostgreSQL pool.
Calls are served by both (the pool records which process wrote each trajectory), ``/metrics``
on any worker counts the calls of both, the parent's liveness port answers for the workers, and
a full-weight update, which would pause only one worker, is refused.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import _create_postgres_database, _drop_postgres_database
from sqlalchemy import select
from tests_support import free_port

from datapool.db import make_engine
from datapool.models import Trajectory
from datapool.settings import PoolSettings
from trajgate.bench.fleet import audit, drive, start_emulator, start_gateway

CALLS = 40
ROUNDS = 5
CONCURRENCY = 8


@pytest.fixture
def postgres_url() -> Iterator[str]:
    url = _create_postgres_database()
    yield url
    _drop_postgres_database(url)


@pytest.fixture
def emulator_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    process = start_emulator(
        {
            "TRAJGATE_EMULATOR_PORT": str(port),
            "TRAJGATE_EMULATOR_PROMPT_TOKENS": "20",
            "TRAJGATE_EMULATOR_RESPONSE_TOKENS": "4",
            "TRAJGATE_EMULATOR_INTER_TOKEN_MS": "5",
        },
        tmp_path / "emulator.log",
    )
    yield f"http://127.0.0.1:{port}"
    process.kill()
    process.wait()


async def _calls(url: str, ids: list[str]) -> list[int]:
    """One call per trajectory id, ``CONCURRENCY`` at a time, each on a new connection (the
    kernel hands each accepted connection to one worker)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def call(trajectory_id: str) -> int:
            async with semaphore:
                response = await client.post(
                    f"/t/{trajectory_id}/v1/chat/completions",
                    json={"model": "emulated", "messages": [{"role": "user", "content": "hi"}]},
                )
                return response.status_code

        return await asyncio.gather(*(call(i) for i in ids))


def _start_two_workers(
    env: dict[str, str], log: Path, liveness_port: int
) -> subprocess.Popen[bytes]:
    """``trajgate serve`` with ``env`` (two workers); returns once the parent's liveness port says
    both workers answer (the main port answers as soon as the first one does)."""
    process = start_gateway(env, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = httpx.get(f"http://127.0.0.1:{liveness_port}/health", timeout=5).json()
        if answer.get("workers") == 2:
            return process
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the second worker did not start: {log.read_text()[-2000:]}")


def _writer_pids(database_url: str, ids: list[str]) -> set[str]:
    """The processes that wrote ``ids`` (each trajectory keeps its last writer, host:pid:start)."""
    engine = make_engine(database_url)
    with engine.connect() as conn:
        writers = conn.scalars(select(Trajectory.writer_id).where(Trajectory.id.in_(ids))).all()
    engine.dispose()
    return {writer.split(":")[1] for writer in writers if writer}


def _sample(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", metrics, re.MULTILINE)
    assert match is not None, f"{name} not in /metrics"
    return float(match.group(1))


def test_two_workers_serve_calls_from_both_and_metrics_count_both(
    postgres_url: str, emulator_url: str, tmp_path: Path
) -> None:
    port, liveness_port = free_port(), free_port()
    env = {
        "TRAJGATE_DATABASE_URL": postgres_url,
        "TRAJGATE_DATA_DIR": str(tmp_path / "data"),
        "TRAJGATE_PORT": str(port),
        "TRAJGATE_UPSTREAM_URL": emulator_url,
        "TRAJGATE_WORKERS": "2",
        "TRAJGATE_LIVENESS_PORT": str(liveness_port),
    }
    process: subprocess.Popen[bytes] | None = None
    try:
        process = _start_two_workers(env, tmp_path / "gateway.log", liveness_port)
        url = f"http://127.0.0.1:{port}"
        # The kernel hands each connection to whichever worker accepts first: calls go in rounds
        # of 40 until the pool shows both workers wrote (one round, barring a starved worker).
        ids: list[str] = []
        for round_ in range(ROUNDS):
            batch = [f"worker-{round_}-{i}" for i in range(CALLS)]
            assert asyncio.run(_calls(url, batch)) == [200] * CALLS
            ids += batch
            if len(_writer_pids(postgres_url, ids)) == 2:
                break
        assert len(_writer_pids(postgres_url, ids)) == 2

        # every call counted once, whichever worker answers the scrape: both workers' summed
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert _sample(metrics, "trajgate_pool_calls_committed_total") == len(ids)
        assert _sample(
            metrics, 'trajgate_requests_total{endpoint="chat.completions",status="200"}'
        ) == len(ids)

        liveness = httpx.get(f"http://127.0.0.1:{liveness_port}/health", timeout=10)
        assert liveness.status_code == 200
        assert (liveness.json()["status"], liveness.json()["workers"]) == ("ok", 2)

        refused = httpx.post(
            f"{url}/admin/weight-updates",
            json={"version": 1, "model_name": "emulated", "weights_location": str(tmp_path)},
            timeout=10,
        )
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "weight_update_needs_one_worker"
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)


def test_two_workers_on_sqlite_store_every_step_once_in_order(
    emulator_url: str, tmp_path: Path
) -> None:
    # Several writer processes on one SQLite file: each write transaction takes the write lock
    # first (BEGIN IMMEDIATE) and waits for it up to the busy timeout, so step numbering reads
    # the trajectory's state only while no other process can change it.
    database_url = f"sqlite:///{tmp_path / 'data' / 'pool.sqlite3'}"
    port, liveness_port = free_port(), free_port()
    env = {
        "TRAJGATE_DATA_DIR": str(tmp_path / "data"),
        "TRAJGATE_PORT": str(port),
        "TRAJGATE_UPSTREAM_URL": emulator_url,
        "TRAJGATE_WORKERS": "2",
        "TRAJGATE_LIVENESS_PORT": str(liveness_port),
    }
    process: subprocess.Popen[bytes] | None = None
    try:
        process = _start_two_workers(env, tmp_path / "gateway.log", liveness_port)
        ids = [f"sqlite-{i}" for i in range(8)]
        # 8 trajectories x 5 turns, 8 agents at once, a new connection per call
        result = asyncio.run(drive(f"http://127.0.0.1:{port}", ids, 5, CONCURRENCY))
        assert result.gave_up == 0 and len(result.delivered) == 8 * 5
        pool = PoolSettings(database_url=database_url, data_dir=tmp_path / "data")
        report = audit(pool, ids, result)
        assert (report.lost, report.duplicated, report.index_gaps) == (0, 0, 0), report
        # read while the workers run: a worker that stops cleanly releases its claims. Both
        # wrote, barring a starved worker (40 connections, 8 at a time, both workers up).
        assert len(_writer_pids(database_url, ids)) == 2
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
