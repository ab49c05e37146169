"""Helpers for the full-weight update tests: versions of the tiny model's weights, and putting
the base weights back into the session's vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from trajgate.vllm_server import VLLMServer

# Each version's weights are the base weights plus N(0, 0.02^2) noise (seed = version) on every
# parameter, the input embedding and the output head included: enough to move a logprob by
# ~1e-2 nats, three orders of magnitude above the 1e-5 tolerance. The tiny model's embeddings
# are untied; vLLM 0.32's in-place reload cannot update a tied output head (docs/gateway.md,
# "Full-weight updates").
NOISE_STD = 0.02


def noisy_versions(tiny_model_dir: Path, root: Path, count: int) -> list[Path]:
    """Checkpoint directories of versions 0 (``tiny_model_dir``) to ``count`` under ``root``."""
    from transformers import AutoModelForCausalLM

    dirs = [tiny_model_dir]
    for version in range(1, count + 1):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        noise = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=noise) * NOISE_STD)
        model.save_pretrained(root / f"v{version}", safe_serialization=True)
        dirs.append(root / f"v{version}")
    return dirs


@contextmanager
def base_weights_put_back(vllm: VLLMServer, tiny_model_dir: Path) -> Iterator[None]:
    """Reload the base weights (and reset the prefix cache) when the block ends, resuming
    vLLM first in case the block failed while it was paused."""
    try:
        yield
    finally:
        httpx.post(f"{vllm.url}/resume", timeout=60).raise_for_status()
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(tiny_model_dir)}}
        httpx.post(f"{vllm.url}/collective_rpc", json=reload, timeout=300).raise_for_status()
        httpx.post(f"{vllm.url}/reset_prefix_cache", timeout=60).raise_for_status()
