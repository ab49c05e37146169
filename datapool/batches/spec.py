"""What a batch is made of: ``BatchSpec``, validated before anything is read.

Owns: the spec's fields, their defaults and bounds, and the refusal of impossible combinations
(with the fix). Never: reads the pool; the algorithms it names are ``ESTIMATORS`` in
``datapool.batches.advantages``.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from datapool.batches.advantages import Algorithm
from datapool.batches.step_advantages import StepAlgorithm, StepNormalisation, step_estimator
from datapool.curation.selection import TrajectoryFilter
from datapool.models import INTEGER_MAX

Layout = Literal["per_step", "merged"]
LAYOUTS: tuple[Layout, ...] = get_args(Layout)
RewardToSteps = Literal["final_step", "broadcast", "discounted"]
REWARD_TO_STEPS: tuple[RewardToSteps, ...] = get_args(RewardToSteps)
ShortGroups = Literal["drop", "keep"]
AnchorKey = Literal["prompt_after_task_prefix", "last_observation"]
ANCHOR_KEYS: tuple[AnchorKey, ...] = get_args(AnchorKey)


class BatchSpec(BaseModel):
    """What a batch is made of; stored with the batch and in its manifest. Strict: a value of
    another JSON type is refused (``"4"`` is no ``group_size``, ``1`` no ``scale_by_std``), as
    for every other body of the pool API (``gateway.api.bodies.StrictBody``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str | None = Field(default=None, max_length=200)
    channel: str = "train"
    filters: TrajectoryFilter = Field(default_factory=TrajectoryFilter)
    algorithm: Algorithm = "grpo"
    layout: Layout = "per_step"
    group_size: int | None = Field(
        default=None,
        ge=1,
        le=INTEGER_MAX,
        description="Members per group (the oldest ready ones are taken).",
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
    step_reward_names: list[str] = Field(
        default_factory=list,
        description="Required step rewards; a step's r = sum_j w_j r_j (weights default 1).",
    )
    step_reward_weights: dict[str, float] = Field(default_factory=dict)
    step_advantage: StepAlgorithm = Field(
        default="none", description="Step-level estimator (STEP_ESTIMATORS) added to A^E."
    )
    step_normalisation: StepNormalisation = Field(
        default="none", description="step_returns: none, group (DeepSeekMath) or leave_one_out."
    )
    episode_advantage_weight: float = Field(
        default=1.0, description="Weight of the algorithm's episode-level advantage (0: alone)."
    )
    step_advantage_weight: float = Field(
        default=1.0, description="Weight (omega) of the step-level advantage."
    )
    anchor_key: AnchorKey = Field(
        default="prompt_after_task_prefix",
        description="anchor_state: what makes two steps' states identical.",
    )
    max_tokens_per_row: int | None = Field(default=None, ge=1, le=INTEGER_MAX)
    max_tokens_per_batch: int | None = Field(default=None, ge=1, le=INTEGER_MAX)
    max_staleness_versions: int | None = Field(default=None, ge=0, le=INTEGER_MAX)
    current_policy_version: int | None = Field(
        default=None,
        ge=0,
        le=INTEGER_MAX,
        description="Staleness reference; default the active policy version.",
    )
    shuffle_seed: int | None = Field(default=None, ge=0, le=INTEGER_MAX)
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
        unknown = set(self.step_reward_weights) - set(self.step_reward_names)
        if unknown:
            raise ValueError(
                f"step_reward_weights names {sorted(unknown)} not in step_reward_names"
            )
        if self.step_reward_names or self.step_advantage != "none":
            self._check_step_credit()
        return self

    def _check_step_credit(self) -> None:
        """Step rewards and step-level advantages give each step its own numbers."""
        if self.layout != "per_step":
            raise ValueError(
                "step rewards and step_advantage give each step its own numbers, so layout "
                f"must be 'per_step', got {self.layout!r}"
            )
        if self.step_advantage == "none":
            return
        if self.reward_to_steps != "broadcast":
            raise ValueError(
                f"step_advantage {self.step_advantage!r} adds a step-level advantage to the "
                "episode-level one broadcast to every step, so reward_to_steps must be "
                f"'broadcast', got {self.reward_to_steps!r}"
            )
        if self.algorithm == "sft":
            raise ValueError(
                f"step_advantage {self.step_advantage!r} needs rewards; algorithm 'sft' uses "
                "none (choose grpo, rloo or reinforce_pp)"
            )
        if step_estimator(self.step_advantage).needs_step_rewards and not self.step_reward_names:
            raise ValueError(
                f"step_advantage {self.step_advantage!r} needs at least one step reward name in "
                "step_reward_names"
            )

    def resolved_step_reward_weights(self) -> dict[str, float]:
        """``{step reward name: weight}`` of ``r = sum_j w_j r_j`` (a weight defaults to 1)."""
        return {n: self.step_reward_weights.get(n, 1.0) for n in self.step_reward_names}

    def resolved_reward_weights(self) -> dict[str, float]:
        """``{reward name: weight}`` of ``R = sum_i w_i r_i`` (a weight defaults to 1)."""
        return {name: self.reward_weights.get(name, 1.0) for name in self.reward_names}
