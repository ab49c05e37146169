"""Step reward functions: a reward per step (process reward), run on every completed trajectory.

Owns: ``StepRewardContext`` (what a step reward function sees: the trajectory and one step of
it) and ``run_step_reward_functions`` (each configured function once per ``ok`` step, what it
returns appended as a reward on that step; an async function judges a trajectory's steps
concurrently, so a process reward model served over HTTP costs one round trip per trajectory,
not one per step). Registration is the trajectory reward functions':
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

from datapool.rewards.values import (
    RewardContext,
    RewardIn,
    add_rewards,
    load_context,
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
    context = await load_context(store, trajectory_id)
    judged = [step for step in context.steps if step.outcome == "ok"]
    records: list[RewardIn] = []
    for name in names:
        label = reward_label(name)
        try:
            # the same resolution as trajectory functions, under the step functions' group
            fn = cast(StepRewardFunction, resolve_reward_function(name, STEP_ENTRY_POINT_GROUP))
            outcomes = await _judge_each(fn, context, judged)
        except Exception as exc:  # not resolved: every step records the failure
            outcomes = [exc] * len(judged)
        for step, outcome in zip(judged, outcomes, strict=True):
            try:
                if isinstance(outcome, BaseException):
                    raise outcome
                records.extend(
                    records_of("step", step.id, label, outcome, author=STEP_REWARD_AUTHOR)
                )
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


async def _judge_each(
    fn: StepRewardFunction, context: RewardContext, steps: Sequence[StoredStep]
) -> list[Any]:
    """What ``fn`` returned, or raised, for each step, in order. An async function judges all
    steps at once (one process reward model call per step, concurrently: the trajectory takes
    about one ``reward_model_timeout_s``, not one per step, so it stays within the hooks'
    lease); a sync one judges them one after another in a worker thread."""
    if inspect.iscoroutinefunction(fn):
        return list(
            await asyncio.gather(
                *(fn(StepRewardContext(context, step)) for step in steps), return_exceptions=True
            )
        )
    results: list[Any] = []
    for step in steps:
        try:
            results.append(await asyncio.to_thread(fn, StepRewardContext(context, step)))
        except Exception as exc:
            results.append(exc)
    return results
