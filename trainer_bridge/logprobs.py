"""Per-token log-probabilities and entropies of a causal LM over given token sequences.

Owns: the alignment between logits and tokens. Shape legend: ``B`` rows, ``T`` tokens, ``V``
vocabulary. Position t of every output holds the value for token t predicted from tokens < t;
position 0 has no prediction and holds 0. This is the alignment of ``loss_mask`` and
``behaviour_logprobs`` in a batch row. Never: re-tokenises text; it reads IDs only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def token_logprobs(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    *,
    with_entropy: bool = False,
    temperature: float | Tensor = 1.0,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities ``[B, T]`` (and entropies ``[B, T]``) of ``input_ids`` under ``model``.

    ``temperature`` (a number, or ``[B, T]``: the temperature of each token, aligned with
    ``input_ids``) divides the logits that predict each token: the policy a token was sampled
    from at temperature ``t`` is ``softmax(logits / t)``. A batch row's ``temperature`` is the
    one its behaviour logprobs are at (vLLM run with ``--logprobs-mode processed_logprobs``
    reports them at the sampling temperature; ``gateway.proxy.sampling``).

    Packed rows (``trainer_bridge.packing``): ``attention_mask`` None and ``position_ids [1, N]``
    restarting at 0 on each row; a row's first token then holds 0, as unpacked. The forward
    never uses a KV cache: with one, transformers skips the packed-row masking.
    """
    if position_ids is None:
        if attention_mask is None:
            raise ValueError("token_logprobs needs an attention_mask or packed position_ids")
        position_ids = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # [B, T]
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).logits  # [B, T, V]
    if isinstance(temperature, Tensor):
        divisor: float | Tensor = temperature[:, 1:].unsqueeze(-1).float()  # [B, T-1, 1]
    else:
        divisor = temperature
    logits = logits[:, :-1, :].float() / divisor  # predicts tokens 1..T-1: [B, T-1, V]
    log_softmax = torch.log_softmax(logits, dim=-1)  # [B, T-1, V]
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    picked = log_softmax.gather(-1, targets).squeeze(-1)  # [B, T-1]
    zeros = torch.zeros_like(picked[:, :1])  # [B, 1]
    starts = position_ids == 0  # [B, T]: a row's first token, predicted by nothing of its own
    logprobs = torch.cat([zeros, picked], dim=1).masked_fill(starts, 0.0)  # [B, T]
    if not with_entropy:
        return logprobs, None
    entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)  # [B, T-1]
    return logprobs, torch.cat([zeros, entropy], dim=1).masked_fill(starts, 0.0)  # [B, T]
