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
    """Per-group facts stored with a batch (C16, C17). All arrays are ``[G]`` (number of groups).

    ``scaled_mean`` and ``scaled_std`` are the statistics of the rewards divided by ``scale``, a
    power of two near the group's largest |reward| (1 when every reward is 0 or none is given):
    ``mean == scaled_mean * scale`` and ``std == scaled_std * scale`` exactly, but the scaled
    ones stay finite and keep their precision for any finite rewards (±1e308, whose spread
    overflows, or ±1e-300, whose squares underflow), so estimators normalise with them.
    """

    group_ids: IntArray  # the distinct group ids, ascending
    mean: FloatArray  # over rewarded members; NaN when none
    std: FloatArray  # unbiased; NaN when fewer than 2 rewarded members; inf past float range
    scored_size: npt.NDArray[np.int64]  # rewarded members (unrewarded ones are not counted)
    degenerate: BoolArray  # std below epsilon (every rewarded member scored the same)
    scale: FloatArray  # a power of two, 2^(e-1) with max |r| in [2^(e-1), 2^e); 1 for all-0
    scaled_mean: FloatArray  # mean / scale, in (-2, 2)
    scaled_std: FloatArray  # std / scale, finite


def group_stats(
    rewards: FloatArray, group_ids: IntArray, *, degenerate_eps: float = 1e-6
) -> GroupStats:
    """Mean, std and scored size of each group over its rewarded (non-NaN) members.

    Args:
        rewards: ``[B]`` float; NaN = unrewarded; any finite value (±inf is refused upstream).
        group_ids: ``[B]`` int.
        degenerate_eps: a group whose std is below this (or that has < 2 rewarded members) is
            ``degenerate``: it carries no learning signal for group-relative estimators.

    Sums run in float64, member by member in row order, whatever the rewards' dtype, over the
    rewards divided by their group's power-of-two ``scale``: dividing by a power of two is
    exact, so ordinary rewards give the same bits as unscaled sums, and no square can overflow
    (or underflow) however large (or small) the rewards are.
    Raises ValueError unless ``rewards`` and ``group_ids`` are both ``[B]`` and rewards are float.
    """
    check_rewards(rewards, group_ids)
    ids, inverse = np.unique(group_ids, return_inverse=True)  # [G], [B]
    rewarded = ~np.isnan(rewards)  # [B]
    values = np.where(rewarded, rewards, 0.0).astype(np.float64)  # [B]
    largest = np.zeros(len(ids), dtype=np.float64)  # [G] max |r|
    np.maximum.at(largest, inverse, np.abs(values))
    _, exponent = np.frexp(largest)  # largest in [2^(e-1), 2^e); frexp(0) gives e = 0
    scale = np.where(largest > 0, np.ldexp(1.0, exponent - 1), 1.0)  # [G]; 2^(e-1) never inf
    scaled = values / scale[inverse]  # [B]; |scaled| < 2
    count = np.bincount(inverse, weights=rewarded.astype(np.float64), minlength=len(ids))  # [G]
    total = np.bincount(inverse, weights=scaled, minlength=len(ids))  # [G]
    with np.errstate(invalid="ignore", divide="ignore"):
        scaled_mean = total / count  # [G]; NaN where count == 0
        centred = np.where(rewarded, scaled - scaled_mean[inverse], 0.0)  # [B]
        square = np.bincount(inverse, weights=centred**2, minlength=len(ids))  # [G]
        scaled_std = np.sqrt(square / (count - 1))  # [G]; Bessel's correction; NaN/inf if < 2
    scaled_std = np.where(count >= 2, scaled_std, np.nan)
    with np.errstate(over="ignore"):  # a std past the float range is inf, as it is
        std = scaled_std * scale  # [G]
    degenerate = ~(std >= degenerate_eps)  # NaN compares False: too few members is degenerate
    return GroupStats(
        ids,
        (scaled_mean * scale).astype(rewards.dtype),
        std.astype(rewards.dtype),
        count.astype(np.int64),
        degenerate,
        scale.astype(rewards.dtype),
        scaled_mean.astype(rewards.dtype),
        scaled_std.astype(rewards.dtype),
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
