"""Writes captured calls into the pool and reads steps back with their exact token payloads.

Owns: the transaction that turns calls into steps (trajectory created on first use, steps
numbered, parent chosen by token lineage, payload stored as a prompt delta in ``step_payloads``),
many calls per transaction (group commit, see ``datapool.steps.writer``), and reading a step's exact
``prompt_token_ids`` / ``response_token_ids`` / ``response_logprobs`` back. Never: tokenizes, or
writes half a call: every step of a batch commits in one transaction or none does.
"""

from __future__ import annotations

import json
import threading
import typing
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from sqlalchemy import Connection, Dialect, Engine, Table, bindparam, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from datapool.db import insert_ignore, make_sessionmaker
from datapool.errors import TrajectoryClosedError
from datapool.models import (
    CallAttempt,
    Step,
    StepOutcome,
    StepPayload,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
    utc_now,
)
from datapool.settings import PoolSettings
from datapool.steps.calls import attempt_rows
from datapool.steps.lineage import TOKEN_BYTES, LineageCache, TrajectoryTokens, pack_ids
from datapool.steps.messages import (
    expand_requests,
    history_keys,
    merge_patch,
    message_key,
    messages_base,
    stored_request,
)
from datapool.steps.payloads import (
    PayloadFiles,
    StepRef,
    TokenPayload,
    encode_logprobs,
    reconstruct,
)
from datapool.steps.prefix import RETOKENISED, Lineage, classify_divergence, divergence_window
from datapool.steps.records import CallRecord


@dataclass(frozen=True)
class StoredStep:
    """A step row with its exact payload; every column of ``Step`` reads through (``.flags``).

    ``prompt_token_ids`` ``[P]``, ``response_token_ids`` ``[R]``, ``response_logprobs`` ``[R]``,
    each None when the engine reported nothing.
    """

    row: Step
    prompt_token_ids: list[int] | None
    response_token_ids: list[int] | None
    response_logprobs: list[float] | None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.row, name)


@dataclass(frozen=True)
class PendingCall:
    """One call waiting to be committed."""

    trajectory_id: str
    call: CallRecord


CallResult = list[str] | Exception


@dataclass(frozen=True)
class _PreparedInsert:
    """An ``INSERT`` of every column of a table, compiled for one dialect (``_insert_rows``)."""

    sql: str
    processors: list[tuple[str, Callable[[Any], Any] | None]]  # (column, bind processor)
    columns: frozenset[str]

    @classmethod
    def of(cls, table: Table, dialect: Dialect) -> _PreparedInsert:
        names = list(table.c.keys())
        compiled = insert(table).compile(dialect=dialect, column_keys=names)
        if compiled.positional:  # the parameters' order in the statement
            names = list(compiled.positiontup or ())
        processors: list[tuple[str, Callable[[Any], Any] | None]] = [
            (name, table.c[name].type.dialect_impl(dialect).bind_processor(dialect))
            for name in names
        ]
        return cls(compiled.string, processors, frozenset(names))


# The write path inserts through Core; these are the models' tables.
_TRAJECTORIES = typing.cast(Table, Trajectory.__table__)
_STEPS = typing.cast(Table, Step.__table__)
_PAYLOADS = typing.cast(Table, StepPayload.__table__)
_ATTEMPTS = typing.cast(Table, CallAttempt.__table__)
_GROUPS = typing.cast(Table, TrajectoryGroup.__table__)


class PoolStore:
    """The pool's write and read API over one SQL engine (SQLite or PostgreSQL)."""

    def __init__(self, engine: Engine, settings: PoolSettings | None = None) -> None:
        self.engine = engine
        self.settings = settings or PoolSettings()
        self.sessions: sessionmaker[Session] = make_sessionmaker(engine)
        self.payloads = PayloadFiles(self.sessions, self.settings.resolved_payload_uri())
        self._lineage = LineageCache(self.settings.lineage_cache_trajectories)
        self._write_lock = threading.Lock()
        self._inserts: dict[str, _PreparedInsert] = {}  # by table name, for this engine

    # ---- writing ---------------------------------------------------------------------------

    def record_call(
        self,
        trajectory_id: str,
        call: CallRecord,
        *,
        group_id: str | None = None,
        channel: str | None = None,
        writer_id: str | None = None,
    ) -> list[str]:
        """Commit one call as one step per choice and return the step ids (in choice order).

        A failed call (``call.outcome != "ok"``) is still recorded, as one step with the error, so
        the trajectory shows what happened; it never becomes a parent. Raises
        ``TrajectoryClosedError`` when the trajectory is no longer open (counted on it).
        """
        if group_id or channel:
            call = _with_attribution(call, group_id, channel)
        [result] = self.record_calls([PendingCall(trajectory_id, call)], writer_id=writer_id)
        if isinstance(result, Exception):
            raise result
        return result

    def record_calls(
        self, pending: Sequence[PendingCall], *, writer_id: str | None = None
    ) -> list[CallResult]:
        """Commit many calls in one transaction; per call, its step ids or why it was refused.

        Refusals (``TrajectoryClosedError``) do not abort the others. Any database error aborts
        the whole transaction and propagates; the lineage memory is then dropped for the
        trajectories involved so it never holds uncommitted steps.
        """
        with self._write_lock:
            trajectory_ids = list(dict.fromkeys(p.trajectory_id for p in pending))
            try:
                with self.sessions.begin() as session:
                    return self._record_in(session, pending, trajectory_ids, writer_id)
            except BaseException:
                for trajectory_id in trajectory_ids:
                    self._lineage.forget(trajectory_id)
                raise

    def _record_in(
        self,
        session: Session,
        pending: Sequence[PendingCall],
        trajectory_ids: list[str],
        writer_id: str | None,
    ) -> list[CallResult]:
        connection = session.connection()
        if connection.dialect.name == "sqlite":
            # Take the write lock before reading the trajectories' state, so nothing can close
            # one between this read and the insert (PostgreSQL locks the rows FOR UPDATE).
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        now = utc_now()
        state = self._trajectory_state(session, pending, trajectory_ids, now)
        for trajectory_id in trajectory_ids:
            status, call_count = state[trajectory_id]
            if status == TrajectoryStatus.OPEN:
                self._refresh_lineage(session, trajectory_id, call_count)

        results: list[CallResult] = []
        next_index = {tid: count for tid, (_status, count) in state.items()}
        rejected: dict[str, int] = {}
        step_rows: list[dict[str, Any]] = []
        payload_rows: list[dict[str, Any]] = []
        for p in pending:
            status = state[p.trajectory_id][0]
            if status != TrajectoryStatus.OPEN:
                rejected[p.trajectory_id] = rejected.get(p.trajectory_id, 0) + 1
                results.append(TrajectoryClosedError(p.trajectory_id, status))
                continue
            step_index = next_index[p.trajectory_id]
            next_index[p.trajectory_id] = step_index + 1
            results.append(
                self._steps_of_call(session, p, step_index, now, step_rows, payload_rows)
            )
        if step_rows:
            self._insert_rows(connection, _STEPS, step_rows)
            self._insert_rows(connection, _PAYLOADS, payload_rows)
        # A call's attempts commit with its steps: one transaction per batch, not one more per call.
        attempts = attempt_rows(
            (
                a
                for p, result in zip(pending, results, strict=True)
                if not isinstance(result, Exception)
                for a in p.call.attempts
            ),
            now,
        )
        if attempts:
            self._insert_rows(connection, _ATTEMPTS, attempts)
        counts = [
            {"b_id": tid, "b_count": n, "b_at": now, "b_writer": writer_id}
            for tid, n in next_index.items()
            if n != state[tid][1]
        ]
        if counts:  # one executemany, not one UPDATE per trajectory
            connection.execute(
                update(_TRAJECTORIES)
                .where(_TRAJECTORIES.c.id == bindparam("b_id"))
                .values(
                    call_count=bindparam("b_count"),
                    last_step_at=bindparam("b_at"),
                    writer_id=bindparam("b_writer"),
                ),
                counts,
            )
        if rejected:
            connection.execute(
                update(_TRAJECTORIES)
                .where(_TRAJECTORIES.c.id == bindparam("b_id"))
                .values(rejected_calls=_TRAJECTORIES.c.rejected_calls + bindparam("b_n")),
                [{"b_id": tid, "b_n": n} for tid, n in rejected.items()],
            )
        return results

    def _insert_rows(
        self, connection: Connection, table: Table, rows: list[dict[str, Any]]
    ) -> None:
        """``INSERT`` ``rows`` (each a value for every column of ``table``) in one DBAPI
        executemany of a statement compiled once per table and dialect.

        Each value goes through its column type's own bind processor (JSON text, SQLite's
        datetime format), as in ``connection.execute(insert(table), rows)``; what is skipped is
        SQLAlchemy's per-row parameter machinery, which cost more CPU than SQLite's insert.
        Raises ``ValueError`` when the rows' keys are not exactly the table's columns (a missing
        column would silently skip its Python-side default).
        """
        dialect = connection.dialect
        prepared = self._inserts.get(table.name)
        if prepared is None:
            prepared = self._inserts[table.name] = _PreparedInsert.of(table, dialect)
        if rows[0].keys() != prepared.columns:
            raise ValueError(
                f"rows for {table.name} must give every column: "
                f"expected {sorted(prepared.columns)}, got {sorted(rows[0])}"
            )
        processors = prepared.processors
        params: list[Any]
        if dialect.positional:  # SQLite's qmark style: tuples in the statement's order
            params = [
                tuple(
                    row[name] if process is None else process(row[name])
                    for name, process in processors
                )
                for row in rows
            ]
        else:  # psycopg's named style
            params = [
                {
                    name: row[name] if process is None else process(row[name])
                    for name, process in processors
                }
                for row in rows
            ]
        connection.exec_driver_sql(prepared.sql, params)

    def _trajectory_state(
        self,
        session: Session,
        pending: Sequence[PendingCall],
        trajectory_ids: list[str],
        now: datetime,
    ) -> dict[str, tuple[str, int]]:
        """``{id: (status, call_count)}`` of every trajectory of the batch, creating the missing
        ones (and their groups) first; on PostgreSQL the rows stay locked until commit."""
        first_call: dict[str, CallRecord] = {}
        for p in pending:
            first_call.setdefault(p.trajectory_id, p.call)
        group_ids = sorted({c.group_id for c in first_call.values() if c.group_id})
        if group_ids:
            insert_ignore(
                session,
                TrajectoryGroup,
                [{"id": g, "status": "open", "created_at": now} for g in group_ids],
            )
        state = self._select_state(session, trajectory_ids)
        missing = [tid for tid in trajectory_ids if tid not in state]
        if missing:  # one IN query per batch finds them; only new trajectories are inserted
            insert_ignore(
                session,
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
            state.update(self._select_state(session, missing))
            joined = sorted({g for t in missing if (g := first_call[t].group_id)})
            if joined:
                # A new open member: its group is not complete (the rule of
                # ``lifecycle.update_group``). Updated unconditionally, so the group rows stay
                # locked until commit and a member closing meanwhile (which locks its group)
                # counts this one.
                session.connection().execute(
                    update(_GROUPS)
                    .where(_GROUPS.c.id.in_(joined))
                    .values(status="open", completed_at=None)
                )
        return state

    @staticmethod
    def _select_state(session: Session, trajectory_ids: list[str]) -> dict[str, tuple[str, int]]:
        table = _TRAJECTORIES
        query = select(table.c.id, table.c.status, table.c.call_count).where(
            table.c.id.in_(trajectory_ids)
        )
        connection = session.connection()
        if connection.dialect.name == "postgresql":
            query = query.with_for_update()
        return {tid: (status, count) for tid, status, count in connection.execute(query)}

    def _steps_of_call(
        self,
        session: Session,
        p: PendingCall,
        step_index: int,
        now: Any,
        step_rows: list[dict[str, Any]],
        payload_rows: list[dict[str, Any]],
    ) -> list[str]:
        call = p.call
        tokens = self._lineage.get(p.trajectory_id)
        assert tokens is not None  # _refresh_lineage loaded every trajectory of the batch
        prompt = None if call.prompt_token_ids is None else pack_ids(call.prompt_token_ids)
        if prompt is None or call.outcome != StepOutcome.OK:
            lineage = Lineage(tokens.latest_step_id, None, None)
            kind, detail = None, None
        else:
            lineage = tokens.choose_parent(prompt)
            kind, detail = self._divergence(tokens, call, lineage)
        base_tokens = 0
        if prompt is not None and lineage.parent_step_id is not None:
            if lineage.extends_parent:
                base_tokens = tokens.tokens_of(lineage.parent_step_id)
            elif lineage.divergence_offset:
                base_tokens = lineage.divergence_offset
        delta = None if prompt is None else prompt[base_tokens * TOKEN_BYTES :]
        # Messages as a delta on the parent (datapool.steps.messages): only a candidate's keys are
        # known, so a failed or token-less parent gets none and the messages are stored whole.
        parent_keys, _ = (
            tokens.message_keys_of(lineage.parent_step_id)
            if lineage.parent_step_id is not None
            else (None, False)
        )
        messages = call.request.get("messages")
        base_messages = messages_base(parent_keys, messages)
        request = stored_request(call.request, base_messages)
        patch = merge_patch(call.request, call.upstream_request)
        step_ids: list[str] = []
        responses: list[bytes | None] = []
        for choice in call.choices:
            step_id = choice.step_id or str(uuid.uuid4())
            flags = list(choice.flags)
            if lineage.extends_parent is False:
                flags.append("prefix_break")
            ids = choice.response_token_ids
            response = None if ids is None else pack_ids(ids)
            responses.append(response)
            step_rows.append(
                {
                    "id": step_id,
                    "trajectory_id": p.trajectory_id,
                    "parent_step_id": lineage.parent_step_id,
                    "call_id": call.call_id,
                    "endpoint": call.endpoint,
                    "request_hash": call.request_hash,
                    "idempotency_key": call.idempotency_key,
                    "step_index": step_index,
                    "choice_index": choice.choice_index,
                    "policy_version": call.policy_version,
                    "model": call.model,
                    "upstream": call.upstream,
                    "outcome": call.outcome,
                    "error": call.error,
                    "request": request,
                    "messages_base": base_messages,
                    "upstream_request": call.upstream_request if patch is None else None,
                    "upstream_request_patch": patch,
                    "response_message": choice.response_message,
                    "finish_reason": choice.finish_reason,
                    "stop_reason": choice.stop_reason,
                    "prompt_tokens": call.prompt_tokens,
                    "completion_tokens": (
                        len(choice.response_token_ids)
                        if choice.response_token_ids is not None
                        else None
                    ),
                    "latency_ms": call.latency_ms,
                    "ttft_ms": call.ttft_ms,
                    "flags": flags,
                    "extends_parent": lineage.extends_parent,
                    "divergence_offset": lineage.divergence_offset,
                    "divergence_kind": kind,
                    "divergence_detail": detail,
                    "prompt_base_tokens": base_tokens if prompt is not None else None,
                    "payload_file_id": None,
                    "created_at": now,
                }
            )
            payload_rows.append(
                {
                    "step_id": step_id,
                    "prompt_delta": delta,
                    "response_token_ids": response,
                    "response_logprobs": encode_logprobs(choice.response_logprobs),
                    "created_at": now,
                }
            )
            step_ids.append(step_id)
        if call.outcome == StepOutcome.OK and prompt is not None:
            for step_id, response, choice in zip(step_ids, responses, call.choices, strict=True):
                if response is not None:
                    keys = history_keys(
                        parent_keys, messages, base_messages or 0, choice.response_message
                    )
                    answered = choice.response_message is not None
                    tokens.add(step_id, lineage, prompt, response, keys, answered)
        if step_ids:
            tokens.latest_step_id = step_ids[0]
        tokens.call_count = step_index + 1  # the count this batch commits (see _refresh_lineage)
        return step_ids

    @staticmethod
    def _divergence(
        tokens: TrajectoryTokens, call: CallRecord, lineage: Lineage
    ) -> tuple[str | None, dict[str, Any] | None]:
        """For a prefix break: its kind (from the messages) and a window of both sides.

        The parent's full messages and response come from the lineage memory's message keys
        (a parent is always a candidate there), not from its stored delta.
        """
        if lineage.extends_parent is not False or lineage.divergence_offset is None:
            return None, None
        assert lineage.parent_step_id is not None and call.prompt_token_ids is not None
        keys, has_response = tokens.message_keys_of(lineage.parent_step_id)
        keys = keys or []
        request_keys = keys[:-1] if has_response else keys
        parent_messages = [json.loads(key) for key in request_keys]
        parent_response = json.loads(keys[-1]) if has_response else None
        new_messages = call.request.get("messages")
        kind = (
            classify_divergence(parent_messages, parent_response, new_messages)
            if isinstance(new_messages, list)
            else RETOKENISED
        )
        sequence = np.frombuffer(tokens.sequence_of(lineage.parent_step_id), dtype="<i4")
        detail = divergence_window(
            sequence.tolist(), call.prompt_token_ids, lineage.divergence_offset
        )
        return kind, detail

    def _refresh_lineage(self, session: Session, trajectory_id: str, call_count: int) -> None:
        """Make the lineage memory of ``trajectory_id`` match the database, whose ``call_count``
        (read under the write lock) says whether another process, an eviction or a restart left
        it behind: every batch that adds steps bumps it in the same transaction."""
        cached = self._lineage.get(trajectory_id)
        if cached is not None and cached.call_count == call_count:
            return
        tokens = (
            TrajectoryTokens()  # no call yet, so no step to read
            if call_count == 0
            else self._rebuild_lineage(session, trajectory_id)
        )
        tokens.call_count = call_count
        self._lineage.put(trajectory_id, tokens)

    def _rebuild_lineage(self, session: Session, trajectory_id: str) -> TrajectoryTokens:
        rows = self._step_rows(session, trajectory_id)
        payloads = self._payloads_of(session, rows)
        expand_requests(session, rows)
        keys_of: dict[int, str] = {}  # message_key by id(): messages a step shares with its parent

        def key(message: Any) -> str:
            found = keys_of.get(id(message))
            if found is None:
                found = keys_of[id(message)] = message_key(message)
            return found

        tokens = TrajectoryTokens()
        for row in rows:
            if row.choice_index == 0 or tokens.latest_step_id is None:
                tokens.latest_step_id = row.id
            payload = payloads[row.id]
            if (
                row.outcome == StepOutcome.OK
                and payload.prompt_token_ids is not None
                and payload.response_token_ids is not None
            ):
                lineage = Lineage(row.parent_step_id, row.extends_parent, row.divergence_offset)
                known = {c.step_id for c in tokens.candidates}
                if row.parent_step_id not in known:
                    lineage = Lineage(None, None, None)
                messages = row.request.get("messages")
                keys = None
                if isinstance(messages, list):
                    keys = [key(m) for m in messages]
                    if row.response_message is not None:
                        keys.append(key(row.response_message))
                tokens.add(
                    row.id,
                    lineage,
                    pack_ids(payload.prompt_token_ids),
                    pack_ids(payload.response_token_ids),
                    keys,
                    row.response_message is not None,
                )
        return tokens

    def forget_lineage(self, trajectory_id: str) -> None:
        """Drop a closed trajectory's sequences from the writer's memory."""
        with self._write_lock:
            self._lineage.forget(trajectory_id)

    # ---- reading ---------------------------------------------------------------------------

    @staticmethod
    def _step_rows(session: Session, trajectory_id: str) -> list[Step]:
        return list(
            session.scalars(
                select(Step)
                .where(Step.trajectory_id == trajectory_id)
                .order_by(Step.step_index, Step.choice_index)
            )
        )

    def _payloads_of(self, session: Session, rows: Sequence[Step]) -> dict[str, TokenPayload]:
        refs = [
            StepRef(
                r.id, r.trajectory_id, r.parent_step_id, r.prompt_base_tokens, r.payload_file_id
            )
            for r in rows
        ]
        return reconstruct(self.payloads.load(session, refs))

    def steps_of(self, trajectory_id: str) -> list[StoredStep]:
        """Steps of a trajectory in call order, then choice order, with exact payloads."""
        with self.sessions() as session:
            rows = self._step_rows(session, trajectory_id)
            payloads = self._payloads_of(session, rows)
            expand_requests(session, rows)
        return [_stored(row, payloads[row.id]) for row in rows]

    def get_step(self, step_id: str) -> StoredStep | None:
        """One step with its exact payload (reads its trajectory's delta chain), or None."""
        with self.sessions() as session:
            row = session.get(Step, step_id)
            if row is None:
                return None
            chain = self._chain_rows(session, row)
            payloads = self._payloads_of(session, chain)
            expand_requests(session, [row])
        return _stored(row, payloads[row.id])

    @staticmethod
    def _chain_rows(session: Session, row: Step) -> list[Step]:
        """``row`` and the ancestors its prompt delta is built on."""
        chain = [row]
        by_id = {r.id: r for r in PoolStore._step_rows(session, row.trajectory_id)}
        current = row
        while current.prompt_base_tokens and current.parent_step_id in by_id:
            current = by_id[current.parent_step_id]
            chain.append(current)
        return chain

    def get_trajectory(self, trajectory_id: str) -> Trajectory | None:
        with self.sessions() as session:
            return session.get(Trajectory, trajectory_id)


def _stored(row: Step, payload: TokenPayload) -> StoredStep:
    return StoredStep(
        row, payload.prompt_token_ids, payload.response_token_ids, payload.response_logprobs
    )


def _with_attribution(call: CallRecord, group_id: str | None, channel: str | None) -> CallRecord:
    from dataclasses import replace

    return replace(call, group_id=group_id or call.group_id, channel=channel or call.channel)
