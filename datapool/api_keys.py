"""The ``api_keys`` table: agents' keys, stored only as hashes, and what each is bound to.

Owns: adding a key row, revoking one, listing them, and finding the unrevoked key with a hash.
Never: sees a key in clear, makes keys or hashes them (``gateway.auth`` does both and caches
verified keys).
"""

from __future__ import annotations

from sqlalchemy import select, update

from datapool.db import Sessions
from datapool.models import ApiKey, utc_now


def add_key(
    sessions: Sessions,
    key_id: str,
    name: str,
    key_hash: str,
    trajectory_id: str | None,
    channel: str | None,
) -> None:
    """Store a new key's hash and bindings (``trajectory_id``/``channel``: None allows any)."""
    with sessions.begin() as session:
        session.add(
            ApiKey(
                id=key_id,
                name=name,
                key_hash=key_hash,
                trajectory_id=trajectory_id,
                channel=channel,
                created_at=utc_now(),
            )
        )


def revoke_key(sessions: Sessions, key_id: str) -> bool:
    """Stamp ``revoked_at`` on the key; False when no key has ``key_id``."""
    with sessions.begin() as session:
        result = session.execute(
            update(ApiKey).where(ApiKey.id == key_id).values(revoked_at=utc_now())
        )
        return bool(result.rowcount)  # type: ignore[attr-defined]


def list_keys(sessions: Sessions) -> list[ApiKey]:
    """Every key, revoked ones too, oldest first."""
    with sessions() as session:
        return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at)))


def active_key(sessions: Sessions, key_hash: str) -> ApiKey | None:
    """The unrevoked key whose hash is ``key_hash``, or None."""
    with sessions() as session:
        return session.scalar(
            select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
        )
