"""C14 with real processes: ``trajgate serve`` in front of the emulator, 200 concurrent agents,
``kill -9`` mid-load, restart; every step whose response was delivered is present exactly once,
completed trajectories stay complete, in-flight ones are flagged ``incomplete``. Two rounds, on
SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select
from tests_support import TRAJGATE, free_port

from datapool.db import make_engine
from datapool.models import Step, Trajectory
from datapool.settings import PoolSettings
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread

AGENTS = 200
CALLS_PER_AGENT = 3


@pytest.fixture
def emulator() -> Iterator[EmulatorThread]:
    settings = EmulatorSettings(
        port=free_port(), prompt_tokens=50, response_tokens=8, inter_token_ms=2.0
    )
    server = EmulatorThread(settings).start()
    yield server
    server.stop()


def start_gateway(
    upstream: str, pool: PoolSettings, port: int, log: Path
) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            TRAJGATE,
            "serve",
            "--upstream",
            upstream,
            "--port",
            str(port),
            "--database-url",
            pool.resolved_database_url(),
            "--data-dir",
            str(pool.data_dir),
        ],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "TRAJGATE_HEALTH_CHECK_INTERVAL_S": "0.5"},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError("gateway did not come up")


async def run_agents(url: str, round_id: int, delivered: dict[str, str], done: set[str]) -> None:
    """Each agent: up to 3 calls, then complete. Records step ids of delivered responses."""
    limits = httpx.Limits(max_connections=AGENTS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def agent(i: int) -> None:
            trajectory_id = f"r{round_id}-a{i}"
            for k in range(CALLS_PER_AGENT):
                body = {"model": "emulated", "messages": [{"role": "user", "content": f"{k}"}]}
                response = await client.post(f"/t/{trajectory_id}/v1/chat/completions", json=body)
                if response.status_code != 200:
                    return
                delivered[response.headers["x-trajgate-step-id"]] = trajectory_id
                await asyncio.sleep(0.05 * (i % 7))
            if (await client.post(f"/api/trajectories/{trajectory_id}/complete")).is_success:
                done.add(trajectory_id)

        await asyncio.gather(*(agent(i) for i in range(AGENTS)), return_exceptions=True)


async def load_then_kill(
    gateway: subprocess.Popen[bytes],
    url: str,
    round_id: int,
    delivered: dict[str, str],
    done: set[str],
) -> None:
    """Start the agents; once a third of all calls were answered, ``kill -9`` the gateway."""
    task = asyncio.create_task(run_agents(url, round_id, delivered, done))
    while len(delivered) < AGENTS:
        await asyncio.sleep(0.02)
    gateway.send_signal(signal.SIGKILL)
    await task


def test_kill_9_mid_load_loses_no_delivered_step_and_flags_in_flight_trajectories(
    emulator: EmulatorThread, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    engine = make_engine(pool_settings.resolved_database_url())
    for round_id in range(2):
        port = free_port()
        gateway = start_gateway(emulator.url, pool_settings, port, tmp_path / "gateway.log")
        delivered: dict[str, str] = {}
        done: set[str] = set()

        asyncio.run(load_then_kill(gateway, f"http://127.0.0.1:{port}", round_id, delivered, done))
        gateway.wait()  # reaped, so the restart sees its pid is gone
        assert AGENTS <= len(delivered) < AGENTS * CALLS_PER_AGENT

        restarted = start_gateway(emulator.url, pool_settings, port, tmp_path / "gateway.log")
        try:
            with engine.connect() as conn:
                stored = conn.execute(
                    select(Step.id, func.count())
                    .where(Step.id.in_(list(delivered)))
                    .group_by(Step.id)
                ).all()
                trajectories = conn.execute(
                    select(Trajectory.id, Trajectory.status, Trajectory.flags).where(
                        Trajectory.id.like(f"r{round_id}-%")
                    )
                ).all()
            assert {step_id for step_id, n in stored if n == 1} == set(delivered)
            for trajectory_id, status, flags in trajectories:
                if trajectory_id in done:
                    assert status == "complete" and "incomplete" not in flags
                elif status == "open":
                    assert "incomplete" in flags, trajectory_id
            assert any(status == "open" for _, status, _ in trajectories)  # some were in flight
        finally:
            restarted.terminate()
            restarted.wait(timeout=30)
    engine.dispose()
