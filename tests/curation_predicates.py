"""Curation predicates the rule tests declare by module path (``curation_predicates:...``)."""

from __future__ import annotations

from datapool.rewards.values import RewardContext


def long_trajectory(context: RewardContext) -> str | None:
    """Matches trajectories of two steps or more, with the reason."""
    return f"{len(context.steps)} steps" if len(context.steps) >= 2 else None


def breaks_on_unlabelled(context: RewardContext) -> bool:
    """Raises ``KeyError`` on a trajectory whose metadata has no ``label`` (a predicate bug)."""
    return bool(context.metadata["label"] == "bad")


def takes_no_context() -> bool:
    """Cannot be called as ``fn(context)``: refused when a rule names it."""
    return True
