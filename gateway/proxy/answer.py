"""The client's answer: a replayed one, or once a replica answered the call its error, its
stream, or its JSON.

Owns: an Idempotency-Key replay's stored answer, the order "upstream answers → steps commit →
client gets the answer" for unary answers (streams: ``gateway.proxy.streaming``, at their end),
an upstream refusal recorded as one failed step and passed on with its status in the dialect's
shape, and a 200 the capture cannot read recorded as ``upstream_error`` and answered 502.
Never: retries (``gateway.proxy.attempts`` has decided).
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse

from datapool.steps.calls import find_replay
from gateway.body_budget import hold_answers
from gateway.capture import request_hash
from gateway.engine.exact import PARSED_ANSWER
from gateway.engine.wire import UNREADABLE, dumps, loads_object
from gateway.errors import UnprocessableError, UpstreamError
from gateway.proxy.attribution import Attribution
from gateway.proxy.call import Call, commit, fail_call, failed_choice
from gateway.proxy.preparation import pool_lookup
from gateway.proxy.streaming import first_event, relay_stream
from gateway.state import GatewayState
from gateway.upstream.replicas import ReplicaResponse


async def answer_call(state: GatewayState, call: Call, upstream: ReplicaResponse) -> Response:
    """The client's answer once an upstream answered: its error, its stream, or its JSON."""
    response = upstream.response
    if response.status_code != 200:
        return await upstream_refused(state, call, upstream)
    if not call.prepared.stream:
        return await finish_unary(state, call, upstream)
    reads, first = await call.ticket.guard(first_event(state, call, upstream))
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
        outcome = call.attempts.upstream_error(replica, status_code=response.status_code)
        await fail_call(state, call, replica, outcome, repr(exc))
        raise UpstreamError(f"upstream {replica.url} answered badly: {exc!r}") from exc
    await upstream.aclose()
    error = content.decode("utf-8", "replace")
    outcome = call.attempts.upstream_error(replica, status_code=response.status_code, error=error)
    record = call.record(replica, failed_choice(outcome), outcome=outcome, error=error)
    step_ids = await commit(state, call, record)
    state.metrics.requests.labels(call.dialect.name, str(response.status_code)).inc()
    return Response(
        call.dialect.upstream_error_body(response.status_code, content),
        status_code=response.status_code,
        media_type=response.headers.get("content-type"),
        headers=call.headers(step_ids),
    )


async def finish_unary(state: GatewayState, call: Call, upstream: ReplicaResponse) -> Response:
    """Capture a 200 answer, commit its steps, answer the client. A body the capture cannot
    read (not UTF-8, not a JSON object, a field of the wrong kind: ``wire.UNREADABLE``) is
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
        outcome = call.attempts.upstream_error(replica, status_code=200, error=error)
        await fail_call(state, call, replica, outcome, error)
        raise UpstreamError(error) from exc
    if replica.system_fingerprint is None:
        replica.system_fingerprint = captured.system_fingerprint
    # The answer is kept for Idempotency-Key replays (``find_replay`` looks up only by key):
    # a call without a key is never replayed, so its answer is not written twice.
    response_body = client_answer if call.idempotency_key else None
    call.attempts.ok(replica, response_body=response_body)
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
    if client_answer is answer and answer is not parsed:  # nothing hidden: vLLM's own bytes
        return Response(content, media_type="application/json", headers=call.headers(step_ids))
    # What vLLM's answer becomes with the hidden fields removed (or an exact answer, which
    # comes as an object only), written as vLLM writes JSON (orjson: 0.5 us against 15 us
    # for JSONResponse with a 200-token answer).
    return Response(
        dumps(client_answer), media_type="application/json", headers=call.headers(step_ids)
    )


async def replayed_answer(
    state: GatewayState,
    attribution: Attribution,
    idempotency_key: str,
    dialect_name: str,
    body: dict[str, Any],
) -> Response | None:
    """The stored answer of the trajectory's earlier call with this Idempotency-Key, if any.

    Raises ``UnprocessableError`` (422 ``idempotency_key_reused``) when that call's body was
    another (its ``request_hash`` differs from ``body``'s under ``dialect_name``): a key names
    one request, and answering another with its answer would hand the client, and the
    trajectory, a reply to a question it did not ask (the IETF Idempotency-Key draft, 2.7)."""
    replay = await pool_lookup(
        state, find_replay, state.store.sessions, attribution.trajectory_id, idempotency_key
    )
    if replay is None:
        return None
    if replay.request_hash is not None and replay.request_hash != request_hash(dialect_name, body):
        raise UnprocessableError(
            f"Idempotency-Key {idempotency_key!r} was used by call {replay.call_id} of trajectory "
            f"{attribution.trajectory_id!r} with another request body; a key names one request: "
            "send a new key for a new request",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    state.metrics.replays.inc()
    # The first answer's headers too: a client replays because it lost that answer, and the
    # step ids are how it attaches rewards to the steps.
    headers = {
        "x-trajgate-trajectory-id": attribution.trajectory_id,
        "x-trajgate-call-id": replay.call_id,
        "x-trajgate-step-id": ",".join(replay.step_ids),
        "x-trajgate-replayed": "true",
    }
    if replay.policy_version is not None:
        headers["x-trajgate-policy-version"] = str(replay.policy_version)
    return JSONResponse(replay.response_body, headers=headers)
