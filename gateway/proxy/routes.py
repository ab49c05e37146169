"""The model-serving surface: every API dialect's routes (``gateway.dialects``) and models.

Owns: attribution of a call to a trajectory (URL, header or API key), Idempotency-Key replays and
re-send detection, the upstream attempt loop (retries only before any byte reached the client),
the order "upstream answers → steps commit → client gets the (last part of the) answer" for
unary answers (streams: ``gateway.proxy.streaming``), and the first-byte and total time limits, the
same for every dialect. Never: looks inside a request or an answer (the dialect reads and renders
them); never retries after a timeout (tokens may already have been generated).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NoReturn, TypeVar

import anyio
import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy.exc import SQLAlchemyError

from datapool.lifecycle.transitions import ensure_trajectory
from datapool.models import StepOutcome
from datapool.steps.calls import find_exchange, find_replay, find_resend
from datapool.steps.faults import is_storage_fault
from gateway.body_budget import hold_answers
from gateway.capture import UNREADABLE, dumps, loads_object, request_hash
from gateway.dialects import (
    Dialect,
    EarlierCall,
    EngineRefused,
    Prepared,
    SideRoute,
    check_limits,
    with_sampling_defaults,
)
from gateway.errors import (
    PermissionDeniedError,
    ServiceUnavailableError,
    UpstreamError,
    UpstreamTimeoutError,
)
from gateway.proxy.attribution import (
    Attribution,
    attribute,
    check_engine_fields,
    check_idempotency_key,
    check_model,
    check_trajectory_id,
    read_json_object,
)
from gateway.proxy.call import Call, commit, fail_call, failed_choice
from gateway.proxy.continuation.engine import (
    CONTINUATION_MODES,
    PARSED_ANSWER,
    Continuation,
    RenderAhead,
    continues_exactly,
    render_ahead,
    send_exact,
)
from gateway.proxy.continuation.history import (
    HistoryKeys,
    find_extension,
    render_key,
    stored_turn,
)
from gateway.proxy.continuation.walk import walk_history
from gateway.proxy.lifetime import CallLifetime
from gateway.proxy.sampling import apply_policy, sampling_record
from gateway.proxy.streaming import first_event, relay_stream
from gateway.state import GatewayState, StateDep
from gateway.upstream.answer_limit import AnswerTooLargeError
from gateway.upstream.replicas import (
    CHAT_PATH,
    InFlight,
    NoHealthyUpstreamError,
    Replica,
    ReplicaResponse,
)
from gateway.upstream.weight_update import (
    ABORTED_FOR_WEIGHT_UPDATE,
    CallAborted,
    aborted_error,
)

log = logging.getLogger("trajgate.proxy")
T = TypeVar("T")

RETRYABLE_STATUS = frozenset({502, 503, 504})
JSON_CONTENT = {"content-type": "application/json"}


router = APIRouter()  # the routes every app serves whatever its dialects: ``/v1/models``


# -- routes ------------------------------------------------------------------------------


def dialect_router(dialects: Sequence[Dialect]) -> APIRouter:
    """The routes of ``dialects`` (``add_dialect_routes`` for each): an app serves the
    dialects it was built with (``gateway.app.create_app``)."""
    dialect_routes = APIRouter()
    for dialect in dialects:
        add_dialect_routes(dialect_routes, dialect)
    return dialect_routes


def add_dialect_routes(router: APIRouter, dialect: Dialect) -> None:
    """Serve each of the dialect's client paths at ``/t/{trajectory_id}/v1<path>`` (attributed
    by URL) and ``/v1<path>`` (attributed by header or API key), and its side routes
    (``Dialect.side_routes``) at the same two places."""

    async def by_url(trajectory_id: str, request: Request, state: StateDep) -> Response:
        return await proxy_call(state, request, dialect, trajectory_id)

    async def by_header(request: Request, state: StateDep) -> Response:
        return await proxy_call(state, request, dialect, None)

    name = dialect.name.replace(".", "_")  # chat_completions, completions: OpenAPI operation ids
    for path in dialect.client_paths:
        router.add_api_route(
            f"/t/{{trajectory_id}}/v1{path}", by_url, methods=["POST"], name=f"{name}_by_url"
        )
        router.add_api_route(f"/v1{path}", by_header, methods=["POST"], name=name)
    for side in dialect.side_routes:
        add_side_route(router, dialect, side)


def add_side_route(router: APIRouter, dialect: Dialect, side: SideRoute) -> None:
    """Serve one of the dialect's side routes at ``/t/{trajectory_id}/v1<path>`` and
    ``/v1<path>`` (``answer_side_route``)."""

    async def by_url(trajectory_id: str, request: Request, state: StateDep) -> Response:
        return await answer_side_route(state, request, dialect, side, trajectory_id)

    async def by_header(request: Request, state: StateDep) -> Response:
        return await answer_side_route(state, request, dialect, side, None)

    name = f"{dialect.name}{side.path}".replace(".", "_").replace("/", "_")
    router.add_api_route(
        f"/t/{{trajectory_id}}/v1{side.path}", by_url, methods=["POST"], name=f"{name}_by_url"
    )
    router.add_api_route(f"/v1{side.path}", by_header, methods=["POST"], name=name)


@dataclass(frozen=True)
class ReplicaEngine:
    """``Dialect``'s ``Engine`` on one replica: vLLM's endpoints a side route may use."""

    client: httpx.AsyncClient
    replica: Replica

    async def tokenize(self, payload: dict[str, Any]) -> dict[str, Any]:
        url = self.replica.url
        try:
            response = await self.client.post(
                f"{url}/tokenize", content=dumps(payload), headers=JSON_CONTENT
            )
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream {url} unreachable: {exc!r}") from exc
        if response.status_code != 200:
            raise EngineRefused(response.status_code, response.content)
        try:
            return loads_object(response.content)
        except UNREADABLE as exc:
            raise UpstreamError(f"upstream {url} answered /tokenize unreadably: {exc!r}") from exc


async def answer_side_route(
    state: GatewayState,
    request: Request,
    dialect: Dialect,
    side: SideRoute,
    trajectory_id: str | None,
) -> Response:
    """One of a dialect's side routes (``SideRoute``): not a call, nothing is recorded, but
    the key passes a call's checks (401, 403 for another trajectory or channel: a bound key
    learns nothing about another trajectory, not even a token count). Errors (the body's,
    vLLM's) in the dialect's envelope; vLLM's error status passed on."""
    request.state.render_error = dialect.render_error
    if trajectory_id is not None:
        check_trajectory_id(trajectory_id)
    attribution = await attribute(state, request, trajectory_id)
    body = await read_json_object(request, state.settings.max_body_bytes)
    await settle_channel(state, attribution)  # a refusal only: nothing here follows the channel
    replica = state.upstreams.pick(attribution.trajectory_id)
    try:
        answer = await side.answer(body, ReplicaEngine(state.client, replica))
    except EngineRefused as refused:
        return Response(
            dialect.upstream_error_body(refused.status_code, refused.content),
            status_code=refused.status_code,
            media_type="application/json",
        )
    return Response(dumps(answer), media_type="application/json")


@router.get("/t/{trajectory_id}/v1/models")
async def models_by_url(trajectory_id: str, request: Request, state: StateDep) -> Response:
    check_trajectory_id(trajectory_id)
    return await list_models(request, state)


@router.get("/v1/models")
async def list_models(request: Request, state: StateDep) -> Response:
    """vLLM's model list from the first healthy replica, passed through unchanged."""
    if state.settings.api_key_required:
        await attribute(state, request, None)
    replica = state.upstreams.pick("models")
    try:
        upstream = await state.client.get(f"{replica.url}/v1/models")
    except httpx.HTTPError as exc:
        raise UpstreamError(f"upstream {replica.url} unreachable: {exc!r}") from exc
    return Response(
        upstream.content,
        status_code=upstream.status_code,
        media_type=upstream.headers.get("content-type"),
    )


async def proxy_call(
    state: GatewayState, request: Request, dialect: Dialect, url_trajectory_id: str | None
) -> Response:
    """Forward one call upstream, commit its steps, and answer as the dialect answers.

    Every error of the call is rendered in the dialect's shape (``request.state.render_error``,
    read by the app's error handlers). The call counts as in flight for its trajectory
    (``PoolWriter.call_started``) until its commit ended, so the idle timeout never closes a
    trajectory under a call of this gateway. It passes the weight gate before its policy
    version is resolved (held while a full-weight update is on: ``gateway.upstream.weight_update``).
    """
    request.state.render_error = dialect.render_error
    if url_trajectory_id is not None:
        check_trajectory_id(url_trajectory_id)
    # The key first: an unauthenticated client never gets its body read.
    attribution = await attribute(state, request, url_trajectory_id)
    body = await read_json_object(request, state.settings.max_body_bytes)
    prepared = dialect.prepare(body)  # the call's one translation: a bad body is a 400 now
    check_model(body)
    check_engine_fields(body, state.settings.allow_client_kv_transfer_params)
    if not prepared.stream:
        hold_answers()  # read whole, its answer's bytes count in the body budget as they come
    attribution = await settle_channel(state, attribution)
    writer = state.writer
    assert writer is not None, "the lifespan starts the pool writer"
    writer.check_accepting()
    async with CallLifetime(writer, attribution.trajectory_id) as lifetime:
        lifetime.ticket = await state.upstreams.gate.admit()
        if body.get("stream") is True:
            lifetime.ticket.streams()  # its tokens are counted as read: a kept reload splits them
        response = await forward_call(state, request, dialect, prepared, attribution, lifetime)
        if isinstance(response, StreamingResponse):
            # A stream commits at its end, inside its generator: the call ends with the stream.
            return lifetime.hand_over(response)
        return response


async def forward_call(
    state: GatewayState,
    request: Request,
    dialect: Dialect,
    prepared: Prepared,
    attribution: Attribution,
    lifetime: CallLifetime,
) -> Response:
    """``proxy_call`` once the call is attributed, counted in flight and admitted
    (``lifetime.ticket``); the open upstream response is handed to ``lifetime``, which closes
    it however the call ends.

    A full-weight update that aborts the call while it waits for its upstream records it as
    ``aborted_for_weight_update`` and answers 503 (``weight_update.aborted_error``).
    """
    idempotency_key = check_idempotency_key(request.headers.get("idempotency-key"))
    if idempotency_key:
        replay = await replayed_answer(state, attribution, idempotency_key)
        if replay is not None:
            return replay
    call = await new_call(state, dialect, prepared, attribution, idempotency_key)
    call.ticket = ticket = lifetime.ticket
    try:
        upstream = lifetime.upstream = await ticket.guard(open_upstream(state, call))
    except CallAborted:
        await abort_call(state, call, None)
    finally:
        call.continuation.discard()  # a render sent ahead that no attempt took
    if not call.prepared.stream:
        ticket.release()  # the whole answer is in: its sampling ended
    try:
        return await answer_call(state, call, upstream)
    except CallAborted:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
        await abort_call(state, call, upstream.replica)


async def abort_call(state: GatewayState, call: Call, replica: Replica | None) -> NoReturn:
    """Record a call a full-weight update aborted before its first token reached the client,
    and raise its 503."""
    call.ticket.release()
    call.add_attempt(replica, ABORTED_FOR_WEIGHT_UPDATE, error="weight update")
    await fail_call(state, call, replica, ABORTED_FOR_WEIGHT_UPDATE, "aborted for a weight update")
    raise aborted_error()


async def replayed_answer(
    state: GatewayState, attribution: Attribution, idempotency_key: str
) -> Response | None:
    """The stored answer of the trajectory's earlier call with this Idempotency-Key, if any."""
    replay = await pool_lookup(
        state, find_replay, state.store.sessions, attribution.trajectory_id, idempotency_key
    )
    if replay is None:
        return None
    state.metrics.replays.inc()
    return JSONResponse(
        replay[1],
        headers={
            "x-trajgate-trajectory-id": attribution.trajectory_id,
            "x-trajgate-call-id": replay[0],
            "x-trajgate-replayed": "true",
        },
    )


async def new_call(
    state: GatewayState,
    dialect: Dialect,
    prepared: Prepared,
    attribution: Attribution,
    idempotency_key: str | None,
) -> Call:
    """The ``prepared`` call with the policy alias resolved, the channel's sampling defaults
    where the client omitted a field, and the earlier call it re-sends (same body within
    ``resend_window_s``), whose call id it then shares. A body continuing an earlier call
    (``Dialect.earlier_call_id``) gets that call's step read from the pool.

    The upstream body is final before the pool is asked about re-sends and turns, so an exact
    continuation's render is already on its way meanwhile (``render_ahead_of``); a re-send's
    body is prepared again under the earlier call's id (``send_exact`` takes the render sent
    ahead when that body's JSON is the same)."""
    body = prepared.client_body
    resolution = state.policy.resolve(body.get("model"))
    digest = request_hash(dialect.name, body)
    earlier = await earlier_call(state, dialect, body, attribution)
    defaults = state.settings.sampling_defaults_for(attribution.channel)
    policy = state.settings.sampling_policy_for(attribution.channel)
    tool_strict_level = state.settings.upstream_tool_strict_level

    def prepared_as(call_id: str) -> tuple[Prepared, dict[str, Any]]:
        call = with_sampling_defaults(
            dialect.prepare_call(prepared, resolution.upstream_model, call_id, earlier), defaults
        )
        call, replaced = apply_policy(dialect, call, policy, defaults, tool_strict_level)
        check_limits(dialect, call, state.settings.generation_limits)
        return call, replaced

    call_id = str(uuid.uuid4())
    final, replaced = prepared_as(call_id)
    ahead = render_ahead_of(state, attribution, dialect, final)
    try:
        if ahead is not None:
            # Let the render reach the replica before the pool lookups below, whose threads
            # would otherwise hold the GIL while the render is still being sent.
            await asyncio.sleep(0)
        resend_of = None
        if state.settings.resend_window_s > 0 and not idempotency_key:
            resend_of = await pool_lookup(
                state,
                find_resend,
                state.store.engine,
                attribution.trajectory_id,
                digest,
                state.settings.resend_window_s,
            )
        if resend_of is not None:
            call_id = resend_of
            final, replaced = prepared_as(call_id)
        continuation, history = await plan_continuation(
            state, attribution, final.upstream_body, dialect
        )
        sampling = sampling_record(
            final.upstream_body,
            state.settings.upstream_logprobs_mode,
            policy,
            replaced,
            tool_strict_level=tool_strict_level,
        )
    except BaseException:
        if ahead is not None:
            ahead.discard()
        raise
    if continuation.extension is not None:
        continuation.ahead = ahead  # from here forward_call discards it, if no attempt takes it
    elif ahead is not None:
        ahead.discard()
    return Call(
        dialect=dialect,
        attribution=attribution,
        body=body,
        prepared=final,
        policy_version=resolution.policy_version,
        call_id=call_id,
        request_hash=digest,
        idempotency_key=idempotency_key,
        resend_of=resend_of,
        continuation=continuation,
        history=history,
        sampling=sampling,
    )


def render_ahead_of(
    state: GatewayState, attribution: Attribution, dialect: Dialect, prepared: Prepared
) -> RenderAhead | None:
    """The exact continuation's render, sent now (``engine.render_ahead``) when the call would
    send one: an exact channel's chat call whose trajectory has a turn in this gateway's
    memory (so it most likely extends one), to the replica ``open_upstream`` will try first,
    once that replica is known to serve exact continuations for this kind of call. None
    otherwise (the render, if any, is then sent when the call goes upstream)."""
    body = prepared.upstream_body
    if (
        state.settings.continuation_for(attribution.channel) != "exact"
        or dialect.upstream_path != CHAT_PATH
        or "kv_transfer_params" in body
        or not state.turns.turns_of(attribution.trajectory_id)
    ):
        return None
    try:
        replica = state.upstreams.pick(attribution.trajectory_id)
    except NoHealthyUpstreamError:
        return None
    if not continues_exactly(replica, body):
        return None
    timeout = None if prepared.stream else upstream_timeout(state)
    return render_ahead(state.client, replica, body, timeout)


async def plan_continuation(
    state: GatewayState, attribution: Attribution, upstream_body: dict[str, Any], dialect: Dialect
) -> tuple[Continuation, HistoryKeys | None]:
    """How the call's prompt will be built: on an exact channel, the latest turn of the
    trajectory its canonical conversation extends (``gateway.proxy.continuation.history``),
    from the gateway's memory or else from the pool (a turn another worker, replica or an
    earlier run of the gateway served), if any; the template's rendering otherwise. With it,
    on an exact channel's chat path, the keys of the call's history (``history_keys``), from
    which its own turn's key is made once answered (``gateway.proxy.call.keyed``)."""
    mode = state.settings.continuation_for(attribution.channel)
    if mode == "template" or dialect.upstream_path != CHAT_PATH:
        return Continuation(mode), None
    if "kv_transfer_params" in upstream_body:  # disaggregated serving chooses its own prompt
        return Continuation(mode), None
    if mode != "exact":
        raise ValueError(f"continuation {mode!r}; valid: {', '.join(CONTINUATION_MODES)}")
    body_key = render_key(
        upstream_body, tool_choice_none_renders=state.upstreams.tool_choice_none_renders()
    )
    trajectory_id = attribution.trajectory_id
    canonical, history = walk_history(
        state.walks,
        trajectory_id,
        upstream_body.get("messages"),
        body_key,
        dialect.name,
        lambda known: dialect.canonical_continuing(upstream_body, known),
    )
    continuation = Continuation(mode, render_key=body_key, canonical=canonical)
    if canonical.messages is None or history is None:  # no conversation: no turn to key
        return continuation, None
    messages = canonical.messages
    candidates = history.candidates
    if not candidates:
        return continuation, history
    memory = state.turns.turns_of(trajectory_id)
    extension = find_extension(candidates, messages, memory.get)
    # A later turn than memory's may be in the pool (served by another process).
    later = [(k, key) for k, key in candidates if extension is None or k >= extension.new_from]
    if later:
        keys = [key for _, key in later]
        stored = await pool_lookup(state, state.store.find_turn, trajectory_id, keys)
        turn = None if stored is None else stored_turn(stored)
        found = None if turn is None else find_extension(later, messages, {turn.key: turn}.get)
        if found is not None:
            state.turns.add(trajectory_id, found.turn)
            extension = found
    continuation.extension = extension
    return continuation, history


async def earlier_call(
    state: GatewayState, dialect: Dialect, body: dict[str, Any], attribution: Attribution
) -> EarlierCall | None:
    """The stored exchange of the trajectory's call that ``body`` continues, if it names one
    and the pool holds it (the dialect refuses a reference that finds nothing)."""
    call_id = dialect.earlier_call_id(body)
    if call_id is None:
        return None
    found = await pool_lookup(
        state, find_exchange, state.store.sessions, attribution.trajectory_id, call_id, needed=True
    )
    return None if found is None else EarlierCall(*found)


async def answer_call(state: GatewayState, call: Call, upstream: ReplicaResponse) -> Response:
    """The client's answer once an upstream answered: its error, its stream, or its JSON."""
    response = upstream.response
    if response.status_code != 200:
        return await upstream_refused(state, call, upstream)
    if not call.prepared.stream:
        return await finish_unary(state, call, upstream)
    reads, first = await call.ticket.guard(first_event(state, call, upstream))
    call.step_ids = [str(uuid.uuid4()) for _ in range(call.prepared.n_choices)]
    return StreamingResponse(
        relay_stream(state, call, upstream, reads, first),
        media_type=response.headers.get("content-type", "text/event-stream"),
        headers=call.headers(call.step_ids, committed=False),
    )


async def upstream_refused(state: GatewayState, call: Call, upstream: ReplicaResponse) -> Response:
    """A non-200 answer the attempt loop did not retry: recorded as one failed step, passed to
    the client with its status (its body as the dialect shows upstream errors)."""
    replica, response = upstream.replica, upstream.response
    hold_answers()  # a stream's error body is read whole too (the stream has not begun)
    try:
        content = await response.aread()
    except httpx.HTTPError as exc:  # a stream's error body broken or past the answer limit
        await upstream.aclose()
        call.add_attempt(replica, StepOutcome.UPSTREAM_ERROR, status_code=response.status_code)
        await fail_call(state, call, replica, StepOutcome.UPSTREAM_ERROR, repr(exc))
        raise UpstreamError(f"upstream {replica.url} answered badly: {exc!r}") from exc
    await upstream.aclose()
    error = content.decode("utf-8", "replace")
    call.add_attempt(
        replica, StepOutcome.UPSTREAM_ERROR, status_code=response.status_code, error=error
    )
    record = call.record(
        replica,
        failed_choice(StepOutcome.UPSTREAM_ERROR),
        outcome=StepOutcome.UPSTREAM_ERROR,
        error=error,
    )
    step_ids = await commit(state, call, record)
    state.metrics.requests.labels(call.dialect.name, str(response.status_code)).inc()
    return Response(
        call.dialect.upstream_error_body(response.status_code, content),
        status_code=response.status_code,
        media_type=response.headers.get("content-type"),
        headers=call.headers(step_ids),
    )


async def settle_channel(state: GatewayState, attribution: Attribution) -> Attribution:
    """The call's attribution with its trajectory's own channel, whose settings the call gets
    (``TRAJGATE_CONTINUATION_CHANNELS``, ``TRAJGATE_SAMPLING_POLICY``,
    ``TRAJGATE_SAMPLING_DEFAULTS``) whatever channel the call names, or none.

    A channel named by ``X-Trajgate-Channel`` or a channel-bound key that is not an existing
    trajectory's own raises ``PermissionDeniedError`` (403) before anything goes upstream: a
    trajectory's channel is set when it is created, and a key bound to a channel writes only
    into that channel's trajectories. A new trajectory is created here in the named channel
    (else 'train'), before anything goes upstream, so that concurrent first calls settle on
    one channel. The pool is read only when the channel can matter: a channel named by the
    call, or settings per channel; a read for a channel-bound key is ``needed`` (refused when
    the pool cannot answer), any other goes on as for a new trajectory in 'serve' mode.
    """
    settings = state.settings
    per_channel = (
        bool(settings.continuation_channels)
        or any(name != "*" for name in settings.sampling_policy)
        or any(name != "*" for name in settings.sampling_defaults)
    )
    if attribution.channel is None and not per_channel:
        return attribution  # every channel gets the same settings and none is named
    trajectory = await pool_lookup(
        state,
        state.store.get_trajectory,
        attribution.trajectory_id,
        needed=attribution.key_channel is not None,
    )
    if trajectory is None:
        # A new trajectory is created now in the channel this call names (insert-or-ignore):
        # concurrent first calls then all read one stored channel and get its settings, where
        # each used to record under the channel it named, a mismatched one accepted too.
        trajectory = await pool_lookup(
            state,
            ensure_trajectory,
            state.store.sessions,
            attribution.trajectory_id,
            attribution.group_id,
            attribution.channel or "train",
            needed=attribution.key_channel is not None,
        )
    if trajectory is None:
        return attribution
    named, own = attribution.channel, trajectory.channel
    if named is not None and named != own:
        if attribution.key_channel is not None:
            raise PermissionDeniedError(
                f"this API key is bound to channel {attribution.key_channel!r}; trajectory "
                f"{attribution.trajectory_id!r} is in channel {own!r}"
            )
        raise PermissionDeniedError(
            f"X-Trajgate-Channel names channel {named!r}; trajectory "
            f"{attribution.trajectory_id!r} is in channel {own!r} (a trajectory's channel is "
            "set when it is created)",
            code="channel_mismatch",
        )
    return replace(attribution, channel=own)


async def pool_lookup(
    state: GatewayState, lookup: Callable[..., T | None], *args: Any, needed: bool = False
) -> T | None:
    """Run a read of the pool before the call goes upstream.

    For a read the call only benefits from (idempotent replay, re-send detection), 'serve' mode
    goes on without it when the database fails it (the call will not be recorded either), and
    'refuse' mode raises ``PoolUnavailableError`` (503) with the fault's reason. A read the call
    is ``needed`` for (an earlier response it continues) raises in both modes.
    """
    try:
        # asyncio's own executor, not anyio's thread runner (``run_in_threadpool``): its
        # capacity limiter and cancel scopes cost more CPU than a SQLite lookup (py-spy, c=16).
        # The lookup is read-only, so a call cancelled meanwhile leaves nothing to undo.
        return await asyncio.get_running_loop().run_in_executor(None, partial(lookup, *args))
    except SQLAlchemyError as exc:
        if not is_storage_fault(exc):
            raise
        assert state.writer is not None, "the lifespan starts the pool writer"
        error = state.writer.report_fault(exc, f"lookup {lookup.__name__}")
        if state.store.settings.on_write_failure == "serve" and not needed:
            return None
        state.writer.stats.refused_calls += 1
        raise error from exc


async def open_upstream(state: GatewayState, call: Call) -> ReplicaResponse:
    """Send the call to a replica, retrying on another one on connection errors and 502/503/504
    (nothing has reached the client yet). Returns the open response, which holds the replica's
    in-flight count until the caller closes it."""
    settings = state.settings
    tried: set[str] = set()
    for attempt in range(settings.upstream_max_attempts):
        if attempt:
            await asyncio.sleep(settings.upstream_retry_backoff_ms * 2 ** (attempt - 1) / 1000)
        replica = pick_replica(state, call, frozenset(tried))
        tried.add(replica.url)
        last = attempt + 1 == settings.upstream_max_attempts
        with InFlight(replica) as in_flight:  # given back on leaving, unless kept
            response = await try_replica(state, call, replica, last=last)
            if response is not None:
                return ReplicaResponse(replica, response, in_flight.keep())
    raise AssertionError("unreachable: the last attempt returns or raises")


def pick_replica(state: GatewayState, call: Call, tried: frozenset[str]) -> Replica:
    """The call's replica among those not tried yet, else among all; 503 when none can capture."""
    try:
        return state.upstreams.pick(call.trajectory_id, tried)
    except NoHealthyUpstreamError:
        try:
            return state.upstreams.pick(call.trajectory_id)
        except NoHealthyUpstreamError as exc:
            raise ServiceUnavailableError(str(exc), code="no_capturing_upstream") from exc


async def try_replica(
    state: GatewayState, call: Call, replica: Replica, *, last: bool
) -> httpx.Response | None:
    """One attempt on ``replica``: the open response, or None to try another replica.

    ``last``: no attempt follows, so a retryable failure fails the call instead. Raises
    ``UpstreamTimeoutError`` (504) or ``UpstreamError`` (502) after recording the failed call.
    """
    settings = state.settings
    stream = call.prepared.stream
    limit_s = (
        settings.upstream_first_byte_timeout_s if stream else settings.upstream_total_timeout_s
    )
    try:
        with anyio.fail_after(limit_s):
            extends = call.continuation.extension is not None
            if extends and replica.serves_exact is None:  # only until the replica is probed
                await state.upstreams.learn_exact(
                    state.client, replica, settings.upstream_connect_timeout_s
                )
            if extends and continues_exactly(replica, call.upstream_body):
                response = await send_exact(
                    state.client,
                    replica,
                    call.upstream_body,
                    call.continuation,
                    None if stream else upstream_timeout(state),
                )
            else:
                response = await state.client.send(
                    upstream_request(state, call, replica), stream=True
                )
                if not stream:
                    await response.aread()
    except (TimeoutError, httpx.TimeoutException) as exc:
        connect = isinstance(exc, httpx.ConnectTimeout)
        outcome = StepOutcome.UPSTREAM_UNREACHABLE if connect else StepOutcome.UPSTREAM_TIMEOUT
        call.add_attempt(replica, outcome, error=repr(exc))
        state.metrics.attempts_failed.labels(outcome).inc()
        if connect:
            state.upstreams.mark_failure(replica)
            if not last:
                return None
        await fail_call(state, call, replica, outcome, repr(exc))
        raise UpstreamTimeoutError(
            f"upstream {replica.url} did not answer within {limit_s:g} s", code=outcome
        ) from exc
    except (httpx.TransportError, httpx.DecodingError) as exc:
        await failed_attempt(state, call, replica, exc, last=last)  # raises unless retried
        return None
    if response.status_code in RETRYABLE_STATUS and not last:
        try:
            content = await response.aread()
        except (httpx.TransportError, httpx.DecodingError) as exc:
            await response.aclose()
            await failed_attempt(state, call, replica, exc, last=last)
            return None
        await response.aclose()
        state.upstreams.mark_failure(replica)
        call.add_attempt(
            replica,
            StepOutcome.UPSTREAM_ERROR,
            status_code=response.status_code,
            error=content.decode("utf-8", "replace"),
        )
        state.metrics.attempts_failed.labels(StepOutcome.UPSTREAM_ERROR).inc()
        return None
    state.upstreams.mark_success(replica)
    return response


async def failed_attempt(
    state: GatewayState, call: Call, replica: Replica, exc: httpx.HTTPError, *, last: bool
) -> None:
    """An attempt that failed at the transport: returns to try another replica, else the call
    is recorded as failed and ``UpstreamError`` (502) raised.

    A replica that could not be reached (refused, reset, ...) is ``upstream_unreachable``. One
    that answered, but not in HTTP (a bad status line, a head too large, a bad chunk size, an
    undecodable body: ``httpx.ProtocolError``, ``httpx.DecodingError``) or past
    ``upstream_max_answer_bytes`` is ``upstream_error``, as the same fault is on a stream once
    its 200 went out: the replica was reached and its answer is what failed. An answer too large
    is not retried: the tokens were generated, and another replica would sample as long.
    """
    reached = isinstance(exc, httpx.ProtocolError | httpx.DecodingError | AnswerTooLargeError)
    outcome = StepOutcome.UPSTREAM_ERROR if reached else StepOutcome.UPSTREAM_UNREACHABLE
    state.upstreams.mark_failure(replica)
    call.add_attempt(replica, outcome, error=repr(exc))
    state.metrics.attempts_failed.labels(outcome).inc()
    if not last and not isinstance(exc, AnswerTooLargeError):
        return
    await fail_call(state, call, replica, outcome, repr(exc))
    if reached:
        raise UpstreamError(f"upstream {replica.url} answered badly: {exc!r}") from exc
    raise UpstreamError(f"upstream {replica.url} unreachable: {exc!r}") from exc


def upstream_request(state: GatewayState, call: Call, replica: Replica) -> httpx.Request:
    """The POST of the call's upstream body to the dialect's upstream path on ``replica``.

    A non-streaming answer arrives whole after generation: its only limit is the total one (the
    client's read timeout is the silence allowed between stream chunks).
    """
    timeout = httpx.USE_CLIENT_DEFAULT if call.prepared.stream else upstream_timeout(state)
    return state.client.build_request(
        "POST",
        replica.endpoint(call.dialect.upstream_path),
        # orjson (``capture.dumps``) rather than httpx's json.dumps: the same JSON values, at
        # a fraction of the CPU for a long conversation
        content=dumps(call.upstream_body),
        headers=JSON_CONTENT,
        timeout=timeout,
    )


def upstream_timeout(state: GatewayState) -> httpx.Timeout:
    """The limits of a non-streaming upstream call: connect, then the total time."""
    settings = state.settings
    return httpx.Timeout(
        settings.upstream_total_timeout_s, connect=settings.upstream_connect_timeout_s
    )


async def finish_unary(state: GatewayState, call: Call, upstream: ReplicaResponse) -> Response:
    """Capture a 200 answer, commit its steps, answer the client. A body the capture cannot
    read (not UTF-8, not a JSON object, a field of the wrong kind: ``capture.UNREADABLE``) is
    recorded as an ``upstream_error`` step and answered 502."""
    replica = upstream.replica
    dialect = call.dialect
    try:
        content = upstream.response.content
    finally:
        await upstream.aclose()
    parsed = upstream.response.extensions.get(PARSED_ANSWER)  # an exact answer's own object
    try:
        answer = parsed if isinstance(parsed, dict) else loads_object(content)
        captured = dialect.read_answer(call.prepared, answer)
        client_answer = dialect.client_answer(call.prepared, answer)
    except UNREADABLE as exc:
        error = f"upstream {replica.url} answered 200 with a body the capture cannot read: {exc!r}"
        call.add_attempt(replica, StepOutcome.UPSTREAM_ERROR, status_code=200, error=error)
        await fail_call(state, call, replica, StepOutcome.UPSTREAM_ERROR, error)
        raise UpstreamError(error) from exc
    if replica.system_fingerprint is None:
        replica.system_fingerprint = captured.system_fingerprint
    # The answer is kept for Idempotency-Key replays (``find_replay`` looks up only by key):
    # a call without a key is never replayed, so its answer is not written twice.
    response_body = client_answer if call.idempotency_key else None
    call.add_attempt(replica, StepOutcome.OK, status_code=200, response_body=response_body)
    record = call.record(
        replica,
        captured.choices,
        prompt_ids=captured.prompt_ids,
        prompt_tokens=captured.prompt_tokens,
        model=captured.model,
    )
    step_ids = await commit(state, call, record)
    state.metrics.requests.labels(dialect.name, "200").inc()
    state.metrics.latency.labels(dialect.name, "false").observe(call.elapsed_ms() / 1000)
    if client_answer is answer:  # nothing hidden: vLLM's own bytes, unparsed and unchanged
        return Response(content, media_type="application/json", headers=call.headers(step_ids))
    # What vLLM's answer becomes with the hidden fields removed, written as vLLM writes JSON
    # (orjson: 0.5 us against 15 us for JSONResponse with a 200-token answer).
    return Response(
        dumps(client_answer), media_type="application/json", headers=call.headers(step_ids)
    )
