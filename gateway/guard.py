"""The edge guard: what every HTTP request must pass before any route runs or reads its body.

Owns: ``EdgeGuard``, a raw ASGI middleware (one pass over the request's headers, no per-request
objects on the path of an accepted call), which refuses, in this order:

=====  ==========================  =============================================================
400    ``host_not_allowed``        a ``Host`` that is not one of this gateway's names
                                   (``allowed_hosts``: DNS rebinding would let a web page read
                                   the pool through a name the attacker controls)
403    ``cross_site``              a write (POST, PUT, PATCH, DELETE) a browser sent for another
                                   site's page: ``Sec-Fetch-Site`` ``cross-site``/``same-site``,
                                   or an ``Origin`` that is not this gateway's own
415    ``unsupported_media_type``  a write whose ``Content-Type`` is not JSON (``application/json``
                                   or ``application/*+json``): the types a page may send without
                                   a CORS preflight (``text/plain``, forms) are never JSON
401    ``invalid_admin_token``     ``/api`` and ``/admin`` without the admin token (when one is
                                   set), before a byte of the body is read
413    ``payload_too_large``       a declared ``Content-Length`` over ``max_body_bytes``; a body
                                   sent without a length is counted as it is read and cut there
=====  ==========================  =============================================================

A request with a body that passes holds, until its answer is complete, the bytes of it its
route has read out of the process's budget of body bytes (``gateway.body_budget``,
``max_body_bytes_in_flight``): each piece waits there for room before the route gets it. The
upstream answer a call reads whole grows the same holding (``gateway.body_budget``). A route
checks the API key before reading the body, so a refused key holds nothing.

A request whose client leaves before its route has read the body (a disconnect, or the 408 of
the body deadline) ends with one INFO line, not a traceback.

Under uvicorn's own HTTP protocols (``http_protocol`` ``httptools`` or ``h11``, which know no
body deadline) the guard keeps ``request_body_timeout_s`` itself: the time the route waits in
``receive`` for pieces of the body is summed (time the route spends elsewhere, as waiting for
body budget, is the gateway's, not the client's); past the limit the route's read raises a 408
``request_timeout`` answered with ``Connection: close``, so uvicorn closes the connection after
it and nothing is recorded. Under the gateway's own protocol it does nothing of the kind
(``gateway.http_protocol`` keeps both deadlines).

Errors are rendered in the envelope of the dialect whose path was asked (Anthropic's for
``/v1/messages``), OpenAI's everywhere else. Never: reads or buffers a body; decides what a
route does with one (a route still checks its own body, and its own token, behind this).

A request without ``Content-Type`` or without ``Host`` passes those two checks: browsers always
send both on the requests this guards against, and the SDKs always send JSON. The same-origin
check compares ``Origin`` with ``Host``, so a reverse proxy in front must pass ``Host`` through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.auth import check_admin_token
from gateway.body_budget import BodyBudget, Holding
from gateway.dialects import DIALECTS, Dialect
from gateway.errors import (
    AuthenticationError,
    ErrorRenderer,
    InvalidRequestError,
    PayloadTooLargeError,
    PermissionDeniedError,
    TrajgateError,
    UnsupportedMediaTypeError,
    error_response,
    openai_envelope,
)
from gateway.settings import HTTP_PROTOCOLS, GatewaySettings, allowed_host_names

log = logging.getLogger("trajgate.guard")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
ADMIN_PREFIXES = ("/api", "/admin")


class _BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body without a declared length passes the limit: an
    ``HTTPException`` so FastAPI's body reader lets it through to the app's error handlers,
    which render it in the route's envelope as ``payload_too_large``."""

    def __init__(self, max_body_bytes: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {max_body_bytes} bytes")


class _BodyDeadline(HTTPException):
    """Raised from ``receive`` when the body took longer than ``request_body_timeout_s`` (only
    under uvicorn's own protocols): an ``HTTPException`` for the reason ``_BodyTooLarge`` is one,
    rendered as 408 ``request_timeout``; ``Connection: close`` ends the connection after it."""

    def __init__(self, body_timeout_s: float) -> None:
        super().__init__(
            408,
            f"the request's body did not arrive within {body_timeout_s:g} s "
            "(TRAJGATE_REQUEST_BODY_TIMEOUT_S)",
            headers={"connection": "close"},
        )


def declared_length(content_length: bytes | None) -> int:
    """A ``Content-Length`` header's bytes; 0 when absent or not digits (the HTTP parser
    refuses such a head before the app sees it)."""
    return int(content_length) if content_length and content_length.isdigit() else 0


class EdgeGuard:
    """The checks of the module docstring, configured once from ``settings``."""

    def __init__(
        self,
        app: ASGIApp,
        settings: GatewaySettings,
        dialects: Sequence[Dialect] = DIALECTS,
        body_budget: BodyBudget | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = settings.max_body_bytes
        # The app's budget (``create_app`` keeps it on ``app.state``: its counters), else our own.
        self.body_budget = body_budget or BodyBudget(settings.max_body_bytes_in_flight)
        self.admin_token = settings.admin_token
        self.host_names = allowed_host_names(settings)  # None: any host name
        # The body deadline, where the HTTP protocol does not keep it (module docstring).
        self.body_timeout_s: float | None
        match settings.http_protocol:
            case "own":
                self.body_timeout_s = None
            case "httptools" | "h11":
                self.body_timeout_s = settings.request_body_timeout_s
            case other:
                raise ValueError(
                    f"http_protocol must be one of {', '.join(HTTP_PROTOCOLS)}, got {other!r}"
                )
        # Longest first, so "/v1/messages/count_tokens" finds the Messages dialect.
        self.renderers: list[tuple[str, ErrorRenderer]] = sorted(
            (
                (f"/v1{path}", dialect.render_error)
                for dialect in dialects
                for path in (*dialect.client_paths, *(side.path for side in dialect.side_routes))
            ),
            key=lambda entry: -len(entry[0]),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = origin = fetch_site = content_type = content_length = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
            elif name == b"content-length":
                content_length = value
            elif name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"sec-fetch-site":
                fetch_site = value.decode("latin-1")
            elif name == b"transfer-encoding":
                chunked = True
        error = self._refusal(scope, host, origin, fetch_site, content_type, content_length)
        if error is not None:
            await error_response(error, self._renderer(scope["path"]))(scope, receive, send)
            return
        counted = chunked and content_length is None
        if not counted and declared_length(content_length) == 0:
            await self.app(scope, receive, send)
            return
        async with self.body_budget.hold() as holding:
            try:
                await self.app(scope, self._budgeted(receive, holding, counted), send)
            except ClientDisconnect:
                # The client left, or was cut at its body deadline (408, gateway.http_protocol),
                # before the route read its body: nothing to answer, nothing recorded.
                log.info(
                    "%s %s: the client's body ended before it was read (disconnect or the body "
                    "deadline)",
                    scope["method"],
                    scope["path"][:200],
                )

    def _refusal(
        self,
        scope: Scope,
        host: str | None,
        origin: str | None,
        fetch_site: str | None,
        content_type: str | None,
        content_length: bytes | None,
    ) -> TrajgateError | None:
        """The first check ``scope`` fails, or None."""
        names = self.host_names
        if host is not None and names is not None and host_name(host) not in names:
            return InvalidRequestError(
                f"host {host[:100]!r} is not one of this gateway's names "
                f"({', '.join(sorted(names))}); set TRAJGATE_ALLOWED_HOSTS",
                code="host_not_allowed",
            )
        if scope["method"] not in SAFE_METHODS:
            if fetch_site in ("cross-site", "same-site"):
                return PermissionDeniedError(
                    f"cross-site write refused (Sec-Fetch-Site: {fetch_site})", code="cross_site"
                )
            if origin is not None and urlsplit(origin).netloc != host:
                return PermissionDeniedError(
                    f"cross-site write refused: Origin {origin[:100]!r} is not {host!r}",
                    code="cross_site",
                )
            if content_type is not None and not is_json_media_type(content_type):
                return UnsupportedMediaTypeError(
                    f"request body must be JSON (Content-Type: application/json), "
                    f"got {content_type[:100]!r}"
                )
        path: str = scope["path"]
        if self.admin_token is not None and _is_under(path, ADMIN_PREFIXES):
            try:
                check_admin_token(Request(scope), self.admin_token)
            except AuthenticationError as refused:
                return refused
        declared = declared_length(content_length)
        if declared > self.max_body_bytes:
            return PayloadTooLargeError(
                f"request body of {declared} bytes exceeds the limit of {self.max_body_bytes} bytes"
            )
        return None

    def _budgeted(self, receive: Receive, holding: Holding, counted: bool) -> Receive:
        """``receive`` that grows ``holding`` by each piece of the body before handing it on
        (``gateway.body_budget``) and, for a body sent without a length (``counted``), raises
        ``_BodyTooLarge`` once it passes the limit; raises ``_BodyDeadline`` once the waits for
        the body's pieces sum past ``body_timeout_s`` (when set)."""
        received = 0
        body_timeout_s = self.body_timeout_s
        left_s = body_timeout_s  # None: no deadline kept here, or the body has ended

        async def budgeted() -> Message:
            nonlocal received, left_s
            if left_s is None or body_timeout_s is None:
                message = await receive()
            else:
                started_s = time.monotonic()
                try:
                    async with asyncio.timeout(max(left_s, 0.0)):
                        message = await receive()
                except TimeoutError:
                    raise _BodyDeadline(body_timeout_s) from None
                left_s -= time.monotonic() - started_s
                if message["type"] != "http.request" or not message.get("more_body", False):
                    left_s = None  # later waits are for a disconnect, not for the body
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                received += size
                if counted and received > self.max_body_bytes:
                    raise _BodyTooLarge(self.max_body_bytes)
                await holding.grow(size)
            return message

        return budgeted

    def _renderer(self, path: str) -> ErrorRenderer:
        if path.startswith("/t/"):  # /t/<trajectory_id>/v1/...: the dialect's own envelope
            path = path[path.find("/", 3) :] if path.find("/", 3) > 0 else path
        for prefix, render in self.renderers:
            if path.startswith(prefix):
                return render
        return openai_envelope


def host_name(host: str) -> str:
    """The name in a ``Host`` header, lower-case, without port or final dot:
    ``"LocalHost.:8000"`` → ``"localhost"``, ``"[::1]:8000"`` → ``"::1"``."""
    if host.startswith("["):
        name = host[1 : host.find("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        name = host.split(":", 1)[0]
    else:
        name = host
    return name.rstrip(".").lower()


def is_json_media_type(content_type: str) -> bool:
    """``application/json`` or ``application/<x>+json``, any parameters (``; charset=utf-8``)."""
    media_type = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = media_type.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _is_under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == prefix or path.startswith(prefix + "/") for prefix in prefixes)
