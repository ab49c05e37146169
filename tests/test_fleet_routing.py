"""Sticky routing across gateways: the routing key a request names, the consistent-hash ring, and
the bench's sticky balancer in front of two real ``trajgate serve`` processes on one PostgreSQL
pool, one of them killed mid-load: each trajectory stays on its owner until the owner dies, then
moves to the next gateway on the ring, and every delivered step is stored once.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import _create_postgres_database, _drop_postgres_database
from sqlalchemy import select
from tests_support import free_port

from datapool.db import make_engine
from datapool.models import Step
from datapool.settings import PoolSettings
from trajgate.bench.fleet import Balancer, DriveResult, audit, drive, start_emulator, start_gateway
from trajgate.bench.ring import HashRing, routing_key

TRAJECTORIES = 16
TURNS = 6
AGENTS = 8


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"POST /t/traj-7/v1/chat/completions HTTP/1.1\r\nX-Trajgate-Trajectory: other", b"traj-7"),
        (b"GET /t/traj-7?x=1 HTTP/1.1\r\n", None),  # no slash after the id: not an agent path
        (b"POST /v1/chat/completions HTTP/1.1\r\nx-trajgate-trajectory: t2\r\n", b"t2"),
        (b"POST /v1/messages HTTP/1.1\r\nAuthorization: Bearer k\r\nx-api-key: j", b"Bearer k"),
        (b"POST /v1/messages HTTP/1.1\r\nHost: gw\r\nx-api-key: tg-abc\r\n", b"tg-abc"),
        (b"GET /health HTTP/1.1\r\nHost: gw\r\n", None),
    ],
)
def test_routing_key_prefers_path_then_header_then_api_key(
    head: bytes, expected: bytes | None
) -> None:
    assert routing_key(head) == expected


def test_removing_a_backend_moves_only_its_own_keys_to_the_next_on_the_ring() -> None:
    full = HashRing(["a", "b", "c"])
    without_b = HashRing(["a", "c"])
    keys = [f"traj-{i}".encode() for i in range(600)]
    owners = {key: full.order(key) for key in keys}
    for key in keys:
        expected = owners[key][1] if owners[key][0] == "b" else owners[key][0]
        assert without_b.order(key)[0] == expected
    # 160 points per backend spread 600 keys roughly evenly: each owns a fair share
    shares = [sum(1 for key in keys if owners[key][0] == name) for name in "abc"]
    assert all(100 < share < 300 for share in shares), shares


@pytest.fixture
def postgres_url() -> Iterator[str]:
    url = _create_postgres_database()
    yield url
    _drop_postgres_database(url)


def test_sticky_balancer_keeps_each_trajectory_on_one_gateway_and_moves_it_once_on_a_kill(
    postgres_url: str, tmp_path: Path
) -> None:
    emulator_port = free_port()
    emulator = start_emulator(
        {
            "TRAJGATE_EMULATOR_HOST": "0.0.0.0",
            "TRAJGATE_EMULATOR_PORT": str(emulator_port),
            "TRAJGATE_EMULATOR_PROMPT_TOKENS": "40",
            "TRAJGATE_EMULATOR_RESPONSE_TOKENS": "8",
            "TRAJGATE_EMULATOR_INTER_TOKEN_MS": "3",
        },
        tmp_path / "emulator.log",
    )
    ports = [free_port(), free_port()]
    # each gateway reaches the emulator under its own address, recorded on every step it writes
    upstreams = [f"http://127.0.0.{i + 1}:{emulator_port}" for i in range(2)]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for port, upstream in zip(ports, upstreams, strict=True):
            env = {
                "TRAJGATE_DATABASE_URL": postgres_url,
                "TRAJGATE_DATA_DIR": str(tmp_path / "data"),
                "TRAJGATE_PORT": str(port),
                "TRAJGATE_UPSTREAM_URL": upstream,
            }
            processes.append(start_gateway(env, tmp_path / "gateways.log"))
        backends = [("127.0.0.1", port) for port in ports]
        balancer = Balancer(backends, policy="sticky").start()
        ids = [f"sticky-{i}" for i in range(TRAJECTORIES)]
        ring = HashRing([f"127.0.0.1:{port}" for port in ports])
        owned = [
            sum(1 for i in ids if ring.order(i.encode())[0] == f"127.0.0.1:{port}")
            for port in ports
        ]
        victim = 0 if owned[0] >= owned[1] else 1
        survivor = 1 - victim

        async def load_then_kill() -> DriveResult:
            task = asyncio.create_task(drive(balancer.url, ids, TURNS, AGENTS))
            # kill -9 the gateway owning more trajectories once it answered a third of its calls
            while balancer.connections[backends[victim]] < owned[victim] * TURNS // 3:
                await asyncio.sleep(0.01)
            processes[victim].send_signal(signal.SIGKILL)
            return await task

        result = asyncio.run(load_then_kill())
        balancer.stop()
    finally:
        for process in processes:
            process.kill()
            process.wait()
        emulator.kill()
        emulator.wait()

    assert result.gave_up == 0
    assert len(result.delivered) == TRAJECTORIES * TURNS
    report = audit(PoolSettings(database_url=postgres_url, data_dir=tmp_path / "data"), ids, result)
    assert (report.lost, report.duplicated, report.index_gaps) == (0, 0, 0), report
    engine = make_engine(postgres_url)
    with engine.connect() as conn:
        rows = conn.execute(
            select(Step.trajectory_id, Step.step_index, Step.upstream).where(
                Step.trajectory_id.in_(ids)
            )
        ).all()
    engine.dispose()
    writers: dict[str, list[str | None]] = defaultdict(list)
    for written, _index, writer in sorted(rows, key=lambda row: (row[0], row[1])):
        writers[written].append(writer)
    for trajectory_id, sequence in writers.items():
        owner = ring.order(trajectory_id.encode())[0]
        if owner == f"127.0.0.1:{ports[survivor]}":  # the survivor's trajectories never moved
            assert set(sequence) == {upstreams[survivor]}, (trajectory_id, sequence)
        else:  # the killed gateway's: on it until the kill, then on the survivor for good
            moved = sequence.index(upstreams[survivor]) if upstreams[survivor] in sequence else None
            before, after = sequence[:moved], sequence[moved:] if moved is not None else []
            assert set(before) <= {upstreams[victim]}, (trajectory_id, sequence)
            assert set(after) <= {upstreams[survivor]}, (trajectory_id, sequence)
    # only the victim's trajectories can have been written by both
    assert 0 < report.spread_trajectories <= owned[victim], (report, owned)


def test_keep_alive_agents_reuse_one_connection_each_and_fresh_agents_open_one_per_call() -> None:
    """``drive(keep_alive=True)`` (``bench pool --keep-alive``) is an SDK-like agent: one
    connection for all its calls; without it every call is a new connection (the bench's
    worst case for workers' lineage memory)."""

    async def run(keep_alive: bool) -> tuple[int, int]:
        accepted = 0
        answered = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted, answered
            accepted += 1
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                answered += 1
                body = b'{"choices":[{"message":{"role":"assistant","content":"ok"}}]}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"x-trajgate-step-id: s%d\r\ncontent-length: %d\r\n\r\n%s"
                    % (answered, len(body), body)
                )
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            result = await drive(
                f"http://127.0.0.1:{port}", ["a", "b", "c", "d"], 3, 2, keep_alive=keep_alive
            )
        assert (len(result.delivered), result.gave_up) == (12, 0)
        return accepted, answered

    assert asyncio.run(run(keep_alive=True)) == (2, 12)
    assert asyncio.run(run(keep_alive=False)) == (12, 12)
