"""Full-weight updates: hold new calls, drain or abort the calls in flight, reload, release.

Owns: the gate every model-serving call passes before its policy version is resolved
(``WeightGate.admit``), the ``Ticket`` an admitted call holds until its upstream stopped
sampling, the pause around a reload (``WeightGate.pause``), and the reload of every replica
(``reload_replicas``: vLLM's ``collective_rpc reload_weights``, then ``reset_prefix_cache``).

Why: vLLM reloads full weights in place, between two engine steps, while requests run. A call
sampling across the reload would get tokens (and behaviour logprobs) from two policies under
one stamped version. So a pause (one at a time):

1. closes the gate: calls arriving from now on wait in ``admit`` (held, never refused);
2. gives the calls already admitted ``drain_timeout_s`` to finish sampling;
3. aborts the ones still sampling (``Ticket.guard`` raises ``CallAborted`` in the call's own
   task; the call records its step as ``aborted_for_weight_update`` and answers 503);
4. runs the reload (and the registration of the new version), then opens the gate: the held
   calls resolve their policy version only now, so they are stamped with the new one.

Every model-serving call is held, not only those naming the reloaded model: an adapter computes
on the base weights being replaced. LoRA hot-loads never pause (each version is its own adapter).

Never: resolves versions or records steps (``gateway.proxy.routes`` and
``gateway.upstream.policy`` do);
retries an aborted call (tokens were generated under the old policy; the client decides).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from datapool.models import StepOutcome
from gateway.errors import ServiceUnavailableError

T = TypeVar("T")
ABORTED_FOR_WEIGHT_UPDATE = StepOutcome.ABORTED_FOR_WEIGHT_UPDATE

# Seconds the aborted calls get to notice the abort and give their tickets back (they do so
# before recording their step, so this is only a guard against a call stuck elsewhere).
ABORT_GRACE_S = 10.0
# Seconds a replica's prefix-cache reset is retried before it is forced (see reload_replicas).
RESET_RETRY_S = 5.0


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
        self._gate = gate
        self._waiting: asyncio.Task[Any] | None = None  # the task inside ``guard``, if any
        self._cut = False  # ``abort`` cancelled ``_waiting``: that cancellation is ours
        self._loop = asyncio.get_running_loop() if gate is not None else None

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
            return await awaitable
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

    ``drained_calls``: in flight at the start and finished within the drain limit;
    ``aborted_calls``: still sampling at the limit; ``held_calls``: arrived during the pause.
    """

    pause_ms: float
    drained_calls: int
    aborted_calls: int
    held_calls: int


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


async def reload_replicas(
    client: httpx.AsyncClient, urls: list[str], weights_location: str, timeout_s: float
) -> None:
    """Reload full weights from ``weights_location`` (a checkpoint directory every replica can
    read) into each replica in place, then reset its prefix cache (KV cached under the old
    weights must never serve the new ones: a prompt prefix computed by v0 would leak into a
    step stamped v1).

    vLLM endpoints (0.32, ``VLLM_SERVER_DEV_MODE=1``): ``POST /collective_rpc {"method":
    "reload_weights", "kwargs": {"weights_path"}}`` and ``POST /reset_prefix_cache``, which
    answers ``{"success": false}`` while a request still holds KV blocks (an aborted call
    whose disconnect vLLM has not processed yet): retried for ``RESET_RETRY_S``, then forced
    with ``reset_running_requests=true`` (what still runs then is no call of this gateway).

    Raises:
        ReloadError: a replica refused or could not be reached, or its prefix cache could not
            be reset; names the replica and the replicas reloaded before it.
    """
    done: list[str] = []
    for url in urls:
        reload = {"method": "reload_weights", "kwargs": {"weights_path": weights_location}}
        await _post(client, url, "/collective_rpc", reload, timeout_s, done)
        deadline = time.monotonic() + RESET_RETRY_S
        while not await _reset_prefix_cache(client, url, timeout_s, done, force=False):
            if time.monotonic() > deadline:
                if not await _reset_prefix_cache(client, url, timeout_s, done, force=True):
                    raise ReloadError(url, done, "its prefix cache could not be reset")
                break
            await asyncio.sleep(0.05)
        done.append(url)


async def _reset_prefix_cache(
    client: httpx.AsyncClient, url: str, timeout_s: float, done: list[str], *, force: bool
) -> bool:
    path = "/reset_prefix_cache?reset_running_requests=true" if force else "/reset_prefix_cache"
    answer = await _post(client, url, path, {}, timeout_s, done)
    try:
        return bool(answer.json().get("success", True))
    except (ValueError, AttributeError):
        return True  # an older vLLM answers 200 without a body: nothing to retry on


async def _post(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: dict[str, Any],
    timeout_s: float,
    done: list[str],
) -> httpx.Response:
    try:
        response = await client.post(f"{url}{path}", json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ReloadError(url, done, repr(exc)) from exc
    if response.status_code >= 400:
        raise ReloadError(url, done, f"{response.status_code}: {response.text[:500]}")
    return response


class ReloadError(RuntimeError):
    """A replica refused the reload; ``reloaded`` lists the replicas that took it before."""

    def __init__(self, url: str, reloaded: list[str], detail: str) -> None:
        super().__init__(
            f"replica {url} refused the weight reload ({detail}); replicas reloaded before it: "
            f"{reloaded or 'none'}"
        )
        self.url = url
        self.reloaded = reloaded
