"""A group of rollouts as the pool API and the inspector show it.

Owns: a group's expected size, status and member count per status (``GET /api/groups/{id}``),
and its members side by side with the advantage a batch algorithm would give each
(``GET /api/groups/{id}/rollouts``). Never: writes, or treats a missing reward as 0 (an
unrewarded member's advantage is None).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import func, select

from datapool.batches.advantages import estimate_advantages
from datapool.db import Sessions
from datapool.models import Trajectory, TrajectoryGroup
from datapool.queries.listing import describe, last_answers


@dataclass(frozen=True)
class GroupCounts:
    """A group and how many of its member trajectories are in each status."""

    group: TrajectoryGroup
    members: dict[str, int]


def group_with_counts(sessions: Sessions, group_id: str) -> GroupCounts | None:
    """The group with its member count per status; None for an unknown group."""
    with sessions() as session:
        group = session.get(TrajectoryGroup, group_id)
        if group is None:
            return None
        members = {
            status: n
            for status, n in session.execute(
                select(Trajectory.status, func.count())
                .where(Trajectory.group_id == group_id)
                .group_by(Trajectory.status)
            )
        }
    return GroupCounts(group, members)


def group_rollouts(
    sessions: Sessions, group_id: str, reward_name: str, algorithm: str
) -> list[dict[str, Any]] | None:
    """The group's members, oldest first, as inspector list rows (``listing.describe``) plus
    ``advantage`` (what ``algorithm`` gives the member's current ``reward_name`` within this
    group; None when unrewarded or when the algorithm leaves it to the trainer) and ``answer``
    (the response message of its last step, choice 0; ``{}`` without one). None when no
    trajectory names the group.

    Raises:
        InvalidPoolRequestError: ``algorithm`` is not one of ``datapool.batches`` algorithms.
    """
    with sessions() as session:
        trajectories = list(
            session.scalars(
                select(Trajectory)
                .where(Trajectory.group_id == group_id)
                .order_by(Trajectory.created_at, Trajectory.id)
            )
        )
        if not trajectories:
            return None
        rows = describe(session, trajectories)
        answers = last_answers(session, [t.id for t in trajectories])
    values = [r["rewards"].get(reward_name, math.nan) for r in rows]
    advantages = estimate_advantages(
        algorithm,
        np.array(values, dtype=np.float64),  # [G]
        np.zeros(len(values), dtype=np.int64),  # [G] one group
    ).tolist()
    for row, advantage in zip(rows, advantages, strict=True):
        row["advantage"] = None if math.isnan(advantage) else advantage
        row["answer"] = answers.get(row["id"], {})
    return rows
