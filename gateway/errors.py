"""The gateway's exception tree and its one JSON error envelope.

Every error a client sees has OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``,
with the HTTP status from the exception class. A test walks every route with bad input and
checks the shape.

    TrajgateError                      500 internal_error
     ├── InvalidRequestError           400 invalid_request_error
     │    └── PayloadTooLargeError     413 invalid_request_error
     ├── AuthenticationError           401 authentication_error
     ├── PermissionDeniedError         403 permission_error
     ├── NotFoundError                 404 not_found_error
     ├── ConflictError                 409 conflict_error
     ├── ServiceUnavailableError       503 service_unavailable
     └── UpstreamError                 502 upstream_error
          └── UpstreamTimeoutError     504 upstream_timeout

The pool's own errors (``datapool.errors.PoolError``) map onto this tree with ``from_pool_error``:
TrajectoryClosedError → 409, UnknownTargetError → 404, InvalidPoolRequestError → 400,
PoolUnavailableError → 503.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException as StarletteHTTPException

from datapool.errors import (
    InvalidPoolRequestError,
    PoolError,
    PoolUnavailableError,
    TrajectoryClosedError,
    UnknownTargetError,
)
from datapool.steps.faults import fault_reason
from datapool.steps.payloads import PayloadMissingError

log = logging.getLogger("trajgate.gateway")


class TrajgateError(Exception):
    status_code = 500
    error_type = "internal_error"

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
        self.code = code
        self.headers = headers


class InvalidRequestError(TrajgateError):
    status_code = 400
    error_type = "invalid_request_error"


class PayloadTooLargeError(InvalidRequestError):
    status_code = 413


class AuthenticationError(TrajgateError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(TrajgateError):
    status_code = 403
    error_type = "permission_error"


class NotFoundError(TrajgateError):
    status_code = 404
    error_type = "not_found_error"


class ConflictError(TrajgateError):
    """The request conflicts with the pool's state (e.g. a call for a closed trajectory)."""

    status_code = 409
    error_type = "conflict_error"


class ServiceUnavailableError(TrajgateError):
    """The pool cannot take writes now; retry later (nothing was half-written)."""

    status_code = 503
    error_type = "service_unavailable"


def from_pool_error(exc: PoolError) -> TrajgateError:
    """The gateway error a pool error becomes (status per the tree in the module docstring)."""
    if isinstance(exc, TrajectoryClosedError):
        return ConflictError(exc.message, param=exc.param, code="trajectory_closed")
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


class UpstreamError(TrajgateError):
    status_code = 502
    error_type = "upstream_error"


class UpstreamTimeoutError(UpstreamError):
    status_code = 504
    error_type = "upstream_timeout"


def envelope(
    message: str, error_type: str, *, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception FastAPI can raise through the one envelope."""

    @app.exception_handler(TrajgateError)
    async def _trajgate(_request: Request, exc: TrajgateError) -> JSONResponse:
        return JSONResponse(
            envelope(exc.message, exc.error_type, param=exc.param, code=exc.code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(PoolError)
    async def _pool(request: Request, exc: PoolError) -> JSONResponse:
        return await _trajgate(request, from_pool_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            envelope(str(exc.detail), error_type, code=exc.status_code),
            status_code=exc.status_code,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return JSONResponse(
            envelope(
                str(first.get("msg", "invalid request")), "invalid_request_error", param=param
            ),
            status_code=400,
        )

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
        return await _trajgate(request, from_pool_error(unavailable))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            envelope(f"internal error: {type(exc).__name__}", "internal_error"), status_code=500
        )
