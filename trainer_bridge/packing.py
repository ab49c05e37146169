"""Micro-batches of one update: padded groups of rows, or rows packed end to end.

Owns: which rows go into which forward pass (``plan_micro_batches``), packing a group of rows into
one sequence without padding (``pack``) and putting per-token outputs back into the padded
layout the losses read (``unpack``), and the tokens they feed the model (``fed_tokens``, for
the update's padding fraction). Shape legend: ``b`` rows of a micro-batch, ``T`` the padded
width, ``N`` the packed tokens (the sum of the rows' lengths). Never: weighs or normalises
losses (``trainer.PolicyTrainer.update`` does, over the whole batch, not per micro-batch).

Packing, as transformers 5 supports it for Qwen2 (checked on 5.19): the rows are concatenated
into ``input_ids [1, N]`` with ``position_ids`` restarting at 0 on each row and no attention
mask. The model's mask builder (``transformers.masking_utils.find_packed_sequence_indices``)
reads the restarts and keeps attention within each row: a block-diagonal causal mask for the
``sdpa`` and ``eager`` kernels (CPU), variable-length kernels for ``flash_attention_2``. It does
so only without a KV cache, so every forward passes ``use_cache=False``
(``logprobs.token_logprobs``). A row's first token predicts nothing, exactly as unpacked.

Packing plan: first-fit decreasing over the rows (longest first, each into the first micro-batch
with room, ``micro_batch_tokens`` each); a row longer than the budget gets a micro-batch of its
own (rows are never split: its tokens attend to each other).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def plan_micro_batches(lengths: Sequence[int], *, rows: int, tokens: int | None) -> list[list[int]]:
    """Row indices of each micro-batch.

    Args:
        lengths: tokens of each row of the batch (any order).
        rows: rows per padded micro-batch (used when ``tokens`` is None), in batch order.
        tokens: token budget of a packed micro-batch; None: padded micro-batches of ``rows``.

    Raises:
        ValueError: ``rows`` or ``tokens`` below 1.
    """
    if rows < 1 or (tokens is not None and tokens < 1):
        raise ValueError(f"rows and tokens per micro-batch must be >= 1; got {rows}, {tokens}")
    if tokens is None:
        return [list(range(i, min(i + rows, len(lengths)))) for i in range(0, len(lengths), rows)]
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        for k, free in enumerate(room):
            if length <= free:
                bins[k].append(index)
                room[k] -= length
                break
        else:
            bins.append([index])
            room.append(max(tokens - length, 0))
    return bins


def pack(input_ids: Tensor, lengths: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Right-padded rows ``input_ids [b, T]`` of ``lengths`` as ``ids [1, N], positions [1, N]``."""
    ids = torch.cat([input_ids[i, :n] for i, n in enumerate(lengths)])  # [N]
    positions = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])  # [N]
    return ids[None, :], positions[None, :]


def unpack(values: Tensor, lengths: Sequence[int], width: int) -> Tensor:
    """Packed per-token ``values [1, N]`` back to the padded layout ``[b, width]`` (0 in padding).

    Differentiable: the loss's gradient flows back into the packed forward.
    """
    rows = []
    offset = 0
    for n in lengths:
        row = values[0, offset : offset + n]  # [n]
        rows.append(torch.nn.functional.pad(row, (0, width - n)))  # [width]
        offset += n
    return torch.stack(rows)  # [b, width]


def fed_tokens(lengths: Sequence[int], plan: list[list[int]], *, packed: bool) -> int:
    """Tokens fed to the model by ``plan``'s micro-batches, padding included: packed, the rows'
    tokens; padded, each micro-batch is as wide as its longest row."""
    if packed:
        return sum(lengths[i] for group in plan for i in group)
    return sum(len(group) * max(lengths[i] for i in group) for group in plan if group)
