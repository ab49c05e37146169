"""Building batches: from a spec to an immutable batch of rows, and reading batches back.

Owns: ``build_rows`` (the stages of ``datapool.batches.stages``, run in order),
``materialise`` (write the rows as Parquet + manifest, record the batch and the lineage of
every row in ``batch_rows`` in one transaction, and claim the trajectories of an exclusive
batch in ``batch_claims`` in that same transaction), reading batches back, and the lineage of a
step. Never: changes a batch once it is ``ready``. What a batch is made of is
``datapool.batches.spec.BatchSpec``; how rewards become advantages is
``datapool.batches.advantages``.

This module is the public face of batch building: ``__all__`` names what callers use.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Literal, get_args

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from datapool.batches import stages
from datapool.batches.settings import BatchSettings
from datapool.batches.spec import BatchSpec
from datapool.curation.rules import apply_rules
from datapool.curation.selection import select_trajectory_ids
from datapool.errors import InvalidPoolRequestError, UnknownTargetError
from datapool.models import (
    Batch,
    BatchClaim,
    BatchConsumption,
    BatchRow,
    CurationRule,
    Step,
    utc_now,
)
from datapool.steps.store import PoolStore

__all__ = [
    "BatchSpec",
    "NothingToBatchError",
    "build_rows",
    "consumptions",
    "get_batch",
    "list_batches",
    "materialise",
    "read_rows",
    "step_lineage",
]


# How many times a build whose trajectories a concurrent batch claimed first is built again
# without them (each retry sees the winners' batches and excludes their trajectories).
CLAIM_ATTEMPTS = 8
SQL_ROWS_PER_INSERT = 5000


class NothingToBatchError(InvalidPoolRequestError):
    """No ready data matches the spec (the message carries the counts of why)."""


def build_rows(store: PoolStore, spec: BatchSpec) -> tuple[pa.Table, dict[str, Any]]:
    """Select, score and assemble the rows of ``spec``; returns ``(rows, manifest facts)``: the
    counts of what each stage kept and dropped, not-ready reasons, per-group statistics, the
    staleness reference, policy versions and trajectory ids.

    Raises ``NothingToBatchError`` when nothing is ready, or every step was dropped.
    """
    counts: Counter[str] = Counter()
    candidates = stages.select_candidates(store, spec, counts)
    not_ready = stages.not_ready_reasons(candidates)
    trainable = stages.trainable_steps(candidates, spec, counts)
    groups = stages.form_groups(candidates, trainable, spec, counts)
    groups, group_report = stages.keep_groups(groups, spec, counts)
    groups = stages.fit_token_budget(groups, spec, counts)
    members = [m for g in groups for m in g.members]  # [N]
    if not members:
        raise NothingToBatchError(
            f"no ready data for this spec: {dict(counts)}; not ready: {dict(not_ready)}"
        )
    pool_sizes = stages.pool_group_sizes(store, [g.group_id for g in groups if g.group_id])
    scores = stages.score(groups, spec, pool_sizes)
    plan = stages.place_rewards(members, spec, counts)
    if not plan.segments:
        raise NothingToBatchError(f"every step was dropped: {dict(counts)}")
    plan = stages.shuffle_rows(plan, spec.shuffle_seed)
    steps = stages.credit_steps(plan, groups, members, scores, spec)
    table = stages.assemble_table(plan, groups, members, scores, steps, spec)
    counts.update(
        {
            "rows": table.num_rows,
            "tokens": int(table["num_tokens"].to_numpy().sum()),
            "loss_tokens": int(table["num_loss_tokens"].to_numpy().sum()),
            "trajectories": len(members),
            "groups": sum(1 for g in groups if g.group_id is not None),
            "steps": sum(len(seg) for seg in plan.segments),
        }
    )
    if "anchor" in steps.report:
        counts["anchored_steps"] = steps.report["anchor"]["steps_in_subgroups"]
    versions = Counter(s.row.policy_version for seg in plan.segments for s in seg)
    manifest = {
        "counts": dict(counts),
        "not_ready": dict(not_ready),
        "groups": group_report,
        "current_policy_version": candidates.current_policy_version,
        "policy_versions": {str(k): v for k, v in sorted(versions.items(), key=str)},
        "trajectory_ids": [m.trajectory_id for m in members],
        "step_credit": steps.report,
    }
    return table, manifest


def materialise(store: PoolStore, spec: BatchSpec, settings: BatchSettings | None = None) -> Batch:
    """Build ``spec`` into a new immutable batch (status ``ready``): Parquet rows and a manifest
    under the batch URI, the batch and its ``batch_rows`` in one transaction.

    With ``exclude_batched`` (the default) the batch also claims its trajectories in that
    transaction (``batch_claims``): builds running at once, in any gateway processes, never put
    one trajectory in two such batches. A build that loses a claim is built again without the
    trajectories the winner took, so it gets only episodes not yet batched, or raises
    ``NothingToBatchError`` when none are left (also after ``CLAIM_ATTEMPTS`` lost claims).
    """
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
    for _attempt in range(CLAIM_ATTEMPTS):
        table, manifest = build_rows(store, spec)
        try:
            return _record(store, spec, settings, table, manifest)
        except _ClaimTakenError:
            continue  # a concurrent batch took some of them first: build again without those
    raise NothingToBatchError(
        f"concurrent batches took trajectories this spec chose on each of {CLAIM_ATTEMPTS} "
        "attempts; ask again"
    )


def _record(
    store: PoolStore, spec: BatchSpec, settings: BatchSettings, table: pa.Table, manifest: Any
) -> Batch:
    """Write ``table`` and its manifest under a new batch URI, then record the batch, its claims
    (when ``spec.exclude_batched``) and its lineage in one transaction.

    Raises ``_ClaimTakenError`` (files removed, nothing recorded) when another batch claimed one
    of the table's trajectories since ``build_rows`` read the pool.
    """
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
    directory = path.rsplit("/", 1)[0]
    fs.create_dir(directory, recursive=True)
    with fs.open_output_stream(path) as sink:
        pq.write_table(table, sink, compression="zstd")
    with fs.open_output_stream(directory + "/manifest.json") as sink:
        sink.write(json.dumps(manifest, indent=1).encode())
    trajectory_ids = table["trajectory_id"].to_pylist()
    lineage = [
        {"batch_id": batch_id, "row_index": i, "step_id": step_id, "trajectory_id": trajectory_id}
        for i, (step_ids, trajectory_id) in enumerate(
            zip(table["step_ids"].to_pylist(), trajectory_ids, strict=True)
        )
        for step_id in step_ids
    ]
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
    try:
        with store.sessions.begin() as session:
            session.add(batch)
            session.flush()
            if spec.exclude_batched:
                # what the pre-check reads back: the trajectories of the lineage rows
                _claim(session, batch_id, [row["trajectory_id"] for row in lineage])
            for start in range(0, len(lineage), SQL_ROWS_PER_INSERT):
                session.execute(insert(BatchRow), lineage[start : start + SQL_ROWS_PER_INSERT])
    except _ClaimTakenError:
        fs.delete_dir(directory)
        raise
    return batch


class _ClaimTakenError(Exception):
    """Another batch claimed one of the trajectories first (its transaction committed)."""


def _claim(session: Session, batch_id: str, trajectory_ids: list[str]) -> None:
    """Claim ``trajectory_ids`` for ``batch_id`` in the caller's transaction; raises
    ``_ClaimTakenError`` when one is claimed already.

    The trajectory id is ``batch_claims``' primary key, so of two builds that chose the same
    trajectory only the first to commit gets it, whatever process each runs in: PostgreSQL makes
    the second INSERT wait for the first transaction and then fail on the key; SQLite's single
    writer lock does the same. Sorted, so two builds insert overlapping keys in one order and
    never deadlock on PostgreSQL.
    """
    claims = [{"trajectory_id": t, "batch_id": batch_id} for t in sorted(set(trajectory_ids))]
    try:
        for start in range(0, len(claims), SQL_ROWS_PER_INSERT):
            session.execute(insert(BatchClaim), claims[start : start + SQL_ROWS_PER_INSERT])
    except IntegrityError as exc:
        raise _ClaimTakenError(str(exc.orig)) from exc


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


def get_batch(store: PoolStore, batch_id: str) -> Batch:
    with store.sessions() as session:
        batch = session.get(Batch, batch_id)
    if batch is None:
        raise UnknownTargetError(f"no batch {batch_id!r}", param="batch_id")
    return batch


# Every status a batch row can hold (``batches.status``): a filter naming another matches nothing,
# so the edges (``GET /api/batches``, ``trajgate batches list``) refuse it.
BatchStatusName = Literal["building", "ready", "leased", "consumed", "failed"]
BATCH_STATUSES: tuple[str, ...] = get_args(BatchStatusName)


def list_batches(store: PoolStore, status: str | None = None, limit: int = 100) -> list[Batch]:
    """At most ``limit`` batches, newest first, of ``status`` (one of ``BATCH_STATUSES``) or any."""
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
