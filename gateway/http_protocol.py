"""The HTTP/1.1 protocol the gateway serves with: uvicorn's httptools protocol plus read
deadlines for a request's head and body.

Owns: ``ReadDeadlineProtocol`` and ``protocol_factory`` (what ``uvicorn.Config(http=...)``
takes, in ``trajgate serve`` and ``gateway.server.BackgroundServer``). uvicorn bounds only the
idle time between two requests of a connection (``timeout_keep_alive``); a client that drips
its head or its body byte by byte (a head at 1 byte per 2 s was held 300 s, a body at 1 byte/s
45 s) holds a connection, a parser and a buffer for as long as it likes, before any key is
checked. Here:

- the head (request line and headers) must be complete within ``head_timeout_s`` of its first
  byte, or of the connection's opening for its first request: else the connection is answered
  408 ``request_timeout`` (``Connection: close``) and closed; the app never sees the request;
- the body must be complete within ``body_timeout_s`` of the head's end: else the same 408 and
  close; the app's read of the body ends as a disconnect, so nothing is recorded. Time in which
  reading is paused because the app has not yet taken what arrived (uvicorn pauses past 64 KiB
  unread), or in which a client that sent ``Expect: 100-continue`` waits for the app to ask
  for the body, is the gateway's, not the client's: the deadline is put off meanwhile.

Never: bounds the time the app takes to answer (the upstream limits do), or a response's
delivery (a slow reader is a separate concern).

``server_protocol`` picks it, or uvicorn's own ``httptools`` or ``h11`` protocol unchanged
(``http_protocol`` setting: a fallback that rules this subclass out when something breaks).
With uvicorn's own, the body deadline is kept one layer up (``gateway.guard``: the time the
app waits in ``receive`` for the body is counted, then 408 ``request_timeout`` with
``Connection: close``), but the head deadline is not: the app never sees a head that has not
ended, and uvicorn bounds only the idle time between two requests of a connection.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.settings import HTTP_PROTOCOLS, GatewaySettings

_TIMEOUT_BODY = json.dumps(
    {
        "error": {
            "message": "the request's head or body did not arrive in time "
            "(TRAJGATE_REQUEST_HEAD_TIMEOUT_S, TRAJGATE_REQUEST_BODY_TIMEOUT_S)",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_timeout",
        }
    }
).encode()
REQUEST_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    + f"content-length: {len(_TIMEOUT_BODY)}\r\n\r\n".encode()
    + _TIMEOUT_BODY
)


class ReadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's head and on its body
    (module docstring). ``head_timeout_s``, ``body_timeout_s``: seconds."""

    def __init__(self, *args: Any, head_timeout_s: float, body_timeout_s: float, **kw: Any):
        super().__init__(*args, **kw)
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        self._deadline: asyncio.TimerHandle | None = None
        self._reading_body = False  # which deadline is armed: the body's, else the head's

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._deadline_passed)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        waiting_for_app = self.flow.read_paused or (
            # A client that sent "Expect: 100-continue" sends its body once the app reads it.
            self._reading_body and cycle is not None and cycle.waiting_for_100_continue
        )
        if waiting_for_app:  # the app has not taken what came: not the client's delay
            self._arm(self.body_timeout_s)
            return
        if self._reading_body:
            answer = cycle is not None and not cycle.response_started
        else:  # no answer while an earlier pipelined request's response is still going out
            answer = cycle is None or cycle.response_complete
        if answer:
            self.transport.write(REQUEST_TIMEOUT_ANSWER)
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_body = False
        if self._deadline is None:  # a keep-alive connection's next request: its first byte
            self._arm(self.head_timeout_s)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._reading_body = True
        self._arm(self.body_timeout_s)

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the connection is the WebSocket protocol's from here
        super().handle_websocket_upgrade()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()


def protocol_factory(head_timeout_s: float, body_timeout_s: float) -> Any:
    """What ``uvicorn.Config(http=...)`` takes: a picklable callable (worker processes are
    spawned with the config) that makes a ``ReadDeadlineProtocol`` per connection."""
    return functools.partial(
        ReadDeadlineProtocol, head_timeout_s=head_timeout_s, body_timeout_s=body_timeout_s
    )


def server_protocol(settings: GatewaySettings) -> Any:
    """What ``uvicorn.Config(http=...)`` takes for ``settings.http_protocol``: ours with its
    deadlines, or the name of uvicorn's own protocol."""
    match settings.http_protocol:
        case "own":
            head_s, body_s = settings.request_head_timeout_s, settings.request_body_timeout_s
            return protocol_factory(head_s, body_s)
        case "httptools" | "h11":
            return settings.http_protocol
        case other:
            raise ValueError(
                f"http_protocol must be one of {', '.join(HTTP_PROTOCOLS)}, got {other!r}"
            )
