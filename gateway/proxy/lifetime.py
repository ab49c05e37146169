"""One call's lifetime: the one owner of what a call holds of the process's shared counts.

Owns: ``CallLifetime``, taken when a call is attributed and ended exactly once, however the
call ends (answered, refused, failed, cancelled, a client gone before or during its stream).
It holds:

=====================  =====================================================================
trajectory in flight   ``PoolWriter.call_started``/``call_ended``: the writer's count and the
                       crash journal's entry, so the idle timeout never closes a trajectory
                       under a call, and a crash flags the calls it cut
weight gate ticket     ``Ticket`` from ``WeightGate.admit``: a full-weight update waits for
                       (or aborts) the calls still sampling
replica in flight      the open upstream response (``ReplicaResponse``), whose close gives
                       back the replica's in-flight count and makes vLLM abort a request left
                       early
render sent ahead      an exact continuation's render (``RenderAhead``), sent while the call
                       is still prepared (``gateway.proxy.preparation.render_ahead_of``);
                       the attempt loop takes it (``Continuation.take_ahead``) and hands
                       it to ``gateway.engine.exact.send_exact``; ending the
                       lifetime cancels one no attempt took (refused, re-sent elsewhere,
                       failed upstream, cancelled), so none is left running
=====================  =====================================================================

Leaving the ``async with`` block ends the lifetime unless the call's answer is a stream that
outlives the route handler: ``hand_over`` then gives it to the answer (``CallStream``), which
ends it once the stream is done, after the stream's own commit, whether the server sent it
whole, the client left midway, or never read it at all. Earlier releases that are part of a
call's meaning stay where they happen (``Ticket.release`` when sampling ended, so an update
need not wait for a commit; ``ReplicaResponse.aclose`` when the answer is read;
``drop_ahead`` once the call is known to extend no turn, so a template call does not keep a
render it will never read while it samples): all are idempotent, and ending the lifetime
releases what is still held.

Never: decides what a call records or answers (``gateway.proxy.routes`` and
``gateway.proxy.streaming`` do); ends twice (``end`` is idempotent).
"""

from __future__ import annotations

from types import TracebackType

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from datapool.steps.writer import PoolWriter
from gateway.engine.exact import RenderAhead
from gateway.upstream.replicas import ReplicaResponse
from gateway.upstream.weight_update import Ticket


class CallLifetime:
    """What one call holds (module docstring), from ``__aenter__`` until ``end``."""

    def __init__(self, writer: PoolWriter, trajectory_id: str) -> None:
        self._writer = writer
        self._trajectory_id = trajectory_id
        self.ticket = Ticket()  # the gate's ticket once ``admit`` set it
        self.upstream: ReplicaResponse | None = None  # the open upstream response, once any
        self.ahead: RenderAhead | None = None  # the render sent ahead, once any
        self._started = False
        self._handed_over = False

    async def __aenter__(self) -> CallLifetime:
        self._writer.call_started(self._trajectory_id)
        self._started = True
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._handed_over:
            await self.end()

    def hand_over(self, response: StreamingResponse) -> CallStream:
        """``response`` as a ``CallStream`` that ends this lifetime once it is done; leaving
        the ``async with`` block then no longer ends it."""
        self._handed_over = True
        return CallStream(self, response)

    def drop_ahead(self) -> None:
        """Discard the render sent ahead now rather than when the lifetime ends (cancelled if
        still out, its answer let go); nothing when there is none."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.discard()

    async def end(self) -> None:
        """Discard the render sent ahead (cancelled if no attempt took it; a taken one is done),
        close the upstream response if still open, give the ticket back and count the call
        out of its trajectory; shielded from cancellation (a client gone must not leave a
        count held). The second call does nothing."""
        if not self._started:
            return
        self._started = False
        with anyio.CancelScope(shield=True):
            try:
                self.drop_ahead()
                if self.upstream is not None:
                    await self.upstream.aclose()
            finally:
                self.ticket.release()
                self._writer.call_ended(self._trajectory_id)


class CallStream(StreamingResponse):
    """A call's streamed answer that ends the call's lifetime when the server is done with it.

    The stream's generator commits in its own ``finally`` (``gateway.proxy.streaming``). When
    the server stopped reading it early (a client gone while an event was being sent) the
    generator is closed here first, so its commit runs before the lifetime ends; one the server
    never started is closed without running (nothing was read, nothing is recorded) and the
    lifetime's end closes the upstream response.
    """

    def __init__(self, lifetime: CallLifetime, response: StreamingResponse) -> None:
        super().__init__(
            response.body_iterator,
            status_code=response.status_code,
            media_type=response.media_type,
        )
        self.raw_headers = response.raw_headers  # the same headers, content type included
        self._lifetime = lifetime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    close = getattr(self.body_iterator, "aclose", None)
                    if close is not None:
                        await close()
                finally:
                    await self._lifetime.end()
