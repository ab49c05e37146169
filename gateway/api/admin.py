"""Management endpoints under ``/admin``: policy versions, weight updates, agent API keys.

Owns: the HTTP surface of the policy registry, of weight updates (full weights: the pause
around an in-place reload, ``gateway.upstream.weight_update``; LoRA: a new adapter per
version, ``gateway.upstream.adapters``) and of the key ring, behind the admin token.
Never: serves agents; OpenAI routes live in ``gateway.proxy.routes``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, get_args

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from datapool.models import INTEGER_MAX
from gateway.api.bodies import PoolRoute, StrictBody
from gateway.api.dependencies import AdminDep
from gateway.engine.admin import (
    AdapterRefusedError,
    ReloadError,
    listed_adapters,
    load_adapter,
    pause_replicas,
    reload_kept_replicas,
    reload_replicas,
    resume_replicas,
    unload_adapters,
)
from gateway.engine.models import base_models_everywhere, served_models
from gateway.errors import (
    ConflictError,
    InvalidRequestError,
    TrajgateError,
    UpstreamError,
)
from gateway.proxy.attribution import CHANNEL_PATTERN, TRAJECTORY_ID_PATTERN
from gateway.settings import UPDATE_MODES, UpdateMode
from gateway.state import GatewayState
from gateway.upstream.adapters import (
    ADAPTER_PREFIX_PATTERN,
    DEFAULT_ADAPTER_PREFIX,
    adapter_name,
    stale_adapters,
)
from gateway.upstream.weight_update import reload_label

router = APIRouter(prefix="/admin", tags=["admin"], route_class=PoolRoute)


class PolicyVersionCreate(StrictBody):
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


# What a weight update publishes: a LoRA adapter (loaded beside the base weights, never paused)
# or full weights (reloaded in place around a pause).
WeightFormat = Literal["lora", "full"]
WEIGHT_FORMATS: tuple[str, ...] = get_args(WeightFormat)


class WeightUpdateCreate(StrictBody):
    version: int = Field(
        ge=0, le=INTEGER_MAX, description="The policy version the new weights are."
    )
    weight_format: WeightFormat = Field(
        default="full",
        description="'full': weights reloaded in place under model_name, around a pause of the "
        "calls; 'lora': an adapter loaded into every replica as <adapter_prefix>-v<version>, "
        "nothing paused.",
    )
    model_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Full weights (required): the upstream model name the replicas serve, "
        "replaced in place. Not sent for LoRA: the gateway names the adapter.",
    )
    adapter_prefix: str | None = Field(
        default=None,
        pattern=ADAPTER_PREFIX_PATTERN.pattern,
        description="LoRA: the adapter is loaded as <adapter_prefix>-v<version> (default "
        "'policy'); a prefix per run keeps runs sharing replicas apart.",
    )
    weights_location: str = Field(
        min_length=1,
        max_length=4096,
        description="Checkpoint directory (config + safetensors) or LoRA adapter directory "
        "every vLLM replica can read.",
    )
    drain_timeout_s: float | None = Field(
        default=None,
        ge=0,
        le=3600,
        description="Full weights, mode 'drain': seconds calls in flight may take to finish "
        "before they are aborted (default: the gateway's weight_update_drain_timeout_s).",
    )
    mode: UpdateMode | None = Field(
        default=None,
        description="Full weights: 'keep': calls in flight are paused in vLLM and continue on "
        "the new weights, each token recording its version; 'drain': they finish or are "
        "aborted (default: the gateway's weight_update_mode).",
    )


class WeightUpdatePublic(BaseModel):
    version: int
    weight_format: WeightFormat
    model_name: str = Field(description="The upstream model name serving the version.")
    weights_location: str
    replicas: list[str] = Field(description="The vLLM replicas updated, in order.")
    pause_ms: float = Field(
        description="How long new calls were held (gate closed to open); 0 for LoRA."
    )
    drained_calls: int = Field(description="Calls in flight that finished within the limit.")
    aborted_calls: int = Field(description="Calls still sampling at the limit: aborted.")
    held_calls: int = Field(description="Calls that arrived during the pause and were held.")
    mode: UpdateMode | None = Field(
        description="Full weights: how the calls in flight were treated; None for LoRA (the "
        "calls in flight finish on their adapter)."
    )
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
    unloaded_adapters: list[str] = Field(
        default_factory=list,
        description="LoRA: the adapters unloaded from the replicas after the switch, this "
        "registry's past the newest lora_adapters_kept.",
    )


class ApiKeyCreate(StrictBody):
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
    # Registered anyway, every call for the alias would reach vLLM and fail as a 404.
    await _check_served(
        state, body.model_name, "load the adapter or weights into vLLM, then register it"
    )
    row, _ = await run_in_threadpool(
        state.policy.register, body.version, body.model_name, body.weights_location, body.activate
    )
    return _public(row)


async def _check_served(
    state: GatewayState, model_name: str, fix: str, *, base_everywhere: bool = False
) -> None:
    """Raise 400 ``model_not_served`` (naming the served models and ``fix``) when no replica
    lists ``model_name`` in its model list, or, with ``base_everywhere``, when not every
    answering replica lists it as a base model (an entry without ``parent``, not a LoRA
    adapter); unchecked when no replica answers one."""
    urls = [replica.url for replica in state.upstreams.replicas]
    timeout_s = state.settings.upstream_connect_timeout_s
    if base_everywhere:
        served = await base_models_everywhere(state.client, urls, timeout_s)
        which = "the base models (not LoRA adapters) every replica serves are"
    else:
        served = await served_models(state.client, urls, timeout_s)
        which = "the replicas serve"
    if served is not None and model_name not in served:
        raise InvalidRequestError(
            f"model_name {model_name!r} is not served by vLLM; {which} {sorted(served)} ({fix})",
            param="model_name",
            code="model_not_served",
        )


@router.post("/policy-versions/{version}/activate")
async def activate_policy_version(
    version: Annotated[int, Path(ge=0, le=INTEGER_MAX)], state: AdminDep
) -> PolicyVersionPublic:
    return _public(await run_in_threadpool(state.policy.activate, version))


@router.post("/weight-updates", status_code=201)
async def update_weights(body: WeightUpdateCreate, state: AdminDep) -> WeightUpdatePublic:
    """Publish new weights as policy version ``version``: LoRA (``weight_format: "lora"``) or
    full weights (the default); the trainer publishes both here (``trainer_bridge.sync``).

    LoRA: see ``_publish_adapter`` (nothing paused). Full weights: publish without a step
    whose tokens' versions are unknown: hold new calls;
    mode ``keep`` pauses every replica keeping its requests, reloads, registers and activates
    ``version``, records on each call in flight which tokens came before, and resumes (nothing
    aborted); mode ``drain`` lets the calls in flight finish (aborting them past
    ``weight_update_drain_timeout_s``), then reloads every replica in place, resets its prefix
    cache and registers ``version``. Then the held calls are released (stamped with
    ``version``). 400 when ``model_name`` is missing or ``adapter_prefix`` sent (LoRA only);
    400 ``model_not_served`` when ``model_name`` is not a base model (a ``/v1/models`` entry
    without ``parent``: a LoRA adapter's name is refused) that every answering replica lists
    (nothing paused or registered; not checked when no replica answers its list);
    409 ``policy_version_conflict`` when ``version`` is registered with another
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
    if body.weight_format == "lora":
        return await _publish_adapter(body, state)
    if body.weight_format != "full":
        raise ValueError(
            f"weight_format must be one of {WEIGHT_FORMATS}, got {body.weight_format!r}"
        )
    if body.adapter_prefix is not None:
        raise InvalidRequestError(
            f"adapter_prefix applies to weight_format 'lora' only, got {body.adapter_prefix!r} "
            "with full weights (reloaded in place under model_name): leave it out",
            param="adapter_prefix",
        )
    if body.model_name is None:
        raise InvalidRequestError(
            "model_name is required for full weights: the upstream model name the replicas "
            "serve, whose weights are replaced in place",
            param="model_name",
        )
    model_name = body.model_name
    if state.settings.workers > 1:
        raise ConflictError(
            f"full-weight updates need a gateway with one worker process, this one runs "
            f"{state.settings.workers} (TRAJGATE_WORKERS): the pause would hold only the worker "
            "that received it. Publish through a one-worker gateway, or publish LoRA adapters "
            "(never paused).",
            code="weight_update_needs_one_worker",
        )
    # The reload replaces the base weights of every replica under the name: a name they do not
    # serve would pause every call, reload, and activate a version whose model every call for
    # the alias asks vLLM for in vain (404); a LoRA adapter's name, or a base model only some
    # replicas serve, would reload the base weights and stamp its steps with a version their
    # model never had. Checked before the claim: nothing paused or stored.
    await _check_served(
        state,
        model_name,
        "full weights replace a served model's in place: name the base model every replica "
        "serves, or publish an adapter with weight_format 'lora'",
        base_everywhere=True,
    )
    # The version is claimed in the database before anything pauses: of two publishes of one
    # version with different weights (in turn, at once, or through gateways sharing the
    # database) exactly one inserts the row; the other is refused here, nothing paused.
    _, claimed = await run_in_threadpool(
        state.policy.register, body.version, model_name, body.weights_location, False
    )
    urls = [replica.url for replica in state.upstreams.replicas]

    reload_timeout_s = state.settings.upstream_total_timeout_s
    timeout_s = state.settings.weight_update_exchange_timeout_s
    mode = body.mode or state.settings.weight_update_mode

    async def register() -> None:
        await run_in_threadpool(
            state.policy.register, body.version, model_name, body.weights_location, True
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
        weight_format="full",
        model_name=model_name,
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


async def _publish_adapter(body: WeightUpdateCreate, state: GatewayState) -> WeightUpdatePublic:
    """Publish the LoRA adapter at ``weights_location`` as ``version``: load it into every
    replica as ``<adapter_prefix>-v<version>`` (a name of its own: never one loaded before, so
    no call's prefix cache or tokens come from another version), register and activate the
    version with that model name, then unload this registry's adapters past the newest
    ``lora_adapters_kept`` (never the active one).

    No pause, and nothing held or aborted: the base weights do not change, and a call in
    flight resolved the alias to its adapter's name before the switch, so it samples every
    token on that adapter, which stays loaded (``gateway.upstream.adapters`` says why even an
    unloaded one would serve it); calls resolving after the switch sample on the new one. So
    several worker processes may publish LoRA (the others pick the switch up within
    ``policy_refresh_s``, their previous adapter still loaded: ``lora_adapters_kept`` >= 2).
    It runs between this process's full-weight pauses (``WeightGate.exclusive``): no adapter
    is loaded into a replica being paused or reloaded, and two updates' unloads never cross.

    The failure rules of full weights: the version is claimed before anything loads (409
    ``policy_version_conflict`` for other weights under it; an identical re-send loads the
    same weights in place) and activated only once every replica loaded it, so no call is ever
    stamped with a version that a replica does not serve. A replica that refuses the adapter
    as sent is 400 (``lora_not_enabled``: it runs without runtime LoRA; ``lora_adapter_not_found``:
    no adapter at the path, as the replica sees its disk; ``lora_adapter_refused``: vLLM's
    reason kept); one that fails otherwise is 502 ``weight_update_failed``. Either way the
    adapter is unloaded from the replicas that loaded it and the claim given back (a re-send
    of a registered version unloads nothing: it may be serving). Each load has one overall
    deadline (``upstream_total_timeout_s``), each unload and list
    ``weight_update_exchange_timeout_s``.

    Raises:
        InvalidRequestError: ``model_name``, ``mode`` or ``drain_timeout_s`` sent (full weights
            only), or a replica refused the adapter as sent.
        UpstreamError: a replica failed the load (``weight_update_failed``).
    """
    for field in ("model_name", "mode", "drain_timeout_s"):
        value = getattr(body, field)
        if value is not None:
            raise InvalidRequestError(
                f"{field} applies to full weights only, got {value!r} with weight_format "
                "'lora': the gateway names the adapter <adapter_prefix>-v<version> and pauses "
                "nothing; leave it out",
                param=field,
            )
    name = adapter_name(body.adapter_prefix or DEFAULT_ADAPTER_PREFIX, body.version)
    location = body.weights_location
    _, claimed = await run_in_threadpool(state.policy.register, body.version, name, location, False)
    urls = [replica.url for replica in state.upstreams.replicas]
    settings = state.settings
    timeout_s = settings.weight_update_exchange_timeout_s

    async def give_back(loaded: list[str]) -> None:
        """Undo a claimed publish that failed: no replica keeps the adapter, no row stays."""
        if not claimed:
            return  # a re-send of a registered version: its adapter may be serving
        for url in loaded:
            await unload_adapters(state.client, url, [name], timeout_s)
        await run_in_threadpool(state.policy.unregister_unused, body.version)

    async with state.upstreams.gate.exclusive():  # one update of the replicas at a time
        try:
            await load_adapter(
                state.client,
                urls,
                name,
                location,
                settings.upstream_total_timeout_s,
                in_place=not claimed,
            )
        except ReloadError as exc:
            await give_back(exc.reloaded)
            raise _adapter_error(exc, name, body.version) from exc
        try:
            await run_in_threadpool(state.policy.register, body.version, name, location, True)
        except BaseException:
            await give_back(urls)
            raise
        registered = [
            (row.version, row.model_name) for row in await run_in_threadpool(state.policy.list)
        ]
        unloaded: list[str] = []
        for url, listed in (await listed_adapters(state.client, urls, timeout_s)).items():
            stale = stale_adapters(listed, registered, settings.lora_adapters_kept, name)
            for gone in (await unload_adapters(state.client, url, stale, timeout_s)).unloaded:
                if gone not in unloaded:
                    unloaded.append(gone)
    return WeightUpdatePublic(
        version=body.version,
        weight_format="lora",
        model_name=name,
        weights_location=location,
        replicas=urls,
        pause_ms=0.0,
        drained_calls=0,
        aborted_calls=0,
        held_calls=0,
        mode=None,
        kept_calls=0,
        split_unknown_calls=0,
        unloaded_adapters=unloaded,
    )


def _adapter_error(exc: ReloadError, name: str, version: int) -> TrajgateError:
    """The one error of a LoRA publish that failed on a replica (see ``_publish_adapter``)."""
    undone = f"version {version} is not registered and no replica keeps {name}"
    if not isinstance(exc, AdapterRefusedError):
        return UpstreamError(f"{exc}; {undone}: publish again", code="weight_update_failed")
    fix = {
        "lora_not_enabled": "start vLLM with --enable-lora and "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (as `trajgate vllm start` does), or publish "
        "full weights",
        "lora_adapter_not_found": "weights_location must be a LoRA adapter directory "
        "(adapter_config.json + weights) that every replica can read",
        "lora_adapter_refused": "see vLLM's reason",
    }[exc.code]
    return InvalidRequestError(
        f"replica {exc.url} refused the LoRA adapter {name} ({exc.detail}): {fix}; {undone}",
        param="weights_location" if exc.code == "lora_adapter_not_found" else "weight_format",
        code=exc.code,
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
