"""Advantage estimators for RL on agent trajectories.

Owns: turning scalar rewards into advantages. Shape legend: ``B`` rows (one per rollout or step),
``G`` rollouts in a group, ``S`` steps of one trajectory. Never: treats a missing reward as 0.0:
a missing reward is ``NaN`` on the way in, is left out of every baseline, and gets a ``NaN``
advantage on the way out, which the caller must mask or drop (DESIGN invariant 5).

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
- Discounted returns for multi-turn credit: ``G_k = sum_{j >= k} gamma^(j-k) r_j``.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupStats:
    """Per-group facts stored with a batch (C16, C17). All tensors are ``[number of groups]``."""

    group_ids: Tensor  # the distinct group ids, ascending
    mean: Tensor  # over rewarded members; NaN when none
    std: Tensor  # unbiased; NaN when fewer than 2 rewarded members
    scored_size: Tensor  # rewarded members (unrewarded ones are not counted)
    degenerate: Tensor  # bool: std below epsilon (every rewarded member scored the same)


def group_stats(rewards: Tensor, group_ids: Tensor, *, degenerate_eps: float = 1e-6) -> GroupStats:
    """Mean, std and scored size of each group over its rewarded (non-NaN) members.

    Args:
        rewards: ``[B]`` float; NaN = unrewarded.
        group_ids: ``[B]`` int64.
        degenerate_eps: a group whose std is below this (or that has < 2 rewarded members) is
            ``degenerate``: it carries no learning signal for group-relative estimators.
    """
    _check(rewards, group_ids)
    ids, inverse = torch.unique(group_ids, sorted=True, return_inverse=True)
    rewarded = ~torch.isnan(rewards)
    values = torch.where(rewarded, rewards, torch.zeros_like(rewards)).double()
    count = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, rewarded.double())
    total = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, values)
    mean = total / count  # NaN where count == 0
    centred = torch.where(rewarded, values - mean[inverse], torch.zeros_like(values))
    square = torch.zeros(len(ids), dtype=torch.float64).index_add_(0, inverse, centred**2)
    std = torch.sqrt(square / (count - 1))  # Bessel's correction; NaN/inf for count < 2
    std = torch.where(count >= 2, std, torch.full_like(std, float("nan")))
    degenerate = ~(std >= degenerate_eps)  # NaN compares False: too few members is degenerate
    return GroupStats(ids, mean.to(rewards.dtype), std.to(rewards.dtype), count.long(), degenerate)


def grpo_advantages(
    rewards: Tensor, group_ids: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO advantages ``[B]`` from rewards ``[B]`` and group ids ``[B]`` (NaN in, NaN out).

    A degenerate group (all rewarded members equal) gets advantage 0 for its rewarded members.
    """
    stats = group_stats(rewards, group_ids)
    inverse = torch.searchsorted(stats.group_ids, group_ids)
    centred = rewards - stats.mean[inverse]
    if not scale_by_std:
        return centred
    std = torch.nan_to_num(stats.std[inverse], nan=0.0)
    return centred / (std + eps)


def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO advantages ``[B]``: each reward minus the mean of the *other* rewarded members.

    A member whose group has no other rewarded member gets NaN (no baseline exists).
    """
    stats = group_stats(rewards, group_ids)
    inverse = torch.searchsorted(stats.group_ids, group_ids)
    n = stats.scored_size[inverse].to(rewards.dtype)
    total = stats.mean[inverse] * n
    leave_one_out = (total - rewards) / (n - 1)
    return torch.where(n >= 2, rewards - leave_one_out, torch.full_like(rewards, float("nan")))


def reinforce_pp_advantages(rewards: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ advantages ``[B]``: rewards normalised by the batch's mean and std."""
    rewarded = rewards[~torch.isnan(rewards)]
    if rewarded.numel() == 0:
        return torch.full_like(rewards, float("nan"))
    std = rewarded.std() if rewarded.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
    return (rewards - rewarded.mean()) / (torch.nan_to_num(std, nan=0.0) + eps)


def discounted_returns(step_rewards: Tensor, gamma: float) -> Tensor:
    """Returns ``[S]`` of one trajectory's per-step rewards ``[S]`` (in step order).

    A final-only reward R over S steps is ``[0, ..., 0, R]`` and gives ``G_k = gamma^(S-1-k) R``.
    Raises ValueError for gamma outside [0, 1].
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    returns = torch.empty_like(step_rewards)
    running = torch.zeros((), dtype=step_rewards.dtype)
    for k in range(step_rewards.shape[0] - 1, -1, -1):
        running = step_rewards[k] + gamma * running
        returns[k] = running
    return returns


def _check(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if not torch.is_floating_point(rewards):
        raise ValueError(f"rewards must be floating point (NaN = unrewarded), got {rewards.dtype}")
