"""Logical calls: upstream attempts, Idempotency-Key replays, and re-send detection (case C13).

Owns: the ``call_attempts`` table, the queries that link a repeated request to the call it
repeats, and the read of an earlier call's exchange a new request continues (``find_exchange``:
the Responses API's ``previous_response_id``). Never: creates steps (``datapool.steps.store``
does); a failed attempt is never a step.

Case codes (Cnn) are defined in docs/capture-cases.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import Engine, bindparam, insert, select
from sqlalchemy.orm import Session, sessionmaker

from datapool.models import CallAttempt, Step, StepOutcome, utc_now
from datapool.steps.messages import expand_requests
from datapool.steps.records import AttemptRecord

__all__ = [
    "AttemptRecord",
    "Replay",
    "attempt_rows",
    "find_exchange",
    "find_replay",
    "find_resend",
    "record_attempts",
]


def attempt_rows(attempts: Iterable[AttemptRecord], created_at: datetime) -> list[dict[str, Any]]:
    """``call_attempts`` rows for a Core ``insert`` (the writer's batch uses them too)."""
    return [
        {
            "id": a.id,
            "call_id": a.call_id,
            "trajectory_id": a.trajectory_id,
            "attempt_index": a.attempt_index,
            "upstream": a.upstream,
            "status_code": a.status_code,
            "outcome": a.outcome,
            "error": a.error,
            "latency_ms": a.latency_ms,
            "idempotency_key": a.idempotency_key,
            "response_body": a.response_body,
            "created_at": created_at,
        }
        for a in attempts
    ]


def record_attempts(sessions: sessionmaker[Session], attempts: list[AttemptRecord]) -> None:
    """Commit the attempts of one call in one transaction (calls through ``PoolWriter`` carry
    them in ``CallRecord.attempts`` instead, committed with their steps)."""
    if not attempts:
        return
    with sessions.begin() as session:
        session.execute(insert(CallAttempt), attempt_rows(attempts, utc_now()))


class Replay(NamedTuple):
    """The stored answer of an earlier call with an Idempotency-Key, and what names it."""

    call_id: str
    response_body: dict[str, Any]
    request_hash: str | None  # its step's (None for a step stored without one)
    step_ids: list[str]  # its steps, by choice index: what x-trajgate-step-id named
    policy_version: int | None  # the version its steps are stamped with (None: unknown)


def find_replay(
    sessions: sessionmaker[Session], trajectory_id: str, idempotency_key: str
) -> Replay | None:
    """The successful call of ``trajectory_id`` with this key, if any: its answer, request hash,
    step ids and policy version (a replay names the steps the first answer named, so a client
    whose first answer was lost can still attach rewards to them)."""
    with sessions() as session:
        row = session.execute(
            select(CallAttempt.call_id, CallAttempt.response_body)
            .where(
                CallAttempt.trajectory_id == trajectory_id,
                CallAttempt.idempotency_key == idempotency_key,
                CallAttempt.outcome == StepOutcome.OK,
                CallAttempt.response_body.is_not(None),
            )
            .order_by(CallAttempt.created_at.desc())
            .limit(1)
        ).first()
        if row is None:
            return None
        steps = session.execute(
            select(Step.id, Step.request_hash, Step.policy_version)
            .where(Step.trajectory_id == trajectory_id, Step.call_id == row[0])
            .order_by(Step.choice_index)
        ).all()
    return Replay(
        call_id=row[0],
        response_body=row[1],
        request_hash=steps[0][1] if steps else None,
        step_ids=[step[0] for step in steps],
        policy_version=steps[0][2] if steps else None,
    )


# Built once: the statement is the same for every call, only its parameters change.
_RESEND_OF = (
    select(Step.call_id)
    .where(
        Step.trajectory_id == bindparam("trajectory_id"),
        Step.request_hash == bindparam("request_hash"),
        Step.created_at >= bindparam("since"),
    )
    .order_by(Step.step_index.desc())
    .limit(1)
)


def find_resend(
    engine: Engine, trajectory_id: str, request_hash: str, window_s: float
) -> str | None:
    """The call id of a step of this trajectory with the same request hash in the last
    ``window_s`` seconds: the new request is a re-send of that call.

    Asked before every call goes upstream, so it runs on a plain connection: an ORM session
    cost about six times the CPU of the query itself (426 against 73 us on the 2-core machine).
    """
    since: datetime = utc_now() - timedelta(seconds=window_s)
    params = {"trajectory_id": trajectory_id, "request_hash": request_hash, "since": since}
    with engine.connect() as connection:
        found: str | None = connection.execute(_RESEND_OF, params).scalar()
    return found


def find_exchange(
    sessions: sessionmaker[Session], trajectory_id: str, named: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]] | None:
    """``(request, upstream_request, response_message)`` of the trajectory's step ``named``,
    or else (a reference handed out before references named steps) of its call ``named``'s
    latest step; either way an ok first-choice step that has a response message, both
    requests read back whole (``datapool.steps.messages.expand_requests``). None when the
    trajectory has no such step. A step id and a call id never coincide (both random UUIDs)."""
    answered = (
        Step.trajectory_id == trajectory_id,
        Step.choice_index == 0,
        Step.outcome == StepOutcome.OK,
        Step.response_message.is_not(None),
    )
    with sessions() as session:
        row = session.scalars(select(Step).where(Step.id == named, *answered)).first()
        if row is None:
            row = session.scalars(
                select(Step)
                .where(Step.call_id == named, *answered)
                .order_by(Step.step_index.desc())
                .limit(1)
            ).first()
        if row is None or row.response_message is None:
            return None
        expand_requests(session, [row])
        return row.request, row.upstream_request or {}, row.response_message
