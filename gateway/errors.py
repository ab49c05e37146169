"""The gateway's exception tree and its one error envelope.

Owns: the exception classes every gateway route raises, the mapping of the pool's errors and of
FastAPI's own (unknown route, wrong method, failed validation) onto them, and the rendering of an
error as a response body or a stream event. Never: decides *whether* a request is an error (the
routes and ``gateway.proxy.attribution`` do).

An upstream's own error answer (vLLM's 4xx/5xx body, or the error event ending its stream) is
read with ``read_upstream_error`` into an ``UpstreamErrorBody``: vLLM's ``message`` and
``param`` kept as it wrote them, the ``type`` and ``code`` ours, from the table below by status
(a 4xx: ``invalid_request_error`` / ``invalid_request``, the engine refused the request as
sent; a 5xx: ``upstream_error`` / ``upstream_error``), so a client branches on the same values
whatever vLLM version answers (vLLM's own ``type`` is its exception class, ``BadRequestError``,
``NotFoundError``, ..., and its ``code`` the HTTP status as a number). Each dialect renders it
in its envelope (``upstream_envelope`` is OpenAI's); the step stores vLLM's body as sent.

An error is five things: ``status_code`` (HTTP), ``error_type`` (the class's kind), ``code`` (a
string a client can branch on: the class default unless the raiser names a finer one),
``message`` (says what was expected and what came) and ``param`` (the offending field, or None).
A dialect renders those five in its own shape (``ErrorRenderer``); the default is OpenAI's,

    {"error": {"message": str, "type": str, "param": str | None, "code": str}}

the same unstreamed (``error_response``) and as the last event of a stream (``sse_error_event``).
``tests/test_error_envelope.py`` walks every route of the app with bad input and checks it.

    class                               status  type                   default code
    TrajgateError                       500     internal_error         internal_error
     ├── InvalidRequestError            400     invalid_request_error  invalid_request
     │    ├── PayloadTooLargeError      413     invalid_request_error  payload_too_large
     │    ├── UnsupportedMediaTypeError 415     invalid_request_error  unsupported_media_type
     │    ├── RequestTimeoutError       408     invalid_request_error  request_timeout
     │    └── MethodNotAllowedError     405     invalid_request_error  method_not_allowed
     ├── AuthenticationError            401     authentication_error   unauthenticated
     ├── PermissionDeniedError          403     permission_error       permission_denied
     ├── NotFoundError                  404     not_found_error        not_found
     ├── UnprocessableError             422     invalid_request_error  unprocessable
     ├── ConflictError                  409     conflict_error         conflict
     ├── ServiceUnavailableError        503     service_unavailable    service_unavailable
     └── UpstreamError                  502     upstream_error         upstream_error
          ├── UpstreamTimeoutError      504     upstream_timeout       upstream_timeout
          └── EventTooLargeError        502     upstream_error         upstream_error

Finer codes named where raised: ``invalid_value``, ``unknown_parameter``,
``previous_response_not_found`` (400, the translating dialects; ``unknown_parameter`` also for a
query parameter an ``/api`` or ``/admin`` route does not declare, ``gateway.api.bodies``);
``invalid_cursor`` (400, ``GET /api/trajectories``); ``model_not_served`` (400,
``POST /admin/policy-versions`` and a full-weight ``POST /admin/weight-updates``);
``lora_not_enabled``, ``lora_adapter_not_found``, ``lora_adapter_refused`` (400, a replica
refused a LoRA update's adapter, ``gateway.upstream.adapters``); ``host_not_allowed`` (400,
``gateway.guard``); ``invalid_api_key``,
``missing_api_key``, ``invalid_admin_token`` (401); ``cross_site`` (403); ``unknown_target``,
``batch_not_found`` (404); ``trajectory_closed``, ``nothing_ready``, ``lease_lost``,
``ack_conflict``, ``policy_version_conflict``, ``trajectory_exists``, ``lora_adapter_active``
(409, ``gateway.api.lora``);
``idempotency_key_reused`` (422, an ``Idempotency-Key`` sent again with another body,
``gateway.proxy.answer``); ``payload_missing``
(500); ``pool_<fault reason>`` (503, e.g. ``pool_disk_full``, with Retry-After),
``no_capturing_upstream`` (503); ``aborted_for_weight_update`` (503, with Retry-After: still
sampling when a full-weight update's drain limit ran out, ``gateway.upstream.weight_update``);
``replica_weights_unknown`` (503, every replica the call could use took part in a full-weight
update that failed, ``gateway.upstream.replicas``); ``weight_update_failed`` (502, a replica
failed a step of a full-weight or LoRA update, ``gateway.api.admin``); ``lora_release_failed``
(502, a replica failed an adapter release's unload or none answered its model list,
``gateway.api.lora``);
``upstream_unreachable`` (504 when the connection timed out, else 502 ``upstream_error``).

The pool's own errors (``datapool.errors.PoolError``) map onto this tree with ``from_pool_error``:
TrajectoryClosedError → 409, VersionConflictError → 409, TrajectoryExistsError → 409,
CurationRuleFailedError → 409 (code ``curation_rule_failed``), UnknownTargetError → 404,
InvalidPoolRequestError → 400, PoolUnavailableError → 503, PayloadMissingError → 500.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from datapool.errors import (
    CurationRuleFailedError,
    InvalidPoolRequestError,
    PoolError,
    PoolUnavailableError,
    TrajectoryClosedError,
    TrajectoryExistsError,
    UnknownTargetError,
    VersionConflictError,
)
from datapool.steps.faults import fault_reason
from datapool.steps.payloads import PayloadMissingError

log = logging.getLogger("trajgate.gateway")


class TrajgateError(Exception):
    """Base of every error the gateway answers on purpose; ``code`` defaults to the class's."""

    status_code = 500
    error_type = "internal_error"
    default_code = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code: str = code if code is not None else self.default_code
        self.headers = headers


class InvalidRequestError(TrajgateError):
    status_code = 400
    error_type = "invalid_request_error"
    default_code = "invalid_request"


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413
    default_code = "payload_too_large"


class UnsupportedMediaTypeError(InvalidRequestError):
    """A write whose ``Content-Type`` is not JSON (``gateway.guard``)."""

    status_code = 415
    default_code = "unsupported_media_type"


class RequestTimeoutError(InvalidRequestError):
    """A request's body did not arrive within ``request_body_timeout_s`` (``gateway.guard``,
    under uvicorn's own protocols; ``gateway.http_protocol`` answers it itself otherwise)."""

    status_code = 408
    default_code = "request_timeout"


class MethodNotAllowedError(InvalidRequestError):
    """The path exists, the method does not (``headers`` carry ``Allow``)."""

    status_code = 405
    default_code = "method_not_allowed"


class AuthenticationError(TrajgateError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "unauthenticated"


class PermissionDeniedError(TrajgateError):
    status_code = 403
    error_type = "permission_error"
    default_code = "permission_denied"


class NotFoundError(TrajgateError):
    status_code = 404
    error_type = "not_found_error"
    default_code = "not_found"


class UnprocessableError(TrajgateError):
    """A well-formed request the gateway will not process as sent (an ``Idempotency-Key``
    reused with another body: 422, as the IETF's Idempotency-Key header draft asks)."""

    status_code = 422
    error_type = "invalid_request_error"
    default_code = "unprocessable"


class ConflictError(TrajgateError):
    """The request conflicts with the pool's state (e.g. a call for a closed trajectory)."""

    status_code = 409
    error_type = "conflict_error"
    default_code = "conflict"


class ServiceUnavailableError(TrajgateError):
    """The pool cannot take writes now; retry later (nothing was half-written)."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "service_unavailable"


class UpstreamError(TrajgateError):
    status_code = 502
    error_type = "upstream_error"
    default_code = "upstream_error"


class UpstreamTimeoutError(UpstreamError):
    status_code = 504
    error_type = "upstream_timeout"
    default_code = "upstream_timeout"


class EventTooLargeError(UpstreamError):
    """An upstream event passed ``upstream_max_event_bytes`` (``gateway.proxy.streaming``);
    ``completed``: the payloads of the events the same read completed before it (their tokens
    are captured before the stream ends with this error)."""

    def __init__(
        self,
        message: str,
        *,
        completed: list[bytes] | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, param=param, code=code)
        self.completed: list[bytes] = completed if completed is not None else []


def from_pool_error(exc: PoolError) -> TrajgateError:
    """The gateway error a pool error becomes (status per the tree in the module docstring)."""
    if isinstance(exc, TrajectoryClosedError):
        return ConflictError(exc.message, param=exc.param, code="trajectory_closed")
    if isinstance(exc, VersionConflictError):
        return ConflictError(exc.message, param=exc.param, code="policy_version_conflict")
    if isinstance(exc, CurationRuleFailedError):
        return ConflictError(exc.message, param=exc.param, code="curation_rule_failed")
    if isinstance(exc, TrajectoryExistsError):
        return ConflictError(exc.message, param=exc.param, code="trajectory_exists")
    if isinstance(exc, UnknownTargetError):
        return NotFoundError(exc.message, param=exc.param, code="unknown_target")
    if isinstance(exc, InvalidPoolRequestError):
        return InvalidRequestError(exc.message, param=exc.param)
    if isinstance(exc, PoolUnavailableError):
        # The code names the fault (pool_disk_full, pool_locked, pool_unreachable, ...) so a
        # client or an alert can tell them apart; Retry-After says when to come back.
        return ServiceUnavailableError(
            exc.message,
            code=f"pool_{exc.reason}",
            headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))},
        )
    if isinstance(exc, PayloadMissingError):  # lost data: say which, never a bare 500
        return TrajgateError(exc.message, code="payload_missing")
    return TrajgateError(exc.message, param=exc.param)


# Starlette's own HTTP errors (routing, body limits) by status; any other 4xx is a bad request.
_HTTP_ERRORS: dict[int, type[TrajgateError]] = {
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    408: RequestTimeoutError,
    409: ConflictError,
    413: PayloadTooLargeError,
    415: UnsupportedMediaTypeError,
    503: ServiceUnavailableError,
}


def from_http_exception(exc: StarletteHTTPException) -> TrajgateError:
    """The gateway error a Starlette ``HTTPException`` becomes; keeps its status and headers."""
    error_class = _HTTP_ERRORS.get(exc.status_code)
    if error_class is None:
        error_class = InvalidRequestError if exc.status_code < 500 else TrajgateError
    error = error_class(str(exc.detail), headers=dict(exc.headers) if exc.headers else None)
    error.status_code = exc.status_code  # an unlisted 4xx/5xx keeps its own status
    return error


def from_validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """A 400 naming the first failing field (``param``, dotted, without its location).

    Example: ``GET /api/batches?limit=x`` → param ``limit``, message "Input should be a valid
    integer, unable to parse string as an integer; got 'x'".
    """
    errors = exc.errors()
    first = errors[0] if errors else {}
    kind = first.get("type")
    if kind == "json_invalid":  # located by ("body", offset): no field is at fault
        detail = (first.get("ctx") or {}).get("error")
        return InvalidRequestError(f"request body is not valid JSON: {detail or 'decode error'}")
    param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
    if kind == "missing":
        return InvalidRequestError(
            f"{param!r} is required" if param else "a request body is required", param=param
        )
    if kind == "extra_forbidden":
        return InvalidRequestError(
            f"unknown field {param!r}: this request does not take it (unknown fields are refused, "
            "never ignored; nothing was changed)",
            param=param,
        )
    message = str(first.get("msg") or "invalid request")
    if "input" in first:
        got = repr(first["input"])
        message += f"; got {got if len(got) <= 80 else got[:77] + '...'}"
    return InvalidRequestError(message, param=param)


ErrorRenderer = Callable[[TrajgateError], Mapping[str, object]]
"""Renders an error as a dialect's JSON body (from ``status_code``, ``error_type``, ``code``,
``message``, ``param``), typed as the dialect's envelope; ``openai_envelope`` is the default."""


class ErrorObject(TypedDict):
    message: str
    type: str
    param: str | None
    code: str


class ErrorEnvelope(TypedDict):
    """OpenAI's error body, the gateway's one envelope."""

    error: ErrorObject


def openai_envelope(error: TrajgateError) -> ErrorEnvelope:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.code,
        }
    }


def error_response(error: TrajgateError, render: ErrorRenderer = openai_envelope) -> JSONResponse:
    """The unstreamed answer for ``error``: its status, its headers, its rendered body."""
    return JSONResponse(render(error), status_code=error.status_code, headers=error.headers)


def sse_error_event(error: TrajgateError, render: ErrorRenderer = openai_envelope) -> bytes:
    """The SSE event that ends a stream in ``error`` (after the status line went out as 200):
    ``data: <rendered body>`` and a blank line, the body the same as unstreamed."""
    return b"data: " + json.dumps(render(error)).encode() + b"\n\n"


@dataclass(frozen=True)
class UpstreamErrorBody:
    """A non-200 upstream answer as read from its body.

    ``message`` and ``param`` are vLLM's (``error.message``, ``error.param``; a body that is not
    vLLM's envelope gives its ``message`` or its text); ``error_type`` and ``code`` are ours
    for the status; ``is_json`` is False when the body was not a JSON object (then it is best
    passed on as it came, with its own content type).
    """

    status_code: int
    message: str
    param: str | None
    is_json: bool

    @property
    def error_type(self) -> str:
        """Our type: ``invalid_request_error`` for a 4xx, ``upstream_error`` for anything else
        (vLLM's is its exception's class name, which changes with its version)."""
        refused = self.status_code < 500
        return (InvalidRequestError if refused else UpstreamError).error_type

    @property
    def code(self) -> str:
        """Our string code: ``invalid_request`` for a 4xx (the engine refused the request as
        sent), ``upstream_error`` for anything else."""
        refused = self.status_code < 500
        return (InvalidRequestError if refused else UpstreamError).default_code


def read_upstream_error(status_code: int, content: bytes) -> UpstreamErrorBody:
    """vLLM's error body ``{"error": {"message", "type", "param", "code"}}`` (or any other
    body) read as an ``UpstreamErrorBody``. Never raises."""
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    outer = parsed if isinstance(parsed, dict) else {}
    inner = outer.get("error")
    fields = inner if isinstance(inner, dict) else outer
    message = fields.get("message") or outer.get("message")
    param = fields.get("param")
    return UpstreamErrorBody(
        status_code=status_code,
        message=str(message)
        if message
        else content.decode("utf-8", "replace") or f"upstream status {status_code}",
        param=param if isinstance(param, str) else None,
        is_json=isinstance(parsed, dict),
    )


def stream_error_status(error: dict[str, Any]) -> int:
    """The HTTP status an error event inside vLLM's stream stands for: its numeric ``code``
    (vLLM writes the status there), else 500 (the stream broke on the engine's side)."""
    code = error.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599:
        return code
    return 500


def upstream_envelope(error: UpstreamErrorBody, param: str | None) -> dict[str, Any]:
    """OpenAI's envelope for an upstream error: vLLM's message, ``param`` as the dialect names
    it (vLLM's own for a dialect that passes the body through), our ``type`` and ``code``."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": param,
            "code": error.code,
        }
    }


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI can raise through the one envelope.

    A route whose dialect has its own envelope sets ``request.state.render_error`` (an
    ``ErrorRenderer``, e.g. in a router dependency); every other request gets OpenAI's.
    """

    def respond(request: Request, error: TrajgateError) -> JSONResponse:
        render: ErrorRenderer = getattr(request.state, "render_error", openai_envelope)
        return error_response(error, render)

    @app.exception_handler(TrajgateError)
    async def _trajgate(request: Request, exc: TrajgateError) -> JSONResponse:
        return respond(request, exc)

    @app.exception_handler(PoolError)
    async def _pool(request: Request, exc: PoolError) -> JSONResponse:
        return respond(request, from_pool_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(request, from_http_exception(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, from_validation_error(exc))

    @app.exception_handler(SQLAlchemyError)
    async def _database(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        # A read or write of the pool API that met a storage fault: 503 with its reason, so a
        # full disk or a lost database reads as what it is, not as a bug.
        reason = fault_reason(exc)
        if reason == "other":
            return await _unexpected(request, exc)
        operation = f"{request.method} {request.url.path}"
        gateway = getattr(request.app.state, "gateway", None)
        writer = getattr(gateway, "writer", None)
        if writer is not None:  # counted and logged with the write path's faults
            unavailable = writer.report_fault(exc, operation)
        else:
            log.error("pool %s failed (%s): %r", operation, reason, exc)
            unavailable = PoolUnavailableError(
                f"the pool's database failed ({reason}) during {operation}", reason=reason
            )
        return respond(request, from_pool_error(unavailable))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, TrajgateError(f"internal error: {type(exc).__name__}"))
