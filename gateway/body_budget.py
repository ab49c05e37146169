"""The budget of body bytes one gateway process works on at once: request bodies, and the
upstream answers the gateway reads whole.

Owns: ``BodyBudget``, a semaphore counted in bytes, ``Holding``, one request's share of it, and
``hold_answers``/``answer_read``, which charge a call's upstream answer to its request's
holding. ``EdgeGuard`` opens a holding per request with a body and grows it by each piece of
the body the route reads (``Holding.grow`` before the piece is handed on), so a request holds
only bytes that actually arrived, and only once its route asked for them: a route checks the
API key before it reads a byte, so an unauthenticated request holds nothing, and a client that
declares 16 MiB and drips one byte holds one byte. A call that reads its upstream answer whole
(a unary call, an error body; ``hold_answers``) grows the same holding by each piece of the
answer as it is read (``answer_read``, from ``gateway.upstream.answer_limit``), before the piece
is handed on: a piece that does not fit waits there, the rest of the answer unread in the
socket (the transport stops reading past 1 MiB buffered). A streamed answer's pieces are passed
on as they come and are not held. The holding is given back when the route's answer is
complete, so the bytes of bodies being parsed, translated, sent upstream and recorded, and of
answers being parsed, recorded and answered, stay within ``max_body_bytes_in_flight``
together. A body piece that does not fit waits before the route gets it; the rest of that body
waits unread meanwhile (uvicorn stops reading a connection past 64 KiB unread: its bytes stay
in the kernel and the client's buffers). Requests without a body (``/health``, ``GET``) never
wait.

Waiters are served oldest request first (a large body is not starved by a stream of small
ones, and a body already partly read goes before newer requests). Bodies read piece by piece
can deadlock a plain semaphore: several half-read bodies (or answers) fill it and each waits
for room only another can free. So when every byte in use is held by requests that are
themselves waiting, the oldest of them that holds bytes is let past the capacity until its body
(or answer) is read; at most one request is past it at a time, so the bytes held never exceed
``capacity_bytes`` plus one largest call (``max_body_bytes`` + ``upstream_max_answer_bytes``).

Why: one call holds its body several times over while it is processed (the bytes, the parsed
JSON, the upstream body, the stored request; docs/gateway.md, "Large bodies"), about 12 times
its bytes in all, and an answer about 7 times (its bytes, the parsed JSON, the steps recorded,
the client's answer). Without a bound eight concurrent 10.7 MiB bodies took the gateway from 397
to 984 MB and held ``/health`` at 0.8-3.3 s, and four concurrent 200 MB unary answers (each
within ``upstream_max_answer_bytes``) took it from 166 to 2,490 MB. Reserving each declared
``Content-Length`` up front, before the key was checked, let four connections that declared 16
MiB and dripped a byte hold the whole budget until their body deadline: every other POST waited
29 s. Never: refuses a request (the size limit, 413, is ``EdgeGuard``'s; an answer's is
``upstream_max_answer_bytes``), or limits anything across processes: each worker has its own
budget. A call whose answer waits for room waits within its upstream time limit
(``upstream_total_timeout_s``).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass(eq=False)
class Holding:
    """One request's bytes of the budget: ``held_bytes`` granted so far; ``order`` its arrival
    (older first); ``holds_answers``: the upstream answers its call reads grow it too."""

    budget: BodyBudget
    order: int
    held_bytes: int = 0
    holds_answers: bool = False

    async def grow(self, size_bytes: int) -> None:
        """Add ``size_bytes``; waits while they do not fit or older requests wait. Cancelled
        while waiting: nothing is added."""
        await self.budget._grow(self, size_bytes)


@dataclass(order=True)
class _Waiter:
    order: int
    size: int = field(compare=False)
    holding: Holding = field(compare=False)
    granted: asyncio.Future[None] = field(compare=False)


# The holding of the request being served (set by ``BodyBudget.hold`` for its block): the
# upstream answers read in its task (and in tasks it starts) find their call's share here.
_current: ContextVar[Holding | None] = ContextVar("trajgate_body_holding", default=None)


def hold_answers() -> None:
    """From now on, the upstream answer bytes this request reads (``answer_read``) grow its
    holding: call it before reading an answer whole. No-op outside a holding (a request
    without a body)."""
    holding = _current.get()
    if holding is not None:
        holding.holds_answers = True


async def answer_read(size_bytes: int) -> None:
    """``size_bytes`` of an upstream answer were read: grow the current request's holding by
    them if it holds its answers (``hold_answers``); waits while they do not fit (module
    docstring). Called by ``gateway.upstream.answer_limit`` before each piece is handed on."""
    holding = _current.get()
    if holding is not None and holding.holds_answers:
        await holding.grow(size_bytes)


class BodyBudget:
    """``capacity_bytes`` of bodies at once (module docstring). ``in_use_bytes``: held now;
    ``peak_in_use_bytes``: the most held at once since it was made; ``waiting``: requests
    waiting for room now; ``waits``: pieces that waited for room since it was made."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.waits = 0
        self._arrivals = itertools.count()
        self._waiters: list[_Waiter] = []  # oldest request first
        self._waiters_hold_bytes = 0  # bytes held by the requests in ``_waiters``

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[Holding]:
        """A holding of no bytes yet, grown with ``Holding.grow`` (and ``answer_read`` within
        the block); all it holds is given back when the block ends."""
        holding = Holding(self, next(self._arrivals))
        token = _current.set(holding)
        try:
            yield holding
        finally:
            _current.reset(token)
            # A task the request started keeps the holding in its context: what it reads once
            # the request ended must not grow a share nobody gives back.
            holding.holds_answers = False
            self.in_use_bytes -= holding.held_bytes
            holding.held_bytes = 0
            self._grant()

    async def _grow(self, holding: Holding, size: int) -> None:
        if size <= 0:
            return
        if not self._waiters and self.in_use_bytes + size <= self.capacity_bytes:
            self._add(holding, size)
            return
        self.waits += 1
        waiter = _Waiter(holding.order, size, holding, asyncio.get_running_loop().create_future())
        bisect.insort(self._waiters, waiter)
        self._waiters_hold_bytes += holding.held_bytes
        self._grant()
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if not (waiter.granted.done() and not waiter.granted.cancelled()):
                self._leave(waiter)  # not granted: its holding gets nothing
                self._grant()  # it may have held back smaller ones behind it
            raise

    def _add(self, holding: Holding, size: int) -> None:
        holding.held_bytes += size
        self.in_use_bytes += size
        if self.in_use_bytes > self.peak_in_use_bytes:
            self.peak_in_use_bytes = self.in_use_bytes

    def _leave(self, waiter: _Waiter) -> None:
        self._waiters.remove(waiter)
        self._waiters_hold_bytes -= waiter.holding.held_bytes

    def _grant(self) -> None:
        while self._waiters:
            waiter = self._waiters[0]
            if self.in_use_bytes + waiter.size > self.capacity_bytes and self.in_use_bytes > 0:
                if self.in_use_bytes > self._waiters_hold_bytes:
                    return  # a request that is not waiting will give bytes back
                # Every byte in use is held by a waiter: none can be freed until one is let
                # past the capacity. The oldest that holds bytes finishes its body first.
                waiter = next(w for w in self._waiters if w.holding.held_bytes > 0)
            self._leave(waiter)
            if not waiter.granted.cancelled():
                self._add(waiter.holding, waiter.size)
                waiter.granted.set_result(None)
