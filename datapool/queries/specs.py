"""Which batch spec a trajectory's readiness is judged against, named so people can see it.

Owns: ``judged_spec``: a chosen batch's spec (``batch_id``), chosen reward names, or by default
the spec of the most recent batch of the trajectory's channel; when the channel has no batch
yet, the pool's most recently recorded trajectory reward name (never a name nothing carries,
so a trajectory's rewards and its readiness do not contradict each other). Never: builds
batches or decides readiness itself (``datapool.curation.readiness``).

Readiness depends on a spec only through its ``reward_names`` (every one must be current).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from datapool.errors import UnknownTargetError
from datapool.models import Batch
from datapool.queries.rewards import reward_names

RECENT_BATCHES = 200
SPEC_CHOICES = 20
DEFAULT_REWARD = "final"  # BatchSpec's default reward_names


def _described(batch: Batch) -> dict[str, Any]:
    return {
        "source": "batch",
        "batch_id": batch.id,
        "name": batch.name,
        "channel": batch.spec.get("channel", "train"),
        "reward_names": list(batch.spec.get("reward_names") or [DEFAULT_REWARD]),
        "created_at": batch.created_at.isoformat(),
    }


def channel_specs(session: Session, channel: str) -> list[dict[str, Any]]:
    """The specs of the channel's newest batches (at most 20 among the newest 200 of any
    channel), newest first, each ``{source: 'batch', batch_id, name, channel, reward_names,
    created_at}``."""
    batches = session.scalars(
        select(Batch).order_by(Batch.created_at.desc(), Batch.id).limit(RECENT_BATCHES)
    )
    found = [_described(b) for b in batches if b.spec.get("channel", "train") == channel]
    return found[:SPEC_CHOICES]


def judged_spec(
    session: Session,
    channel: str,
    *,
    batch_id: str | None = None,
    chosen_rewards: Sequence[str] = (),
) -> dict[str, Any]:
    """The spec readiness is judged against, ``{source, batch_id, name, channel,
    reward_names, created_at}``: ``source`` is ``batch`` (``batch_id``'s spec, or the newest of
    ``channel``), ``chosen`` (``chosen_rewards``), or ``pool`` (no batch of the channel yet: the
    pool's most recently recorded trajectory reward, ``final`` in an unrewarded pool).

    Raises ``UnknownTargetError`` for a ``batch_id`` that is not a batch."""
    if batch_id is not None:
        batch = session.get(Batch, batch_id)
        if batch is None:
            raise UnknownTargetError(f"no batch {batch_id!r}", param="batch_id")
        return _described(batch)
    if chosen_rewards:
        return {
            "source": "chosen",
            "batch_id": None,
            "name": None,
            "channel": channel,
            "reward_names": list(chosen_rewards),
            "created_at": None,
        }
    specs = channel_specs(session, channel)
    if specs:
        return specs[0]
    names = reward_names(session)
    return {
        "source": "pool",
        "batch_id": None,
        "name": None,
        "channel": channel,
        "reward_names": names[:1] or [DEFAULT_REWARD],
        "created_at": None,
    }
