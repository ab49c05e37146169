"""Reward functions as the completion hooks run them, on SQLite and PostgreSQL: what
``run_reward_functions`` records of each, a failure recorded with its error and a null value."""

from __future__ import annotations

import asyncio
from typing import Any

from batch_helpers import make_store
from sqlalchemy import select

from datapool import lifecycle
from datapool.models import Reward, TrajectoryStatus
from datapool.records import CallRecord, ChoiceRecord
from datapool.rewards import current_rewards, run_reward_functions
from datapool.settings import PoolSettings
from datapool.store import PoolStore

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


# -- helpers ----------------------------------------------------------------------------------


def record(
    store: PoolStore,
    trajectory_id: str,
    response: dict[str, Any] | None,
    *,
    messages: list[dict[str, Any]] = QUESTION,
    tools: list[dict[str, Any]] | None = None,
    outcome: str = "ok",
    choices: int = 1,
) -> None:
    """One call as the gateway records it: ``choices`` copies of ``response`` (None: failed)."""
    request: dict[str, Any] = {"model": "tiny", "messages": messages}
    if tools is not None:
        request["tools"] = tools
    ids = None if response is None else [11, 12]
    store.record_call(
        trajectory_id,
        CallRecord(
            request=request,
            upstream_request=request,
            model="tiny",
            upstream="http://up",
            policy_version=0,
            latency_ms=1.0,
            prompt_token_ids=[1, 2, 3],
            prompt_tokens=3,
            choices=[
                ChoiceRecord(i, ids, None if ids is None else [-0.5, -0.5], response, "stop")
                for i in range(choices)
            ],
            outcome=outcome,
            error=None if outcome == "ok" else "upstream answered 503",
        ),
    )


def answer(content: str | None, *tool_calls: tuple[str, str]) -> dict[str, Any]:
    """An assistant message with ``content`` and tool calls ``(name, arguments string)``."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [
            {"id": f"call-{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(tool_calls)
        ]
    return message


def create(store: PoolStore, trajectory_id: str, metadata: dict[str, Any] | None = None) -> None:
    lifecycle.create_trajectory(store.sessions, trajectory_id, metadata=metadata)


def complete(store: PoolStore, trajectory_id: str, *names: str) -> None:
    """Complete the trajectory and run ``names`` on it, as its completion hooks would."""
    lifecycle.close_trajectory(store.sessions, trajectory_id, TrajectoryStatus.COMPLETE)
    asyncio.run(run_reward_functions(store, trajectory_id, names))


def records(store: PoolStore, trajectory_id: str) -> list[tuple[str, float | None, str | None]]:
    """``(name, value, error)`` of every reward record of the trajectory, oldest first."""
    with store.sessions() as session:
        return [
            (r.name, r.value, r.error)
            for r in session.scalars(
                select(Reward).where(Reward.trajectory_id == trajectory_id).order_by(Reward.id)
            )
        ]


def current(store: PoolStore, trajectory_id: str) -> dict[str, float]:
    with store.sessions() as session:
        return current_rewards(session, "trajectory", [trajectory_id]).get(trajectory_id, {})


# -- what run_reward_functions records --------------------------------------------------------


def test_reward_function_returning_nan_is_recorded_as_failed_and_the_others_still_land(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    create(store, "nan")
    record(store, "nan", answer("Sunny."))
    complete(store, "nan", "pool_reward_fns:not_a_number", "pool_reward_fns:steps_times_half")
    [nan, half] = records(store, "nan")
    assert nan[:2] == ("not_a_number", None)
    assert nan[2] is not None and "expected a finite number" in nan[2]
    assert half == ("steps_times_half", 0.5, None)  # 0.5 * 1 step
