"""TRL (1.16) trains on the pool's rows: the ``rollout_func`` of a ``GRPOTrainer``.

TRL's contract (``trl/trainer/grpo_trainer.py``, 1.16.0): ``rollout_func(prompts, trainer)``
gets this process's prompts, already repeated ``num_generations`` times in a row by TRL's
sampler, and returns one row per prompt: ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one
per completion token), optionally ``env_mask`` (1 = model token, 0 = tool/environment token,
multiplied into TRL's loss mask); every other key goes per row to the reward functions as a
keyword argument. TRL computes the group advantages itself from the reward functions, over
consecutive ``num_generations`` rows, and runs on the CPU without vLLM (``use_vllm=False``):
with a ``rollout_func`` it never generates. It divides its logits by ``args.temperature``, so
the rows' behaviour logprobs must be at that temperature (checked).

Owns: ``PoolRollout`` (the ``rollout_func``: one agent episode per prompt through the gateway,
then the pool's rows of those episodes), ``rollout_output`` (pool rows → TRL's dict, in the
prompts' order) and ``pool_reward`` (a reward function returning each row's pool reward).
Never: tokenizes, or reorders tokens.

Weights the other way: with ``use_vllm=True`` TRL pushes its weights into vLLM before the first
``rollout_func`` call of each new optimizer step. ``PoolRollout(policy_model_name=...)`` then
tells the gateway with the one call ``POST /admin/policy-versions {"version", "model_name",
"activate": true}`` (``PoolEpisodes.register_policy_version``) before the step's episodes run,
so their steps are stamped with version ``version_offset + global_step`` (docs/deployment.md).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Sequence
from typing import Any

from trainer_bridge.integrations.episodes import Episode, PoolEpisodes
from trainer_bridge.integrations.rows import PoolRow


def rollout_output(rows: Sequence[PoolRow], trajectory_ids: Sequence[str]) -> dict[str, list[Any]]:
    """TRL's ``rollout_func`` answer: one row per trajectory of ``trajectory_ids`` (the episodes
    of the prompts, in the prompts' order).

    Extra keys, passed per row to TRL's reward functions: ``trajectory_id``, ``lineage_id``,
    ``group_id``, ``policy_version``, ``pool_reward``, ``pool_advantage``, ``step_ids``.

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
        "lineage_id": [row.lineage_id for row in chosen],
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


class PoolRollout:
    """A ``GRPOTrainer`` ``rollout_func``: each prompt is one agent episode through the gateway
    (``episodes.agent(base_url, prompt)``), each run of ``num_generations`` consecutive prompts
    one group; returns the pool's rows of those episodes once they are rewarded.

    Trajectory ids are ``{run_id}-c{call}-p{process}-{i}``, group ids
    ``{run_id}-c{call}-g{k}`` with ``k`` the group's index over all processes (TRL's groups
    may span processes: give every process the same ``run_id``, e.g. the run's name).
    ``policy_model_name``: the name vLLM serves TRL's weights under; when set, each new
    ``trainer.state.global_step`` registers and activates policy version
    ``version_offset + global_step`` with the gateway before its episodes run (only when TRL
    pushes weights into vLLM, ``use_vllm=True``: otherwise the served weights did not change).

    Raises (from ``__call__``):
        EpisodeError: an episode failed or was not rewarded in time.
        ValueError: an episode has not exactly one row (see ``rollout_output``), or a row's
            logprobs are at another temperature than ``trainer.temperature``.
    """

    def __init__(
        self,
        episodes: PoolEpisodes,
        *,
        run_id: str | None = None,
        policy_model_name: str | None = None,
        version_offset: int = 0,
    ) -> None:
        self.episodes = episodes
        self.run_id = run_id or f"trl-{uuid.uuid4().hex[:8]}"
        self.policy_model_name = policy_model_name
        self.version_offset = version_offset
        self.registered_version: int | None = None
        self._calls = itertools.count()

    def _sync_policy_version(self, trainer: Any) -> None:
        if self.policy_model_name is None:
            return
        version = self.version_offset + int(trainer.state.global_step)
        if version != self.registered_version and trainer.state.global_step > 0:
            self.episodes.register_policy_version(
                version,
                self.policy_model_name,
                f"trl:{self.run_id}:step-{trainer.state.global_step}",
            )
            self.registered_version = version

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        self._sync_policy_version(trainer)
        call = next(self._calls)
        group_size = (
            trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        )
        first = trainer.accelerator.process_index * len(prompts)
        episodes = [
            Episode(
                trajectory_id=f"{self.run_id}-c{call}-p{trainer.accelerator.process_index}-{i}",
                group_id=f"{self.run_id}-c{call}-g{(first + i) // group_size}",
                prompt=prompt,
            )
            for i, prompt in enumerate(prompts)
        ]
        rows = self.episodes.run(episodes)
        wrong = {
            r.trajectory_id: r.temperature for r in rows if r.temperature != trainer.temperature
        }
        if wrong:
            raise ValueError(
                f"TRL divides its logits by temperature {trainer.temperature}, but these rows' "
                f"behaviour logprobs are at {wrong}: sample at the trainer's temperature or set "
                "GRPOConfig(temperature=...) to the agents'"
            )
        return rollout_output(rows, [e.trajectory_id for e in episodes])
