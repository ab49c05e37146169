"""The engine's own control exchanges: freeze and thaw it, reload its weights, drop its prefix
cache, label its weights, and load, list and unload LoRA adapters.

Owns: each exchange, its overall deadline (``post_to_replica``: the request sent and the whole
answer read within ``timeout_s``, ``ExchangeTimeoutError`` past it, so a replica that trickles a
byte a second cannot hold a weight update), the retries vLLM's answers call for (a prefix-cache
reset refused while a request holds KV blocks; a ``/resume`` that failed), and what a failure
says (``ReloadError``: which replicas accepted the reload and whose weights are unknown;
``AdapterRefusedError``: an adapter refused as sent, not a failing replica).

Never: decides when to pause, which version a call is stamped with, or which adapters to keep
(``gateway.upstream.weight_update``, ``gateway.upstream.adapters``, ``gateway.api.admin``,
``gateway.api.lora``).

vLLM endpoints (0.32): full weights in dev mode (``VLLM_SERVER_DEV_MODE=1``): ``POST
/pause?mode=keep``, ``/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}``,
``/reset_prefix_cache[?reset_running_requests=true]``, ``/update_weight_version
{"new_version"}``, ``/resume``; LoRA at runtime (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``,
``--enable-lora``): ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}``,
``POST /v1/unload_lora_adapter {"lora_name"}``; ``GET /v1/models`` lists each loaded adapter
with its ``parent`` (``gateway.engine.models``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.engine.errors import ExchangeTimeoutError, deadline
from gateway.engine.models import listed_ids
from gateway.engine.paths import (
    COLLECTIVE_RPC_PATH,
    LOAD_LORA_ADAPTER_PATH,
    PAUSE_PATH,
    RESET_PREFIX_CACHE_PATH,
    RESUME_PATH,
    UNLOAD_LORA_ADAPTER_PATH,
    UPDATE_WEIGHT_VERSION_PATH,
)

log = logging.getLogger("trajgate.upstreams")

# Seconds a replica's prefix-cache reset is retried before it is forced (see reload_replicas).
RESET_RETRY_S = 5.0
# Tries of a replica's /resume (RESUME_BACKOFF_S apart) before it is left to the health checks,
# which retry it each round (``UpstreamPool.check_health``): a frozen replica stalls its calls.
RESUME_TRIES = 3
RESUME_BACKOFF_S = 0.2
# vLLM 0.32's answers that say the replica cannot load adapters at all: no runtime LoRA route
# (``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` unset: 404 from the framework, not vLLM's "No adapter
# found") or no LoRA in the engine (``--enable-lora`` missing: a 500 carrying this text).
_LORA_OFF = "LoRA is not enabled"
_NO_ADAPTER = "No adapter found"


async def reload_replicas(
    client: httpx.AsyncClient,
    urls: list[str],
    weights_location: str,
    timeout_s: float,
    reload_timeout_s: float,
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
    Each exchange ends within ``timeout_s``, the reload within ``reload_timeout_s``.

    Raises:
        ReloadError: a replica refused or could not be reached, or its prefix cache could not
            be reset; names the replica, those that accepted the reload and those whose
            weights are unknown.
    """
    reloaded: list[str] = []
    for url in urls:
        await _reload_weights(client, url, weights_location, reload_timeout_s, reloaded)
        reset_until = time.monotonic() + RESET_RETRY_S
        while not await _reset_prefix_cache(client, url, timeout_s, reloaded, force=False):
            if time.monotonic() > reset_until:
                if not await _reset_prefix_cache(client, url, timeout_s, reloaded, force=True):
                    raise ReloadError(url, reloaded, "its prefix cache could not be reset")
                break
            await asyncio.sleep(0.05)


async def pause_replicas(client: httpx.AsyncClient, urls: list[str], timeout_s: float) -> None:
    """``POST /pause?mode=keep`` on each replica: vLLM freezes its requests, answering once its
    engine finished the step in flight (vLLM 0.32, dev mode). Raises ``ReloadError``."""
    for url in urls:
        await post_to_replica(client, url, f"{PAUSE_PATH}?mode=keep", {}, timeout_s, [])


async def resume_replicas(
    client: httpx.AsyncClient, urls: list[str], timeout_s: float, tries: int = RESUME_TRIES
) -> list[str]:
    """``POST /resume`` on every replica, each tried ``tries`` times (``RESUME_BACKOFF_S``
    apart) even when another failed (a frozen replica stalls every call on it); returns the
    replicas still not resumed (logged)."""
    paused: list[str] = []
    for url in urls:
        for attempt in range(tries):
            try:
                await post_to_replica(client, url, RESUME_PATH, {}, timeout_s, [])
                break
            except ReloadError as exc:
                if attempt + 1 == tries:
                    log.error("upstream %s did not resume after a weight update: %s", url, exc)
                    paused.append(url)
                else:
                    await asyncio.sleep(RESUME_BACKOFF_S)
    return paused


async def reload_kept_replicas(
    client: httpx.AsyncClient,
    urls: list[str],
    weights_location: str,
    label: str,
    timeout_s: float,
    reload_timeout_s: float,
) -> None:
    """The reload of a ``keep`` update on paused replicas: ``reload_weights`` (within
    ``reload_timeout_s``), the prefix cache reset with the frozen requests preempted
    (recomputed under the new weights on resume), then the engine's weight version label set
    to ``label`` (``reload_label``; each within ``timeout_s``). Raises ``ReloadError``."""
    reloaded: list[str] = []
    for url in urls:
        await _reload_weights(client, url, weights_location, reload_timeout_s, reloaded)
        if not await _reset_prefix_cache(client, url, timeout_s, reloaded, force=True):
            raise ReloadError(url, reloaded, "its prefix cache could not be reset")
        label_body = {"new_version": label}
        await post_to_replica(
            client, url, UPDATE_WEIGHT_VERSION_PATH, label_body, timeout_s, reloaded
        )


async def _reload_weights(
    client: httpx.AsyncClient,
    url: str,
    weights_location: str,
    timeout_s: float,
    reloaded: list[str],
) -> None:
    """``reload_weights`` on ``url``, added to ``reloaded`` once it accepted; raises
    ``ReloadError`` (``partial`` when the reload may have begun: see ``post_to_replica``)."""
    reload = {"method": "reload_weights", "kwargs": {"weights_path": weights_location}}
    await post_to_replica(
        client, url, COLLECTIVE_RPC_PATH, reload, timeout_s, reloaded, reloading=True
    )
    reloaded.append(url)


async def _reset_prefix_cache(
    client: httpx.AsyncClient, url: str, timeout_s: float, reloaded: list[str], *, force: bool
) -> bool:
    path = RESET_PREFIX_CACHE_PATH
    if force:
        path += "?reset_running_requests=true"
    answer = await post_to_replica(client, url, path, {}, timeout_s, reloaded)
    try:
        return bool(answer.json().get("success", True))
    except (ValueError, AttributeError):
        return True  # an older vLLM answers 200 without a body: nothing to retry on


async def post_to_replica(
    client: httpx.AsyncClient,
    url: str,
    path: str,
    body: dict[str, Any],
    timeout_s: float,
    reloaded: list[str],
    *,
    reloading: bool = False,
) -> httpx.Response:
    """POST ``body`` to the replica and read its whole answer within ``timeout_s`` in all
    (``deadline``: a per-read timeout alone lets a peer that trickles a byte a second hold it
    forever); raises ``ReloadError`` naming the replicas that accepted the reload
    (``reloaded``).
    ``reloading``: the request is a reload, so a failure once it was sent (an answer of 5xx,
    a timeout, a cut connection) may have left the replica's weights part loaded
    (``ReloadError.partial``); one never sent (no connection) or refused as a request (4xx: no
    such route, a bad body) changed nothing."""
    try:
        async with deadline(timeout_s, path):
            response = await client.post(f"{url}{path}", json=body, timeout=timeout_s)
    except ExchangeTimeoutError as exc:
        raise ReloadError(url, reloaded, str(exc), partial=reloading) from exc
    except httpx.HTTPError as exc:
        unsent = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
        raise ReloadError(url, reloaded, repr(exc), partial=reloading and not unsent) from exc
    if response.status_code >= 400:
        detail = f"{response.status_code}: {response.text[:500]}"
        raise ReloadError(url, reloaded, detail, partial=reloading and response.status_code >= 500)
    return response


class ReloadError(RuntimeError):
    """A replica failed a step of a weight update.

    ``reloaded``: the replicas that accepted the reload (``reload_weights`` answered 2xx), this
    one included when it failed after that (its prefix cache reset or its label);
    ``partial``: this replica's reload itself failed once sent, so its weights may be part
    loaded; ``weights_unknown``: the replicas that may no longer hold the active version's
    weights (both).
    """

    def __init__(
        self, url: str, reloaded: list[str], detail: str, *, partial: bool = False
    ) -> None:
        message = (
            f"replica {url} failed the weight update ({detail}); replicas that accepted the "
            f"reload: {reloaded or 'none'}"
        )
        if partial:
            message += f"; {url}'s reload failed part way: its weights are unknown"
        super().__init__(message)
        self.url = url
        self.detail = detail
        self.reloaded = list(reloaded)
        self.partial = partial

    @property
    def weights_unknown(self) -> list[str]:
        return [*self.reloaded, self.url] if self.partial else self.reloaded


class AdapterRefusedError(ReloadError):
    """A replica refused the adapter as sent: bad input, not a failing replica.

    ``code``: ``lora_not_enabled`` (the replica runs without runtime LoRA),
    ``lora_adapter_not_found`` (no adapter at the path, as the replica sees its disk) or
    ``lora_adapter_refused`` (any other 4xx, vLLM's message kept: a name already loaded).
    ``reloaded``: the replicas that had loaded it before.
    """

    def __init__(self, url: str, loaded: list[str], detail: str, code: str) -> None:
        super().__init__(url, loaded, detail)
        self.code = code


async def load_adapter(
    client: httpx.AsyncClient,
    urls: list[str],
    name: str,
    path: str,
    timeout_s: float,
    *,
    in_place: bool,
) -> None:
    """Load the adapter at ``path`` (a directory every replica can read) as ``name`` into each
    replica in turn, each load within ``timeout_s`` in all.

    ``in_place``: replace an adapter already loaded under ``name`` (only for a re-send of a
    version registered with this very name and path: same weights); otherwise a name already
    loaded is refused, so no version ever takes over another's name.

    Raises:
        AdapterRefusedError: a replica refused the adapter as sent (4xx, or a replica without
            LoRA); ``reloaded`` names the replicas that loaded it before.
        ReloadError: a replica failed otherwise (5xx, no whole answer in time, unreachable).
    """
    body = {"lora_name": name, "lora_path": path, "load_inplace": in_place}
    loaded: list[str] = []
    for url in urls:
        try:
            await post_to_replica(client, url, LOAD_LORA_ADAPTER_PATH, body, timeout_s, loaded)
        except ReloadError as exc:
            code = _refusal(exc.detail)
            if code is None:
                raise
            raise AdapterRefusedError(url, loaded, exc.detail, code) from exc
        loaded.append(url)


def _refusal(detail: str) -> str | None:
    """The code of a load's failure that is the request's fault (``AdapterRefusedError``), or
    None for a replica that failed. ``detail``: ``post_to_replica``'s, ``"<status>: <body>"``
    for an answer."""
    status, _, text = detail.partition(": ")
    if not status.isdigit():
        return None  # no answer: a timeout or a connection error
    if _LORA_OFF in text:
        return "lora_not_enabled"
    if status == "404":
        return "lora_adapter_not_found" if _NO_ADAPTER in text else "lora_not_enabled"
    return "lora_adapter_refused" if 400 <= int(status) < 500 else None


async def listed_adapters(
    client: httpx.AsyncClient, urls: list[str], timeout_s: float
) -> dict[str, set[str]]:
    """The adapters each replica lists now (``GET /v1/models`` entries with a ``parent``), each
    asked within ``timeout_s``; a replica that does not answer a list is left out."""
    return await listed_ids(client, urls, timeout_s, "adapters")


@dataclass(frozen=True)
class Unloads:
    """What ``unload_adapters`` did on one replica: ``unloaded``, the names it no longer serves
    (unloaded now, or already gone: vLLM's 404), in the order asked; ``failed``, each name it
    may still serve, with why (``post_to_replica``'s detail: ``"<status>: <body>"`` for an
    answer, the error otherwise)."""

    unloaded: list[str]
    failed: dict[str, str]


async def unload_adapters(
    client: httpx.AsyncClient, url: str, names: list[str], timeout_s: float
) -> Unloads:
    """Unload ``names`` from the replica at ``url``, each within ``timeout_s``, every name tried
    whatever the others did. A failure is logged and returned, not raised: whether it fails the
    request is the caller's (a publish serves its version either way and tries again at the next
    update; a release answers 502)."""
    unloads = Unloads([], {})
    for name in names:
        try:
            await post_to_replica(
                client, url, UNLOAD_LORA_ADAPTER_PATH, {"lora_name": name}, timeout_s, []
            )
        except ReloadError as exc:
            if not exc.detail.startswith("404"):
                log.warning("upstream %s did not unload adapter %s: %s", url, name, exc.detail)
                unloads.failed[name] = exc.detail
                continue
        unloads.unloaded.append(name)
    return unloads
