"""The curation and batch HTTP API under ``/api``: labels, curation rules, readiness, batches,
leases, rows, lineage.

Owns: request/response schemas (OpenAPI) and wiring to ``datapool.curation.labels``,
``datapool.curation.rules``, ``datapool.curation.readiness``, ``datapool.batches.build`` and
``datapool.batches.leases``.
Never: builds rows itself; ``GET /api/batches/{id}/rows`` streams the batch's stored Parquet as
Arrow IPC (or the Parquet file itself).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any, Literal

import pyarrow as pa
from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, BaseModel, Field, Strict
from starlette.concurrency import run_in_threadpool

from datapool.batches import build as batches
from datapool.batches import leases
from datapool.batches.build import BatchStatusName
from datapool.batches.settings import BatchSettings
from datapool.curation import bulk_labels, labels, readiness
from datapool.curation import rules as curation
from datapool.curation.selection import TrajectoryFilter
from datapool.db import Sessions
from datapool.errors import UnknownTargetError
from datapool.models import INTEGER_MAX, Batch, CurationRule, Label
from datapool.queries.labels import current_label as current_label_of
from datapool.queries.labels import label_history
from datapool.steps.store import PoolStore
from gateway.api.bodies import PoolRoute, StrictBody, check_tags
from gateway.api.dependencies import BatchSettingsDep, SessionsDep, StoreDep
from gateway.errors import ConflictError, InvalidRequestError, NotFoundError
from gateway.state import GatewayState, StateDep

router = APIRouter(tags=["curation and batches"], route_class=PoolRoute)
ARROW_STREAM = "application/vnd.apache.arrow.stream"


# ---- labels --------------------------------------------------------------------------------


class LabelFields(StrictBody):
    tags: list[str] = Field(default_factory=list, description="Tags to add.")
    remove_tags: list[str] = Field(default_factory=list, description="Tags to remove.")
    quality: Literal["good", "bad", "unsure"] | None = None
    decision: Literal["include", "exclude"] | None = Field(
        default=None, description="exclude: never in a batch; include: overrides a rule."
    )
    note: str | None = None
    author: str | None = Field(default=None, max_length=200)


class LabelCreate(LabelFields):
    target: Literal["step", "trajectory", "group"]
    target_id: str


class LabelBulk(LabelFields):
    target: Literal["step", "trajectory", "group"] = Field(
        description="Label the matching trajectories, all their steps, or their groups."
    )
    filter: TrajectoryFilter


class LabelPublic(BaseModel):
    id: int
    target: str
    target_id: str
    trajectory_id: str | None
    tags: list[str]
    remove_tags: list[str]
    quality: str | None
    decision: str | None
    note: str | None
    author: str | None
    created_at: datetime


class LabelIds(BaseModel):
    ids: list[int]


class CurrentLabelPublic(BaseModel):
    target: str
    target_id: str
    tags: list[str]
    quality: str | None
    decision: str | None
    note: str | None
    records: int


def _label_in(body: LabelFields, target: str, target_id: str) -> labels.LabelIn:
    return labels.LabelIn(
        target,
        target_id,
        body.tags,
        body.remove_tags,
        body.quality,
        body.decision,
        body.note,
        body.author,
    )


def _label_public(r: Label) -> LabelPublic:
    return LabelPublic(
        id=r.id,
        target=r.target_kind,
        target_id=r.target_id,
        trajectory_id=r.trajectory_id,
        tags=list(r.tags or []),
        remove_tags=list(r.remove_tags or []),
        quality=r.quality,
        decision=r.decision,
        note=r.note,
        author=r.author,
        created_at=r.created_at,
    )


def _check_label_tags(body: LabelFields, state: GatewayState) -> None:
    check_tags(body.tags, state.settings, "tags")
    check_tags(body.remove_tags, state.settings, "remove_tags")


@router.post("/labels", response_model=LabelIds, status_code=201)
async def post_label(body: LabelCreate, sessions: SessionsDep, state: StateDep) -> LabelIds:
    """Append one label (append-only; the current view folds the history). Its tags are bounded
    as a trajectory's own (``TRAJGATE_MAX_TRAJECTORY_TAGS``, ``TRAJGATE_MAX_TAG_CHARS``)."""
    _check_label_tags(body, state)
    ids = await run_in_threadpool(
        labels.add_labels, sessions, [_label_in(body, body.target, body.target_id)]
    )
    return LabelIds(ids=ids)


@router.post("/labels/bulk", response_model=LabelIds, status_code=201)
async def post_labels_bulk(body: LabelBulk, sessions: SessionsDep, state: StateDep) -> LabelIds:
    """Append the same label to every trajectory, step or group the filter matches (its tags
    bounded as ``post_label``'s)."""
    _check_label_tags(body, state)
    ids = await run_in_threadpool(
        bulk_labels.bulk_label, sessions, body.filter, _label_in(body, body.target, "-")
    )
    return LabelIds(ids=ids)


@router.get("/labels", response_model=list[LabelPublic])
async def list_labels(
    sessions: SessionsDep,
    target: Literal["step", "trajectory", "group"] | None = None,
    target_id: str | None = None,
    trajectory_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[LabelPublic]:
    """Label records (history), oldest first: of one target, or of a trajectory and its steps."""
    records = await run_in_threadpool(
        lambda: label_history(
            sessions,
            target_kind=target,
            target_id=target_id,
            trajectory_id=trajectory_id,
            limit=limit,
        )
    )
    return [_label_public(r) for r in records]


@router.get("/labels/current", response_model=CurrentLabelPublic | None)
async def current_label(
    sessions: SessionsDep, target: Literal["step", "trajectory", "group"], target_id: str
) -> CurrentLabelPublic | None:
    """The current view of one target's labels (null when it has none)."""
    view = await run_in_threadpool(current_label_of, sessions, target, target_id)
    if view is None:
        return None
    return CurrentLabelPublic(
        target=target,
        target_id=target_id,
        tags=view.tags,
        quality=view.quality,
        decision=view.decision,
        note=view.note,
        records=view.records,
    )


# ---- curation rules ------------------------------------------------------------------------


class RuleCreate(StrictBody):
    name: str = Field(min_length=1, max_length=200)
    kind: curation.RuleKind
    action: curation.RuleAction = "exclude"
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Checked against the kind's typed params (datapool.curation.rule_params).",
    )
    author: str | None = Field(default=None, max_length=200)
    apply_now: bool = Field(default=True, description="Apply to the whole pool right away.")


class RulePublic(BaseModel):
    id: int
    name: str
    kind: str
    action: str
    params: dict[str, Any]
    enabled: bool
    author: str | None
    created_at: datetime
    applied_at: datetime | None
    error: str | None = Field(
        description="Why the rule's last run failed (its marks stay as they were); null after "
        "a good run. Batches that re-apply rules are refused (409) while it fails."
    )
    failed_at: datetime | None


class RuleResultPublic(BaseModel):
    rule_id: int
    name: str
    matched: int = Field(description="Targets the rule marks in the scope it ran on.")
    counts: dict[str, int] = Field(description="degenerate_group: groups per kind (all_success…)")
    error: str | None = Field(
        default=None, description="The rule failed: nothing was marked, old marks stay."
    )


class RuleCreated(RulePublic):
    result: RuleResultPublic | None


class ApplyRequest(StrictBody):
    rule_ids: list[Annotated[int, Field(ge=1, le=INTEGER_MAX)]] | None = Field(
        default=None, description="Default: every enabled rule."
    )
    trajectory_ids: list[str] | None = Field(default=None, description="Default: whole pool.")


def _rule_public(rule: CurationRule) -> dict[str, Any]:
    return {k: getattr(rule, k) for k in RulePublic.model_fields}


def _result_public(result: curation.RuleResult) -> RuleResultPublic:
    return RuleResultPublic(
        rule_id=result.rule_id,
        name=result.name,
        matched=result.matched,
        counts=result.counts,
        error=result.error,
    )


@router.post("/curation/rules", response_model=RuleCreated, status_code=201)
async def create_rule(body: RuleCreate, store: StoreDep) -> RuleCreated:
    """Declare a curation rule; it runs on each completed trajectory and, by default, now."""
    rule, result = await run_in_threadpool(
        lambda: curation.create_rule(
            store,
            body.name,
            body.kind,
            action=body.action,
            params=body.params,
            author=body.author,
            apply_now=body.apply_now,
        )
    )
    return RuleCreated(
        **_rule_public(rule), result=None if result is None else _result_public(result)
    )


@router.get("/curation/rules", response_model=list[RulePublic])
async def list_rules(sessions: SessionsDep) -> list[RulePublic]:
    """Every curation rule, oldest first."""
    rules = await run_in_threadpool(curation.list_rules, sessions)
    return [RulePublic(**_rule_public(r)) for r in rules]


@router.delete("/curation/rules/{rule_id}", status_code=204)
async def delete_rule(
    rule_id: Annotated[int, Path(ge=1, le=INTEGER_MAX)], sessions: SessionsDep
) -> Response:
    """Delete a rule and its marks (what it excluded becomes eligible again)."""
    await run_in_threadpool(curation.delete_rule, sessions, rule_id)
    return Response(status_code=204)


@router.post("/curation/apply", response_model=list[RuleResultPublic])
async def apply_rules(body: ApplyRequest, store: StoreDep) -> list[RuleResultPublic]:
    """Re-apply rules (e.g. after rewards arrived); each rule's marks in the scope are replaced.

    A rule that fails is reported in its result's ``error`` (and stored on the rule)."""
    results = await run_in_threadpool(
        lambda: curation.apply_rules(
            store, rule_ids=body.rule_ids, trajectory_ids=body.trajectory_ids, on_failure="report"
        )
    )
    return [_result_public(r) for r in results]


# ---- readiness -----------------------------------------------------------------------------


class ReadinessPublic(BaseModel):
    trajectory_id: str
    group_id: str | None
    status: str
    ready: bool
    reasons: list[str] = Field(description="Why it is not ready (empty when ready).")
    notes: list[str] = Field(description="Non-blocking facts: flag marks, overridden rules.")
    rewards: dict[str, float]
    excluded_steps: dict[str, str] = Field(description="Steps kept out of rows, and why.")
    step_rewards: dict[str, dict[str, float]] = Field(
        description="The required step rewards of each step: {step id: {name: value}}."
    )
    unrewarded_steps: dict[str, list[str]] = Field(
        description="Trainable steps lacking a required step reward, and the names they lack."
    )


class GroupReadinessPublic(BaseModel):
    group_id: str
    ready: bool
    reasons: list[str]
    members: list[ReadinessPublic]


RewardNamesQuery = Annotated[
    list[str] | None, Query(description="Rewards a batch would require (repeat; default final).")
]
StepRewardNamesQuery = Annotated[
    list[str] | None,
    Query(description="Step rewards a batch would require on every trainable step (repeat)."),
]


def _readiness_public(v: readiness.Verdict) -> ReadinessPublic:
    return ReadinessPublic(**vars(v))


@router.get("/trajectories/{trajectory_id}/readiness", response_model=ReadinessPublic)
async def trajectory_readiness(
    trajectory_id: str,
    sessions: SessionsDep,
    reward_name: RewardNamesQuery = None,
    step_reward_name: StepRewardNamesQuery = None,
) -> ReadinessPublic:
    """Whether the trajectory is ready for a batch requiring ``reward_name``s, and why not."""
    verdict = await run_in_threadpool(
        readiness.trajectory_readiness,
        sessions,
        trajectory_id,
        reward_name or ["final"],
        step_reward_name or [],
    )
    return _readiness_public(verdict)


@router.get("/groups/{group_id}/readiness", response_model=GroupReadinessPublic)
async def group_readiness(
    group_id: str,
    sessions: SessionsDep,
    reward_name: RewardNamesQuery = None,
    step_reward_name: StepRewardNamesQuery = None,
) -> GroupReadinessPublic:
    """Whether every member of the group is ready, and each member's reasons."""
    ready, reasons, members = await run_in_threadpool(
        readiness.group_readiness,
        sessions,
        group_id,
        reward_name or ["final"],
        step_reward_name or [],
    )
    return GroupReadinessPublic(
        group_id=group_id,
        ready=ready,
        reasons=reasons,
        members=[_readiness_public(m) for m in members],
    )


# ---- batches -------------------------------------------------------------------------------


class Consumption(BaseModel):
    consumer: str
    policy_version_trained: int | None
    acked_at: datetime


class BatchPublic(BaseModel):
    id: str
    name: str | None
    status: str = Field(description="ready, leased, consumed (by someone; others may still), …")
    rows: int
    tokens: int
    uri: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    leases: int
    expired_leases: int
    created_at: datetime


class BatchDetail(BatchPublic):
    spec: dict[str, Any]
    manifest: dict[str, Any]
    consumed_by: list[Consumption]


# Seconds, strictly a number: pydantic's lax mode read ``true`` as 1 s and ``"30"`` as 30.
LeaseSeconds = Annotated[float, Strict()]


def _names_someone(consumer: str) -> str:
    if not consumer.strip():
        raise ValueError(f"consumer must name someone, got only whitespace ({consumer!r})")
    return consumer


# Who holds a lease: the same bounds wherever a consumer is named (an empty one used to reach
# the lease check and answer 409 lease_lost instead of 400; a blank one was a consumer).
Consumer = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_names_someone)]
# A policy version is an integer: lax mode read ``"1"`` as 1 and ``true`` as 1.
PolicyVersion = Annotated[int, Strict(), Field(ge=0, le=INTEGER_MAX)]


class LeaseRequest(StrictBody):
    consumer: Consumer
    lease_s: LeaseSeconds | None = Field(
        default=None, gt=0, description="Default TRAJGATE_LEASE_DEFAULT_S."
    )
    batch_id: str | None = Field(
        default=None, description="Lease this batch only (e.g. the one just materialised)."
    )


class LeasePublic(BaseModel):
    batch_id: str
    consumer: str
    lease_id: str = Field(description="Pass back with ack/nack.")
    expires_at: datetime
    rows: int
    tokens: int
    rows_url: str


class RenewRequest(StrictBody):
    consumer: Consumer
    lease_id: str
    lease_s: LeaseSeconds | None = Field(
        default=None,
        gt=0,
        description="The lease ends this long from now; default TRAJGATE_LEASE_DEFAULT_S, at "
        "most TRAJGATE_LEASE_MAX_S.",
    )


class AckRequest(StrictBody):
    consumer: Consumer
    lease_id: str
    policy_version_trained: PolicyVersion | None = None


class NackRequest(StrictBody):
    consumer: Consumer
    lease_id: str
    reason: str | None = None


class StepBatch(BaseModel):
    batch_id: str
    name: str | None
    created_at: datetime
    row_index: int
    trained: list[dict[str, Any]] = Field(description="[{consumer, policy_version_trained}]")


def _batch_public(b: Batch) -> dict[str, Any]:
    return {k: getattr(b, k) for k in BatchPublic.model_fields}


@router.post("/batches", response_model=BatchDetail, status_code=201)
async def create_batch(
    spec: batches.BatchSpec, store: StoreDep, settings: BatchSettingsDep
) -> BatchDetail:
    """Materialise a batch spec into an immutable batch (409 when nothing is ready)."""
    try:
        batch = await run_in_threadpool(batches.materialise, store, spec, settings)
    except batches.NothingToBatchError as exc:
        raise ConflictError(exc.message, code="nothing_ready") from exc
    return BatchDetail(
        **_batch_public(batch), spec=batch.spec, manifest=batch.manifest, consumed_by=[]
    )


@router.get("/batches", response_model=list[BatchPublic])
async def list_batches(
    store: StoreDep,
    status: BatchStatusName | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[BatchPublic]:
    """Batches, newest first."""
    found = await run_in_threadpool(batches.list_batches, store, status, limit)
    return [BatchPublic(**_batch_public(b)) for b in found]


def _lease_s(asked: float | None, settings: BatchSettings) -> float:
    lease_s = asked or settings.lease_default_s
    if lease_s > settings.lease_max_s:
        raise InvalidRequestError(
            f"lease_s {lease_s} exceeds TRAJGATE_LEASE_MAX_S {settings.lease_max_s}",
            param="lease_s",
        )
    return lease_s


def _lease_public(lease: leases.Lease) -> LeasePublic:
    return LeasePublic(
        batch_id=lease.batch_id,
        consumer=lease.consumer,
        lease_id=lease.lease_id,
        expires_at=lease.expires_at,
        rows=lease.rows,
        tokens=lease.tokens,
        rows_url=f"/api/batches/{lease.batch_id}/rows",
    )


def _batch_not_found(exc: UnknownTargetError) -> NotFoundError:
    """The one answer for a batch id the pool does not hold, whatever the route: 404
    ``batch_not_found`` (a lease of one answered 204 as if it were merely taken)."""
    return NotFoundError(exc.message, param=exc.param, code="batch_not_found")


async def _existing_batch(store: PoolStore, batch_id: str) -> Batch:
    try:
        return await run_in_threadpool(batches.get_batch, store, batch_id)
    except UnknownTargetError as exc:
        raise _batch_not_found(exc) from exc


@router.post("/batches/lease", response_model=LeasePublic | None)
async def lease_batch(
    body: LeaseRequest, sessions: SessionsDep, store: StoreDep, settings: BatchSettingsDep
) -> LeasePublic | Response:
    """Lease the oldest ready batch this consumer has not consumed; 204 when there is none
    (with ``batch_id``: when that batch is held or consumed; 404 when there is no such batch)."""
    lease = await run_in_threadpool(
        leases.lease_next,
        sessions,
        body.consumer,
        _lease_s(body.lease_s, settings),
        body.batch_id,
    )
    if lease is None:
        if body.batch_id is not None:
            await _existing_batch(store, body.batch_id)
        return Response(status_code=204)
    return _lease_public(lease)


@router.post("/batches/{batch_id}/renew", response_model=LeasePublic)
async def renew_lease(
    batch_id: str, body: RenewRequest, sessions: SessionsDep, settings: BatchSettingsDep
) -> LeasePublic:
    """Extend a held lease to ``lease_s`` from now (a consumer still working); 409
    ``lease_lost`` when the lease expired, was released or was taken over."""
    lease_s = _lease_s(body.lease_s, settings)
    lease: leases.Lease = await _held(
        leases.renew, sessions, batch_id, body.consumer, body.lease_id, lease_s
    )
    return _lease_public(lease)


@router.get("/batches/{batch_id}", response_model=BatchDetail)
async def get_batch(batch_id: str, store: StoreDep) -> BatchDetail:
    """A batch with its spec, manifest (counts, groups, lineage) and who consumed it."""
    batch = await _existing_batch(store, batch_id)
    acks = await run_in_threadpool(batches.consumptions, store, batch_id)
    return BatchDetail(
        **_batch_public(batch),
        spec=batch.spec,
        manifest=batch.manifest,
        consumed_by=[
            Consumption(
                consumer=a.consumer,
                policy_version_trained=a.policy_version_trained,
                acked_at=a.acked_at,
            )
            for a in acks
        ],
    )


@router.get("/batches/{batch_id}/rows")
async def batch_rows(
    batch_id: str,
    store: StoreDep,
    format: Literal["arrow", "parquet"] = "arrow",
) -> Response:
    """The batch's rows as an Arrow IPC stream (default) or its Parquet file."""
    batch = await _existing_batch(store, batch_id)
    table = await run_in_threadpool(batches.read_rows, batch)
    if format == "parquet":
        import pyarrow.parquet as pq

        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        return Response(
            sink.getvalue(),
            media_type="application/vnd.apache.parquet",
            headers={"content-disposition": f'attachment; filename="{batch_id}.parquet"'},
        )
    if format != "arrow":
        raise InvalidRequestError(f"format must be 'arrow' or 'parquet', got {format!r}")

    def stream() -> Iterator[bytes]:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            for record_batch in table.to_batches(max_chunksize=1024):
                writer.write_batch(record_batch)
        yield sink.getvalue().to_pybytes()

    return StreamingResponse(stream(), media_type=ARROW_STREAM)


@router.post("/batches/{batch_id}/ack", status_code=204)
async def ack_batch(batch_id: str, body: AckRequest, sessions: SessionsDep) -> Response:
    """The consumer trained on the batch: recorded once, with the policy version trained (a
    retry of an ack already recorded answers 204 again; one naming another policy version
    answers 409 ``ack_conflict`` and the recorded version stays)."""
    await _held(
        leases.ack, sessions, batch_id, body.consumer, body.lease_id, body.policy_version_trained
    )
    return Response(status_code=204)


@router.post("/batches/{batch_id}/nack", status_code=204)
async def nack_batch(batch_id: str, body: NackRequest, sessions: SessionsDep) -> Response:
    """Give the batch back now (the update failed); the next lease may take it."""
    await _held(leases.nack, sessions, batch_id, body.consumer, body.lease_id)
    return Response(status_code=204)


async def _held(fn: Any, sessions: Sessions, *args: Any) -> Any:
    """``fn(sessions, *args)`` on a held lease: one that is no longer held answers 409, one on
    a batch the pool does not hold 404 ``batch_not_found``."""
    try:
        return await run_in_threadpool(fn, sessions, *args)
    except leases.LeaseNotCurrentError as exc:
        raise ConflictError(exc.message, param=exc.param, code="lease_lost") from exc
    except leases.AckConflictError as exc:
        raise ConflictError(exc.message, param=exc.param, code="ack_conflict") from exc
    except UnknownTargetError as exc:
        raise _batch_not_found(exc) from exc


@router.get("/steps/{step_id}/batches", response_model=list[StepBatch])
async def step_batches(step_id: str, store: StoreDep) -> list[StepBatch]:
    """Lineage of a step: the batches holding it and the policy versions trained on them."""
    found = await run_in_threadpool(batches.step_lineage, store, step_id)
    return [StepBatch(**row) for row in found]
