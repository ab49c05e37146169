"""Policy versions and API keys: the ``/admin`` error paths through the real app, and the
``datapool.policy_versions`` / ``datapool.api_keys`` functions on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from datapool import api_keys, policy_versions
from datapool.db import Sessions, make_engine, make_sessionmaker
from datapool.errors import InvalidPoolRequestError
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


def test_registering_a_version_for_another_model_is_400_naming_the_version(
    admin: TestClient,
) -> None:
    assert admin.post("/admin/policy-versions", json={"version": 1, "model_name": "a"}).is_success
    again = admin.post("/admin/policy-versions", json={"version": 1, "model_name": "b"})
    assert again.status_code == 400
    assert again.json() == {
        "error": {
            "message": "policy version 1 is already registered for model 'a', not 'b'",
            "type": "invalid_request_error",
            "param": "version",
            "code": "invalid_request",
        }
    }


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
    first = policy_versions.register(sessions, 2, "m", "/lora/2")
    second = policy_versions.register(sessions, 2, "m", "/elsewhere")
    assert (second.version, second.weights_location) == (2, "/lora/2")
    assert second.created_at == first.created_at
    with pytest.raises(InvalidPoolRequestError, match="already registered for model 'm'"):
        policy_versions.register(sessions, 2, "other", None)


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
