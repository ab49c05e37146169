"""Step reward functions: a reward per step (process reward), run on every completed trajectory.

Owns: ``StepRewardContext`` (what a step reward function sees: the trajectory and one step of
it) and ``run_step_reward_functions`` (each configured function once per ``ok`` step, what it
returns appended as a reward on that step). Registration is the trajectory reward functions':
an entry point in the group ``STEP_ENTRY_POINT_GROUP`` (``trajgate.step_rewards``) or a module
path ``pkg.mod:fn``, named in ``PoolSettings.step_reward_functions``; the built-ins live in
``datapool.rewards.functions``. Never: invents a value.

Three outcomes, never confused (as for trajectories): a finite number (or ``{name: number}``)
is the step's reward, recorded under the function's name (or each key) with source ``rule``
and author ``step_reward_fn``; None records nothing (the step stays unrewarded, and a batch
spec requiring that reward keeps the trajectory out); an exception, or a value that is not a
finite number, is recorded as that function's *failed* reward on that step (``error`` set,
``value`` null), which never reads as 0.0. Steps whose outcome is not ``ok`` never train and are
not judged.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from datapool.errors import UnknownTargetError
from datapool.rewards.values import (
    RewardContext,
    RewardIn,
    add_rewards,
    records_of,
    resolve_reward_function,
    reward_label,
)
from datapool.steps.store import PoolStore, StoredStep

STEP_ENTRY_POINT_GROUP = "trajgate.step_rewards"
STEP_REWARD_AUTHOR = "step_reward_fn"


@dataclass(frozen=True)
class StepRewardContext:
    """What a step reward function sees: the completed ``trajectory`` (all its steps, metadata,
    settings) and the ``step`` to judge (exact payload, request and generated message)."""

    trajectory: RewardContext
    step: StoredStep


StepRewardFunction = Callable[[StepRewardContext], Any]


async def run_step_reward_functions(
    store: PoolStore,
    trajectory_id: str,
    names: Sequence[str],
    on_outcome: Callable[[str, bool], None] | None = None,
) -> list[int]:
    """Run each named step reward function on every ``ok`` step of the trajectory, in step
    order, and append what it returned, or its failure, on that step (one transaction).

    Sync functions run in a worker thread. Returns the appended record ids. ``on_outcome`` is
    told ``(name, succeeded)`` per function and step. Raises ``UnknownTargetError`` for an
    unknown trajectory.
    """
    if not names:
        return []
    trajectory = await asyncio.to_thread(store.get_trajectory, trajectory_id)
    if trajectory is None:
        raise UnknownTargetError(f"no trajectory {trajectory_id!r}", param="trajectory_id")
    steps = await asyncio.to_thread(store.steps_of, trajectory_id)
    context = RewardContext(
        trajectory_id,
        trajectory.group_id,
        trajectory.channel,
        dict(trajectory.metadata_json),
        steps,
        store.settings,
    )
    records: list[RewardIn] = []
    for name in names:
        label = reward_label(name)
        fn: StepRewardFunction | None = None
        failure: Exception | None = None
        try:
            # the same resolution as trajectory functions, under the step functions' group
            fn = cast(StepRewardFunction, resolve_reward_function(name, STEP_ENTRY_POINT_GROUP))
        except Exception as exc:  # every step records the failure: none is judged
            failure = exc
        for step in steps:
            if step.outcome != "ok":
                continue
            try:
                if fn is None:
                    raise failure or RuntimeError(f"step reward function {name!r} not found")
                judged = StepRewardContext(context, step)
                value = (
                    await fn(judged)
                    if inspect.iscoroutinefunction(fn)
                    else await asyncio.to_thread(fn, judged)
                )
                records.extend(records_of("step", step.id, label, value, author=STEP_REWARD_AUTHOR))
            except Exception as exc:  # a failed reward on this step, never a value
                records.append(
                    RewardIn("step", step.id, label, None, "rule", STEP_REWARD_AUTHOR, repr(exc))
                )
                if on_outcome is not None:
                    on_outcome(name, False)
            else:
                if on_outcome is not None:
                    on_outcome(name, True)
    if not records:
        return []
    return await asyncio.to_thread(add_rewards, store.sessions, records)
