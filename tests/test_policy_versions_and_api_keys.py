"""Policy versions and API keys: the ``/admin`` error paths through the real app, and the
``datapool.policy_versions`` / ``datapool.api_keys`` functions on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from datapool import api_keys, policy_versions
from datapool.db import Sessions, make_engine, make_sessionmaker
from datapool.errors import VersionConflictError
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.settings import GatewaySettings


@pytest.fixture
def admin(pool_settings: PoolSettings) -> Iterator[TestClient]:
    app = create_app(GatewaySettings(upstream_url="http://127.0.0.1:9"), pool_settings)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


@pytest.fixture
def sessions(pool_settings: PoolSettings) -> Sessions:
    return make_sessionmaker(make_engine(pool_settings.resolved_database_url()))


@pytest.mark.parametrize(
    ("again", "stored"),
    [
        (
            {"model_name": "b", "weights_location": "/ckpt/1"},
            "'a' and weights_location '/ckpt/1', not 'b' and '/ckpt/1'",
        ),
        (
            {"model_name": "a", "weights_location": "/ckpt/1-b"},
            "'a' and weights_location '/ckpt/1', not 'a' and '/ckpt/1-b'",
        ),
    ],
)
def test_registering_a_version_again_with_other_fields_is_409_and_keeps_the_first(
    admin: TestClient, again: dict[str, str], stored: str
) -> None:
    first = {"version": 1, "model_name": "a", "weights_location": "/ckpt/1"}
    assert admin.post("/admin/policy-versions", json=first).status_code == 201
    refused = admin.post("/admin/policy-versions", json={"version": 1, **again})
    assert refused.status_code == 409
    error = refused.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "conflict_error",
        "version",
        "policy_version_conflict",
    )
    assert "policy version 1 is already registered with model_name" in error["message"]
    assert stored in error["message"]
    # An identical re-send is idempotent; the registry still holds the first weight set.
    assert admin.post("/admin/policy-versions", json=first).status_code == 201
    listed = admin.get("/admin/policy-versions").json()
    assert [(v["version"], v["model_name"], v["weights_location"]) for v in listed] == [
        (1, "a", "/ckpt/1")
    ]


def test_activating_an_unknown_version_is_404_and_changes_nothing(admin: TestClient) -> None:
    admin.post("/admin/policy-versions", json={"version": 1, "model_name": "a"})
    unknown = admin.post("/admin/policy-versions/7/activate")
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": "policy version 7 is not registered",
        "type": "not_found_error",
        "param": "version",
        "code": "not_found",
    }
    listed = admin.get("/admin/policy-versions").json()
    assert [(v["version"], v["active"]) for v in listed] == [(1, True)]


def test_revoking_an_unknown_key_is_404(admin: TestClient) -> None:
    unknown = admin.delete("/admin/api-keys/nope")
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": "no API key with id 'nope'",
        "type": "not_found_error",
        "param": "key_id",
        "code": "not_found",
    }


def test_registering_the_same_version_twice_returns_the_first_row(sessions: Sessions) -> None:
    first, created = policy_versions.register(sessions, 2, "m", "/lora/2")
    second, created_again = policy_versions.register(sessions, 2, "m", "/lora/2")
    assert (created, created_again) == (True, False)
    assert (second.version, second.weights_location) == (2, "/lora/2")
    assert second.created_at == first.created_at
    with pytest.raises(VersionConflictError, match="with model_name 'm' and weights_location"):
        policy_versions.register(sessions, 2, "other", "/lora/2")
    with pytest.raises(VersionConflictError, match="not 'm' and '/elsewhere'"):
        policy_versions.register(sessions, 2, "m", "/elsewhere")


def test_concurrent_registrations_of_one_version_have_exactly_one_winner(
    pool_settings: PoolSettings,
) -> None:
    """Eight writers, each with its own engine (as gateway workers or replicas sharing the
    database are), register version 9 with eight weight sets at once: the database's primary
    key lets exactly one insert; the seven others are refused and the stored row is the
    winner's."""
    writers = 8
    url = pool_settings.resolved_database_url()
    engines = [make_engine(url) for _ in range(writers)]
    barrier = threading.Barrier(writers)

    def publish(index: int) -> str:
        barrier.wait()
        try:
            policy_versions.register(make_sessionmaker(engines[index]), 9, "m", f"/ckpt/v9-{index}")
        except VersionConflictError:
            return "refused"
        return f"/ckpt/v9-{index}"

    with ThreadPoolExecutor(writers) as pool:
        outcomes = list(pool.map(publish, range(writers)))
    for engine in engines:
        engine.dispose()
    winners = [outcome for outcome in outcomes if outcome != "refused"]
    assert len(winners) == 1, outcomes
    stored = policy_versions.list_versions(make_sessionmaker(make_engine(url)))
    assert [(row.version, row.weights_location) for row in stored] == [(9, winners[0])]


def test_a_claim_given_back_is_deleted_unless_the_version_was_activated(
    sessions: Sessions,
) -> None:
    policy_versions.register(sessions, 3, "m", "/ckpt/3")
    policy_versions.register(sessions, 4, "m", "/ckpt/4")
    policy_versions.activate(sessions, 4)
    policy_versions.unregister_unused(sessions, 3)
    policy_versions.unregister_unused(sessions, 4)
    assert [row.version for row in policy_versions.list_versions(sessions)] == [4]


def test_activating_a_version_leaves_exactly_that_one_active(sessions: Sessions) -> None:
    for version in (1, 2, 3):
        policy_versions.register(sessions, version, f"m{version}", None)
    assert policy_versions.activate(sessions, 1) is not None
    activated = policy_versions.activate(sessions, 3)
    assert activated is not None and activated.activated_at is not None
    versions = policy_versions.list_versions(sessions)
    assert [(v.version, v.active) for v in versions] == [(1, False), (2, False), (3, True)]
    assert policy_versions.activate(sessions, 9) is None


def test_a_revoked_key_is_no_longer_found_by_its_hash(sessions: Sessions) -> None:
    api_keys.add_key(sessions, "k1", "agent", "hash-1", "traj-1", None)
    api_keys.add_key(sessions, "k2", "other", "hash-2", None, "val")
    found = api_keys.active_key(sessions, "hash-1")
    assert found is not None and (found.id, found.trajectory_id) == ("k1", "traj-1")
    assert api_keys.revoke_key(sessions, "k1") is True
    assert api_keys.active_key(sessions, "hash-1") is None
    assert api_keys.revoke_key(sessions, "missing") is False
    listed = api_keys.list_keys(sessions)
    assert [(k.id, k.revoked_at is not None) for k in listed] == [("k1", True), ("k2", False)]
