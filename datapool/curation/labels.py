"""Labels: append-only human judgements on steps, trajectories and groups, and their current view.

Owns: appending label records (never updating one) and the current view per target
(``datapool.curation.bulk_labels`` applies one label to everything a filter matches).
Never: changes a step or trajectory; a label is data about data, read by curation
(``datapool.curation.rules``) and batch specs.

The current view of a target folds its records oldest first: ``tags`` are added and
``remove_tags`` removed; ``quality`` (good / bad / unsure), ``decision`` (include / exclude) and
``note`` are the latest non-null value of each. A ``decision`` of ``exclude`` keeps the target out
of every batch; ``include`` overrides a curation rule's exclusion of the same target (never an
integrity flag: a step without exact IDs is never trained on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, get_args

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from datapool.db import chunks
from datapool.errors import InvalidPoolRequestError, UnknownTargetError
from datapool.models import Label, Step, Trajectory, TrajectoryGroup, utc_now

LabelTarget = Literal["step", "trajectory", "group"]
Quality = Literal["good", "bad", "unsure"]
LABEL_TARGETS: tuple[str, ...] = get_args(LabelTarget)
QUALITIES: tuple[str, ...] = get_args(Quality)
DECISIONS: tuple[str, ...] = ("include", "exclude")


@dataclass(frozen=True)
class LabelIn:
    """One label to append; at least one of tags, remove_tags, quality, decision, note."""

    target_kind: str
    target_id: str
    tags: list[str] = field(default_factory=list)
    remove_tags: list[str] = field(default_factory=list)
    quality: str | None = None
    decision: str | None = None
    note: str | None = None
    author: str | None = None


@dataclass
class CurrentLabel:
    """The folded view of a target's label records."""

    tags: list[str] = field(default_factory=list)
    quality: str | None = None
    decision: str | None = None
    note: str | None = None
    decided_by: str | None = None  # author of the record that set ``decision``
    decision_label_id: int | None = None
    updated_at: datetime | None = None
    records: int = 0


def check_label(label: LabelIn) -> None:
    """Raises InvalidPoolRequestError naming the field when ``label`` cannot be stored."""
    if label.target_kind not in LABEL_TARGETS:
        raise InvalidPoolRequestError(
            f"target must be one of {LABEL_TARGETS}, got {label.target_kind!r}", param="target"
        )
    if label.quality is not None and label.quality not in QUALITIES:
        raise InvalidPoolRequestError(
            f"quality must be one of {QUALITIES}, got {label.quality!r}", param="quality"
        )
    if label.decision is not None and label.decision not in DECISIONS:
        raise InvalidPoolRequestError(
            f"decision must be one of {DECISIONS}, got {label.decision!r}", param="decision"
        )
    if not (label.tags or label.remove_tags or label.quality or label.decision or label.note):
        raise InvalidPoolRequestError(
            "a label needs at least one of tags, remove_tags, quality, decision, note"
        )


def _trajectory_of(session: Session, labels: Sequence[LabelIn]) -> dict[tuple[str, str], str]:
    """``{(kind, id): trajectory_id}`` for step and trajectory targets; raises for unknown ids."""
    found: dict[tuple[str, str], str] = {}
    unknown: list[str] = []
    for kind in LABEL_TARGETS:
        ids = sorted({label.target_id for label in labels if label.target_kind == kind})
        known: set[str] = set()
        for chunk in chunks(ids):
            if kind == "step":
                rows = session.execute(
                    select(Step.id, Step.trajectory_id).where(Step.id.in_(chunk))
                )
                for step_id, trajectory_id in rows:
                    found[("step", step_id)] = trajectory_id
                    known.add(step_id)
            elif kind == "trajectory":
                for trajectory_id in session.scalars(
                    select(Trajectory.id).where(Trajectory.id.in_(chunk))
                ):
                    found[("trajectory", trajectory_id)] = trajectory_id
                    known.add(trajectory_id)
            else:
                known |= set(
                    session.scalars(select(TrajectoryGroup.id).where(TrajectoryGroup.id.in_(chunk)))
                )
                known |= set(
                    session.scalars(
                        select(Trajectory.group_id).where(Trajectory.group_id.in_(chunk))
                    )
                )
        unknown += [f"{kind} {i}" for i in ids if i not in known]
    if unknown:
        shown = ", ".join(unknown[:10]) + (" ..." if len(unknown) > 10 else "")
        raise UnknownTargetError(
            f"{len(unknown)} label target(s) not in the pool: {shown}", param="target_id"
        )
    return found


def add_labels(sessions: sessionmaker[Session], labels: Sequence[LabelIn]) -> list[int]:
    """Append ``labels`` in one transaction (all or none); returns their record ids.

    Raises ``UnknownTargetError`` naming unknown targets and ``InvalidPoolRequestError`` for a
    bad kind, quality, decision or an empty label.
    """
    for label in labels:
        check_label(label)
    with sessions.begin() as session:
        trajectory_of = _trajectory_of(session, labels)
        now = utc_now()
        records = [
            Label(
                target_kind=label.target_kind,
                target_id=label.target_id,
                trajectory_id=trajectory_of.get((label.target_kind, label.target_id)),
                tags=list(label.tags),
                remove_tags=list(label.remove_tags),
                quality=label.quality,
                decision=label.decision,
                note=label.note,
                author=label.author,
                created_at=now,
            )
            for label in labels
        ]
        session.add_all(records)
        session.flush()
        return [record.id for record in records]


def label_fields(
    label: LabelIn,
) -> tuple[list[str], list[str], str | None, str | None, str | None, str | None]:
    """A label's fields after its target, to build the same label on another target."""
    return (
        label.tags,
        label.remove_tags,
        label.quality,
        label.decision,
        label.note,
        label.author,
    )


def current_labels(
    session: Session, target_kind: str, target_ids: Sequence[str]
) -> dict[str, CurrentLabel]:
    """``{target_id: CurrentLabel}`` for targets with at least one record."""
    result: dict[str, CurrentLabel] = {}
    for chunk in chunks(list(target_ids)):
        records = session.scalars(
            select(Label)
            .where(Label.target_kind == target_kind, Label.target_id.in_(chunk))
            .order_by(Label.id)
        )
        for record in records:
            _fold(result.setdefault(record.target_id, CurrentLabel()), record)
    return result


def labels_of_trajectories(
    session: Session, trajectory_ids: Sequence[str]
) -> dict[tuple[str, str], CurrentLabel]:
    """``{(kind, target_id): CurrentLabel}`` of the steps and trajectories of ``trajectory_ids``."""
    result: dict[tuple[str, str], CurrentLabel] = {}
    for chunk in chunks(list(trajectory_ids)):
        for record in session.scalars(
            select(Label).where(Label.trajectory_id.in_(chunk)).order_by(Label.id)
        ):
            _fold(result.setdefault((record.target_kind, record.target_id), CurrentLabel()), record)
    return result


def _fold(view: CurrentLabel, record: Label) -> None:
    tags = [t for t in view.tags if t not in set(record.remove_tags or [])]
    view.tags = tags + [t for t in record.tags or [] if t not in tags]
    view.quality = record.quality or view.quality
    view.note = record.note or view.note
    if record.decision is not None:
        view.decision = record.decision
        view.decided_by = record.author
        view.decision_label_id = record.id
    view.updated_at = record.created_at
    view.records += 1
