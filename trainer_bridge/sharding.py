"""FSDP2 sharding of the policy, and gathering sharded weights back into files vLLM loads.

Owns: ``shard_model`` (torch's ``torch.distributed.fsdp.fully_shard`` on each decoder layer, then
on the whole model, over a one-dimensional device mesh of every rank), ``sharded_parameters``
(what one rank holds), and writing a sharded model's weights as full tensors
(``save_full_safetensors``, ``gather_trainable``). Never: talks HTTP, chooses rows, or builds a
distributed engine of its own: every collective is torch's.

Choices, each checked on this CPU machine under ``torchrun`` with gloo (tests/test_distributed.py):

- Gradients are summed over the ranks, not averaged (``set_gradient_divide_factor(1.0)``): the
  trainer already weighs each rank's micro-batches by their share of the whole batch, exactly
  as on the replicated path. Gloo has no pre-multiplied sum, so the reduce-scatter is told to use
  a plain sum (``set_force_sum_reduction_for_comms``); with a divide factor of 1 that is the same.
- Mixed precision on GPUs only (``MixedPrecisionPolicy``): bf16 parameters for the forward and
  backward, fp32 gradient reduction; the sharded master weights and AdamW's state stay fp32. On
  CPU everything is fp32.
- Activation checkpointing (optional) recomputes each decoder layer in the backward pass
  (transformers' non-reentrant ``gradient_checkpointing_enable``), applied before sharding.
- LoRA: the peft model is sharded the same way; its frozen base weights are sharded too (FSDP2
  shards per parameter and accepts frozen and trainable parameters in one group).

Writing weights without two full copies: each tensor is gathered in turn (``full_tensor()``, a
collective every rank joins in the same order) and rank 0 keeps only the tensors of the file
it is filling (at most ``max_file_bytes`` plus one tensor), written with safetensors' own
``save_file`` in Hugging Face's sharded layout (``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``; a single ``model.safetensors`` when it fits one file), which
vLLM and transformers both load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

MAX_FILE_BYTES = 2 * 1024**3  # Hugging Face's default shard size for safetensors files


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM, under peft's wrapper or not.

    Raises:
        ValueError: the model has no ``model.layers`` (not a decoder-only transformers model).
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = getattr(getattr(inner, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(inner).__name__} has no model.layers to shard")
    return list(layers)


def shard_model(model: Any, device: torch.device, *, activation_checkpointing: bool) -> Any:
    """Shard ``model`` in place over every rank of the default process group (FSDP2).

    Every rank must hold the same starting weights (each loads the same directory, and LoRA
    adapters are initialised from the same seed; ``PolicyTrainer`` broadcasts them anyway).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():  # each sharded module reduces its own parameter group
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if device.type != "cuda":
                module.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
    return model


def local_numel(tensor: Tensor) -> int:
    """Elements this rank stores of ``tensor`` (its shard of a DTensor, else all)."""
    from torch.distributed.tensor import DTensor

    return int(tensor.to_local().numel()) if isinstance(tensor, DTensor) else int(tensor.numel())


def full(tensor: Tensor) -> Tensor:
    """The whole ``tensor`` on every rank (a collective for a DTensor), detached, on CPU."""
    from torch.distributed.tensor import DTensor

    value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return value.detach().cpu()


def gather_trainable(model: Any) -> dict[str, Tensor]:
    """Every trainable parameter, whole, by its state-dict name (every rank joins; LoRA's
    adapters are a few megabytes, so all of them are held at once)."""
    return {name: full(p) for name, p in model.named_parameters() if p.requires_grad}


def _weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` of what ``save_pretrained`` would write: the state dict without a tied
    output embedding (Hugging Face drops the duplicate; vLLM ties it again on load). A sharded
    model's state dict keeps a tied tensor under one of its names, which one depending on
    Python's string hashing: it is written as the input embedding."""
    state = dict(model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in state:
        tied = state.pop("lm_head.weight")
        state.setdefault("model.embed_tokens.weight", tied)
    yield from state.items()


def save_full_safetensors(
    model: Any, directory: Path, *, rank: int, max_file_bytes: int = MAX_FILE_BYTES
) -> Path:
    """Write a (sharded) model's full weights and config to ``directory`` from rank 0.

    Every rank must call it (each tensor's gather is a collective); only rank 0 writes. Memory on
    rank 0: one file's tensors at a time. Returns ``directory``.
    """
    from safetensors.torch import save_file

    entries = [(name, tensor.shape, tensor.dtype) for name, tensor in _weights(model)]
    sizes = [torch.Size(shape).numel() * dtype.itemsize for _, shape, dtype in entries]
    files: list[list[str]] = [[]]
    filled = 0
    for (name, _, _), size in zip(entries, sizes, strict=True):
        if files[-1] and filled + size > max_file_bytes:
            files.append([])
            filled = 0
        files[-1].append(name)
        filled += size
    count = len(files)
    names = (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    file_of = {name: names[i] for i, group in enumerate(files) for name in group}
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    held: dict[str, Tensor] = {}
    current = names[0]
    for name, tensor in _weights(model):
        value = full(tensor)  # every rank gathers; rank 0 keeps it
        if rank != 0:
            continue
        if file_of[name] != current:
            save_file(held, str(directory / current), metadata={"format": "pt"})
            held, current = {}, file_of[name]
        held[name] = value.contiguous()
    if rank == 0:
        save_file(held, str(directory / current), metadata={"format": "pt"})
        if count > 1:
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": file_of}
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(directory)
    return directory
