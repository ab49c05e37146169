"""Reward records as stored: the append-only history, failed reward functions included.

Owns: the SQL of ``GET /api/rewards`` and the names of trajectory rewards present in the pool
(``reward_names``, what the inspector's charts and readiness choose from). Never: folds the
history into current values (that is ``datapool.rewards.values.current_rewards``: the latest
record without an error per name).
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

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


MAX_REWARD_NAMES = 100


def reward_names(session: Session) -> list[str]:
    """Names of trajectory rewards in the pool (at most 100): the one recorded last first,
    then the rest by name. One index seek per name (``ix_rewards_kind_name_target``), so it
    costs the same on a pool of millions of rewards."""
    kind = Reward.target_kind == "trajectory"
    last = session.scalar(select(Reward.name).where(kind).order_by(Reward.id.desc()).limit(1))
    if last is None:
        return []
    names: list[str] = []
    name: str | None = ""
    while len(names) < MAX_REWARD_NAMES:
        name = session.scalar(select(func.min(Reward.name)).where(kind, Reward.name > name))
        if name is None:
            break
        names.append(name)
    return [last, *(n for n in names if n != last)]
