"""Sorted, filtered, paged trajectory lists and one trajectory with everything about its steps.

Owns: ``ListQuery`` (the pool API's trajectory filters plus text search, a sort key and an
offset page), the SQL behind the inspector's list and its trajectory view, and turning a list
query into a ``TrajectoryFilter`` for bulk labels and batch specs. Never: writes; never reads
token payloads (the token view reads one step's payload through ``PoolStore.get_step``).

Cost: a page is one indexed ``ORDER BY ... LIMIT`` plus grouped lookups for the page's ids
(step counts, rewards, labels, curation marks), so it stays flat as the pool grows; filters on
JSON tags/flags and text search scan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field
from sqlalchemy import and_, exists, func, select
from sqlalchemy.orm import Session, aliased

from datapool.curation.labels import current_labels, labels_of_trajectories
from datapool.curation.readiness import assess
from datapool.curation.selection import TrajectoryFilter, trajectory_conditions
from datapool.db import Sessions, chunks
from datapool.models import (
    INTEGER_MAX,
    CurationMark,
    CurationRule,
    Reward,
    Step,
    Trajectory,
    UTCTimestamp,
)
from datapool.queries.conversation import conversation_deltas
from datapool.queries.lineages import lineage_view
from datapool.queries.rewards import reward_names
from datapool.queries.specs import channel_specs, judged_spec
from datapool.rewards.values import current_rewards
from datapool.steps.messages import expand_requests

DEFAULT_REWARD_NAME = "final"

SortKey = Literal[
    "created_at", "last_step_at", "completed_at", "call_count", "status", "channel", "id", "reward"
]
SORT_KEYS: tuple[str, ...] = get_args(SortKey)


class ListQuery(BaseModel):
    """The filters of ``GET /api/trajectories`` plus sort and offset paging (every filter ANDs)."""

    status: list[str] | None = None
    channel: str | None = None
    group_id: str | None = None
    tag: list[str] = Field(default_factory=list, description="Every tag must be present.")
    flag: list[str] = Field(default_factory=list, description="Every flag must be present.")
    reward_name: str | None = Field(
        default=None,
        description="Reward the reward column, filters and sort read; default the trajectory "
        "reward recorded last in the pool (else 'final').",
    )
    reward_min: float | None = None
    reward_max: float | None = None
    rewarded: bool | None = None
    policy_version: int | None = Field(default=None, ge=0, le=INTEGER_MAX)
    created_after: UTCTimestamp | None = None
    created_before: UTCTimestamp | None = None
    q: str | None = Field(
        default=None, description="Text in a step's request JSON, any case (scans)."
    )
    sort: SortKey = "created_at"
    order: Literal["asc", "desc"] = "desc"
    offset: int = Field(default=0, ge=0, le=INTEGER_MAX)
    limit: int = Field(default=50, ge=1, le=500)

    def to_filter(self, trajectory_ids: list[str] | None = None) -> TrajectoryFilter:
        """The same selection as a curation/batch ``TrajectoryFilter`` (``q`` needs ids)."""
        if self.q and trajectory_ids is None:
            raise ValueError("text search has no TrajectoryFilter field: resolve ids first")
        return TrajectoryFilter(
            channel=self.channel,
            status=self.status,
            group_ids=[self.group_id] if self.group_id is not None else None,
            trajectory_ids=trajectory_ids,
            tags=self.tag,
            flags=self.flag,
            reward_name=self.reward_name or DEFAULT_REWARD_NAME,
            reward_min=self.reward_min,
            reward_max=self.reward_max,
            rewarded=self.rewarded,
            policy_version=self.policy_version,
            created_after=self.created_after,
            created_before=self.created_before,
        )


def current_reward(name: str) -> Any:
    """The trajectory's current value of reward ``name`` as a correlated scalar subquery.

    Same rule as ``datapool.rewards.values.current_rewards`` (the latest record without an error);
    an
    index seek per trajectory on ``ix_rewards_kind_name_target``, where joining the grouped
    ``current_rewards_query`` made SQLite rebuild the group per row (minutes on 100k).
    """
    return (
        select(Reward.value)
        .where(
            Reward.target_kind == "trajectory",
            Reward.name == name,
            Reward.target_id == Trajectory.id,
            Reward.error.is_(None),
        )
        .order_by(Reward.id.desc())
        .limit(1)
        .correlate(Trajectory)
        .scalar_subquery()
    )


def _filtered(where: ListQuery, columns: Sequence[Any]) -> tuple[Any, Any]:
    """``(select(columns) with every filter, current-reward expression or None)``."""
    query = select(*columns).where(
        *trajectory_conditions(
            status=where.status,
            channel=where.channel,
            group_ids=None if where.group_id is None else [where.group_id],
            tags=where.tag,
            flags=where.flag,
            policy_version=where.policy_version,
            created_after=where.created_after,
            created_before=where.created_before,
            q=where.q,
        )
    )
    reward = None
    if (
        where.reward_min is not None
        or where.reward_max is not None
        or where.rewarded is not None
        or where.sort == "reward"
    ):
        reward = current_reward(where.reward_name or DEFAULT_REWARD_NAME)
        if where.rewarded is not None:
            query = query.where(reward.is_not(None) if where.rewarded else reward.is_(None))
        if where.reward_min is not None:
            query = query.where(reward >= where.reward_min)
        if where.reward_max is not None:
            query = query.where(reward <= where.reward_max)
    return query, reward


def with_reward_name(sessions: Sessions, where: ListQuery) -> ListQuery:
    """``where`` with its reward name decided: the one asked for, else the trajectory reward
    recorded last in the pool (one index seek), else ``final``."""
    if where.reward_name is not None:
        return where
    with sessions() as session:
        names = reward_names(session)
    return where.model_copy(update={"reward_name": names[0] if names else DEFAULT_REWARD_NAME})


def list_page(
    sessions: Sessions, where: ListQuery, *, with_total: bool = False
) -> tuple[list[dict[str, Any]], int | None]:
    """``(rows, total)``: one page of trajectories in the requested order, each with its counts,
    rewards, labels (``describe``), and how many match in all (only ``with_total``, else None;
    a second query that counts every match)."""
    with sessions() as session:
        if where.sort == "reward":
            page = _page_by_reward(session, where)
        else:
            query, _ = _filtered(where, [Trajectory])
            key = getattr(Trajectory, where.sort)
            ordered = key.desc() if where.order == "desc" else key.asc()
            tie = Trajectory.id.desc() if where.order == "desc" else Trajectory.id.asc()
            query = query.order_by(ordered, tie).offset(where.offset).limit(where.limit)
            page = list(session.scalars(query))
        rows = describe(session, page)
        total = _count(session, where) if with_total else None
    return rows, total


def _page_by_reward(session: Session, where: ListQuery) -> list[Trajectory]:
    """One page sorted by current reward (ties by id, same direction), unrewarded last.

    Two parts, each one ordered ``LIMIT`` query: the rewarded trajectories come from walking
    ``ix_rewards_sort`` in value order, keeping a record only if it is its trajectory's current
    one (no later record without an error) and the trajectory passes the filters, so a page reads
    about one page of index entries instead of scoring every trajectory; when that part runs out,
    the page continues with the unrewarded trajectories in id order. The offset into the second
    part needs the rewarded count, taken only when the first part returned no row.
    """
    name = where.reward_name or DEFAULT_REWARD_NAME
    desc = where.order == "desc"
    rewarded = _rewarded_by_value(where, name)
    page: list[Trajectory] = []
    if where.rewarded is not False:
        value_order = Reward.value.desc() if desc else Reward.value.asc()
        # The tie on target_id (= the trajectory's id), so the order is the index's own.
        tie = Reward.target_id.desc() if desc else Reward.target_id.asc()
        query = rewarded.order_by(value_order, tie).offset(where.offset).limit(where.limit)
        page = list(session.scalars(query))
    if (
        len(page) == where.limit
        or where.rewarded is True
        or where.reward_min is not None
        or where.reward_max is not None
    ):
        return page
    if page:
        rewarded_count = where.offset + len(page)
    elif where.rewarded is False:
        rewarded_count = 0
    else:
        counted = select(func.count()).select_from(rewarded.subquery())
        rewarded_count = int(session.scalar(counted) or 0)
    unrewarded, _ = _filtered(where.model_copy(update={"rewarded": False}), [Trajectory])
    tie = Trajectory.id.desc() if desc else Trajectory.id.asc()
    rest = (
        unrewarded.order_by(tie)
        .offset(max(0, where.offset - rewarded_count))
        .limit(where.limit - len(page))
    )
    return page + list(session.scalars(rest))


def _rewarded_by_value(where: ListQuery, name: str) -> Any:
    """``select(Trajectory)`` joined to the current record of reward ``name`` (not null), with
    every filter; ``Reward.value`` is in scope for ordering."""
    later = aliased(Reward)
    is_current = ~exists().where(
        later.target_kind == "trajectory",
        later.name == name,
        later.target_id == Reward.target_id,
        later.id > Reward.id,
        later.error.is_(None),
    )
    query, _ = _filtered(
        where.model_copy(
            update={"sort": "created_at", "rewarded": None, "reward_min": None, "reward_max": None}
        ),
        [Trajectory],
    )
    query = query.join(Reward, Reward.target_id == Trajectory.id).where(
        Reward.target_kind == "trajectory",
        Reward.name == name,
        Reward.error.is_(None),
        Reward.value.is_not(None),
        is_current,
    )
    if where.reward_min is not None:
        query = query.where(Reward.value >= where.reward_min)
    if where.reward_max is not None:
        query = query.where(Reward.value <= where.reward_max)
    return query


def _count(session: Session, where: ListQuery) -> int:
    query, _ = _filtered(where, [func.count(Trajectory.id)])
    return int(session.scalar(query) or 0)


def matching_ids(sessions: Sessions, where: ListQuery, limit: int) -> list[str]:
    """Ids matching the filters, oldest first, at most ``limit``."""
    query, _ = _filtered(where, [Trajectory.id])
    query = query.order_by(Trajectory.created_at, Trajectory.id).limit(limit)
    with sessions() as session:
        return list(session.scalars(query))


def _step_counts(session: Session, ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """``{trajectory_id: (steps, tokens)}``; tokens = prompt + completion tokens of every step."""
    result: dict[str, tuple[int, int]] = {}
    for chunk in chunks(list(ids)):
        rows = session.execute(
            select(
                Step.trajectory_id,
                func.count(Step.id),
                func.coalesce(func.sum(Step.prompt_tokens), 0)
                + func.coalesce(func.sum(Step.completion_tokens), 0),
            )
            .where(Step.trajectory_id.in_(chunk))
            .group_by(Step.trajectory_id)
        )
        for trajectory_id, steps, tokens in rows:
            result[trajectory_id] = (int(steps), int(tokens or 0))
    return result


def marks_of(session: Session, trajectory_ids: Sequence[str]) -> list[dict[str, Any]]:
    """Curation marks (rule name, action, reason) on these trajectories and their steps."""
    found: list[dict[str, Any]] = []
    for chunk in chunks(list(trajectory_ids)):
        rows = session.execute(
            select(CurationMark, CurationRule.name)
            .join(CurationRule, CurationRule.id == CurationMark.rule_id)
            .where(CurationMark.trajectory_id.in_(chunk))
            .order_by(CurationMark.id)
        )
        found += [_mark(mark, name) for mark, name in rows]
    return found


def _mark(mark: CurationMark, rule_name: str) -> dict[str, Any]:
    return {
        "rule_id": mark.rule_id,
        "rule": rule_name,
        "target": mark.target_kind,
        "target_id": mark.target_id,
        "trajectory_id": mark.trajectory_id,
        "action": mark.action,
        "reason": mark.reason,
        "created_at": mark.created_at,
    }


def list_marks(sessions: Sessions, rule_id: int | None, limit: int) -> list[dict[str, Any]]:
    """At most ``limit`` curation marks (what rules excluded or flagged, and why), newest first,
    of one rule or (``rule_id`` None) of all."""
    query = (
        select(CurationMark, CurationRule.name)
        .join(CurationRule, CurationRule.id == CurationMark.rule_id)
        .order_by(CurationMark.id.desc())
        .limit(limit)
    )
    if rule_id is not None:
        query = query.where(CurationMark.rule_id == rule_id)
    with sessions() as session:
        return [_mark(mark, name) for mark, name in session.execute(query)]


def describe(session: Session, page: Sequence[Trajectory]) -> list[dict[str, Any]]:
    """List rows: the trajectory's columns plus steps, tokens, rewards, label and exclusion."""
    ids = [t.id for t in page]
    counts = _step_counts(session, ids)
    rewards = current_rewards(session, "trajectory", ids)
    labels = current_labels(session, "trajectory", ids)
    excluded = {
        m["trajectory_id"]
        for m in marks_of(session, ids)
        if m["target"] == "trajectory" and m["action"] == "exclude"
    }
    rows = []
    for t in page:
        label = labels.get(t.id)
        steps, tokens = counts.get(t.id, (0, 0))
        rows.append(
            {
                "id": t.id,
                "group_id": t.group_id,
                "channel": t.channel,
                "status": t.status,
                "tags": sorted(set(t.tags or []) | set(label.tags if label else [])),
                "flags": list(t.flags or []),
                "created_at": t.created_at,
                "completed_at": t.completed_at,
                "last_step_at": t.last_step_at,
                "call_count": t.call_count,
                "steps": steps,
                "tokens": tokens,
                "rewards": rewards.get(t.id, {}),
                "quality": label.quality if label else None,
                "decision": label.decision if label else None,
                "note": label.note if label else None,
                "rule_excluded": t.id in excluded,
            }
        )
    return rows


STEP_COLUMNS = (
    "id",
    "call_id",
    "step_index",
    "choice_index",
    "parent_step_id",
    "extends_parent",
    "divergence_offset",
    "divergence_kind",
    "divergence_detail",
    "lineage_id",
    "lineage_parent_id",
    "lineage_kind",
    "lineage_source",
    "outcome",
    "error",
    "finish_reason",
    "flags",
    "policy_version",
    "model",
    "upstream",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms",
    "ttft_ms",
    "continuation",
    "suffix_tokens",
    "response_message",
    "created_at",
)


def trajectory_view(
    sessions: Sessions,
    trajectory_id: str,
    *,
    batch_id: str | None = None,
    chosen_rewards: Sequence[str] = (),
) -> dict[str, Any] | None:
    """A trajectory, its steps in order (no token payloads; of each step's conversation only
    what it added, ``datapool.queries.conversation``, with the trajectory's distinct tool lists
    once in ``tools``), their rewards, labels and marks, and ``readiness`` for a batch: judged
    against ``readiness.spec`` (see ``datapool.queries.specs.judged_spec``; the newest batch
    spec of the trajectory's channel unless ``batch_id`` or ``chosen_rewards`` choose), with
    ``readiness.specs`` the channel's recent specs to choose from; ``lineages`` and each step's
    ``segment_index``: its conversations and the merged rows they train as
    (``datapool.queries.lineages``); None for an unknown id."""
    with sessions() as session:
        trajectory = session.get(Trajectory, trajectory_id)
        if trajectory is None:
            return None
        row, steps = _view(session, trajectory)
        spec = judged_spec(
            session, row["channel"], batch_id=batch_id, chosen_rewards=chosen_rewards
        )
        choices = channel_specs(session, row["channel"])
        # The view's step rows, so readiness does not read (and parse) every step again.
        verdict = assess(session, [trajectory], spec["reward_names"], step_rows=steps)[
            trajectory_id
        ]
    lineages, segment_index = lineage_view(steps, verdict.excluded_steps)
    row["lineages"] = lineages
    for step in row["steps"]:
        step["segment_index"] = segment_index[step["id"]]
    row["readiness"] = {
        "ready": verdict.ready,
        "reasons": verdict.reasons,
        "notes": verdict.notes,
        "excluded_steps": verdict.excluded_steps,
        "spec": spec,
        "specs": choices,
    }
    return row


def _view(session: Session, trajectory: Trajectory) -> tuple[dict[str, Any], list[Step]]:
    """The view of ``trajectory`` without its readiness, and its step rows in call order."""
    trajectory_id = trajectory.id
    (row,) = describe(session, [trajectory])
    steps = list(
        session.scalars(
            select(Step)
            .where(Step.trajectory_id == trajectory_id)
            .order_by(Step.step_index, Step.choice_index)
        )
    )
    expand_requests(session, steps)  # the full records, then what each step added to them
    added, tools, head_texts = conversation_deltas(steps)
    step_ids = [s.id for s in steps]
    step_rewards = current_rewards(session, "step", step_ids)
    labels = labels_of_trajectories(session, [trajectory_id])
    marks = marks_of(session, [trajectory_id])
    row["metadata"] = dict(trajectory.metadata_json or {})
    row["completion_reason"] = trajectory.completion_reason
    row["rejected_calls"] = trajectory.rejected_calls
    row["label_tags"] = _label(labels.get(("trajectory", trajectory_id)))
    row["marks"] = [m for m in marks if m["target"] == "trajectory"]
    row["tools"] = tools
    row["head_texts"] = head_texts
    row["steps"] = [
        {
            **{k: getattr(s, k) for k in STEP_COLUMNS},
            **added[s.id],
            "rewards": step_rewards.get(s.id, {}),
            "label": _label(labels.get(("step", s.id))),
            "marks": [m for m in marks if m["target"] == "step" and m["target_id"] == s.id],
        }
        for s in steps
    ]
    return row, steps


def _label(view: Any) -> dict[str, Any] | None:
    if view is None:
        return None
    return {k: getattr(view, k) for k in ("tags", "quality", "decision", "note")}


def last_answers(session: Session, trajectory_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The response message of each trajectory's last step (choice 0)."""
    latest = (
        select(Step.trajectory_id, func.max(Step.step_index).label("last"))
        .where(Step.trajectory_id.in_(list(trajectory_ids)))
        .group_by(Step.trajectory_id)
        .subquery()
    )
    rows = session.execute(
        select(Step.trajectory_id, Step.response_message).join(
            latest,
            and_(
                Step.trajectory_id == latest.c.trajectory_id,
                Step.step_index == latest.c.last,
                Step.choice_index == 0,
            ),
        )
    )
    return {trajectory_id: message or {} for trajectory_id, message in rows}
