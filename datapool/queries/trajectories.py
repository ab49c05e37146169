"""Trajectories as the pool API lists and shows them: filtered keyset pages and one trajectory
with its steps.

Owns: the SQL of ``GET /api/trajectories`` (the shared filter conditions of
``datapool.curation.selection``, a current-reward filter, newest first, paged after the last
row's ``(created_at, id)`` so inserts never shift a page) and of ``GET /api/trajectories/{id}``.
Never: encodes cursors (the API turns the last row into an opaque cursor) or reads token payloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import and_, or_, select

from datapool.curation.selection import trajectory_conditions
from datapool.db import Sessions
from datapool.models import Step, Trajectory
from datapool.rewards.values import current_rewards, current_rewards_query


@dataclass(frozen=True)
class RewardedTrajectory:
    """A trajectory and its current value per reward name (a name absent is unrewarded)."""

    trajectory: Trajectory
    rewards: dict[str, float]


@dataclass(frozen=True)
class TrajectoryWithSteps(RewardedTrajectory):
    """...and its steps in ``(step_index, choice_index)`` order, without token payloads."""

    steps: list[Step]


def trajectory_page(
    sessions: Sessions,
    *,
    status: Sequence[str] | None = None,
    channel: str | None = None,
    group_id: str | None = None,
    tags: Sequence[str] = (),
    flags: Sequence[str] = (),
    reward_name: str = "final",
    reward_min: float | None = None,
    reward_max: float | None = None,
    rewarded: bool | None = None,
    policy_version: int | None = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    q: str | None = None,
    after: tuple[datetime, str] | None = None,
    limit: int = 50,
) -> tuple[list[RewardedTrajectory], bool]:
    """``(page, more)``: at most ``limit`` trajectories matching every given filter, newest
    first (ties by id, descending), after ``after`` = the previous page's last
    ``(created_at, id)``; ``more`` says whether another page follows.

    ``rewarded=False`` keeps trajectories without a current ``reward_name`` (then
    ``reward_min``/``reward_max`` are ignored); ``rewarded=True`` or a bound keeps rewarded ones
    whose value lies in ``[reward_min, reward_max]``.
    """
    query = select(Trajectory).where(
        *trajectory_conditions(
            status=status,
            channel=channel,
            group_ids=None if group_id is None else [group_id],
            tags=tags,
            flags=flags,
            policy_version=policy_version,
            created_after=created_after,
            created_before=created_before,
            q=q,
        )
    )
    if reward_min is not None or reward_max is not None or rewarded is not None:
        current = current_rewards_query("trajectory", reward_name)
        if rewarded is False:
            query = query.where(~Trajectory.id.in_(select(current.c.target_id)))
        else:
            query = query.join(current, current.c.target_id == Trajectory.id)
            if reward_min is not None:
                query = query.where(current.c.value >= reward_min)
            if reward_max is not None:
                query = query.where(current.c.value <= reward_max)
    if after is not None:
        at, last_id = after
        query = query.where(
            or_(
                Trajectory.created_at < at,
                and_(Trajectory.created_at == at, Trajectory.id < last_id),
            )
        )
    query = query.order_by(Trajectory.created_at.desc(), Trajectory.id.desc()).limit(limit + 1)
    with sessions() as session:
        rows = list(session.scalars(query))
        page = rows[:limit]
        rewards = current_rewards(session, "trajectory", [t.id for t in page])
    return [RewardedTrajectory(t, rewards.get(t.id, {})) for t in page], len(rows) > limit


def trajectory_with_steps(sessions: Sessions, trajectory_id: str) -> TrajectoryWithSteps | None:
    """The trajectory, its current rewards and its steps; None for an unknown id."""
    with sessions() as session:
        trajectory = session.get(Trajectory, trajectory_id)
        if trajectory is None:
            return None
        steps = list(
            session.scalars(
                select(Step)
                .where(Step.trajectory_id == trajectory_id)
                .order_by(Step.step_index, Step.choice_index)
            )
        )
        rewards = current_rewards(session, "trajectory", [trajectory_id])
    return TrajectoryWithSteps(trajectory, rewards.get(trajectory_id, {}), steps)
