"""Writes captured calls into the pool and reads steps back.

Owns: the transaction that turns one ``CallRecord`` into steps (trajectory created on first use,
step numbered, parent chosen by token lineage). Never: tokenizes, or writes half a call: every
step of a call commits in one transaction or none does.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from datapool.db import make_sessionmaker
from datapool.models import Step, StepOutcome, Trajectory, utc_now
from datapool.prefix import (
    RETOKENISED,
    Candidate,
    Lineage,
    choose_parent,
    classify_divergence,
    divergence_window,
)
from datapool.records import CallRecord


class PoolStore:
    """The pool's write and read API over one SQL engine (SQLite or PostgreSQL)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sessions: sessionmaker[Session] = make_sessionmaker(engine)

    def record_call(
        self,
        trajectory_id: str,
        call: CallRecord,
        *,
        group_id: str | None = None,
        channel: str | None = None,
    ) -> list[str]:
        """Commit one call as one step per choice and return the step ids (in choice order).

        A failed call (``call.outcome != "ok"``) is still recorded, as one step with the error, so
        the trajectory shows what happened; it never becomes a parent.
        """
        group_id = group_id or call.group_id
        channel = channel or call.channel
        with self.sessions.begin() as session:
            self._ensure_trajectory(session, trajectory_id, group_id, channel)
            step_index = (
                session.execute(
                    update(Trajectory)
                    .where(Trajectory.id == trajectory_id)
                    .values(call_count=Trajectory.call_count + 1)
                    .returning(Trajectory.call_count)
                ).scalar_one()
                - 1
            )
            lineage, kind, detail = self._lineage(session, trajectory_id, call)
            step_ids: list[str] = []
            for choice in call.choices:
                flags = list(choice.flags)
                if lineage.extends_parent is False:
                    flags.append("prefix_break")
                step = Step(
                    id=str(uuid.uuid4()),
                    trajectory_id=trajectory_id,
                    parent_step_id=lineage.parent_step_id,
                    call_id=call.call_id,
                    endpoint=call.endpoint,
                    request_hash=call.request_hash,
                    idempotency_key=call.idempotency_key,
                    step_index=step_index,
                    choice_index=choice.choice_index,
                    policy_version=call.policy_version,
                    model=call.model,
                    upstream=call.upstream,
                    outcome=call.outcome,
                    error=call.error,
                    request=call.request,
                    upstream_request=call.upstream_request,
                    response_message=choice.response_message,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                    prompt_tokens=call.prompt_tokens,
                    completion_tokens=(
                        len(choice.response_token_ids)
                        if choice.response_token_ids is not None
                        else None
                    ),
                    latency_ms=call.latency_ms,
                    ttft_ms=call.ttft_ms,
                    flags=flags,
                    extends_parent=lineage.extends_parent,
                    divergence_offset=lineage.divergence_offset,
                    divergence_kind=kind,
                    divergence_detail=detail,
                    prompt_token_ids=call.prompt_token_ids,
                    response_token_ids=choice.response_token_ids,
                    response_logprobs=choice.response_logprobs,
                )
                session.add(step)
                step_ids.append(step.id)
            return step_ids

    def _lineage(
        self, session: Session, trajectory_id: str, call: CallRecord
    ) -> tuple[Lineage, str | None, dict[str, Any] | None]:
        """Parent, extends flag, and for a break its kind and a window of both sides."""
        if call.prompt_token_ids is None or call.outcome != StepOutcome.OK:
            latest = session.scalar(
                select(Step.id)
                .where(Step.trajectory_id == trajectory_id)
                .order_by(Step.step_index.desc(), Step.choice_index)
                .limit(1)
            )
            return Lineage(latest, None, None), None, None
        candidates = self._candidates(session, trajectory_id)
        lineage = choose_parent(candidates, call.prompt_token_ids)
        if lineage.extends_parent is not False or lineage.divergence_offset is None:
            return lineage, None, None
        parent = session.get(Step, lineage.parent_step_id)
        assert parent is not None
        new_messages = call.request.get("messages")
        kind = (
            classify_divergence(
                parent.request.get("messages") or [], parent.response_message, new_messages
            )
            if isinstance(new_messages, list)
            else RETOKENISED
        )
        parent_sequence = candidates[-1].sequence
        detail = divergence_window(
            parent_sequence, call.prompt_token_ids, lineage.divergence_offset
        )
        return lineage, kind, detail

    def _ensure_trajectory(
        self, session: Session, trajectory_id: str, group_id: str | None, channel: str | None
    ) -> None:
        values: dict[str, Any] = {
            "id": trajectory_id,
            "group_id": group_id,
            "channel": channel or "train",
            "status": "open",
            "metadata_json": {},
            "call_count": 0,
            "created_at": utc_now(),
        }
        dialect = session.get_bind().dialect.name
        if dialect == "postgresql":
            stmt: Any = postgresql.insert(Trajectory).values(values).on_conflict_do_nothing()
        elif dialect == "sqlite":
            stmt = sqlite.insert(Trajectory).values(values).on_conflict_do_nothing()
        else:
            raise ValueError(
                f"unsupported database dialect {dialect!r}; expected sqlite or postgresql"
            )
        session.execute(stmt)

    @staticmethod
    def _candidates(session: Session, trajectory_id: str) -> Sequence[Candidate]:
        rows = session.execute(
            select(Step.id, Step.prompt_token_ids, Step.response_token_ids)
            .where(
                Step.trajectory_id == trajectory_id,
                Step.outcome == StepOutcome.OK,
                Step.prompt_token_ids.is_not(None),
                Step.response_token_ids.is_not(None),
            )
            .order_by(Step.step_index, Step.choice_index)
        ).all()
        return [Candidate(step_id, [*prompt, *response]) for step_id, prompt, response in rows]

    def get_step(self, step_id: str) -> Step | None:
        with self.sessions() as session:
            return session.get(Step, step_id)

    def steps_of(self, trajectory_id: str) -> list[Step]:
        """Steps of a trajectory in call order, then choice order."""
        with self.sessions() as session:
            return list(
                session.scalars(
                    select(Step)
                    .where(Step.trajectory_id == trajectory_id)
                    .order_by(Step.step_index, Step.choice_index)
                )
            )

    def get_trajectory(self, trajectory_id: str) -> Trajectory | None:
        with self.sessions() as session:
            return session.get(Trajectory, trajectory_id)
