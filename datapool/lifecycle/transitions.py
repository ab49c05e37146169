"""Trajectory and group lifecycle: open → complete / abandoned / failed, and what a crash leaves.

Owns: the status transitions (explicit, or by idle timeout), the ``empty`` flag (closed with no
step: case C15; the ``incomplete`` flag of a crashed writer is ``datapool.steps.crashes``'), group
completion (all ``expected_size`` members closed), marking a newly complete trajectory's
completion hooks due (``hooks_due_at``, run by ``datapool.lifecycle.hooks``), and the staleness
query (steps more than K policy versions old). Never: deletes steps; a closed trajectory keeps
everything it had, and a late call is refused and counted (``TrajectoryClosedError``), never
stored. Never runs the hooks itself (they may be slow; the closing transaction must not wait).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from datapool.db import insert_ignore
from datapool.errors import (
    InvalidPoolRequestError,
    TrajectoryClosedError,
    TrajectoryExistsError,
    UnknownTargetError,
)
from datapool.models import (
    EMPTY,
    Reward,
    RewardSource,
    Step,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
    utc_now,
)
from datapool.rewards.values import RewardIn, check_reward

CLOSED_STATUSES = (
    TrajectoryStatus.COMPLETE.value,
    TrajectoryStatus.ABANDONED.value,
    TrajectoryStatus.FAILED.value,
)


def create_trajectory(
    sessions: sessionmaker[Session],
    trajectory_id: str,
    *,
    group_id: str | None = None,
    channel: str = "train",
    tags: list[str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Trajectory:
    """Register a trajectory before its first call (or one whose calls bypass capture).

    Raises ``TrajectoryExistsError`` when the id exists already (its first call, or an earlier
    registration, created it).
    """
    with sessions.begin() as session:
        # Insert-or-ignore: concurrent creations of a group's members race on the group row.
        if group_id is not None:
            _ensure_group(session, group_id)
        inserted = insert_ignore(
            session,
            Trajectory,
            [
                {
                    "id": trajectory_id,
                    "group_id": group_id,
                    "channel": channel,
                    "status": TrajectoryStatus.OPEN.value,
                    "metadata_json": metadata or {},
                    "tags": list(tags or []),
                    "flags": [],
                    "call_count": 0,
                    "rejected_calls": 0,
                    "created_at": utc_now(),
                }
            ],
        )
        if not inserted:
            raise TrajectoryExistsError(f"trajectory {trajectory_id!r} exists already", param="id")
        trajectory = session.get(Trajectory, trajectory_id)
        assert trajectory is not None
        if group_id is not None:
            update_group(session, group_id)  # a new open member reopens a complete group
    return trajectory


def ensure_trajectory(
    sessions: sessionmaker[Session],
    trajectory_id: str,
    group_id: str | None = None,
    channel: str = "train",
) -> Trajectory:
    """The trajectory ``trajectory_id``, created open in ``channel`` (and ``group_id``) when it
    does not exist yet, as the pool writer creates it for a first call (insert-or-ignore).

    Concurrent first calls of a new trajectory settle its channel through this before any of
    them goes upstream: the first insert wins and every call reads the one stored channel,
    whose settings it then gets (each calling ``get`` first would let each record under the
    channel it named). Idempotent: an existing trajectory is returned unchanged, whatever its
    status.
    """
    with sessions.begin() as session:
        if group_id is not None:
            _ensure_group(session, group_id)
        inserted = insert_ignore(
            session,
            Trajectory,
            [
                {
                    "id": trajectory_id,
                    "group_id": group_id,
                    "channel": channel,
                    "status": TrajectoryStatus.OPEN.value,
                    "metadata_json": {},
                    "tags": [],
                    "flags": [],
                    "call_count": 0,
                    "rejected_calls": 0,
                    "created_at": utc_now(),
                }
            ],
        )
        trajectory = session.get(Trajectory, trajectory_id)
        assert trajectory is not None
        if inserted and group_id is not None:
            update_group(session, group_id)  # a new open member reopens a complete group
    return trajectory


def _ensure_group(session: Session, group_id: str) -> None:
    insert_ignore(
        session,
        TrajectoryGroup,
        [{"id": group_id, "status": "open", "created_at": utc_now(), "expected_size": None}],
    )


def close_trajectory(
    sessions: sessionmaker[Session],
    trajectory_id: str,
    status: TrajectoryStatus,
    *,
    reason: str = "explicit",
    final_reward: float | None = None,
    reward_name: str = "final",
    author: str | None = None,
) -> Trajectory:
    """Move an open trajectory to ``status`` (complete, abandoned or failed).

    ``final_reward`` (complete only) is appended as reward ``reward_name`` (source 'agent'),
    checked like every reward (``rewards.check_reward``: a finite number, a 1-100 character
    name) before anything is written, so an invalid one leaves the trajectory open.
    Idempotent for the same status without a reward; raises ``TrajectoryClosedError`` (409) for
    a closed trajectory otherwise (another status, or a final reward after the fact: post it
    to /api/rewards), ``InvalidPoolRequestError`` for an invalid reward, and
    ``UnknownTargetError`` for an unknown id.
    """
    if status.value not in CLOSED_STATUSES:
        raise InvalidPoolRequestError(
            f"a trajectory closes as one of {CLOSED_STATUSES}, got {status.value!r}"
        )
    if final_reward is not None and status != TrajectoryStatus.COMPLETE:
        raise InvalidPoolRequestError("only 'complete' takes a final reward", param="reward")
    final = None
    if final_reward is not None:
        final = RewardIn(
            "trajectory", trajectory_id, reward_name, final_reward, RewardSource.AGENT.value, author
        )
        try:
            check_reward(final, "final reward: ")
        except InvalidPoolRequestError as exc:  # the API's field names: reward, reward_name
            param = {"value": "reward", "name": "reward_name"}.get(exc.param or "", exc.param)
            raise InvalidPoolRequestError(str(exc), param=param) from exc
    with sessions.begin() as session:
        query = select(Trajectory).where(Trajectory.id == trajectory_id)
        if session.get_bind().dialect.name == "postgresql":
            query = query.with_for_update()
        trajectory = session.scalar(query)
        if trajectory is None:
            raise UnknownTargetError(f"no trajectory {trajectory_id!r}", param="trajectory_id")
        if trajectory.status != TrajectoryStatus.OPEN:
            if trajectory.status == status.value and final_reward is None:
                return trajectory
            # 409 like a late call: the trajectory's state, not the request, is what conflicts.
            what = "the final reward" if final_reward is not None else f"marking it {status.value}"
            raise TrajectoryClosedError(trajectory_id, trajectory.status, refused=what)
        _close(session, trajectory, status, reason)
        if final is not None:
            session.add(
                Reward(
                    target_kind="trajectory",
                    target_id=trajectory_id,
                    trajectory_id=trajectory_id,
                    name=final.name,
                    value=float(final_reward),  # type: ignore[arg-type]
                    source=final.source,
                    author=author,
                    created_at=utc_now(),
                )
            )
    return trajectory


def _close(session: Session, trajectory: Trajectory, status: TrajectoryStatus, reason: str) -> None:
    trajectory.status = status.value
    trajectory.completed_at = utc_now()
    trajectory.completion_reason = reason
    trajectory.writer_id = None
    if status == TrajectoryStatus.COMPLETE:
        # In the closing transaction, so no completion (explicit or idle) can miss its hooks.
        trajectory.hooks_due_at = trajectory.completed_at
    has_steps = session.scalar(
        select(func.count()).select_from(Step).where(Step.trajectory_id == trajectory.id)
    )
    if not has_steps and EMPTY not in trajectory.flags:
        trajectory.flags = [*trajectory.flags, EMPTY]
    session.flush()
    if trajectory.group_id is not None:
        update_group(session, trajectory.group_id)


def update_group(session: Session, group_id: str) -> None:
    """Recompute the group's status: ``complete`` while it has ``expected_size`` closed members
    and none open, else ``open`` (a complete group reopens, ``completed_at`` cleared, when a
    member joins or its expected size changes). Called when a member closes or joins (the
    writer reopens groups itself, ``PoolStore``) and on ``set_group``."""
    # Locked on PostgreSQL, so a member joining concurrently (the writer locks the group row
    # too) is either counted here or reopens the group after this commits.
    locking = session.get_bind().dialect.name == "postgresql"
    group = session.get(TrajectoryGroup, group_id, with_for_update=locking)
    if group is None:
        return
    complete = False
    if group.expected_size is not None:
        counts = dict(
            (status, n)
            for status, n in session.execute(
                select(Trajectory.status, func.count())
                .where(Trajectory.group_id == group_id)
                .group_by(Trajectory.status)
            )
        )
        closed = sum(counts.get(status, 0) for status in CLOSED_STATUSES)
        complete = closed >= group.expected_size and not counts.get(TrajectoryStatus.OPEN.value)
    if complete and group.status != "complete":
        group.status = "complete"
        group.completed_at = utc_now()
    elif not complete and group.status == "complete":
        group.status = "open"
        group.completed_at = None


def set_group(
    sessions: sessionmaker[Session],
    group_id: str,
    expected_size: int | None,
    *,
    update_size: bool = True,
) -> TrajectoryGroup:
    """Create a group if missing and set its expected size (``None``: no size), then re-check
    whether it is complete. With ``update_size=False`` the size is left as it is (a new group's
    is ``None``) and ``expected_size`` is ignored. Raises ``InvalidPoolRequestError`` for a size
    below 1."""
    if expected_size is not None and expected_size < 1:
        raise InvalidPoolRequestError(
            f"expected_size must be >= 1, got {expected_size}", param="expected_size"
        )
    with sessions.begin() as session:
        _ensure_group(session, group_id)
        group = session.get(TrajectoryGroup, group_id)
        assert group is not None
        if update_size:
            group.expected_size = expected_size
        session.flush()
        update_group(session, group_id)
    return group


def close_idle(
    sessions: sessionmaker[Session], idle_s: float, *, in_flight: Collection[str] = ()
) -> list[str]:
    """Complete open trajectories whose last step (or creation) is older than ``idle_s``,
    except those in ``in_flight`` (a call has started and not committed yet: its step would be
    refused with 409 however long the engine took). Returns the ids completed.

    Only the caller's own calls can be passed: with several gateways, another gateway's call in
    flight is not seen, so ``idle_s`` must stay far above the longest call.
    """
    cutoff = utc_now() - timedelta(seconds=idle_s)
    with sessions.begin() as session:
        idle = [
            trajectory
            for trajectory in session.scalars(
                select(Trajectory).where(
                    Trajectory.status == TrajectoryStatus.OPEN.value,
                    func.coalesce(Trajectory.last_step_at, Trajectory.created_at) < cutoff,
                )
            )
            if trajectory.id not in in_flight
        ]
        for trajectory in idle:
            _close(session, trajectory, TrajectoryStatus.COMPLETE, "idle_timeout")
        return [t.id for t in idle]


def stale_steps(
    sessions: sessionmaker[Session],
    current_version: int,
    max_versions_behind: int,
    *,
    limit: int | None = None,
    after: tuple[int, str] | None = None,
) -> list[tuple[str, int | None]]:
    """``(step_id, policy_version)`` of steps more than ``max_versions_behind`` versions older
    than ``current_version`` (e.g. current 7, K 2: versions <= 4), oldest version first.

    Pages by keyset: at most ``limit`` rows after ``after`` = ``(policy_version, step_id)`` of
    the previous page's last row.
    """
    query = (
        select(Step.id, Step.policy_version)
        .where(Step.policy_version < current_version - max_versions_behind)
        .order_by(Step.policy_version, Step.id)
    )
    if after is not None:
        version, step_id = after
        query = query.where(
            or_(
                Step.policy_version > version,
                and_(Step.policy_version == version, Step.id > step_id),
            )
        )
    if limit is not None:
        query = query.limit(limit)
    with sessions() as session:
        return [(step_id, version) for step_id, version in session.execute(query)]
