"""Writes captured calls into the pool and reads steps back with their exact token payloads.

Owns: the transaction that turns calls into steps (trajectory created on first use, steps
numbered, parent chosen by token lineage, payload stored as a prompt delta in ``step_payloads``),
many calls per transaction (group commit, see ``datapool.steps.writer``), and reading a step's exact
``prompt_token_ids`` / ``response_token_ids`` / ``response_logprobs`` back. Never: tokenizes, or
writes half a call: every step of a batch commits in one transaction or none does.

The write path reads top-down: ``record_calls`` opens the transaction; ``_record_in`` locks the
batch's trajectories and brings the lineage memory up to date; ``_steps_of_call`` then takes
each call through one module per concept, in order: its parent and any prefix break
(``lineage``, ``prefix``), its token payload as a prompt delta (``payloads``), its requests as a
message delta and a merge patch, every other field as a delta or a shared blob (``messages``,
``bodies``), and its SQL rows (``transaction``). None of them calls back into this module.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from datapool.db import make_sessionmaker
from datapool.errors import TrajectoryClosedError
from datapool.models import Step, StepOutcome, Trajectory, TrajectoryStatus, utc_now
from datapool.settings import PoolSettings
from datapool.steps import chain
from datapool.steps.canonical import CanonicalCall, Message, response_of
from datapool.steps.lineage import LineageCache, TrajectoryTokens, rebuilt
from datapool.steps.messages import canonical_call, expand_requests, request_delta
from datapool.steps.payloads import (
    PayloadFiles,
    StepRef,
    TokenPayload,
    encode_payload,
    pack_ids,
    reconstruct,
)
from datapool.steps.records import CallRecord, PendingCall
from datapool.steps.transaction import Statements, WriteBatch, lock_trajectories

__all__ = ["CallResult", "PendingCall", "PoolStore", "StoredStep"]


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

    @property
    def call(self) -> CanonicalCall | None:
        """What the engine was asked (``datapool.steps.canonical``): the conversation, tools and
        sampling parameters in one form for every dialect; None for a step recorded without."""
        return canonical_call(self.row)

    @property
    def response(self) -> Message:
        """The generated message as a canonical message (no content when none was generated)."""
        return response_of(self.row.response_message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.row, name)


CallResult = list[str] | Exception


class PoolStore:
    """The pool's write and read API over one SQL engine (SQLite or PostgreSQL)."""

    def __init__(self, engine: Engine, settings: PoolSettings | None = None) -> None:
        self.engine = engine
        self.settings = settings or PoolSettings()
        self.sessions: sessionmaker[Session] = make_sessionmaker(engine)
        self.payloads = PayloadFiles(self.sessions, self.settings.resolved_payload_uri())
        self._lineage = LineageCache(
            self.settings.lineage_cache_trajectories, self.settings.lineage_cache_mb << 20
        )
        self._write_lock = threading.Lock()
        self._statements = Statements(engine.dialect)
        # Committed steps that start a prefix break, by ``divergence_kind`` (the gateway's
        # ``trajgate_pool_prefix_breaks_total``); re-sends and retries are never counted.
        self.prefix_breaks: Counter[str] = Counter()

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
            call = replace(
                call, group_id=group_id or call.group_id, channel=channel or call.channel
            )
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
                # A Core transaction, not an ORM session: the write path is Core statements,
                # and the session's begin/commit machinery cost ~0.1 ms per batch.
                with self.engine.begin() as connection:
                    results, breaks = self._record_in(
                        connection, pending, trajectory_ids, writer_id
                    )
                self.prefix_breaks.update(breaks)
                return results
            except BaseException:
                for trajectory_id in trajectory_ids:
                    self._lineage.forget(trajectory_id)
                raise

    def _record_in(
        self,
        connection: Connection,
        pending: Sequence[PendingCall],
        trajectory_ids: list[str],
        writer_id: str | None,
    ) -> tuple[list[CallResult], list[str]]:
        """The transaction of ``record_calls``: lock (or create) the trajectories, bring their
        lineage memory up to date, turn each call of an open trajectory into rows, write them.
        Returns each call's result and the kind of each prefix break written."""
        if connection.dialect.name == "sqlite":
            # Take the write lock before reading the trajectories' state, so nothing can close
            # one between this read and the insert (PostgreSQL locks the rows FOR UPDATE).
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        now = utc_now()
        state = lock_trajectories(connection, self._statements, pending, trajectory_ids, now)
        # Held here, not looked up in the LRU per call: a batch may span more trajectories than
        # the LRU keeps.
        memory: dict[str, TrajectoryTokens] = {}
        for trajectory_id in trajectory_ids:
            status, call_count, _flags = state[trajectory_id]
            if status == TrajectoryStatus.OPEN:
                memory[trajectory_id] = self._refresh_lineage(connection, trajectory_id, call_count)
        batch = WriteBatch(state, now)
        results: list[CallResult] = []
        for p in pending:
            status = state[p.trajectory_id][0]
            if status == TrajectoryStatus.OPEN:
                results.append(self._steps_of_call(p, memory[p.trajectory_id], batch))
            else:
                batch.reject(p.trajectory_id)
                results.append(TrajectoryClosedError(p.trajectory_id, status))
        batch.write(connection, self._statements, writer_id)
        return results, batch.prefix_breaks

    @staticmethod
    def _steps_of_call(p: PendingCall, tokens: TrajectoryTokens, batch: WriteBatch) -> list[str]:
        """Add one call's rows to ``batch`` and return its step ids, one concept at a time;
        ``tokens`` is the lineage memory of its trajectory, updated with the new steps."""
        call = p.call
        prompt = None if call.prompt_token_ids is None else pack_ids(call.prompt_token_ids)
        placement = tokens.place(call, prompt)
        payload = encode_payload(prompt, placement.lineage, placement.parent_tokens, call.choices)
        request = request_delta(
            placement.parent_keys,
            call.request,
            call.upstream_request,
            call.history_field,
            call.canonical,
        )
        step_index = batch.next_step_index(p.trajectory_id)
        step_ids = batch.add_call(p.trajectory_id, call, step_index, placement, payload, request)
        tokens.remember(step_ids, call, placement, prompt, payload.responses, request)
        tokens.call_count = step_index + 1  # the count this batch commits (see _refresh_lineage)
        return step_ids

    def _refresh_lineage(
        self, connection: Connection, trajectory_id: str, call_count: int
    ) -> TrajectoryTokens:
        """The lineage memory of ``trajectory_id``, made to match the database, whose
        ``call_count`` (read under the write lock) says whether another process, an eviction or
        a restart left it behind: every batch that adds steps bumps it in the same
        transaction."""
        cached = self._lineage.get(trajectory_id)
        if cached is not None and cached.call_count == call_count:
            return cached
        if call_count == 0:
            tokens = TrajectoryTokens()  # no call yet, so no step to read
        else:
            # ORM reads on a miss only; the session joins the batch's transaction.
            with self.sessions(bind=connection) as session:
                rows = self._step_rows(session, trajectory_id)
                payloads = self._payloads_of(session, rows)
                expand_requests(session, rows)
                tokens = rebuilt(rows, payloads)
        tokens.call_count = call_count
        self._lineage.put(trajectory_id, tokens)
        return tokens

    def count_rejected(self, trajectory_id: str) -> None:
        """Count one call of ``trajectory_id`` refused before it was sampled (it was known
        closed: ``PoolWriter.check_open``) in ``rejected_calls``, by one ``UPDATE ... SET
        rejected_calls = rejected_calls + 1``: no read, so concurrent refusals and commits all
        count. Raises what the database raised."""
        with self.engine.begin() as connection:
            connection.execute(
                update(Trajectory)
                .where(Trajectory.id == trajectory_id)
                .values(rejected_calls=Trajectory.rejected_calls + 1)
            )

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
        return reconstruct(self.payloads.load(session, [_ref(r) for r in rows]))

    def steps_of(self, trajectory_id: str) -> list[StoredStep]:
        """Steps of a trajectory in call order, then choice order, with exact payloads."""
        with self.sessions() as session:
            rows = self._step_rows(session, trajectory_id)
            payloads = self._payloads_of(session, rows)
            expand_requests(session, rows)
        return [_stored(row, payloads[row.id]) for row in rows]

    def get_step(self, step_id: str) -> StoredStep | None:
        """One step with its exact payload and its bodies read back whole, or None.

        Loads the step's own row; of its ancestors only what their deltas need: the five
        columns that chain its prompt (``_chain_refs``), their token payloads, and their
        stored request deltas (``expand_requests``). Only this step's ids become lists.
        """
        return self._step(step_id, bodies=True)

    def _step(self, step_id: str, *, bodies: bool) -> StoredStep | None:
        """``get_step``; with ``bodies`` False the row's request, upstream request and
        canonical record stay as stored (deltas on the parent), which ``find_turn`` never
        reads."""
        with self.sessions() as session:
            row = session.get(Step, step_id)
            if row is None:
                return None
            payloads = reconstruct(
                self.payloads.load(session, self._chain_refs(session, row)), [row.id]
            )
            if bodies:
                expand_requests(session, [row])
        return _stored(row, payloads[row.id])

    def find_turn(self, trajectory_id: str, keys: Sequence[str]) -> StoredStep | None:
        """The trajectory's ok step whose ``turn_key`` is the first of ``keys`` that any step
        has (the latest step of those with it), with its exact payload; None when none has
        one. One indexed read, then the step's token delta chain (``get_step`` without its
        bodies: the returned row's request, upstream request and canonical record are as
        stored, deltas on its parent; its ``turn_key``, ``response_message`` and ids are
        whole)."""
        if not keys:
            return None
        with self.sessions() as session:
            found = session.execute(
                select(Step.turn_key, Step.id)
                .where(
                    Step.trajectory_id == trajectory_id,
                    Step.turn_key.in_(list(keys)),
                    Step.outcome == StepOutcome.OK,
                )
                .order_by(Step.step_index.desc(), Step.choice_index)
            ).all()
        if not found:
            return None
        first: dict[str | None, str] = {}
        for key, step_id in found:
            first.setdefault(key, step_id)
        step_id = next(first[key] for key in keys if key in first)
        return self._step(step_id, bodies=False)

    @staticmethod
    def _chain_refs(session: Session, row: Step) -> list[StepRef]:
        """``row`` and the ancestors its prompt delta is built on (``datapool.steps.chain``),
        as the payload columns of each: no ancestor's JSON is read or parsed."""
        by_id = {
            values[0]: StepRef(*values)
            for values in session.execute(
                select(
                    Step.id,
                    Step.trajectory_id,
                    Step.parent_step_id,
                    Step.prompt_base_tokens,
                    Step.payload_file_id,
                ).where(Step.trajectory_id == row.trajectory_id)
            )
        }
        by_id[row.id] = _ref(row)
        links, _absent = chain.walk(row.id, by_id, _prompt_based_on)
        # An absent ancestor is left for ``reconstruct`` to report (``PayloadMissingError``).
        return [link for _, link in links]

    def get_trajectory(self, trajectory_id: str) -> Trajectory | None:
        with self.sessions() as session:
            return session.get(Trajectory, trajectory_id)


def _stored(row: Step, payload: TokenPayload) -> StoredStep:
    return StoredStep(
        row, payload.prompt_token_ids, payload.response_token_ids, payload.response_logprobs
    )


def _ref(row: Step) -> StepRef:
    return StepRef(
        row.id, row.trajectory_id, row.parent_step_id, row.prompt_base_tokens, row.payload_file_id
    )


def _prompt_based_on(ref: StepRef) -> str | None:
    """The step whose sequence ``ref``'s prompt is a delta on; None when stored whole."""
    return ref.parent_step_id if ref.prompt_base_tokens else None
