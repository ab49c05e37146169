"""Checkpoints of the trainer under torchrun: model and optimizer state, sharded, and the lineage
of what those weights were trained on, so a restarted trainer resumes without training a batch
twice.

Owns: ``save`` and ``load`` (torch's ``torch.distributed.checkpoint``: every rank writes and reads
its own shards, ``get_state_dict``/``set_state_dict`` translate FSDP2 and replicated models and
AdamW alike; LoRA saves only the adapters and their optimizer state, the frozen base weights
come from the model directory again), ``latest``, and ``Lineage``: the policy version and the
batches trained into the checkpointed weights, written by rank 0 as ``lineage.json`` after
every rank has written its shards (a directory without it is an unfinished checkpoint and is
ignored). The last two checkpoints are kept. Never: talks to the pool; the resume rules that
use the lineage are in ``trainer_bridge.distributed``.

Layout: ``<checkpoint_dir>/update-<N>/`` (N = updates in the weights, 8 digits), holding the
shards (``*.distcp``, ``.metadata``) and ``lineage.json``.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as load_shards
from torch.distributed.checkpoint.state_dict_saver import save as save_shards

LINEAGE_FILE = "lineage.json"
KEEP_CHECKPOINTS = 2


@dataclass
class Lineage:
    """What a checkpoint's weights are: ``policy_version`` of their last update (0: none yet),
    ``steps`` optimiser steps, and ``batches``: ``[batch_id, policy_version]`` of every batch
    trained into them, in order (one entry per update)."""

    policy_version: int = 0
    steps: int = 0
    batches: list[tuple[str, int]] = field(default_factory=list)

    def version_of(self, batch_id: str) -> int | None:
        """The policy version ``batch_id`` was trained into, or None when it was not."""
        return next((v for b, v in self.batches if b == batch_id), None)


def _options() -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=True)


def _state(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state dicts, a tied parameter's optimizer state under one name.

    ``get_state_dict`` names a parameter that has several names (tied input and output
    embeddings) by whichever comes first out of a set, which changes from process to process
    with Python's string hashing: a checkpoint saved as ``model.embed_tokens.weight`` was then
    looked up as ``lm_head.weight`` after a restart. Here the alphabetically first name wins.
    """
    model_state, optimizer_dict = get_state_dict(model, optimizer, options=_options())
    optimizer_state: dict[str, Any] = dict(optimizer_dict)
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    canonical = {n: min(group) for group in names.values() if len(group) > 1 for n in group}
    state = optimizer_state.get("state", {})
    optimizer_state["state"] = {canonical.get(k, k): v for k, v in state.items()}
    for group in optimizer_state.get("param_groups", []):
        group["params"] = [canonical.get(k, k) for k in group["params"]]
    return model_state, optimizer_state


def latest(directory: Path) -> Path | None:
    """The newest finished checkpoint under ``directory``, or None."""
    finished = sorted(p.parent for p in directory.glob(f"update-*/{LINEAGE_FILE}"))
    return finished[-1] if finished else None


def save(directory: Path, model: Any, optimizer: Any, lineage: Lineage) -> Path:
    """Write a checkpoint of ``lineage``'s weights (every rank calls it); returns its path."""
    path = directory / f"update-{len(lineage.batches):08d}"
    model_state, optimizer_state = _state(model, optimizer)
    save_shards({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    if dist.get_rank() == 0:
        staged = path / f"{LINEAGE_FILE}.tmp"
        staged.write_text(json.dumps(asdict(lineage)))
        staged.replace(path / LINEAGE_FILE)  # the checkpoint counts from here on
        finished = sorted(p.parent for p in directory.glob(f"update-*/{LINEAGE_FILE}"))
        for old in finished[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load(path: Path, model: Any, optimizer: Any) -> Lineage:
    """Restore the checkpoint at ``path`` into ``model`` and ``optimizer`` (every rank)."""
    model_state, optimizer_state = _state(model, optimizer)
    load_shards({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(  # load_shards filled both dicts in place
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
        options=_options(),
    )
    data = json.loads((path / LINEAGE_FILE).read_text())
    return Lineage(
        int(data["policy_version"]),
        int(data["steps"]),
        [(str(b), int(v)) for b, v in data["batches"]],
    )
