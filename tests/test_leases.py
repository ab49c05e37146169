"""Leases on SQLite and PostgreSQL: an expired lease returns the batch exactly once, concurrent
consumers never hold the same batch, a batch is trained on once per consumer, and lease state
is only in SQL (a fresh store, as after a gateway restart, sees it); a renewed lease outlives its
first expiry, and only the current unexpired lease is renewed."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from batch_helpers import agent_turns, make_store, write_trajectory

from datapool.batches import leases
from datapool.batches.build import BatchSpec, materialise
from datapool.batches.settings import BatchSettings
from datapool.errors import InvalidPoolRequestError, UnknownTargetError
from datapool.models import Batch
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore


def make_batches(store: PoolStore, tmp_path: Path, n: int) -> list[str]:
    settings = BatchSettings(batch_uri=str(tmp_path / "batches"))
    ids = []
    for i in range(n):
        write_trajectory(store, f"t{i}", agent_turns(i + 1, 2), reward=float(i))
        spec = BatchSpec(algorithm="sft", filters={"trajectory_ids": [f"t{i}"]})
        ids.append(materialise(store, spec, settings).id)
    return ids


def test_an_expired_lease_returns_the_batch_exactly_once(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = make_store(pool_settings)
    [batch_id] = make_batches(store, tmp_path, 1)
    # 2 s: long enough that the check below runs before expiry on a loaded machine
    first = leases.lease_next(store.sessions, "crashed-trainer", 2.0)
    assert first is not None and first.batch_id == batch_id
    assert leases.lease_next(store.sessions, "other", 60) is None  # held, not expired
    time.sleep(2.2)  # the crashed trainer never acks
    got: list[leases.Lease | None] = []
    barrier = threading.Barrier(4)

    def take(consumer: str) -> None:
        barrier.wait()
        got.append(leases.lease_next(make_store(pool_settings).sessions, consumer, 60))

    threads = [threading.Thread(target=take, args=(f"c{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    winners = [lease for lease in got if lease is not None]
    assert len(winners) == 1 and winners[0].batch_id == batch_id
    with pytest.raises(leases.LeaseNotCurrentError):  # the late ack of the expired lease is refused
        leases.ack(store.sessions, batch_id, "crashed-trainer", first.lease_id, 1)
    leases.ack(store.sessions, batch_id, winners[0].consumer, winners[0].lease_id, 1)
    with make_store(pool_settings).sessions() as session:  # a fresh store: state is in SQL
        batch = session.get(Batch, batch_id)
        assert batch is not None
        assert (batch.status, batch.leases, batch.expired_leases) == ("consumed", 2, 1)


def test_concurrent_consumers_never_share_a_batch_and_each_trains_once(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = make_store(pool_settings)
    batch_ids = make_batches(store, tmp_path, 5)
    held: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def consume(consumer: str) -> None:
        own = make_store(pool_settings)
        barrier.wait()
        try:
            while (lease := leases.lease_next(own.sessions, consumer, 60)) is not None:
                held.setdefault(consumer, []).append(lease.batch_id)  # held, never acked
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(f"c{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    taken = [b for bs in held.values() for b in bs]
    assert sorted(taken) == sorted(batch_ids)  # each batch held by exactly one consumer

    # acked by its holder, a batch goes to other consumers but never back to the same one
    [(consumer, [batch_id, *_])] = list(held.items())[:1]
    with store.sessions() as session:
        lease_id = session.get(Batch, batch_id).lease_id  # type: ignore[union-attr]
    assert lease_id is not None
    leases.ack(store.sessions, batch_id, consumer, lease_id, 3)
    again = leases.lease_next(store.sessions, consumer, 60)
    assert again is None or again.batch_id != batch_id
    other = leases.lease_next(store.sessions, "late-consumer", 60)
    assert other is not None and other.batch_id == batch_id


def test_nack_gives_the_batch_back_at_once(pool_settings: PoolSettings, tmp_path: Path) -> None:
    store = make_store(pool_settings)
    [batch_id] = make_batches(store, tmp_path, 1)
    lease = leases.lease_next(store.sessions, "a", 60)
    assert lease is not None
    leases.nack(store.sessions, batch_id, "a", lease.lease_id)
    again = leases.lease_next(store.sessions, "a", 60)
    assert again is not None and again.batch_id == batch_id and again.lease_id != lease.lease_id
    with pytest.raises(leases.LeaseNotCurrentError):
        leases.nack(store.sessions, batch_id, "a", lease.lease_id)


def test_a_consumer_can_lease_exactly_the_batch_it_asked_for(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    # Found by the demo: a control trainer leasing "its next batch" got the other arm's older one.
    store = make_store(pool_settings)
    older, newer = make_batches(store, tmp_path, 2)
    lease = leases.lease_next(store.sessions, "control", 60, batch_id=newer)
    assert lease is not None and lease.batch_id == newer
    assert leases.lease_next(store.sessions, "control", 60, batch_id=newer) is None  # held
    leases.ack(store.sessions, newer, "control", lease.lease_id, 1)
    assert leases.lease_next(store.sessions, "control", 60, batch_id=newer) is None  # consumed
    untouched = leases.lease_next(store.sessions, "control", 60)
    assert untouched is not None and untouched.batch_id == older


def test_a_renewed_lease_outlives_its_first_expiry_and_is_still_acked_once(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = make_store(pool_settings)
    [batch_id] = make_batches(store, tmp_path, 1)
    lease = leases.lease_next(store.sessions, "slow-trainer", 2.0)
    assert lease is not None
    renewed = leases.renew(store.sessions, batch_id, "slow-trainer", lease.lease_id, 60)
    assert renewed.lease_id == lease.lease_id
    # 2 s lease, renewed to 60 s from a moment later: at least 58 s further on
    assert (renewed.expires_at - lease.expires_at).total_seconds() >= 58
    time.sleep(2.2)  # past the first expiry
    assert leases.lease_next(store.sessions, "other", 60) is None  # still held
    leases.ack(store.sessions, batch_id, "slow-trainer", lease.lease_id, 3)
    with make_store(pool_settings).sessions() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        assert (batch.status, batch.leases, batch.expired_leases) == ("consumed", 1, 0)


def test_only_the_current_unexpired_lease_is_renewed(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = make_store(pool_settings)
    [batch_id] = make_batches(store, tmp_path, 1)
    lease = leases.lease_next(store.sessions, "a", 1.0)
    assert lease is not None
    with pytest.raises(leases.LeaseNotCurrentError):  # another consumer's name
        leases.renew(store.sessions, batch_id, "b", lease.lease_id, 60)
    with pytest.raises(InvalidPoolRequestError):
        leases.renew(store.sessions, batch_id, "a", lease.lease_id, 0)
    with pytest.raises(UnknownTargetError):
        leases.renew(store.sessions, "no-such-batch", "a", lease.lease_id, 60)
    time.sleep(1.2)  # expired, nobody has taken it over yet: lost all the same
    with pytest.raises(leases.LeaseNotCurrentError):
        leases.renew(store.sessions, batch_id, "a", lease.lease_id, 60)
    again = leases.lease_next(store.sessions, "a", 60)
    assert again is not None
    leases.ack(store.sessions, batch_id, "a", again.lease_id, 1)
    with pytest.raises(leases.LeaseNotCurrentError):  # acked: the lease ended
        leases.renew(store.sessions, batch_id, "a", again.lease_id, 60)
