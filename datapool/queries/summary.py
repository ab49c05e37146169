"""Whole-pool counts for dashboards (``GET /api/summary``).

Owns: trajectories per status and per channel, steps per outcome, how many trajectories have a
reward, refused calls, the ``empty``/``incomplete`` integrity flags, and token payloads not yet
compacted into Parquet. Never: samples; every number is an exact count (each one scans its table
or an index).

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select

from datapool.curation.selection import json_contains
from datapool.models import EMPTY, INCOMPLETE, Reward, Step, Trajectory
from datapool.steps.store import PoolStore


@dataclass(frozen=True)
class PoolCounts:
    trajectories_by_status: dict[str, int]
    trajectories_by_channel: dict[str, int]
    steps_by_outcome: dict[str, int]
    rewarded_trajectories: int  # with at least one reward record that is not an error
    rejected_calls: int  # calls refused with 409 after their trajectory closed
    empty_trajectories: int  # closed with no step (case C15)
    incomplete_trajectories: int  # open in a writer process that died (case C14)
    payloads_pending_compaction: int  # steps whose token payload is still an SQL row


def pool_counts(store: PoolStore) -> PoolCounts:
    """Every count of ``PoolCounts`` (those of the SQL tables read in one session)."""
    with store.sessions() as session:
        by_status = {
            status: n
            for status, n in session.execute(
                select(Trajectory.status, func.count()).group_by(Trajectory.status)
            )
        }
        by_channel = {
            channel: n
            for channel, n in session.execute(
                select(Trajectory.channel, func.count()).group_by(Trajectory.channel)
            )
        }
        by_outcome = {
            outcome: n
            for outcome, n in session.execute(
                select(Step.outcome, func.count()).group_by(Step.outcome)
            )
        }
        rewarded = session.scalar(
            select(func.count(func.distinct(Reward.trajectory_id))).where(Reward.error.is_(None))
        )
        rejected = session.scalar(select(func.coalesce(func.sum(Trajectory.rejected_calls), 0)))
        empty = session.scalar(select(func.count()).where(json_contains(Trajectory.flags, EMPTY)))
        incomplete = session.scalar(
            select(func.count()).where(json_contains(Trajectory.flags, INCOMPLETE))
        )
    return PoolCounts(
        trajectories_by_status=by_status,
        trajectories_by_channel=by_channel,
        steps_by_outcome=by_outcome,
        rewarded_trajectories=int(rewarded or 0),
        rejected_calls=int(rejected or 0),
        empty_trajectories=int(empty or 0),
        incomplete_trajectories=int(incomplete or 0),
        payloads_pending_compaction=store.payloads.pending_steps(),
    )
