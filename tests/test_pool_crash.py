"""C14 with real processes: ``trajgate serve`` in front of the emulator, 200 concurrent agents,
``kill -9`` mid-load, restart; every step whose response was delivered is present exactly once,
completed trajectories stay complete, only those with a call in flight are flagged ``incomplete``,
and an agent that carries on lifts the flag. Two rounds, on SQLite and PostgreSQL. The same
process logs one line per proxied call."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
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
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from datapool.steps.writer import PoolWriter
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread

AGENTS = 200
CALLS_PER_AGENT = 3


@pytest.fixture
def emulator() -> Iterator[EmulatorThread]:
    # 8 tokens 25 ms apart: each call is in flight for 0.2 s, so the kill can cut one.
    settings = EmulatorSettings(
        port=free_port(), prompt_tokens=50, response_tokens=8, inter_token_ms=25.0
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


async def run_agents(
    url: str, round_id: int, delivered: dict[str, str], done: set[str], cut: set[str]
) -> None:
    """Each agent: up to 3 calls, then complete. Records step ids of delivered responses, and
    in ``cut`` the trajectories whose call was sent and got no answer (not those refused a
    connection: the gateway was already dead)."""
    limits = httpx.Limits(max_connections=AGENTS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def agent(i: int) -> None:
            trajectory_id = f"r{round_id}-a{i}"
            for k in range(CALLS_PER_AGENT):
                body = {"model": "emulated", "messages": [{"role": "user", "content": f"{k}"}]}
                try:
                    response = await client.post(
                        f"/t/{trajectory_id}/v1/chat/completions", json=body
                    )
                except httpx.ConnectError:
                    return
                except httpx.HTTPError:
                    cut.add(trajectory_id)
                    return
                if response.status_code != 200:
                    return
                delivered[response.headers["x-trajgate-step-id"]] = trajectory_id
                await asyncio.sleep(0.05 * (i % 7))
            if (await client.post(f"/api/trajectories/{trajectory_id}/complete")).is_success:
                done.add(trajectory_id)

        await asyncio.gather(*(agent(i) for i in range(AGENTS)), return_exceptions=True)


async def load_then_kill(
    gateway: subprocess.Popen[bytes],
    emulator: EmulatorThread,
    url: str,
    round_id: int,
    delivered: dict[str, str],
    done: set[str],
    cut: set[str],
) -> None:
    """Start the agents; once a third of all calls were answered, ``kill -9`` the gateway while
    one more agent (``r<round>-held``, one call answered before) is inside a streamed call: the
    first chunk came, so the gateway had started the call, and the emulator holds the rest
    (``stall_streams``), so the call is still in flight at the kill. (Waiting for the first chunk
    alone did not make sure of it: on a loaded machine this process read that chunk after the
    gateway had relayed all 8 tokens in 0.2 s and committed the step, and then nothing was cut.)
    The agents' own calls are not streamed, so they are not held; they may or may not be in
    flight at that instant."""
    task = asyncio.create_task(run_agents(url, round_id, delivered, done, cut))
    held = f"r{round_id}-held"
    body = {"model": "emulated", "messages": [{"role": "user", "content": "0"}]}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answered = await client.post(f"/t/{held}/v1/chat/completions", json=body)
        delivered[answered.headers["x-trajgate-step-id"]] = held
        while len(delivered) < AGENTS:
            await asyncio.sleep(0.02)
        stream = {**body, "stream": True}
        emulator.stall_streams()
        try:
            async with client.stream(
                "POST", f"/t/{held}/v1/chat/completions", json=stream
            ) as response:
                assert response.status_code == 200
                async for _chunk in response.aiter_raw():
                    break
                gateway.send_signal(signal.SIGKILL)
                cut.add(held)
        finally:
            emulator.resume_streams()
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
        cut: set[str] = set()
        url = f"http://127.0.0.1:{port}"
        asyncio.run(load_then_kill(gateway, emulator, url, round_id, delivered, done, cut))
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
            flagged = {t for t, _status, flags in trajectories if "incomplete" in flags}
            for trajectory_id, status, flags in trajectories:
                if trajectory_id in done:
                    assert status == "complete" and "incomplete" not in flags
            # Only a call in flight is a cut (an agent between calls was not).
            # A sent call the gateway had not yet started is not flagged: nothing was sampled.
            assert f"r{round_id}-held" in flagged and flagged <= cut, sorted(flagged - cut)
            assert any(t not in cut and s == "open" for t, s, _ in trajectories)
            # An agent that carries on is judged on its own steps: the flag goes.
            again = f"r{round_id}-held"
            body = {"model": "emulated", "messages": [{"role": "user", "content": "again"}]}
            assert httpx.post(f"{url}/t/{again}/v1/chat/completions", json=body).is_success
            assert httpx.post(f"{url}/api/trajectories/{again}/complete").is_success
            with engine.connect() as conn:
                status, flags = conn.execute(
                    select(Trajectory.status, Trajectory.flags).where(Trajectory.id == again)
                ).one()
            assert (status, flags) == ("complete", [])
        finally:
            restarted.terminate()
            restarted.wait(timeout=30)
    engine.dispose()


# -- what a crash actually cut ---------------------------------------------------------------

_CRASHING_WRITER = """
import os, socket, sys, time
from pathlib import Path
from datapool.steps.crashes import CallJournal
writer_id = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
journal = CallJournal(Path(sys.argv[1]), writer_id)
journal.started("cut")        # in flight at the crash
journal.started("cut-other")  # in flight, though another writer wrote its last step
journal.started("finished")   # answered and committed before the crash
journal.ended("finished")
print(writer_id, flush=True)
os.kill(os.getpid(), 9)
"""


def _crashed_writer(journal_dir: Path) -> str:
    """The id of a writer process that journaled three calls and died of ``kill -9``."""
    process = subprocess.run(
        [sys.executable, "-c", _CRASHING_WRITER, str(journal_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert process.returncode == -signal.SIGKILL, process.stderr
    return process.stdout.strip()


def _dead_writer_without_journal() -> str:
    process = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return f"{socket.gethostname()}:{process.stdout.strip()}:1"


def _one_call(prompt: list[int]) -> CallRecord:
    return CallRecord(
        request={"messages": [{"role": "user", "content": "x"}]},
        upstream_request={},
        model="tiny",
        upstream="http://up",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        choices=[ChoiceRecord(0, [7], [-0.5], {"role": "assistant", "content": "a"}, "stop")],
    )


def test_a_crash_flags_only_the_calls_it_cut_and_an_agent_that_carries_on_lifts_the_flag(
    pool_settings: PoolSettings,
) -> None:
    journal_dir = pool_settings.data_dir / "calls"
    dead = _crashed_writer(journal_dir)
    legacy = _dead_writer_without_journal()  # a writer of a version without a journal
    alive = f"{socket.gethostname()}:{os.getppid()}:1"  # our parent lives: never judged dead
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    for trajectory_id, writer_id in [
        ("cut", dead),
        ("finished", dead),  # its call committed; no call in flight at the crash
        ("idle", dead),  # the agent was thinking between calls
        ("cut-other", alive),
        ("legacy", legacy),
    ]:
        store.record_call(trajectory_id, _one_call([1, 2]), writer_id=writer_id)

    writer = PoolWriter(store, pool_settings).start()
    try:
        flags = {
            t: store.get_trajectory(t).flags
            for t in ("cut", "finished", "idle", "cut-other", "legacy")
        }  # type: ignore[union-attr]
        assert flags == {
            "cut": ["incomplete"],
            "finished": [],
            "idle": [],
            "cut-other": ["incomplete"],
            "legacy": ["incomplete"],  # nothing says which were cut: all, as before
        }
        assert not (journal_dir / Path(dead.replace(":", "_") + ".calls")).exists()
        assert store.get_trajectory("idle").writer_id is None  # type: ignore[union-attr]
        # The agent of "cut" carries on (its retry lands after the restart): it is judged on its
        # own steps again; "cut-other" never came back and stays flagged.
        store.record_call("cut", _one_call([1, 2, 7, 3]), writer_id=writer.writer_id)
        assert store.get_trajectory("cut").flags == []  # type: ignore[union-attr]
        assert store.get_trajectory("cut-other").flags == ["incomplete"]  # type: ignore[union-attr]
    finally:
        writer.close()
    store.engine.dispose()


def test_serve_logs_one_line_per_proxied_call(
    emulator: EmulatorThread, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    port, log = free_port(), tmp_path / "gateway.log"
    process = start_gateway(emulator.url, pool_settings, port, log)
    try:
        answer = httpx.post(
            f"http://127.0.0.1:{port}/t/logged-1/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert answer.status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=30)
    lines = [line for line in log.read_text().splitlines() if "call trajectory=logged-1" in line]
    assert len(lines) == 1, log.read_text()[-2000:]
    assert "outcome=ok" in lines[0] and lines[0].startswith("INFO:")
