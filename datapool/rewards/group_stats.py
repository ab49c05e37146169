"""Statistics of rewards within groups of rollouts: mean, std, scored size, degeneracy.

Owns: ``group_stats``, shared by curation (a group whose rollouts all scored the same carries no
learning signal: C16, C17) and by the advantage estimators of ``datapool.batches.advantages``.
Shape legend: ``B`` rows (one per rollout or step), ``G`` groups. Never: treats a missing reward
as 0.0: NaN is unrewarded and is left out of every statistic (DESIGN invariant 5).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.floating[Any]]
IntArray = npt.NDArray[np.integer[Any]]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class GroupStats:
    """Per-group facts stored with a batch (C16, C17). All arrays are ``[G]`` (number of groups)."""

    group_ids: IntArray  # the distinct group ids, ascending
    mean: FloatArray  # over rewarded members; NaN when none
    std: FloatArray  # unbiased; NaN when fewer than 2 rewarded members
    scored_size: npt.NDArray[np.int64]  # rewarded members (unrewarded ones are not counted)
    degenerate: BoolArray  # std below epsilon (every rewarded member scored the same)


def group_stats(
    rewards: FloatArray, group_ids: IntArray, *, degenerate_eps: float = 1e-6
) -> GroupStats:
    """Mean, std and scored size of each group over its rewarded (non-NaN) members.

    Args:
        rewards: ``[B]`` float; NaN = unrewarded.
        group_ids: ``[B]`` int.
        degenerate_eps: a group whose std is below this (or that has < 2 rewarded members) is
            ``degenerate``: it carries no learning signal for group-relative estimators.

    Sums run in float64, member by member in row order, whatever the rewards' dtype.
    Raises ValueError unless ``rewards`` and ``group_ids`` are both ``[B]`` and rewards are float.
    """
    check_rewards(rewards, group_ids)
    ids, inverse = np.unique(group_ids, return_inverse=True)  # [G], [B]
    rewarded = ~np.isnan(rewards)  # [B]
    values = np.where(rewarded, rewards, 0.0).astype(np.float64)  # [B]
    count = np.bincount(inverse, weights=rewarded.astype(np.float64), minlength=len(ids))  # [G]
    total = np.bincount(inverse, weights=values, minlength=len(ids))  # [G]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count  # [G]; NaN where count == 0
        centred = np.where(rewarded, values - mean[inverse], 0.0)  # [B]
        square = np.bincount(inverse, weights=centred**2, minlength=len(ids))  # [G]
        std = np.sqrt(square / (count - 1))  # [G]; Bessel's correction; NaN/inf for count < 2
    std = np.where(count >= 2, std, np.nan)
    degenerate = ~(std >= degenerate_eps)  # NaN compares False: too few members is degenerate
    return GroupStats(
        ids,
        mean.astype(rewards.dtype),
        std.astype(rewards.dtype),
        count.astype(np.int64),
        degenerate,
    )


def check_rewards(rewards: FloatArray, group_ids: IntArray) -> None:
    """Raises ValueError unless ``rewards`` and ``group_ids`` are ``[B]`` and rewards are float."""
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be [B]; got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if not np.issubdtype(rewards.dtype, np.floating):
        raise ValueError(f"rewards must be floating point (NaN = unrewarded), got {rewards.dtype}")
