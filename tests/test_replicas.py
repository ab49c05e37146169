"""Stateless gateways: three ``trajgate serve`` processes on one PostgreSQL pool, started at once
on an un-migrated database, behind a round-robin balancer; concurrent agents whose consecutive
calls land on different replicas; ``kill -9`` of one replica mid-load. Afterwards every delivered
step is stored exactly once, each trajectory's step indices are 0..n-1, every parent is the one
the pool's lineage rule gives over the earlier steps in database order (each turn extends the
last, a retry is a fork at the same prompt: ``trajgate.bench.fleet.audit``), and leasing
concurrently from all three replicas never hands one batch out twice.

The gateways run with docker-compose.yml's own command and environment (host-specific values
substituted), so the compose file's gateway and migrate services are exercised here.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import _create_postgres_database, _drop_postgres_database
from deployment_helpers import compose_service_env
from tests_support import free_port

from datapool.settings import PoolSettings
from trajgate.bench.fleet import (
    Balancer,
    DriveResult,
    audit,
    drive,
    start_emulator,
    start_gateway,
)

REPLICAS = 3
TRAJECTORIES = 24
TURNS = 6
AGENTS = 12
BATCHES = 6


@pytest.fixture
def postgres_url() -> Iterator[str]:
    url = _create_postgres_database()
    yield url
    _drop_postgres_database(url)


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    process = start_emulator(
        {
            # 0.0.0.0 so each replica can reach it under its own loopback address (127.0.0.x),
            # which the pool records on every step as its upstream: who wrote which step.
            "TRAJGATE_EMULATOR_HOST": "0.0.0.0",
            "TRAJGATE_EMULATOR_PORT": str(port),
            "TRAJGATE_EMULATOR_PROMPT_TOKENS": "40",
            "TRAJGATE_EMULATOR_RESPONSE_TOKENS": "8",
            "TRAJGATE_EMULATOR_INTER_TOKEN_MS": "3",
            # prompt IDs that follow the conversation, so each turn extends the last one
            "TRAJGATE_EMULATOR_PROMPT_IDS": "messages",
        },
        tmp_path / "emulator.log",
    )
    yield port
    process.kill()
    process.wait()


def gateway_env(postgres_url: str, tmp_path: Path, port: int, upstream: str) -> dict[str, str]:
    """docker-compose.yml's gateway environment with this machine's values."""
    return compose_service_env(
        "gateway",
        {
            "TRAJGATE_DATABASE_URL": postgres_url,
            "TRAJGATE_DATA_DIR": str(tmp_path / "data"),
            "TRAJGATE_PAYLOAD_URI": str(tmp_path / "payloads"),
            "TRAJGATE_BATCH_URI": str(tmp_path / "batches"),
            "TRAJGATE_HOST": "127.0.0.1",  # compose binds 0.0.0.0 inside its network
            "TRAJGATE_PORT": str(port),
            "TRAJGATE_UPSTREAM_URL": upstream,
            # one container each in compose; here the replicas share a host and its ports
            "TRAJGATE_LIVENESS_PORT": str(free_port()),
        },
    )


async def lease_everywhere(ports: list[int], attempts: int, headers: dict[str, str]) -> list[str]:
    """``attempts`` lease requests of one consumer, spread over every replica, all at once."""
    async with httpx.AsyncClient(timeout=60, headers=headers) as client:

        async def lease(i: int) -> str | None:
            response = await client.post(
                f"http://127.0.0.1:{ports[i % len(ports)]}/api/batches/lease",
                json={"consumer": "trainer", "lease_s": 600},
            )
            assert response.status_code in (200, 204), response.text
            return response.json()["batch_id"] if response.status_code == 200 else None

        got = await asyncio.gather(*(lease(i) for i in range(attempts)))
    return [batch_id for batch_id in got if batch_id is not None]


def test_three_gateways_one_killed_keep_every_step_once_in_order_and_lease_exactly_once(
    postgres_url: str, emulator: int, tmp_path: Path
) -> None:
    ports = [free_port() for _ in range(REPLICAS)]
    envs = [
        gateway_env(postgres_url, tmp_path, port, f"http://127.0.0.{i + 1}:{emulator}")
        for i, port in enumerate(ports)
    ]
    log = tmp_path / "gateways.log"
    processes: list[subprocess.Popen[bytes]] = []
    try:
        # All three at once on an empty database: their start-up migrations race.
        with ThreadPoolExecutor(REPLICAS) as pool:
            processes = list(pool.map(lambda env: start_gateway(env, log), envs))
        balancer = Balancer([("127.0.0.1", port) for port in ports]).start()
        trajectory_ids = [f"traj-{i}" for i in range(TRAJECTORIES)]

        async def load_then_kill() -> DriveResult:
            task = asyncio.create_task(drive(balancer.url, trajectory_ids, TURNS, AGENTS))
            # kill -9 the first replica once a third of all calls were answered
            while balancer.connections[("127.0.0.1", ports[0])] < TRAJECTORIES * TURNS // 9:
                await asyncio.sleep(0.01)
            processes[0].send_signal(signal.SIGKILL)
            return await task

        result = asyncio.run(load_then_kill())
        processes[0].wait()
        assert result.gave_up == 0
        assert len(result.delivered) == TRAJECTORIES * TURNS
        pool = PoolSettings(
            database_url=postgres_url,
            data_dir=tmp_path / "data",
            payload_uri=str(tmp_path / "payloads"),
        )
        report = audit(pool, trajectory_ids, result)
        assert report.lost == 0, report
        assert report.duplicated == 0, report
        assert report.index_gaps == 0, report
        assert report.wrong_parents == 0, report
        # The check is not empty: turns 1..5 of each trajectory extend the turn before (a retry
        # of one repeats its lineage), so at least 24 * 5 = 120 steps extend a parent.
        assert report.extending >= TRAJECTORIES * (TURNS - 1), report
        # calls of one trajectory really went to several replicas (round-robin over concurrent
        # agents may, by chance, send all six calls of a few trajectories to one replica)
        assert report.spread_trajectories >= TRAJECTORIES * 3 // 4, report
        balancer.stop()

        # the killed replica comes back; batches are leased from all three at once
        processes[0] = start_gateway(envs[0], log)
        # The pool API is behind the admin token whenever one is set (compose sets one).
        token = envs[0].get("TRAJGATE_ADMIN_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with httpx.Client(timeout=60, headers=headers) as client:
            for i, trajectory_id in enumerate(trajectory_ids):
                port = ports[i % REPLICAS]
                response = client.post(
                    f"http://127.0.0.1:{port}/api/trajectories/{trajectory_id}/complete",
                    json={"reward": float(i % 2)},
                )
                assert response.status_code == 200, response.text
            per_batch = TRAJECTORIES // BATCHES
            for b in range(BATCHES):
                chosen = trajectory_ids[b * per_batch : (b + 1) * per_batch]
                response = client.post(
                    f"http://127.0.0.1:{ports[b % REPLICAS]}/api/batches",
                    json={"algorithm": "sft", "filters": {"trajectory_ids": chosen}},
                )
                assert response.status_code == 201, response.text
        leased = asyncio.run(lease_everywhere(ports, attempts=BATCHES * 3, headers=headers))
        assert sorted(leased) == sorted(set(leased)) and len(leased) == BATCHES
    finally:
        for process in processes:
            process.kill()
            process.wait()
