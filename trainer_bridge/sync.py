"""Publishing new weights: into vLLM, then into the gateway as the next policy version.

Owns: the order of a publish, so that no step mixes old and new weights and every later step
carries the new version.

- LoRA: "load the adapter into every vLLM replica under its own name → reset each prefix cache
  → register the version with the gateway (which switches the alias atomically)". Calls in
  flight finish on the adapter they started with.
- Full weights: one ``POST /admin/weight-updates`` to the gateway, which holds new calls, drains
  (or aborts) the calls in flight, reloads its replicas in place, registers the version and
  releases the held calls on it (``gateway.upstream.weight_update``). The gateway reloads the
  replicas it routes to; ``vllm_urls`` serve LoRA loads only. A full reload must not go to vLLM
  directly: calls in flight would sample across it.

Never: trains.

vLLM endpoints used (vLLM 0.32, checked against the CPU build):
``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": true}`` (needs
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``) and ``POST /reset_prefix_cache``
(``VLLM_SERVER_DEV_MODE=1``); the gateway uses ``POST /collective_rpc {"method":
"reload_weights", "kwargs": {"weights_path"}}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

WeightFormat = Literal["lora", "full"]


class WeightSyncError(RuntimeError):
    """vLLM or the gateway refused a step of the sync; the message names which and why."""


@dataclass(frozen=True)
class PublishedPolicy:
    """A published version; ``pause_ms``: how long the gateway held calls (full weights only)."""

    version: int
    model_name: str
    weights_location: str
    pause_ms: float | None = None


class WeightSync:
    """Pushes weights to vLLM replicas and registers them with a gateway."""

    def __init__(
        self,
        vllm_urls: list[str],
        gateway_url: str,
        *,
        admin_token: str | None = None,
        adapter_prefix: str = "policy",
        base_model_name: str = "tiny",
        keep_adapters: int = 2,
        timeout_s: float = 120.0,
    ) -> None:
        self.vllm_urls = [url.rstrip("/") for url in vllm_urls]
        self.gateway_url = gateway_url.rstrip("/")
        self.adapter_prefix = adapter_prefix
        self.base_model_name = base_model_name
        self.keep_adapters = keep_adapters
        self.loaded_adapters: list[str] = []
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.client = httpx.Client(timeout=timeout_s, headers=headers)

    def _post(self, url: str, body: dict[str, object]) -> dict[str, object]:
        response = self.client.post(url, json=body)
        if response.status_code >= 400:
            raise WeightSyncError(f"POST {url} -> {response.status_code}: {response.text[:500]}")
        try:  # vLLM answers some of these in plain text ("Success: LoRA adapter ...")
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
        """Load ``weights_dir`` into every replica, reset their prefix caches, register.

        LoRA: each version is its own adapter name (``<prefix>-v<version>``), so a call resolved
        against the previous version before the switch still finds its adapter. Full weights:
        reloaded in place under the base model name by the gateway, around a pause of its
        calls (``POST /admin/weight-updates``); ``weights_dir`` must be readable by every
        replica. Adapters older than the last ``keep_adapters`` are unloaded after the switch
        (the previous version stays for calls still in flight).

        Raises:
            WeightSyncError: a replica or the gateway refused.
            ValueError: unknown ``fmt``.
        """
        location = str(weights_dir.resolve())
        if fmt == "full":
            answer = self._post(
                f"{self.gateway_url}/admin/weight-updates",
                {
                    "version": version,
                    "model_name": self.base_model_name,
                    "weights_location": location,
                },
            )
            pause_ms = answer.get("pause_ms")
            return PublishedPolicy(
                version,
                self.base_model_name,
                location,
                float(pause_ms) if isinstance(pause_ms, int | float) else None,
            )
        if fmt != "lora":
            raise ValueError(f"weight format must be 'lora' or 'full', got {fmt!r}")
        model_name = f"{self.adapter_prefix}-v{version}"
        for url in self.vllm_urls:
            self._post(
                f"{url}/v1/load_lora_adapter",
                {"lora_name": model_name, "lora_path": location, "load_inplace": True},
            )
        for url in self.vllm_urls:
            self._post(f"{url}/reset_prefix_cache", {})
        published = self.register(version, model_name, location)
        self.loaded_adapters.append(model_name)
        while len(self.loaded_adapters) > self.keep_adapters:
            self.unload(self.loaded_adapters.pop(0))
        return published

    def unload(self, model_name: str) -> None:
        """Unload an adapter from every replica. Old versions must not pile up: vLLM reloads an
        evicted adapter from its directory, and one whose directory is gone kills the engine
        (vLLM 0.32, CPU: ``LoRAAdapterNotFoundError`` in the worker, then ``EngineDeadError``)."""
        for url in self.vllm_urls:
            self._post(f"{url}/v1/unload_lora_adapter", {"lora_name": model_name})

    def unload_all(self) -> None:
        """Unload every adapter this sync loaded (end of a run or a test)."""
        while self.loaded_adapters:
            self.unload(self.loaded_adapters.pop())

    def close(self) -> None:
        self.client.close()
