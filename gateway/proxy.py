"""The model-serving surface: every API dialect's routes (``gateway.dialects``) and models.

Owns: attribution of a call to a trajectory (URL, header or API key), the upstream attempt loop
(retries only before any byte reached the client), the order "upstream answers → steps commit →
client gets the (last part of the) answer", time limits, client disconnects, and Idempotency-Key
replays, the same for every dialect. Never: looks inside a request or an answer (the dialect
reads and renders them); never retries after a timeout (tokens may already have been
generated).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
import httpx
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from datapool.models import StepOutcome
from datapool.steps.calls import AttemptRecord, find_replay, find_resend
from datapool.steps.faults import is_storage_fault
from datapool.steps.records import CallRecord, ChoiceRecord
from gateway.attribution import Attribution, attribute, check_trajectory_id, read_json_object
from gateway.capture import loads, request_hash
from gateway.dialects import DIALECTS, Dialect, DialectStream, Prepared
from gateway.errors import (
    ServiceUnavailableError,
    TrajgateError,
    UpstreamError,
    UpstreamTimeoutError,
)
from gateway.state import GatewayState, StateDep
from gateway.streaming import sse_data
from gateway.upstreams import InFlight, NoHealthyUpstreamError, Replica, ReplicaResponse

log = logging.getLogger("trajgate.proxy")
T = TypeVar("T")

RETRYABLE_STATUS = frozenset({502, 503, 504})


router = APIRouter()


# -- routes ------------------------------------------------------------------------------


def add_dialect_routes(router: APIRouter, dialect: Dialect) -> None:
    """Serve each of the dialect's client paths at ``/t/{trajectory_id}/v1<path>`` (attributed
    by URL) and ``/v1<path>`` (attributed by header or API key), plus its own ``router``."""

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
    if dialect.router is not None:
        router.include_router(dialect.router)


for _dialect in DIALECTS:
    add_dialect_routes(router, _dialect)


@router.get("/t/{trajectory_id}/v1/models")
async def models_by_url(trajectory_id: str, request: Request, state: StateDep) -> Response:
    check_trajectory_id(trajectory_id)
    return await list_models(request, state)


@router.get("/v1/models")
async def list_models(request: Request, state: StateDep) -> Response:
    """vLLM's model list from the first healthy replica, passed through unchanged."""
    if state.settings.api_key_required:
        attribute(state, request, None)
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


# -- the call ----------------------------------------------------------------------------


@dataclass
class Call:
    """Everything known about one logical call while it is in flight."""

    dialect: Dialect
    attribution: Attribution
    body: dict[str, Any]  # the client's body as sent (before the model alias was resolved)
    prepared: Prepared
    policy_version: int
    call_id: str
    request_hash: str
    idempotency_key: str | None
    resend_of: str | None
    started: float = field(default_factory=time.perf_counter)
    attempts: list[AttemptRecord] = field(default_factory=list)
    # Named before writing when the answer's headers go out first (streaming): index = choice.
    step_ids: list[str] = field(default_factory=list)

    @property
    def trajectory_id(self) -> str:
        return self.attribution.trajectory_id

    @property
    def upstream_body(self) -> dict[str, Any]:
        return self.prepared.upstream_body

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0

    def add_attempt(
        self,
        replica: Replica | None,
        outcome: str,
        *,
        status_code: int | None = None,
        error: str | None = None,
        response_body: dict[str, Any] | None = None,
    ) -> None:
        self.attempts.append(
            AttemptRecord(
                id=str(uuid.uuid4()),
                call_id=self.call_id,
                trajectory_id=self.trajectory_id,
                attempt_index=len(self.attempts),
                upstream=replica.url if replica else None,
                status_code=status_code,
                outcome=outcome,
                error=error,
                latency_ms=self.elapsed_ms(),
                idempotency_key=self.idempotency_key,
                response_body=response_body,
            )
        )

    def record(
        self,
        replica: Replica | None,
        choices: list[ChoiceRecord],
        *,
        prompt_ids: list[int] | None = None,
        prompt_tokens: int | None = None,
        model: Any = None,
        outcome: str = StepOutcome.OK,
        error: str | None = None,
        ttft_ms: float | None = None,
    ) -> CallRecord:
        if self.resend_of is not None:
            choices = [replace(c, flags=[*c.flags, "resend"]) for c in choices]
        if self.step_ids:
            choices = [
                replace(c, step_id=self.step_ids[c.choice_index])
                if c.choice_index < len(self.step_ids)
                else c
                for c in choices
            ]
        return CallRecord(
            request=self.body,
            upstream_request=self.upstream_body,
            model=model if isinstance(model, str) else self.upstream_body.get("model"),
            upstream=replica.url if replica else "",
            policy_version=self.policy_version,
            latency_ms=self.elapsed_ms(),
            prompt_token_ids=prompt_ids,
            prompt_tokens=prompt_tokens,
            choices=choices,
            outcome=outcome,
            error=error,
            call_id=self.call_id,
            endpoint=self.dialect.name,
            request_hash=self.request_hash,
            idempotency_key=self.idempotency_key,
            ttft_ms=ttft_ms,
            group_id=self.attribution.group_id,
            channel=self.attribution.channel,
            attempts=tuple(self.attempts),
        )

    def headers(self, step_ids: list[str], *, committed: bool = True) -> dict[str, str]:
        """The trajgate headers of the answer. ``committed``: ``step_ids`` came back from the
        commit (unary answers); a stream's ids are chosen before its commit."""
        headers = {
            "x-trajgate-trajectory-id": self.trajectory_id,
            "x-trajgate-call-id": self.call_id,
            "x-trajgate-step-id": ",".join(step_ids),
            "x-trajgate-policy-version": str(self.policy_version),
        }
        if committed:
            # False only under on_write_failure='serve' when the pool failed the commit.
            headers["x-trajgate-recorded"] = "true" if step_ids else "false"
        return headers


def failed_choice(outcome: str) -> list[ChoiceRecord]:
    return [ChoiceRecord(0, None, None, None, None, flags=[outcome])]


async def proxy_call(
    state: GatewayState, request: Request, dialect: Dialect, url_trajectory_id: str | None
) -> Response:
    """Forward one call upstream, commit its steps, and answer as the dialect answers.

    Every error of the call is rendered in the dialect's shape (``request.state.render_error``,
    read by the app's error handlers). The call counts as in flight for its trajectory
    (``PoolWriter.call_started``) until its commit ended, so the idle timeout never closes a
    trajectory under a call of this gateway.
    """
    request.state.render_error = dialect.render_error
    if url_trajectory_id is not None:
        check_trajectory_id(url_trajectory_id)
    body = await read_json_object(request, state.settings.max_body_bytes)
    dialect.check_body(body)
    attribution = attribute(state, request, url_trajectory_id)
    writer = state.writer
    assert writer is not None, "the lifespan starts the pool writer"
    writer.check_accepting()
    writer.call_started(attribution.trajectory_id)
    try:
        response = await forward_call(state, request, dialect, body, attribution)
    except BaseException:
        writer.call_ended(attribution.trajectory_id)
        raise
    if isinstance(response, StreamingResponse):
        # A stream commits at its end, inside its generator: the call ends when the generator
        # is gone (finished, or never started because the client left first).
        weakref.finalize(response.body_iterator, writer.call_ended, attribution.trajectory_id)
    else:
        writer.call_ended(attribution.trajectory_id)
    return response


async def forward_call(
    state: GatewayState,
    request: Request,
    dialect: Dialect,
    body: dict[str, Any],
    attribution: Attribution,
) -> Response:
    """``proxy_call`` once the call is attributed and counted in flight."""
    idempotency_key = request.headers.get("idempotency-key")
    sessions = state.store.sessions
    if idempotency_key:
        replay = await pool_lookup(
            state, find_replay, sessions, attribution.trajectory_id, idempotency_key
        )
        if replay is not None:
            state.metrics.replays.inc()
            return JSONResponse(
                replay[1],
                headers={
                    "x-trajgate-trajectory-id": attribution.trajectory_id,
                    "x-trajgate-call-id": replay[0],
                    "x-trajgate-replayed": "true",
                },
            )
    resolution = state.policy.resolve(body.get("model"))
    client_body = (
        body
        if resolution.upstream_model == body.get("model")
        else {**body, "model": resolution.upstream_model}
    )
    prepared = dialect.prepare(client_body)
    digest = request_hash(dialect.name, body)
    resend_of = None
    if state.settings.resend_window_s > 0 and not idempotency_key:
        resend_of = await pool_lookup(
            state,
            find_resend,
            sessions,
            attribution.trajectory_id,
            digest,
            state.settings.resend_window_s,
        )
    call = Call(
        dialect=dialect,
        attribution=attribution,
        body=body,
        prepared=prepared,
        policy_version=resolution.policy_version,
        call_id=resend_of or str(uuid.uuid4()),
        request_hash=digest,
        idempotency_key=idempotency_key,
        resend_of=resend_of,
    )
    stream = prepared.stream
    upstream = await open_upstream(state, call, stream)
    try:
        return await answer_call(state, call, upstream)
    except BaseException:
        # Whatever failed before a stream's generator or finish_unary took the response over
        # (a client gone while waiting for the first event included): close it, free the slot.
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
        raise


async def answer_call(state: GatewayState, call: Call, upstream: ReplicaResponse) -> Response:
    """The client's answer once an upstream answered: its error, its stream, or its JSON."""
    dialect = call.dialect
    replica, response = upstream.replica, upstream.response
    if response.status_code != 200:
        content = await response.aread()
        await upstream.aclose()
        call.add_attempt(
            replica,
            StepOutcome.UPSTREAM_ERROR,
            status_code=response.status_code,
            error=content.decode("utf-8", "replace"),
        )
        step_ids = await commit(
            state,
            call,
            call.record(
                replica,
                failed_choice(StepOutcome.UPSTREAM_ERROR),
                outcome=StepOutcome.UPSTREAM_ERROR,
                error=content.decode("utf-8", "replace"),
            ),
        )
        state.metrics.requests.labels(dialect.name, str(response.status_code)).inc()
        return Response(
            dialect.upstream_error_body(response.status_code, content),
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
            headers=call.headers(step_ids),
        )
    if call.prepared.stream:
        events, first = await first_event(state, call, upstream)
        call.step_ids = [str(uuid.uuid4()) for _ in range(call.prepared.n_choices)]
        streaming = StreamingResponse(
            relay_stream(state, call, upstream, events, first),
            media_type=response.headers.get("content-type", "text/event-stream"),
            headers=call.headers(call.step_ids, committed=False),
        )
        # A generator the server never starts (the client left first) never runs its finally.
        weakref.finalize(streaming.body_iterator, upstream.in_flight.release)
        return streaming
    return await finish_unary(state, call, upstream)


async def pool_lookup(state: GatewayState, lookup: Callable[..., T | None], *args: Any) -> T | None:
    """Run a read the call only benefits from (idempotent replay, re-send detection).

    When the database fails it, 'serve' mode goes on without it (the call will not be recorded
    either) and 'refuse' mode raises ``PoolUnavailableError`` (503) with the fault's reason.
    """
    try:
        return await run_in_threadpool(lookup, *args)
    except SQLAlchemyError as exc:
        if not is_storage_fault(exc):
            raise
        assert state.writer is not None, "the lifespan starts the pool writer"
        error = state.writer.report_fault(exc, f"lookup {lookup.__name__}")
        if state.store.settings.on_write_failure == "serve":
            return None
        state.writer.stats.refused_calls += 1
        raise error from exc


async def open_upstream(state: GatewayState, call: Call, stream: bool) -> ReplicaResponse:
    """Send the call to a replica, retrying on another one on connection errors and 502/503/504
    (nothing has reached the client yet). Returns the open response, which holds the replica's
    in-flight count until the caller closes it."""
    settings = state.settings
    tried: set[str] = set()
    for attempt in range(settings.upstream_max_attempts):
        if attempt:
            await asyncio.sleep(settings.upstream_retry_backoff_ms * 2 ** (attempt - 1) / 1000)
        try:
            replica = state.upstreams.pick(call.trajectory_id, frozenset(tried))
        except NoHealthyUpstreamError:
            try:
                replica = state.upstreams.pick(call.trajectory_id)
            except NoHealthyUpstreamError as exc:
                raise ServiceUnavailableError(str(exc), code="no_capturing_upstream") from exc
        tried.add(replica.url)
        # Counted in flight until handed on with the open response (or given back).
        with InFlight(replica) as in_flight:
            # A non-streaming answer arrives whole after generation: its only limit is the total one
            # (the client's read timeout is the silence allowed between stream chunks).
            timeout = (
                None
                if stream
                else httpx.Timeout(
                    settings.upstream_total_timeout_s, connect=settings.upstream_connect_timeout_s
                )
            )
            request = state.client.build_request(
                "POST",
                replica.url + call.dialect.upstream_path,
                json=call.upstream_body,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
            limit_s = (
                settings.upstream_first_byte_timeout_s
                if stream
                else settings.upstream_total_timeout_s
            )
            try:
                with anyio.fail_after(limit_s):
                    response = await state.client.send(request, stream=True)
                    if not stream:
                        await response.aread()
            except (TimeoutError, httpx.TimeoutException) as exc:
                connect = isinstance(exc, httpx.ConnectTimeout)
                outcome = (
                    StepOutcome.UPSTREAM_UNREACHABLE if connect else StepOutcome.UPSTREAM_TIMEOUT
                )
                call.add_attempt(replica, outcome, error=repr(exc))
                state.metrics.attempts_failed.labels(outcome).inc()
                if connect:
                    state.upstreams.mark_failure(replica)
                    if attempt + 1 < settings.upstream_max_attempts:
                        continue
                await fail_call(state, call, replica, outcome, repr(exc))
                raise UpstreamTimeoutError(
                    f"upstream {replica.url} did not answer within {limit_s:g} s", code=outcome
                ) from exc
            except httpx.TransportError as exc:
                state.upstreams.mark_failure(replica)
                call.add_attempt(replica, StepOutcome.UPSTREAM_UNREACHABLE, error=repr(exc))
                state.metrics.attempts_failed.labels(StepOutcome.UPSTREAM_UNREACHABLE).inc()
                if attempt + 1 < settings.upstream_max_attempts:
                    continue
                await fail_call(state, call, replica, StepOutcome.UPSTREAM_UNREACHABLE, repr(exc))
                raise UpstreamError(f"upstream {replica.url} unreachable: {exc!r}") from exc
            if (
                response.status_code in RETRYABLE_STATUS
                and attempt + 1 < settings.upstream_max_attempts
            ):
                content = await response.aread()
                await response.aclose()
                state.upstreams.mark_failure(replica)
                call.add_attempt(
                    replica,
                    StepOutcome.UPSTREAM_ERROR,
                    status_code=response.status_code,
                    error=content.decode("utf-8", "replace"),
                )
                state.metrics.attempts_failed.labels(StepOutcome.UPSTREAM_ERROR).inc()
                continue
            state.upstreams.mark_success(replica)
            return ReplicaResponse(replica, response, in_flight.keep())
    raise AssertionError("unreachable: the last attempt returns or raises")


async def fail_call(
    state: GatewayState, call: Call, replica: Replica | None, outcome: str, error: str
) -> None:
    await commit(
        state, call, call.record(replica, failed_choice(outcome), outcome=outcome, error=error)
    )
    state.metrics.requests.labels(call.dialect.name, "error").inc()


async def commit(state: GatewayState, call: Call, record: CallRecord) -> list[str]:
    """Make the call durable (steps and attempts) and count it."""
    step_ids = await state.record(call.trajectory_id, record)
    state.metrics.steps_written.inc(len(step_ids))
    for choice in record.choices:
        for flag in choice.flags:
            state.metrics.step_flags.labels(flag).inc()
    if record.prompt_tokens:
        state.metrics.tokens.labels("prompt").inc(record.prompt_tokens)
    sampled = sum(len(choice.response_token_ids or []) for choice in record.choices)
    state.metrics.tokens.labels("completion").inc(sampled)
    log.info(
        "call trajectory=%s call=%s endpoint=%s outcome=%s steps=%d prompt_tokens=%s "
        "completion_tokens=%d latency_ms=%.1f policy_version=%d",
        call.trajectory_id,
        call.call_id,
        call.dialect.name,
        record.outcome,
        len(step_ids),
        record.prompt_tokens,
        sampled,
        record.latency_ms,
        call.policy_version,
    )
    return step_ids


async def finish_unary(state: GatewayState, call: Call, upstream: ReplicaResponse) -> Response:
    replica = upstream.replica
    try:
        content = upstream.response.content
        answer = loads(content)
    finally:
        await upstream.aclose()
    dialect = call.dialect
    captured = dialect.read_answer(call.prepared, answer)
    if replica.system_fingerprint is None:
        replica.system_fingerprint = captured.system_fingerprint
    client_answer = dialect.client_answer(call.prepared, answer)
    call.add_attempt(replica, StepOutcome.OK, status_code=200, response_body=client_answer)
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
    return JSONResponse(client_answer, headers=call.headers(step_ids))


async def first_event(
    state: GatewayState, call: Call, upstream: ReplicaResponse
) -> tuple[AsyncIterator[bytes], bytes | None]:
    """Wait for the stream's first event before answering, so a slow first byte is still a
    clean 504 (nothing has been sent) rather than an error inside a 200 stream."""
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


async def relay_stream(
    state: GatewayState,
    call: Call,
    upstream: ReplicaResponse,
    events: AsyncIterator[bytes],
    first: bytes | None,
) -> AsyncIterator[bytes]:
    """Yield the client's SSE events as the upstream's arrive; commit before the last ones.

    A client disconnect closes the upstream response (vLLM aborts the request) and records the
    partial step with finish reason ``client_disconnect``; a time limit ends the stream with an
    error event and records ``upstream_timeout``. Either way the step is never left open.

    Time limits cost nothing per chunk: the silence between chunks is the HTTP client's read
    timeout (``upstream_between_chunks_timeout_s``), and the total limit is checked as each chunk
    arrives (a stream that goes silent just before it ends one silence limit later).
    """
    settings = state.settings
    dialect = call.dialect
    replica = upstream.replica
    stream: DialectStream = dialect.open_stream(call.prepared, replica.system_fingerprint)
    deadline = call.started + settings.upstream_total_timeout_s
    abort_reason: str | None = None
    ttft_ms: float | None = None
    finished = False
    not_recorded: TrajgateError | None = None
    try:
        for event in stream.opening():
            yield event
        while True:
            message = None
            try:
                if first is not None:
                    data, first = first, None
                else:
                    data = await events.__anext__()
            except StopAsyncIteration:
                break
            except httpx.TimeoutException:
                limit_s = settings.upstream_between_chunks_timeout_s
                message = f"upstream stopped sending within {limit_s:.3g} s"
            else:
                if time.perf_counter() > deadline:
                    limit_s = settings.upstream_total_timeout_s
                    message = f"upstream stream took longer than {limit_s:.3g} s in all"
            if message is not None:
                abort_reason = StepOutcome.UPSTREAM_TIMEOUT
                call.add_attempt(replica, abort_reason, status_code=200, error=message)
                yield stream.error_event(UpstreamTimeoutError(message))
                break
            if data == b"[DONE]":
                finished = True
                break
            for event in stream.feed(data):
                yield event
            if ttft_ms is None and stream.first_token_seen:
                ttft_ms = call.elapsed_ms()
                state.metrics.ttft.labels(dialect.name).observe(ttft_ms / 1000)
    except (asyncio.CancelledError, GeneratorExit):
        abort_reason = StepOutcome.CLIENT_DISCONNECT
        raise
    except httpx.HTTPError as exc:
        abort_reason = StepOutcome.UPSTREAM_ERROR
        call.add_attempt(replica, abort_reason, status_code=200, error=repr(exc))
        yield stream.error_event(UpstreamError(f"upstream stream failed: {exc!r}"))
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()  # closing the connection makes vLLM abort the request
            captured = stream.captured(abort_reason)
            if finished and captured.error is None:
                call.add_attempt(replica, StepOutcome.OK, status_code=200)
            outcome = StepOutcome.OK if abort_reason is None else abort_reason
            if captured.error is not None:
                outcome = StepOutcome.UPSTREAM_ERROR
            record = call.record(
                replica,
                captured.choices,
                prompt_ids=captured.prompt_ids,
                prompt_tokens=captured.prompt_tokens,
                model=captured.model,
                outcome=outcome,
                error=json.dumps(captured.error) if captured.error else None,
                ttft_ms=ttft_ms,
            )
            try:
                await commit(state, call, record)
            except TrajgateError as exc:
                log.warning("stream of call %s not recorded: %s", call.call_id, exc.message)
                not_recorded = exc
            state.metrics.requests.labels(dialect.name, "200").inc()
            state.metrics.latency.labels(dialect.name, "true").observe(call.elapsed_ms() / 1000)
    if abort_reason is None and not_recorded is not None:
        # The status line went out before the commit could fail: the stream ends in an error
        # event (the OpenAI SDKs raise on it) instead of its last chunk and [DONE], so the
        # client knows to retry a call the pool could not keep.
        yield stream.error_event(not_recorded)
    elif abort_reason is None:
        for event in stream.closing():
            yield event
