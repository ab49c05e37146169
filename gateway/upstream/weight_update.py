"""Full-weight updates: hold new calls, keep or drain the calls in flight, reload, release.

Owns: the gate every model-serving call passes before its policy version is resolved
(``WeightGate.admit``), the ``Ticket`` an admitted call holds until its upstream stopped
sampling, the pause around a reload (``WeightGate.pause``, two modes), which policy version
sampled which of a call's tokens (``Ticket.version_spans``), and the engine's label of a kept
reload (``reload_label``). The exchanges with the replicas (``reload_replicas``,
``pause_replicas`` / ``resume_replicas``, ``reload_kept_replicas``) are the engine room's
(``gateway.engine.admin``).

Why: vLLM reloads full weights in place, between two engine steps, while requests run. A call
sampling across the reload gets tokens (and behaviour logprobs) from two policies, so either no
call samples across it (``drain``) or every token knows its version (``keep``). Both close the
gate first: calls arriving from now on wait in ``admit`` (held, never refused), and resolve
their policy version only once it opens, so they are stamped with the new one. Pauses run one
at a time.

``keep`` (the default; vLLM 0.32 dev mode, checked on the CPU build):

1. ``POST /pause?mode=keep`` on every replica: vLLM stops scheduling and freezes the requests
   in its queue; it answers once its engine finished the step in flight and sent its outputs;
2. ``collective_rpc reload_weights``, ``reset_prefix_cache?reset_running_requests=true`` (the
   frozen requests are preempted, so on resume their prompt and tokens so far are recomputed
   under the new weights: no token of the new version attends to KV of the old one; vLLM
   0.32's pause already does so, its ``clear_cache`` defaulting to true even with ``keep``,
   whatever its docstring says, and the forced reset keeps it so where it does not) and
   ``POST /update_weight_version`` (what ``/inference/v1/generate`` reports per token);
3. the split: each streamed call in flight records how many tokens of each choice it has read
   (``Ticket.mark``). Exact, because the engine samples nothing between 1 and 4 and the
   gateway reads every chunk sent before: a stream counts once its read has waited
   ``QUIET_S`` with nothing arriving (its socket empty while the engine is frozen); one that
   does not within ``SETTLE_S`` (a client too slow to take its chunks), and every unary call
   in flight (its answer comes whole, the split cannot be known), is marked unknown: its step
   is flagged ``policy_version_split_unknown`` and kept out of training (invariant 9), unless
   the engine reports the split itself (below);
4. ``POST /resume`` on every replica (whatever failed before), each tried ``RESUME_TRIES``
   times; then the gate opens. A replica still paused is marked so (``UpstreamPool.paused``):
   unhealthy, routed no call, its ``/resume`` retried at each health check until it succeeds.

Every exchange with a replica (pause, reload, reset, label, resume) has one overall deadline,
not only a per-read timeout, so a replica that trickles a byte a second cannot hold the
gate closed: the pause is bounded by the sum of those deadlines.

An update that fails part way (a replica refused its pause, reload, cache reset or label, or
the version could not be registered) marks every call in flight unknown whatever the engine's
spans say (``Ticket.update_failed``: the engine's label may be the old one over new weights),
and the replicas that accepted the reload, or whose reload failed once sent
(``ReloadError.weights_unknown``), are refused calls until a publish succeeds
(``UpstreamPool.replacing_weights``): they may hold weights of no registered version.

Where the engine reports which weight version sampled each token (``weight_versions`` of
vLLM's ``/inference/v1/generate``, which a unary exact continuation uses), its spans
are read instead of the gateway's counts (``Ticket.engine_spans`` says how its labels map to
policy versions): a unary exact call across a kept reload is then exact too. A report of
several versions for a call no reload of this gateway split is flagged unknown as well.

Nothing is aborted and nothing waits longer than the reload. ``drain`` (the former behaviour):
the calls admitted get ``drain_timeout_s`` to finish sampling, those still sampling are aborted
(``Ticket.guard`` raises ``CallAborted`` in the call's own task; the call records its step as
``aborted_for_weight_update`` and answers 503), then the reload runs.

Every model-serving call is held, not only those naming the reloaded model: an adapter computes
on the base weights being replaced. LoRA hot-loads never pause (each version is its own adapter).

Never: resolves versions or records steps (``gateway.proxy.routes`` and
``gateway.upstream.policy`` do);
retries an aborted call (tokens were generated under the old policy; the client decides).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from datapool.models import StepOutcome
from gateway.errors import ServiceUnavailableError
from gateway.settings import UpdateMode

T = TypeVar("T")
log = logging.getLogger("trajgate.upstreams")
ABORTED_FOR_WEIGHT_UPDATE = StepOutcome.ABORTED_FOR_WEIGHT_UPDATE

# Seconds the aborted calls get to notice the abort and give their tickets back (they do so
# before recording their step, so this is only a guard against a call stuck elsewhere).
ABORT_GRACE_S = 10.0
# ``keep``: a stream's read must have waited this long with nothing arriving to count its
# tokens, and the split waits at most SETTLE_S in all for the streams to get there.
QUIET_S = 0.05
SETTLE_S = 2.0
POLICY_VERSION_SPLIT_UNKNOWN = "policy_version_split_unknown"

# A choice's tokens read so far, by choice index (``Ticket.sampled``).
Counts = dict[int, int]


class CallAborted(Exception):
    """The gate cut this call's upstream wait: a full-weight reload is about to start."""


def aborted_error() -> ServiceUnavailableError:
    """What an aborted call answers (503, code ``aborted_for_weight_update``, Retry-After)."""
    return ServiceUnavailableError(
        "the call was still sampling when a full-weight update began and outlasted the drain "
        "limit (TRAJGATE_WEIGHT_UPDATE_DRAIN_TIMEOUT_S); it was aborted so that no step mixes "
        "two policies, and its step is kept out of training. Retry it: it runs on the new "
        "weights.",
        code=ABORTED_FOR_WEIGHT_UPDATE,
        headers={"Retry-After": "1"},
    )


class Ticket:
    """One admitted call, from the gate until its upstream stopped sampling.

    ``held_ms``: how long ``admit`` held the call (None when it passed an open gate).
    ``release`` is idempotent; ``release_threadsafe`` may be called from any thread (a
    finalizer). A ticket made without a gate (``Ticket()``) is never aborted.
    """

    def __init__(self, gate: WeightGate | None = None, held_ms: float | None = None) -> None:
        self.held_ms = held_ms
        self.aborted = False
        # Streams: the tokens of each choice read so far (set by the stream's relay; before it
        # starts, none were). None: a unary call, whose tokens arrive at once at the end.
        self.sampled: Callable[[], Counts] | None = None
        # Each kept reload this call sampled across: (the new version, its counts at the
        # split, None when unknown, the engine's label of the new weights).
        self.marks: list[tuple[int, Counts | None, str | None]] = []
        # A kept update failed while this call sampled: some replica may hold weights of no
        # registered version, and its engine's labels may be stale (``version_spans``).
        self.update_failed = False
        self._gate = gate
        self._waiting: asyncio.Task[Any] | None = None  # the task inside ``guard``, if any
        self._cut = False  # ``abort`` cancelled ``_waiting``: that cancellation is ours
        self._last_read_at = time.monotonic()  # when a read inside ``guard`` last returned
        self._loop = asyncio.get_running_loop() if gate is not None else None

    def streams(self) -> None:
        """This call is a stream: its tokens are counted as they are read (none yet)."""
        if self.sampled is None:
            self.sampled = dict

    def quiet(self, now: float) -> bool:
        """Waiting on its upstream with nothing read for ``QUIET_S`` (see the module doc)."""
        return self._waiting is not None and now - self._last_read_at >= QUIET_S

    def mark(self, version: int, known: bool, label: str | None = None) -> None:
        """Record the split of a kept reload to ``version`` (``known``: the counts are exact;
        ``label``: the engine's weight version label it set, ``reload_label``)."""
        counts = self.sampled() if known and self.sampled is not None else None
        self.marks.append((version, counts, label))

    def version_spans(
        self,
        policy_version: int,
        choice_index: int,
        tokens: int,
        reported: list[Any] | None = None,
    ) -> list[list[int]] | None:
        """``[[version, start, end], ...]`` of a choice's ``tokens`` response tokens (empty
        spans left out), starting with ``policy_version``; None when the call sampled under
        one version, its own.

        ``reported``: the engine's ``weight_versions`` of the choice where it reports them
        (vLLM's ``/inference/v1/generate``: ``[{"version", "start", "end"}, ...]`` over the
        output tokens, on the final chunk), used when ``engine_spans`` can read them as policy
        versions; otherwise the gateway's own counts at each kept reload.

        Raises ``LookupError`` when the split is not known: a kept update failed while the call
        sampled (``update_failed``: whatever the engine reports, for its label was not set or
        not set everywhere), a reload split a call whose tokens were not counted (a unary call)
        and the engine did not report it, or the engine reports tokens of several weight
        versions while this gateway reloaded none during the call.
        """
        if self.update_failed:
            raise LookupError("a full-weight update failed while the call sampled")
        spans = None if reported is None else self.engine_spans(policy_version, reported, tokens)
        if spans is None:
            if not self.marks:
                if reported is not None and len(reported) > 1:
                    raise LookupError("the engine changed weights this gateway did not reload")
                return None
            spans = self._counted_spans(policy_version, choice_index, tokens)
        return None if len(spans) == 1 and spans[0][0] == policy_version else spans

    def engine_spans(
        self, policy_version: int, reported: list[Any], tokens: int
    ) -> list[list[int]] | None:
        """The engine's spans as ``[[version, start, end], ...]``, or None when they are not
        readable as this call's policy versions.

        vLLM 0.32 labels each engine step's output with its weight version, a string: "default"
        until ``POST /update_weight_version`` sets one, which a ``keep`` reload does while the
        engine is paused, with a label no earlier reload used (``reload_label``: a stale label
        equal to the new one would hide the split). So a span whose label is that of a reload
        during the call (``marks``, in order) is that reload's version, and a first span
        labelled otherwise was sampled before the first of them, by the weights the call was
        admitted under (``policy_version``: every reload passes the gate). Readable means:
        dicts with int ``start``/``end``, contiguous from 0 to ``tokens``, each later span
        labelled by a later reload of this call.
        """
        if not reported:
            return None
        reloads = [(version, label) for version, _, label in self.marks]
        spans: list[list[int]] = []
        after = 0  # later spans must name reloads from this index on
        for span in reported:
            if not isinstance(span, dict):
                return None
            label, start, end = span.get("version"), span.get("start"), span.get("end")
            if type(start) is not int or type(end) is not int:
                return None
            if start != (spans[-1][2] if spans else 0) or end <= start:
                return None
            named = [k for k in range(after, len(reloads)) if reloads[k][1] == label]
            if named:
                version, after = reloads[named[0]][0], named[0] + 1
            elif not spans:
                version = policy_version
            else:
                return None
            spans.append([version, start, end])
        return spans if spans[-1][2] == tokens else None

    def _counted_spans(
        self, policy_version: int, choice_index: int, tokens: int
    ) -> list[list[int]]:
        """The spans from the gateway's counts at each kept reload (``mark``); raises
        ``LookupError`` when a count is unknown."""
        spans: list[list[int]] = []
        version, start = policy_version, 0
        for new_version, counts, _ in self.marks:
            if counts is None:
                raise LookupError("the tokens sampled before a kept reload are not known")
            end = min(counts.get(choice_index, 0), tokens)
            if end > start:
                spans.append([version, start, end])
            version, start = new_version, max(start, end)
        if tokens > start or not spans:
            spans.append([version, start, tokens])
        return spans

    async def guard(self, awaitable: Coroutine[Any, Any, T]) -> T:
        """Await ``awaitable`` unless the gate aborts this call first or meanwhile.

        Called once per upstream read of a stream, so it costs no cancel scope: ``abort``
        cancels the waiting task itself, and only that cancellation becomes ``CallAborted``
        (one from elsewhere, a client gone, propagates as it came).

        Raises:
            CallAborted: aborted before or while awaiting (the awaitable was cancelled, which
                closes an open upstream connection: vLLM then aborts the request).
        """
        if self.aborted:
            awaitable.close()
            raise CallAborted
        if self._gate is None:  # released (sampling ended) or never admitted: never aborted
            return await awaitable
        task = asyncio.current_task()
        self._waiting = task
        try:
            result = await awaitable
            self._last_read_at = time.monotonic()
            return result
        except asyncio.CancelledError:
            if not self._cut or task is None:
                raise
            self._cut = False
            if task.uncancel() > 0:  # cancelled from elsewhere as well: that one wins
                raise
            raise CallAborted from None
        finally:
            self._waiting = None

    def abort(self) -> None:
        """Mark the call aborted and cut the upstream wait it is in, if any."""
        self.aborted = True
        if self._waiting is not None and not self._cut:
            self._cut = True
            self._waiting.cancel()

    def release(self) -> None:
        if self._gate is not None:
            self._gate._release(self)
            self._gate = None

    def release_threadsafe(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.release)


@dataclass(frozen=True)
class PauseReport:
    """What one pause did: its length (ms, gate closed to gate open) and the calls it touched.

    ``drained_calls``: in flight at the start and finished within the drain limit (``drain``);
    ``aborted_calls``: still sampling at the limit; ``held_calls``: arrived during the pause;
    ``kept_calls``: in flight across a ``keep`` reload, ``split_unknown_calls`` of which could
    not tell which tokens came before it (kept out of training).
    """

    pause_ms: float
    drained_calls: int
    aborted_calls: int
    held_calls: int
    mode: UpdateMode = "drain"
    kept_calls: int = 0
    split_unknown_calls: int = 0


class WeightGate:
    """The gate of one gateway process (see the module docstring for the protocol)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._tickets: set[Ticket] = set()
        self._left = asyncio.Event()
        self._lock = asyncio.Lock()
        self._held = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def admit(self) -> Ticket:
        """Wait while a pause is on, then admit the call (resolve its version after this)."""
        if self._open.is_set():
            ticket = Ticket(self)
        else:
            started = time.perf_counter()
            self._held += 1
            while not self._open.is_set():
                await self._open.wait()
            ticket = Ticket(self, (time.perf_counter() - started) * 1000.0)
        self._tickets.add(ticket)
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)
        self._left.set()

    async def _wait_until_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._tickets:
            self._left.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._left.wait(), remaining)
            except TimeoutError:
                return not self._tickets
        return True

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Run the body between pauses, the gate left open: a LoRA update
        (``gateway.upstream.adapters``) must not load an adapter into replicas a full-weight
        update has paused or is reloading, nor unload adapters while another update picks
        them. Calls pass as usual."""
        async with self._lock:
            yield

    async def pause(
        self, during: Callable[[], Awaitable[T]], drain_timeout_s: float
    ) -> tuple[T, PauseReport]:
        """Close the gate, drain (abort past ``drain_timeout_s``), run ``during``, reopen.

        The gate reopens however ``during`` ends (its error propagates). Pauses run one at a
        time: a second waits for the first to end.
        """
        async with self._lock:
            self._open.clear()
            self._held = 0
            started = time.perf_counter()
            in_flight = len(self._tickets)
            aborted = 0
            try:
                if not await self._wait_until_empty(drain_timeout_s):
                    for ticket in list(self._tickets):
                        ticket.abort()
                        aborted += 1
                    await self._wait_until_empty(ABORT_GRACE_S)
                result = await during()
            finally:
                pause_ms = (time.perf_counter() - started) * 1000.0
                held = self._held
                self._open.set()
        return result, PauseReport(pause_ms, in_flight - aborted, aborted, held)

    async def keep(
        self,
        reload: Callable[[], Awaitable[T]],
        resume: Callable[[], Awaitable[None]],
        version: int,
        label: str | None = None,
    ) -> tuple[T, PauseReport]:
        """Close the gate, run ``reload`` (pause the replicas keeping their requests, reload,
        label the engine's weights ``label``, register ``version``), mark the split on every
        call in flight, run ``resume``, reopen.

        ``resume`` runs however ``reload`` ends; when ``reload`` fails the calls in flight are
        marked unknown whatever the engine reports (``Ticket.update_failed``: some replicas may
        hold weights of no registered version, under a label that was not changed) and its
        error propagates. One pause at a time, as ``pause``.
        """
        async with self._lock:
            self._open.clear()
            self._held = 0
            started = time.perf_counter()
            in_flight = list(self._tickets)
            known = False
            try:
                result = await reload()
                known = True
            finally:
                try:
                    unknown = await self._split(in_flight, version, label, known)
                    await resume()
                finally:
                    pause_ms = (time.perf_counter() - started) * 1000.0
                    held = self._held
                    self._open.set()
        report = PauseReport(pause_ms, 0, 0, held, "keep", len(in_flight), unknown)
        return result, report

    async def _split(
        self, tickets: list[Ticket], version: int, label: str | None, known: bool
    ) -> int:
        """Mark ``version``'s split on the ``tickets`` still sampling; returns how many were
        marked unknown. Waits up to ``SETTLE_S`` for streams to be ``quiet``."""
        deadline = time.monotonic() + SETTLE_S
        waiting = [t for t in tickets if t in self._tickets]
        unknown = 0
        while waiting:
            now = time.monotonic()
            late = now >= deadline or not known
            pending = []
            for ticket in waiting:
                if ticket not in self._tickets:  # sampling ended meanwhile: one version
                    continue
                if ticket.sampled is None or late:
                    ticket.mark(version, False, label)
                    ticket.update_failed = ticket.update_failed or not known
                    unknown += 1
                elif ticket.quiet(now):
                    ticket.mark(version, True, label)
                else:
                    pending.append(ticket)
            waiting = pending
            if waiting:
                await asyncio.sleep(QUIET_S / 5)
        return unknown


def reload_label(version: int) -> str:
    """The engine's weight version label of a kept reload to ``version``: the version and a
    random suffix (``"4:9f2c61d0a4b7"``), so that no label set before, by this gateway or
    another, or before a restart, equals it (``Ticket.engine_spans``)."""
    return f"{version}:{secrets.token_hex(6)}"
