"""Policy-gradient losses over sampled tokens.

Owns: the clipped surrogate, its importance weights, KL to a reference, and how per-token losses
are averaged. Shape legend: ``B`` rows, ``T`` tokens. Every tensor argument is ``[B, T]`` and
aligned so that position t holds the log-probability of token t (given tokens < t); positions
with ``loss_mask == 0`` (prompt, environment and padding tokens) never contribute.

Variants, each with its source:

- PPO clipped surrogate (Schulman et al. 2017, eq. 7):
  ``L_t = -min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)``, ``rho_t = exp(logp_t -
  logp_old_t)``. Asymmetric bounds ``eps_high > eps_low`` are DAPO's "clip-higher" (Yu et al.
  2025, sec. 3.1), which keeps low-probability tokens explorable.
- Truncated importance sampling for the sampler/trainer mismatch (Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training"): when the trainer's own
  pre-update logprobs ``old_logprobs`` are given, ``rho`` is taken against them and each token
  is weighted by ``min(exp(old_logprobs - behaviour_logprobs), tis_cap)``; without them ``rho``
  is taken against the behaviour logprobs vLLM reported.
- KL to a reference policy ``pi_ref`` with Schulman's k3 estimator (J. Schulman 2020,
  "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html), per token on the loss
  mask: with ``d_t = ref_logprobs_t - logprobs_t`` (``log pi_ref/pi`` of the sampled token),
  ``k3_t = exp(d_t) - d_t - 1``, aggregated like the policy loss and added with weight
  ``kl_coef`` (GRPO's penalty, Shao et al. 2024, eq. 4, uses this k3). Why k3 and not k1: over
  tokens sampled from ``pi``, k1 = ``-d_t`` is unbiased for KL(pi || pi_ref) but takes negative
  values and, used as a loss, its gradient ``grad log pi`` has expectation 0, so it would not
  pull toward the reference at all; k3 is never negative, unbiased for the same KL, and its
  gradient ``(1 - pi_ref/pi) grad log pi`` has the expectation of the gradient of the forward
  KL(pi_ref || pi) (Tang and Munos 2025, "On a few pitfalls in KL divergence gradient estimation
  for RL"). The tokens were sampled by the behaviour policy, not the current one: no importance
  weight is put on this term (as in GRPO and TRL), a bias of the size of the sampler gap.
- Aggregation: ``token_mean`` (DAPO: every token weighs the same, the normaliser is the batch's
  token count, no length bias); ``seq_mean`` (GRPO as published: mean over a sequence's tokens,
  then over sequences, which favours short correct and long wrong answers, Liu et al. 2025);
  ``seq_sum_token_mean`` (Dr. GRPO, Liu et al. 2025: a sequence's token sum divided by a
  constant ``norm_tokens``, then the mean over sequences, which removes that length bias).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer_bridge.settings import Aggregation


@dataclass(frozen=True)
class LossConfig:
    """How the policy loss is computed. Defaults: symmetric PPO clip, token mean, no KL."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float | None = 2.0
    aggregation: Aggregation = "token_mean"
    norm_tokens: int | None = None  # seq_sum_token_mean's constant; default T
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip bounds must be >= 0, got {self.clip_low}, {self.clip_high}")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.aggregation not in ("token_mean", "seq_mean", "seq_sum_token_mean"):
            raise ValueError(
                f"aggregation must be token_mean, seq_mean or seq_sum_token_mean; "
                f"got {self.aggregation!r}"
            )
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@dataclass(frozen=True)
class LossOutput:
    """The scalar loss and detached statistics over masked tokens."""

    loss: Tensor
    clip_fraction: float
    ratio_mean: float
    ratio_max: float
    kl: float
    tis_weight_mean: float


def aggregate(
    values: Tensor, mask: Tensor, aggregation: Aggregation, norm_tokens: int | None
) -> Tensor:
    """Reduce per-token ``values [B, T]`` under ``mask [B, T]`` to a scalar (see module doc)."""
    mask = mask.to(values.dtype)
    if aggregation == "token_mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    per_sequence = (values * mask).sum(dim=1)  # [B]
    if aggregation == "seq_mean":
        return (per_sequence / mask.sum(dim=1).clamp(min=1.0)).mean()
    if aggregation == "seq_sum_token_mean":
        return (per_sequence / float(norm_tokens or values.shape[1])).mean()
    raise ValueError(
        f"aggregation must be token_mean, seq_mean or seq_sum_token_mean; got {aggregation!r}"
    )


def policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    config: LossConfig,
    *,
    old_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
) -> LossOutput:
    """Clipped policy-gradient loss.

    Args:
        logprobs: ``[B, T]`` current policy, with grad.
        behaviour_logprobs: ``[B, T]`` what the sampler (vLLM) reported for the sampled tokens.
        advantages: ``[B, T]``, or ``[B]`` broadcast over the row's tokens.
        loss_mask: ``[B, T]``, 1 on sampled tokens.
        old_logprobs: ``[B, T]`` trainer logprobs before this update (enables TIS).
        ref_logprobs: ``[B, T]`` reference policy (needed when ``config.kl_coef > 0``).

    Raises:
        ValueError: shapes disagree, or ``kl_coef > 0`` without ``ref_logprobs``.
    """
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(logprobs)  # [B] -> [B, T]
    for name, tensor in (
        ("behaviour_logprobs", behaviour_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
    ):
        if tensor.shape != logprobs.shape:
            raise ValueError(f"{name} must be {tuple(logprobs.shape)}, got {tuple(tensor.shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs; pass them or set kl_coef=0")
    mask = loss_mask.bool()
    anchor = behaviour_logprobs if old_logprobs is None else old_logprobs
    log_ratio = torch.where(mask, logprobs - anchor, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)  # [B, T]
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)  # [B, T]
    tis = torch.ones_like(logprobs)
    if old_logprobs is not None and config.tis_cap is not None:
        mismatch = torch.where(mask, old_logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
        tis = torch.exp(mismatch).clamp(max=config.tis_cap).detach()
    per_token = per_token * tis
    kl_value = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None:
        delta = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl_tokens = torch.exp(delta) - delta - 1.0  # k3, [B, T]
        kl_value = aggregate(kl_tokens, mask, config.aggregation, config.norm_tokens)
    loss = aggregate(per_token, mask, config.aggregation, config.norm_tokens)
    loss = loss + config.kl_coef * kl_value
    with torch.no_grad():
        was_clipped = (ratio * advantages > clipped * advantages) & mask
        masked_ratio = ratio[mask]
        count = max(int(mask.sum()), 1)
        return LossOutput(
            loss=loss,
            clip_fraction=float(was_clipped.sum()) / count,
            ratio_mean=float(masked_ratio.mean()) if masked_ratio.numel() else 1.0,
            ratio_max=float(masked_ratio.max()) if masked_ratio.numel() else 1.0,
            kl=float(kl_value),
            tis_weight_mean=float(tis[mask].mean()) if masked_ratio.numel() else 1.0,
        )
