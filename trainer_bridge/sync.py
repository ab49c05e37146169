"""Publishing new weights and releasing adapters: requests to the gateway, which drives every
vLLM replica; the trainer never speaks to vLLM.

Owns: what the trainer sends to publish a version, and the end-of-run release of its adapters.

Both formats go through ``POST /admin/weight-updates`` of the gateway, which loads the weights
into every replica it routes to, registers and activates the version, and answers once calls
are served by it (its failure rules, deadlines and error envelope are the gateway's:
docs/gateway.md, "Full-weight updates" and "LoRA updates"):

- LoRA (``weight_format: "lora"``): the gateway loads the adapter as
  ``<adapter_prefix>-v<version>``, a new name per version, switches the alias to it and unloads
  its adapters past the newest ``lora_adapters_kept``; nothing paused, calls in flight finish on
  the adapter they started with (``gateway.upstream.adapters``).
- Full weights: the gateway holds new calls, keeps or drains the calls in flight, reloads its
  replicas in place, registers the version and releases the held calls on it
  (``gateway.upstream.weight_update``). A full reload must not go to vLLM directly: calls in
  flight would sample across it.

The end of a run (the demo, a test) releases the adapters it published before their
directories are deleted (vLLM reloads an evicted adapter from its directory, and one whose
directory is gone kills the engine): ``release_adapters``, one ``POST /admin/adapter-releases``
of the gateway (``gateway.api.lora``), which unloads every adapter named
``<adapter_prefix>-v...`` from every replica, between its weight updates.

Never: trains; speaks to vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

WeightFormat = Literal["lora", "full"]


class WeightSyncError(RuntimeError):
    """The gateway refused a step of the sync, or a replica behind it failed one; the message
    is the gateway's answer (its status and error envelope)."""


@dataclass(frozen=True)
class PublishedPolicy:
    """A published version; ``pause_ms``: how long the gateway held calls (full weights only)."""

    version: int
    model_name: str
    weights_location: str
    pause_ms: float | None = None


class WeightSync:
    """Publishes weights and releases adapters through the gateway at ``gateway_url``."""

    def __init__(
        self,
        gateway_url: str,
        *,
        admin_token: str | None = None,
        adapter_prefix: str = "policy",
        base_model_name: str = "tiny",
        timeout_s: float = 120.0,
    ) -> None:
        self.gateway_url = gateway_url.rstrip("/")
        self.adapter_prefix = adapter_prefix
        self.base_model_name = base_model_name
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)

    def _post(self, url: str, body: dict[str, object]) -> dict[str, object]:
        response = self.client.post(url, json=body)
        if response.status_code >= 400:
            raise WeightSyncError(f"POST {url} -> {response.status_code}: {response.text[:500]}")
        try:
            answer = response.json()
        except ValueError:
            return {}
        return answer if isinstance(answer, dict) else {}

    def register(self, version: int, model_name: str, weights_location: str) -> PublishedPolicy:
        """Register and activate ``version`` in the gateway's policy registry."""
        self._post(
            f"{self.gateway_url}/admin/policy-versions",
            {
                "version": version,
                "model_name": model_name,
                "weights_location": weights_location,
                "activate": True,
            },
        )
        return PublishedPolicy(version, model_name, weights_location)

    def publish(self, version: int, weights_dir: Path, fmt: WeightFormat) -> PublishedPolicy:
        """Publish ``weights_dir`` as ``version`` with one ``POST /admin/weight-updates``.

        LoRA: the gateway loads the adapter into every replica as ``<prefix>-v<version>`` (a
        name of its own, so a call resolved against the previous version still finds its
        adapter), activates it and unloads its older adapters. Full weights: reloaded in place
        under the base model name, around a pause of the gateway's calls. ``weights_dir`` must
        be readable by every replica.

        Raises:
            WeightSyncError: the gateway refused (4xx: bad input, such as replicas without
                LoRA or no adapter in ``weights_dir``; 409: the version holds other weights)
                or a replica failed (502 ``weight_update_failed``: publish again).
            ValueError: unknown ``fmt``.
        """
        location = str(weights_dir.resolve())
        body: dict[str, object] = {
            "version": version,
            "weight_format": fmt,
            "weights_location": location,
        }
        if fmt == "full":
            body["model_name"] = self.base_model_name
        elif fmt == "lora":
            body["adapter_prefix"] = self.adapter_prefix
        else:
            raise ValueError(f"weight format must be 'lora' or 'full', got {fmt!r}")
        answer = self._post(f"{self.gateway_url}/admin/weight-updates", body)
        model_name = answer.get("model_name")
        if not isinstance(model_name, str):
            raise WeightSyncError(f"the gateway's answer names no model_name: {answer}")
        if fmt == "lora":
            return PublishedPolicy(version, model_name, location)
        pause_ms = answer.get("pause_ms")
        return PublishedPolicy(
            version,
            model_name,
            location,
            float(pause_ms) if isinstance(pause_ms, int | float) else None,
        )

    def release_adapters(self, *, include_active: bool = False) -> dict[str, list[str]]:
        """Unload this run's adapters (``<adapter_prefix>-v...``) from every replica through the
        gateway (end of a run or a test, before their directories are deleted); returns, per
        replica URL, the adapters it no longer serves.

        ``include_active``: also the adapter of the active policy version, which the alias
        serves (calls for the alias then fail until the next publish); otherwise a release that
        selects it is refused and nothing is released.

        Raises:
            WeightSyncError: the gateway refused (409 ``lora_adapter_active``: the active
                version's adapter was selected without ``include_active``) or a replica failed
                (502 ``lora_release_failed``: the message says what was released; release
                again).
        """
        body: dict[str, object] = {
            "adapter_prefix": f"{self.adapter_prefix}-v",
            "include_active": include_active,
        }
        answer = self._post(f"{self.gateway_url}/admin/adapter-releases", body)
        released = answer.get("released")
        if not isinstance(released, dict) or not all(
            isinstance(names, list) for names in released.values()
        ):
            raise WeightSyncError(f"the gateway's answer lists no released adapters: {answer}")
        return {str(url): [str(name) for name in names] for url, names in released.items()}

    def close(self) -> None:
        self.client.close()
