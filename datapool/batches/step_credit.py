"""Step credit of a batch's rows: step rewards, the step-level estimator and its anchors.

Owns: turning each step row's named step rewards into ``r_k = sum_j w_j r_{k,j}``, running the
spec's step-level estimator (``step_advantages.STEP_ESTIMATORS``) with its anchor states
(``anchors``), and the manifest's ``step_credit`` report. Never: reads the pool, or lets a
missing step reward become 0 (readiness keeps such trajectories out; NaN stays NaN).

Shape legend: ``B`` step rows (``per_step``: one step each), in batch order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from datapool.batches import anchors
from datapool.batches.rows import StepTokens
from datapool.batches.spec import BatchSpec
from datapool.batches.step_advantages import StepParams, StepRows, step_estimator
from datapool.rewards.group_stats import FloatArray, IntArray


@dataclass(frozen=True)
class StepScores:
    """Step credit of the rows ``[B]`` (NaN / null / 0 where the spec asks for none)."""

    step_rewards_json: list[str | None]  # the named step rewards the row used
    process_reward: FloatArray  # [B] r_k = sum_j w_j r_{k,j}
    step_return: FloatArray  # [B] G_k the step estimator compared
    step_advantage: FloatArray  # [B] A^S_k
    anchor_key: list[str | None]  # [B] hash of the row's state (anchor_state only)
    anchor_group_size: npt.NDArray[np.int32]  # [B] steps of the group sharing it; 0 = none
    report: dict[str, Any]  # the manifest's ``step_credit``


def credit_rows(
    steps: Sequence[StepTokens],
    trajectory: IntArray,
    position: IntArray,
    group: IntArray,
    outcome: FloatArray,
    step_rewards: Sequence[Mapping[str, float]],
    group_ids: Sequence[str | None],
    trajectory_ids: Sequence[str],
    spec: BatchSpec,
) -> StepScores:
    """Per row ``[B]`` (its step, trajectory index, position in it, group index, outcome ``R``,
    the step's current named step rewards, group id, trajectory id): the weighted step reward
    ``r_k``, then the spec's step-level estimator with its anchors; the report says how many
    steps found an anchor sub-group and the sub-groups' sizes (the manifest's ``step_credit``).
    """
    b = len(steps)
    weights = spec.resolved_step_reward_weights()
    process = np.full(b, np.nan, dtype=np.float64)  # [B]
    used: list[str | None] = [None] * b
    if weights:
        for i, values in enumerate(step_rewards):
            used[i] = json.dumps(dict(values))
            if set(values) >= set(weights):  # readiness guarantees it; missing stays NaN
                process[i] = sum(w * values[name] for name, w in weights.items())
    report: dict[str, Any] = {
        "step_reward_names": list(spec.step_reward_names),
        "step_advantage": spec.step_advantage,
        "steps": b,
    }
    nothing = np.full(b, np.nan, dtype=np.float64)  # [B]
    if spec.step_advantage == "none":
        zero = np.zeros(b, dtype=np.int32)
        return StepScores(used, process, nothing, nothing.copy(), [None] * b, zero, report)
    chosen = step_estimator(spec.step_advantage)
    keys: list[str | None] = [None] * b
    codes = np.zeros(b, dtype=np.int64)  # [B]
    if chosen.needs_anchors:
        first = np.flatnonzero(position == 0)  # [N] the trajectories' first rows
        keys = anchors.anchor_keys(
            steps, [steps[i] for i in first.tolist()], group, group[first], spec.anchor_key
        )
        index: dict[str, int] = {}
        # a row without a key (no observation) is a sub-group of its own
        codes = np.array(
            [index.setdefault(k or f"\x00{i}", len(index)) for i, k in enumerate(keys)],
            dtype=np.int64,
        )  # [B]
    rows = StepRows(trajectory, position, group, process, outcome, codes)
    credit = chosen.credit(
        rows,
        StepParams(spec.gamma, spec.step_normalisation, spec.scale_by_std, spec.advantage_eps),
    )
    if chosen.needs_anchors:
        report["anchor"] = anchors.anchor_report(
            [step.row.id for step in steps],
            position.tolist(),
            group_ids,
            trajectory_ids,
            keys,
            credit.anchor_group_size,
        )
        report["anchor"]["key"] = spec.anchor_key
    return StepScores(
        used,
        process,
        credit.step_return,
        credit.step_advantage,
        keys,
        credit.anchor_group_size,
        report,
    )
