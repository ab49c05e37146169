"""Curation rules through the real gateway on SQLite and PostgreSQL: bad params are refused
with a 400 naming the param (nothing stored), a rule that fails when applied (stored params no
longer valid, a predicate that raises) is reported and keeps its old marks instead of failing
every batch with a 500 or excluding everything, and a deleted rule's id is never reused."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from batch_helpers import agent_turns, make_store, write_trajectory

from datapool.curation import rules as curation
from datapool.lifecycle import transitions as lifecycle
from datapool.models import CurationRule, Trajectory, utc_now
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.server import BackgroundServer

# (kind, params, the param the 400 names)
BAD_PARAMS: list[tuple[str, dict[str, Any], str]] = [
    ("reward_threshold", {"min": "abc"}, "params.min"),  # a string is not read as a number
    ("reward_threshold", {"min": True}, "params.min"),  # nor a boolean
    ("reward_threshold", {"min": 1.0, "max": 0.0}, "params"),  # empty interval
    ("reward_threshold", {"name": "final"}, "params"),  # no bound at all
    ("stale", {"max_versions_behind": 1, "current_version": "x"}, "params.current_version"),
    ("stale", {"max_versions_behind": -1}, "params.max_versions_behind"),
    ("stale", {}, "params.max_versions_behind"),
    ("length", {"max_steps": "x"}, "params.max_steps"),
    ("length", {"max_total_tokens": -5}, "params.max_total_tokens"),
    ("degenerate_group", {"success_reward": "a"}, "params.success_reward"),
    ("degenerate_group", {"eps": "x"}, "params.eps"),
    ("degenerate_group", {"reward_name": 5}, "params.reward_name"),
    ("integrity", {"flags": "x"}, "params.flags"),
    ("integrity", {"flags": [5]}, "params.flags.0"),
    ("truncated", {"target": "group"}, "params.target"),
    ("truncated", {"max_steps": 3}, "params.max_steps"),  # a param of another kind
    ("empty", {"anything": 1}, "params.anything"),
    ("predicate", {"function": "os"}, "params.function"),  # not pkg.mod:fn
    ("predicate", {"function": "no_such_module_here:fn"}, "params.function"),
    ("predicate", {"function": "curation_predicates:takes_no_context"}, "params.function"),
]


@pytest.fixture
def pool_settings(pool_settings: PoolSettings) -> PoolSettings:
    """Each backend's pool, with this module's predicates allowed (the default allows none)."""
    return pool_settings.model_copy(update={"curation_predicate_modules": ["curation_predicates"]})


def pool_of_three(pool_settings: PoolSettings) -> PoolStore:
    """``a`` (label bad, 2 steps), ``b`` (label ok, 1 step), ``c`` (no metadata, 1 step)."""
    store = make_store(pool_settings)
    for name, label, turns, seed in (("a", "bad", 2, 1), ("b", "ok", 1, 2), ("c", None, 1, 3)):
        lifecycle.create_trajectory(
            store.sessions, name, metadata=None if label is None else {"label": label}
        )
        write_trajectory(store, name, agent_turns(seed, turns), reward=1.0)
    return store


def ready(api: httpx.Client, trajectory_id: str) -> bool:
    verdict = api.get(f"/api/trajectories/{trajectory_id}/readiness")
    assert verdict.status_code == 200, verdict.text
    return bool(verdict.json()["ready"])


def test_rules_with_bad_params_are_refused_with_400_naming_the_param_and_nothing_is_stored(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    pool_of_three(pool_settings)
    with httpx.Client(base_url=gateway.url, timeout=60) as api:
        for i, (kind, params, param) in enumerate(BAD_PARAMS):
            rule = {"name": f"bad-{i}", "kind": kind, "params": params}
            refused = api.post("/api/curation/rules", json=rule)
            assert refused.status_code == 400, (rule, refused.text)
            error = refused.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            assert error["param"] == param, (rule, error)
        assert api.get("/api/curation/rules").json() == []
        assert api.post("/api/curation/apply", json={}).json() == []
        batch = api.post("/api/batches", json={"algorithm": "reinforce_pp"})
        assert batch.status_code == 201, batch.text
        assert batch.json()["manifest"]["counts"]["trajectories"] == 3  # nothing excluded


def test_a_predicate_that_raises_on_the_pool_is_refused_at_create_and_nothing_is_stored(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    pool_of_three(pool_settings)
    with httpx.Client(base_url=gateway.url, timeout=60) as api:
        # Trajectory c has no label: the predicate raises KeyError on it.
        refused = api.post(
            "/api/curation/rules",
            json={
                "name": "broken",
                "kind": "predicate",
                "params": {"function": "curation_predicates:breaks_on_unlabelled"},
            },
        )
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "predicate curation_predicates:breaks_on_unlabelled raised" in message
        assert api.get("/api/curation/rules").json() == []
        assert all(ready(api, t) for t in ("a", "b", "c"))  # nothing excluded


def test_a_predicate_outside_the_operators_modules_is_refused_before_anything_is_imported(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # A rule comes over the API: a caller naming os:system (which takes one argument) must not
    # get the gateway to import and call it; neither may a module nobody allowed.
    pool_of_three(pool_settings)
    with httpx.Client(base_url=gateway.url, timeout=60) as api:
        for function in ("os:system", "antigravity:geohash", "curation_predicates_x:fn"):
            rule = {"name": "shell", "kind": "predicate", "params": {"function": function}}
            refused = api.post("/api/curation/rules", json=rule)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "params.function"
            assert "TRAJGATE_CURATION_PREDICATE_MODULES" in error["message"]
        assert api.get("/api/curation/rules").json() == []
    import sys

    assert "antigravity" not in sys.modules  # refused before any import


def test_predicate_modules_allow_a_module_or_a_package_and_nothing_else() -> None:
    assert curation.predicate_allowed("pkg.mod", ["pkg.mod"])
    assert not curation.predicate_allowed("pkg.mod2", ["pkg.mod"])
    assert not curation.predicate_allowed("pkg", ["pkg.mod"])
    assert curation.predicate_allowed("pkg.sub.mod", ["pkg.*"])
    assert not curation.predicate_allowed("pkgx.mod", ["pkg.*"])
    assert not curation.predicate_allowed("os", [])


def test_a_predicate_that_starts_raising_fails_its_rule_which_keeps_its_marks_and_blocks_batches(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    store = pool_of_three(pool_settings)
    with httpx.Client(base_url=gateway.url, timeout=60) as api:
        long = api.post(
            "/api/curation/rules",
            json={
                "name": "long",
                "kind": "predicate",
                "params": {"function": "curation_predicates:long_trajectory"},
            },
        )
        assert long.status_code == 201 and long.json()["result"]["matched"] == 1  # a: 2 steps
        declared = api.post(
            "/api/curation/rules",
            json={
                "name": "bad-label",
                "kind": "predicate",
                "params": {"function": "curation_predicates:breaks_on_unlabelled"},
                "apply_now": False,  # c has no label: applying now would be refused
            },
        )
        assert declared.status_code == 201, declared.text
        results = {r["name"]: r for r in api.post("/api/curation/apply", json={}).json()}
        assert results["long"]["error"] is None and results["long"]["matched"] == 1
        assert results["bad-label"]["matched"] == 0
        assert "raised on trajectory 'c': KeyError('label')" in results["bad-label"]["error"]
        [stored] = [r for r in api.get("/api/curation/rules").json() if r["name"] == "bad-label"]
        assert stored["error"] == results["bad-label"]["error"] and stored["failed_at"]
        # the failed rule excluded nothing: only the good rule's mark on a keeps anything out
        assert [ready(api, t) for t in ("a", "b", "c")] == [False, True, True]
        refused = api.post("/api/batches", json={"algorithm": "reinforce_pp"})
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "curation_rule_failed" and "'bad-label'" in error["message"]
        # once c is labelled the rule runs again; its error is cleared
        with store.sessions.begin() as session:
            trajectory = session.get(Trajectory, "c")
            assert trajectory is not None
            trajectory.metadata_json = {"label": "bad"}
        results = {r["name"]: r for r in api.post("/api/curation/apply", json={}).json()}
        assert results["bad-label"]["error"] is None and results["bad-label"]["matched"] == 2
        [stored] = [r for r in api.get("/api/curation/rules").json() if r["name"] == "bad-label"]
        assert stored["error"] is None and stored["failed_at"] is None
        batch = api.post("/api/batches", json={"algorithm": "reinforce_pp"})
        assert batch.status_code == 201, batch.text
        assert batch.json()["manifest"]["trajectory_ids"] == ["b"]  # a and c: rule 'bad-label'


def test_a_stored_rule_whose_params_no_longer_validate_is_reported_not_a_500(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    store = pool_of_three(pool_settings)
    curation.create_rule(store, "floor", "reward_threshold", params={"min": 0.5})
    # A rule stored before params were typed: written straight to the table.
    with store.sessions.begin() as session:
        session.add(
            CurationRule(
                name="legacy",
                kind="reward_threshold",
                action="exclude",
                params={"min": "abc"},
                enabled=True,
                created_at=utc_now(),
            )
        )
    with httpx.Client(base_url=gateway.url, timeout=60) as api:
        results = {r["name"]: r for r in api.post("/api/curation/apply", json={}).json()}
        assert results["floor"]["error"] is None
        assert results["legacy"]["error"] == (
            "stored params no longer valid: params.min: Input should be a valid number (got 'abc')"
        )
        refused = api.post("/api/batches", json={"algorithm": "reinforce_pp"})
        assert refused.status_code == 409, refused.text
        assert "'legacy'" in refused.json()["error"]["message"]
        # the completion hook reports the failure on the rule and does not fail
        assert api.get("/api/trajectories/c").json()["status"] == "complete"
        curation.apply_on_completion(store, "c")
        [legacy] = [r for r in api.get("/api/curation/rules").json() if r["name"] == "legacy"]
        assert legacy["error"] is not None and legacy["enabled"] is True
        assert api.delete(f"/api/curation/rules/{legacy['id']}").status_code == 204
        batch = api.post("/api/batches", json={"algorithm": "reinforce_pp"})
        assert batch.status_code == 201, batch.text


def test_the_id_of_a_deleted_rule_is_never_given_to_a_new_rule(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    first, _ = curation.create_rule(store, "one", "empty")
    second, _ = curation.create_rule(store, "two", "empty")
    curation.delete_rule(store.sessions, second.id)
    third, _ = curation.create_rule(store, "three", "empty")
    assert (first.id, second.id, third.id) == (first.id, first.id + 1, first.id + 2)


def test_apply_rules_refuses_an_unknown_failure_mode(pool_settings: PoolSettings) -> None:
    with pytest.raises(ValueError, match="on_failure must be one of"):
        curation.apply_rules(make_store(pool_settings), on_failure="ignore")  # type: ignore[arg-type]
