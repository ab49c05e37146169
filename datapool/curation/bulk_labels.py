"""Bulk labels: one label appended to everything a trajectory filter selects.

Owns: turning a ``TrajectoryFilter`` and a label template into label records on the matching
trajectories, their steps, or their groups. Never: updates or deletes a label (records are
appended through ``datapool.curation.labels.add_labels``).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from datapool.curation.labels import LABEL_TARGETS, LabelIn, add_labels, check_label, label_fields
from datapool.curation.selection import TrajectoryFilter, select_trajectory_ids
from datapool.db import chunks
from datapool.errors import InvalidPoolRequestError
from datapool.models import Step, Trajectory


def bulk_label(
    sessions: sessionmaker[Session], where: TrajectoryFilter, template: LabelIn
) -> list[int]:
    """Append ``template`` (its ``target_id`` ignored) to everything ``where`` matches.

    ``template.target_kind`` picks what gets the label: the matching trajectories, every step of
    them, or their distinct groups. Returns the appended record ids.
    """
    check_label(LabelIn(template.target_kind, "-", *label_fields(template)))
    with sessions() as session:
        trajectory_ids = select_trajectory_ids(session, where)
        if template.target_kind == "trajectory":
            targets = trajectory_ids
        elif template.target_kind == "step":
            targets = [
                step_id
                for chunk in chunks(trajectory_ids)
                for step_id in session.scalars(
                    select(Step.id)
                    .where(Step.trajectory_id.in_(chunk))
                    .order_by(Step.trajectory_id, Step.step_index, Step.choice_index)
                )
            ]
        elif template.target_kind == "group":
            targets = sorted(
                {
                    group_id
                    for chunk in chunks(trajectory_ids)
                    for group_id in session.scalars(
                        select(Trajectory.group_id).where(Trajectory.id.in_(chunk))
                    )
                    if group_id is not None
                }
            )
        else:
            raise InvalidPoolRequestError(
                f"target must be one of {LABEL_TARGETS}, got {template.target_kind!r}"
            )
    if not targets:
        return []
    return add_labels(
        sessions, [LabelIn(template.target_kind, t, *label_fields(template)) for t in targets]
    )
