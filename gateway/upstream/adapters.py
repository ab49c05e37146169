"""LoRA updates: a new adapter per policy version, and which old ones to unload.

Owns: the adapter name of a policy version (``adapter_name``) and which adapters to unload once
a new one serves (``stale_adapters``). The exchanges themselves (the load into every replica,
telling a refusal of the adapter as sent from a replica that failed, the listing and the
unloads) are the engine room's (``gateway.engine.admin``: ``load_adapter``,
``AdapterRefusedError``, ``listed_adapters``, ``unload_adapters``).

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

vLLM endpoints: ``gateway.engine.admin`` (checked on the CPU build).

Never: registers versions (``gateway.api.admin`` does, through ``gateway.upstream.policy``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# The adapter name prefix of a LoRA update that names none (``adapter_name``).
DEFAULT_ADAPTER_PREFIX = "policy"
# An adapter name prefix: what vLLM and every client accept in a model name.
ADAPTER_PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,150}$")


def adapter_name(prefix: str, version: int) -> str:
    """The adapter name of policy ``version``: ``<prefix>-v<version>`` (``policy-v4``)."""
    return f"{prefix}-v{version}"


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
