"""Step-level advantage estimators: credit per step, on numpy (the pool never needs torch).

Owns: ``STEP_ESTIMATORS``, the registry of step-level estimators (``BatchSpec.step_advantage``
takes its names), and the numbers each computes per step row. Never: treats a missing step
reward as 0.0 (readiness keeps a trajectory with an unrewarded trainable step out of batches, so
a step reward reaching here is a number; NaN in gives NaN out); never reads the pool.

Shape legend: ``B`` step rows of a batch (``per_step`` layout: one step each), in any order;
each row names its trajectory (member index), its position ``k`` among the trajectory's
``S`` rows (0..S-1), its group (index) and, for anchor grouping, its anchor (an int code, equal
codes = identical state within the group). ``r_k`` is a step's weighted step reward
``sum_j w_j r_{k,j}`` over the spec's ``step_reward_names``; ``R`` the trajectory reward.

Estimators (``A^E`` is the episode-level advantage of ``BatchSpec.algorithm``, broadcast to every
step; a row's advantage is ``episode_advantage_weight * A^E + step_advantage_weight * A^S``):

- ``step_returns``: the discounted return of (normalised) step rewards,
  ``A^S_k = G_k = sum_{s >= k} gamma^(s-k) r~_s``, where ``r~`` is, by ``step_normalisation``:

  - ``none``: ``r~_s = r_s``;
  - ``group`` (Shao et al. 2024, "DeepSeekMath", sec. 4.1.3, process supervision with GRPO):
    ``r~ = (r - mean(r_group)) / (std(r_group) + eps)`` over every step of every rollout in the
    group (unbiased std; ``scale_by_std=False`` only centres); the paper sums the following
    steps' normalised rewards, i.e. ``gamma = 1``;
  - ``leave_one_out`` (Cui et al. 2025, "Process Reinforcement through Implicit Rewards"
    (PRIME), arXiv 2502.01456, its advantage with implicit process rewards):
    ``r~_{i,s} = r_{i,s} - 1/(K-1) sum_{j != i} mean_t r_{j,t}``, the mean step reward of the
    *other* K-1 rollouts of the group as baseline (NaN when the group has one rollout). PRIME
    adds RLOO on the outcome reward (``algorithm: rloo``) with weight 1:
    ``A_k = G_k + (R_i - mean_{j != i} R_j)``.

- ``anchor_state`` (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent
  Training" (GiGPO), arXiv 2505.10978, its step relative advantage): steps of one group whose
  state is identical form a step-level sub-group ``G^S(s~)``; each step's discounted return
  ``G_k = sum_{s >= k} gamma^(s-k) r_s``, where the step rewards are the named step rewards (0
  when none is named) plus ``R`` on the trajectory's last step (the sparse outcome, as in the
  paper's environments), is compared within its sub-group:
  ``A^S_k = (G_k - mean(G in G^S)) / (std(G in G^S) + eps)`` (unbiased std;
  ``scale_by_std=False`` is the paper's ``F_norm = 1``). A step alone in its sub-group gets
  ``A^S = 0``. The paper combines ``A = A^E + omega A^S`` with GRPO's ``A^E`` and
  ``omega = 1``.

Adding a step-level estimator: write its function here (arrays in, ``StepCredit`` out, paper
and equation in the docstring), add its name to ``StepAlgorithm`` and one entry to
``STEP_ESTIMATORS``; ``datapool.batches.step_credit.credit_rows`` calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from datapool.batches.advantages import grpo_advantages
from datapool.errors import InvalidPoolRequestError
from datapool.rewards.group_stats import FloatArray, IntArray, group_stats

StepAlgorithm = Literal["none", "step_returns", "anchor_state"]
STEP_ALGORITHMS: tuple[StepAlgorithm, ...] = get_args(StepAlgorithm)
StepNormalisation = Literal["none", "group", "leave_one_out"]
STEP_NORMALISATIONS: tuple[StepNormalisation, ...] = get_args(StepNormalisation)


@dataclass(frozen=True)
class StepRows:
    """The batch's step rows ``[B]`` as the estimators see them."""

    trajectory: IntArray  # [B] member index
    position: IntArray  # [B] 0..S-1 within the trajectory
    group: IntArray  # [B] group index
    step_reward: FloatArray  # [B] float64 r_k; NaN where no step reward is named
    outcome: FloatArray  # [B] float64 R of the row's trajectory
    anchor: IntArray  # [B] anchor code (identical state = equal code); unused without anchors


@dataclass(frozen=True)
class StepParams:
    """The spec's knobs the estimators read."""

    gamma: float
    normalisation: StepNormalisation
    scale_by_std: bool
    eps: float


@dataclass(frozen=True)
class StepCredit:
    """What a step-level estimator gives each row ``[B]``."""

    step_return: FloatArray  # [B] float64 G_k the estimator compared
    step_advantage: FloatArray  # [B] float64 A^S_k
    anchor_group_size: npt.NDArray[np.int32]  # [B] steps sharing the row's anchor; 0 = none


def discounted_step_returns(
    step_reward: FloatArray, trajectory: IntArray, position: IntArray, gamma: float
) -> FloatArray:
    """``G_k = sum_{s >= k} gamma^(s-k) r_s`` ``[B]`` within each trajectory, rows in any order.

    ``[1, 2, 3]`` with gamma 0.5 gives ``[1 + 0.5*2 + 0.25*3, 2 + 0.5*3, 3] = [2.75, 3.5, 3]``.
    Raises ValueError for gamma outside [0, 1] or arrays of different shapes.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not (step_reward.shape == trajectory.shape == position.shape) or step_reward.ndim != 1:
        raise ValueError(
            f"step_reward, trajectory and position must all be [B]; got {step_reward.shape}, "
            f"{trajectory.shape}, {position.shape}"
        )
    order = np.lexsort((position, trajectory))  # [B] by trajectory, then position
    values = step_reward[order].tolist()
    owners = trajectory[order].tolist()
    returns = [0.0] * len(values)
    running, owner = 0.0, None
    for i in range(len(values) - 1, -1, -1):  # backwards; a new trajectory resets the sum
        if owners[i] != owner:
            running, owner = 0.0, owners[i]
        running = values[i] + gamma * running
        returns[i] = running
    result = np.empty_like(step_reward, dtype=np.float64)  # [B]
    result[order] = returns
    return result


def normalised_step_rewards(rows: StepRows, params: StepParams) -> FloatArray:
    """``r~`` ``[B]`` of ``step_returns`` by ``params.normalisation`` (see the module doc).

    Raises ``InvalidPoolRequestError`` for any other normalisation.
    """
    r = rows.step_reward
    if params.normalisation == "none":
        return r.astype(np.float64)
    if params.normalisation == "group":
        return grpo_advantages(r, rows.group, scale_by_std=params.scale_by_std, eps=params.eps)
    if params.normalisation == "leave_one_out":
        # Each rollout's mean step reward [N], then RLOO's baseline over the others in the group.
        ids, inverse = np.unique(rows.trajectory, return_inverse=True)  # [N], [B]
        counts = np.bincount(inverse, minlength=len(ids)).astype(np.float64)  # [N]
        means = np.bincount(inverse, weights=r, minlength=len(ids)) / counts  # [N]
        member_group = np.zeros(len(ids), dtype=np.int64)  # [N]
        member_group[inverse] = rows.group
        stats = group_stats(means, member_group)  # [G'] over rollouts with rewards
        g = np.searchsorted(stats.group_ids, member_group)  # [N]
        k = stats.scored_size[g].astype(np.float64)  # [N] rollouts K
        scale, mean = stats.scale[g], stats.scaled_mean[g]  # [N] each
        # (K mean - m_i) / (K - 1) = mean + (mean - m_i) / (K - 1), on the means divided by the
        # group's power-of-two scale: K mean overflowed for rewards near 1e308.
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            others = (mean + (mean - means / scale) / (k - 1)) * scale  # [N]; NaN/inf if K < 2
        baseline = np.where(k >= 2, others, np.nan)  # [N]
        return r - baseline[inverse]
    raise InvalidPoolRequestError(
        f"step_normalisation must be one of {STEP_NORMALISATIONS}, got {params.normalisation!r}",
        param="step_normalisation",
    )


def step_return_advantages(rows: StepRows, params: StepParams) -> StepCredit:
    """``step_returns``: ``A^S_k = G_k`` of the normalised step rewards ``[B]`` (module doc)."""
    r = normalised_step_rewards(rows, params)  # [B]
    returns = discounted_step_returns(r, rows.trajectory, rows.position, params.gamma)  # [B]
    return StepCredit(returns, returns, np.zeros(len(returns), dtype=np.int32))


def anchor_state_advantages(rows: StepRows, params: StepParams) -> StepCredit:
    """``anchor_state`` (GiGPO): each step's return relative to the steps of its group that
    start from the same state (module doc). ``anchor_group_size`` counts them (1 = alone)."""
    last = np.zeros(len(rows.position), dtype=bool)  # [B] the trajectory's last row
    if len(last):
        order = np.lexsort((rows.position, rows.trajectory))  # [B]
        ends = np.append(rows.trajectory[order][1:] != rows.trajectory[order][:-1], True)
        last[order[ends]] = True
    rewards = np.nan_to_num(rows.step_reward, nan=0.0) + np.where(last, rows.outcome, 0.0)  # [B]
    if np.isnan(rows.step_reward).any() and not np.isnan(rows.step_reward).all():
        # Some rows have a step reward and some not: that is a missing reward, not a 0.
        rewards = np.where(np.isnan(rows.step_reward), np.nan, rewards)
    returns = discounted_step_returns(rewards, rows.trajectory, rows.position, params.gamma)
    _ids, subgroup, sizes = np.unique(
        np.stack([rows.group, rows.anchor]), axis=1, return_inverse=True, return_counts=True
    )  # sub-group = (group, anchor); [B'], [B], [B']
    subgroup = subgroup.reshape(-1)  # [B]
    advantage = grpo_advantages(
        returns, subgroup, scale_by_std=params.scale_by_std, eps=params.eps
    )  # [B]; a sub-group of one: G - G = 0
    return StepCredit(returns, advantage, sizes[subgroup].astype(np.int32))


@dataclass(frozen=True)
class StepEstimator:
    """One step-level estimator: ``StepCredit`` from the step rows; ``needs_step_rewards``: a
    spec choosing it must name step rewards; ``needs_anchors``: the builder computes anchors."""

    credit: Callable[[StepRows, StepParams], StepCredit]
    needs_step_rewards: bool
    needs_anchors: bool


STEP_ESTIMATORS: dict[str, StepEstimator] = {  # keys: STEP_ALGORITHMS but "none" (a test checks)
    "step_returns": StepEstimator(step_return_advantages, True, False),
    "anchor_state": StepEstimator(anchor_state_advantages, False, True),
}


def step_estimator(name: str) -> StepEstimator:
    """The registered step-level estimator ``name``; raises ``InvalidPoolRequestError`` (listing
    the valid names) for any other."""
    if name not in STEP_ESTIMATORS:
        raise InvalidPoolRequestError(
            f"step_advantage must be one of {STEP_ALGORITHMS}, got {name!r}",
            param="step_advantage",
        )
    return STEP_ESTIMATORS[name]
