"""LoRA updates: load a policy version's adapter into every replica, unload the old ones.

Owns: the adapter name of a policy version (``adapter_name``), its load into every replica
(``load_adapter``), telling a refusal of the adapter as sent (bad input: the replica runs
without runtime LoRA, no adapter at the path, a name taken) from a replica that failed
(``AdapterRefusedError`` vs ``ReloadError``), and which adapters to unload once a new one
serves (``stale_adapters``, ``unload_adapters``).

Why no pause (unlike ``gateway.upstream.weight_update``): a LoRA update changes no weight any
call is computing with. The base weights stay; the new version is a new adapter under a name
never used before, and a call chose its adapter when it resolved its policy version (the alias
names one adapter), so a call in flight samples every token on the adapter it started with,
and a call admitted after the switch samples every token on the new one. vLLM 0.32 keys its
prefix cache by adapter name and path, and ``/v1/load_lora_adapter`` with ``load_inplace``
swaps the weights under an existing name while its requests run: reusing a name per version
would let a rollout take its prefix (or its first tokens) from the old policy and the rest from
the new one. Unloading an adapter (``/v1/unload_lora_adapter``) only removes its name from
vLLM's list: requests already running on it keep their adapter (vLLM reloads it from its
directory if it was evicted, so that directory must outlive them).

vLLM endpoints (0.32, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, ``--enable-lora``; checked on the
CPU build): ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}``, ``POST
/v1/unload_lora_adapter {"lora_name"}``; ``GET /v1/models`` lists each loaded adapter with its
``parent`` (the base model).

Never: registers versions (``gateway.api.admin`` does, through ``gateway.upstream.policy``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable

import httpx

from gateway.upstream.replicas import model_entries
from gateway.upstream.weight_update import ReloadError, post_to_replica

log = logging.getLogger("trajgate.upstreams")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
# The adapter name prefix of a LoRA update that names none (``adapter_name``).
DEFAULT_ADAPTER_PREFIX = "policy"
# An adapter name prefix: what vLLM and every client accept in a model name.
ADAPTER_PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,150}$")
# vLLM 0.32's answers that say the replica cannot load adapters at all: no runtime LoRA route
# (``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` unset: 404 from the framework, not vLLM's "No adapter
# found") or no LoRA in the engine (``--enable-lora`` missing: a 500 carrying this text).
_LORA_OFF = "LoRA is not enabled"
_NO_ADAPTER = "No adapter found"


def adapter_name(prefix: str, version: int) -> str:
    """The adapter name of policy ``version``: ``<prefix>-v<version>`` (``policy-v4``)."""
    return f"{prefix}-v{version}"


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
            await post_to_replica(client, url, LOAD_PATH, body, timeout_s, loaded)
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

    async def listed(url: str) -> set[str] | None:
        entries = await model_entries(client, url, timeout_s)
        return None if entries is None else {e["id"] for e in entries if e.get("parent")}

    answers = await asyncio.gather(*map(listed, urls))
    return {url: names for url, names in zip(urls, answers, strict=True) if names is not None}


def stale_adapters(
    listed: set[str], registered: Iterable[tuple[int, str]], kept: int, active: str | None
) -> list[str]:
    """The adapters of ``listed`` to unload: those registered (``(version, model_name)`` pairs
    of the policy registry) past the ``kept`` highest versions among them, never ``active``
    (the one the alias serves, say after a rollback). Adapters this registry never registered
    (another pool's, an operator's) are never unloaded. Highest version first is newest: the
    registry refuses a version registered twice with other weights."""
    ours = sorted(((version, name) for version, name in registered if name in listed), reverse=True)
    return [name for _, name in ours[kept:] if name != active]


async def unload_adapters(
    client: httpx.AsyncClient, url: str, names: list[str], timeout_s: float
) -> list[str]:
    """Unload ``names`` from the replica at ``url``, each within ``timeout_s``; returns those
    unloaded (one already gone, vLLM's 404, counts). A failure is logged, not raised: the
    version is served either way, and the next update tries again."""
    unloaded = []
    for name in names:
        try:
            await post_to_replica(client, url, UNLOAD_PATH, {"lora_name": name}, timeout_s, [])
        except ReloadError as exc:
            if not exc.detail.startswith("404"):
                log.warning("upstream %s did not unload adapter %s: %s", url, name, exc.detail)
                continue
        unloaded.append(name)
    return unloaded
