"""Reward functions the pool tests register by module path (``tests.pool_reward_fns:...``)."""

from __future__ import annotations

import asyncio
import time

from datapool.rewards.step_rewards import StepRewardContext
from datapool.rewards.values import RewardContext


def steps_times_half(context: RewardContext) -> float:
    return 0.5 * len(context.steps)  # 2 steps -> 1.0


def broken(context: RewardContext) -> float:
    raise RuntimeError("reward model unreachable")


def slow_steps_times_half(context: RewardContext) -> float:
    time.sleep(0.05)  # long enough for two racing runners to overlap on every trajectory
    return 0.5 * len(context.steps)


async def never_returns(context: RewardContext) -> float:
    await asyncio.sleep(3600)  # a reward model that hangs: its runner is stopped mid-run
    return 0.0


def not_a_number(context: RewardContext) -> float:
    return float("nan")  # a broken scorer: recorded as a failure, never stored as a value


def step_position(context: StepRewardContext) -> float:
    """A step reward function: 0.25 per step index (step 0 -> 0.0, step 2 -> 0.5)."""
    return 0.25 * context.step.step_index


def judges_only_the_first_step(context: StepRewardContext) -> float | None:
    """Judges step 0, has nothing to judge on step 1 (None), cannot judge later steps (raises)."""
    if context.step.step_index == 0:
        return 1.0
    if context.step.step_index == 1:
        return None
    raise ValueError(f"cannot judge step {context.step.step_index}: no reference solution")
