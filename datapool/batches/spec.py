"""What a batch is made of: ``BatchSpec``, validated before anything is read.

Owns: the spec's fields, their defaults and bounds, and the refusal of impossible combinations
(with the fix). Never: reads the pool; the algorithms it names are ``ESTIMATORS`` in
``datapool.batches.advantages``.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from datapool.batches.advantages import Algorithm
from datapool.curation.selection import TrajectoryFilter

Layout = Literal["per_step", "merged"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
RewardToSteps = Literal["final_step", "broadcast", "discounted"]
REWARD_TO_STEPS: tuple[RewardToSteps, ...] = get_args(RewardToSteps)
ShortGroups = Literal["drop", "keep"]


class BatchSpec(BaseModel):
    """What a batch is made of; stored with the batch and in its manifest."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, max_length=200)
    channel: str = "train"
    filters: TrajectoryFilter = Field(default_factory=TrajectoryFilter)
    algorithm: Algorithm = "grpo"
    layout: Layout = "per_step"
    group_size: int | None = Field(
        default=None, ge=1, description="Members per group (the oldest ready ones are taken)."
    )
    short_groups: ShortGroups = Field(
        default="drop", description="A group with fewer ready members than group_size."
    )
    drop_degenerate_groups: bool = Field(
        default=True, description="grpo/rloo: drop groups whose reward std < degenerate_eps."
    )
    degenerate_eps: float = Field(default=1e-6, ge=0)
    success_reward: float = Field(default=1.0, description="all-success: every reward >= this.")
    fail_reward: float = Field(default=0.0, description="all-fail: every reward <= this.")
    reward_names: list[str] = Field(default_factory=lambda: ["final"])
    reward_weights: dict[str, float] = Field(default_factory=dict)
    reward_to_steps: RewardToSteps = "broadcast"
    gamma: float = Field(default=1.0, ge=0, le=1)
    scale_by_std: bool = True
    advantage_eps: float = Field(default=1e-6, gt=0)
    max_tokens_per_row: int | None = Field(default=None, ge=1)
    max_tokens_per_batch: int | None = Field(default=None, ge=1)
    max_staleness_versions: int | None = Field(default=None, ge=0)
    current_policy_version: int | None = Field(
        default=None, description="Staleness reference; default the active policy version."
    )
    shuffle_seed: int | None = None
    exclude_batched: bool = Field(
        default=True, description="Skip trajectories already in a batch (not failed)."
    )
    apply_rules: bool = Field(default=True, description="Re-apply curation rules first.")

    @model_validator(mode="after")
    def _combinations(self) -> BatchSpec:
        if self.layout == "merged" and self.reward_to_steps != "broadcast":
            raise ValueError(
                f"layout 'merged' packs several steps into a row with one advantage, so "
                f"reward_to_steps must be 'broadcast', got {self.reward_to_steps!r}; use layout "
                "'per_step' for final_step or discounted"
            )
        if self.algorithm != "sft" and not self.reward_names:
            raise ValueError(
                f"algorithm {self.algorithm!r} needs at least one reward name in reward_names"
            )
        unknown = set(self.reward_weights) - set(self.reward_names)
        if unknown:
            raise ValueError(f"reward_weights names {sorted(unknown)} not in reward_names")
        return self

    def resolved_reward_weights(self) -> dict[str, float]:
        """``{reward name: weight}`` of ``R = sum_i w_i r_i`` (a weight defaults to 1)."""
        return {name: self.reward_weights.get(name, 1.0) for name in self.reward_names}
