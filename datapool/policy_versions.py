"""The ``policy_versions`` table: which weights exist, and which one the policy alias serves.

Owns: registering a version (idempotent for identical fields, a conflict for others: one
version is one weight set), making one version the only active one, and listing them in version
order. Never: loads weights or resolves a request's
model name (``gateway.upstream.policy`` keeps the in-memory view the gateway resolves against).
"""

from __future__ import annotations

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError

from datapool.db import Sessions
from datapool.errors import VersionConflictError
from datapool.models import PolicyVersion, utc_now


def list_versions(sessions: Sessions) -> list[PolicyVersion]:
    """Every registered version, lowest version first."""
    with sessions() as session:
        return list(session.scalars(select(PolicyVersion).order_by(PolicyVersion.version)))


def register(
    sessions: Sessions, version: int, model_name: str, weights_location: str | None
) -> tuple[PolicyVersion, bool]:
    """Add ``version`` as inactive, or return it unchanged when it exists with the same fields.

    One version is one weight set: the row is inserted first and the primary key decides, so of
    concurrent registrations of one version (threads, gateway workers, replicas sharing the
    database) exactly one inserts it; the others then compare against the stored row.

    Returns:
        (the stored row, True when this call inserted it).

    Raises:
        VersionConflictError: the version exists with another model name or weights
            location (``param="version"``); the stored row is unchanged.
    """
    try:
        with sessions.begin() as session:
            row = PolicyVersion(
                version=version,
                model_name=model_name,
                weights_location=weights_location,
                active=False,
                created_at=utc_now(),
            )
            session.add(row)
        return row, True
    except IntegrityError:
        pass  # the version exists (maybe inserted a moment ago by another writer): compare
    with sessions() as session:
        stored = session.get(PolicyVersion, version)
    if stored is None:  # deleted in between (a failed reload gave its claim back): try again
        return register(sessions, version, model_name, weights_location)
    sent = (model_name, weights_location)
    if (stored.model_name, stored.weights_location) != sent:
        raise VersionConflictError(
            f"policy version {version} is already registered with model_name "
            f"{stored.model_name!r} and weights_location {stored.weights_location!r}, not "
            f"{model_name!r} and {weights_location!r}: one version is one weight set, publish "
            "other weights under a new version (an identical re-send is accepted)",
            param="version",
        )
    return stored, False


def unregister_unused(sessions: Sessions, version: int) -> None:
    """Delete ``version`` if it was never activated (a publish whose reload failed gives back
    the version it claimed with ``register``); an activated version is kept."""
    with sessions.begin() as session:
        session.execute(
            delete(PolicyVersion).where(
                PolicyVersion.version == version, PolicyVersion.activated_at.is_(None)
            )
        )


def activate(sessions: Sessions, version: int) -> PolicyVersion | None:
    """Make ``version`` the only active one (stamped ``activated_at`` now), in one transaction;
    None when no such version is registered (nothing changes then)."""
    with sessions.begin() as session:
        row = session.get(PolicyVersion, version)
        if row is None:
            return None
        session.execute(update(PolicyVersion).values(active=False))
        row.active = True
        row.activated_at = utc_now()
    return row
