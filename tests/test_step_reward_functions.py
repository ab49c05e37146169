"""Step reward functions (``datapool.rewards.step_rewards``) on SQLite and PostgreSQL: run once
per ok step by the real completion hooks, recorded on each step with name and source; a step a
function cannot judge gets a failed reward (null value, the error), never 0.0; the HTTP variant
asks a process reward model served on a real local port (an edge trajgate does not own)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from batch_helpers import agent_turns, make_store, write_trajectory
from fastapi import FastAPI, Request, Response
from pydantic import ValidationError
from sqlalchemy import select
from tests_support import free_port

from datapool.lifecycle.hooks import CompletionHooks
from datapool.models import Reward
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.server import BackgroundServer


def step_records(store: PoolStore, trajectory_id: str) -> list[tuple[str, str, Any, str, str]]:
    """``(step id, name, value, source, author or error)`` of the trajectory's step rewards."""
    with store.sessions() as session:
        return [
            (r.target_id, r.name, r.value, r.source, r.error or r.author)
            for r in session.scalars(
                select(Reward)
                .where(Reward.trajectory_id == trajectory_id, Reward.target_kind == "step")
                .order_by(Reward.id)
            )
        ]


def run_hooks(store: PoolStore) -> CompletionHooks:
    hooks = CompletionHooks(store)
    assert asyncio.run(hooks.run_due()) >= 1
    return hooks


def test_completion_hooks_run_each_step_reward_function_once_per_step(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(
        pool_settings.model_copy(
            update={
                "step_reward_functions": [
                    "pool_reward_fns:step_position",
                    "pool_reward_fns:judges_only_the_first_step",
                ]
            }
        )
    )
    ids = write_trajectory(store, "t", agent_turns(1, 3), reward=1.0)
    hooks = run_hooks(store)
    got = step_records(store, "t")
    # step_position: 0.25 * step_index on every step; judges_only_the_first_step: 1.0 on step
    # 0, nothing on step 1 (None: unrewarded), a failed reward on step 2 (null, its error)
    assert [g[:4] for g in got if g[1] == "step_position"] == [
        (ids[0], "step_position", 0.0, "rule"),
        (ids[1], "step_position", 0.25, "rule"),
        (ids[2], "step_position", 0.5, "rule"),
    ]
    assert {g[4] for g in got if g[1] == "step_position"} == {"step_reward_fn"}
    judged = [g for g in got if g[1] == "judges_only_the_first_step"]
    assert [(g[0], g[2]) for g in judged] == [(ids[0], 1.0), (ids[2], None)]
    assert "cannot judge step 2" in judged[1][4]
    assert hooks.stats.reward_function_runs == {
        ("pool_reward_fns:step_position", "ok"): 3,
        ("pool_reward_fns:judges_only_the_first_step", "ok"): 2,
        ("pool_reward_fns:judges_only_the_first_step", "failed"): 1,
    }
    store.engine.dispose()


class ProcessRewardModel:
    """A process reward model on a local port: ``/score`` gives 0.5 + 0.1 * step_index,
    ``/slow`` answers 1.0 after 1.5 s (counting requests in flight), ``/crash`` fails; keeps
    the bodies it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        app = FastAPI()

        @app.post("/score")
        async def score(request: Request) -> dict[str, Any]:
            body = await request.json()
            self.bodies.append(body)
            return {"reward": 0.5 + 0.1 * body["step_index"]}

        @app.post("/slow")
        async def slow(request: Request) -> dict[str, Any]:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            await asyncio.sleep(1.5)
            self.in_flight -= 1
            return {"reward": 1.0}

        @app.post("/crash")
        async def crash() -> Response:
            return Response("judge crashed", status_code=500)

        self.server = BackgroundServer(app, port=free_port())


@pytest.fixture(scope="module")
def prm() -> Iterator[ProcessRewardModel]:
    model = ProcessRewardModel()
    model.server.start()
    yield model
    model.server.stop()


def test_http_step_reward_model_scores_every_ok_step_and_a_failure_is_null_never_zero(
    pool_settings: PoolSettings, prm: ProcessRewardModel
) -> None:
    prm.bodies.clear()

    def store_for(path: str) -> PoolStore:
        return make_store(
            pool_settings.model_copy(
                update={
                    "step_reward_functions": ["http_step_reward_model"],  # the entry point
                    "step_reward_model_url": f"{prm.server.url}{path}",
                    "reward_model_timeout_s": 5.0,
                }
            )
        )

    store = store_for("/score")
    ids = write_trajectory(store, "judged", agent_turns(1, 2), group_id="g", reward=1.0)
    run_hooks(store)
    assert [g[:3] for g in step_records(store, "judged")] == [
        (ids[0], "http_step_reward_model", 0.5),
        (ids[1], "http_step_reward_model", 0.6),
    ]
    bodies = sorted(prm.bodies, key=lambda b: b["step_index"])  # asked concurrently
    assert [(b["step_id"], b["step_index"], b["group_id"]) for b in bodies] == [
        (ids[0], 0, "g"),
        (ids[1], 1, "g"),
    ]
    # the step's request messages, then its generated message
    assert bodies[0]["messages"][-1] == {"role": "assistant", "content": "ok"}
    store.engine.dispose()

    store = store_for("/crash")
    ids = write_trajectory(store, "crashed", agent_turns(2, 2), reward=1.0)
    run_hooks(store)
    got = step_records(store, "crashed")
    assert [(g[0], g[2]) for g in got] == [(ids[0], None), (ids[1], None)]
    assert all("HTTP 500" in g[4] for g in got)
    store.engine.dispose()


def test_http_step_reward_model_judges_the_steps_of_a_trajectory_concurrently(
    pool_settings: PoolSettings, prm: ProcessRewardModel
) -> None:
    prm.most_in_flight = 0
    store = make_store(
        pool_settings.model_copy(
            update={
                "step_reward_functions": ["http_step_reward_model"],
                "step_reward_model_url": f"{prm.server.url}/slow",
                "reward_model_timeout_s": 20.0,
            }
        )
    )
    write_trajectory(store, "long", agent_turns(3, 4), reward=1.0)
    run_hooks(store)
    assert [g[2] for g in step_records(store, "long")] == [1.0] * 4
    assert prm.most_in_flight == 4  # all four steps asked at once, not one after another
    store.engine.dispose()


def test_http_step_reward_model_without_a_url_is_refused_at_start_up() -> None:
    with pytest.raises(ValidationError, match="TRAJGATE_STEP_REWARD_MODEL_URL"):
        PoolSettings(step_reward_functions=["http_step_reward_model"])
    with pytest.raises(ValidationError, match="must start with http"):
        PoolSettings(step_reward_model_url="judge:8000/score")
