"""The ``policy_versions`` table: which weights exist, and which one the policy alias serves.

Owns: registering a version (idempotent for identical fields), making one version the only
active one, and listing them in version order. Never: loads weights or resolves a request's
model name (``gateway.upstream.policy`` keeps the in-memory view the gateway resolves against).
"""

from __future__ import annotations

from sqlalchemy import select, update

from datapool.db import Sessions
from datapool.errors import InvalidPoolRequestError
from datapool.models import PolicyVersion, utc_now


def list_versions(sessions: Sessions) -> list[PolicyVersion]:
    """Every registered version, lowest version first."""
    with sessions() as session:
        return list(session.scalars(select(PolicyVersion).order_by(PolicyVersion.version)))


def register(
    sessions: Sessions, version: int, model_name: str, weights_location: str | None
) -> PolicyVersion:
    """Add ``version`` as inactive, or return it unchanged when it exists with ``model_name``.

    Raises:
        InvalidPoolRequestError: the version exists with a different model name
            (``param="version"``).
    """
    with sessions.begin() as session:
        row = session.get(PolicyVersion, version)
        if row is not None and row.model_name != model_name:
            raise InvalidPoolRequestError(
                f"policy version {version} is already registered for model "
                f"{row.model_name!r}, not {model_name!r}",
                param="version",
            )
        if row is None:
            row = PolicyVersion(
                version=version,
                model_name=model_name,
                weights_location=weights_location,
                active=False,
                created_at=utc_now(),
            )
            session.add(row)
    return row


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
