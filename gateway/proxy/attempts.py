"""The upstream attempt loop: a call sent to a replica, and retried on another only before any
byte reached the client.

Owns: picking the replica, the first-byte (streams) and total (unary) time limits, retries on
connection errors and 502/503/504 answers (never after a timeout: tokens may already have been
generated; never an answer past ``upstream_max_answer_bytes``: another replica would sample as
long), what a failed attempt is recorded as (``upstream_unreachable``, ``upstream_error``,
``upstream_timeout``), the upstream request with its limits, and an exact attempt's answer kept
on the call (``exact_attempt``: ``Continuation.answer``). Never: answers the client
(``gateway.proxy.answer``) or reads an answer beyond a unary answer's bytes.
"""

from __future__ import annotations

import asyncio

import anyio
import httpx

from gateway.engine.exact import continues_exactly, send_exact
from gateway.engine.wire import dumps
from gateway.errors import ServiceUnavailableError, UpstreamError, UpstreamTimeoutError
from gateway.proxy.call import Call, fail_call
from gateway.state import GatewayState
from gateway.upstream.answer_limit import AnswerTooLargeError
from gateway.upstream.replicas import InFlight, NoHealthyUpstreamError, Replica, ReplicaResponse

RETRYABLE_STATUS = frozenset({502, 503, 504})
JSON_CONTENT = {"content-type": "application/json"}


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
                response = await exact_attempt(state, call, replica)
            else:
                response = await state.client.send(
                    upstream_request(state, call, replica), stream=True
                )
                if not stream:
                    await response.aread()
    except (TimeoutError, httpx.TimeoutException) as exc:
        connect = isinstance(exc, httpx.ConnectTimeout)
        if connect:
            outcome = call.attempts.unreachable(replica, repr(exc))
        else:
            outcome = call.attempts.timed_out(replica, repr(exc))
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
        outcome = call.attempts.upstream_error(
            replica, status_code=response.status_code, error=content.decode("utf-8", "replace")
        )
        state.metrics.attempts_failed.labels(outcome).inc()
        return None
    state.upstreams.mark_success(replica)
    return response


async def exact_attempt(state: GatewayState, call: Call, replica: Replica) -> httpx.Response:
    """The exact continuation of ``call`` on ``replica`` (probed: its end token is known): the
    turn it extends closed with that token and the render sent ahead, if no earlier attempt
    took it, go to ``send_exact``; its answer (what built the prompt, the prompt sent, the
    engine's weight version spans) is kept on ``call.continuation`` as ``answer``, and its
    response returned. Raises as ``send_exact`` does."""
    continuation = call.continuation
    end_token = replica.end_token
    assert end_token is not None, "an exact continuation goes to a probed replica"
    prefix = continuation.exact_prefix(end_token)  # while a render sent ahead is out
    timeout = None if call.prepared.stream else upstream_timeout(state)
    answer = await send_exact(
        state.client, replica, call.upstream_body, prefix, continuation.take_ahead(), timeout
    )
    continuation.answer = answer
    return answer.response


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
    state.upstreams.mark_failure(replica)
    if reached:
        outcome = call.attempts.upstream_error(replica, error=repr(exc))
    else:
        outcome = call.attempts.unreachable(replica, repr(exc))
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
        # orjson (``wire.dumps``) rather than httpx's json.dumps: the same JSON values, at
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
