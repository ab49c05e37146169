"""The trainer's settings: ``TrainerSettings`` (the RL update) and ``DistributedSettings`` (the
ranks under ``torchrun``), both ``TRAJGATE_TRAINER_*`` variables or ``[trainer]`` in the
``TRAJGATE_CONFIG`` file (docs/deployment.md, Settings).

Owns: the names, defaults, bounds and help of every trainer setting. Never: imports torch,
transformers or peft, so a host without the ``[train]`` extra (a gateway) can check a config
file's ``[trainer]`` keys (``trajgate.config.SETTINGS_CLASSES`` names both classes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from trajgate.config import ConfigFileSettings

# How per-token losses are averaged; each variant's normaliser and source: trainer_bridge/losses.py
Aggregation = Literal["token_mean", "seq_mean", "seq_sum_token_mean"]
# How the ranks under torchrun hold the model: trainer_bridge/sharding.py
Sharding = Literal["replicated", "fsdp2"]


class TrainerSettings(ConfigFileSettings):
    """How the policy is trained (``TRAJGATE_TRAINER_*`` variables)."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_TRAINER_", extra="ignore")
    config_section = "trainer"

    model_dir: Path = Field(
        description="Hugging Face model directory of the policy's base weights."
    )
    lora_rank: int = Field(
        default=8,
        ge=0,
        description="LoRA rank; 0 trains every weight (full fine-tuning, pushed with a reload).",
    )
    lora_alpha: int = Field(default=16, gt=0, description="LoRA scaling numerator.")
    lora_target_modules: list[str] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Modules that get LoRA adapters (vLLM supports these for Qwen2).",
    )
    learning_rate: float = Field(default=1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    micro_batch_rows: int = Field(
        default=8, ge=1, description="Rows per forward/backward; gradients accumulate over them."
    )
    micro_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Pack rows end to end into forward passes of at most this many tokens (no "
        "padding; attention kept within each row); unset: padded micro-batches of "
        "micro_batch_rows rows. A longer row gets a pass of its own.",
    )
    sharding: Sharding = Field(
        default="replicated",
        description="'replicated': every rank holds the whole model, gradients all-reduced once "
        "per update (cheap for LoRA); 'fsdp2': parameters, gradients and AdamW state sharded "
        "over the ranks with FSDP2 (full fine-tuning of models that do not fit one GPU; under "
        "torchrun only).",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Recompute each decoder layer's activations in the backward pass: less "
        "memory for long rows, about one more forward pass of compute.",
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    clip_low: float = Field(default=0.2, ge=0, description="PPO clip below 1.")
    clip_high: float = Field(default=0.28, ge=0, description="PPO clip above 1 (clip-higher).")
    tis_cap: float | None = Field(default=2.0, description="Truncated importance weight cap.")
    aggregation: Aggregation = Field(default="token_mean", description="Loss aggregation.")
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the k3 KL penalty to the starting policy (0: none). LoRA: the "
        "reference is the model with the adapter off (one more forward pass per update); full "
        "fine-tuning: a frozen copy of the weights (4 bytes more per parameter).",
    )
    seed: int = Field(default=0, description="Seed of LoRA initialisation.")
    device: str = Field(
        default="auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="'auto' (CUDA if present), 'cpu', 'cuda' or 'cuda:<index>'.",
    )


class DistributedSettings(ConfigFileSettings):
    """Where the pool is and how the ranks run (``TRAJGATE_TRAINER_*`` variables)."""

    model_config = SettingsConfigDict(env_prefix="TRAJGATE_TRAINER_", extra="ignore")
    config_section = "trainer"

    pool_url: str = Field(
        default="http://127.0.0.1:8000",
        description="Base URL of a gateway (or the load balancer) whose /api the ranks use.",
    )
    consumer: str = Field(
        default="trainer", description="Consumer id of the leases: one per training run."
    )
    lease_s: float = Field(
        default=600.0,
        gt=0,
        description="Lease length; renewed every third of it while the trainer works (however "
        "long an update takes), so it bounds how long a crashed trainer keeps its batches.",
    )
    max_updates: int | None = Field(
        default=None, ge=1, description="Stop after this many updates; unset: run until idle."
    )
    idle_wait_s: float = Field(
        default=5.0, gt=0, description="Seconds to wait before asking again when no batch waits."
    )
    idle_exit_s: float | None = Field(
        default=None, gt=0, description="Stop after this long without a batch; unset: never."
    )
    pad_token_id: int = Field(default=0, ge=0, description="Token id used for right padding.")
    weights_dir: Path = Field(
        default=Path(".trajgate/weights"),
        description="Where rank 0 saves each update's weights (a directory vLLM can read).",
    )
    vllm_urls: str = Field(
        default="",
        description="torchrun's trainer: set (the vLLM base URLs, comma-separated), each update "
        "is published through gateway_url, which loads it into the replicas it routes to; empty: "
        "saved only. Not contacted directly.",
    )
    adapter_prefix: str = Field(
        default="policy",
        min_length=1,
        description="LoRA: the gateway loads each version as the adapter <prefix>-v<version>.",
    )
    gateway_url: str | None = Field(
        default=None,
        description="Gateway whose policy registry gets each new version; default pool_url.",
    )
    admin_token: str | None = Field(
        default=None,
        description="The gateways' TRAJGATE_ADMIN_TOKEN (pool API and policy registration).",
    )
    first_version: int = Field(
        default=1, ge=1, description="Policy version of the first published update."
    )
    publish_attempts: int = Field(
        default=3,
        ge=1,
        description="Tries of one publish (vLLM, then the gateway) before its batch is given "
        "back (nack) and the trainer stops; a batch is acked only once its update is published.",
    )
    publish_retry_s: float = Field(
        default=5.0,
        ge=0,
        description="Seconds before the second publish try, doubled before each later one.",
    )
    checkpoint_dir: Path | None = Field(
        default=None,
        description="Where the ranks save model and optimizer state (sharded, "
        "torch.distributed.checkpoint) and resume from after a crash; unset: no checkpoints.",
    )
    checkpoint_every_updates: int = Field(
        default=1,
        ge=1,
        description="Checkpoint every N updates. Leases are acknowledged only once a checkpoint "
        "holds their update (renewed until then); a crash retrains at most N.",
    )
