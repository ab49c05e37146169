"""Readiness: whether a trajectory or group may enter a batch and, if not, every reason why.

Owns: ``assess`` (one pass over many trajectories, shared by the readiness API and batch
materialisation) and the exclusion precedence: a target is excluded when a human label says
``exclude``, or when a curation rule with action ``exclude`` marks it and no human label on the
same target says ``include``. Never: decides by itself what a rule matches
(``datapool.curation.rules``)
or changes data.

A trajectory is ready when it is ``complete``, not flagged ``empty``/``incomplete``, rewarded by
every reward a batch spec requires (missing is never 0), not excluded (itself or its group), its
group has no open member, and at least one of its steps is neither integrity-flagged (or not
``ok``) nor excluded. Excluded steps of a ready trajectory stay out of rows (``excluded_steps``).
A spec naming step rewards also needs every such trainable step to have each of them
(``unrewarded_steps`` lists the steps that lack one; missing is never 0).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from datapool.curation.labels import CurrentLabel, current_labels, labels_of_trajectories
from datapool.curation.rules import INTEGRITY_FLAGS
from datapool.db import chunks
from datapool.errors import UnknownTargetError
from datapool.models import (
    EMPTY,
    INCOMPLETE,
    CurationMark,
    CurationRule,
    Step,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)
from datapool.rewards.values import current_rewards


@dataclass
class Verdict:
    """Whether a trajectory is ready for a batch that requires ``required_rewards``.

    ``reasons`` say why not (empty when ready); ``notes`` list non-blocking facts (flag marks);
    ``excluded_steps`` maps step id to why it is kept out of rows (the rest may still train).
    ``step_rewards``: the current step rewards required (``{step id: {name: value}}``);
    ``unrewarded_steps``: the trainable steps lacking one (``{step id: [missing names]}``).
    """

    trajectory_id: str
    group_id: str | None
    status: str
    ready: bool
    reasons: list[str]
    notes: list[str]
    rewards: dict[str, float]
    excluded_steps: dict[str, str]
    step_rewards: dict[str, dict[str, float]] = field(default_factory=dict)
    unrewarded_steps: dict[str, list[str]] = field(default_factory=dict)


def _excluded(
    marks: Sequence[tuple[str, str, str, str]], label: CurrentLabel | None
) -> tuple[list[str], list[str]]:
    """``(exclusion reasons, notes)`` of one target from its marks ``(rule, id, action, reason)``
    and its current human label."""
    reasons: list[str] = []
    notes: list[str] = []
    included = label is not None and label.decision == "include"
    for rule_name, rule_id, action, reason in marks:
        text = f"rule {rule_name!r} (#{rule_id}): {reason}"
        if action == "exclude" and not included:
            reasons.append(f"excluded by {text}")
        else:
            prefix = "overridden by an include label: " if action == "exclude" else "flagged by "
            notes.append(prefix + text)
    if label is not None and label.decision == "exclude":
        reasons.append(
            f"excluded by label #{label.decision_label_id} ({label.decided_by or 'anonymous'})"
        )
    return reasons, notes


def _marks_of(
    session: Session, trajectory_ids: Sequence[str], group_ids: Sequence[str]
) -> dict[tuple[str, str], list[tuple[str, str, str, str]]]:
    result: dict[tuple[str, str], list[tuple[str, str, str, str]]] = defaultdict(list)
    query = select(
        CurationMark.target_kind,
        CurationMark.target_id,
        CurationRule.name,
        CurationRule.id,
        CurationMark.action,
        CurationMark.reason,
    ).join(CurationRule, CurationRule.id == CurationMark.rule_id)
    for chunk in chunks(list(trajectory_ids)):
        for kind, target, name, rule_id, action, reason in session.execute(
            query.where(CurationMark.trajectory_id.in_(chunk))
        ):
            result[(kind, target)].append((name, str(rule_id), action, reason))
    for chunk in chunks(list(group_ids)):
        for kind, target, name, rule_id, action, reason in session.execute(
            query.where(CurationMark.target_kind == "group", CurationMark.target_id.in_(chunk))
        ):
            result[(kind, target)].append((name, str(rule_id), action, reason))
    return result


def assess(
    session: Session,
    trajectories: Sequence[Trajectory],
    required_rewards: Sequence[str],
    step_rows: Sequence[Any] | None = None,
    required_step_rewards: Sequence[str] = (),
) -> dict[str, Verdict]:
    """Readiness of each trajectory: complete, not empty/incomplete, rewarded by every name in
    ``required_rewards``, not excluded (itself or its group), with at least one step that is
    neither integrity-flagged nor excluded, and each such step rewarded by every name in
    ``required_step_rewards``. ``step_rows`` (``Step`` rows of these trajectories) avoids a
    second read when the caller has them."""
    ids = [t.id for t in trajectories]
    groups = sorted({t.group_id for t in trajectories if t.group_id is not None})
    if step_rows is None:
        step_rows = [
            s
            for chunk in chunks(ids)
            for s in session.scalars(select(Step).where(Step.trajectory_id.in_(chunk)))
        ]
    steps_by_trajectory: dict[str, list[Any]] = defaultdict(list)
    for step in step_rows:
        steps_by_trajectory[step.trajectory_id].append(step)
    marks = _marks_of(session, ids, groups)
    labels = labels_of_trajectories(session, ids)
    group_labels = current_labels(session, "group", groups)
    rewards = current_rewards(session, "trajectory", ids)
    step_rewards = (
        current_rewards(session, "step", [s.id for s in step_rows]) if required_step_rewards else {}
    )
    open_members: dict[str, int] = defaultdict(int)
    for chunk in chunks(groups):
        for group_id, count in session.execute(
            select(Trajectory.group_id, func.count())
            .where(Trajectory.group_id.in_(chunk), Trajectory.status == TrajectoryStatus.OPEN.value)
            .group_by(Trajectory.group_id)
        ):
            open_members[str(group_id)] = int(count)
    result: dict[str, Verdict] = {}
    for t in trajectories:
        reasons: list[str] = []
        notes: list[str] = []
        if t.status != TrajectoryStatus.COMPLETE.value:
            reasons.append(f"status is {t.status!r} (ready needs 'complete')")
        for flag in (EMPTY, INCOMPLETE):
            if flag in (t.flags or []):
                reasons.append(f"trajectory flagged {flag!r}")
        current = rewards.get(t.id, {})
        for name in required_rewards:
            if name not in current:
                reasons.append(f"unrewarded: no current reward {name!r} (missing is not 0)")
        r, n = _excluded(marks.get(("trajectory", t.id), []), labels.get(("trajectory", t.id)))
        reasons += r
        notes += n
        if t.group_id is not None:
            r, n = _excluded(marks.get(("group", t.group_id), []), group_labels.get(t.group_id))
            reasons += [f"group {t.group_id!r} {x}" for x in r]
            notes += [f"group {t.group_id!r} {x}" for x in n]
            if open_members.get(t.group_id):
                reasons.append(
                    f"group {t.group_id!r} has {open_members[t.group_id]} open member(s)"
                )
        excluded_steps: dict[str, str] = {}
        steps = steps_by_trajectory.get(t.id, [])
        for step in steps:
            bad = sorted(set(INTEGRITY_FLAGS) & set(step.flags or []))
            if step.outcome != "ok":
                excluded_steps[step.id] = f"outcome {step.outcome!r}"
            elif bad:
                excluded_steps[step.id] = f"integrity flag(s) {bad}"
            else:
                r, n = _excluded(marks.get(("step", step.id), []), labels.get(("step", step.id)))
                notes += [f"step {step.id} {x}" for x in n]
                if r:
                    excluded_steps[step.id] = "; ".join(r)
        if steps and len(excluded_steps) == len(steps):
            reasons.append(f"no trainable step: all {len(steps)} are flagged or excluded")
        elif not steps and EMPTY not in (t.flags or []):
            reasons.append("no steps")
        used, unrewarded = _step_rewards_of(
            steps, excluded_steps, step_rewards, required_step_rewards
        )
        reasons += [
            f"unrewarded step: {step_id} has no current step reward {name!r} (missing is not 0)"
            for step_id, names in unrewarded.items()
            for name in names
        ]
        result[t.id] = Verdict(
            t.id,
            t.group_id,
            t.status,
            not reasons,
            reasons,
            notes,
            current,
            excluded_steps,
            used,
            unrewarded,
        )
    return result


def _step_rewards_of(
    steps: Sequence[Any],
    excluded_steps: dict[str, str],
    current: dict[str, dict[str, float]],
    required: Sequence[str],
) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """``(required step rewards of each step, missing names of each trainable step)``."""
    used: dict[str, dict[str, float]] = {}
    missing: dict[str, list[str]] = {}
    if not required:
        return used, missing
    for step in steps:
        have = current.get(step.id, {})
        used[step.id] = {name: have[name] for name in required if name in have}
        lacking = [name for name in required if name not in have]
        if lacking and step.id not in excluded_steps:
            missing[step.id] = lacking
    return used, missing


def trajectory_readiness(
    sessions: sessionmaker[Session],
    trajectory_id: str,
    required_rewards: Sequence[str],
    required_step_rewards: Sequence[str] = (),
) -> Verdict:
    with sessions() as session:
        trajectory = session.get(Trajectory, trajectory_id)
        if trajectory is None:
            raise UnknownTargetError(f"no trajectory {trajectory_id!r}", param="trajectory_id")
        return assess(
            session, [trajectory], required_rewards, required_step_rewards=required_step_rewards
        )[trajectory_id]


def group_readiness(
    sessions: sessionmaker[Session],
    group_id: str,
    required_rewards: Sequence[str],
    required_step_rewards: Sequence[str] = (),
) -> tuple[bool, list[str], list[Verdict]]:
    """``(ready, reasons, member verdicts)``: ready when every member is ready."""
    with sessions() as session:
        members = list(
            session.scalars(
                select(Trajectory)
                .where(Trajectory.group_id == group_id)
                .order_by(Trajectory.created_at, Trajectory.id)
            )
        )
        if not members and session.get(TrajectoryGroup, group_id) is None:
            raise UnknownTargetError(f"no group {group_id!r}", param="group_id")
        group = session.get(TrajectoryGroup, group_id)
        verdicts = list(
            assess(
                session, members, required_rewards, required_step_rewards=required_step_rewards
            ).values()
        )
    reasons = [f"member {v.trajectory_id}: {r}" for v in verdicts for r in v.reasons]
    if not members:
        reasons.append("no members")
    if group is not None and group.expected_size and len(members) < group.expected_size:
        reasons.append(f"{len(members)} of {group.expected_size} expected members exist")
    return not reasons, reasons, verdicts
