"""The torch trainer: one RL update of a Hugging Face causal LM (LoRA via peft, or full weights).

Owns: the model and optimiser, the reference policy of the KL penalty, micro-batching with
gradient accumulation (padded groups of rows, or rows packed into token budgets:
``trainer_bridge.packing``), gradient clipping, bf16 autocast on GPU, FSDP2 sharding
(``trainer_bridge.sharding``) or a replicated model, the update's metrics, and saving what vLLM
loads (a peft adapter directory or full safetensors). Shape legend: ``B`` rows, ``T`` tokens.
Never: talks HTTP (``sync`` and ``client`` do), or computes advantages (the pool does, before
the batch gets here).

Sharded (``sharding = "fsdp2"``, under ``torchrun`` only): every forward and backward pass is a
collective (each layer's weights are gathered for it), so every rank runs the same number of
them: a rank with fewer micro-batches than its peers runs empty ones (a two-token forward whose
loss is multiplied by 0). Gradients arrive reduce-scattered and summed; nothing else changes:
the micro-batch weights, the loss, clipping (over the sharded gradients' global norm) and the
step are those of the replicated path.

The reference policy (only when ``kl_coef > 0``; the estimator is in ``losses``): with LoRA it is
the same model with the adapter switched off (peft's ``disable_adapter()`` context), so it costs
one extra forward pass per update and no memory. With full fine-tuning it is a frozen copy of the
initial weights made at start: one more copy of every parameter in float32 (4 bytes per
parameter: 2 GB for a 0.5B model, 28 GB for 7B; no gradients or optimiser state) plus the same
extra forward pass. Both are the starting weights, so the first update's KL is 0.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from trainer_bridge.logprobs import token_logprobs
from trainer_bridge.losses import LossConfig, policy_loss
from trainer_bridge.packing import fed_tokens, pack, plan_micro_batches, unpack
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.sharding import full, gather_trainable, save_full_safetensors, shard_model


@dataclass(frozen=True)
class TrainBatch:
    """Tensors of one update; all ``[B, T]`` except ``advantages`` (``[B, T]`` or ``[B]``) and
    ``temperatures`` (``[B]``: each row's, which divides its logits; None: all 1)."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    temperatures: Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def lengths(self) -> list[int]:
        """Tokens of each row (its attention mask's ones)."""
        return [int(n) for n in self.attention_mask.sum(dim=1).tolist()]

    def select(self, indices: list[int]) -> TrainBatch:
        """The rows ``indices``, cut to the longest of them: ``[b, T_b]``."""
        index = torch.tensor(indices, dtype=torch.long)
        width = max(int(n) for n in self.attention_mask[index].sum(dim=1).tolist())
        advantages = self.advantages[index]
        return TrainBatch(
            self.input_ids[index, :width],
            self.attention_mask[index, :width],
            self.loss_mask[index, :width],
            self.behaviour_logprobs[index, :width],
            advantages[:, :width] if advantages.ndim == 2 else advantages,
            None if self.temperatures is None else self.temperatures[index],
        )

    def to(self, device: torch.device) -> TrainBatch:
        return TrainBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.loss_mask.to(device),
            self.behaviour_logprobs.to(device),
            self.advantages.to(device),
            None if self.temperatures is None else self.temperatures.to(device),
        )

    def token_temperatures(self) -> Tensor | float:
        """Each token's temperature ``[B, T]`` (its row's), or 1.0 when every row's is 1."""
        if self.temperatures is None:
            return 1.0
        return self.temperatures[:, None].expand(self.input_ids.shape)  # [B, T]


@dataclass(frozen=True)
class UpdateMetrics:
    """What one update did. ``logprob_gap_mean_abs``: mean |trainer - vLLM| logprob of the
    sampled tokens before the update (the sampler/trainer mismatch, in nats). ``kl``: the k3
    estimate of KL(policy || reference) in nats per token, aggregated like the loss; None when
    ``kl_coef`` is 0 (no reference is evaluated). ``step``: optimiser steps taken so far,
    this one included (1 after the first update). ``padding_fraction``: share of the tokens fed
    to the model in the update's forward passes that were padding (0 when rows are packed)."""

    loss: float
    clip_fraction: float
    ratio_mean: float
    kl: float | None
    entropy_mean: float
    grad_norm: float
    tokens: int
    tokens_per_s: float
    logprob_gap_mean_abs: float
    logprob_gap_max_abs: float
    step: int
    padding_fraction: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """Every metric as a float; ``kl`` left out when it was not measured."""
        return {key: float(value) for key, value in self.__dict__.items() if value is not None}


class World(Protocol):
    """The ranks of a data-parallel update (``trainer_bridge.distributed.GlooWorld``)."""

    def sum(self, value: float) -> float: ...

    def max(self, value: float) -> float: ...

    def sum_gradients(self, parameters: list[torch.nn.Parameter]) -> None: ...


class PolicyTrainer:
    """Holds the policy model and performs clipped policy-gradient updates."""

    def __init__(self, settings: TrainerSettings) -> None:
        from transformers import AutoModelForCausalLM

        self.settings = settings
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu")
            if settings.device == "auto"
            else settings.device
        )
        torch.manual_seed(settings.seed)
        model: Any = AutoModelForCausalLM.from_pretrained(settings.model_dir, dtype=torch.float32)
        if settings.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=settings.lora_rank,
                lora_alpha=settings.lora_alpha,
                target_modules=settings.lora_target_modules,
                lora_dropout=0.0,
                bias="none",
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, lora)
        self.sharded = settings.sharding == "fsdp2"
        if self.sharded and not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "sharding 'fsdp2' needs torch.distributed initialised: run "
                "`torchrun -m trainer_bridge.distributed`, or set sharding 'replicated'"
            )
        # Sharded, the model stays on the CPU until fully_shard moves each layer's shard to
        # the device: no GPU ever holds the whole model.
        self.model: Any = model if self.sharded else model.to(self.device)
        self.model.train()
        # Full fine-tuning's reference for the KL penalty: a frozen copy (memory: module doc).
        self.reference: Any = None
        if settings.kl_coef > 0 and settings.lora_rank == 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self.sharded:
            with torch.no_grad():  # LoRA's initial adapters: rank 0's on every rank
                for parameter in self.model.parameters():
                    if parameter.requires_grad:
                        value = parameter.data.to(self.device)  # NCCL broadcasts device tensors
                        dist.broadcast(value, src=0)
                        parameter.data.copy_(value)
            shard_model(
                self.model,
                self.device,
                activation_checkpointing=settings.activation_checkpointing,
            )
            if self.reference is not None:
                shard_model(self.reference, self.device, activation_checkpointing=False)
        elif settings.activation_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.steps = 0
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=settings.learning_rate, weight_decay=settings.weight_decay
        )
        self.loss_config = LossConfig(
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            tis_cap=settings.tis_cap,
            aggregation=settings.aggregation,
            kl_coef=settings.kl_coef,
        )

    def _autocast(self) -> Any:
        enabled = self.device.type == "cuda"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _plan(self, batch: TrainBatch, world: World | None) -> list[list[int]]:
        """Row indices of each micro-batch; sharded, padded with empty ones (``[]``) to the
        largest count of any rank (module doc)."""
        plan = plan_micro_batches(
            batch.lengths,
            rows=self.settings.micro_batch_rows,
            tokens=self.settings.micro_batch_tokens,
        )
        if self.sharded:
            if world is None:
                raise ValueError("a sharded trainer needs the world of its ranks (World)")
            plan += [[] for _ in range(int(world.max(len(plan))) - len(plan))]
        return plan

    def _forward(
        self, model: Any, micro: TrainBatch | None, *, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Logprobs (and entropies) ``[b, T_b]`` of a micro-batch on the device, padded or packed
        by the settings; ``None``: an empty micro-batch's two-token forward (``[1, 2]``)."""
        if micro is None:
            ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)  # [1, 2]
            with self._autocast():
                return token_logprobs(model, ids, torch.ones_like(ids))
        if self.settings.micro_batch_tokens is None:
            with self._autocast():
                return token_logprobs(
                    model,
                    micro.input_ids,
                    micro.attention_mask,
                    with_entropy=with_entropy,
                    temperature=micro.token_temperatures(),
                )
        lengths = micro.lengths
        ids, positions = pack(micro.input_ids, lengths)  # [1, N] each
        temperature: float | Tensor = 1.0
        if micro.temperatures is not None:
            counts = torch.tensor(lengths, device=micro.temperatures.device)  # [b]
            temperature = micro.temperatures.repeat_interleave(counts)[None]  # [1, N]
        with self._autocast():
            values, entropy = token_logprobs(
                model,
                ids,
                None,
                with_entropy=with_entropy,
                position_ids=positions,
                temperature=temperature,
            )
        width = int(micro.input_ids.shape[1])
        return (
            unpack(values, lengths, width),  # [b, T_b]
            None if entropy is None else unpack(entropy, lengths, width),
        )

    @torch.no_grad()
    def _logprobs_of(self, model: Any, batch: TrainBatch, world: World | None) -> Tensor:
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)  # [B, T]
        for group in self._plan(batch, world):
            micro = batch.select(group).to(self.device) if group else None
            values, _ = self._forward(model, micro)
            if group:
                out[torch.tensor(group), : values.shape[1]] = values.float().cpu()
        return out

    def logprobs(self, batch: TrainBatch, world: World | None = None) -> Tensor:
        """The current policy's logprobs ``[B, T]`` of the batch's tokens (no gradient);
        sharded, every rank calls it with its ``world``."""
        return self._logprobs_of(self.model, batch, world)

    def reference_logprobs(self, batch: TrainBatch, world: World | None = None) -> Tensor:
        """The reference policy's logprobs ``[B, T]`` (no gradient): the base model with the
        LoRA adapter disabled, or the frozen copy under full fine-tuning.

        Raises:
            ValueError: full fine-tuning with ``kl_coef == 0`` (no copy was kept).
        """
        if self.settings.lora_rank > 0:
            with self.model.disable_adapter():
                return self._logprobs_of(self.model, batch, world)
        if self.reference is None:
            raise ValueError(
                "full fine-tuning keeps a reference copy only when kl_coef > 0; got kl_coef 0"
            )
        return self._logprobs_of(self.reference, batch, world)

    def update(self, batch: TrainBatch, world: World | None = None) -> UpdateMetrics:
        """One optimiser step over the whole batch, accumulated over micro-batches.

        Micro-batch losses are weighted so the accumulated gradient equals the full-batch
        aggregation: by token share for ``token_mean``, by row share for the others.
        With ``world`` (data parallel, ``trainer_bridge.distributed``), ``batch`` is this rank's
        shard: shares are taken of the whole batch's tokens and rows (summed over ranks), and
        the gradients are summed over ranks before clipping, so every rank applies the update
        a single process would apply to the whole batch.

        Raises:
            ValueError: the (whole) batch has no token with ``loss_mask == 1``.
        """
        started = time.perf_counter()
        local_tokens = int(batch.loss_mask.sum())
        total_tokens = int(world.sum(local_tokens)) if world else local_tokens
        total_rows = int(world.sum(batch.rows)) if world else batch.rows
        if total_tokens == 0:
            raise ValueError("batch has no sampled token (loss_mask is all 0)")
        old = self.logprobs(batch, world)  # [B, T], before the update
        ref = (
            self.reference_logprobs(batch, world) if self.loss_config.kl_coef > 0 else None
        )  # [B, T]
        mask = batch.loss_mask.bool()
        gap = (old - batch.behaviour_logprobs).abs()[mask]
        self.optimizer.zero_grad(set_to_none=True)
        sums = {"loss": 0.0, "clip": 0.0, "ratio": 0.0, "kl": 0.0, "entropy": 0.0}
        plan = self._plan(batch, world)
        lengths = batch.lengths
        fed = fed_tokens(lengths, plan, packed=self.settings.micro_batch_tokens is not None)
        for group in plan:
            micro = batch.select(group).to(self.device) if group else None
            micro_tokens = 0 if micro is None else int(micro.loss_mask.sum())
            if micro is None or micro_tokens == 0:
                if self.sharded:  # the peers' collectives need this rank's passes too
                    values, _ = self._forward(self.model, None)
                    (values.sum() * 0.0).backward()  # type: ignore[no-untyped-call]
                continue
            share = (
                micro_tokens / total_tokens
                if self.loss_config.aggregation == "token_mean"
                else micro.rows / total_rows
            )
            logprobs, entropy = self._forward(self.model, micro, with_entropy=True)
            index, width = torch.tensor(group), int(micro.input_ids.shape[1])
            out = policy_loss(
                logprobs.float(),
                micro.behaviour_logprobs.float(),
                micro.advantages.float(),
                micro.loss_mask,
                self.loss_config,
                old_logprobs=old[index, :width].to(self.device),
                ref_logprobs=None if ref is None else ref[index, :width].to(self.device),
            )
            (out.loss * share).backward()  # type: ignore[no-untyped-call]
            token_share = micro_tokens / total_tokens
            sums["loss"] += float(out.loss.detach()) * share
            sums["clip"] += out.clip_fraction * token_share
            sums["ratio"] += out.ratio_mean * token_share
            sums["kl"] += out.kl * share
            assert entropy is not None
            sums["entropy"] += float(entropy.detach()[micro.loss_mask.bool()].mean()) * token_share
        gap_sum, gap_max = float(gap.sum()), float(gap.max()) if gap.numel() else 0.0
        real, fed_total = float(sum(lengths)), float(fed)
        if world is not None:
            if not self.sharded:  # sharded: FSDP2 reduce-scattered them in the backward
                world.sum_gradients(self.parameters)
            sums = {key: world.sum(value) for key, value in sums.items()}
            gap_sum, gap_max = world.sum(gap_sum), world.max(gap_max)
            real, fed_total = world.sum(real), world.sum(fed_total)
        grad_norm = full(
            torch.nn.utils.clip_grad_norm_(self.parameters, self.settings.max_grad_norm)
        )
        self.optimizer.step()
        self.steps += 1
        elapsed = max(time.perf_counter() - started, 1e-9)  # finite: the pool refuses inf
        return UpdateMetrics(
            loss=sums["loss"],
            clip_fraction=sums["clip"],
            ratio_mean=sums["ratio"],
            kl=None if ref is None else sums["kl"],
            entropy_mean=sums["entropy"],
            grad_norm=float(grad_norm),
            tokens=total_tokens,
            tokens_per_s=total_tokens / elapsed,
            logprob_gap_mean_abs=gap_sum / total_tokens,
            logprob_gap_max_abs=gap_max,
            step=self.steps,
            padding_fraction=1.0 - real / fed_total if fed_total else 0.0,
        )

    def save_for_vllm(self, directory: Path) -> Path:
        """Write what vLLM loads: a peft adapter (LoRA) or full safetensors; returns the dir.

        Sharded, every rank calls it and rank 0 writes: the adapters gathered whole, or the full
        weights gathered one tensor at a time into safetensors files (``sharding``).
        """
        if not self.sharded:
            directory.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(directory, safe_serialization=True)
            return directory
        rank = dist.get_rank()
        if self.settings.lora_rank == 0:
            return save_full_safetensors(self.model, directory, rank=rank)
        adapters = gather_trainable(self.model)
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(directory, state_dict=adapters, safe_serialization=True)
        return directory
