"""Reward functions the pool tests register by module path (``tests.pool_reward_fns:...``)."""

from __future__ import annotations

from datapool.rewards import RewardContext


def steps_times_half(context: RewardContext) -> float:
    return 0.5 * len(context.steps)  # 2 steps -> 1.0


def broken(context: RewardContext) -> float:
    raise RuntimeError("reward model unreachable")
