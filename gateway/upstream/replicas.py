"""The vLLM replicas behind the gateway: choosing one per call, and knowing which are alive.

Owns: least-outstanding-requests balancing with stickiness by trajectory (so a trajectory's
growing prompt keeps hitting the replica whose prefix cache holds it), health checks that take a
dead replica out and bring it back, and per-replica in-flight counts. Never: retries by itself;
the proxy decides when a retry is safe (only before any byte reached the client).
``InFlight`` is the one place the in-flight count goes up and down. ``UpstreamPool.gate``
is the replicas' weight gate: calls wait there while their weights are replaced in place
(``gateway.upstream.weight_update``). A replica that took part in a full-weight update that
failed (``UpstreamPool.replacing_weights``) may hold weights of no registered version: no call
is routed to it until a publish succeeds (``weights_unknown_error``, 503), so no step is stamped
with a version its replica no longer holds. A replica whose ``/resume`` after a full-weight
update failed (``UpstreamPool.mark_paused``) is unhealthy and routed no call until a resume,
retried at each health check, succeeds.

Every exchange of the health checks has one overall deadline (a replica trickling a byte a
second cannot stall the round), and the exact-continuation probe runs outside the round, in
its own task (``UpstreamPool.learn_exact``): a call waits for an unknown probe at most
``EXACT_PROBE_WAIT_S``, then uses the template.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx

from gateway.engine.admin import ReloadError, resume_replicas
from gateway.engine.probe import healthy, probe_exact_endpoints, probe_token_ids
from gateway.errors import ServiceUnavailableError
from gateway.upstream.weight_update import WeightGate

log = logging.getLogger("trajgate.upstreams")

# Seconds a call that extends a turn waits for its replica's first exact-continuation probe
# (``UpstreamPool.learn_exact``) before it is rendered by the template instead.
EXACT_PROBE_WAIT_S = 5.0
# A whole probe's deadline, in the health checks' timeouts (it makes up to 6 exchanges).
EXACT_PROBE_DEADLINE_TIMEOUTS = 3


@dataclass
class Replica:
    """One vLLM server: base URL (without /v1), health, requests in flight, learnt fingerprint."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    consecutive_failures: int = 0
    system_fingerprint: str | None = None
    # Whether the replica returns token ids when asked (probed once it is healthy): None until
    # known. A replica that answers without them is never routed to (case C06).
    returns_token_ids: bool | None = None
    # Whether it serves the endpoints exact continuation needs (gateway.engine.exact; probed
    # once it is healthy): None until known. False: its calls use the template.
    serves_exact: bool | None = None
    end_token: int | None = None  # the template's end-of-turn token (``probe_exact``)
    # Whether its chat endpoint samples from forwarded prompt ids (``probe_exact``): exact
    # streams need it; without it they use the template.
    forwards_prompt_ids: bool = False
    # Whether its template leaves the tools out under ``tool_choice: "none"`` (vLLM's
    # --exclude-tools-when-tool-choice-none; ``probe_exact``): None until known.
    excludes_tools_for_none: bool | None = None
    # Why its weights may be no registered version's (a full-weight update that failed after
    # it accepted the reload, or during it: ``UpstreamPool.replacing_weights``); None when it
    # holds the active version's. Never routed to while set.
    weights_unknown: str | None = None
    # Its /resume after a full-weight update failed: unhealthy and routed no call until a
    # resume, retried at each health check, succeeds (``UpstreamPool.mark_paused``).
    paused: bool = False
    # The exact-continuation probe running now, if any: one at a time (``learn_exact``).
    exact_probe: asyncio.Task[None] | None = field(default=None, repr=False, compare=False)
    # Parsed once per path: httpx parses a URL string on every request (its host as an IP
    # address included), a measurable share of a call's CPU.
    _endpoints: dict[str, httpx.URL] = field(default_factory=dict, repr=False)

    def endpoint(self, path: str) -> httpx.URL:
        """The replica's URL of ``path`` (``/v1/chat/completions``)."""
        url = self._endpoints.get(path)
        if url is None:
            url = self._endpoints[path] = httpx.URL(self.url + path)
        return url


class InFlight:
    """One request counted in ``replica.in_flight``, from creation until ``release``.

    ``release`` gives the count back once (later calls do nothing), so every path that ends the
    request may call it. As a context manager it gives the count back on leaving the block,
    however the block ends, unless ``keep`` handed it on to the holder of the open response
    (``ReplicaResponse``, whose ``aclose`` releases it). This class is the only writer of
    ``Replica.in_flight``.
    """

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._held = True
        self._kept = False
        replica.in_flight += 1

    def keep(self) -> InFlight:
        """Hand the count on: leaving the ``with`` block no longer releases it."""
        self._kept = True
        return self

    def release(self) -> None:
        if self._held:
            self._held = False
            self.replica.in_flight -= 1

    def __enter__(self) -> InFlight:
        return self

    def __exit__(self, *_: object) -> None:
        if not self._kept:
            self.release()


@dataclass
class ReplicaResponse:
    """An open upstream response and the in-flight count it holds on its replica."""

    replica: Replica
    response: httpx.Response
    in_flight: InFlight

    async def aclose(self) -> None:
        """Close the response (for a stream, vLLM then aborts the request) and release the
        count, even when closing fails; closing twice does nothing more."""
        try:
            await self.response.aclose()
        finally:
            self.in_flight.release()


class NoHealthyUpstreamError(RuntimeError):
    """Every replica is marked unhealthy (or excluded after failing this call)."""


def weights_unknown_error(why: str) -> ServiceUnavailableError:
    """503 ``replica_weights_unknown``: every replica that could serve the call took part in a
    full-weight update that failed (``why``), so its weights may be of no registered version."""
    return ServiceUnavailableError(
        "no replica can serve this call with weights of a known policy version: a "
        f"full-weight update failed ({why}). A replica that took part in it may hold the "
        "new weights under the old version, so calls to it are refused until a publish "
        "succeeds: publish again (POST /admin/weight-updates; mode 'drain' where the "
        "replicas lack /update_weight_version).",
        code="replica_weights_unknown",
    )


class UpstreamPool:
    """Picks a replica per call.

    Stickiness: each trajectory prefers the replica with the highest rendezvous hash of
    ``(trajectory_id, url)`` among healthy ones, unless that replica has more than
    ``sticky_slack`` requests in flight beyond the least loaded one; then least-outstanding wins.
    Rendezvous hashing keeps most trajectories on their replica when one is added or removed.
    """

    def __init__(self, urls: list[str], *, sticky_slack: int = 4, failures_to_eject: int = 2):
        if not urls:
            raise ValueError("at least one upstream URL is required")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self.sticky_slack = sticky_slack
        self.failures_to_eject = failures_to_eject
        self.gate = WeightGate()

    def tool_choice_none_renders(self) -> bool:
        """Whether ``tool_choice: "none"`` may change a call's rendering: unless every replica
        was probed rendering the tools under it (as ``trajgate vllm start`` runs vLLM), a call
        may reach one that leaves them out (``Replica.excludes_tools_for_none``)."""
        return any(r.excludes_tools_for_none is not False for r in self.replicas)

    def pick(self, trajectory_id: str, exclude: frozenset[str] = frozenset()) -> Replica:
        """The replica for this call, never one whose weights are unknown.

        Raises:
            NoHealthyUpstreamError: none is usable (none captures, or every one is excluded).
            ServiceUnavailableError: every replica that captures has unknown weights (503
                ``replica_weights_unknown``, ``weights_unknown_error``).
        """
        capturing = [r for r in self.replicas if r.returns_token_ids is not False]
        if not capturing:
            raise NoHealthyUpstreamError(
                f"no upstream returns token ids (probed {[r.url for r in self.replicas]}); "
                "trajgate needs vLLM >= 0.10.2, which honours return_token_ids"
            )
        serving = [r for r in capturing if r.weights_unknown is None and not r.paused]
        if not serving:
            unknown = [r.weights_unknown for r in capturing if r.weights_unknown is not None]
            if unknown:
                raise weights_unknown_error(unknown[0])
            raise NoHealthyUpstreamError(
                f"every replica is paused ({[r.url for r in capturing]}): its /resume after a "
                "full-weight update failed; it is retried at each health check"
            )
        capturing = serving
        candidates = [r for r in capturing if r.healthy and r.url not in exclude]
        if not candidates:
            # All marked down: try the ones not excluded anyway rather than refusing outright.
            candidates = [r for r in capturing if r.url not in exclude]
        if not candidates:
            raise NoHealthyUpstreamError(
                f"no usable upstream among {[r.url for r in self.replicas]}"
            )
        sticky = max(candidates, key=lambda r: _rendezvous(trajectory_id, r.url))
        least = min(candidates, key=lambda r: r.in_flight)
        if sticky.in_flight - least.in_flight > self.sticky_slack:
            return least
        return sticky

    @contextmanager
    def replacing_weights(self, version: int) -> Iterator[None]:
        """Around a full-weight update's reload of every replica and the registration of
        ``version``: ending normally, every replica holds the active version (its weights are
        known again); ending with a ``ReloadError``, the replicas it names as reloaded or part
        loaded are marked ``weights_unknown`` (those that refused before their reload keep
        serving); ending otherwise (the registration failed, the publish was cancelled), every
        replica is. The error propagates."""
        try:
            yield
        except ReloadError as exc:
            self._weights_unknown(exc.weights_unknown, f"publishing version {version}: {exc}")
            raise
        except BaseException as exc:
            urls = [replica.url for replica in self.replicas]
            self._weights_unknown(urls, f"publishing version {version}: {exc!r}")
            raise
        for replica in self.replicas:
            replica.weights_unknown = None

    def mark_paused(self, urls: list[str]) -> None:
        """The replicas at ``urls`` stayed paused after a weight update (their ``/resume``
        failed): unhealthy and routed no call until ``check_health`` resumes them."""
        for replica in self.replicas:
            if replica.url in urls:
                replica.paused = True
                replica.healthy = False

    def _weights_unknown(self, urls: list[str], why: str) -> None:
        for replica in self.replicas:
            if replica.url in urls:
                replica.weights_unknown = why
                log.error(
                    "upstream %s: weights unknown, no call is routed to it (%s)", replica.url, why
                )

    def mark_failure(self, replica: Replica) -> None:
        replica.consecutive_failures += 1
        if replica.consecutive_failures >= self.failures_to_eject and replica.healthy:
            replica.healthy = False
            log.warning("upstream %s marked unhealthy", replica.url)

    def mark_success(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        if not replica.healthy and not replica.paused:
            replica.healthy = True
            log.warning("upstream %s healthy again", replica.url)

    async def check_health(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        """One round of ``GET /health`` on every replica (each exchange within ``timeout_s``
        in all); updates ``healthy``, resumes a paused replica first (``mark_paused``) and
        starts the exact-continuation probe of a healthy one that has none yet."""

        async def probe(replica: Replica) -> None:
            if replica.paused:
                if await resume_replicas(client, [replica.url], timeout_s, tries=1):
                    return  # still paused: unhealthy, tried again next round
                replica.paused = False
                log.warning("upstream %s resumed", replica.url)
            if await healthy(client, replica.url, timeout_s):
                self.mark_success(replica)
                if replica.returns_token_ids is None:
                    try:
                        async with asyncio.timeout(2 * timeout_s):  # two exchanges
                            returns = await probe_token_ids(client, replica.url, timeout_s)
                        replica.returns_token_ids = returns
                    except TimeoutError:
                        pass  # unknown: asked again next round
                self.start_exact_probe(client, replica, timeout_s)
            else:
                replica.consecutive_failures = max(
                    replica.consecutive_failures + 1, self.failures_to_eject
                )
                if replica.healthy:
                    replica.healthy = False
                    log.warning("upstream %s failed its health check", replica.url)

        await asyncio.gather(*(probe(replica) for replica in self.replicas))

    def start_exact_probe(
        self, client: httpx.AsyncClient, replica: Replica, timeout_s: float
    ) -> asyncio.Task[None] | None:
        """Start ``replica``'s exact-continuation probe (``probe_exact``, within
        ``EXACT_PROBE_DEADLINE_TIMEOUTS`` x ``timeout_s`` in all; unknown past it, probed again
        at the next health check) unless one runs or the answer is known; returns the running
        probe, None when known."""
        if replica.serves_exact is not None:
            return None
        if replica.exact_probe is None or replica.exact_probe.done():
            replica.exact_probe = asyncio.create_task(self._probe_exact(client, replica, timeout_s))
        return replica.exact_probe

    async def _probe_exact(
        self, client: httpx.AsyncClient, replica: Replica, timeout_s: float
    ) -> None:
        try:
            async with asyncio.timeout(EXACT_PROBE_DEADLINE_TIMEOUTS * timeout_s):
                serves = await probe_exact(client, replica, timeout_s)
        except TimeoutError:
            log.warning(
                "upstream %s: its exact-continuation probe did not end in time", replica.url
            )
            serves = None
        if replica.serves_exact is None:
            replica.serves_exact = serves

    async def learn_exact(
        self, client: httpx.AsyncClient, replica: Replica, timeout_s: float
    ) -> None:
        """Whether ``replica`` serves exact continuation (``probe_exact``), unless known. Called
        by a call on an exact channel that extends a turn and reached a replica before its
        first probe ended: it waits for the probe (started if none runs) rather than being
        rendered by the template for having come first, but at most ``EXACT_PROBE_WAIT_S``
        (or ``timeout_s`` if shorter); the probe goes on without it."""
        probe = self.start_exact_probe(client, replica, timeout_s)
        if probe is not None:
            await asyncio.wait({probe}, timeout=min(timeout_s, EXACT_PROBE_WAIT_S))

    async def health_loop(
        self, client: httpx.AsyncClient, interval_s: float, timeout_s: float
    ) -> None:
        """Probe every ``interval_s`` seconds until cancelled."""
        while True:
            await self.check_health(client, timeout_s)
            await asyncio.sleep(interval_s)


def _rendezvous(key: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest(), "big")


async def probe_exact(client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> bool | None:
    """Whether ``replica`` serves exact continuation (``gateway.engine.probe``'s
    ``probe_exact_endpoints``, each exchange within ``timeout_s``), keeping what the probe found
    on it (``end_token``, ``forwards_prompt_ids``, ``excludes_tools_for_none``) when its routes
    exist. None when the probe could not run (unknown: tried again at the next health check)."""
    found = await probe_exact_endpoints(client, replica.url, timeout_s)
    if found is None or not found.routes:
        return None if found is None else False
    replica.forwards_prompt_ids = found.forwards_prompt_ids
    replica.excludes_tools_for_none = found.excludes_tools_for_none
    replica.end_token = found.end_token
    return found.serves_exact
