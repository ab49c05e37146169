"""Relaying an upstream stream to the client while its dialect captures every sampled token.

Owns: reading the upstream's server-sent events (``SSEPayloads``, ``sse_reads``), waiting for
the first one before answering (``first_event``: a slow first byte is still a clean 504), the
relay loop with its time limits (``relay_stream``), and recording the stream's steps before its
last events go out (``record_stream``). Never: interprets an event (the call's ``DialectStream``
does), buffers events that are not terminal (what one upstream read completes is flushed as one
write as soon as the dialect hands it back: case C10), or retries (bytes may already have
reached the client).

The work is done once per upstream read, not once per event: one read often completes several
events (a loaded gateway, a fast engine), which are split in bytes (never decoded to text), fed
to the dialect in order and sent to the client in one write.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import NoReturn

import anyio
import httpx

from datapool.models import StepOutcome
from gateway.dialects import DialectStream
from gateway.engine.wire import UNREADABLE
from gateway.errors import EventTooLargeError, TrajgateError, UpstreamError, UpstreamTimeoutError
from gateway.proxy.call import Call, commit, fail_call
from gateway.settings import GatewaySettings
from gateway.state import GatewayState
from gateway.upstream.replicas import ReplicaResponse
from gateway.upstream.weight_update import ABORTED_FOR_WEIGHT_UPDATE, CallAborted, aborted_error

log = logging.getLogger("trajgate.proxy")

DONE = b"[DONE]"


class SSEPayloads:
    """The ``data`` payloads of a server-sent event stream fed in arbitrary pieces, in bytes.

    The SSE rules (WHATWG HTML, "Interpreting an event stream"): a line ends at CRLF, LF or CR
    (a CRLF split between two pieces included); a line starting with ``:`` is a comment; a
    ``data`` line adds its value (one leading space removed) to the event's data, several
    ``data`` lines are joined by ``\n``; a blank line ends the event, which is dispatched only
    when it had a ``data`` line; other fields (``event``, ``id``, ``retry``) are read past; an
    unfinished event at the end of the stream is dropped. Bytes are never decoded: a UTF-8
    sequence holds no CR or LF byte, so a piece boundary inside one is kept as is.

    ``most_event_bytes`` bounds what is held of one event (its data lines and the line not
    ended yet): ``feed`` raises ``EventTooLargeError`` past it, with the payloads of the events the
    same piece completed before it.
    """

    def __init__(self, most_event_bytes: int) -> None:
        self._most = most_event_bytes
        self._tail = b""  # the unfinished line (never holds a CR: pieces are normalised first)
        self._data: list[bytes] | None = None  # the current event's data lines
        self._data_bytes = 0  # their bytes
        self._skip_lf = False  # the last piece ended in CR: a LF starting the next one is its pair

    def feed(self, piece: bytes) -> list[bytes]:
        """The payloads of the events ``piece`` completes, in order (often none or one).
        Raises ``EventTooLargeError`` when one event holds more than ``most_event_bytes``."""
        if self._skip_lf:
            self._skip_lf = False
            if piece[:1] == b"\n":
                piece = piece[1:]
        if b"\r" in piece:
            self._skip_lf = piece.endswith(b"\r")
            piece = piece.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        end = piece.rfind(b"\n")
        if end < 0:
            if len(self._tail) + len(piece) + self._data_bytes > self._most:
                self._too_large([])
            self._tail += piece
            return []
        lines = (self._tail + piece[:end]).split(b"\n") if self._tail else piece[:end].split(b"\n")
        self._tail = piece[end + 1 :]
        payloads: list[bytes] = []
        data = self._data
        held = self._data_bytes
        for line in lines:
            if not line:
                if data is not None:
                    payloads.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data = None
                    held = 0
            elif line.startswith(b"data:"):
                value = line[6:] if line[5:6] == b" " else line[5:]
                held += len(value)
                if held > self._most:
                    self._too_large(payloads)
                if data is None:
                    data = [value]
                else:
                    data.append(value)
            elif line == b"data":  # a field name without a colon has an empty value
                data = [b""] if data is None else [*data, b""]
        if held + len(self._tail) > self._most:
            self._too_large(payloads)
        self._data = data
        self._data_bytes = held
        return payloads

    def _too_large(self, completed: list[bytes]) -> NoReturn:
        raise EventTooLargeError(
            f"an upstream event passed the {self._most} bytes of upstream_max_event_bytes",
            completed=completed,
        )


async def sse_reads(response: httpx.Response, most_event_bytes: int) -> AsyncIterator[list[bytes]]:
    """The ``data`` payloads of ``response``'s server-sent events, one list per read that
    completed at least one event. A silence longer than the client's read timeout raises
    ``httpx.ReadTimeout`` from here, an event past ``most_event_bytes`` ``UpstreamError``."""
    parser = SSEPayloads(most_event_bytes)
    async for piece in response.aiter_bytes():
        try:
            payloads = parser.feed(piece)
        except EventTooLargeError as exc:
            if exc.completed:
                yield exc.completed  # raised at the next read, once these are captured
            raise
        if payloads:
            yield payloads


async def sse_data(response: httpx.Response, most_event_bytes: int) -> AsyncIterator[bytes]:
    """The ``data`` payload of each server-sent event of ``response``, in order."""
    async for payloads in sse_reads(response, most_event_bytes):
        for payload in payloads:
            yield payload


async def first_event(
    state: GatewayState, call: Call, upstream: ReplicaResponse
) -> tuple[AsyncIterator[list[bytes]], list[bytes] | None]:
    """Wait for the stream's first event before answering, so a slow first byte is still a
    clean 504 (nothing has been sent) rather than an error inside a 200 stream.

    Returns the upstream's payloads per read (``sse_reads``) and the first read's (None for an
    empty stream). Raises ``UpstreamTimeoutError`` (504) or ``UpstreamError`` (502) after
    recording the failed call.
    """
    replica = upstream.replica
    reads = sse_reads(upstream.response, state.settings.upstream_max_event_bytes)
    limit_s = state.settings.upstream_first_byte_timeout_s
    try:
        with anyio.fail_after(max(limit_s - call.elapsed_ms() / 1000, 0.0)):
            return reads, await reads.__anext__()
    except StopAsyncIteration:
        return reads, None
    except (TimeoutError, httpx.HTTPError, UpstreamError) as exc:
        await upstream.aclose()
        timeout = isinstance(exc, TimeoutError | httpx.TimeoutException)
        if timeout:
            outcome = call.attempts.timed_out(replica, repr(exc), status_code=200)
        else:
            outcome = call.attempts.upstream_error(replica, status_code=200, error=repr(exc))
        await fail_call(state, call, replica, outcome, repr(exc))
        if timeout:
            raise UpstreamTimeoutError(
                f"upstream {replica.url} sent no first chunk within {limit_s:g} s", code=outcome
            ) from exc
        if isinstance(exc, UpstreamError):
            raise
        raise UpstreamError(f"upstream {replica.url} stream failed: {exc!r}") from exc


class StreamTimedOut(Exception):
    """The upstream went silent too long, or the whole stream outlasted its limit."""


async def next_read(
    settings: GatewaySettings, reads: AsyncIterator[list[bytes]], deadline: float
) -> list[bytes] | None:
    """The payloads of the upstream's next read, None at the end of its stream.

    Time limits cost nothing per read: the silence between chunks is the HTTP client's read
    timeout (``upstream_between_chunks_timeout_s``), and the total limit (``deadline``, a
    ``time.perf_counter`` value) is checked as each read arrives (a stream that goes silent just
    before it ends one silence limit later). Raises ``StreamTimedOut`` with the limit it broke.
    """
    try:
        payloads = await reads.__anext__()
    except StopAsyncIteration:
        return None
    except httpx.TimeoutException as exc:
        limit_s = settings.upstream_between_chunks_timeout_s
        raise StreamTimedOut(f"upstream stopped sending within {limit_s:.3g} s") from exc
    if time.perf_counter() > deadline:
        limit_s = settings.upstream_total_timeout_s
        raise StreamTimedOut(f"upstream stream took longer than {limit_s:.3g} s in all")
    return payloads


async def relay_stream(
    state: GatewayState,
    call: Call,
    upstream: ReplicaResponse,
    reads: AsyncIterator[list[bytes]],
    first: list[bytes] | None,
) -> AsyncIterator[bytes]:
    """Yield the client's SSE bytes as the upstream's arrive, one write per upstream read;
    commit before the last ones.

    A client disconnect closes the upstream response (vLLM aborts the request) and records the
    partial step with finish reason ``client_disconnect``; a time limit ends the stream with the
    dialect's error event and records ``upstream_timeout``; so does an abort by a full-weight
    update (``gateway.upstream.weight_update``), recorded ``aborted_for_weight_update``, and a
    broken upstream stream or an event the dialect cannot read (``gateway.engine.wire.UNREADABLE``),
    recorded ``upstream_error``.
    Either way the step is never left open, and the response (with its in-flight count) is closed.
    """
    replica = upstream.replica
    metrics = state.metrics
    stream = call.dialect.open_stream(call.prepared, replica.system_fingerprint)
    call.ticket.sampled = stream.sampled_counts  # what a kept weight reload splits at
    feed = stream.feed
    deadline = call.started + state.settings.upstream_total_timeout_s
    abort_reason: str | None = None
    abort_error: str | None = None  # stored on the step of a stream that broke
    ttft_ms: float | None = None
    finished = False
    try:
        opening = stream.opening()
        if opening:
            yield b"".join(opening)
        payloads: list[bytes] | None = first  # first_event read it already
        events = 0  # fed to the dialect: a stream without any is no answer
        while True:
            if payloads is None:
                payloads = await call.ticket.guard(next_read(state.settings, reads, deadline))
                if payloads is None:
                    break
            out: list[bytes] = []
            try:
                for data in payloads:
                    if data == DONE:
                        finished = True
                        break
                    out += feed(data)
                    events += 1
            except UNREADABLE as exc:
                raise UpstreamError(
                    f"upstream {replica.url} sent an event the capture cannot read: {exc!r}"
                ) from exc
            if out:
                yield out[0] if len(out) == 1 else b"".join(out)
            if ttft_ms is None and stream.first_token_seen:
                ttft_ms = call.elapsed_ms()
                metrics.ttft.labels(call.dialect.name).observe(ttft_ms / 1000)
            if finished:
                break
            payloads = None
        if events == 0:  # an empty 200, or a body that is no event stream (JSON)
            kind = upstream.response.headers.get("content-type")
            raise UpstreamError(f"upstream {replica.url} answered a stream with no event ({kind})")
    except StreamTimedOut as exc:
        abort_reason = call.attempts.timed_out(replica, str(exc), status_code=200)
        yield stream.error_event(UpstreamTimeoutError(str(exc)))
    except CallAborted:
        abort_reason = call.attempts.aborted(replica, status_code=200)
        yield stream.error_event(aborted_error())
    except (asyncio.CancelledError, GeneratorExit):
        abort_reason = StepOutcome.CLIENT_DISCONNECT
        raise
    except (httpx.HTTPError, UpstreamError) as exc:
        # a broken connection or framing, or an event the capture cannot read: the step keeps
        # the tokens before it, flagged ``aborted`` with outcome upstream_error (never trained)
        abort_error = repr(exc)
        abort_reason = call.attempts.upstream_error(replica, status_code=200, error=abort_error)
        error = exc if isinstance(exc, UpstreamError) else None
        yield stream.error_event(error or UpstreamError(f"upstream stream failed: {exc!r}"))
    finally:
        with anyio.CancelScope(shield=True):
            not_recorded = await record_stream(
                state,
                call,
                upstream,
                stream,
                abort_reason,
                finished=finished,
                ttft_ms=ttft_ms,
                abort_error=abort_error,
            )
    if abort_reason is None and not_recorded is not None:
        # The status line went out before the commit could fail: the stream ends in an error
        # event (the OpenAI SDKs raise on it) instead of its last chunk and [DONE], so the
        # client knows to retry a call the pool could not keep.
        yield stream.error_event(not_recorded)
    elif abort_reason is None:
        yield b"".join(stream.closing())


async def record_stream(
    state: GatewayState,
    call: Call,
    upstream: ReplicaResponse,
    stream: DialectStream,
    abort_reason: str | None,
    *,
    finished: bool,
    ttft_ms: float | None,
    abort_error: str | None = None,
) -> TrajgateError | None:
    """Close the upstream response and commit what the stream captured; returns the error when
    the pool refused the commit (the client is told in-stream), else None.

    ``finished``: the upstream sent ``[DONE]``; ``abort_reason`` why the stream was cut short,
    ``abort_error`` what broke it (stored as the step's ``error``).
    """
    replica = upstream.replica
    await upstream.aclose()  # closing the connection makes vLLM abort the request
    call.ticket.release()  # sampling ended: a full-weight update need not wait for the commit
    captured = stream.captured(abort_reason)
    if finished and captured.error is None:
        call.attempts.ok(replica)
    elif captured.error is not None:  # vLLM's own error event ended the stream
        call.attempts.upstream_error(replica, status_code=200, error=json.dumps(captured.error))
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
        error=json.dumps(captured.error) if captured.error else abort_error,
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
