"""The SQL of one write transaction: which rows it locks, inserts and updates, and how.

Owns: locking (PostgreSQL ``FOR UPDATE``) or creating the batch's trajectories and their groups
(``lock_trajectories``), the ``steps`` / ``step_payloads`` / ``call_attempts`` rows of each
accepted call and the trajectories' counters (``WriteBatch``), and the fast executemany they go
through (``Statements``). Never: opens or commits the transaction (``datapool.steps.store`` does),
or decides a step's parent, payload or request encoding: it writes what
``datapool.steps.lineage``, ``datapool.steps.payloads`` and ``datapool.steps.messages`` made.
"""

from __future__ import annotations

import typing
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Dialect, Table, bindparam, insert, select, update
from sqlalchemy.sql import ClauseElement
from sqlalchemy.sql.compiler import SQLCompiler

from datapool.db import insert_ignore, insert_ignoring
from datapool.models import (
    CallAttempt,
    JsonBlob,
    Step,
    StepPayload,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)
from datapool.steps.calls import attempt_rows
from datapool.steps.crashes import came_back
from datapool.steps.lineage import Placement
from datapool.steps.messages import RequestDelta
from datapool.steps.payloads import CallPayload
from datapool.steps.records import CallRecord, PendingCall

# The write path inserts through Core; these are the models' tables.
_TRAJECTORIES = typing.cast(Table, Trajectory.__table__)
_STEPS = typing.cast(Table, Step.__table__)
_PAYLOADS = typing.cast(Table, StepPayload.__table__)
_ATTEMPTS = typing.cast(Table, CallAttempt.__table__)
_GROUPS = typing.cast(Table, TrajectoryGroup.__table__)
_BLOBS = typing.cast(Table, JsonBlob.__table__)

# (status, call_count, flags) as read under the write lock
TrajectoryState = tuple[str, int, list[str]]


def lock_trajectories(
    connection: Connection,
    statements: Statements,
    pending: Sequence[PendingCall],
    trajectory_ids: list[str],
    now: datetime,
) -> dict[str, TrajectoryState]:
    """``{id: (status, call_count, flags)}`` of every trajectory of the batch, creating the
    missing ones (and their groups) first; on PostgreSQL the rows stay locked until commit."""
    first_call: dict[str, CallRecord] = {}
    for p in pending:
        first_call.setdefault(p.trajectory_id, p.call)
    group_ids = sorted({c.group_id for c in first_call.values() if c.group_id})
    if group_ids:
        statements.insert_groups(
            connection, [{"id": g, "status": "open", "created_at": now} for g in group_ids]
        )
    state = statements.select_state(connection, trajectory_ids)
    missing = [tid for tid in trajectory_ids if tid not in state]
    if missing:  # one IN query per batch finds them; only new trajectories are inserted
        insert_ignore(
            connection,
            Trajectory,
            [
                {
                    "id": trajectory_id,
                    "group_id": first_call[trajectory_id].group_id,
                    "channel": first_call[trajectory_id].channel or "train",
                    "status": TrajectoryStatus.OPEN.value,
                    "metadata_json": {},
                    "tags": [],
                    "flags": [],
                    "call_count": 0,
                    "rejected_calls": 0,
                    "created_at": now,
                }
                for trajectory_id in missing
            ],
        )
        state.update(statements.select_state(connection, missing))
        joined = sorted({g for t in missing if (g := first_call[t].group_id)})
        if joined:
            # A new open member: its group is not complete (the rule of
            # ``lifecycle.update_group``). Updated unconditionally, so the group rows stay
            # locked until commit and a member closing meanwhile (which locks its group)
            # counts this one.
            connection.execute(
                update(_GROUPS)
                .where(_GROUPS.c.id.in_(joined))
                .values(status="open", completed_at=None)
            )
    return state


class WriteBatch:
    """The rows one transaction writes: steps, payloads and attempts of the accepted calls, and
    per trajectory its new ``call_count`` and its refused calls (``rejected_calls``)."""

    def __init__(self, state: Mapping[str, TrajectoryState], now: datetime) -> None:
        self.now = now
        self._counts_before = {tid: count for tid, (_status, count, _flags) in state.items()}
        self._flags = {tid: flags for tid, (_status, _count, flags) in state.items()}
        self._counts = dict(self._counts_before)
        self._rejected: dict[str, int] = {}
        self._steps: list[dict[str, Any]] = []
        self._payloads: list[dict[str, Any]] = []
        self._attempts: list[dict[str, Any]] = []
        self._blobs: dict[str, str] = {}  # ``json_blobs`` rows: sha256 -> JSON text
        # The kind of each step that starts a prefix break ("unknown" when none was found).
        self.prefix_breaks: list[str] = []

    def reject(self, trajectory_id: str) -> None:
        """Count a call refused because its trajectory is not open."""
        self._rejected[trajectory_id] = self._rejected.get(trajectory_id, 0) + 1

    def next_step_index(self, trajectory_id: str) -> int:
        """The ``step_index`` of the trajectory's next accepted call (its calls so far)."""
        step_index = self._counts[trajectory_id]
        self._counts[trajectory_id] = step_index + 1
        return step_index

    def add_call(
        self,
        trajectory_id: str,
        call: CallRecord,
        step_index: int,
        placement: Placement,
        payload: CallPayload,
        request: RequestDelta,
    ) -> list[str]:
        """Add one step and one payload row per choice of ``call``, and its attempts; returns
        the step ids in choice order (the gateway's own where it named them)."""
        lineage = placement.lineage
        now = self.now
        named = [choice.step_id or str(uuid.uuid4()) for choice in call.choices]
        conversation = placement.lineage_of(named[0]) if named else placement.conversation
        step_ids: list[str] = []
        for step_id, choice, response, logprobs in zip(
            named, call.choices, payload.responses, payload.logprobs, strict=True
        ):
            flags = list(choice.flags)
            if lineage.is_break:  # not at a fork at the same prompt (a re-send, a retry)
                flags.append("prefix_break")
                self.prefix_breaks.append(placement.divergence_kind or "unknown")
            ids = choice.response_token_ids
            self._steps.append(
                {
                    "id": step_id,
                    "trajectory_id": trajectory_id,
                    "parent_step_id": lineage.parent_step_id,
                    "call_id": call.call_id,
                    "endpoint": call.endpoint,
                    "request_hash": call.request_hash,
                    "idempotency_key": call.idempotency_key,
                    "step_index": step_index,
                    "choice_index": choice.choice_index,
                    # A step sampled across a kept reload: the version of its first token.
                    "policy_version": (
                        choice.policy_version_spans[0][0]
                        if choice.policy_version_spans
                        else call.policy_version
                    ),
                    "model": call.model,
                    "upstream": call.upstream,
                    "outcome": call.outcome,
                    "error": call.error,
                    "request": request.request,
                    "messages_base": request.messages_base,
                    "upstream_request": request.upstream_request,
                    "upstream_request_patch": request.upstream_request_patch,
                    "response_message": choice.response_message,
                    "history_field": call.history_field,
                    "canonical": request.canonical,
                    "canonical_base": request.canonical_base,
                    "body_deltas": request.body_deltas,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                    "prompt_tokens": call.prompt_tokens,
                    "completion_tokens": None if ids is None else len(ids),
                    "latency_ms": call.latency_ms,
                    "ttft_ms": call.ttft_ms,
                    "held_ms": call.held_ms,
                    "continuation": call.continuation,
                    "suffix_tokens": placement.suffix_tokens(call),
                    "turn_key": choice.turn_key,
                    "sampling": call.sampling,
                    "policy_version_spans": choice.policy_version_spans,
                    "flags": flags,
                    "extends_parent": lineage.extends_parent,
                    "divergence_offset": lineage.divergence_offset,
                    "divergence_kind": placement.divergence_kind,
                    "divergence_detail": placement.divergence_detail,
                    "lineage_id": conversation.id,
                    "lineage_parent_id": conversation.parent_id,
                    "lineage_kind": conversation.kind,
                    "lineage_source": conversation.source,
                    "prompt_base_tokens": payload.prompt_base_tokens,
                    "payload_file_id": None,
                    "created_at": now,
                }
            )
            self._payloads.append(
                {
                    "step_id": step_id,
                    "prompt_delta": payload.prompt_delta,
                    "response_token_ids": response,
                    "response_logprobs": logprobs,
                    "created_at": now,
                }
            )
            step_ids.append(step_id)
        self._blobs.update(request.new_blobs)
        # A call's attempts commit with its steps: one transaction per batch, not one more per call.
        self._attempts += attempt_rows(call.attempts, now)
        return step_ids

    def write(self, connection: Connection, statements: Statements, writer_id: str | None) -> None:
        """Insert every row (one executemany per table) and update the trajectories' counters
        (``call_count``, ``last_step_at``, ``writer_id``; ``rejected_calls``)."""
        if self._blobs:  # before the steps that refer to them; rows that exist are kept
            statements.insert_blobs(
                connection,
                [{"sha256": s, "body": t, "created_at": self.now} for s, t in self._blobs.items()],
            )
        if self._steps:
            statements.insert(connection, _STEPS, self._steps)
            statements.insert(connection, _PAYLOADS, self._payloads)
        if self._attempts:
            statements.insert(connection, _ATTEMPTS, self._attempts)
        stepped = [tid for tid, n in self._counts.items() if n != self._counts_before[tid]]
        if stepped:  # one executemany, not one UPDATE per trajectory
            statements.update_counts(
                connection,
                [
                    {
                        "b_id": tid,
                        "b_count": self._counts[tid],
                        "b_at": self.now,
                        "b_writer": writer_id,
                    }
                    for tid in stepped
                ],
            )
            # A crash-cut trajectory whose agent carried on is judged on its own steps.
            came_back(connection, {tid: self._flags[tid] for tid in stepped})
        if self._rejected:
            connection.execute(
                update(_TRAJECTORIES)
                .where(_TRAJECTORIES.c.id == bindparam("b_id"))
                .values(rejected_calls=_TRAJECTORIES.c.rejected_calls + bindparam("b_n")),
                [{"b_id": tid, "b_n": n} for tid, n in self._rejected.items()],
            )


@dataclass(frozen=True)
class _Prepared:
    """A statement compiled for one dialect: its SQL, and its parameters in the order the DBAPI
    takes them, each with its type's bind processor (None: the value goes as it is)."""

    sql: str
    processors: list[tuple[str, Callable[[Any], Any] | None]]  # (parameter, bind processor)
    positional: bool  # SQLite's qmark style takes tuples; psycopg's named style takes dicts

    @classmethod
    def of(
        cls, statement: ClauseElement, dialect: Dialect, column_keys: list[str] | None = None
    ) -> _Prepared:
        compiled = typing.cast(
            SQLCompiler, statement.compile(dialect=dialect, column_keys=column_keys)
        )
        binds = compiled.binds
        names = list(compiled.positiontup or ()) if compiled.positional else list(binds)
        processors: list[tuple[str, Callable[[Any], Any] | None]] = [
            (name, binds[name].type.dialect_impl(dialect).bind_processor(dialect)) for name in names
        ]
        return cls(compiled.string, processors, compiled.positional)

    def params(self, rows: Iterable[Mapping[str, Any]]) -> list[Any]:
        """The DBAPI parameters of ``rows`` (each a value for every parameter, by name), each
        value through its bind processor."""
        processors = self.processors
        if self.positional:
            return [
                tuple(
                    row[name] if process is None else process(row[name])
                    for name, process in processors
                )
                for row in rows
            ]
        return [
            {
                name: row[name] if process is None else process(row[name])
                for name, process in processors
            }
            for row in rows
        ]


class Statements:
    """The write transaction's statements, compiled once for one engine's dialect (one
    ``Statements`` per ``PoolStore``) and run as one DBAPI call each (``exec_driver_sql``).

    Each value goes through its type's own bind processor (JSON text, SQLite's datetime format)
    and each read JSON value through its result processor, as ``connection.execute`` of the same
    statement would; what is skipped is SQLAlchemy's per-execution compiled-cache lookup and
    parameter machinery (an ``IN`` list's expansion, per-row parameter dicts), which cost more
    CPU than SQLite's own work for a batch of one call.
    """

    def __init__(self, dialect: Dialect) -> None:
        self._dialect = dialect
        self._inserts: dict[str, tuple[_Prepared, frozenset[str]]] = {}  # by table name
        self._states: dict[int, _Prepared] = {}  # the state SELECT, by number of ids
        flags_type = _TRAJECTORIES.c.flags.type.dialect_impl(dialect)
        # SQLite hands JSON back as text, decoded here; psycopg decodes it itself (None).
        self._flags_processor = flags_type.result_processor(dialect, None)
        # Every batch whose calls name a group runs it, so it is prepared too.
        self._groups = _Prepared.of(
            insert_ignoring(_GROUPS, dialect.name),
            dialect,
            column_keys=["id", "status", "created_at"],
        )
        self._blobs = _Prepared.of(
            insert_ignoring(_BLOBS, dialect.name),
            dialect,
            column_keys=["sha256", "body", "created_at"],
        )
        self._counts = _Prepared.of(
            update(_TRAJECTORIES)
            .where(_TRAJECTORIES.c.id == bindparam("b_id"))
            .values(
                call_count=bindparam("b_count"),
                last_step_at=bindparam("b_at"),
                writer_id=bindparam("b_writer"),
            ),
            dialect,
        )

    def insert_groups(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Create the groups of ``rows`` (``{"id", "status", "created_at"}`` each) that do not
        exist yet (``INSERT ... ON CONFLICT DO NOTHING``), in one executemany."""
        connection.exec_driver_sql(self._groups.sql, self._groups.params(rows))

    def insert_blobs(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Create the ``json_blobs`` rows of ``rows`` (``{"sha256", "body", "created_at"}``
        each) that do not exist yet (``INSERT ... ON CONFLICT DO NOTHING``: a blob is immutable,
        so another step's row of the same sha is the same value), in one executemany."""
        connection.exec_driver_sql(self._blobs.sql, self._blobs.params(rows))

    def insert(self, connection: Connection, table: Table, rows: list[dict[str, Any]]) -> None:
        """``INSERT`` ``rows`` (each a value for every column of ``table``) in one DBAPI
        executemany.

        Raises ``ValueError`` when the rows' keys are not exactly the table's columns (a missing
        column would silently skip its Python-side default).
        """
        entry = self._inserts.get(table.name)
        if entry is None:
            names = list(table.c.keys())
            prepared = _Prepared.of(insert(table), self._dialect, column_keys=names)
            entry = self._inserts[table.name] = (prepared, frozenset(names))
        prepared, columns = entry
        if rows[0].keys() != columns:
            raise ValueError(
                f"rows for {table.name} must give every column: "
                f"expected {sorted(columns)}, got {sorted(rows[0])}"
            )
        connection.exec_driver_sql(prepared.sql, prepared.params(rows))

    def select_state(
        self, connection: Connection, trajectory_ids: Sequence[str]
    ) -> dict[str, TrajectoryState]:
        """``{id: (status, call_count, flags)}`` of those of ``trajectory_ids`` that exist, read
        by one ``SELECT ... WHERE id IN (...)``, ``FOR UPDATE`` on PostgreSQL (the rows stay
        locked until commit; SQLite's transaction already holds the write lock). One statement
        is kept per number of ids, so at most ``write_batch_max_calls`` of them."""
        n = len(trajectory_ids)
        if n == 0:
            return {}
        prepared = self._states.get(n)
        if prepared is None:
            table = _TRAJECTORIES
            # The flags too: the batch lifts ``incomplete`` from those that get a step
            # (``came_back``) without reading the rows again.
            query = select(table.c.id, table.c.status, table.c.call_count, table.c.flags).where(
                table.c.id.in_([bindparam(f"id_{i}", type_=table.c.id.type) for i in range(n)])
            )
            if self._dialect.name == "postgresql":
                query = query.with_for_update()
            prepared = self._states[n] = _Prepared.of(query, self._dialect)
        [params] = prepared.params([{f"id_{i}": tid for i, tid in enumerate(trajectory_ids)}])
        decode = self._flags_processor
        rows = connection.exec_driver_sql(prepared.sql, params)
        return {
            tid: (status, count, (flags if decode is None else decode(flags)) or [])
            for tid, status, count, flags in rows
        }

    def update_counts(self, connection: Connection, rows: list[dict[str, Any]]) -> None:
        """Set ``call_count``, ``last_step_at`` and ``writer_id`` of each trajectory in one
        executemany; ``rows``: ``{"b_id", "b_count", "b_at", "b_writer"}`` each."""
        connection.exec_driver_sql(self._counts.sql, self._counts.params(rows))
