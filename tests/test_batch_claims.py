"""Exclusive batches under concurrency, on SQLite and PostgreSQL: builds that run at once (in
threads, each with its own engine as separate gateway processes would have, and over HTTP
through the real gateway) never put one trajectory in two batches built with
``exclude_batched``; the builds that lose answer ``nothing_ready``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from batch_helpers import agent_turns, make_store, write_trajectory
from sqlalchemy import select

from datapool.batches import build
from datapool.batches.build import BatchSpec, NothingToBatchError, materialise
from datapool.models import BatchClaim, BatchRow
from datapool.settings import PoolSettings
from gateway.server import BackgroundServer

BUILDERS = 4
EPISODES = 7


@pytest.fixture
def builds_meet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The first ``BUILDERS`` calls of ``build_rows`` all read the pool before any of them goes
    on to record its batch: the interleaving that let every build choose the same episodes,
    made certain instead of left to the scheduler. Later calls (a rebuild) pass straight on."""
    barrier = threading.Barrier(BUILDERS, timeout=120)
    calls = iter(range(10**6))
    lock = threading.Lock()
    real: Callable[..., Any] = build.build_rows

    def meeting(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        with lock:
            call = next(calls)
        if call < BUILDERS:
            barrier.wait()
        return result

    monkeypatch.setattr(build, "build_rows", meeting)
    yield


def write_episodes(pool_settings: PoolSettings) -> list[str]:
    store = make_store(pool_settings)
    ids = [f"ep-{i}" for i in range(EPISODES)]
    for i, tid in enumerate(ids):
        write_trajectory(store, tid, agent_turns(i + 1, 1), reward=1.0)
    return ids


def batched_trajectories(pool_settings: PoolSettings) -> list[tuple[str, str]]:
    """``(trajectory id, batch id)`` of every batch's rows, one per pair."""
    store = make_store(pool_settings)
    with store.sessions() as session:
        return sorted(set(session.execute(select(BatchRow.trajectory_id, BatchRow.batch_id))))


def test_concurrent_builds_in_separate_engines_batch_each_episode_once(
    pool_settings: PoolSettings, builds_meet: None
) -> None:
    episodes = write_episodes(pool_settings)
    spec = BatchSpec(algorithm="sft", reward_names=[])

    def build_one(_: int) -> str:
        try:
            return materialise(make_store(pool_settings), spec).id  # own engine, own pool
        except NothingToBatchError:
            return "nothing_ready"

    with ThreadPoolExecutor(BUILDERS) as pool:
        outcomes = list(pool.map(build_one, range(BUILDERS)))

    built = [o for o in outcomes if o != "nothing_ready"]
    assert len(built) == 1 and outcomes.count("nothing_ready") == BUILDERS - 1
    pairs = batched_trajectories(pool_settings)
    assert pairs == [(tid, built[0]) for tid in episodes]  # each episode once, in the one batch
    with make_store(pool_settings).sessions() as session:
        claims = sorted(session.execute(select(BatchClaim.trajectory_id, BatchClaim.batch_id)))
    assert claims == [(tid, built[0]) for tid in episodes]


def test_concurrent_batch_requests_over_http_give_the_episodes_to_one_batch(
    gateway: BackgroundServer, pool_settings: PoolSettings, builds_meet: None
) -> None:
    episodes = write_episodes(pool_settings)

    def post(_: int) -> httpx.Response:
        with httpx.Client(base_url=gateway.url, timeout=300) as api:
            return api.post("/api/batches", json={"algorithm": "sft", "reward_names": []})

    with ThreadPoolExecutor(BUILDERS) as pool:
        answers = list(pool.map(post, range(BUILDERS)))

    created = [a for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]
    assert len(created) == 1, [a.text for a in answers]
    assert sorted(created[0].json()["manifest"]["trajectory_ids"]) == episodes
    assert [(a.status_code, a.json()["error"]["code"]) for a in refused] == [
        (409, "nothing_ready")
    ] * (BUILDERS - 1)
    assert batched_trajectories(pool_settings) == [
        (tid, created[0].json()["id"]) for tid in episodes
    ]


def test_a_build_that_loses_its_claim_takes_only_the_episodes_left(
    pool_settings: PoolSettings,
) -> None:
    episodes = write_episodes(pool_settings)
    store = make_store(pool_settings)
    # An exclusive batch of the first three, recorded while a second build (below) already
    # chose all seven: the second loses its claim and builds again from the four left.
    first = BatchSpec(algorithm="sft", reward_names=[], filters={"trajectory_ids": episodes[:3]})
    real = build.build_rows
    raced: list[str] = []

    def racing(store_: Any, spec: BatchSpec) -> Any:
        result = real(store_, spec)
        if spec is not first and not raced:
            raced.append(materialise(make_store(pool_settings), first).id)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "build_rows", racing)
        second = materialise(store, BatchSpec(algorithm="sft", reward_names=[]))
    pairs = batched_trajectories(pool_settings)
    assert pairs == sorted(
        [(tid, raced[0]) for tid in episodes[:3]] + [(tid, second.id) for tid in episodes[3:]]
    )
