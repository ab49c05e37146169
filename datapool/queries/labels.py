"""Label records as stored, and one target's current label (``GET /api/labels``,
``GET /api/labels/current``).

Owns: the SQL of the label history. Never: folds records itself (the current view is
``datapool.curation.labels.current_labels``, whose rule the curation and batch code share).
"""

from __future__ import annotations

from sqlalchemy import select

from datapool.curation.labels import CurrentLabel, current_labels
from datapool.db import Sessions
from datapool.models import Label


def label_history(
    sessions: Sessions,
    *,
    target_kind: str | None = None,
    target_id: str | None = None,
    trajectory_id: str | None = None,
    limit: int = 1000,
) -> list[Label]:
    """At most ``limit`` label records, oldest first, of one target and/or of one trajectory
    (itself and its steps); a filter that is None is not applied."""
    query = select(Label).order_by(Label.id).limit(limit)
    if target_kind is not None:
        query = query.where(Label.target_kind == target_kind)
    if target_id is not None:
        query = query.where(Label.target_id == target_id)
    if trajectory_id is not None:
        query = query.where(Label.trajectory_id == trajectory_id)
    with sessions() as session:
        return list(session.scalars(query))


def current_label(sessions: Sessions, target_kind: str, target_id: str) -> CurrentLabel | None:
    """The current view of one target's labels; None when it has no record."""
    with sessions() as session:
        return current_labels(session, target_kind, [target_id]).get(target_id)
