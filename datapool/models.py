"""SQL schema of the data pool (SQLAlchemy 2.0 typed models).

Owns: the tables and their columns. Never: changes the schema at run time; every change goes
through an Alembic migration in ``migrations/`` (a test compares these models with the migrated
database on SQLite and PostgreSQL).

Token payloads (prompt IDs, response IDs, behaviour logprobs) are JSON arrays on the step row
for now; they are exactly the engine's numbers, never re-encoded text.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utc_now() -> datetime:
    return datetime.now(UTC)


# none_as_null: a Python None is SQL NULL ("missing"), never the JSON literal null.
JSONColumn = JSON(none_as_null=True)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSONColumn, list[Any]: JSONColumn}  # noqa: RUF012


class TrajectoryStatus(enum.StrEnum):
    OPEN = "open"
    COMPLETE = "complete"
    ABANDONED = "abandoned"
    FAILED = "failed"


class StepOutcome(enum.StrEnum):
    """How the call behind a step ended."""

    OK = "ok"
    UPSTREAM_ERROR = "upstream_error"  # the upstream answered with a 4xx/5xx
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"


class Trajectory(Base):
    """One agent episode: the steps sharing ``id``."""

    __tablename__ = "trajectories"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    group_id: Mapped[str | None] = mapped_column(String(200), index=True)
    channel: Mapped[str] = mapped_column(String(100), default="train", index=True)
    status: Mapped[str] = mapped_column(String(20), default=TrajectoryStatus.OPEN, index=True)
    metadata_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Counter of logical calls, bumped atomically (UPDATE ... RETURNING) to number steps.
    call_count: Mapped[int] = mapped_column(Integer, default=0)


class Step(Base):
    """One LLM call's choice: the exact prompt IDs, the sampled response IDs and their logprobs."""

    __tablename__ = "steps"
    __table_args__ = (UniqueConstraint("trajectory_id", "step_index", "choice_index"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(
        ForeignKey("trajectories.id", ondelete="CASCADE"), index=True
    )
    parent_step_id: Mapped[str | None] = mapped_column(String(36))
    step_index: Mapped[int] = mapped_column(Integer)
    choice_index: Mapped[int] = mapped_column(Integer, default=0)
    policy_version: Mapped[int | None] = mapped_column(Integer, index=True)
    model: Mapped[str | None] = mapped_column(String(200))
    upstream: Mapped[str | None] = mapped_column(String(500))
    outcome: Mapped[str] = mapped_column(String(30), default=StepOutcome.OK)
    error: Mapped[str | None] = mapped_column(Text)
    request: Mapped[dict[str, Any]] = mapped_column()
    upstream_request: Mapped[dict[str, Any]] = mapped_column()
    response_message: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    finish_reason: Mapped[str | None] = mapped_column(String(50))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float] = mapped_column(Float)
    flags: Mapped[list[Any]] = mapped_column(default=list)
    extends_parent: Mapped[bool | None] = mapped_column()
    divergence_offset: Mapped[int | None] = mapped_column(Integer)
    prompt_token_ids: Mapped[list[Any] | None] = mapped_column(JSONColumn)
    response_token_ids: Mapped[list[Any] | None] = mapped_column(JSONColumn)
    response_logprobs: Mapped[list[Any] | None] = mapped_column(JSONColumn)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utc_now)
