"""Batch specs and materialisation: from ready trajectories to an immutable batch of rows.

Owns: ``BatchSpec`` (what a batch is made of), ``materialise`` (select ready data, compute
rewards and advantages, assemble rows, write Parquet + manifest, record lineage in
``batch_rows``), reading batches back, and the lineage of a step. Never: changes a batch once it
is ``ready``; never lets an unrewarded trajectory's reward become 0 (NaN stays NaN, and
unrewarded trajectories are not ready); never puts an integrity-flagged or excluded step in a
row, or crosses a prefix break (``datapool.batches.rows``).

Shape legend: ``B`` rows, ``N`` trajectories in the batch, ``G`` groups.

Rewards reach rows as follows. A trajectory's reward ``R`` is ``sum_i w_i r_i`` over the spec's
``reward_names`` (weights default 1). The estimator (``datapool.batches.advantages``) runs on the
trajectories' ``R`` ``[N]``: ``grpo`` (group mean/std, Dr. GRPO with ``scale_by_std=false``),
``rloo`` (leave-one-out within the group), ``reinforce_pp`` (the batch's mean/std), ``ppo``
(no advantage: NaN, the trainer's critic computes it from ``step_reward``), ``sft`` (advantage
1.0: a plain likelihood weight). ``reward_to_steps`` then decides what each step row gets:
``broadcast`` (every row: ``R`` and ``A``), ``final_step`` (only the trajectory's last trainable
step has a row), ``discounted`` (the k-th of S trainable steps gets ``gamma^(S-1-k)`` times ``R``
and ``A``; per_step only). A ``merged`` row holds several steps and one advantage, so merged
needs ``broadcast``.
"""

from __future__ import annotations

import json
import math
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from datapool.batches.rows import StepTokens, assemble, load_tokens, segment_tokens, segments
from datapool.batches.settings import BatchSettings
from datapool.curation.readiness import assess
from datapool.curation.rules import active_policy_version, apply_rules, judge_group
from datapool.curation.selection import TrajectoryFilter, select_trajectory_ids
from datapool.db import chunks
from datapool.errors import InvalidPoolRequestError, UnknownTargetError
from datapool.models import (
    Batch,
    BatchConsumption,
    BatchRow,
    CurationRule,
    Step,
    Trajectory,
    utc_now,
)
from datapool.steps.store import PoolStore

if TYPE_CHECKING:
    import torch

Algorithm = Literal["grpo", "rloo", "reinforce_pp", "ppo", "sft"]
ALGORITHMS: tuple[str, ...] = ("grpo", "rloo", "reinforce_pp", "ppo", "sft")
Layout = Literal["per_step", "merged"]
RewardToSteps = Literal["final_step", "broadcast", "discounted"]
ShortGroups = Literal["drop", "keep"]
GROUP_ALGORITHMS = ("grpo", "rloo")

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
        ("step_ids", pa.list_(pa.string())),
        ("policy_version", pa.int32()),
        ("reward", pa.float64()),
        ("step_reward", pa.float64()),
        ("rewards_json", pa.string()),
        ("advantage", pa.float64()),
        ("group_size", pa.int32()),
        ("scored_group_size", pa.int32()),
        ("group_reward_mean", pa.float64()),
        ("group_reward_std", pa.float64()),
        ("group_degenerate", pa.bool_()),
    ]
)


class NothingToBatchError(InvalidPoolRequestError):
    """No ready data matches the spec (the message carries the counts of why)."""


class BatchSpec(BaseModel):
    """What a batch is made of; stored with the batch and in its manifest."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=200)
    channel: str = "train"
    filters: TrajectoryFilter = Field(default_factory=TrajectoryFilter)
    algorithm: Algorithm = "grpo"
    layout: Layout = "per_step"
    group_size: int | None = Field(
        default=None, ge=1, description="Members per group (the oldest ready ones are taken)."
    )
    short_groups: ShortGroups = Field(
        default="drop", description="A group with fewer ready members than group_size."
    )
    drop_degenerate_groups: bool = Field(
        default=True, description="grpo/rloo: drop groups whose reward std < degenerate_eps."
    )
    degenerate_eps: float = Field(default=1e-6, ge=0)
    success_reward: float = Field(default=1.0, description="all-success: every reward >= this.")
    fail_reward: float = Field(default=0.0, description="all-fail: every reward <= this.")
    reward_names: list[str] = Field(default_factory=lambda: ["final"])
    reward_weights: dict[str, float] = Field(default_factory=dict)
    reward_to_steps: RewardToSteps = "broadcast"
    gamma: float = Field(default=1.0, ge=0, le=1)
    scale_by_std: bool = True
    advantage_eps: float = Field(default=1e-6, gt=0)
    max_tokens_per_row: int | None = Field(default=None, ge=1)
    max_tokens_per_batch: int | None = Field(default=None, ge=1)
    max_staleness_versions: int | None = Field(default=None, ge=0)
    current_policy_version: int | None = Field(
        default=None, description="Staleness reference; default the active policy version."
    )
    shuffle_seed: int | None = None
    exclude_batched: bool = Field(
        default=True, description="Skip trajectories already in a batch (not failed)."
    )
    apply_rules: bool = Field(default=True, description="Re-apply curation rules first.")

    @model_validator(mode="after")
    def _combinations(self) -> BatchSpec:
        if self.layout == "merged" and self.reward_to_steps != "broadcast":
            raise ValueError(
                f"layout 'merged' packs several steps into a row with one advantage, so "
                f"reward_to_steps must be 'broadcast', got {self.reward_to_steps!r}; use layout "
                "'per_step' for final_step or discounted"
            )
        if self.algorithm != "sft" and not self.reward_names:
            raise ValueError(
                f"algorithm {self.algorithm!r} needs at least one reward name in reward_names"
            )
        unknown = set(self.reward_weights) - set(self.reward_names)
        if unknown:
            raise ValueError(f"reward_weights names {sorted(unknown)} not in reward_names")
        return self


def estimate_advantages(
    algorithm: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages ``[N]`` of trajectory rewards ``[N]`` (NaN = unrewarded stays NaN)."""
    import torch

    from datapool.batches.advantages import (
        grpo_advantages,
        reinforce_pp_advantages,
        rloo_advantages,
    )

    if algorithm == "grpo":
        return grpo_advantages(rewards, group_ids, scale_by_std=scale_by_std, eps=eps)
    if algorithm == "rloo":
        return rloo_advantages(rewards, group_ids)
    if algorithm == "reinforce_pp":
        return reinforce_pp_advantages(rewards, eps=eps)
    if algorithm == "ppo":
        return torch.full_like(rewards, float("nan"))
    if algorithm == "sft":
        return torch.ones_like(rewards)
    raise InvalidPoolRequestError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")


@dataclass
class _Member:
    trajectory: Trajectory
    steps: list[StepTokens]
    reward: float
    rewards: dict[str, float]


def _reason_kind(reason: str) -> str:
    return reason.split(":")[0].split(" (")[0]


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


def build_rows(store: PoolStore, spec: BatchSpec) -> tuple[pa.Table, dict[str, Any]]:
    """Select, score and assemble the rows of ``spec``; returns ``(rows, manifest counts)``.

    Raises ``NothingToBatchError`` when nothing is ready.
    """
    import torch  # lazily: the gateway imports this module, torch costs seconds to import

    from datapool.batches.advantages import discounted_returns, group_stats

    counts: Counter[str] = Counter()
    not_ready: Counter[str] = Counter()
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
        step_rows = [
            s
            for chunk in chunks(ids)
            for s in session.scalars(
                select(Step)
                .where(Step.trajectory_id.in_(chunk))
                .order_by(Step.trajectory_id, Step.step_index, Step.choice_index)
            )
        ]
        verdicts = assess(session, trajectories, spec.reward_names, step_rows)
        ready_ids = {t.id for t in trajectories if verdicts[t.id].ready}
        for t in trajectories:
            for reason in verdicts[t.id].reasons[:1]:
                not_ready[_reason_kind(reason)] += 1
        current_version = (
            spec.current_policy_version
            if spec.current_policy_version is not None
            else active_policy_version(session)
        )
        tokens = load_tokens(store, session, [s for s in step_rows if s.trajectory_id in ready_ids])
    counts["candidates"] = len(trajectories)
    counts["ready"] = len(ready_ids)
    by_trajectory: dict[str, list[StepTokens]] = defaultdict(list)
    for step in step_rows:
        if step.trajectory_id not in ready_ids:
            continue
        if step.id in verdicts[step.trajectory_id].excluded_steps:
            counts["excluded_steps"] += 1
            continue
        arrays = tokens.get(step.id)
        if arrays is None:
            counts["steps_without_exact_ids"] += 1
            continue
        if (
            spec.max_staleness_versions is not None
            and current_version is not None
            and step.policy_version is not None
            and step.policy_version < current_version - spec.max_staleness_versions
        ):
            counts["stale_steps"] += 1
            continue
        by_trajectory[step.trajectory_id].append(arrays)

    weights = {name: spec.reward_weights.get(name, 1.0) for name in spec.reward_names}
    groups: dict[str, list[_Member]] = defaultdict(list)
    for t in trajectories:
        if t.id not in ready_ids:
            continue
        if not by_trajectory.get(t.id):
            counts["trajectories_without_trainable_steps"] += 1
            continue
        current = verdicts[t.id].rewards
        reward = sum(w * current[name] for name, w in weights.items()) if weights else math.nan
        groups[t.group_id or f"\x00{t.id}"].append(_Member(t, by_trajectory[t.id], reward, current))

    order = list(groups)
    if spec.shuffle_seed is not None:
        np.random.default_rng(spec.shuffle_seed).shuffle(order)
    kept: list[tuple[str, list[_Member]]] = []
    group_report: list[dict[str, Any]] = []
    for key in order:
        members = groups[key]
        group_id = None if key.startswith("\x00") else key
        if spec.group_size is not None and group_id is not None:
            if len(members) < spec.group_size and spec.short_groups == "drop":
                counts["short_groups_dropped"] += 1
                continue
            if len(members) > spec.group_size:
                counts["surplus_members_left"] += len(members) - spec.group_size
                members = members[: spec.group_size]
        verdict = judge_group(
            [m.reward for m in members], spec.degenerate_eps, spec.success_reward, spec.fail_reward
        )
        if group_id is not None:
            counts[f"groups_{verdict.kind}"] += 1
            group_report.append(
                {
                    "group_id": group_id,
                    "members_in_batch": verdict.members,
                    "scored_size": verdict.scored,
                    "mean": None if math.isnan(verdict.mean) else verdict.mean,
                    "std": None if math.isnan(verdict.std) else verdict.std,
                    "degenerate": verdict.degenerate,
                    "kind": verdict.kind,
                }
            )
            if (
                verdict.degenerate
                and spec.drop_degenerate_groups
                and spec.algorithm in GROUP_ALGORITHMS
            ):
                counts["degenerate_groups_dropped"] += 1
                continue
        elif spec.algorithm in GROUP_ALGORITHMS:
            counts["ungrouped_trajectories_dropped"] += 1
            continue
        kept.append((key, members))

    if spec.max_tokens_per_batch is not None:
        budget = spec.max_tokens_per_batch
        fitted: list[tuple[str, list[_Member]]] = []
        for key, members in kept:
            cost = sum(
                segment_tokens(seg)
                for m in members
                for seg in segments(m.steps, spec.layout, spec.max_tokens_per_row)[0]
            )
            if cost > budget:
                counts["groups_over_batch_tokens"] += len(kept) - len(fitted)
                break
            budget -= cost
            fitted.append((key, members))
        kept = fitted

    members_flat = [m for _key, members in kept for m in members]
    if not members_flat:
        raise NothingToBatchError(
            f"no ready data for this spec: {dict(counts)}; not ready: {dict(not_ready)}"
        )
    group_index = {key: i for i, (key, _m) in enumerate(kept)}
    pool_members = _group_members(store, [k for k, _m in kept if not k.startswith("\x00")])
    rewards_n = torch.tensor([m.reward for m in members_flat], dtype=torch.float64)  # [N]
    gids_n = torch.tensor(
        [group_index[key] for key, members in kept for _m in members], dtype=torch.long
    )  # [N]
    advantages_n = estimate_advantages(
        spec.algorithm, rewards_n, gids_n, scale_by_std=spec.scale_by_std, eps=spec.advantage_eps
    )  # [N]
    stats = group_stats(rewards_n, gids_n, degenerate_eps=spec.degenerate_eps)  # [G] each
    sizes = np.array(
        [pool_members.get(key, len(members)) for key, members in kept], dtype=np.int32
    )  # [G]: members in the pool (rewarded or not); scored_size counts the rewarded ones

    row_segments: list[list[StepTokens]] = []
    member_of_row: list[int] = []
    factor_of_row: list[float] = []
    segment_of_row: list[int] = []
    for n, member in enumerate(members_flat):
        cut, too_long = segments(member.steps, spec.layout, spec.max_tokens_per_row)
        counts["steps_over_row_tokens"] += too_long
        if spec.reward_to_steps == "final_step":
            cut = cut[-1:]
            factors = [1.0] * len(cut)
        elif spec.reward_to_steps == "discounted":
            unit = torch.zeros(len(cut), dtype=torch.float64)  # [S]
            if len(cut):
                unit[-1] = 1.0
            factors = discounted_returns(unit, spec.gamma).tolist()  # gamma^(S-1-k)
        elif spec.reward_to_steps == "broadcast":
            factors = [1.0] * len(cut)
        else:
            raise InvalidPoolRequestError(
                "reward_to_steps must be one of ('final_step', 'broadcast', 'discounted'), "
                f"got {spec.reward_to_steps!r}"
            )
        for k, seg in enumerate(cut):
            row_segments.append(seg)
            member_of_row.append(n)
            factor_of_row.append(factors[k])
            segment_of_row.append(k)
    if not row_segments:
        raise NothingToBatchError(f"every step was dropped: {dict(counts)}")

    b = np.arange(len(row_segments))
    if spec.shuffle_seed is not None:
        b = np.random.default_rng(spec.shuffle_seed).permutation(len(row_segments))
    row_segments = [row_segments[i] for i in b]
    member_idx = np.asarray(member_of_row)[b]  # [B]
    factor = np.asarray(factor_of_row, dtype=np.float64)[b]  # [B]
    columns = assemble(row_segments)
    reward_n = rewards_n.numpy()
    advantage_n = advantages_n.numpy()
    gid_b = gids_n.numpy()[member_idx]  # [B]
    group_names = [None if k.startswith("\x00") else k for k, _m in kept]
    table = pa.table(
        {
            "input_ids": columns.input_ids,
            "loss_mask": columns.loss_mask,
            "behaviour_logprobs": columns.behaviour_logprobs,
            "position_ids": columns.position_ids,
            "prompt_tokens": columns.prompt_tokens,
            "num_tokens": columns.num_tokens,
            "num_loss_tokens": columns.num_loss_tokens,
            "group_id": [group_names[g] for g in gid_b],
            "trajectory_id": [members_flat[n].trajectory.id for n in member_idx],
            "segment_index": np.asarray(segment_of_row, dtype=np.int32)[b],
            "step_ids": columns.step_ids,
            "policy_version": pa.array([_oldest_version(seg) for seg in row_segments], pa.int32()),
            "reward": reward_n[member_idx],
            "step_reward": reward_n[member_idx] * factor,
            "rewards_json": [json.dumps(members_flat[n].rewards) for n in member_idx],
            "advantage": advantage_n[member_idx] * factor,
            "group_size": sizes[gid_b],
            "scored_group_size": stats.scored_size.numpy().astype(np.int32)[gid_b],
            "group_reward_mean": stats.mean.numpy()[gid_b],
            "group_reward_std": stats.std.numpy()[gid_b],
            "group_degenerate": stats.degenerate.numpy()[gid_b],
        },
        schema=ROW_SCHEMA,
    )
    counts.update(
        {
            "rows": table.num_rows,
            "tokens": int(columns.num_tokens.sum()),
            "loss_tokens": int(columns.num_loss_tokens.sum()),
            "trajectories": len(members_flat),
            "groups": sum(1 for g in group_names if g is not None),
            "steps": sum(len(seg) for seg in row_segments),
        }
    )
    versions = Counter(s.row.policy_version for seg in row_segments for s in seg)
    manifest = {
        "counts": dict(counts),
        "not_ready": dict(not_ready),
        "groups": group_report,
        "current_policy_version": current_version,
        "policy_versions": {str(k): v for k, v in sorted(versions.items(), key=str)},
        "trajectory_ids": [m.trajectory.id for m in members_flat],
    }
    return table, manifest


def _group_members(store: PoolStore, group_ids: Sequence[str]) -> dict[str, int]:
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


def _oldest_version(segment: Sequence[StepTokens]) -> int | None:
    versions = [s.row.policy_version for s in segment if s.row.policy_version is not None]
    return min(versions) if versions else None


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


def materialise(store: PoolStore, spec: BatchSpec, settings: BatchSettings | None = None) -> Batch:
    """Build ``spec`` into a new immutable batch (status ``ready``): Parquet rows and a manifest
    under the batch URI, the batch and its ``batch_rows`` in one transaction."""
    settings = settings or BatchSettings()
    if spec.apply_rules:
        with store.sessions() as session:
            has_rules = session.scalar(select(CurationRule.id).limit(1)) is not None
        if has_rules:
            with store.sessions() as session:
                scope = select_trajectory_ids(
                    session, spec.filters.model_copy(update={"channel": spec.channel})
                )
            apply_rules(store, trajectory_ids=scope)
    table, manifest = build_rows(store, spec)
    batch_id = str(uuid.uuid4())
    root = settings.resolved_batch_uri(Path(store.settings.data_dir))
    uri = f"{root}/{batch_id}/rows.parquet"
    created_at = utc_now()
    manifest = {
        "batch_id": batch_id,
        "created_at": created_at.isoformat(),
        "spec": spec.model_dump(mode="json"),
        **manifest,
        "files": [uri],
    }
    fs, path = _filesystem(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as sink:
        pq.write_table(table, sink, compression="zstd")
    with fs.open_output_stream(path.rsplit("/", 1)[0] + "/manifest.json") as sink:
        sink.write(json.dumps(manifest, indent=1).encode())
    lineage = [
        {"batch_id": batch_id, "row_index": i, "step_id": step_id, "trajectory_id": trajectory_id}
        for i, (step_ids, trajectory_id) in enumerate(
            zip(table["step_ids"].to_pylist(), table["trajectory_id"].to_pylist(), strict=True)
        )
        for step_id in step_ids
    ]
    with store.sessions.begin() as session:
        batch = Batch(
            id=batch_id,
            name=spec.name,
            status="ready",
            spec=spec.model_dump(mode="json"),
            manifest=manifest,
            uri=uri,
            rows=table.num_rows,
            tokens=int(manifest["counts"]["tokens"]),
            leases=0,
            expired_leases=0,
            created_at=created_at,
        )
        session.add(batch)
        session.flush()
        for start in range(0, len(lineage), 5000):
            session.execute(insert(BatchRow), lineage[start : start + 5000])
    return batch


def get_batch(store: PoolStore, batch_id: str) -> Batch:
    with store.sessions() as session:
        batch = session.get(Batch, batch_id)
    if batch is None:
        raise UnknownTargetError(f"no batch {batch_id!r}", param="batch_id")
    return batch


def list_batches(store: PoolStore, status: str | None = None, limit: int = 100) -> list[Batch]:
    query = select(Batch).order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)
    if status is not None:
        query = query.where(Batch.status == status)
    with store.sessions() as session:
        return list(session.scalars(query))


def consumptions(store: PoolStore, batch_id: str) -> list[BatchConsumption]:
    with store.sessions() as session:
        return list(
            session.scalars(
                select(BatchConsumption)
                .where(BatchConsumption.batch_id == batch_id)
                .order_by(BatchConsumption.acked_at)
            )
        )


def read_rows(batch: Batch) -> pa.Table:
    """The batch's rows (Parquet at its URI)."""
    if batch.uri is None or batch.status in ("building", "failed"):
        raise InvalidPoolRequestError(f"batch {batch.id} is {batch.status}; it has no rows")
    fs, path = _filesystem(batch.uri)
    return pq.read_table(path, filesystem=fs)


def step_lineage(store: PoolStore, step_id: str) -> list[dict[str, Any]]:
    """The batches holding ``step_id`` and, per consumer that acked, the policy version trained."""
    with store.sessions() as session:
        if session.get(Step, step_id) is None:
            raise UnknownTargetError(f"no step {step_id!r}", param="step_id")
        rows = session.execute(
            select(Batch.id, Batch.name, Batch.created_at, BatchRow.row_index)
            .join(BatchRow, BatchRow.batch_id == Batch.id)
            .where(BatchRow.step_id == step_id)
            .order_by(Batch.created_at)
        ).all()
        result = []
        for batch_id, name, created_at, row_index in rows:
            acks = session.execute(
                select(BatchConsumption.consumer, BatchConsumption.policy_version_trained)
                .where(BatchConsumption.batch_id == batch_id)
                .order_by(BatchConsumption.acked_at)
            ).all()
            result.append(
                {
                    "batch_id": batch_id,
                    "name": name,
                    "created_at": created_at,
                    "row_index": row_index,
                    "trained": [{"consumer": c, "policy_version_trained": v} for c, v in acks],
                }
            )
    return result
