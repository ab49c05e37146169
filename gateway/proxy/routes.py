"""The model-serving surface: every API dialect's routes (``gateway.dialects``) and models, and
one call's walk through them.

Owns: the routes generated for each dialect (its client paths and side routes, each at
``/t/{trajectory_id}/v1<path>``, attributed by URL, and ``/v1<path>``, by header or API key),
``/v1/models``, and ``proxy_call``: one call from its attribution through its preparation
(``gateway.proxy.preparation``) and its upstream attempts (``gateway.proxy.attempts``) to its
answer (``gateway.proxy.answer``), the same for every dialect, and the record of a call a
full-weight update aborted. Never: looks inside a request or an answer (the dialect reads and
renders them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import anyio
import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from gateway.body_budget import hold_answers
from gateway.dialects import Dialect, EngineRefused, Prepared, SideRoute
from gateway.engine.errors import UnreadableAnswerError
from gateway.engine.models import models_answer
from gateway.engine.paths import TOKENIZE_PATH
from gateway.engine.tokenize import Refused, tokenize
from gateway.engine.wire import dumps
from gateway.errors import UpstreamError
from gateway.proxy.answer import answer_call, replayed_answer
from gateway.proxy.attempts import open_upstream
from gateway.proxy.attribution import (
    Attribution,
    attribute,
    check_engine_fields,
    check_idempotency_key,
    check_model,
    check_trajectory_id,
    read_json_object,
)
from gateway.proxy.call import Call, fail_call
from gateway.proxy.lifetime import CallLifetime
from gateway.proxy.preparation import new_call, settle_channel
from gateway.state import GatewayState, StateDep
from gateway.upstream.replicas import Replica
from gateway.upstream.weight_update import CallAborted, aborted_error

router = APIRouter()  # the routes every app serves whatever its dialects: ``/v1/models``


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
            answer = await tokenize(self.client, url, payload)
        except UnreadableAnswerError as exc:
            raise UpstreamError(
                f"upstream {url} answered {TOKENIZE_PATH} unreadably: {exc.__cause__!r}"
            ) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(f"upstream {url} unreachable: {exc!r}") from exc
        if isinstance(answer, Refused):
            raise EngineRefused(answer.status_code, answer.content)
        return answer


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
        upstream = await models_answer(state.client, replica.url)
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
    (``lifetime.ticket``); the open upstream response and the render sent ahead are handed to
    ``lifetime``, which closes them however the call ends.

    A full-weight update that aborts the call while it waits for its upstream records it as
    ``aborted_for_weight_update`` and answers 503 (``weight_update.aborted_error``). A call to
    a trajectory known closed is refused (409 ``trajectory_closed``, counted) before anything
    reaches the engine (``PoolWriter.check_open``); a replay is still answered, since its step
    is already in the pool.
    """
    idempotency_key = check_idempotency_key(request.headers.get("idempotency-key"))
    if idempotency_key:
        replay = await replayed_answer(
            state, attribution, idempotency_key, dialect.name, prepared.client_body
        )
        if replay is not None:
            return replay
    assert state.writer is not None, "the lifespan starts the pool writer"
    await state.writer.check_open(attribution.trajectory_id)
    call = await new_call(state, dialect, prepared, attribution, idempotency_key, lifetime)
    call.ticket = ticket = lifetime.ticket
    try:
        upstream = lifetime.upstream = await ticket.guard(open_upstream(state, call))
    except CallAborted:
        await abort_call(state, call, None)
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
    outcome = call.attempts.aborted(replica)
    await fail_call(state, call, replica, outcome, "aborted for a weight update")
    raise aborted_error()
