"""SQL schema of the data pool (SQLAlchemy 2.0 typed models).

Owns: the tables and their columns. Never: changes the schema at run time; every change goes
through an Alembic migration in ``migrations/`` (a test compares these models with the migrated
database on SQLite and PostgreSQL).

Token payloads (prompt IDs, response IDs, behaviour logprobs) are not on the step row: a new
step's payload is a row of ``step_payloads`` (binary int32/float blobs, committed with the step)
until compaction moves it into a Parquet file listed in ``payload_files`` (see
``datapool.steps.payloads`` and docs/datapool.md). They are exactly the engine's numbers, never
re-encoded text.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

import enum
import re
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator
from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utc_now() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A ``timestamptz`` column that is an aware UTC ``datetime`` in Python on every backend.

    SQLite has no time zone type: SQLAlchemy stores a datetime's wall-clock fields as text
    (``2026-11-30 15:18:58.523962``) and drops its offset, so ``16:20+01:00`` would be stored
    and compared as ``16:20``. Binding converts every value to UTC first (a naive value is taken
    as UTC), which keeps the stored text exactly as before for the UTC values the pool writes;
    results come back aware in UTC (SQLite's naive text read as UTC, PostgreSQL's values in the
    session's time zone converted), so filters, comparisons and JSON agree on both backends.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return _as_utc(value)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return _as_utc(value)


def _as_utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def in_utc_range(value: datetime) -> datetime:
    """``value`` in UTC (naive taken as UTC); ValueError when UTC cannot hold it (Python's
    years are 1 to 9999: ``0001-01-01T00:00:01+07:00`` is a year 0 instant)."""
    try:
        utc = _as_utc(value)
    except OverflowError:
        raise ValueError(
            f"expected an instant from {datetime.min.isoformat()}Z to "
            f"{datetime.max.isoformat()}Z in UTC, got {value.isoformat()}"
        ) from None
    assert utc is not None
    return utc


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _unix_seconds(value: Any) -> Any:
    """A number, or a string that is one, as Unix seconds in UTC; anything else as it came.

    pydantic alone reads a number past 2e10 as milliseconds, so ``253402300800`` (the second
    after 9999-12-31T23:59:59Z) was a 1978 date. Here a number is always seconds, so a value in
    milliseconds falls far outside UTC's range and is refused instead of read as another time.
    Raises ``ValueError`` for a number no datetime holds.
    """
    number = value
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value)
    if type(number) not in (int, float):
        return value
    try:
        return datetime.fromtimestamp(number, UTC)
    except (OverflowError, OSError, ValueError):
        raise ValueError(
            f"expected an instant from {datetime.min.isoformat()}Z to "
            f"{datetime.max.isoformat()}Z in UTC, got {value!r:.40} (a number is Unix seconds)"
        ) from None


# A time a client filters by (query parameters and filter bodies): ISO 8601, or a number of Unix
# seconds (never milliseconds), converted to UTC at once, so an instant outside Python's UTC range
# is a 400 naming the field instead of an OverflowError in the query (every such parameter uses
# this one type).
UTCTimestamp = Annotated[datetime, BeforeValidator(_unix_seconds), AfterValidator(in_utc_range)]


# The largest value of an Integer column on PostgreSQL (INTEGER: 32 bits; SQLite's hold 64). Every
# integer the API accepts for such a column, or compares with one, is bounded by it at the edge.
INTEGER_MAX = 2**31 - 1

# none_as_null: a Python None is SQL NULL ("missing"), never the JSON literal null.
JSONColumn = JSON(none_as_null=True)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSONColumn, list[Any]: JSONColumn}  # noqa: RUF012


class TrajectoryStatus(enum.StrEnum):
    OPEN = "open"
    COMPLETE = "complete"
    ABANDONED = "abandoned"
    FAILED = "failed"


# Trajectory flags (``trajectories.flags``) that keep a trajectory out of training until a human
# or rule decides: closed with no step (C15), and open in a writer process that died (C14).
EMPTY = "empty"
INCOMPLETE = "incomplete"


class StepOutcome(enum.StrEnum):
    """How the call behind a step ended."""

    OK = "ok"
    UPSTREAM_ERROR = "upstream_error"  # the upstream answered with a 4xx/5xx
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    CLIENT_DISCONNECT = "client_disconnect"  # partial: kept for inspection, never trained on
    # Still sampling when a full-weight reload began and past the gateway's drain limit: cut
    # so that no step mixes two policies' tokens; kept for inspection, never trained on.
    ABORTED_FOR_WEIGHT_UPDATE = "aborted_for_weight_update"


class Trajectory(Base):
    """One agent episode: the steps sharing ``id``."""

    __tablename__ = "trajectories"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    group_id: Mapped[str | None] = mapped_column(String(200), index=True)
    channel: Mapped[str] = mapped_column(String(100), default="train", index=True)
    status: Mapped[str] = mapped_column(String(20), default=TrajectoryStatus.OPEN, index=True)
    metadata_json: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Counter of logical calls, bumped atomically (UPDATE ... RETURNING) to number steps.
    call_count: Mapped[int] = mapped_column(Integer, default=0)
    tags: Mapped[list[Any]] = mapped_column(default=list)
    # Facts about the whole episode: "empty" (closed without steps, C15), "incomplete" (in flight
    # when its gateway died, C14).
    flags: Mapped[list[Any]] = mapped_column(default=list)
    last_step_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Why it left "open": "explicit", "idle_timeout", "abandoned", "failed".
    completion_reason: Mapped[str | None] = mapped_column(String(50))
    # Calls that arrived after the trajectory closed and were refused (409), never stored.
    rejected_calls: Mapped[int] = mapped_column(Integer, default=0)
    # The writer process that last wrote a step here while open ("host:pid:start"), so a restart
    # can tell which open trajectories were in flight in a process that died.
    writer_id: Mapped[str | None] = mapped_column(String(200), index=True)
    # When its completion hooks (reward functions, then curation rules) are due: set on
    # completion, pushed into the future by a runner's claim (its lease), NULL once they ran.
    hooks_due_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), index=True)


class TrajectoryGroup(Base):
    """Rollouts of the same task; complete when ``expected_size`` members are complete."""

    __tablename__ = "trajectory_groups"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    expected_size: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(20), default="open")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class Step(Base):
    """One LLM call's choice: the exact prompt IDs, the sampled response IDs and their logprobs."""

    __tablename__ = "steps"
    __table_args__ = (UniqueConstraint("trajectory_id", "step_index", "choice_index"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    trajectory_id: Mapped[str] = mapped_column(
        ForeignKey("trajectories.id", ondelete="CASCADE"), index=True
    )
    parent_step_id: Mapped[str | None] = mapped_column(String(36))
    # The logical call this step answers: retries and identical re-sends share it.
    call_id: Mapped[str | None] = mapped_column(String(36), index=True)
    endpoint: Mapped[str] = mapped_column(String(30), default="chat.completions")
    request_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    step_index: Mapped[int] = mapped_column(Integer)
    choice_index: Mapped[int] = mapped_column(Integer, default=0)
    policy_version: Mapped[int | None] = mapped_column(Integer, index=True)
    model: Mapped[str | None] = mapped_column(String(200))
    upstream: Mapped[str | None] = mapped_column(String(500))
    outcome: Mapped[str] = mapped_column(String(30), default=StepOutcome.OK)
    error: Mapped[str | None] = mapped_column(Text)
    # The client's request, its ``messages`` stored as a delta on the parent's (migration 0007):
    # only ``messages[messages_base:]`` is here; NULL base = the whole request (older rows).
    # Readers see the full request: ``datapool.steps.messages.expand_requests`` (PoolStore does it).
    request: Mapped[dict[str, Any]] = mapped_column()
    messages_base: Mapped[int | None] = mapped_column(Integer)
    # What went upstream: a JSON Merge Patch against the full request, or (older rows, or what
    # a merge patch cannot say) the whole upstream request; exactly one of the two is set.
    upstream_request: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    upstream_request_patch: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    response_message: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    # The request's field that holds the history (named by the call's dialect), so the pool
    # cuts and rebuilds it without knowing the dialect (migration 0013).
    history_field: Mapped[str | None] = mapped_column(String(32))
    # The canonical record (``datapool.steps.canonical``), its messages a delta on the parent's
    # canonical messages and response: ``canonical["messages"]`` holds ``C[canonical_base:]``.
    canonical: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    canonical_base: Mapped[int | None] = mapped_column(Integer)
    # How ``request``, ``upstream_request`` and ``canonical`` read back beyond the history
    # deltas above (migration 0015, ``datapool.steps.bodies``): per body, the fields stored as a
    # delta on the parent step's same field (an int) or as a ``json_blobs`` row (its sha256);
    # NULL: every field as stored.
    body_deltas: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    finish_reason: Mapped[str | None] = mapped_column(String(50))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    # How long the gateway held the call before sending it upstream because a full-weight
    # reload was in progress (part of ``latency_ms``); None when it was not held.
    held_ms: Mapped[float | None] = mapped_column(Float)
    # What built the prompt (migration 0011): "exact" (a turn's own ids, then the template's
    # rendering of only the new messages, ``suffix_tokens`` of them) or "template" (the whole
    # conversation rendered); NULL when the gateway did not say (completions, older rows).
    continuation: Mapped[str | None] = mapped_column(String(16))
    suffix_tokens: Mapped[int | None] = mapped_column(Integer)
    # The key of the turn this step answered (migration 0014,
    # ``gateway.proxy.continuation.history.turn_key``: a hash of its canonical history, the
    # echo form of its response and the rendering fields), set on the ok steps of exact
    # channels: a later call that extends the turn finds it by this key in any process.
    turn_key: Mapped[str | None] = mapped_column(String(64))
    # What the call sampled with (migration 0012; ``gateway.proxy.sampling.sampling_record``): the
    # effective fields, what narrowed them, the server's logprobs mode and the temperature its
    # stored logprobs are at. NULL: written before 0012 (temperature unknown).
    sampling: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    # Which policy version sampled which response tokens, [[version, start, end), ...] in
    # order, when a full-weight update replaced the weights while the step was sampling
    # (``gateway.upstream.weight_update``, mode 'keep'); NULL: every token is ``policy_version``'s.
    policy_version_spans: Mapped[list[Any] | None] = mapped_column(JSONColumn)
    stop_reason: Mapped[str | None] = mapped_column(String(200))
    flags: Mapped[list[Any]] = mapped_column(default=list)
    extends_parent: Mapped[bool | None] = mapped_column()
    divergence_offset: Mapped[int | None] = mapped_column(Integer)
    # Why the prompt does not extend the parent ("history_rewritten", "tool_arguments_changed",
    # ...) and a short window of both sides around the divergence offset.
    divergence_kind: Mapped[str | None] = mapped_column(String(50))
    divergence_detail: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    # The conversation of the trajectory this step belongs to (migration 0016,
    # ``datapool.steps.records.LineageRecord``): its id (a client's session or agent id, or the
    # id of the lineage's first step), the lineage it came from, its kind (``LINEAGE_KINDS``)
    # and whether a client header named it or the message structure did (``LINEAGE_SOURCES``).
    lineage_id: Mapped[str | None] = mapped_column(String(200))
    lineage_parent_id: Mapped[str | None] = mapped_column(String(200))
    lineage_kind: Mapped[str | None] = mapped_column(String(20))
    lineage_source: Mapped[str | None] = mapped_column(String(10))
    # The prompt is the first ``prompt_base_tokens`` of the parent's prompt + response followed
    # by the stored delta; 0 or None means the delta is the whole prompt.
    prompt_base_tokens: Mapped[int | None] = mapped_column(Integer)
    # None while the payload is in ``step_payloads``; the Parquet file after compaction.
    payload_file_id: Mapped[str | None] = mapped_column(String(36), index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class StepPayload(Base):
    """A recent step's token payload, committed in the step's own transaction.

    Blobs: ``prompt_delta`` and ``response_token_ids`` are little-endian int32;
    ``response_logprobs`` is one width byte (``4`` or ``8``) then little-endian float32/float64
    values. NULL = the engine reported nothing (never made up).
    """

    __tablename__ = "step_payloads"

    step_id: Mapped[str] = mapped_column(
        ForeignKey("steps.id", ondelete="CASCADE"), primary_key=True
    )
    prompt_delta: Mapped[bytes | None] = mapped_column(LargeBinary)
    response_token_ids: Mapped[bytes | None] = mapped_column(LargeBinary)
    response_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class JsonBlob(Base):
    """One JSON value that steps share (a tool list, a system prompt), stored once
    (``datapool.steps.bodies``): keyed by the sha256 of its JSON text, which ``body`` holds
    exactly as hashed. Rows are immutable and never deleted while a step may refer to them."""

    __tablename__ = "json_blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    body: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class PayloadFile(Base):
    """One compacted Parquet file of step payloads (any pyarrow filesystem URI)."""

    __tablename__ = "payload_files"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    steps: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class RewardSource(enum.StrEnum):
    RULE = "rule"
    MODEL = "model"
    HUMAN = "human"
    AGENT = "agent"


class Reward(Base):
    """One append-only reward record on a step or a trajectory.

    The current value of ``(target_kind, target_id, name)`` is the latest record without an
    error. A record with ``error`` set and ``value`` NULL says a reward function failed; it never
    stands for 0.0.
    """

    __tablename__ = "rewards"
    __table_args__ = (Index("ix_rewards_target_name", "target_kind", "target_id", "name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    target_kind: Mapped[str] = mapped_column(String(20))
    target_id: Mapped[str] = mapped_column(String(200))
    trajectory_id: Mapped[str] = mapped_column(String(200), index=True)
    name: Mapped[str] = mapped_column(String(100))
    value: Mapped[float | None] = mapped_column(Float)
    source: Mapped[str] = mapped_column(String(20))
    author: Mapped[str | None] = mapped_column(String(200))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class CallAttempt(Base):
    """One upstream attempt of a logical call; retries of the same call share ``call_id``.

    Only the successful attempt becomes steps; failed attempts stay here with their error.
    """

    __tablename__ = "call_attempts"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    call_id: Mapped[str] = mapped_column(String(36), index=True)
    trajectory_id: Mapped[str] = mapped_column(String(200), index=True)
    attempt_index: Mapped[int] = mapped_column(Integer)
    upstream: Mapped[str | None] = mapped_column(String(500))
    status_code: Mapped[int | None] = mapped_column(Integer)
    outcome: Mapped[str] = mapped_column(String(30))
    error: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[float] = mapped_column(Float)
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    # What the client received for a successful non-streaming attempt: replayed, byte-equal in
    # content, when the same Idempotency-Key comes again.
    response_body: Mapped[dict[str, Any] | None] = mapped_column(JSONColumn)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class PolicyVersion(Base):
    """A version of the policy's weights and the upstream model name that serves it."""

    __tablename__ = "policy_versions"

    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    model_name: Mapped[str] = mapped_column(String(200))
    weights_location: Mapped[str | None] = mapped_column(Text)
    active: Mapped[bool] = mapped_column(default=False, index=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)
    activated_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class ApiKey(Base):
    """An agent's API key, stored only as a hash; optionally bound to a trajectory or channel."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(200), unique=True)
    trajectory_id: Mapped[str | None] = mapped_column(String(200))
    channel: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


# ---- curation and batches (see datapool.curation.labels, datapool.curation.rules,
# datapool.batches.build) ----


class Label(Base):
    """One append-only human label on a step, trajectory or group.

    The current view of a target folds its records oldest first: ``tags`` are added and
    ``remove_tags`` removed; ``quality``, ``decision`` and ``note`` are the latest non-null value.
    """

    __tablename__ = "labels"
    __table_args__ = (Index("ix_labels_target", "target_kind", "target_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    target_kind: Mapped[str] = mapped_column(String(20))
    target_id: Mapped[str] = mapped_column(String(200))
    # The step's or trajectory's trajectory (None for a group): finds a trajectory's labels.
    trajectory_id: Mapped[str | None] = mapped_column(String(200), index=True)
    tags: Mapped[list[Any]] = mapped_column(default=list)
    remove_tags: Mapped[list[Any]] = mapped_column(default=list)
    quality: Mapped[str | None] = mapped_column(String(10))  # good / bad / unsure
    decision: Mapped[str | None] = mapped_column(String(10))  # include / exclude
    note: Mapped[str | None] = mapped_column(Text)
    author: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class CurationRule(Base):
    """A curation rule declared in the pool; its matches are ``curation_marks``."""

    __tablename__ = "curation_rules"
    # SQLite: never reuse the id of a deleted rule (marks and logs name rules by id).
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(50))
    action: Mapped[str] = mapped_column(String(20))  # exclude / flag
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    enabled: Mapped[bool] = mapped_column(default=True)
    author: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)
    applied_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # Why the rule's last run failed (datapool.curation.rules.apply_rules); None after a good run.
    error: Mapped[str | None] = mapped_column(Text)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


class CurationMark(Base):
    """A rule's current match on one target (derived: re-applying a rule replaces its marks)."""

    __tablename__ = "curation_marks"
    __table_args__ = (
        UniqueConstraint("rule_id", "target_kind", "target_id"),
        Index("ix_curation_marks_target", "target_kind", "target_id"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    rule_id: Mapped[int] = mapped_column(
        ForeignKey("curation_rules.id", ondelete="CASCADE"), index=True
    )
    target_kind: Mapped[str] = mapped_column(String(20))
    target_id: Mapped[str] = mapped_column(String(200))
    trajectory_id: Mapped[str | None] = mapped_column(String(200), index=True)
    action: Mapped[str] = mapped_column(String(20))
    reason: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class Batch(Base):
    """An immutable materialised batch (rows in Parquet at ``uri``) and its one lease."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(20), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column()
    manifest: Mapped[dict[str, Any]] = mapped_column(default=dict)
    uri: Mapped[str | None] = mapped_column(Text)
    rows: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_id: Mapped[str | None] = mapped_column(String(36))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    leases: Mapped[int] = mapped_column(Integer, default=0)
    expired_leases: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class BatchConsumption(Base):
    """A consumer acknowledged a batch: trained on it once, with this policy version."""

    __tablename__ = "batch_consumptions"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    consumer: Mapped[str] = mapped_column(String(200), primary_key=True)
    lease_id: Mapped[str] = mapped_column(String(36))
    policy_version_trained: Mapped[int | None] = mapped_column(Integer)
    acked_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


class BatchClaim(Base):
    """A trajectory taken by an exclusive batch (built with ``exclude_batched``): one batch at
    most per trajectory, enforced by the primary key across every process (migration 0018)."""

    __tablename__ = "batch_claims"

    trajectory_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), index=True)


class BatchRow(Base):
    """Lineage: which steps each row of a batch holds (a merged row holds several)."""

    __tablename__ = "batch_rows"

    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    row_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    step_id: Mapped[str] = mapped_column(String(36), primary_key=True, index=True)
    trajectory_id: Mapped[str] = mapped_column(String(200), index=True)


# ---- training metrics and inspector indexes (migration 0005) ----


class TrainingMetric(Base):
    """One append-only row of metrics a trainer reported (loss, KL, grad norm, ...) at a step."""

    __tablename__ = "training_metrics"
    __table_args__ = (Index("ix_training_metrics_run_step", "run", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run: Mapped[str] = mapped_column(String(200), default="default")
    policy_version: Mapped[int | None] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utc_now)


# A trajectory's steps by lineage: a lineage's reward and its merged row (migration 0016).
Index("ix_steps_trajectory_lineage", Step.trajectory_id, Step.lineage_id)
# Sort keys of the inspector's trajectory list and the current-reward subquery (kind, name ->
# latest record per target).
Index("ix_trajectories_created_at", Trajectory.created_at)
Index("ix_trajectories_last_step_at", Trajectory.last_step_at)
Index("ix_trajectories_call_count", Trajectory.call_count, Trajectory.id)
Index("ix_trajectories_completed_at", Trajectory.completed_at, Trajectory.id)
Index("ix_rewards_kind_name_target", Reward.target_kind, Reward.name, Reward.target_id, Reward.id)
# The list sorted by reward walks each name's records in value order (migration 0010).
Index("ix_rewards_sort", Reward.target_kind, Reward.name, Reward.value, Reward.target_id)

# The inspector's charts read these narrow indexes instead of every step row (migration 0009):
# each trajectory's newest version, the step aggregates (covering), and the flagged steps alone.
# FLAGGED_STEP is the partial index's predicate; a query repeats it verbatim to use the index.
FLAGGED_STEP = "flags IS NOT NULL AND CAST(flags AS TEXT) != '[]'"
Index("ix_steps_trajectory_version", Step.trajectory_id, Step.policy_version)
Index("ix_steps_prompt_tokens", Step.prompt_tokens, Step.created_at)
Index("ix_steps_completion_tokens", Step.completion_tokens, Step.created_at)
# Exact continuation finds the turn a call extends by its key (migration 0014).
Index("ix_steps_trajectory_turn_key", Step.trajectory_id, Step.turn_key)
Index(
    "ix_steps_charts",
    Step.created_at,
    Step.policy_version,
    Step.prompt_tokens,
    Step.completion_tokens,
)
Index(
    "ix_steps_flagged",
    Step.policy_version,
    sqlite_where=text(FLAGGED_STEP),
    postgresql_where=text(FLAGGED_STEP),
)
