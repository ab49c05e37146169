"""Completion hooks (reward functions, then curation rules) run once for every completed
trajectory, on SQLite and PostgreSQL: after the idle timeout through a real gateway, again after
a runner died holding the claim, once when two runners race, and never for an abandoned one."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from datetime import timedelta
from typing import Any

import httpx
from batch_helpers import agent_turns, make_store, write_trajectory
from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import select, update
from tests_support import free_port

from datapool.lifecycle import hooks
from datapool.lifecycle import transitions as lifecycle
from datapool.lifecycle.hooks import CompletionHooks
from datapool.models import Reward, Trajectory, TrajectoryStatus, utc_now
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.app import create_app
from gateway.metrics import CompletionHooksCollector
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate import vllm_server

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "find the capybara"}],
    "max_tokens": 5,
}


def with_reward_functions(pool_settings: PoolSettings, *names: str) -> PoolSettings:
    return pool_settings.model_copy(update={"reward_functions": list(names)})


def reward_records(store: PoolStore, trajectory_id: str) -> list[tuple[str, float | None]]:
    with store.sessions() as session:
        return [
            (r.name, r.value)
            for r in session.scalars(
                select(Reward).where(Reward.trajectory_id == trajectory_id).order_by(Reward.id)
            )
        ]


def hooks_due_at(store: PoolStore, trajectory_id: str) -> Any:
    with store.sessions() as session:
        return session.scalar(select(Trajectory.hooks_due_at).where(Trajectory.id == trajectory_id))


def test_trajectory_completed_by_idle_timeout_gets_its_reward_then_its_curation_mark(
    vllm: vllm_server.VLLMServer, pool_settings: PoolSettings
) -> None:
    pool = pool_settings.model_copy(
        update={
            "reward_functions": ["pool_reward_fns:steps_times_half"],
            "trajectory_idle_timeout_s": 0.5,
            "compaction_interval_s": 0.2,  # the writer's upkeep round, which closes idle ones
            "completion_hooks_interval_s": 0.2,
        }
    )
    settings = GatewaySettings(upstream_url=vllm.url, port=free_port())
    server = BackgroundServer(create_app(settings, pool), port=settings.port).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as api:
            # Matches only once the reward function's 0.5 is in: a rule run before the reward
            # functions would see an unrewarded trajectory, which reward_threshold never marks.
            rule = api.post(
                "/api/curation/rules",
                json={
                    "name": "below-one",
                    "kind": "reward_threshold",
                    "params": {"name": "steps_times_half", "min": 1.0},
                },
            )
            assert rule.status_code == 201, rule.text
            chat = api.post("/t/idle-1/v1/chat/completions", json=CHAT)
            assert chat.status_code == 200, chat.text
            deadline = time.monotonic() + 30
            marks: list[dict[str, Any]] = []
            while time.monotonic() < deadline and not marks:
                time.sleep(0.2)
                marks = [
                    m
                    for m in api.get("/api/curation/marks").json()
                    if m["trajectory_id"] == "idle-1"
                ]
            trajectory = api.get("/api/trajectories/idle-1").json()
            records = api.get("/api/rewards", params={"trajectory_id": "idle-1"}).json()
            runs = re.search(
                r"^trajgate_completion_hooks_runs_total (\S+)$", api.get("/metrics").text, re.M
            )
    finally:
        server.stop()
    assert trajectory["status"] == "complete"
    assert trajectory["completion_reason"] == "idle_timeout"
    assert trajectory["rewards"] == {"steps_times_half": 0.5}  # 0.5 * 1 step
    assert [(r["name"], r["value"]) for r in records] == [("steps_times_half", 0.5)]
    assert [(m["rule"], m["target"], m["action"]) for m in marks] == [
        ("below-one", "trajectory", "exclude")
    ]
    assert runs is not None and float(runs.group(1)) == 1.0


def test_hooks_claimed_by_a_runner_that_died_run_again_once_its_lease_passes(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(with_reward_functions(pool_settings, "pool_reward_fns:steps_times_half"))
    write_trajectory(store, "crash-1", agent_turns(1, 2))  # 2 steps, completed: hooks due
    # A runner claims the hooks for 300 s and dies before running them.
    lease_until = hooks.claim(store.sessions, "crash-1", lease_s=300)
    assert lease_until is not None
    runner = CompletionHooks(store)
    assert asyncio.run(runner.run_due()) == 0  # held by the dead runner's lease
    assert reward_records(store, "crash-1") == []
    with store.sessions.begin() as session:  # as if the 300 s had passed
        session.execute(
            update(Trajectory)
            .where(Trajectory.id == "crash-1")
            .values(hooks_due_at=utc_now() - timedelta(seconds=1))
        )
    assert asyncio.run(runner.run_due()) == 1
    assert reward_records(store, "crash-1") == [("steps_times_half", 1.0)]  # 0.5 * 2 steps
    assert hooks_due_at(store, "crash-1") is None
    assert asyncio.run(runner.run_due()) == 0  # done: never again
    assert reward_records(store, "crash-1") == [("steps_times_half", 1.0)]


def test_two_runners_racing_on_one_database_run_each_trajectorys_hooks_once(
    pool_settings: PoolSettings,
) -> None:
    pool = with_reward_functions(pool_settings, "pool_reward_fns:slow_steps_times_half")
    stores = [make_store(pool), make_store(pool)]  # two engines, as two gateway processes
    ids = [f"race-{i}" for i in range(12)]
    for i, trajectory_id in enumerate(ids):
        write_trajectory(stores[0], trajectory_id, agent_turns(i, 1))
    runners = [CompletionHooks(store) for store in stores]
    start = threading.Barrier(len(runners))
    finished: list[int] = []

    def race(runner: CompletionHooks) -> None:
        start.wait()
        finished.append(asyncio.run(runner.run_due()))

    threads = [threading.Thread(target=race, args=(runner,)) for runner in runners]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(finished) == 12
    assert sum(r.stats.runs for r in runners) == 12
    assert [r.stats.failures for r in runners] == [0, 0]
    for trajectory_id in ids:  # exactly one record each: 0.5 * 1 step
        assert reward_records(stores[0], trajectory_id) == [("slow_steps_times_half", 0.5)]


def test_runner_stopped_mid_run_hands_its_claim_back(pool_settings: PoolSettings) -> None:
    store = make_store(with_reward_functions(pool_settings, "pool_reward_fns:never_returns"))
    write_trajectory(store, "stop-1", agent_turns(1, 1))
    runner = CompletionHooks(store)

    async def stop_mid_run() -> None:
        task = asyncio.create_task(runner.run_due())
        while hooks.due_trajectories(store.sessions, 10):
            await asyncio.sleep(0.01)  # until the claim pushes it 300 s ahead
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(stop_mid_run(), 30))
    assert hooks.due_trajectories(store.sessions, 10) == ["stop-1"]  # due again, not in 300 s
    assert reward_records(store, "stop-1") == []


def test_abandoned_trajectory_gets_no_hooks(pool_settings: PoolSettings) -> None:
    store = make_store(with_reward_functions(pool_settings, "pool_reward_fns:steps_times_half"))
    write_trajectory(store, "gave-up", agent_turns(1, 1), complete=False)
    lifecycle.close_trajectory(store.sessions, "gave-up", TrajectoryStatus.ABANDONED)
    assert hooks_due_at(store, "gave-up") is None
    assert asyncio.run(CompletionHooks(store).run_due()) == 0
    assert reward_records(store, "gave-up") == []


def test_failed_reward_functions_are_counted_per_function_for_alerting(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(
        with_reward_functions(
            pool_settings, "pool_reward_fns:steps_times_half", "pool_reward_fns:broken"
        )
    )
    write_trajectory(store, "counted-1", agent_turns(1, 1))
    write_trajectory(store, "counted-2", agent_turns(2, 1))
    runner = CompletionHooks(store)
    assert asyncio.run(runner.run_due()) == 2
    assert runner.stats.reward_function_runs == {
        ("pool_reward_fns:steps_times_half", "ok"): 2,
        ("pool_reward_fns:broken", "failed"): 2,
    }
    text = generate_latest(_registry_with(runner)).decode()
    assert (
        'trajgate_reward_function_runs_total{function="pool_reward_fns:broken",outcome="failed"}'
        " 2.0" in text
    )


def _registry_with(runner: CompletionHooks) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(CompletionHooksCollector(runner))
    return registry
