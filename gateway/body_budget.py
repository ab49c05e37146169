"""The budget of request-body bytes one gateway process works on at once.

Owns: ``BodyBudget``, a first-come-first-served semaphore counted in bytes. ``EdgeGuard``
reserves each request's declared ``Content-Length`` (``max_body_bytes`` for a body sent without
one) before the route runs and gives it back when the route's answer is complete, so the bytes
of bodies being parsed, translated, sent upstream and recorded never exceed
``max_body_bytes_in_flight`` together; a request that does not fit waits, unread (its bytes stay
in the kernel and the client's buffers), in arrival order. Requests without a body (``/health``,
``GET``) never wait.

Why: one call holds its body several times over while it is processed (the bytes, the parsed
JSON, the upstream body, the stored request; docs/gateway.md, "Large bodies"), so eight
concurrent 10.7 MiB bodies took the gateway from 397 to 984 MB and held ``/health`` at 0.8-3.3 s
(issue 29 item 6). Never: refuses a request (the size limit, 413, is ``EdgeGuard``'s), or limits
anything across processes: each worker has its own budget.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class BodyBudget:
    """``capacity_bytes`` of request bodies at once; waiters served in arrival order (a large
    body is not starved by a stream of small ones). ``in_use_bytes``: reserved now;
    ``waiting``: requests waiting for room."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.in_use_bytes = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def reserve(self, size_bytes: int) -> AsyncIterator[None]:
        """Hold ``size_bytes`` (at most the capacity) for the block; waits while they do not
        fit or others wait before. Cancelled while waiting: nothing is held."""
        size = min(size_bytes, self.capacity_bytes)
        if not self._waiters and self.in_use_bytes + size <= self.capacity_bytes:
            self.in_use_bytes += size
        else:
            granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (size, granted)
            self._waiters.append(entry)
            try:
                await granted
            except asyncio.CancelledError:
                if granted.done() and not granted.cancelled():
                    self._release(size)  # granted in the same turn as the cancel
                else:
                    self._waiters.remove(entry)
                    self._grant()  # it may have held back smaller ones behind it
                raise
        try:
            yield
        finally:
            self._release(size)

    def _release(self, size: int) -> None:
        self.in_use_bytes -= size
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.in_use_bytes + self._waiters[0][0] <= self.capacity_bytes:
            size, granted = self._waiters.popleft()
            if not granted.cancelled():
                self.in_use_bytes += size
                granted.set_result(None)
