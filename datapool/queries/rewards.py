"""Reward records as stored: the append-only history, failed reward functions included.

Owns: the SQL of ``GET /api/rewards``. Never: folds the history into current values (that is
``datapool.rewards.values.current_rewards``: the latest record without an error per name).
"""

from __future__ import annotations

from sqlalchemy import select

from datapool.db import Sessions
from datapool.models import Reward


def reward_history(
    sessions: Sessions, *, trajectory_id: str | None, target_id: str | None, limit: int
) -> list[Reward]:
    """At most ``limit`` records, oldest first, of a trajectory (itself and its steps) and/or
    of one target (a step or trajectory id); a filter that is None is not applied."""
    query = select(Reward).order_by(Reward.id).limit(limit)
    if trajectory_id is not None:
        query = query.where(Reward.trajectory_id == trajectory_id)
    if target_id is not None:
        query = query.where(Reward.target_id == target_id)
    with sessions() as session:
        return list(session.scalars(query))
