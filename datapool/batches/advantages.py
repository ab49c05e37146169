"""Advantage estimators for RL on agent trajectories, on numpy (the pool never needs torch).

Owns: turning scalar rewards into advantages, and ``ESTIMATORS``, the one registry of batch
algorithms (``BatchSpec.algorithm`` takes its names). Shape legend: ``B`` rows (one per rollout or
step), ``G`` rollouts in a group, ``S`` steps of one trajectory. Never: treats a missing reward as
0.0: a missing reward is ``NaN`` on the way in, is left out of every baseline, and gets a ``NaN``
advantage on the way out, which the caller must mask or drop (DESIGN invariant 5). Every function
keeps the rewards' float dtype (the pool passes float64).

Estimators:

- GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2, outcome supervision):
  ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)``, std with Bessel's correction (as TRL).
  ``scale_by_std=False`` is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"),
  which removes the std's bias toward easy and hard questions.
- RLOO (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics"):
  ``A_i = r_i - mean_{j != i} r_j`` over the rewarded members of the group.
- REINFORCE++ (Hu 2025, "REINFORCE++"): a global baseline,
  ``A_i = (r_i - mean(r_batch)) / (std(r_batch) + eps)`` over the whole batch. (The paper also
  puts a token-level KL penalty into the reward; here KL lives in the loss, see ``losses``.)
- SFT: advantage 1.0, a plain likelihood weight.
- Discounted returns for multi-turn credit: ``G_k = sum_{j >= k} gamma^(j-k) r_j``.

Adding an algorithm: write its function here, add its name to ``Algorithm`` and one entry to
``ESTIMATORS`` (``group_relative`` says whether it needs groups of rollouts of one task).

Not offered: PPO. It needs a critic (a value head trained with the policy) and GAE over each
row's tokens, which the trainer does not have; a spec naming ``ppo`` is refused (400, listing the
valid values) rather than accepted and then refused by the trainer, so a run fails at its spec,
not hours in (``tests/test_trainer_math.py``).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from datapool.errors import InvalidPoolRequestError
from datapool.rewards.group_stats import FloatArray, IntArray, group_stats

Algorithm = Literal["grpo", "rloo", "reinforce_pp", "sft"]
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)


def grpo_advantages(
    rewards: FloatArray, group_ids: IntArray, *, scale_by_std: bool = True, eps: float = 1e-6
) -> FloatArray:
    """GRPO advantages ``[B]`` from rewards ``[B]`` and group ids ``[B]`` (NaN in, NaN out).

    A degenerate group (all rewarded members equal) gets advantage 0 for its rewarded members.
    Computed on the rewards divided by their group's power-of-two scale ``s``
    (``group_stats``): ``(r/s - mean/s) / (std/s + eps/s)``, the same number, so any finite
    rewards give the normalised advantage (±1e308 in a group of two: ±1/sqrt(2), where the
    unscaled std overflowed); only a centred reward past the float range is ±inf without std.
    """
    stats = group_stats(rewards, group_ids)
    inverse = np.searchsorted(stats.group_ids, group_ids)  # [B]
    scale = stats.scale[inverse]  # [B]
    centred = rewards / scale - stats.scaled_mean[inverse]  # [B], in (-4, 4)
    if not scale_by_std:
        with np.errstate(over="ignore"):
            return centred * scale
    std = np.nan_to_num(stats.scaled_std[inverse], nan=0.0)  # [B]
    with np.errstate(over="ignore"):  # eps/s past the float range: the advantage is ~0, is 0
        return centred / (std + eps / scale)


def rloo_advantages(rewards: FloatArray, group_ids: IntArray) -> FloatArray:
    """RLOO advantages ``[B]``: each reward minus the mean of the *other* rewarded members.

    A member whose group has no other rewarded member gets NaN (no baseline exists). Computed
    as ``n/(n-1) (r - mean)`` (the same number: ``mean_{j != i} r_j = (n mean - r_i)/(n-1)``)
    on the rewards divided by the group's power-of-two scale, so no sum overflows; only an
    advantage past the float range is ±inf.
    """
    stats = group_stats(rewards, group_ids)
    inverse = np.searchsorted(stats.group_ids, group_ids)  # [B]
    n = stats.scored_size[inverse].astype(rewards.dtype)  # [B]
    scale = stats.scale[inverse]  # [B]
    centred = rewards / scale - stats.scaled_mean[inverse]  # [B]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        advantages = centred * (n / (n - 1)) * scale  # [B]; inf/NaN where n < 2, replaced below
    return np.where(n >= 2, advantages, np.nan).astype(rewards.dtype)


def reinforce_pp_advantages(rewards: FloatArray, *, eps: float = 1e-6) -> FloatArray:
    """REINFORCE++ advantages ``[B]``: rewards normalised by the batch's mean and std
    (unbiased; 0 for a single rewarded member; NaN for all when none is rewarded): GRPO with
    the whole batch as one group, so as robust to huge and tiny rewards."""
    return grpo_advantages(rewards, np.zeros(rewards.shape, dtype=np.int64), eps=eps)


def sft_weights(rewards: FloatArray) -> FloatArray:
    """SFT: 1.0 ``[B]`` for every row, a plain likelihood weight (rewards are not used)."""
    return np.ones_like(rewards)


@dataclass(frozen=True)
class Estimator:
    """One batch algorithm: its advantages ``[B]`` from rewards ``[B]``, group ids ``[B]``, and
    the spec's ``(scale_by_std, eps)``; ``group_relative`` estimators need groups, so the builder
    drops ungrouped trajectories and (by default) degenerate groups for them."""

    advantages: Callable[[FloatArray, IntArray, bool, float], FloatArray]
    group_relative: bool


ESTIMATORS: dict[str, Estimator] = {  # keys: exactly ALGORITHMS (a test checks)
    "grpo": Estimator(
        lambda r, g, scale_by_std, eps: grpo_advantages(r, g, scale_by_std=scale_by_std, eps=eps),
        group_relative=True,
    ),
    "rloo": Estimator(lambda r, g, _scale, _eps: rloo_advantages(r, g), group_relative=True),
    "reinforce_pp": Estimator(
        lambda r, _g, _scale, eps: reinforce_pp_advantages(r, eps=eps), group_relative=False
    ),
    "sft": Estimator(lambda r, _g, _scale, _eps: sft_weights(r), group_relative=False),
}


def estimator(algorithm: str) -> Estimator:
    """The registered estimator of ``algorithm``; raises ``InvalidPoolRequestError`` (listing
    the valid names) for any other."""
    if algorithm not in ESTIMATORS:
        raise InvalidPoolRequestError(
            f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}", param="algorithm"
        )
    return ESTIMATORS[algorithm]


def estimate_advantages(
    algorithm: str,
    rewards: FloatArray,
    group_ids: IntArray,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> FloatArray:
    """Advantages ``[B]`` of trajectory rewards ``[B]`` in groups ``[B]`` under ``algorithm``
    (NaN = unrewarded stays NaN). Raises ``InvalidPoolRequestError`` for an unknown algorithm."""
    return estimator(algorithm).advantages(rewards, group_ids, scale_by_std, eps)


def discounted_returns(step_rewards: FloatArray, gamma: float) -> FloatArray:
    """Returns ``[S]`` of one trajectory's per-step rewards ``[S]`` (in step order).

    A final-only reward R over S steps is ``[0, ..., 0, R]`` and gives ``G_k = gamma^(S-1-k) R``.
    Raises ValueError for gamma outside [0, 1].
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    returns = np.empty_like(step_rewards)  # [S]
    running = step_rewards.dtype.type(0.0)
    for k in range(step_rewards.shape[0] - 1, -1, -1):
        running = step_rewards[k] + gamma * running
        returns[k] = running
    return returns
