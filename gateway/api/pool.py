"""The pool's HTTP API under ``/api``: trajectories, steps, rewards, groups, summaries.

Owns: request/response schemas (OpenAPI), parsing filters and opaque cursors, and shaping what
the ``datapool.queries`` and ``datapool.lifecycle`` functions return into those schemas (pool
errors reach the one envelope through ``gateway.errors.from_pool_error``). Never: runs SQL or
opens a session; encodes text into token IDs (``/api/steps/{id}`` returns the stored IDs and,
only when a tokenizer is configured, ``TRAJGATE_TOKENIZER_DIR``, their decoded text).
"""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, Field, StrictFloat, field_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError
from starlette.concurrency import run_in_threadpool

from datapool.db import Sessions
from datapool.lifecycle import transitions as lifecycle
from datapool.models import (
    INTEGER_MAX,
    Step,
    Trajectory,
    TrajectoryStatus,
    UTCTimestamp,
    in_utc_range,
)
from datapool.queries import groups, steps, trajectories
from datapool.queries.rewards import reward_history
from datapool.queries.summary import pool_counts
from datapool.rewards import values as rewards
from datapool.steps.writer import PoolWriter
from gateway.api.bodies import PoolRoute, StrictBody, check_tags
from gateway.api.dependencies import SessionsDep, StoreDep, WriterDep
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.proxy.attribution import CHANNEL_PATTERN, GROUP_ID_PATTERN, TRAJECTORY_ID_PATTERN
from gateway.settings import GatewaySettings
from gateway.state import StateDep

router = APIRouter(tags=["pool"], route_class=PoolRoute)


# ---- schemas -------------------------------------------------------------------------------


class TrajectoryPublic(BaseModel):
    id: str
    group_id: str | None
    channel: str
    status: str
    tags: list[str]
    flags: list[str]
    metadata: dict[str, Any]
    created_at: datetime
    completed_at: datetime | None
    last_step_at: datetime | None
    completion_reason: str | None
    call_count: int = Field(
        description="Calls answered and recorded, one step_index each (a call's choices share "
        "it): a re-send (step flag resend) counts, since it was sampled again, though it shares "
        "the call_id of the call it re-sent."
    )
    rejected_calls: int = Field(description="Calls refused with 409 after the trajectory closed.")
    rewards: dict[str, float] = Field(
        description="Current value per reward name; a name absent here is unrewarded (not 0)."
    )


class TrajectoryPage(BaseModel):
    data: list[TrajectoryPublic]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null: end.")


class StepSummary(BaseModel):
    id: str
    call_id: str | None = Field(
        default=None,
        description="The logical call (the X-Trajgate-Call-Id answered): a re-send, flagged "
        "resend, has the call_id of the earlier step it re-sent; null before call ids.",
    )
    step_index: int
    choice_index: int
    parent_step_id: str | None
    extends_parent: bool | None
    outcome: str
    finish_reason: str | None
    flags: list[str]
    policy_version: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    created_at: datetime
    lineage_id: str | None = Field(
        default=None,
        description="The conversation of the trajectory the step belongs to: a client's "
        "session or agent id, or the id of the lineage's first step.",
    )
    lineage_parent_id: str | None = Field(
        default=None, description="The lineage this one came from (null: the main one)."
    )
    lineage_kind: str | None = Field(
        default=None, description="main, subagent, side_call or compaction."
    )
    lineage_source: str | None = Field(
        default=None,
        description="headers (a client header named it) or inferred (the continuation did).",
    )


class TrajectoryDetail(TrajectoryPublic):
    steps: list[StepSummary]


class TrajectoryCreate(StrictBody):
    # The rules of the X-Trajgate-Group/-Channel headers, so both ways into the pool agree.
    id: str = Field(pattern=TRAJECTORY_ID_PATTERN.pattern)
    group_id: str | None = Field(default=None, pattern=GROUP_ID_PATTERN.pattern)
    channel: str = Field(default="train", pattern=CHANNEL_PATTERN.pattern)
    tags: list[str] = Field(
        default_factory=list,
        description="At most TRAJGATE_MAX_TRAJECTORY_TAGS tags (default 256) of at most "
        "TRAJGATE_MAX_TAG_CHARS characters (default 128).",
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="At most TRAJGATE_MAX_METADATA_BYTES bytes as compact UTF-8 JSON "
        "(default 65536).",
    )


class CompleteRequest(StrictBody):
    # Checked by ``rewards.check_reward`` like POST /api/rewards (one validation path): 400 and
    # the trajectory stays open when the reward is NaN/infinite or the name has a bad length.
    reward: StrictFloat | None = Field(
        default=None,
        description="Optional final reward (a finite number), appended as source 'agent'.",
    )
    reward_name: str = Field(default="final", description="1-100 characters.")
    author: str | None = Field(default=None, description="At most 200 characters.")


class StepPublic(StepSummary):
    trajectory_id: str
    divergence_offset: int | None
    divergence_kind: str | None
    model: str | None
    request: dict[str, Any]
    upstream_request: dict[str, Any] | None = Field(
        default=None,
        description="The body sent to vLLM (after translation, sampling defaults and "
        "policy), whole; null for a call that never went upstream.",
    )
    response_message: dict[str, Any] | None
    latency_ms: float
    ttft_ms: float | None
    held_ms: float | None = Field(
        default=None,
        description="Milliseconds a full-weight reload held the call before it went upstream.",
    )
    continuation: str | None = Field(
        default=None,
        description=(
            "What built the prompt: 'exact' (the extended turn's ids, then the template's "
            "rendering of the new messages) or 'template'; null for completions and older steps."
        ),
    )
    suffix_tokens: int | None = Field(
        default=None,
        description="In exact mode: tokens the template rendered for this call after the "
        "parent step's prompt and response (len(P) - len(S_parent)).",
    )
    sampling: dict[str, Any] | None = Field(
        default=None,
        description="Effective sampling fields, what narrowed them, the logprobs mode and the "
        "temperature the behaviour logprobs are at (null: recorded before they were).",
    )
    policy_version_spans: list[list[int]] | None = Field(
        default=None,
        description="[[version, start, end], ...] over the response tokens when a kept "
        "full-weight update changed the weights mid-call; null: all policy_version's.",
    )
    error: str | None
    prompt_token_ids: list[int] | None
    response_token_ids: list[int] | None
    response_logprobs: list[float] | None
    prompt_text: str | None = Field(description="Decoded IDs; null without a tokenizer.")
    response_text: str | None = Field(description="Decoded IDs; null without a tokenizer.")
    rewards: dict[str, float]


class RewardCreate(StrictBody):
    target: Literal["step", "trajectory", "lineage"]
    target_id: str = Field(
        description="A step id, a trajectory id, or for a lineage '<trajectory_id>/<lineage_id>'."
    )
    name: str = Field(min_length=1, max_length=100)
    # Strict: a JSON string or boolean is refused, never coerced ("1" and true are not 1.0).
    value: StrictFloat
    source: Literal["rule", "model", "human", "agent"] = "human"
    author: str | None = None


class RewardBatch(StrictBody):
    rewards: list[RewardCreate] = Field(min_length=1, max_length=100_000)


class RewardPublic(BaseModel):
    id: int
    target: str
    target_id: str
    trajectory_id: str
    name: str
    value: float | None
    source: str
    author: str | None
    error: str | None
    created_at: datetime


class RewardIds(BaseModel):
    ids: list[int]


class GroupUpdate(StrictBody):
    """A PUT of a group changes only the fields it names (a field left out keeps its value)."""

    expected_size: int | None = Field(
        default=None,
        ge=1,
        le=INTEGER_MAX,
        description="Members that complete the group; null: no size (the group never "
        "completes by size). Left out: unchanged (null for a new group).",
    )
    # Derived from expected_size and the members' statuses, never set: named here only so that
    # sending it is refused with a message saying so rather than as an unknown field.
    status: SkipJsonSchema[Any] = Field(default=None, exclude=True)

    @field_validator("status", mode="before")
    @classmethod
    def _status_is_derived(cls, value: Any) -> None:
        raise PydanticCustomError(
            "read_only",
            "status is derived, never set: a group is complete once expected_size members "
            "closed, and open again when a member joins; nothing was changed",
        )


class GroupPublic(BaseModel):
    id: str
    expected_size: int | None
    status: str
    members: dict[str, int] = Field(description="Member trajectories per status.")
    completed_at: datetime | None


class StaleStep(BaseModel):
    step_id: str
    policy_version: int | None


class Summary(BaseModel):
    trajectories_by_status: dict[str, int]
    trajectories_by_channel: dict[str, int]
    steps: int
    steps_by_outcome: dict[str, int]
    rewarded_trajectories: int
    unrewarded_trajectories: int
    rejected_calls: int
    empty_trajectories: int
    incomplete_trajectories: int
    payloads_pending_compaction: int
    writer: dict[str, Any] | None


# ---- helpers -------------------------------------------------------------------------------


def _public(t: Trajectory, current: dict[str, float]) -> TrajectoryPublic:
    return TrajectoryPublic(
        id=t.id,
        group_id=t.group_id,
        channel=t.channel,
        status=t.status,
        tags=list(t.tags or []),
        flags=list(t.flags or []),
        metadata=dict(t.metadata_json or {}),
        created_at=t.created_at,
        completed_at=t.completed_at,
        last_step_at=t.last_step_at,
        completion_reason=t.completion_reason,
        call_count=t.call_count,
        rejected_calls=t.rejected_calls,
        rewards=current,
    )


def _summary(s: Step) -> dict[str, Any]:
    return {k: getattr(s, k) for k in StepSummary.model_fields}


def _encode_cursor(created_at: datetime, trajectory_id: str) -> str:
    raw = json.dumps([created_at.isoformat(), trajectory_id]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The ``(created_at, id)`` a cursor holds; 400 ``invalid_cursor`` for anything this API
    would not have written (an empty or garbled one, one padded or wrapped in other characters,
    an instant without its offset or UTC cannot hold, an id a trajectory cannot have, NUL
    included: PostgreSQL refuses NUL in text, so it must never reach the query), never the first
    page read as if no cursor had been sent. Cursors are not signed: a well-formed one a client
    built itself reads as the position it names."""
    try:
        created, trajectory_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        if not isinstance(trajectory_id, str) or not TRAJECTORY_ID_PATTERN.fullmatch(trajectory_id):
            raise ValueError("not a trajectory id")
        instant = datetime.fromisoformat(created)
        # b64decode skips characters outside its alphabet and extra padding, so ``!!<C>!`` read
        # as ``<C>``; only the exact bytes _encode_cursor writes (an instant with its offset) pass.
        if instant.tzinfo is None or _encode_cursor(instant, trajectory_id) != cursor:
            raise ValueError("not as this API writes a cursor")
        return in_utc_range(instant), trajectory_id
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(
            f"cursor {cursor[:40]!r} is not one this API returned; pass a page's next_cursor "
            "as it came, or no cursor for the first page",
            param="cursor",
            code="invalid_cursor",
        ) from exc


# ---- trajectories --------------------------------------------------------------------------


# A reward bound is a finite number: ``nan`` compared false with every reward and answered an
# empty page as if nothing matched.
FiniteBound = Annotated[float, Query(allow_inf_nan=False)]


@router.get("/trajectories", response_model=TrajectoryPage)
async def list_trajectories(
    sessions: SessionsDep,
    status: Annotated[list[TrajectoryStatus] | None, Query()] = None,
    channel: str | None = None,
    group_id: str | None = None,
    tag: Annotated[list[str] | None, Query(description="Every tag must be present.")] = None,
    flag: Annotated[list[str] | None, Query(description="Every flag must be present.")] = None,
    reward_name: str = "final",
    reward_min: FiniteBound | None = None,
    reward_max: FiniteBound | None = None,
    rewarded: Annotated[bool | None, Query(description="Has reward_name (true) or not.")] = None,
    policy_version: Annotated[
        int | None, Query(ge=0, le=INTEGER_MAX, description="Has a step of this version.")
    ] = None,
    created_after: UTCTimestamp | None = None,
    created_before: UTCTimestamp | None = None,
    q: Annotated[
        str | None, Query(description="Text in a step's request JSON, any case (scans).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: str | None = None,
) -> TrajectoryPage:
    """Trajectories, newest first, filtered; cursor pagination (stable under inserts)."""
    page, more = await run_in_threadpool(
        lambda: trajectories.trajectory_page(
            sessions,
            status=[s.value for s in status] if status else None,
            channel=channel,
            group_id=group_id,
            tags=tag or (),
            flags=flag or (),
            reward_name=reward_name,
            reward_min=reward_min,
            reward_max=reward_max,
            rewarded=rewarded,
            policy_version=policy_version,
            created_after=created_after,
            created_before=created_before,
            q=q,
            after=None if cursor is None else _decode_cursor(cursor),
            limit=limit,
        )
    )
    last = page[-1].trajectory if page else None
    return TrajectoryPage(
        data=[_public(row.trajectory, row.rewards) for row in page],
        next_cursor=_encode_cursor(last.created_at, last.id) if more and last else None,
    )


def _check_sizes(body: TrajectoryCreate, settings: GatewaySettings) -> None:
    """Raise ``InvalidRequestError`` (400) for more than ``max_trajectory_tags`` tags, a tag over
    ``max_tag_chars`` characters, or metadata over ``max_metadata_bytes`` bytes of compact UTF-8
    JSON: each listing page returns them whole, so one trajectory must not weigh megabytes."""
    check_tags(body.tags, settings)
    size = len(json.dumps(body.metadata, ensure_ascii=False, separators=(",", ":")).encode())
    if size > settings.max_metadata_bytes:
        raise InvalidRequestError(
            f"metadata is {size} bytes as compact JSON; expected at most "
            f"{settings.max_metadata_bytes} (TRAJGATE_MAX_METADATA_BYTES)",
            param="metadata",
        )


@router.post("/trajectories", response_model=TrajectoryPublic, status_code=201)
async def create_trajectory(
    body: TrajectoryCreate, sessions: SessionsDep, state: StateDep
) -> TrajectoryPublic:
    """Register a trajectory before its first call (group, channel, tags, metadata).

    Tags and metadata are bounded (``TRAJGATE_MAX_TRAJECTORY_TAGS``, ``TRAJGATE_MAX_TAG_CHARS``,
    ``TRAJGATE_MAX_METADATA_BYTES``): past a bound, 400 and nothing is registered.
    """
    _check_sizes(body, state.settings)
    trajectory = await run_in_threadpool(
        lifecycle.create_trajectory,
        sessions,
        body.id,
        group_id=body.group_id,
        channel=body.channel,
        tags=body.tags,
        metadata=body.metadata,
    )
    return _public(trajectory, {})


def _detail(sessions: Sessions, trajectory_id: str) -> TrajectoryDetail:
    found = trajectories.trajectory_with_steps(sessions, trajectory_id)
    if found is None:
        raise NotFoundError(f"no trajectory {trajectory_id!r}", param="trajectory_id")
    public = _public(found.trajectory, found.rewards)
    return TrajectoryDetail(
        **public.model_dump(), steps=[StepSummary(**_summary(s)) for s in found.steps]
    )


@router.get("/trajectories/{trajectory_id}", response_model=TrajectoryDetail)
async def get_trajectory(trajectory_id: str, sessions: SessionsDep) -> TrajectoryDetail:
    """One trajectory with its steps (without token IDs; see /api/steps/{id})."""
    return await run_in_threadpool(_detail, sessions, trajectory_id)


@router.post("/trajectories/{trajectory_id}/complete", response_model=TrajectoryDetail)
async def complete_trajectory(
    trajectory_id: str,
    sessions: SessionsDep,
    writer: WriterDep,
    request: Request,
    body: CompleteRequest | None = None,
) -> TrajectoryDetail:
    """Complete an open trajectory (optionally with a final reward); later calls get 409.

    Its completion hooks (the configured reward functions, then the curation rules) start at
    once, in this gateway unless another one claims them first (``datapool.lifecycle.hooks``); the
    answer
    does not wait for them.
    """
    body = body or CompleteRequest()
    detail = await _close(
        sessions,
        writer,
        trajectory_id,
        TrajectoryStatus.COMPLETE,
        final_reward=body.reward,
        reward_name=body.reward_name,
        author=body.author,
    )
    # The hooks are already due in the database (durable); this only saves the polling delay.
    request.app.state.gateway.hooks.wake()
    return detail


async def _close(
    sessions: Sessions,
    writer: PoolWriter,
    trajectory_id: str,
    status: TrajectoryStatus,
    **final: Any,
) -> TrajectoryDetail:
    """Close the trajectory (``final``: its final reward, for completion), tell the writer
    (its later calls are refused before they reach the engine; its cached lineage is
    dropped), and return what it now is."""

    def close() -> None:
        lifecycle.close_trajectory(sessions, trajectory_id, status, **final)
        writer.trajectory_closed(trajectory_id, status.value)

    await run_in_threadpool(close)
    return await run_in_threadpool(_detail, sessions, trajectory_id)


@router.post("/trajectories/{trajectory_id}/abandon", response_model=TrajectoryDetail)
async def abandon_trajectory(
    trajectory_id: str, sessions: SessionsDep, writer: WriterDep
) -> TrajectoryDetail:
    """Mark an open trajectory abandoned (the agent gave up); later calls get 409."""
    return await _close(sessions, writer, trajectory_id, TrajectoryStatus.ABANDONED)


@router.post("/trajectories/{trajectory_id}/fail", response_model=TrajectoryDetail)
async def fail_trajectory(
    trajectory_id: str, sessions: SessionsDep, writer: WriterDep
) -> TrajectoryDetail:
    """Mark an open trajectory failed (the environment broke); later calls get 409."""
    return await _close(sessions, writer, trajectory_id, TrajectoryStatus.FAILED)


# ---- groups --------------------------------------------------------------------------------


def _group(sessions: Sessions, group_id: str) -> GroupPublic:
    found = groups.group_with_counts(sessions, group_id)
    if found is None:
        raise NotFoundError(f"no group {group_id!r}", param="group_id")
    return GroupPublic(
        id=found.group.id,
        expected_size=found.group.expected_size,
        status=found.group.status,
        members=found.members,
        completed_at=found.group.completed_at,
    )


@router.put("/groups/{group_id}", response_model=GroupPublic)
async def put_group(
    group_id: Annotated[str, PathParam(pattern=GROUP_ID_PATTERN.pattern)],
    body: GroupUpdate,
    sessions: SessionsDep,
) -> GroupPublic:
    """Create a group or change the fields the body names (a field left out keeps its value;
    ``{}`` only creates a missing group); it completes when ``expected_size`` members closed.
    ``status`` is derived: a body naming it is refused with 400."""
    await run_in_threadpool(
        lambda: lifecycle.set_group(
            sessions,
            group_id,
            body.expected_size,
            update_size="expected_size" in body.model_fields_set,
        )
    )
    return await run_in_threadpool(_group, sessions, group_id)


@router.get("/groups/{group_id}", response_model=GroupPublic)
async def get_group(group_id: str, sessions: SessionsDep) -> GroupPublic:
    """A group's expected size, status and members per status."""
    return await run_in_threadpool(_group, sessions, group_id)


# ---- steps ---------------------------------------------------------------------------------


@router.get("/steps/stale", response_model=list[StaleStep])
async def stale_steps(
    sessions: SessionsDep,
    current_version: Annotated[int, Query(ge=0, le=INTEGER_MAX)],
    max_versions_behind: Annotated[int, Query(ge=0, le=INTEGER_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    after_version: Annotated[
        int | None,
        Query(ge=0, le=INTEGER_MAX, description="Page after this row: its policy_version..."),
    ] = None,
    after_step_id: Annotated[str | None, Query(description="...and its step_id.")] = None,
) -> list[StaleStep]:
    """Steps produced more than ``max_versions_behind`` policy versions before the current,
    oldest version first, at most ``limit``; the next page starts after the last row
    (``after_version``, ``after_step_id``)."""
    if (after_version is None) != (after_step_id is None):
        raise InvalidRequestError(
            "after_version and after_step_id page together: give both (the last row's "
            "policy_version and step_id) or neither",
            param="after_step_id",
        )
    after = None
    if after_version is not None and after_step_id is not None:
        after = (after_version, after_step_id)
    rows = await run_in_threadpool(
        lambda: lifecycle.stale_steps(
            sessions, current_version, max_versions_behind, limit=limit, after=after
        )
    )
    return [StaleStep(step_id=s, policy_version=v) for s, v in rows]


@router.get("/steps/{step_id}", response_model=StepPublic)
async def get_step(step_id: str, store: StoreDep) -> StepPublic:
    """One step with its exact token IDs and logprobs (and decoded text with a tokenizer)."""
    view = await run_in_threadpool(steps.step_view, store, step_id)
    if view is None:
        raise NotFoundError(f"no step {step_id!r}", param="step_id")
    computed = ("rewards", "prompt_text", "response_text")
    fields = {k: getattr(view.step, k) for k in StepPublic.model_fields if k not in computed}
    return StepPublic(
        **fields,
        prompt_text=view.prompt_text,
        response_text=view.response_text,
        rewards=view.rewards,
    )


# ---- rewards -------------------------------------------------------------------------------


@router.post("/rewards", response_model=RewardIds, status_code=201)
async def post_rewards(body: RewardBatch, sessions: SessionsDep) -> RewardIds:
    """Append rewards (one or many, all or none) to steps or trajectories, at any time.

    Unknown targets are 404 and nothing is written.
    """
    ids = await run_in_threadpool(
        rewards.add_rewards,
        sessions,
        [
            rewards.RewardIn(r.target, r.target_id, r.name, r.value, r.source, r.author)
            for r in body.rewards
        ],
    )
    return RewardIds(ids=ids)


@router.get("/rewards", response_model=list[RewardPublic])
async def list_rewards(
    sessions: SessionsDep,
    trajectory_id: str | None = None,
    target_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> list[RewardPublic]:
    """Reward records (history, failed reward functions included), oldest first."""
    if trajectory_id is None and target_id is None:
        raise InvalidRequestError("give trajectory_id or target_id", param="trajectory_id")
    records = await run_in_threadpool(
        lambda: reward_history(
            sessions, trajectory_id=trajectory_id, target_id=target_id, limit=limit
        )
    )
    return [
        RewardPublic(
            id=r.id,
            target=r.target_kind,
            target_id=r.target_id,
            trajectory_id=r.trajectory_id,
            name=r.name,
            value=r.value,
            source=r.source,
            author=r.author,
            error=r.error,
            created_at=r.created_at,
        )
        for r in records
    ]


# ---- summary -------------------------------------------------------------------------------


@router.get("/summary", response_model=Summary)
async def summary(state: StateDep) -> Summary:
    """Counts for dashboards: trajectories by status/channel, steps, rewards, integrity."""
    counts = await run_in_threadpool(pool_counts, state.store)
    stats = None
    if state.writer is not None:
        stats = {k: v for k, v in vars(state.writer.stats).items() if k != "batch_sizes"}
    total = sum(counts.trajectories_by_status.values())
    return Summary(
        trajectories_by_status=counts.trajectories_by_status,
        trajectories_by_channel=counts.trajectories_by_channel,
        steps=sum(counts.steps_by_outcome.values()),
        steps_by_outcome=counts.steps_by_outcome,
        rewarded_trajectories=counts.rewarded_trajectories,
        unrewarded_trajectories=total - counts.rewarded_trajectories,
        rejected_calls=counts.rejected_calls,
        empty_trajectories=counts.empty_trajectories,
        incomplete_trajectories=counts.incomplete_trajectories,
        payloads_pending_compaction=counts.payloads_pending_compaction,
        writer=stats,
    )
