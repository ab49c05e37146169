"""The JSON endpoints the web inspector's views need, under ``/api``.

Owns: the schemas of sorted/paged trajectory lists, the trajectory view (what each step added)
and a step's full conversation on demand, a step's token view (whole or a window), a group's
rollouts with advantages, curation marks, batch previews, chart aggregates and the trainer's
metrics (each endpoint one call to ``datapool.queries`` or ``datapool.batches``); and
the inspector's guard: the admin token (when one is set) on every endpoint here, and a
same-origin check on every write. Never: runs SQL or opens a session; encodes text into token IDs
(the token view decodes stored IDs one by one with the tokenizer vLLM serves the step's model
with, ``gateway.tokenizer_dirs``); writes labels or batches itself (the inspector calls
``/api/labels`` and ``/api/batches`` for that).

Cross-site writes: a browser page on another origin can send a form POST; it cannot set a
custom header or a JSON content type without a CORS preflight, which this gateway never grants.
Every write here refuses a request whose ``Sec-Fetch-Site`` is ``cross-site``/``same-site`` or
whose ``Origin`` is not this gateway's own, and the inspector adds ``X-Trajgate-Inspector: 1``.
"""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from datapool.batches import build as batches
from datapool.errors import UnknownTargetError
from datapool.models import INTEGER_MAX, UTCTimestamp
from datapool.queries import charts, conversation, groups, listing, steps
from gateway.api.bodies import PoolRoute, StrictBody
from gateway.api.dependencies import SessionsDep, StoreDep
from gateway.auth import check_admin_token
from gateway.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from gateway.state import StateDep

MAX_IDS = 100_000
MAX_TOKEN_PAGE = 100_000


def reject_cross_site(request: Request) -> None:
    """Raises ``PermissionDeniedError`` when a browser sent this request for another site's page."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site in ("cross-site", "same-site"):
        raise PermissionDeniedError(
            f"cross-site write refused (Sec-Fetch-Site: {fetch_site})", code="cross_site"
        )
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise PermissionDeniedError(
            f"cross-site write refused: Origin {origin!r} is not {request.headers.get('host')!r}",
            code="cross_site",
        )


def guard(request: Request) -> None:
    """Admin token on every inspector endpoint (when set); same-origin on every write."""
    check_admin_token(request, request.app.state.gateway.settings.admin_token)
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        reject_cross_site(request)


router = APIRouter(
    prefix="/api", tags=["inspector"], dependencies=[Depends(guard)], route_class=PoolRoute
)

ListQueryDep = Annotated[listing.ListQuery, Query()]


# ---- lists and views -----------------------------------------------------------------------


class ListPage(BaseModel):
    data: list[dict[str, Any]]
    reward_name: str = Field(
        description="The reward the rows' reward column, filters and sort read."
    )
    offset: int
    limit: int
    total: int | None = Field(description="Matching trajectories; only with ?with_total=true.")


@router.get("/inspector/trajectories", response_model=ListPage)
async def list_page(
    sessions: SessionsDep, where: ListQueryDep, with_total: bool = False
) -> ListPage:
    """Trajectories filtered like ``GET /api/trajectories``, sorted by ``sort``/``order``,
    paged by ``offset``/``limit``; each row with steps, tokens, rewards, label, rule exclusion."""
    where = await run_in_threadpool(listing.with_reward_name, sessions, where)
    rows, total = await run_in_threadpool(
        lambda: listing.list_page(sessions, where, with_total=with_total)
    )
    assert where.reward_name is not None
    return ListPage(
        data=rows,
        reward_name=where.reward_name,
        offset=where.offset,
        limit=where.limit,
        total=total,
    )


class IdList(BaseModel):
    ids: list[str]
    truncated: bool


@router.get("/inspector/trajectory-ids", response_model=IdList)
async def trajectory_ids(sessions: SessionsDep, where: ListQueryDep) -> IdList:
    """Ids of every trajectory the filters match (oldest first, at most 100,000): the target of
    bulk actions and batch specs when the filter has a text search."""
    where = await run_in_threadpool(listing.with_reward_name, sessions, where)
    ids = await run_in_threadpool(listing.matching_ids, sessions, where, MAX_IDS + 1)
    return IdList(ids=ids[:MAX_IDS], truncated=len(ids) > MAX_IDS)


@router.get("/inspector/trajectories/{trajectory_id}")
async def trajectory_view(
    trajectory_id: str,
    sessions: SessionsDep,
    batch_id: str | None = None,
    reward_name: Annotated[list[str], Query()] = [],  # noqa: B006 (FastAPI copies defaults)
) -> dict[str, Any]:
    """One trajectory and its steps in order (of each step's messages only those it added to
    its parent's, ``messages_base`` saying how many it repeats, a replaced first message as
    edits of a text of ``head_texts``; its tool list as a key of ``tools``; response, rewards,
    labels, rule marks, lineage and prefix-break windows, the merged row it trains in as
    ``segment_index``; no token IDs), its ``lineages`` (each
    conversation's kind, parent, spawning step and rows: ``datapool.queries.lineages``), with
    its batch readiness judged
    against ``readiness.spec``: ``batch_id``'s spec, else a spec requiring the ``reward_name``
    values, else the newest batch spec of the trajectory's channel (else the pool's newest
    reward name)."""

    def run() -> dict[str, Any] | None:
        try:
            return listing.trajectory_view(
                sessions, trajectory_id, batch_id=batch_id, chosen_rewards=reward_name
            )
        except UnknownTargetError as exc:
            raise NotFoundError(exc.message, param="batch_id") from exc

    view = await run_in_threadpool(run)
    if view is None:
        raise NotFoundError(f"no trajectory {trajectory_id!r}", param="trajectory_id")
    return view


@router.get("/inspector/steps/{step_id}/history")
async def step_history(step_id: str, sessions: SessionsDep) -> dict[str, Any]:
    """One step's full conversation, which the trajectory view leaves out (it sends what each
    step added): ``request``, the client's body exactly as sent, and ``canonical``, the
    canonical record with every message and tool."""
    history = await run_in_threadpool(conversation.step_history, sessions, step_id)
    if history is None:
        raise NotFoundError(f"no step {step_id!r}", param="step_id")
    return history


@router.get("/steps/{step_id}/tokens")
async def step_tokens(
    step_id: str,
    state: StateDep,
    offset: Annotated[int, Query(ge=0, le=INTEGER_MAX)] = 0,
    limit: Annotated[int | None, Query(ge=1, le=MAX_TOKEN_PAGE)] = None,
) -> dict[str, Any]:
    """A step's exact prompt and response IDs with behaviour logprobs, the loss mask (1 on
    sampled tokens), where the prompt stops repeating the parent's prompt + response
    (``prompt_base_tokens``), and each ID's text decoded alone with the step's model's tokenizer
    (learnt from vLLM's ``/v1/models``, or ``TRAJGATE_TOKENIZER_DIR``); without one,
    ``token_texts`` is null and ``tokenizer_note`` says why. ``offset``/``limit`` give one
    window of its positions (prompt first, then response; ``next_offset`` continues); an
    ``offset`` past the step's last token is a 400."""
    dirs = state.tokenizer_dirs
    override = state.store.settings.tokenizer_dir
    if override is None:
        urls = [replica.url for replica in state.upstreams.replicas]
        await dirs.learn(state.client, urls, state.settings.upstream_connect_timeout_s)

    def choose(model: str | None) -> tuple[Path, str] | None:
        chosen = dirs.choose(model, override)
        return None if chosen is None else (chosen.directory, chosen.source)

    def run() -> dict[str, Any] | None:
        try:
            return steps.step_tokens(state.store, step_id, choose, offset=offset, limit=limit)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="offset") from exc

    view = await run_in_threadpool(run)
    if view is None:
        raise NotFoundError(f"no step {step_id!r}", param="step_id")
    view["tokenizer_note"] = None if view["tokenizer"] else dirs.note(view["model"])
    return view


@router.get("/groups/{group_id}/rollouts")
async def group_rollouts(
    group_id: str,
    sessions: SessionsDep,
    reward_name: str = "final",
    algorithm: str = "grpo",
) -> dict[str, Any]:
    """The group's members side by side: status, steps, tokens, reward, the advantage
    ``algorithm`` would give them (``grpo``, ``rloo``, ``reinforce_pp``, ``sft``;
    unrewarded members get none), and each one's last answer."""
    members = await run_in_threadpool(
        groups.group_rollouts, sessions, group_id, reward_name, algorithm
    )
    if members is None:
        raise NotFoundError(f"no group {group_id!r} with members", param="group_id")
    return {
        "group_id": group_id,
        "reward_name": reward_name,
        "algorithm": algorithm,
        "members": members,
    }


@router.get("/curation/marks")
async def curation_marks(
    sessions: SessionsDep,
    rule_id: Annotated[int | None, Query(ge=1, le=INTEGER_MAX)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
) -> list[dict[str, Any]]:
    """What curation rules marked (excluded or flagged), newest first, with each reason."""
    return await run_in_threadpool(listing.list_marks, sessions, rule_id, limit)


# ---- batches -------------------------------------------------------------------------------

PREVIEW_ROWS = 50
# Step-level credit of each previewed row (floats first: NaN is shown as null), and the
# manifest's step_credit (anchor sub-groups: which steps of which rollouts share a state).
STEP_CREDIT_COLUMNS = [
    "process_reward",
    "episode_advantage",
    "step_advantage",
    "anchor_key",
    "anchor_group_size",
]


@router.post("/batches/preview")
async def preview_batch(spec: batches.BatchSpec, store: StoreDep) -> dict[str, Any]:
    """What ``POST /api/batches`` would build from ``spec``, without writing anything: counts,
    rows, tokens, the first 50 rows with their step credit, and ``step_credit`` (step rewards,
    estimator, anchor sub-groups) (rules are not re-applied; materialising does)."""

    def run() -> dict[str, Any]:
        try:
            table, manifest = batches.build_rows(store, spec)
        except batches.NothingToBatchError as exc:
            raise ConflictError(exc.message, code="nothing_ready") from exc
        columns = [
            "trajectory_id",
            "group_id",
            "step_ids",
            "num_tokens",
            "num_loss_tokens",
            "reward",
            "advantage",
            "policy_version",
        ]
        columns += STEP_CREDIT_COLUMNS
        head = table.slice(0, PREVIEW_ROWS).select(columns).to_pylist()
        for row in head:
            for key in ("reward", "advantage", *STEP_CREDIT_COLUMNS[:3]):
                if row[key] is not None and math.isnan(row[key]):
                    row[key] = None
        return {
            "rows": table.num_rows,
            "counts": manifest["counts"],
            "head": head,
            "step_credit": manifest["step_credit"],
        }

    return await run_in_threadpool(run)


# ---- charts and training metrics -----------------------------------------------------------


@router.get("/charts")
async def chart_data(
    sessions: SessionsDep,
    since: UTCTimestamp | None = None,
    bucket_s: Annotated[int, Query(ge=1, le=INTEGER_MAX)] = 60,
    reward_name: str | None = None,
) -> dict[str, Any]:
    """Reward by policy version and channel (mean, standard error, n) of ``reward_name`` (by
    default the trajectory reward recorded last; ``reward_names`` lists those present), steps and
    tokens per bucket, length histograms and flag rates per policy version (exact aggregates over
    steps created since ``since``)."""
    return await run_in_threadpool(
        lambda: charts.charts(sessions, since=since, bucket_s=bucket_s, reward_name=reward_name)
    )


class TrainingMetricIn(StrictBody):
    run: str = Field(default="default", min_length=1, max_length=200)
    policy_version: int | None = Field(default=None, ge=0, le=INTEGER_MAX)
    step: int = Field(ge=0, le=INTEGER_MAX, description="The trainer's optimiser step.")
    metrics: dict[str, float] = Field(description="Name to value, e.g. loss, kl, grad_norm.")


class TrainingMetricBatch(StrictBody):
    rows: list[TrainingMetricIn] = Field(min_length=1, max_length=10_000)


class TrainingMetricPublic(TrainingMetricIn):
    # An answer read from stored rows, not a request body: the request rules do not apply.
    model_config = ConfigDict(extra="ignore", strict=False)

    id: int
    created_at: datetime


@router.post("/training-metrics", status_code=201)
async def post_training_metrics(body: TrainingMetricBatch, sessions: SessionsDep) -> dict[str, Any]:
    """Append rows of trainer metrics (append-only; all or none)."""
    bad = [k for r in body.rows for k, v in r.metrics.items() if not math.isfinite(v)]
    if bad:
        raise InvalidRequestError(f"metric values must be finite numbers; got {bad[:5]}")
    ids = await run_in_threadpool(
        charts.add_training_metrics, sessions, [r.model_dump() for r in body.rows]
    )
    return {"ids": ids}


@router.get("/training-metrics", response_model=list[TrainingMetricPublic])
async def get_training_metrics(
    sessions: SessionsDep,
    run: str | None = None,
    after_id: Annotated[int, Query(ge=0, le=INTEGER_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> list[TrainingMetricPublic]:
    """Trainer metric rows oldest first; ``after_id`` returns only newer rows (polling)."""
    rows = await run_in_threadpool(charts.training_metrics, sessions, run, after_id, limit)
    return [TrainingMetricPublic.model_validate(r, from_attributes=True) for r in rows]
