"""Relaying an upstream stream to the client while its dialect captures every sampled token.

Owns: reading the upstream's server-sent events (``sse_data``), waiting for the first one before
answering (``first_event``: a slow first byte is still a clean 504), the relay loop with its time
limits (``relay_stream``), and recording the stream's steps before its last events go out
(``record_stream``). Never: interprets an event (the call's ``DialectStream`` does), buffers
events that are not terminal (each is flushed as soon as the dialect hands it back: case C10), or
retries (bytes may already have reached the client).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import anyio
import httpx
from httpx_sse import EventSource

from datapool.models import StepOutcome
from gateway.call import Call, commit, fail_call
from gateway.dialects import DialectStream
from gateway.errors import TrajgateError, UpstreamError, UpstreamTimeoutError
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.upstreams import ReplicaResponse
from gateway.weight_update import ABORTED_FOR_WEIGHT_UPDATE, CallAborted, aborted_error

log = logging.getLogger("trajgate.proxy")


async def sse_data(response: httpx.Response) -> AsyncIterator[bytes]:
    """The ``data`` payload of each server-sent event of ``response``, in order, as UTF-8 bytes.

    Parsing is httpx-sse's (the SSE rules: line endings, multi-line data, comments); a silence
    longer than the client's read timeout raises ``httpx.ReadTimeout`` from here.
    """
    async for event in EventSource(response).aiter_sse():
        yield event.data.encode()


async def first_event(
    state: GatewayState, call: Call, upstream: ReplicaResponse
) -> tuple[AsyncIterator[bytes], bytes | None]:
    """Wait for the stream's first event before answering, so a slow first byte is still a
    clean 504 (nothing has been sent) rather than an error inside a 200 stream.

    Returns the upstream's payloads and the first one (None for an empty stream). Raises
    ``UpstreamTimeoutError`` (504) or ``UpstreamError`` (502) after recording the failed call.
    """
    replica = upstream.replica
    events = sse_data(upstream.response)
    limit_s = state.settings.upstream_first_byte_timeout_s
    try:
        with anyio.fail_after(max(limit_s - call.elapsed_ms() / 1000, 0.0)):
            return events, await events.__anext__()
    except StopAsyncIteration:
        return events, None
    except (TimeoutError, httpx.HTTPError) as exc:
        await upstream.aclose()
        timeout = isinstance(exc, TimeoutError | httpx.TimeoutException)
        outcome = StepOutcome.UPSTREAM_TIMEOUT if timeout else StepOutcome.UPSTREAM_ERROR
        call.add_attempt(replica, outcome, status_code=200, error=repr(exc))
        await fail_call(state, call, replica, outcome, repr(exc))
        if timeout:
            raise UpstreamTimeoutError(
                f"upstream {replica.url} sent no first chunk within {limit_s:g} s", code=outcome
            ) from exc
        raise UpstreamError(f"upstream {replica.url} stream failed: {exc!r}") from exc


class StreamTimedOut(Exception):
    """The upstream went silent too long, or the whole stream outlasted its limit."""


async def next_payload(
    settings: GatewaySettings, events: AsyncIterator[bytes], deadline: float
) -> bytes | None:
    """The upstream's next payload, None at the end of its stream.

    Time limits cost nothing per chunk: the silence between chunks is the HTTP client's read
    timeout (``upstream_between_chunks_timeout_s``), and the total limit (``deadline``, a
    ``time.perf_counter`` value) is checked as each chunk arrives (a stream that goes silent just
    before it ends one silence limit later). Raises ``StreamTimedOut`` with the limit it broke.
    """
    try:
        data = await events.__anext__()
    except StopAsyncIteration:
        return None
    except httpx.TimeoutException as exc:
        limit_s = settings.upstream_between_chunks_timeout_s
        raise StreamTimedOut(f"upstream stopped sending within {limit_s:.3g} s") from exc
    if time.perf_counter() > deadline:
        limit_s = settings.upstream_total_timeout_s
        raise StreamTimedOut(f"upstream stream took longer than {limit_s:.3g} s in all")
    return data


async def relay_stream(
    state: GatewayState,
    call: Call,
    upstream: ReplicaResponse,
    events: AsyncIterator[bytes],
    first: bytes | None,
) -> AsyncIterator[bytes]:
    """Yield the client's SSE events as the upstream's arrive; commit before the last ones.

    A client disconnect closes the upstream response (vLLM aborts the request) and records the
    partial step with finish reason ``client_disconnect``; a time limit ends the stream with the
    dialect's error event and records ``upstream_timeout``; so does an abort by a full-weight
    update (``gateway.weight_update``), recorded ``aborted_for_weight_update``. Either way the
    step is never left open, and the response (with its in-flight count) is closed.
    """
    replica = upstream.replica
    metrics = state.metrics
    stream = call.dialect.open_stream(call.prepared, replica.system_fingerprint)
    deadline = call.started + state.settings.upstream_total_timeout_s
    abort_reason: str | None = None
    ttft_ms: float | None = None
    finished = False
    try:
        for event in stream.opening():
            yield event
        data: bytes | None = first  # first_event read it already
        while True:
            if data is None:
                data = await call.ticket.guard(next_payload(state.settings, events, deadline))
                if data is None:
                    break
            if data == b"[DONE]":
                finished = True
                break
            for event in stream.feed(data):
                yield event
            if ttft_ms is None and stream.first_token_seen:
                ttft_ms = call.elapsed_ms()
                metrics.ttft.labels(call.dialect.name).observe(ttft_ms / 1000)
            data = None
    except StreamTimedOut as exc:
        abort_reason = StepOutcome.UPSTREAM_TIMEOUT
        call.add_attempt(replica, abort_reason, status_code=200, error=str(exc))
        yield stream.error_event(UpstreamTimeoutError(str(exc)))
    except CallAborted:
        abort_reason = ABORTED_FOR_WEIGHT_UPDATE
        call.add_attempt(replica, abort_reason, status_code=200, error="weight update")
        yield stream.error_event(aborted_error())
    except (asyncio.CancelledError, GeneratorExit):
        abort_reason = StepOutcome.CLIENT_DISCONNECT
        raise
    except httpx.HTTPError as exc:
        abort_reason = StepOutcome.UPSTREAM_ERROR
        call.add_attempt(replica, abort_reason, status_code=200, error=repr(exc))
        yield stream.error_event(UpstreamError(f"upstream stream failed: {exc!r}"))
    finally:
        with anyio.CancelScope(shield=True):
            not_recorded = await record_stream(
                state, call, upstream, stream, abort_reason, finished=finished, ttft_ms=ttft_ms
            )
    if abort_reason is None and not_recorded is not None:
        # The status line went out before the commit could fail: the stream ends in an error
        # event (the OpenAI SDKs raise on it) instead of its last chunk and [DONE], so the
        # client knows to retry a call the pool could not keep.
        yield stream.error_event(not_recorded)
    elif abort_reason is None:
        for event in stream.closing():
            yield event


async def record_stream(
    state: GatewayState,
    call: Call,
    upstream: ReplicaResponse,
    stream: DialectStream,
    abort_reason: str | None,
    *,
    finished: bool,
    ttft_ms: float | None,
) -> TrajgateError | None:
    """Close the upstream response and commit what the stream captured; returns the error when
    the pool refused the commit (the client is told in-stream), else None.

    ``finished``: the upstream sent ``[DONE]``; ``abort_reason`` why the stream was cut short.
    """
    replica = upstream.replica
    await upstream.aclose()  # closing the connection makes vLLM abort the request
    call.ticket.release()  # sampling ended: a full-weight update need not wait for the commit
    captured = stream.captured(abort_reason)
    if finished and captured.error is None:
        call.add_attempt(replica, StepOutcome.OK, status_code=200)
    outcome = StepOutcome.OK if abort_reason is None else abort_reason
    if captured.error is not None:
        outcome = StepOutcome.UPSTREAM_ERROR
    choices = captured.choices
    if abort_reason == ABORTED_FOR_WEIGHT_UPDATE:
        choices = [replace(c, flags=[*c.flags, abort_reason]) for c in choices]
    record = call.record(
        replica,
        choices,
        prompt_ids=captured.prompt_ids,
        prompt_tokens=captured.prompt_tokens,
        model=captured.model,
        outcome=outcome,
        error=json.dumps(captured.error) if captured.error else None,
        ttft_ms=ttft_ms,
    )
    not_recorded: TrajgateError | None = None
    try:
        await commit(state, call, record)
    except TrajgateError as exc:
        log.warning("stream of call %s not recorded: %s", call.call_id, exc.message)
        not_recorded = exc
    name = call.dialect.name
    state.metrics.requests.labels(name, "200").inc()
    state.metrics.latency.labels(name, "true").observe(call.elapsed_ms() / 1000)
    return not_recorded
