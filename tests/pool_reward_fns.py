"""Reward functions the pool tests register by module path (``tests.pool_reward_fns:...``)."""

from __future__ import annotations

import asyncio
import time

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
