"""Which trajectories a filter names: shared by bulk labels, curation scopes and batch specs.

Owns: ``TrajectoryFilter`` (the one filter shape of the curation and batch APIs) and turning it
into trajectory ids. Never: decides readiness (see ``datapool.curation.rules``); a filter only
selects.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Text, cast, exists, or_, select
from sqlalchemy.orm import Session

from datapool.curation.labels import Quality, current_labels
from datapool.models import INTEGER_MAX, JsonBlob, Step, Trajectory, UTCTimestamp
from datapool.rewards.values import current_rewards_query


class TrajectoryFilter(BaseModel):
    """Trajectories to act on; every given field must hold (AND). Strict as ``BatchSpec``
    (``"4"`` is no ``policy_version``), except the two times, which are ISO 8601 text or Unix
    seconds by design (``UTCTimestamp``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    channel: str | None = None
    status: list[str] | None = Field(default=None, description="Any of these statuses.")
    group_ids: list[str] | None = None
    trajectory_ids: list[str] | None = None
    tags: list[str] = Field(default_factory=list, description="Every tag must be present.")
    flags: list[str] = Field(default_factory=list, description="Every flag must be present.")
    reward_name: str = "final"
    reward_min: float | None = None
    reward_max: float | None = None
    rewarded: bool | None = Field(default=None, description="Has reward_name (true) or not.")
    policy_version: int | None = Field(
        default=None, ge=0, le=INTEGER_MAX, description="Has a step of this version."
    )
    created_after: UTCTimestamp | None = Field(default=None, strict=False)
    created_before: UTCTimestamp | None = Field(default=None, strict=False)
    quality: list[Quality] | None = Field(
        default=None, description="Current quality label of the trajectory is one of these."
    )
    limit: int | None = Field(
        default=None, ge=1, le=INTEGER_MAX, description="Oldest first, at most this many."
    )


_LIKE_ESCAPE = "\\"


def _like_substring(text: str) -> str:
    """A LIKE pattern matching ``text`` literally anywhere (its ``%``, ``_``, ``\\`` escaped).

    Use with ``escape=_LIKE_ESCAPE``; unescaped, ``q=%`` or ``q=_`` would match every row.
    """
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def json_contains(column: Any, value: str) -> Any:
    """``value`` is an element of a JSON list column (text on SQLite, json on PostgreSQL)."""
    return cast(column, Text).like(_like_substring(json.dumps(value)), escape=_LIKE_ESCAPE)


def request_text_contains(text: str) -> Any:
    """Some step of the trajectory has ``text`` in its stored canonical record's JSON, or in a
    ``json_blobs`` value one of its bodies refers to (any case; scans), so the same words are
    found whatever API the agent spoke.

    The JSON text holds message contents and roles, tool definitions and sampling parameters,
    each message once (steps store a delta on their parent) and each tool list or system prompt
    once (a blob, ``datapool.steps.bodies``). ``text`` is matched as the JSON writes it (quotes,
    backslashes and non-ASCII characters escaped), so it finds what a message says rather than
    its escaped spelling.
    """
    pattern = _like_substring(json.dumps(text)[1:-1])  # its JSON spelling, without the quotes
    in_blob = exists().where(
        JsonBlob.body.ilike(pattern, escape=_LIKE_ESCAPE),
        cast(Step.body_deltas, Text).contains(JsonBlob.sha256),
    )
    return exists().where(
        Step.trajectory_id == Trajectory.id,
        or_(cast(Step.canonical, Text).ilike(pattern, escape=_LIKE_ESCAPE), in_blob),
    )


def trajectory_conditions(
    *,
    status: Sequence[str] | None = None,
    channel: str | None = None,
    group_ids: Sequence[str] | None = None,
    tags: Sequence[str] = (),
    flags: Sequence[str] = (),
    policy_version: int | None = None,
    created_after: datetime | None = None,
    created_before: datetime | None = None,
    q: str | None = None,
) -> list[Any]:
    """The WHERE conditions on ``Trajectory`` shared by the pool API list, the inspector list
    and batch selection (AND them; rewards are joined differently by each, so not here)."""
    conditions: list[Any] = []
    if status:
        conditions.append(Trajectory.status.in_(status))
    if channel is not None:
        conditions.append(Trajectory.channel == channel)
    if group_ids is not None:
        conditions.append(Trajectory.group_id.in_(group_ids))
    conditions += [json_contains(Trajectory.tags, tag) for tag in tags]
    conditions += [json_contains(Trajectory.flags, flag) for flag in flags]
    if policy_version is not None:
        conditions.append(
            exists().where(
                Step.trajectory_id == Trajectory.id, Step.policy_version == policy_version
            )
        )
    if created_after is not None:
        conditions.append(Trajectory.created_at >= created_after)
    if created_before is not None:
        conditions.append(Trajectory.created_at < created_before)
    if q:
        conditions.append(request_text_contains(q))
    return conditions


def select_trajectory_ids(session: Session, where: TrajectoryFilter) -> list[str]:
    """Ids of the trajectories matching ``where``, oldest first."""
    query = (
        select(Trajectory.id)
        .where(
            *trajectory_conditions(
                status=where.status,
                channel=where.channel,
                group_ids=where.group_ids,
                tags=where.tags,
                flags=where.flags,
                policy_version=where.policy_version,
                created_after=where.created_after,
                created_before=where.created_before,
            )
        )
        .order_by(Trajectory.created_at, Trajectory.id)
    )
    if where.trajectory_ids is not None:
        query = query.where(Trajectory.id.in_(where.trajectory_ids))
    if where.reward_min is not None or where.reward_max is not None or where.rewarded is not None:
        current = current_rewards_query("trajectory", where.reward_name)
        if where.rewarded is False:
            query = query.where(~Trajectory.id.in_(select(current.c.target_id)))
        else:
            query = query.join(current, current.c.target_id == Trajectory.id)
            if where.reward_min is not None:
                query = query.where(current.c.value >= where.reward_min)
            if where.reward_max is not None:
                query = query.where(current.c.value <= where.reward_max)
    if where.limit is not None and where.quality is None:
        query = query.limit(where.limit)
    ids = list(session.scalars(query))
    if where.quality is not None:
        labels = current_labels(session, "trajectory", ids)
        wanted = set(where.quality)
        ids = [i for i in ids if i in labels and labels[i].quality in wanted]
        if where.limit is not None:
            ids = ids[: where.limit]
    return ids
