"""Lease renewal through a real gateway's pool API, on SQLite and PostgreSQL: a consumer still
working extends its lease (``POST /api/batches/{id}/renew``), one no longer held is refused with
409 ``lease_lost``; ``LeaseKeeper`` (what every trainer path uses) keeps a lease alive past its
first expiry while a slow update runs, and a lease lost anyway is said in one line and the batch
is counted once, never a traceback.

The slow update is a sleep (the trainer's own update is not what is tested, only that the
lease outlives it); the one wait of each test is measured against the pool's own expiry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from batch_helpers import agent_turns, make_store, write_trajectory
from gateway_helpers import gateway_with
from tests_support import free_port

from datapool.batches.build import BatchSpec, materialise
from datapool.batches.settings import BatchSettings
from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trainer_bridge.client import LeasedBatch, LeaseLostError, PoolClient, PoolClientError
from trainer_bridge.leases import LeaseKeeper


@pytest.fixture
def server(pool_settings: PoolSettings, tmp_path: Path) -> Iterator[BackgroundServer]:
    """A real gateway over a pool holding two ready batches."""
    store = make_store(pool_settings)
    settings = BatchSettings(batch_uri=str(tmp_path / "batches"))
    for i in range(2):
        write_trajectory(store, f"t{i}", agent_turns(i + 1, 2), reward=float(i))
        spec = BatchSpec(algorithm="sft", filters={"trajectory_ids": [f"t{i}"]})
        materialise(store, spec, settings)
    with gateway_with(pool_settings, free_port()) as gateway:
        yield gateway


@pytest.fixture
def pool(server: BackgroundServer) -> Iterator[PoolClient]:
    with PoolClient(server.url) as client:
        yield client


@pytest.fixture
def api(server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def _at(iso: str) -> datetime:
    at = datetime.fromisoformat(iso)
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def _wait_past(lease: LeasedBatch, extra_s: float) -> None:
    """Sleep until ``extra_s`` past the lease's expiry as the pool first set it (the slow
    update, or the stall)."""
    time.sleep(max(0.0, (_at(lease.expires_at) - datetime.now(UTC)).total_seconds()) + extra_s)


def _consumers(api: httpx.Client, batch_id: str) -> list[tuple[str, int | None]]:
    detail = api.get(f"/api/batches/{batch_id}").json()
    return [(c["consumer"], c["policy_version_trained"]) for c in detail["consumed_by"]]


def test_renew_extends_a_held_lease_and_answers_409_lease_lost_once_it_is_not_held(
    pool: PoolClient, api: httpx.Client
) -> None:
    lease = pool.lease("trainer", lease_s=60)
    assert lease is not None
    renewed = pool.renew(lease, lease_s=3600)
    assert (renewed.batch_id, renewed.lease_id) == (lease.batch_id, lease.lease_id)
    assert (_at(renewed.expires_at) - _at(lease.expires_at)).total_seconds() > 3000
    http = api
    body = {"consumer": "trainer", "lease_id": lease.lease_id}
    # bounded like a lease: TRAJGATE_LEASE_MAX_S (86,400 s by default)
    too_long = http.post(f"/api/batches/{lease.batch_id}/renew", json={**body, "lease_s": 86_401})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "lease_s"
    someone_else = http.post(
        f"/api/batches/{lease.batch_id}/renew", json={**body, "consumer": "other"}
    )
    assert someone_else.status_code == 409
    assert someone_else.json()["error"]["code"] == "lease_lost"
    unknown = http.post("/api/batches/no-such-batch/renew", json=body)
    assert unknown.status_code == 404
    pool.nack(lease)
    with pytest.raises(LeaseLostError):  # released: renewing it would revive a lease nobody holds
        pool.renew(lease)


def test_an_expired_lease_is_not_renewed_even_before_anyone_takes_it_over(
    pool: PoolClient,
) -> None:
    lease = pool.lease("stalled-trainer", lease_s=1)
    assert lease is not None
    _wait_past(lease, 0.2)
    with pytest.raises(LeaseLostError):
        pool.renew(lease, lease_s=60)


def test_a_keeper_holds_a_lease_past_its_first_expiry_while_a_slow_update_runs(
    pool: PoolClient, api: httpx.Client
) -> None:
    said: list[str] = []
    with LeaseKeeper(pool, "slow-trainer", 3.0, renew_every_s=0.5, say=said.append) as keeper:
        lease = keeper.lease()
        assert lease is not None
        _wait_past(lease, 1.0)  # the slow update: the lease as first granted has run out
        # Still held: another consumer gets the other batch, not this one.
        other = pool.lease("other-trainer", lease_s=60)
        assert other is not None and other.batch_id != lease.batch_id
        assert keeper.ack(lease, policy_version_trained=4) is True
    assert keeper.renewals >= 1 and said == []
    assert _consumers(api, lease.batch_id) == [("slow-trainer", 4)]


def test_a_lease_lost_anyway_is_said_in_one_line_and_the_free_batch_acknowledged_once(
    pool: PoolClient, api: httpx.Client
) -> None:
    said: list[str] = []
    # Never started: no renewals, as when the whole process stalls past its lease.
    keeper = LeaseKeeper(pool, "stalled-trainer", 1.0, say=said.append)
    lease = keeper.lease()
    assert lease is not None
    _wait_past(lease, 0.2)
    assert keeper.ack(lease, policy_version_trained=2) is True  # no LeaseLostError
    [line] = said
    assert "\n" not in line and f"lease on batch {lease.batch_id} was lost" in line
    assert "leased again and acknowledged" in line
    assert _consumers(api, lease.batch_id) == [("stalled-trainer", 2)]


def test_a_lost_batch_another_consumer_holds_is_skipped_then_acknowledged_without_training(
    pool: PoolClient, api: httpx.Client
) -> None:
    said: list[str] = []
    keeper = LeaseKeeper(pool, "stalled-trainer", 1.0, say=said.append)
    lease = keeper.lease()
    assert lease is not None
    _wait_past(lease, 0.2)
    taken = pool.lease("other-trainer", lease_s=60, batch_id=lease.batch_id)
    assert taken is not None  # the expired lease was taken over
    assert keeper.ack(lease, policy_version_trained=2) is False
    [line] = said
    assert "another consumer holds the batch now" in line and "skips" in line
    pool.nack(taken)  # the other consumer gives it back: it comes back to the stalled one
    assert keeper.lease(batch_id=lease.batch_id) is None  # acked at once, not handed out again
    assert said[1] == f"batch {lease.batch_id} came back; acknowledged without training it again"
    assert _consumers(api, lease.batch_id) == [("stalled-trainer", 2)]


def test_a_keeper_refuses_a_renewal_interval_that_does_not_fit_in_the_lease(
    pool: PoolClient,
) -> None:
    with pytest.raises(ValueError, match=r"renew_every_s 10, lease_s 5"):
        LeaseKeeper(pool, "trainer", 5.0, renew_every_s=10)


def test_nack_of_a_lost_lease_is_quiet_because_the_batch_is_back_already(
    pool: PoolClient,
) -> None:
    keeper = LeaseKeeper(pool, "stalled-trainer", 1.0, say=pytest.fail)
    lease = keeper.lease()
    assert lease is not None
    _wait_past(lease, 0.2)
    keeper.nack(lease, reason="update failed")  # no LeaseLostError
    assert isinstance(pool.lease("other-trainer", batch_id=lease.batch_id), LeasedBatch)


def test_lease_bodies_are_read_strictly_and_a_retried_ack_is_answered_as_done(
    pool: PoolClient, api: httpx.Client
) -> None:
    """``lease_s: true`` is not one second, a field we do not know is not ignored, an empty
    consumer is a 400 (not a 409 about a lease), and an ack retried after its answer was lost
    is 204 again (it was 409 lease_lost, which told the trainer its update was not counted)."""
    for bad in ({"lease_s": True}, {"lease_s": "30"}, {"lease_s": 30, "lease_ms": 5}):
        refused = api.post("/api/batches/lease", json={"consumer": "strict", **bad})
        assert refused.status_code == 400, (bad, refused.text)
    assert api.post("/api/batches/lease", json={"consumer": ""}).status_code == 400
    lease = pool.lease("strict", lease_s=60)
    assert lease is not None
    body = {"consumer": "strict", "lease_id": lease.lease_id}
    for path, extra in (("renew", {"lease_s": True}), ("renew", {"until": 1}), ("ack", {"x": 1})):
        refused = api.post(f"/api/batches/{lease.batch_id}/{path}", json={**body, **extra})
        assert refused.status_code == 400, (path, extra, refused.text)
    for path in ("renew", "ack", "nack"):
        empty = api.post(f"/api/batches/{lease.batch_id}/{path}", json={**body, "consumer": ""})
        assert empty.status_code == 400, (path, empty.text)
    ack = {**body, "policy_version_trained": 3}
    assert api.post(f"/api/batches/{lease.batch_id}/ack", json=ack).status_code == 204
    assert api.post(f"/api/batches/{lease.batch_id}/ack", json=ack).status_code == 204
    assert _consumers(api, lease.batch_id) == [("strict", 3)]  # recorded once
    # Another consumer's ack of that lease is still refused.
    other = api.post(f"/api/batches/{lease.batch_id}/ack", json={**ack, "consumer": "other"})
    assert other.status_code == 409 and other.json()["error"]["code"] == "lease_lost"


def test_a_repeated_ack_with_another_policy_version_is_409_ack_conflict_and_the_first_stands(
    pool: PoolClient, api: httpx.Client
) -> None:
    """An ack of version 1, then the same lease acked with version 2 (it was 204 with 1 still
    recorded, so the trainer believed version 2 held the batch): 409 ``ack_conflict``, version
    1 stays. An identical retry is still 204, and the client raises its plain error for the
    conflict, not ``LeaseLostError`` (the update was counted)."""
    lease = pool.lease("conflicting", lease_s=60)
    assert lease is not None
    ack = {"consumer": "conflicting", "lease_id": lease.lease_id, "policy_version_trained": 1}
    assert api.post(f"/api/batches/{lease.batch_id}/ack", json=ack).status_code == 204
    for other in (2, None):
        refused = api.post(
            f"/api/batches/{lease.batch_id}/ack", json={**ack, "policy_version_trained": other}
        )
        assert refused.status_code == 409, (other, refused.text)
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("ack_conflict", "policy_version_trained")
        assert f"policy_version_trained 1, got {other}" in error["message"]
    assert api.post(f"/api/batches/{lease.batch_id}/ack", json=ack).status_code == 204
    assert _consumers(api, lease.batch_id) == [("conflicting", 1)]
    with pytest.raises(PoolClientError) as raised:
        pool.ack(lease, policy_version_trained=2)
    assert raised.value.status_code == 409 and not isinstance(raised.value, LeaseLostError)


def test_lease_bodies_refuse_a_version_that_is_not_an_integer_a_blank_consumer_and_a_key_twice(
    pool: PoolClient, api: httpx.Client
) -> None:
    """``"1"`` and ``true`` are not policy version 1 (lax mode read both as 1), ``" "`` names
    no consumer, and a body naming ``consumer`` twice is refused rather than read last-wins."""
    assert api.post("/api/batches/lease", json={"consumer": " "}).status_code == 400
    twice = b'{"consumer": "strict", "consumer": "other", "lease_s": 60}'
    refused = api.post(
        "/api/batches/lease", content=twice, headers={"content-type": "application/json"}
    )
    assert refused.status_code == 400, refused.text
    assert "'consumer' twice" in refused.json()["error"]["message"]
    lease = pool.lease("strict", lease_s=60)
    assert lease is not None
    body = {"consumer": "strict", "lease_id": lease.lease_id}
    for version in ("1", True, 1.0):
        ack = {**body, "policy_version_trained": version}
        refused = api.post(f"/api/batches/{lease.batch_id}/ack", json=ack)
        assert refused.status_code == 400, (version, refused.text)
        assert refused.json()["error"]["param"] == "policy_version_trained"
    for path in ("renew", "ack", "nack"):
        blank = api.post(f"/api/batches/{lease.batch_id}/{path}", json={**body, "consumer": "\t "})
        assert blank.status_code == 400, (path, blank.text)
    ack = {**body, "policy_version_trained": 1}
    assert api.post(f"/api/batches/{lease.batch_id}/ack", json=ack).status_code == 204
    assert _consumers(api, lease.batch_id) == [("strict", 1)]


def test_an_unknown_batch_is_404_batch_not_found_on_lease_renew_ack_nack_and_reads(
    pool: PoolClient, api: httpx.Client
) -> None:
    """Leasing a batch id the pool does not hold answered 204 (as if it were only taken) while
    its ack answered 404 unknown_target: each answers 404 ``batch_not_found`` now."""
    lease = api.post("/api/batches/lease", json={"consumer": "c", "batch_id": "no-such-batch"})
    answers = [lease]
    body = {"consumer": "c", "lease_id": "l"}
    for path in ("renew", "ack", "nack"):
        answers.append(api.post(f"/api/batches/no-such-batch/{path}", json=body))
    answers += [api.get("/api/batches/no-such-batch"), api.get("/api/batches/no-such-batch/rows")]
    for answer in answers:
        assert answer.status_code == 404, (answer.request.url, answer.text)
        assert answer.json()["error"]["code"] == "batch_not_found", answer.text
    # A batch that exists but is held by someone else is still 204 for a lease by id.
    held = pool.lease("holder", lease_s=60)
    assert held is not None
    taken = api.post("/api/batches/lease", json={"consumer": "c", "batch_id": held.batch_id})
    assert taken.status_code == 204
