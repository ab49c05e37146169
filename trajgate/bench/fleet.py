"""Several stateless gateway processes on one pool: launch them, balance calls over them, drive
agents through the balancer, and audit what the pool holds afterwards.

Owns: ``start_gateway`` (``trajgate serve`` as a child process, configured only through
``TRAJGATE_*`` environment variables, the way docker-compose.yml runs it), ``Balancer`` (a
TCP load balancer, one backend per connection, skipping backends that refuse to connect: what
nginx does with ``proxy_next_upstream error``; ``round_robin``, or ``sticky``: consistent hashing
of the trajectory the request names, ``trajgate.bench.ring``, as deploy/nginx.conf), ``drive``
(agents whose every call opens a new connection, so under round-robin consecutive calls of one
trajectory land on different replicas) and ``audit`` (lost, duplicated, gapped and mis-parented
steps). Used by tests/test_replicas.py, tests/test_fleet_routing.py and ``trajgate bench pool
--gateways N``.

Never: used by the gateway itself; it is the harness that proves the gateway stateless.

Each agent carries its conversation (every earlier question and answer, then the new question),
so with the emulator's ``prompt_ids="messages"`` turn k+1's prompt extends turn k's prompt +
response, and an agent's retry of a call whose step committed on a killed replica is a fork at the
same prompt. The audit recomputes every step's lineage with the pool's own rule
(``datapool.steps.prefix.choose_parent``) over the trajectory's earlier stored steps in database
order, so a replica that chose parents or step indices from its own memory would be caught as
soon as another replica wrote the previous step. (With the emulator's default fixed prompt every
call repeats turn 0's prompt: all steps are forks of it, parentless, and the check is trivial.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import httpx

from datapool.db import make_engine
from datapool.models import StepOutcome
from datapool.settings import PoolSettings
from datapool.steps.prefix import Candidate, Lineage, choose_parent
from datapool.steps.store import PoolStore, StoredStep
from trajgate.bench.gateway import free_port, process_cpu_s
from trajgate.bench.ring import HashRing, routing_key

TRAJGATE = str(Path(sys.executable).with_name("trajgate"))
BalancerPolicy = Literal["round_robin", "sticky"]
BALANCER_POLICIES: tuple[str, ...] = get_args(BalancerPolicy)
_MAX_HEAD_BYTES = 16384  # a sticky balancer reads at most this much to find the routing key


def start_gateway(
    env: Mapping[str, str],
    log: Path,
    *,
    command: tuple[str, ...] = ("serve",),
    ready_timeout_s: float = 60.0,
) -> subprocess.Popen[bytes]:
    """``trajgate <command>`` with ``env`` on top of this process's environment; returns once
    ``GET /health`` answers on ``TRAJGATE_PORT``.

    Raises:
        RuntimeError: the process exited or did not answer within ``ready_timeout_s``.
    """
    port = env["TRAJGATE_PORT"]
    process = subprocess.Popen(
        [TRAJGATE, *command],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        if process.poll() is not None:
            raise RuntimeError(f"gateway on port {port} exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"gateway on port {port} did not answer /health in {ready_timeout_s} s")


def start_emulator(env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m trajgate.bench.emulator`` with ``TRAJGATE_EMULATOR_*`` ``env``; waits for
    /health."""
    port = env["TRAJGATE_EMULATOR_PORT"]
    process = subprocess.Popen(
        [sys.executable, "-m", "trajgate.bench.emulator"],
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        if process.poll() is not None:
            raise RuntimeError(f"emulator exited: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"emulator on port {port} did not answer /health")


class Balancer:
    """TCP load balancer on ``host:port`` in a daemon thread.

    ``round_robin``: each accepted connection goes to the next backend. ``sticky``: the
    balancer first reads the request head and sends the connection to the owner of its
    ``routing_key`` on a ``HashRing`` of the backends (round-robin when the head names no
    trajectory and no key); one routing decision per connection, so agents that keep
    connections alive across trajectories should route by nginx's per-request ``hash`` instead.
    A backend that refuses the connection is skipped, for the next one in turn or along the
    ring (no byte of the request has been sent yet, so this is always safe). A connection whose
    backend dies mid-request is closed, as a real L4 balancer would: the client sees the error
    and decides whether to retry.

    Raises ``ValueError`` for a policy not in ``BALANCER_POLICIES``.
    """

    def __init__(
        self,
        backends: list[tuple[str, int]],
        host: str = "127.0.0.1",
        port: int = 0,
        policy: BalancerPolicy = "round_robin",
    ):
        if policy not in BALANCER_POLICIES:
            raise ValueError(f"expected a policy among {BALANCER_POLICIES}, got {policy!r}")
        self.backends = backends
        self.host = host
        self.port = port
        self.policy = policy
        self.connections: dict[tuple[str, int], int] = defaultdict(int)
        self._ring = HashRing([f"{h}:{p}" for h, p in backends])
        self._by_name = {f"{h}:{p}": (h, p) for h, p in backends}
        self._turn = itertools.cycle(range(len(backends)))
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="balancer", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Balancer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("balancer did not start")
        return self

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _candidates(
        self, client_r: asyncio.StreamReader
    ) -> tuple[list[tuple[str, int]], bytes]:
        """The backends to try, in order, and the bytes already read from the client."""
        start = next(self._turn)
        rotation = self.backends[start:] + self.backends[:start]
        if self.policy == "round_robin":
            return rotation, b""
        head = b""
        while b"\r\n\r\n" not in head and len(head) < _MAX_HEAD_BYTES:
            chunk = await client_r.read(4096)
            if not chunk:
                break
            head += chunk
        key = routing_key(head.partition(b"\r\n\r\n")[0])
        if key is None:
            return rotation, head
        return [self._by_name[name] for name in self._ring.order(key)], head

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        candidates, head = await self._candidates(client_r)
        for backend in candidates:
            try:
                upstream = await asyncio.open_connection(*backend)
            except OSError:
                continue
            self.connections[backend] += 1
            break
        if upstream is None:
            client_w.close()
            return
        up_r, up_w = upstream
        if head:
            up_w.write(head)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while chunk := await reader.read(65536):
                    writer.write(chunk)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))


@dataclass
class DriveResult:
    """What the agents saw: ``delivered`` step id → trajectory id of every answered call."""

    delivered: dict[str, str] = field(default_factory=dict)
    delivered_twice: int = 0  # a step id answered to two different calls: a duplicate
    failed_attempts: int = 0  # connection reset by a killed replica, 5xx: the agent retried
    gave_up: int = 0  # calls never answered after every retry
    wall_s: float = 0.0


async def drive(
    url: str,
    trajectory_ids: list[str],
    turns: int,
    concurrency: int,
    *,
    max_tokens: int | None = None,
    retries: int = 20,
    keep_alive: bool = False,
) -> DriveResult:
    """Run ``turns`` calls per trajectory, in order, ``concurrency`` trajectories at a time.

    Without ``keep_alive`` every call opens a connection, so a round-robin balancer sends each
    call of a trajectory to another replica, and the kernel spreads them over the workers of
    ``trajgate serve --workers`` (the worst case for the writers' lineage memory). With it each
    agent keeps one connection for all its calls, as an SDK client does: a connection stays on
    the replica or worker it reached until it breaks. Each call sends the conversation so far
    (questions and the answers delivered) plus a new question. A failed call (connection error,
    5xx) is retried unchanged after a short pause, as an agent runtime would.
    """
    result = DriveResult()
    pending = list(reversed(trajectory_ids))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    if keep_alive:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)

    async def agent(client: httpx.AsyncClient) -> None:
        while pending:
            trajectory_id = pending.pop()
            messages: list[dict[str, Any]] = []
            for turn in range(turns):
                messages = [*messages, {"role": "user", "content": f"{trajectory_id} turn {turn}"}]
                body: dict[str, Any] = {"model": "emulated", "messages": messages}
                if max_tokens is not None:
                    body["max_tokens"] = max_tokens
                for _attempt in range(retries):
                    try:
                        response = await client.post(
                            f"/t/{trajectory_id}/v1/chat/completions", json=body
                        )
                    except httpx.HTTPError:
                        response = None
                    if response is not None and response.status_code == 200:
                        for step_id in response.headers["x-trajgate-step-id"].split(","):
                            if step_id in result.delivered:
                                result.delivered_twice += 1
                            result.delivered[step_id] = trajectory_id
                        answer = response.json()["choices"][0]["message"]
                        messages = [*messages, {"role": "assistant", "content": answer["content"]}]
                        break
                    result.failed_attempts += 1
                    await asyncio.sleep(0.05)
                else:
                    result.gave_up += 1

    started = time.perf_counter()
    clients = [
        httpx.AsyncClient(base_url=url, timeout=60, limits=limits)
        for _ in range(concurrency if keep_alive else 1)
    ]
    try:
        await asyncio.gather(*(agent(clients[k % len(clients)]) for k in range(concurrency)))
    finally:
        for client in clients:
            await client.aclose()
    result.wall_s = time.perf_counter() - started
    return result


@dataclass(frozen=True)
class Audit:
    """What the pool holds for the driven trajectories, against what the agents were told."""

    steps: int
    lost: int  # delivered step ids not in the pool
    duplicated: int  # rows sharing (trajectory, step_index, choice) + ids delivered twice
    undelivered: int  # committed steps whose answer never reached an agent (killed replica)
    index_gaps: int  # trajectories whose step indices are not exactly 0..n-1
    # steps whose parent (or whether they extend it) is not what the pool's lineage rule gives
    # over the trajectory's earlier steps (``expected_lineage``)
    wrong_parents: int
    extending: int  # steps stored with a parent they extend (0 when every prompt is the same)
    # trajectories written by more than one replica (each replica is configured with its own
    # spelling of the upstream URL, recorded on every step it writes)
    spread_trajectories: int

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def audit(pool: PoolSettings, trajectory_ids: list[str], result: DriveResult) -> Audit:
    """Check the pool of ``pool`` against ``result`` (see ``Audit``); reads the database and
    the token payloads only."""
    engine = make_engine(pool.resolved_database_url())
    try:
        store = PoolStore(engine, pool)
        by_trajectory = {tid: store.steps_of(tid) for tid in trajectory_ids}
    finally:
        engine.dispose()
    steps = [step for trajectory in by_trajectory.values() for step in trajectory]
    stored = {step.id for step in steps}
    keys = [(step.trajectory_id, step.step_index, step.choice_index) for step in steps]
    gaps = 0
    wrong_parents = 0
    for trajectory in by_trajectory.values():
        indices = sorted({step.step_index for step in trajectory})
        if indices != list(range(len(indices))):
            gaps += 1
        expected = expected_lineage(trajectory)
        for step in trajectory:
            lineage = expected[step.id]
            if (step.parent_step_id, step.extends_parent) != (
                lineage.parent_step_id,
                lineage.extends_parent,
            ):
                wrong_parents += 1
    return Audit(
        steps=len(steps),
        lost=len(set(result.delivered) - stored),
        duplicated=len(keys) - len(set(keys)) + result.delivered_twice,
        undelivered=len(stored - set(result.delivered)),
        index_gaps=gaps,
        wrong_parents=wrong_parents,
        extending=sum(1 for step in steps if step.parent_step_id and step.extends_parent),
        spread_trajectories=sum(
            1 for trajectory in by_trajectory.values() if len({s.upstream for s in trajectory}) > 1
        ),
    )


def expected_lineage(steps: Sequence[StoredStep]) -> dict[str, Lineage]:
    """Each step's lineage by the pool's rule, recomputed from ``steps`` (one trajectory, in
    step then choice order, with their token IDs): an ok call with prompt IDs gets
    ``prefix.choose_parent`` over the earlier ok steps that have prompt and response IDs; any
    other call hangs on the previous call's first step, without ``extends_parent``. The choices
    of one call share its lineage."""
    expected: dict[str, Lineage] = {}
    candidates: list[Candidate] = []
    latest: str | None = None
    for step_index, group in itertools.groupby(steps, key=lambda step: step.step_index):
        choices = list(group)
        prompt = choices[0].prompt_token_ids
        if choices[0].outcome == StepOutcome.OK and prompt is not None:
            lineage = choose_parent(candidates, prompt)
        else:
            lineage = Lineage(latest, None, None)
        for step in choices:
            expected[step.id] = lineage
            response = step.response_token_ids
            if step.outcome == StepOutcome.OK and prompt is not None and response is not None:
                candidates.append(
                    Candidate(step.id, [*prompt, *response], len(prompt), step_index, lineage)
                )
        latest = choices[0].id
    return expected


def ensure_postgres_database(url: str) -> None:
    """Create the database of ``url`` on its server when it does not exist yet."""
    import psycopg
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    with psycopg.connect(
        host=parsed.host,
        port=parsed.port,
        user=parsed.username,
        password=parsed.password,
        dbname="postgres",
        autocommit=True,
    ) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (parsed.database,)
        ).fetchone()
        if exists is None:
            conn.execute(f'CREATE DATABASE "{parsed.database}"')


async def _drive_then_kill(
    balancer: Balancer,
    ids: list[str],
    turns: int,
    concurrency: int,
    victim: subprocess.Popen[bytes] | None,
    kill_after_calls: int,
    keep_alive: bool = False,
) -> tuple[DriveResult, float]:
    """``drive`` through ``balancer``; with a ``victim`` (the first backend's gateway), ``kill
    -9`` it once ``kill_after_calls`` connections reached it. Returns the result and the CPU
    seconds the victim's processes had spent just before the kill (0.0 without one)."""
    task = asyncio.create_task(drive(balancer.url, ids, turns, concurrency, keep_alive=keep_alive))
    if victim is None:
        return await task, 0.0
    while balancer.connections[balancer.backends[0]] < kill_after_calls and not task.done():
        await asyncio.sleep(0.01)
    victim_cpu_s = process_tree_cpu_s([victim.pid])
    for pid in _process_tree([victim.pid]):  # its workers too: they hold the listening socket
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return await task, victim_cpu_s


def _process_tree(pids: list[int]) -> set[int]:
    """``pids`` and all their live descendants (Linux ``/proc``)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rpartition(")")[2].split()
            parents[int(stat.parent.name)] = int(fields[1])
    tree = set(pids)
    grown = True
    while grown:
        children = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= children
        grown = bool(children)
    return tree


def process_tree_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and all their live descendants (a ``trajgate serve
    --workers N`` parent and its workers): the sum of ``process_cpu_s`` over the tree, so each
    process counts to the scheduler's nanosecond, not in /proc's 10 ms ticks. A process that
    exits between listing and reading counts 0."""
    return sum(process_cpu_s(pid) or 0.0 for pid in _process_tree(pids))


def bench_gateways(
    database_url: str,
    configurations: list[tuple[int, int]],
    trajectories: int,
    turns: int,
    concurrency: int,
    work_dir: Path,
    balancer_policy: BalancerPolicy = "round_robin",
    kill_one: bool = False,
    keep_alive: bool = False,
) -> dict[str, Any]:
    """Committed steps/s of agents through ``n`` ``trajgate serve`` processes of ``w`` workers
    each on one pool behind the balancer (``balancer_policy``), for each ``(n, w)`` of
    ``configurations``, the gateways' CPU per committed step (ms, every process of every
    gateway), and the audit of each run (lost and duplicated steps must be 0). ``kill_one``:
    in runs of several gateways, ``kill -9`` the first once it answered a third of its share
    (the agents retry; its CPU until then is counted). ``keep_alive``: each agent keeps one
    connection (``drive``). Every run uses its own trajectory ids, so one database serves them
    all.

    Upstream: the emulator in its own process (200-token prompts, 50-token answers, no delay),
    so the figure is the gateways' and the database's, not an engine's.
    """
    # Over 80 lines on purpose: a benchmark reads as one script (processes, load, kill,
    # counts) in the order it runs; pieces would hide what is timed.
    import uuid

    from datapool import db

    db.upgrade(database_url)
    emulator_port = free_port()
    emulator = start_emulator(
        {
            "TRAJGATE_EMULATOR_HOST": "0.0.0.0",  # reached as 127.0.0.<replica>: see audit
            "TRAJGATE_EMULATOR_PORT": str(emulator_port),
            "TRAJGATE_EMULATOR_PROMPT_TOKENS": "200",
            "TRAJGATE_EMULATOR_RESPONSE_TOKENS": "50",
        },
        work_dir / "emulator.log",
    )
    runs: list[dict[str, Any]] = []
    try:
        for count, workers in configurations:
            ports = [free_port() for _ in range(count)]
            processes: list[subprocess.Popen[bytes]] = []
            balancer: Balancer | None = None
            try:
                for i, port in enumerate(ports):
                    env = {
                        "TRAJGATE_DATABASE_URL": database_url,
                        "TRAJGATE_DATA_DIR": str(work_dir / "data"),
                        "TRAJGATE_PORT": str(port),
                        "TRAJGATE_UPSTREAM_URL": f"http://127.0.0.{i + 1}:{emulator_port}",
                        "TRAJGATE_WORKERS": str(workers),
                    }
                    processes.append(start_gateway(env, work_dir / "gateways.log"))
                backends = [("127.0.0.1", port) for port in ports]
                balancer = Balancer(backends, policy=balancer_policy).start()
                prefix = f"bench-{count}g{workers}w-{uuid.uuid4().hex[:8]}"
                ids = [f"{prefix}-{i}" for i in range(trajectories)]
                pids = [process.pid for process in processes]
                cpu_before_s = process_tree_cpu_s(pids)
                kill = kill_one and count > 1
                result, killed_cpu_s = asyncio.run(
                    _drive_then_kill(
                        balancer,
                        ids,
                        turns,
                        concurrency,
                        processes[0] if kill else None,
                        trajectories * turns // count // 3,
                        keep_alive,
                    )
                )
                # the killed gateway's processes may linger as zombies: count them once
                survivors = pids[1:] if kill else pids
                cpu_s = process_tree_cpu_s(survivors) + killed_cpu_s - cpu_before_s
                pool = PoolSettings(database_url=database_url, data_dir=work_dir / "data")
                report = audit(pool, ids, result)
                steps = len(result.delivered)
                runs.append(
                    {
                        "gateways": count,
                        "workers": workers,
                        "balancer": balancer_policy,
                        "keep_alive": keep_alive,
                        # "steps" (from the audit, below): stored; these were answered
                        "delivered_steps": steps,
                        "steps_per_s": round(steps / result.wall_s, 1),
                        "gateway_cpu_ms_per_step": round(1000 * cpu_s / max(steps, 1), 2),
                        "failed_attempts": result.failed_attempts,
                        "gave_up": result.gave_up,
                        "killed_one": kill,
                        **report.as_dict(),
                    }
                )
            finally:
                if balancer is not None:
                    balancer.stop()
                for process in processes:
                    process.terminate()
                for process in processes:
                    process.wait(timeout=60)
    finally:
        emulator.kill()
        emulator.wait()
    backend = make_engine(database_url).dialect.name
    base = runs[0]
    return {
        "backend": backend,
        "balancer": balancer_policy,
        "trajectories": trajectories,
        "turns": turns,
        "concurrency": concurrency,
        "cpu_count": os.cpu_count(),
        "runs": runs,
        "speedup": {
            f"{run['gateways']}g{run['workers']}w": round(
                run["steps_per_s"] / base["steps_per_s"], 2
            )
            for run in runs
        },
        # the goal: at most 1.2: more processes must not cost more CPU per step
        "cpu_per_step_ratio": {
            f"{run['gateways']}g{run['workers']}w": round(
                run["gateway_cpu_ms_per_step"] / max(base["gateway_cpu_ms_per_step"], 1e-9), 2
            )
            for run in runs
        },
        "lost": sum(run["lost"] for run in runs),
        "duplicated": sum(run["duplicated"] for run in runs),
    }
