"""Management endpoints under ``/admin``: policy versions, full-weight updates, agent API keys.

Owns: the HTTP surface of the policy registry, of full-weight updates (the pause around an
in-place reload: ``gateway.upstream.weight_update``) and of the key ring, behind the admin token.
Never: serves agents; OpenAI routes live in ``gateway.proxy.routes``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from datapool.models import INTEGER_MAX
from gateway.api.bodies import PoolRoute
from gateway.auth import check_admin_token
from gateway.errors import ConflictError, InvalidRequestError, UpstreamError
from gateway.proxy.attribution import CHANNEL_PATTERN, TRAJECTORY_ID_PATTERN
from gateway.settings import UPDATE_MODES, UpdateMode
from gateway.state import GatewayState
from gateway.upstream.replicas import served_models
from gateway.upstream.weight_update import (
    ReloadError,
    pause_replicas,
    reload_kept_replicas,
    reload_label,
    reload_replicas,
    resume_replicas,
)


def _admin_state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    check_admin_token(request, state.settings.admin_token)
    return state


AdminDep = Annotated[GatewayState, Depends(_admin_state)]
router = APIRouter(prefix="/admin", tags=["admin"], route_class=PoolRoute)


class PolicyVersionCreate(BaseModel):
    version: int = Field(
        ge=0, le=INTEGER_MAX, description="Integer id of the weights; bumps on each sync."
    )
    model_name: str = Field(
        min_length=1,
        max_length=200,
        description="Upstream model name serving it (base model or LoRA adapter).",
    )
    weights_location: str | None = Field(
        default=None, description="LoRA directory or checkpoint the weights were loaded from."
    )
    activate: bool = Field(default=True, description="Make it the version the alias serves.")


class PolicyVersionPublic(BaseModel):
    version: int
    model_name: str
    weights_location: str | None
    active: bool
    created_at: datetime
    activated_at: datetime | None


class WeightUpdateCreate(BaseModel):
    version: int = Field(
        ge=0, le=INTEGER_MAX, description="The policy version the new weights are."
    )
    model_name: str = Field(
        min_length=1,
        max_length=200,
        description="Upstream model name the replicas serve (full weights replace it in place).",
    )
    weights_location: str = Field(
        min_length=1,
        max_length=4096,
        description="Checkpoint directory (config + safetensors) every vLLM replica can read.",
    )
    drain_timeout_s: float | None = Field(
        default=None,
        ge=0,
        le=3600,
        description="Mode 'drain': seconds calls in flight may take to finish before they "
        "are aborted (default: the gateway's weight_update_drain_timeout_s).",
    )
    mode: UpdateMode | None = Field(
        default=None,
        description="'keep': calls in flight are paused in vLLM and continue on the new "
        "weights, each token recording its version; 'drain': they finish or are aborted "
        "(default: the gateway's weight_update_mode).",
    )


class WeightUpdatePublic(BaseModel):
    version: int
    model_name: str
    weights_location: str
    replicas: list[str] = Field(description="The vLLM replicas reloaded, in order.")
    pause_ms: float = Field(description="How long new calls were held (gate closed to open).")
    drained_calls: int = Field(description="Calls in flight that finished within the limit.")
    aborted_calls: int = Field(description="Calls still sampling at the limit: aborted.")
    held_calls: int = Field(description="Calls that arrived during the pause and were held.")
    mode: UpdateMode = Field(description="How the calls in flight were treated.")
    kept_calls: int = Field(description="Mode 'keep': calls in flight across the reload.")
    split_unknown_calls: int = Field(
        description="Kept calls whose tokens before the reload the gateway could not count "
        "(unary calls, streams too slow to read): flagged policy_version_split_unknown, never "
        "trained on, unless the engine reports the split itself (an exact continuation's "
        "weight_versions)."
    )
    unresumed_replicas: list[str] = Field(
        default_factory=list,
        description="Mode 'keep': replicas whose /resume failed after the version became "
        "active (tried 3 times): no call is routed to them and /ready counts them unhealthy "
        "until a /resume, retried at each health check, succeeds.",
    )


class ApiKeyCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    trajectory_id: str | None = Field(
        default=None,
        pattern=TRAJECTORY_ID_PATTERN.pattern,
        description="Bind the key to a trajectory (an id as the gateway checks it).",
    )
    channel: str | None = Field(
        default=None,
        pattern=CHANNEL_PATTERN.pattern,
        description="Bind the key to a channel (a channel name as the gateway checks it).",
    )


class ApiKeyIssued(BaseModel):
    id: str
    name: str
    key: str = Field(description="Shown once; only its hash is stored.")


class ApiKeyPublic(BaseModel):
    id: str
    name: str
    trajectory_id: str | None
    channel: str | None
    created_at: datetime
    revoked_at: datetime | None


def _public(row: Any) -> PolicyVersionPublic:
    return PolicyVersionPublic.model_validate(row, from_attributes=True)


@router.get("/policy-versions")
async def list_policy_versions(state: AdminDep) -> list[PolicyVersionPublic]:
    return [_public(row) for row in await run_in_threadpool(state.policy.list)]


@router.post("/policy-versions", status_code=201)
async def register_policy_version(
    body: PolicyVersionCreate, state: AdminDep
) -> PolicyVersionPublic:
    """Register a version (and by default switch agents asking for the alias to it). An
    identical re-send answers the stored row; 409 ``policy_version_conflict`` when the version
    is registered with another model name or weights location (nothing changes); 400
    ``model_not_served`` naming the served models when no replica lists ``model_name`` (load
    the adapter or weights into vLLM first; not checked when no replica answers its list)."""
    served = await served_models(
        state.client,
        [replica.url for replica in state.upstreams.replicas],
        state.settings.upstream_connect_timeout_s,
    )
    if served is not None and body.model_name not in served:
        # Registered anyway, every call for the alias would reach vLLM and fail as a 404.
        raise InvalidRequestError(
            f"model_name {body.model_name!r} is not served by vLLM; the replicas serve "
            f"{sorted(served)} (load the adapter or weights into vLLM, then register it)",
            param="model_name",
            code="model_not_served",
        )
    row, _ = await run_in_threadpool(
        state.policy.register, body.version, body.model_name, body.weights_location, body.activate
    )
    return _public(row)


@router.post("/policy-versions/{version}/activate")
async def activate_policy_version(
    version: Annotated[int, Path(ge=0, le=INTEGER_MAX)], state: AdminDep
) -> PolicyVersionPublic:
    return _public(await run_in_threadpool(state.policy.activate, version))


@router.post("/weight-updates", status_code=201)
async def update_weights(body: WeightUpdateCreate, state: AdminDep) -> WeightUpdatePublic:
    """Publish full weights without a step whose tokens' versions are unknown: hold new calls;
    mode ``keep`` pauses every replica keeping its requests, reloads, registers and activates
    ``version``, records on each call in flight which tokens came before, and resumes (nothing
    aborted); mode ``drain`` lets the calls in flight finish (aborting them past
    ``weight_update_drain_timeout_s``), then reloads every replica in place, resets its prefix
    cache and registers ``version``. Then the held calls are released (stamped with
    ``version``). 409 ``policy_version_conflict`` when ``version`` is registered with another
    model name or weights location (nothing paused; an identical re-send reloads the same
    weights again); 409 when this gateway runs several worker processes (the pause
    would hold only this one; nothing paused); 502 ``weight_update_failed`` when a replica
    failed the update (the version is not registered, the held calls are released; the
    message names the replicas that accepted the reload, which are refused calls until a
    publish succeeds, ``UpstreamPool.replacing_weights``; publish again). A replica whose
    ``/resume`` fails does not fail the publish (the version is active): it is named in
    ``unresumed_replicas`` and left out of routing until its resume, retried at each health
    check, succeeds (``UpstreamPool.mark_paused``). Every exchange with a replica has one
    overall deadline (``weight_update_exchange_timeout_s``; the reload
    ``upstream_total_timeout_s``), so the pause is bounded."""
    if state.settings.workers > 1:
        raise ConflictError(
            f"full-weight updates need a gateway with one worker process, this one runs "
            f"{state.settings.workers} (TRAJGATE_WORKERS): the pause would hold only the worker "
            "that received it. Publish through a one-worker gateway, or publish LoRA adapters "
            "(never paused).",
            code="weight_update_needs_one_worker",
        )
    # The version is claimed in the database before anything pauses: of two publishes of one
    # version with different weights (in turn, at once, or through gateways sharing the
    # database) exactly one inserts the row; the other is refused here, nothing paused.
    _, claimed = await run_in_threadpool(
        state.policy.register, body.version, body.model_name, body.weights_location, False
    )
    urls = [replica.url for replica in state.upstreams.replicas]

    reload_timeout_s = state.settings.upstream_total_timeout_s
    timeout_s = state.settings.weight_update_exchange_timeout_s
    mode = body.mode or state.settings.weight_update_mode

    async def register() -> None:
        await run_in_threadpool(
            state.policy.register, body.version, body.model_name, body.weights_location, True
        )

    upstreams = state.upstreams
    location = body.weights_location

    async def reload_and_register() -> None:
        with upstreams.replacing_weights(body.version):
            await reload_replicas(state.client, urls, location, timeout_s, reload_timeout_s)
            await register()

    label = reload_label(body.version)

    async def pause_reload_and_register() -> None:
        await pause_replicas(state.client, urls, timeout_s)
        with upstreams.replacing_weights(body.version):
            await reload_kept_replicas(
                state.client, urls, location, label, timeout_s, reload_timeout_s
            )
            await register()

    unresumed: list[str] = []

    async def resume() -> None:
        unresumed.extend(await resume_replicas(state.client, urls, timeout_s))
        upstreams.mark_paused(unresumed)

    gate = upstreams.gate
    try:
        if mode == "keep":
            _, report = await gate.keep(pause_reload_and_register, resume, body.version, label)
        elif mode == "drain":
            drain_timeout_s = body.drain_timeout_s
            if drain_timeout_s is None:
                drain_timeout_s = state.settings.weight_update_drain_timeout_s
            _, report = await gate.pause(reload_and_register, drain_timeout_s)
        else:
            raise ValueError(f"weight update mode must be one of {UPDATE_MODES}, got {mode!r}")
    except ReloadError as exc:
        if claimed:
            await run_in_threadpool(state.policy.unregister_unused, body.version)
        refused = (
            f"; calls to {exc.weights_unknown} are refused (503 replica_weights_unknown) until "
            "a publish succeeds"
            if exc.weights_unknown
            else ""
        )
        paused = (
            f"; replicas not resumed (no call routed to them, /resume retried at each health "
            f"check): {unresumed}"
            if unresumed
            else ""
        )
        raise UpstreamError(
            f"{exc}; version {body.version} is not registered{refused}{paused}: publish again",
            code="weight_update_failed",
        ) from exc
    state.metrics.record_weight_update(report)
    return WeightUpdatePublic(
        version=body.version,
        model_name=body.model_name,
        weights_location=body.weights_location,
        replicas=urls,
        pause_ms=report.pause_ms,
        drained_calls=report.drained_calls,
        aborted_calls=report.aborted_calls,
        held_calls=report.held_calls,
        mode=report.mode,
        kept_calls=report.kept_calls,
        split_unknown_calls=report.split_unknown_calls,
        unresumed_replicas=unresumed,
    )


@router.post("/api-keys", status_code=201)
async def issue_api_key(body: ApiKeyCreate, state: AdminDep) -> ApiKeyIssued:
    key_id, key = await run_in_threadpool(
        state.keys.issue, body.name, body.trajectory_id, body.channel
    )
    return ApiKeyIssued(id=key_id, name=body.name, key=key)


@router.get("/api-keys")
async def list_api_keys(state: AdminDep) -> list[ApiKeyPublic]:
    rows = await run_in_threadpool(state.keys.list)
    return [ApiKeyPublic.model_validate(row, from_attributes=True) for row in rows]


@router.delete("/api-keys/{key_id}", status_code=204)
async def revoke_api_key(key_id: str, state: AdminDep) -> None:
    await run_in_threadpool(state.keys.revoke, key_id)
