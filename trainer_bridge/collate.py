"""Batch rows to padded tensors.

Owns: padding rows into ``[B, T]`` tensors and ordering them by length so micro-batches carry
little padding. Shape legend: ``B`` rows, ``T`` the longest row's tokens. A row is what a
materialised batch holds: ``input_ids``, ``loss_mask`` (1 on sampled tokens),
``behaviour_logprobs`` (0 where the mask is 0), one advantage and the temperature its
behaviour logprobs are at. Never: builds token IDs from
text; rows come from captured IDs only.

Not done here: packing several rows into one sequence. With right padding and length-sorted
micro-batches the padding stays small on CPU; true packing needs a varlen attention kernel
(flash-attention) and belongs to the GPU path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer_bridge.trainer import TrainBatch


@dataclass(frozen=True)
class Row:
    """One training row (lists of equal length ``L``)."""

    input_ids: Sequence[int]
    loss_mask: Sequence[int]
    behaviour_logprobs: Sequence[float]
    advantage: float
    # The temperature the behaviour logprobs are at; the trainer divides the logits by it.
    temperature: float = 1.0

    def __post_init__(self) -> None:
        lengths = {len(self.input_ids), len(self.loss_mask), len(self.behaviour_logprobs)}
        if len(lengths) != 1:
            raise ValueError(
                "input_ids, loss_mask and behaviour_logprobs must have one length; got "
                f"{len(self.input_ids)}, {len(self.loss_mask)}, {len(self.behaviour_logprobs)}"
            )


def row_from_step(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    logprobs: Sequence[float],
    advantage: float,
    temperature: float = 1.0,
) -> Row:
    """A ``per_step`` row: the exact prompt (mask 0) followed by the sampled response (mask 1)."""
    if len(response_ids) != len(logprobs):
        raise ValueError(
            f"response has {len(response_ids)} ids but {len(logprobs)} logprobs; such a step is "
            "flagged ids_incomplete and must not be trained on"
        )
    return Row(
        input_ids=[*prompt_ids, *response_ids],
        loss_mask=[0] * len(prompt_ids) + [1] * len(response_ids),
        behaviour_logprobs=[0.0] * len(prompt_ids) + list(logprobs),
        advantage=advantage,
        temperature=temperature,
    )


def collate(rows: Sequence[Row], pad_token_id: int) -> TrainBatch:
    """Right-pad ``rows`` (longest first) into a ``TrainBatch`` of ``[B, T]`` tensors.

    Raises ValueError for an empty batch.
    """
    if not rows:
        raise ValueError("cannot collate an empty batch")
    ordered = sorted(rows, key=lambda row: len(row.input_ids), reverse=True)
    width = len(ordered[0].input_ids)
    batch = len(ordered)
    input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    behaviour = torch.zeros((batch, width), dtype=torch.float32)  # [B, T]
    for i, row in enumerate(ordered):
        n = len(row.input_ids)
        input_ids[i, :n] = torch.tensor(row.input_ids, dtype=torch.long)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(row.loss_mask, dtype=torch.long)
        behaviour[i, :n] = torch.tensor(row.behaviour_logprobs, dtype=torch.float32)
    advantages = torch.tensor([row.advantage for row in ordered], dtype=torch.float32)  # [B]
    temperatures = None
    if any(row.temperature != 1.0 for row in ordered):
        temperatures = torch.tensor([row.temperature for row in ordered])  # [B]
    return TrainBatch(input_ids, attention, loss_mask, behaviour, advantages, temperatures)
