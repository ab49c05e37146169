"""What an exchange with the engine raises besides httpx's own errors, and the deadline of one.

Exception tree (both are httpx's, so the callers that classify httpx errors need no case of
their own)::

    httpx.HTTPError
    ├── httpx.DecodingError
    │   └── UnreadableAnswerError   a 2xx answer that is not what the exchange reads
    └── httpx.TransportError
        └── httpx.TimeoutException
            └── ExchangeTimeoutError  no whole answer within the exchange's overall deadline

``gateway.proxy.attempts`` records an ``httpx.DecodingError`` as ``upstream_error`` (the
replica was reached, its answer is what failed) and a timeout other than a connect timeout as
``upstream_timeout``: both stay so.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from gateway.engine.wire import UNREADABLE, loads_object


class UnreadableAnswerError(httpx.DecodingError):
    """The engine answered, but not what the exchange reads: not UTF-8 JSON, not an object, or
    a field of another shape than vLLM's. The message names the exchange and what was read."""


class ExchangeTimeoutError(httpx.TimeoutException):
    """One exchange (request sent, whole answer read) outlasted its overall deadline: a per-read
    timeout alone lets a peer that trickles a byte a second hold it for ever."""


@asynccontextmanager
async def deadline(seconds: float | None, exchange: str) -> AsyncIterator[None]:
    """Run the block within ``seconds`` in all (None: no deadline of its own, the caller's
    limits bound it). Raises ``ExchangeTimeoutError`` naming ``exchange`` (``"/pause?mode=keep"``)
    past it."""
    if seconds is None:
        yield
        return
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as exc:
        raise ExchangeTimeoutError(f"no whole answer to {exchange} within {seconds} s") from exc


def limit_s(timeout: httpx.Timeout | None) -> float | None:
    """The overall deadline, in seconds, of an exchange sent with ``timeout``: its longest
    limit (the unary limits ``httpx.Timeout(total_s, connect=connect_s)`` give ``total_s``);
    None for None (a stream: the client's per-read limits and the caller's first-byte limit
    bound it)."""
    if timeout is None:
        return None
    limits = [t for t in (timeout.connect, timeout.read, timeout.write, timeout.pool) if t]
    return max(limits) if limits else None


def answer_object(response: httpx.Response, exchange: str) -> dict[str, Any]:
    """A 2xx answer's JSON object. Raises ``UnreadableAnswerError`` for one the gateway cannot
    read (not UTF-8 JSON, not an object)."""
    try:
        return loads_object(response.content)
    except UNREADABLE as exc:
        raise UnreadableAnswerError(f"vLLM's {exchange} answered unreadably: {exc!r}") from exc
