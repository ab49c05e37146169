"""The interface every API dialect implements, and the shapes it hands the proxy.

A dialect is one client-facing API: chat completions and completions pass through to vLLM's
own endpoints (``gateway.dialects.choices``); the Responses and Messages APIs translate to chat
completions (``gateway.dialects.translation``). ``gateway.proxy.routes`` runs every call the
same way and asks the dialect, through ``Dialect`` and the per-stream ``DialectStream``, for
everything that depends on the API:

=====================  =====================================================================
client paths           ``client_paths`` under ``/v1``; the proxy serves each at ``/v1<path>``
                       and ``/t/{trajectory_id}/v1<path>``
side routes            ``side_routes``: the dialect's routes that are not captured calls
                       (``SideRoute``: the Messages API's ``/messages/count_tokens``), served at
                       the same two places after the same key and channel checks as a call;
                       their handler reaches the engine only through ``Engine`` and records
                       nothing
upstream path          ``upstream_path``: the vLLM path called, which need not be the client's
upstream body          ``prepare``: the one translation of a call, run as soon as its body is
                       read: it checks the body (``InvalidRequestError``, 400; every error of
                       the dialect's routes is rendered by its ``render_error``) and writes
                       what the engine must be asked for to capture token-exactly (ids,
                       logprobs, usage), translated when the upstream speaks another API (the
                       proxy then adds the channel's sampling defaults a client omitted,
                       ``with_sampling_defaults``: recorded, since the step stores the body)
earlier calls          ``earlier_call_id``: the step (or, for older references, the call) a
                       body continues (the Responses API's ``previous_response_id``); the
                       proxy reads that step from the pool and hands it to ``prepare_call``
                       with the prepared call, the resolved model and the id the new call's
                       first step will be recorded under (no second translation)
canonical record       ``canonical``: the engine's body as the pool's ``CanonicalCall``
                       (``datapool.steps.canonical``), written once per call when its record
                       is made; ``history_field`` names the client body's list that repeats
                       the history (stored as a delta on the parent's)
unary capture          ``read_answer``: prompt ids, per choice the sampled ids, behaviour
                       logprobs, the response message in the common form (``content``,
                       ``tool_calls``, ``reasoning``) and finish reason
client answer          ``client_answer``: returns the upstream answer object itself when the
                       client sees it unchanged (then vLLM's own bytes are sent), else the
                       client's JSON (fields removed, or the answer rendered in the dialect)
upstream errors        ``upstream_error_body``: a non-200 upstream body as the client sees it
                       (``gateway.errors.read_upstream_error``: vLLM's message and param in
                       the dialect's envelope, with our type and string ``code``)
streams                ``open_stream`` gives a ``DialectStream``: it consumes each upstream SSE
                       ``data`` payload, accumulates the capture and returns the framed bytes
                       to send now (zero, one or several events), plus opening and closing
                       events and the event that ends a stream in error
=====================  =====================================================================

The client's body as sent and the upstream body are both stored on the step; re-send detection
hashes the client's body with the dialect's ``name`` (``gateway.capture.request_hash``).

Never: talks HTTP, reads settings, retries or writes to the pool; a dialect is pure translation
between one client API and the engine's answers.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NoReturn, Protocol

from datapool.steps.canonical import CanonicalCall, Message
from datapool.steps.records import ChoiceRecord
from gateway.errors import InvalidRequestError, TrajgateError, openai_envelope


@dataclass(frozen=True)
class ClientAsked:
    """Which capture fields the client itself asked for (so they are not hidden from it).

    ``logprobs`` is True for chat ``logprobs: true`` and for completions ``logprobs: <int>``;
    ``include_usage`` for a stream with ``stream_options.include_usage: true`` (always True for
    a unary call, whose answer carries usage anyway).
    """

    return_token_ids: bool
    logprobs: bool
    include_usage: bool = True


@dataclass(frozen=True)
class Prepared:
    """One call as its dialect prepared it.

    ``client_body`` is the client's body with the model alias resolved, ``upstream_body`` the
    body sent to ``upstream_path``, ``n_choices`` how many choices (so steps) the call yields.
    """

    client_body: dict[str, Any]
    upstream_body: dict[str, Any]
    asked: ClientAsked
    n_choices: int = 1

    @property
    def stream(self) -> bool:
        return self.client_body.get("stream") is True


@dataclass(frozen=True)
class EarlierCall:
    """What the pool holds of an earlier call's first step: the client's request as sent, the
    body sent upstream, and the response message in the common form (``content``,
    ``tool_calls``, ``reasoning``)."""

    request: dict[str, Any]
    upstream_request: dict[str, Any]
    response_message: dict[str, Any]


def with_sampling_defaults(prepared: Prepared, defaults: dict[str, Any]) -> Prepared:
    """``prepared`` with each of ``defaults`` (upstream field → value) set in its upstream body
    where the body lacks the field or holds ``null`` (the client omitted it: every dialect's
    upstream is a chat or completions body, whose field names the defaults use). The same
    object when nothing is added; else a copy of the same class."""
    upstream = prepared.upstream_body
    missing = {name: value for name, value in defaults.items() if upstream.get(name) is None}
    if not missing:
        return prepared
    return replace(prepared, upstream_body={**upstream, **missing})


def with_model(prepared: Prepared, model: Any) -> Prepared:
    """``prepared`` with ``model`` in both bodies (the same object when it is there already):
    every dialect's client and upstream bodies name the model in ``model``."""
    if prepared.client_body.get("model") == model and prepared.upstream_body.get("model") == model:
        return prepared
    return replace(
        prepared,
        client_body={**prepared.client_body, "model": model},
        upstream_body={**prepared.upstream_body, "model": model},
    )


def check_limits(
    dialect: Dialect, prepared: Prepared, limits: Mapping[str, tuple[int, str]]
) -> None:
    """Raise ``InvalidRequestError`` (400, naming the client's field) when a call asks for more
    than ``limits`` allow: upstream field → (most, the gateway setting). Checked on the client's
    body as sent (a field it names as the upstream does, e.g. completions' ``max_completion_tokens``
    before it is sent as ``max_tokens``), then on the upstream body, where every dialect's fields
    have their chat or completions names (``Dialect.client_field`` names them back). A boolean
    (chat's ``logprobs: true``) or a non-number is left to the engine to judge."""
    for body, client_name in (
        (prepared.client_body, str),
        (prepared.upstream_body, dialect.client_field),
    ):
        for name, (most, setting) in limits.items():
            value = body.get(name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= most:
                continue
            _refuse_over_limit(client_name(name), value, most, setting)


def _refuse_over_limit(field_name: str, value: float, most: int, setting: str) -> NoReturn:
    digits = str(value)
    shown = digits if len(digits) <= 24 else f"{digits[:8]}... ({len(digits)} digits)"
    raise InvalidRequestError(
        f"'{field_name}' must be at most {most} (the gateway's {setting} setting), got {shown}",
        param=field_name,
        code="invalid_value",
    )


@dataclass(frozen=True)
class Captured:
    """What one call captured, ready for its step record.

    ``prompt_ids`` is ``[P]`` as the engine reported it (None when missing); ``prompt_tokens``
    the usage count; ``error`` an error object the upstream sent inside its stream;
    ``system_fingerprint`` the upstream's, learnt per replica for streams that drop usage.
    """

    prompt_ids: list[int] | None
    choices: list[ChoiceRecord]
    prompt_tokens: int | None
    model: str | None
    error: dict[str, Any] | None = None
    system_fingerprint: str | None = None


def sse_event(data: bytes, event: str | None = None) -> bytes:
    """One server-sent event: ``data: <data>\\n\\n``, with ``event: <event>\\n`` first when named
    (the Anthropic framing)."""
    if event is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


def frame(event: Mapping[str, object]) -> bytes:
    """One named event as SSE: ``event: <type>\\ndata: <compact json>\\n\\n`` (the framing of
    the Responses and Messages streams; ``event`` is any of their typed events)."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
    return sse_event(data, str(event["type"]))


class Engine(Protocol):
    """What a side route may ask of the engine (the proxy core provides it, on a replica it
    picks): vLLM's own endpoints that record nothing."""

    async def tokenize(self, payload: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``POST /tokenize`` answer (``{"count", "max_model_len", "tokens"}``) for
        ``payload``. Raises ``EngineRefused`` when vLLM answers an error status,
        ``UpstreamError`` (502) when it cannot be reached or answers no JSON object."""
        ...


class EngineRefused(Exception):
    """The engine answered a side route's request with ``status_code`` and ``content``: the
    client gets that status with the content as the dialect shows upstream errors
    (``Dialect.upstream_error_body``)."""

    def __init__(self, status_code: int, content: bytes) -> None:
        super().__init__(status_code)
        self.status_code = status_code
        self.content = content


@dataclass(frozen=True)
class SideRoute:
    """A ``POST`` route of a dialect that is not a captured call, at ``/v1<path>`` and
    ``/t/{trajectory_id}/v1<path>``: ``answer(body, engine)`` turns the client's JSON object
    into the JSON answered with 200. Nothing is recorded; the caller's key passes the checks a
    call's does (401, 403 for another trajectory or channel). Errors it raises
    (``InvalidRequestError``, ``UpstreamError``, ``EngineRefused``) reach the client in the
    dialect's envelope."""

    path: str
    answer: Callable[[dict[str, Any], Engine], Awaitable[dict[str, Any]]]


class DialectStream(ABC):
    """The state of one streamed call: feed upstream SSE payloads in order, send what comes back.

    Every method returns framed SSE bytes (``sse_event``). The proxy calls ``opening`` once
    before the first upstream event, ``feed`` per upstream ``data`` payload (``[DONE]``
    excluded), commits the steps, then sends ``closing``; when the stream cannot end normally
    (time limit, upstream failure, commit refused) it sends ``error_event`` instead.
    ``first_token_seen`` turns True once a sampled token arrived (time to first token).
    """

    first_token_seen: bool = False

    def opening(self) -> list[bytes]:
        """Events the client gets before any upstream event (none for chat and completions)."""
        return []

    @abstractmethod
    def feed(self, data: bytes) -> list[bytes]:
        """Take one upstream ``data`` payload; return the events to flush to the client now.
        Raises one of ``gateway.engine.wire.UNREADABLE`` for a payload it cannot read (not UTF-8,
        not a JSON object, a field of the wrong kind): the proxy then ends the stream in error."""

    @abstractmethod
    def closing(self) -> list[bytes]:
        """The events that end a complete stream, sent after the commit (held-back events,
        closing events, the terminator)."""

    @abstractmethod
    def error_event(self, error: TrajgateError) -> bytes:
        """The event that ends a stream in ``error`` (the status line already said 200)."""

    @abstractmethod
    def sampled_counts(self) -> dict[int, int]:
        """Sampled tokens read so far, by choice index (where a kept weight reload splits the
        call's versions: ``gateway.upstream.weight_update``)."""

    @abstractmethod
    def captured(self, abort_reason: str | None) -> Captured:
        """The capture so far. ``abort_reason`` (``client_disconnect``, ``upstream_timeout``,
        ``upstream_error``) replaces a missing finish reason and flags the step ``aborted``."""


class Dialect(ABC):
    """One client-facing API; see the module docstring for what each member answers."""

    # Stored as the step's ``endpoint`` and used as the metrics label: keep it stable.
    name: ClassVar[str]
    client_paths: ClassVar[tuple[str, ...]]
    upstream_path: ClassVar[str]
    # Routes of the dialect that are not captured calls (e.g. counting tokens), served under
    # ``/v1`` and ``/t/{trajectory_id}/v1`` like the client paths.
    side_routes: ClassVar[tuple[SideRoute, ...]] = ()
    # The client body's field that holds the history an agent resends (None: none), so the
    # pool stores it as a delta on the parent's without knowing the dialect.
    history_field: ClassVar[str | None] = None

    @abstractmethod
    def prepare(self, body: dict[str, Any]) -> Prepared:
        """The upstream body for the client's ``body`` (never mutated) and what it asked for:
        the call's one translation. Raises ``InvalidRequestError`` when the body cannot be
        captured; everything else is the engine's to judge."""

    @abstractmethod
    def canonical(self, upstream_body: Mapping[str, Any]) -> CanonicalCall:
        """The canonical record of a call whose engine body is ``upstream_body`` (the body
        ``prepare`` wrote, sampling defaults included): called once per call, and by the pool's
        migration for steps stored before the record existed."""

    def canonical_continuing(
        self, upstream_body: Mapping[str, Any], known: tuple[Message, ...]
    ) -> CanonicalCall:
        """``canonical``, given ``known``: the canonical messages of the first ``len(known)``
        messages of the body's ``messages`` (all objects), made for an earlier call from the
        same JSON (``gateway.proxy.continuation.walk`` proves it), so a dialect whose record
        is made message by message reads only the messages after them. By default they are
        not used: the record is made whole."""
        return self.canonical(upstream_body)

    def client_field(self, upstream_field: str) -> str:
        """The client's name of a field of the upstream body (default: the same name)."""
        return upstream_field

    def earlier_call_id(self, body: dict[str, Any]) -> str | None:
        """The id of the earlier step of the same trajectory that ``body`` continues, or of
        its call (``datapool.steps.calls.find_exchange`` reads either; None: none, the
        default). Raises ``InvalidRequestError`` when the reference cannot name a
        call (the proxy then answers 400 before any lookup)."""
        return None

    def prepare_call(
        self, prepared: Prepared, model: Any, step_id: str, earlier: EarlierCall | None
    ) -> Prepared:
        """``prepared`` for the call whose first step will be recorded as ``step_id``, with the
        policy's upstream ``model`` (the alias resolved), given the earlier step
        ``earlier_call_id`` named (None when it named none, or the pool has no such step).
        Default: ``with_model``."""
        return with_model(prepared, model)

    @abstractmethod
    def read_answer(self, prepared: Prepared, answer: dict[str, Any]) -> Captured:
        """The capture of a unary upstream answer (its parsed JSON object). Raises one of
        ``gateway.engine.wire.UNREADABLE`` for an answer it cannot read (a field of the wrong
        kind)."""

    @abstractmethod
    def client_answer(self, prepared: Prepared, answer: dict[str, Any]) -> dict[str, Any]:
        """The client's answer: ``answer`` itself (the very object) when nothing changes."""

    def upstream_error_body(self, status_code: int, content: bytes) -> bytes:
        """A non-200 upstream answer as the client sees it (default: unchanged)."""
        return content

    @abstractmethod
    def open_stream(self, prepared: Prepared, system_fingerprint: str | None) -> DialectStream:
        """The state of one streamed call; ``system_fingerprint`` is the replica's when known."""

    def render_error(self, error: TrajgateError) -> Mapping[str, object]:
        """An error's body in the dialect's shape (an ``ErrorRenderer``; default: OpenAI's
        ``{"error": {"message", "type", "param", "code"}}``)."""
        return openai_envelope(error)
