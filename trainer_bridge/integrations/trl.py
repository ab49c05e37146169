"""TRL (1.16) trains on the pool's rows: what a ``GRPOTrainer`` ``rollout_func`` returns.

TRL's contract (``trl/trainer/grpo_trainer.py``, 1.16.0): ``rollout_func(prompts, trainer)``
gets this process's prompts, already repeated ``num_generations`` times in a row by TRL's
sampler, and returns one row per prompt: ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one
per completion token), optionally ``env_mask`` (1 = model token, 0 = tool/environment token,
multiplied into TRL's loss mask); every other key goes per row to the reward functions as a
keyword argument. TRL computes the group advantages itself from the reward functions, over
consecutive ``num_generations`` rows, and runs on the CPU without vLLM (``use_vllm=False``):
with a ``rollout_func`` it never generates.

Owns: ``rollout_output`` (pool rows → that dict, in the prompts' order) and ``pool_reward``
(a reward function returning each row's pool reward). Never: tokenizes, or reorders tokens.

Weights the other way: when TRL pushes new weights into vLLM (``use_vllm=True``, it syncs before
each ``rollout_func`` call of a new step), tell the gateway the new version with the one call
``POST /admin/policy-versions {"version", "model_name", "activate": true}``
(``trainer_bridge.sync.WeightSync.register``), before the next episodes run, so their steps are
stamped right (docs/deployment.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainer_bridge.integrations.rows import PoolRow


def rollout_output(rows: Sequence[PoolRow], trajectory_ids: Sequence[str]) -> dict[str, list[Any]]:
    """TRL's ``rollout_func`` answer: one row per trajectory of ``trajectory_ids`` (the episodes
    of the prompts, in the prompts' order).

    Extra keys, passed per row to TRL's reward functions: ``trajectory_id``, ``group_id``,
    ``policy_version``, ``pool_reward``, ``pool_advantage``, ``step_ids``.

    Raises:
        ValueError: an episode has no row, or more than one (a prefix break or a tree splits a
            trajectory into several rows; TRL's groups are one row per prompt, so use verl's
            agent loop or a batch lease for such trajectories).
    """
    by_trajectory: dict[str, list[PoolRow]] = {}
    for row in rows:
        by_trajectory.setdefault(row.trajectory_id, []).append(row)
    wrong = {t: len(by_trajectory.get(t, [])) for t in trajectory_ids}
    wrong = {t: n for t, n in wrong.items() if n != 1}
    if wrong:
        raise ValueError(
            f"TRL takes exactly one row per episode; these trajectories have {wrong} rows "
            "(0: not ready or excluded, see /api/trajectories/{id}/readiness; >1: a prefix break "
            "or a tree split it)"
        )
    chosen = [by_trajectory[t][0] for t in trajectory_ids]
    return {
        "prompt_ids": [row.prompt_ids for row in chosen],
        "completion_ids": [row.completion_ids for row in chosen],
        "logprobs": [row.completion_logprobs for row in chosen],
        "env_mask": [row.completion_mask for row in chosen],
        "trajectory_id": [row.trajectory_id for row in chosen],
        "group_id": [row.group_id for row in chosen],
        "policy_version": [row.policy_version for row in chosen],
        "pool_reward": [row.reward for row in chosen],
        "pool_advantage": [row.advantage for row in chosen],
        "step_ids": [row.step_ids for row in chosen],
    }


def pool_reward(
    prompts: list[Any], completions: list[Any], pool_reward: list[float | None], **kwargs: Any
) -> list[float | None]:
    """A TRL reward function: each row's reward in the pool (None stays None: TRL treats a row
    every reward function scored None as unscorable, never as 0)."""
    return list(pool_reward)
