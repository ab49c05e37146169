"""Leases: handing materialised batches to consumers exactly once each.

Owns: ``lease_next`` (atomically give a consumer the oldest ready batch it has not consumed and
nobody holds), ``renew`` (a consumer still working extends its lease: the expiry moves to
``lease_s`` from now, as a queue consumer extends a message's visibility), ``ack`` (the update
succeeded: recorded once per consumer, with the policy version it trained) and ``nack`` (give it
back now). State lives in SQL only, so leases survive gateway restarts and work across several
gateway processes. Never: reads or writes batch files.

Atomicity: on PostgreSQL the candidate row is taken with ``SELECT ... FOR UPDATE SKIP LOCKED``
(concurrent consumers skip each other's row instead of waiting or colliding); on SQLite one
``UPDATE ... WHERE id = (SELECT ...) RETURNING`` runs under the database's single writer lock.
Either way the UPDATE re-checks the lease condition, so two consumers never hold one batch.
An expired lease counts in ``expired_leases`` when the next consumer takes the batch over; a
renewal, ack or nack with a lease that expired (or was taken over) is refused with
``LeaseNotCurrentError`` (the gateway answers 409 ``lease_lost``; the trainer's client raises its
own ``trainer_bridge.client.LeaseLostError`` from that answer). An ack repeated with another
policy version than the one recorded is refused with ``AckConflictError`` (409 ``ack_conflict``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, exists, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from datapool.errors import InvalidPoolRequestError, PoolError, UnknownTargetError
from datapool.models import Batch, BatchConsumption, utc_now

LEASABLE = ("ready", "consumed", "leased")


class LeaseNotCurrentError(InvalidPoolRequestError):
    """The lease named in an ack/nack is not the batch's current, unexpired lease."""


class AckConflictError(InvalidPoolRequestError):
    """An ack repeated for a lease already acked, with another ``policy_version_trained``: not
    a retry of the recorded ack, and the recorded one stands."""


@dataclass(frozen=True)
class Lease:
    batch_id: str
    consumer: str
    lease_id: str
    expires_at: datetime
    uri: str | None
    rows: int
    tokens: int


def _eligible(consumer: str, now: datetime) -> Any:
    consumed = exists().where(
        BatchConsumption.batch_id == Batch.id, BatchConsumption.consumer == consumer
    )
    return and_(
        Batch.status.in_(LEASABLE),
        or_(Batch.lease_expires_at.is_(None), Batch.lease_expires_at < now),
        ~consumed,
    )


def lease_next(
    sessions: sessionmaker[Session], consumer: str, lease_s: float, batch_id: str | None = None
) -> Lease | None:
    """The next batch for ``consumer`` under a new lease of ``lease_s`` seconds, or None.

    ``batch_id`` restricts the choice to that batch (a trainer leasing the batch it just had
    materialised from its own spec, so it never picks up another channel's batch).
    """
    if not consumer or len(consumer) > 200:
        raise InvalidPoolRequestError(
            f"consumer must be 1-200 characters, got {consumer!r}", param="consumer"
        )
    if lease_s <= 0:
        raise InvalidPoolRequestError(f"lease_s must be > 0, got {lease_s}", param="lease_s")
    now = utc_now()
    lease_id = str(uuid.uuid4())
    expires_at = now + timedelta(seconds=lease_s)
    values = {
        "status": "leased",
        "lease_owner": consumer,
        "lease_id": lease_id,
        "lease_expires_at": expires_at,
        "leases": Batch.leases + 1,
        "expired_leases": Batch.expired_leases
        + case((Batch.lease_expires_at.is_not(None), 1), else_=0),
    }
    eligible = _eligible(consumer, now)
    if batch_id is not None:
        eligible = and_(eligible, Batch.id == batch_id)
    oldest = select(Batch.id).where(eligible).order_by(Batch.created_at, Batch.id)
    with sessions.begin() as session:
        if session.get_bind().dialect.name == "postgresql":
            batch_id = session.scalar(oldest.limit(1).with_for_update(skip_locked=True))
            if batch_id is None:
                return None
            target = Batch.id == batch_id
        else:
            target = Batch.id == oldest.limit(1).scalar_subquery()
        row = session.execute(
            update(Batch)
            .where(target, eligible)
            .values(**values)
            .returning(Batch.id, Batch.uri, Batch.rows, Batch.tokens)
            .execution_options(synchronize_session=False)
        ).first()
    if row is None:
        return None
    return Lease(row[0], consumer, lease_id, expires_at, row[1], row[2], row[3])


def _current(batch_id: str, consumer: str, lease_id: str, now: datetime) -> Any:
    """The batch's lease is this one and has not expired (an expired lease is lost even before
    another consumer takes the batch over: its consumer cannot know whether one did)."""
    return and_(
        Batch.id == batch_id,
        Batch.lease_id == lease_id,
        Batch.lease_owner == consumer,
        Batch.lease_expires_at >= now,
    )


def _not_current(session: Session, batch_id: str, consumer: str, lease_id: str) -> PoolError:
    if session.get(Batch, batch_id) is None:
        return UnknownTargetError(f"no batch {batch_id!r}", param="batch_id")
    return LeaseNotCurrentError(
        f"lease {lease_id!r} of {consumer!r} on batch {batch_id} is not current (expired, "
        "released or taken over); lease the next batch instead",
        param="lease_id",
    )


def _release(session: Session, batch_id: str, consumer: str, lease_id: str, status: Any) -> None:
    released = session.execute(
        update(Batch)
        .where(_current(batch_id, consumer, lease_id, utc_now()))
        .values(status=status, lease_owner=None, lease_id=None, lease_expires_at=None)
        .returning(Batch.id)
        .execution_options(synchronize_session=False)
    ).first()
    if released is None:
        raise _not_current(session, batch_id, consumer, lease_id)


def renew(
    sessions: sessionmaker[Session], batch_id: str, consumer: str, lease_id: str, lease_s: float
) -> Lease:
    """Extend ``consumer``'s current lease on the batch to ``lease_s`` seconds from now (it may
    end earlier than before: the consumer says how long it still needs); the lease id stays.

    Raises:
        InvalidPoolRequestError: ``lease_s`` <= 0.
        UnknownTargetError: no such batch.
        LeaseNotCurrentError: the lease expired, was released or was taken over (the gateway
            answers 409 ``lease_lost``); a lost lease is never revived, so a consumer that
            stalled past its expiry learns it here, before it acks.
    """
    if lease_s <= 0:
        raise InvalidPoolRequestError(f"lease_s must be > 0, got {lease_s}", param="lease_s")
    now = utc_now()
    expires_at = now + timedelta(seconds=lease_s)
    with sessions.begin() as session:
        row = session.execute(
            update(Batch)
            .where(_current(batch_id, consumer, lease_id, now))
            .values(lease_expires_at=expires_at)
            .returning(Batch.uri, Batch.rows, Batch.tokens)
            .execution_options(synchronize_session=False)
        ).first()
        if row is None:
            raise _not_current(session, batch_id, consumer, lease_id)
    return Lease(batch_id, consumer, lease_id, expires_at, row[0], row[1], row[2])


def ack(
    sessions: sessionmaker[Session],
    batch_id: str,
    consumer: str,
    lease_id: str,
    policy_version_trained: int | None,
) -> None:
    """Record that ``consumer`` trained on the batch (once); the lease ends.

    Idempotent for a retry of the same ack (same consumer, lease id and policy version trained
    already recorded): a consumer whose ack reached the pool but whose answer was lost retries
    and is told it is done, not that its lease was lost.

    Raises:
        LeaseNotCurrentError: the lease is not current and this ack was not recorded before.
        AckConflictError: this lease's ack is recorded with another ``policy_version_trained``
            (the gateway answers 409 ``ack_conflict``); the recorded version is kept, since the
            lineage of every step in the batch already names it.
    """
    with sessions.begin() as session:
        recorded = session.execute(
            select(BatchConsumption.policy_version_trained).where(
                BatchConsumption.batch_id == batch_id,
                BatchConsumption.consumer == consumer,
                BatchConsumption.lease_id == lease_id,
            )
        ).first()
        if recorded is not None:
            if recorded[0] != policy_version_trained:
                raise AckConflictError(
                    f"lease {lease_id!r} of {consumer!r} on batch {batch_id} was acked with "
                    f"policy_version_trained {recorded[0]}, got {policy_version_trained}; a "
                    "retry must repeat the recorded ack",
                    param="policy_version_trained",
                )
            return
        _release(session, batch_id, consumer, lease_id, "consumed")
        session.add(
            BatchConsumption(
                batch_id=batch_id,
                consumer=consumer,
                lease_id=lease_id,
                policy_version_trained=policy_version_trained,
                acked_at=utc_now(),
            )
        )


def nack(sessions: sessionmaker[Session], batch_id: str, consumer: str, lease_id: str) -> None:
    """Give the batch back now (the update failed); the next lease may take it."""
    consumed = exists().where(BatchConsumption.batch_id == batch_id)
    with sessions.begin() as session:
        _release(session, batch_id, consumer, lease_id, case((consumed, "consumed"), else_="ready"))
