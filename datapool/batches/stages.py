"""The stages from a spec to batch rows, one function each, in the order ``build_rows`` runs them.

Owns the steps between "which trajectories" and "an Arrow table of rows":

1. ``select_candidates``: the spec's complete trajectories (not yet batched), their steps,
   readiness verdicts and exact tokens. With ``pool_group_sizes``, the only reads of the pool.
2. ``trainable_steps``: per ready trajectory, the steps that may train (not excluded, with exact
   token ids, not stale).
3. ``form_groups``: members with their weighted reward ``R``, grouped by group id (an ungrouped
   trajectory is a group of one).
4. ``keep_groups``: group order (shuffled with a seed), group size, group verdicts (C17), and the
   groups a group-relative algorithm cannot use.
5. ``fit_token_budget``: whole groups, in order, until the batch's token budget.
6. ``score``: rewards, advantages (the spec's estimator) and group statistics.
7. ``place_rewards``: each member cut into rows, and the share of ``R`` and ``A`` each row gets.
8. ``shuffle_rows``: the rows in order.
9. ``credit_steps``: step rewards, and the spec's step-level estimator
   (``datapool.batches.step_advantages``) with its anchor sub-groups, per row.
10. ``assemble_table``: the rows as a table in ``ROW_SCHEMA``.

Every stage that drops something counts it in ``counts`` (the manifest's counts) under a named
key. Never: writes to the pool or to files (``build.materialise`` does); never lets an unrewarded
trajectory's reward become 0 (NaN stays NaN, and unrewarded trajectories are not ready); never
puts an integrity-flagged or excluded step in a row, or crosses a prefix break
(``datapool.batches.rows``).

Shape legend: ``B`` rows, ``N`` trajectories (members) in the batch, ``G`` groups, ``S`` rows of
one trajectory.

Rewards reach rows as follows. A trajectory's reward ``R`` is ``sum_i w_i r_i`` over the spec's
``reward_names`` (weights default 1). The estimator (``datapool.batches.advantages``) runs on the
members' ``R`` ``[N]``. ``reward_to_steps`` then decides what each row gets: ``broadcast`` (every
row: ``R`` and ``A``), ``final_step`` (only the trajectory's last row is kept), ``discounted``
(the k-th of S rows gets ``gamma^(S-1-k)`` times ``R`` and ``A``; per_step only). A ``merged``
row holds several steps and one advantage, so merged needs ``broadcast``. With step credit
(``step_reward_names``, ``step_advantage``; per_step only) a row's advantage is
``episode_advantage_weight * A^E + step_advantage_weight * A^S_k``. Lineages: every row of a
trajectory, whatever conversation (``lineage_id``) it is, gets the trajectory's ``R`` and ``A`` as
above; a reward given to a lineage (target ``lineage``) rides on that lineage's rows in
``lineage_rewards_json`` and changes neither ``R`` nor ``A`` (estimators score trajectories).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pyarrow as pa
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from datapool.batches.advantages import discounted_returns, estimate_advantages, estimator
from datapool.batches.rows import (
    VERSION_SPANS,
    StepTokens,
    assemble,
    load_tokens,
    segment_tokens,
    segments,
)
from datapool.batches.spec import REWARD_TO_STEPS, BatchSpec
from datapool.batches.step_credit import StepScores, credit_rows
from datapool.curation.readiness import Verdict, assess
from datapool.curation.rules import GroupVerdict, active_policy_version, judge_group
from datapool.curation.selection import select_trajectory_ids
from datapool.db import chunks
from datapool.errors import InvalidPoolRequestError
from datapool.models import Batch, BatchRow, Step, Trajectory
from datapool.rewards.group_stats import FloatArray, GroupStats, group_stats
from datapool.rewards.values import current_rewards, lineage_target
from datapool.steps.messages import expand_requests
from datapool.steps.store import PoolStore

Segment = list[StepTokens]  # the steps of one row, in order
T = TypeVar("T")

ROW_SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("position_ids", pa.list_(pa.int32())),
        ("prompt_tokens", pa.int32()),
        ("num_tokens", pa.int32()),
        ("num_loss_tokens", pa.int32()),
        ("group_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("segment_index", pa.int32()),
        ("lineage_id", pa.string()),
        ("lineage_rewards_json", pa.string()),
        ("step_ids", pa.list_(pa.string())),
        ("policy_version", pa.int32()),
        ("policy_version_spans", VERSION_SPANS),
        ("temperature", pa.float32()),
        ("sampling_json", pa.string()),
        ("reward", pa.float64()),
        ("step_reward", pa.float64()),
        ("rewards_json", pa.string()),
        ("advantage", pa.float64()),
        ("group_size", pa.int32()),
        ("scored_group_size", pa.int32()),
        ("group_reward_mean", pa.float64()),
        ("group_reward_std", pa.float64()),
        ("group_degenerate", pa.bool_()),
        ("step_rewards_json", pa.string()),
        ("process_reward", pa.float64()),
        ("step_return", pa.float64()),
        ("episode_advantage", pa.float64()),
        ("step_advantage", pa.float64()),
        ("anchor_key", pa.string()),
        ("anchor_group_size", pa.int32()),
    ]
)


# ---- 1. candidates ------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidates:
    """What the pool holds for a spec, read in one session."""

    trajectories: list[Trajectory]  # complete, in the spec's filters, oldest first
    steps: list[Step]  # theirs, by (trajectory, step_index, choice_index)
    verdicts: dict[str, Verdict]  # readiness per trajectory id
    ready_ids: set[str]
    tokens: dict[str, StepTokens | None]  # exact arrays of the ready trajectories' steps
    current_policy_version: int | None  # the staleness reference
    # {trajectory id: {lineage id: {name: value}}}: the ready trajectories' lineage rewards
    lineage_rewards: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)


def select_candidates(store: PoolStore, spec: BatchSpec, counts: Counter[str]) -> Candidates:
    """The complete trajectories that ``spec`` selects, with readiness and exact tokens.

    Counts ``already_batched`` (when ``exclude_batched``), ``candidates`` and ``ready``.
    """
    where = spec.filters.model_copy(update={"channel": spec.channel, "status": ["complete"]})
    with store.sessions() as session:
        ids = select_trajectory_ids(session, where)
        if spec.exclude_batched:
            batched = _already_batched(session, ids)
            counts["already_batched"] = len(batched)
            ids = [i for i in ids if i not in batched]
        trajectories = [
            t
            for chunk in chunks(ids)
            for t in session.scalars(select(Trajectory).where(Trajectory.id.in_(chunk)))
        ]
        trajectories.sort(key=lambda t: (t.created_at, t.id))
        steps = [
            s
            for chunk in chunks(ids)
            for s in session.scalars(
                select(Step)
                .where(Step.trajectory_id.in_(chunk))
                .order_by(Step.trajectory_id, Step.step_index, Step.choice_index)
            )
        ]
        verdicts = assess(
            session,
            trajectories,
            spec.reward_names,
            steps,
            required_step_rewards=spec.step_reward_names,
        )
        ready_ids = {t.id for t in trajectories if verdicts[t.id].ready}
        if spec.step_advantage == "anchor_state" and spec.anchor_key == "last_observation":
            expand_requests(session, [s for s in steps if s.trajectory_id in ready_ids])
        current_version = (
            spec.current_policy_version
            if spec.current_policy_version is not None
            else active_policy_version(session)
        )
        tokens = load_tokens(store, session, [s for s in steps if s.trajectory_id in ready_ids])
        targets = {
            lineage_target(s.trajectory_id, s.lineage_id)
            for s in steps
            if s.trajectory_id in ready_ids and s.lineage_id is not None
        }
        lineage_rewards: dict[str, dict[str, dict[str, float]]] = {}
        for target, values in current_rewards(session, "lineage", sorted(targets)).items():
            trajectory_id, lineage_id = target.split("/", 1)
            lineage_rewards.setdefault(trajectory_id, {})[lineage_id] = values
    counts["candidates"] = len(trajectories)
    counts["ready"] = len(ready_ids)
    return Candidates(
        trajectories, steps, verdicts, ready_ids, tokens, current_version, lineage_rewards
    )


def not_ready_reasons(candidates: Candidates) -> Counter[str]:
    """How many candidates are not ready, by the kind of their first reason
    (``"excluded by rule 'x': ..."`` counts as ``excluded by rule 'x'``)."""
    result: Counter[str] = Counter()
    for t in candidates.trajectories:
        for reason in candidates.verdicts[t.id].reasons[:1]:
            result[reason.split(":")[0].split(" (")[0]] += 1
    return result


def _already_batched(session: Session, ids: Sequence[str]) -> set[str]:
    found: set[str] = set()
    for chunk in chunks(list(ids)):
        found |= set(
            session.scalars(
                select(BatchRow.trajectory_id)
                .join(Batch, Batch.id == BatchRow.batch_id)
                .where(BatchRow.trajectory_id.in_(chunk), Batch.status != "failed")
                .distinct()
            )
        )
    return found


# ---- 2. trainable steps -------------------------------------------------------------------


def trainable_steps(
    candidates: Candidates, spec: BatchSpec, counts: Counter[str]
) -> dict[str, list[StepTokens]]:
    """Per ready trajectory id, its steps that may train, in step order.

    Counts the steps left out: ``excluded_steps`` (a rule or label), ``steps_without_exact_ids``
    (the engine did not report them) and ``stale_steps`` (see ``is_stale``).
    """
    result: dict[str, list[StepTokens]] = {}
    for step in candidates.steps:
        if step.trajectory_id not in candidates.ready_ids:
            continue
        if step.id in candidates.verdicts[step.trajectory_id].excluded_steps:
            counts["excluded_steps"] += 1
            continue
        arrays = candidates.tokens.get(step.id)
        if arrays is None:
            counts["steps_without_exact_ids"] += 1
            continue
        if is_stale(step.policy_version, spec, candidates.current_policy_version):
            counts["stale_steps"] += 1
            continue
        result.setdefault(step.trajectory_id, []).append(arrays)
    return result


def is_stale(policy_version: int | None, spec: BatchSpec, current_version: int | None) -> bool:
    """A step sampled by ``policy_version`` is stale when it is more than
    ``spec.max_staleness_versions`` behind ``current_version`` (never when any is unknown).

    Per step, by its oldest version: a step sampled across a kept full-weight update
    (``policy_version_spans``) is stamped with the version of its first token, the oldest of
    its spans, so the bound holds for every token of it. Per token would cut a response in
    the middle and train its tail on a context whose head was dropped."""
    return (
        spec.max_staleness_versions is not None
        and current_version is not None
        and policy_version is not None
        and policy_version < current_version - spec.max_staleness_versions
    )


# ---- 3. groups ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """One trajectory of the batch."""

    trajectory_id: str
    steps: list[StepTokens]  # trainable, in step order
    reward: float  # R = sum_i w_i r_i; NaN without reward names (sft)
    rewards: dict[str, float]  # every current trajectory reward, by name
    # {step id: {name: value}} of the spec's step_reward_names
    step_rewards: dict[str, dict[str, float]] = field(default_factory=dict)
    # {lineage id: {name: value}}: every current reward of its lineages (``lineage_rewards_json``)
    lineage_rewards: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Group:
    """Members scored together; ``group_id`` None is an ungrouped trajectory, alone."""

    group_id: str | None
    members: list[Member]


def form_groups(
    candidates: Candidates,
    trainable: Mapping[str, list[StepTokens]],
    spec: BatchSpec,
    counts: Counter[str],
) -> list[Group]:
    """The ready trajectories with trainable steps as members, grouped by group id in order of
    each group's oldest member; counts ``trajectories_without_trainable_steps``."""
    weights = spec.resolved_reward_weights()
    groups: dict[str, list[Member]] = {}
    for t in candidates.trajectories:
        if t.id not in candidates.ready_ids:
            continue
        steps = trainable.get(t.id)
        if not steps:
            counts["trajectories_without_trainable_steps"] += 1
            continue
        current = candidates.verdicts[t.id].rewards
        reward = sum(w * current[name] for name, w in weights.items()) if weights else math.nan
        key = t.group_id or f"\x00{t.id}"  # a key no group id has: the trajectory alone
        step_rewards = candidates.verdicts[t.id].step_rewards
        lineages = candidates.lineage_rewards.get(t.id, {})
        groups.setdefault(key, []).append(
            Member(t.id, steps, reward, current, step_rewards, lineages)
        )
    return [Group(None if key.startswith("\x00") else key, m) for key, m in groups.items()]


def keep_groups(
    groups: Sequence[Group], spec: BatchSpec, counts: Counter[str]
) -> tuple[list[Group], list[dict[str, Any]]]:
    """The groups the batch takes, in batch order, and a report of every group judged.

    Order: as given, or shuffled by ``shuffle_seed``. A group over ``group_size`` keeps its
    oldest members (``surplus_members_left``); one under it is dropped when ``short_groups`` is
    ``drop`` (``short_groups_dropped``). Each group is judged (``groups_<kind>``, C17); a
    group-relative algorithm drops degenerate groups (``degenerate_groups_dropped``, unless
    ``drop_degenerate_groups`` is false) and ungrouped trajectories
    (``ungrouped_trajectories_dropped``).
    """
    group_relative = needs_groups(spec)
    order = list(groups)
    if spec.shuffle_seed is not None:
        np.random.default_rng(spec.shuffle_seed).shuffle(order)
    kept: list[Group] = []
    report: list[dict[str, Any]] = []
    for group in order:
        if group.group_id is None:
            if group_relative:
                counts["ungrouped_trajectories_dropped"] += 1
                continue
            kept.append(group)
            continue
        members = group.members
        if spec.group_size is not None:
            if len(members) < spec.group_size and spec.short_groups == "drop":
                counts["short_groups_dropped"] += 1
                continue
            if len(members) > spec.group_size:
                counts["surplus_members_left"] += len(members) - spec.group_size
                members = members[: spec.group_size]
        verdict = judge_group(
            [m.reward for m in members], spec.degenerate_eps, spec.success_reward, spec.fail_reward
        )
        counts[f"groups_{verdict.kind}"] += 1
        report.append(_group_report(group.group_id, verdict))
        if verdict.degenerate and spec.drop_degenerate_groups and group_relative:
            counts["degenerate_groups_dropped"] += 1
            continue
        kept.append(Group(group.group_id, members))
    return kept, report


def needs_groups(spec: BatchSpec) -> bool:
    """Whether ``spec`` compares rollouts of one task: a group-relative algorithm, anchor
    grouping, or step rewards normalised within the group."""
    return (
        estimator(spec.algorithm).group_relative
        or spec.step_advantage == "anchor_state"
        or (spec.step_advantage == "step_returns" and spec.step_normalisation != "none")
    )


def _group_report(group_id: str, verdict: GroupVerdict) -> dict[str, Any]:
    return {
        "group_id": group_id,
        "members_in_batch": verdict.members,
        "scored_size": verdict.scored,
        # JSON has no NaN or inf (PostgreSQL refuses them): a std past the float range
        # (rewards near ±1.8e308) is null here, inf in the rows' group_reward_std.
        "mean": verdict.mean if math.isfinite(verdict.mean) else None,
        "std": verdict.std if math.isfinite(verdict.std) else None,
        "degenerate": verdict.degenerate,
        "kind": verdict.kind,
    }


# ---- 5. token budget ----------------------------------------------------------------------


def fit_token_budget(groups: Sequence[Group], spec: BatchSpec, counts: Counter[str]) -> list[Group]:
    """Whole groups, in order, while their row tokens fit ``max_tokens_per_batch``; the first
    group that does not fit ends the batch (``groups_over_batch_tokens`` counts it and the rest).
    """
    if spec.max_tokens_per_batch is None:
        return list(groups)
    budget = spec.max_tokens_per_batch
    fitted: list[Group] = []
    for group in groups:
        cost = sum(
            segment_tokens(seg)
            for m in group.members
            for seg in segments(m.steps, spec.layout, spec.max_tokens_per_row)[0]
        )
        if cost > budget:
            counts["groups_over_batch_tokens"] += len(groups) - len(fitted)
            break
        budget -= cost
        fitted.append(group)
    return fitted


# ---- 6. scores ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Scores:
    """The numbers of the batch's members ``[N]`` (in group order) and groups ``[G]``."""

    reward: FloatArray  # [N] float64: R of each member
    group_index: npt.NDArray[np.int64]  # [N]: the member's group, 0..G-1
    advantage: FloatArray  # [N] float64: the spec's estimator on reward
    stats: GroupStats  # [G] each: over the members in the batch
    group_size: npt.NDArray[np.int32]  # [G]: members in the pool, rewarded or not


def score(groups: Sequence[Group], spec: BatchSpec, pool_sizes: Mapping[str, int]) -> Scores:
    """Rewards, advantages and group statistics of ``groups``; ``pool_sizes`` is each group's
    member count in the pool (``pool_group_sizes``; ``scored_size`` counts the rewarded ones)."""
    reward = np.array([m.reward for g in groups for m in g.members], dtype=np.float64)  # [N]
    group_index = np.array(
        [i for i, g in enumerate(groups) for _m in g.members], dtype=np.int64
    )  # [N]
    advantage = estimate_advantages(
        spec.algorithm, reward, group_index, scale_by_std=spec.scale_by_std, eps=spec.advantage_eps
    )  # [N]
    stats = group_stats(reward, group_index, degenerate_eps=spec.degenerate_eps)  # [G] each
    sizes = np.array(
        [pool_sizes.get(g.group_id or "", len(g.members)) for g in groups], dtype=np.int32
    )  # [G]; an ungrouped trajectory is a group of its one member
    return Scores(reward, group_index, advantage, stats, sizes)


def pool_group_sizes(store: PoolStore, group_ids: Sequence[str]) -> dict[str, int]:
    """Members of each group in the pool (any status, rewarded or not)."""
    result: dict[str, int] = {}
    with store.sessions() as session:
        for chunk in chunks(list(group_ids)):
            for group_id, n in session.execute(
                select(Trajectory.group_id, func.count())
                .where(Trajectory.group_id.in_(chunk))
                .group_by(Trajectory.group_id)
            ):
                result[str(group_id)] = int(n)
    return result


# ---- 7. reward placement ------------------------------------------------------------------


@dataclass(frozen=True)
class RowPlan:
    """The batch's rows ``[B]``, before the token columns: each one's steps, the member it
    belongs to (index into the members ``[N]``), its share of ``R`` and ``A``, and which row of
    its trajectory it is."""

    segments: list[Segment]
    member: list[int]
    share: list[float]
    segment_index: list[int]


def place_rewards(members: Sequence[Member], spec: BatchSpec, counts: Counter[str]) -> RowPlan:
    """Cut each member's steps into rows (``rows.segments``, by layout and row cap; a step over
    the cap is dropped and counted in ``steps_over_row_tokens``) and give each row its share
    (``reward_shares``)."""
    plan = RowPlan([], [], [], [])
    for n, member in enumerate(members):
        cut, too_long = segments(member.steps, spec.layout, spec.max_tokens_per_row)
        counts["steps_over_row_tokens"] += too_long
        for k, (segment, share) in enumerate(reward_shares(cut, spec.reward_to_steps, spec.gamma)):
            plan.segments.append(segment)
            plan.member.append(n)
            plan.share.append(share)
            plan.segment_index.append(k)
    return plan


def reward_shares(rows: Sequence[T], reward_to_steps: str, gamma: float) -> list[tuple[T, float]]:
    """Which of one trajectory's ``rows`` ``[S]`` (in order) carry its reward, and each one's
    factor on ``R`` and ``A``: ``broadcast`` every row, 1; ``final_step`` the last row alone, 1;
    ``discounted`` row k, ``gamma^(S-1-k)`` (the discounted return of a final-only reward).

    Raises ``InvalidPoolRequestError`` for any other ``reward_to_steps``.
    """
    if reward_to_steps == "broadcast":
        return [(row, 1.0) for row in rows]
    if reward_to_steps == "final_step":
        return [(row, 1.0) for row in rows[-1:]]
    if reward_to_steps == "discounted":
        unit = np.zeros(len(rows), dtype=np.float64)  # [S]: a reward of 1 on the last row
        if len(rows):
            unit[-1] = 1.0
        return list(zip(rows, discounted_returns(unit, gamma).tolist(), strict=True))
    raise InvalidPoolRequestError(
        f"reward_to_steps must be one of {REWARD_TO_STEPS}, got {reward_to_steps!r}"
    )


# ---- 8. row order --------------------------------------------------------------------------


def shuffle_rows(plan: RowPlan, seed: int | None) -> RowPlan:
    """``plan`` in a reproducible random row order (``seed``), or as it is for None."""
    if seed is None:
        return plan
    b = np.random.default_rng(seed).permutation(len(plan.segments))  # [B]
    return RowPlan(
        [plan.segments[i] for i in b],
        [plan.member[i] for i in b],
        [plan.share[i] for i in b],
        [plan.segment_index[i] for i in b],
    )


# ---- 9. step credit ------------------------------------------------------------------------


def credit_steps(
    plan: RowPlan,
    groups: Sequence[Group],
    members: Sequence[Member],
    scores: Scores,
    spec: BatchSpec,
) -> StepScores:
    """Step credit of the rows of ``plan`` (``step_credit.credit_rows``): each row's step, its
    trajectory, position, group, outcome ``R`` and named step rewards."""
    member = np.asarray(plan.member, dtype=np.int64)  # [B]
    group = scores.group_index[member]  # [B]
    return credit_rows(
        [seg[-1] for seg in plan.segments],
        member,
        np.asarray(plan.segment_index, dtype=np.int64),
        group,
        scores.reward[member],
        [
            members[n].step_rewards.get(seg[-1].row.id, {})
            for seg, n in zip(plan.segments, plan.member, strict=True)
        ],
        [groups[g].group_id for g in group.tolist()],
        [members[n].trajectory_id for n in plan.member],
        spec,
    )


# ---- 10. rows -------------------------------------------------------------------------------


def assemble_table(
    plan: RowPlan,
    groups: Sequence[Group],
    members: Sequence[Member],
    scores: Scores,
    steps: StepScores,
    spec: BatchSpec,
) -> pa.Table:
    """The rows of ``plan`` as a table in ``ROW_SCHEMA``: token columns from the stored arrays
    (``rows.assemble``), per row its member's and group's numbers times the row's share, and its
    step credit (``steps``); ``advantage`` combines them by the spec's weights."""
    columns = assemble(plan.segments)
    member = np.asarray(plan.member, dtype=np.int64)  # [B]
    share = np.asarray(plan.share, dtype=np.float64)  # [B]
    group = scores.group_index[member]  # [B]
    group_names = [g.group_id for g in groups]  # [G]
    episode = scores.advantage[member] * share  # [B]
    advantage = (
        episode
        if spec.step_advantage == "none"
        else spec.episode_advantage_weight * episode
        + spec.step_advantage_weight * steps.step_advantage
    )  # [B]
    return pa.table(
        {
            "input_ids": columns.input_ids,
            "loss_mask": columns.loss_mask,
            "behaviour_logprobs": columns.behaviour_logprobs,
            "position_ids": columns.position_ids,
            "prompt_tokens": columns.prompt_tokens,
            "num_tokens": columns.num_tokens,
            "num_loss_tokens": columns.num_loss_tokens,
            "group_id": [group_names[g] for g in group],
            "trajectory_id": [members[n].trajectory_id for n in member],
            "segment_index": np.asarray(plan.segment_index, dtype=np.int32),
            # A row never crosses lineages: its steps hang on each other (``rows.segments``).
            "lineage_id": [seg[0].row.lineage_id for seg in plan.segments],
            "lineage_rewards_json": [
                json.dumps(members[n].lineage_rewards.get(seg[0].row.lineage_id or "", {}))
                for seg, n in zip(plan.segments, plan.member, strict=True)
            ],
            "step_ids": columns.step_ids,
            "policy_version": pa.array([oldest_version(seg) for seg in plan.segments], pa.int32()),
            "policy_version_spans": columns.policy_version_spans,
            "temperature": columns.temperature,
            "sampling_json": [json.dumps([s.row.sampling for s in seg]) for seg in plan.segments],
            "reward": scores.reward[member],
            "step_reward": scores.reward[member] * share,
            "rewards_json": [json.dumps(members[n].rewards) for n in member],
            "advantage": advantage,
            "group_size": scores.group_size[group],
            "scored_group_size": scores.stats.scored_size.astype(np.int32)[group],
            "group_reward_mean": scores.stats.mean[group],
            "group_reward_std": scores.stats.std[group],
            "group_degenerate": scores.stats.degenerate[group],
            "step_rewards_json": steps.step_rewards_json,
            "process_reward": steps.process_reward,
            "step_return": steps.step_return,
            "episode_advantage": episode,
            "step_advantage": steps.step_advantage,
            "anchor_key": steps.anchor_key,
            "anchor_group_size": steps.anchor_group_size,
        },
        schema=ROW_SCHEMA,
    )


def oldest_version(segment: Sequence[StepTokens]) -> int | None:
    """The oldest policy version among a row's steps (None when none is known)."""
    versions = [s.row.policy_version for s in segment if s.row.policy_version is not None]
    return min(versions) if versions else None
