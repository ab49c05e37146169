"""The pool API and lifecycle through a real gateway in front of the vLLM-shaped emulator, on
SQLite and PostgreSQL: 409 after completion, reward backfill by step id, unrewarded is null
(C16), empty trajectories (C15), groups, filters with cursor pagination, reward functions."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests_support import free_port

from datapool.db import make_engine
from datapool.queries.export import export_trajectories
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trajgate.bench.emulator import EmulatorSettings, EmulatorThread

CHAT = {"model": "emulated", "messages": [{"role": "user", "content": "find the capybara"}]}


@pytest.fixture
def emulator() -> Iterator[EmulatorThread]:
    settings = EmulatorSettings(port=free_port(), prompt_tokens=20, response_tokens=5)
    server = EmulatorThread(settings).start()
    yield server
    server.stop()


@pytest.fixture
def api(emulator: EmulatorThread, pool_settings: PoolSettings) -> Iterator[httpx.Client]:
    pool = pool_settings.model_copy(
        update={"reward_functions": ["pool_reward_fns:steps_times_half", "pool_reward_fns:broken"]}
    )
    settings = GatewaySettings(upstream_url=emulator.url, port=free_port())
    server = BackgroundServer(create_app(settings, pool), port=settings.port).start()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client
    server.stop()


def chat(api: httpx.Client, trajectory_id: str) -> httpx.Response:
    return api.post(f"/t/{trajectory_id}/v1/chat/completions", json=CHAT)


def assert_envelope(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


def test_call_after_completion_is_refused_with_409_and_counted(api: httpx.Client) -> None:
    assert chat(api, "done-1").status_code == 200
    completed = api.post("/api/trajectories/done-1/complete", json={"reward": 1.0})
    assert completed.status_code == 200
    assert completed.json()["status"] == "complete"
    assert completed.json()["rewards"]["final"] == 1.0
    error = assert_envelope(chat(api, "done-1"), 409)
    assert error["code"] == "trajectory_closed" and "complete" in error["message"]
    detail = api.get("/api/trajectories/done-1").json()
    assert detail["rejected_calls"] == 1
    assert len(detail["steps"]) == 1  # the refused call left no step


def test_a_resend_reads_the_same_in_the_pool_api_the_inspector_and_the_export(
    api: httpx.Client, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    """The same body again within the re-send window: sampled again, flagged ``resend`` and
    linked to the first call by its call id. Each surface carries both halves, so a reader can
    tell which call a re-send repeated, and counts it as a call (``call_count`` 2: two step
    indices) whose call id is the first's."""
    first, again = chat(api, "resent-1"), chat(api, "resent-1")
    call_id = first.headers["x-trajgate-call-id"]
    assert again.headers["x-trajgate-call-id"] == call_id
    expected = [(0, call_id, []), (1, call_id, ["resend"])]

    detail = api.get("/api/trajectories/resent-1").json()
    assert detail["call_count"] == 2
    assert [(s["step_index"], s["call_id"], s["flags"]) for s in detail["steps"]] == expected
    step = api.get(f"/api/steps/{detail['steps'][1]['id']}").json()
    assert (step["call_id"], step["flags"]) == (call_id, ["resend"])

    view = api.get("/api/inspector/trajectories/resent-1").json()
    assert view["call_count"] == 2
    assert [(s["step_index"], s["call_id"], s["flags"]) for s in view["steps"]] == expected

    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    out = tmp_path / "steps.jsonl"
    assert export_trajectories(store, ["resent-1"], out, "jsonl") == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["step_index"], r["call_id"], r["flags"]) for r in rows] == expected


def test_reward_backfill_by_step_id_and_unknown_target_is_404(api: httpx.Client) -> None:
    step_id = chat(api, "rw-1").headers["x-trajgate-step-id"]
    step = api.get(f"/api/steps/{step_id}").json()
    assert step["rewards"] == {}  # unrewarded: no value, not 0.0
    assert len(step["response_token_ids"]) == len(step["response_logprobs"]) == 5
    assert len(step["prompt_token_ids"]) == 20 and step["prompt_text"] is None
    posted = api.post(
        "/api/rewards",
        json={"rewards": [{"target": "step", "target_id": step_id, "name": "fmt", "value": 0.5}]},
    )
    assert posted.status_code == 201
    api.post(
        "/api/rewards",
        json={"rewards": [{"target": "step", "target_id": step_id, "name": "fmt", "value": 0.7}]},
    )
    assert api.get(f"/api/steps/{step_id}").json()["rewards"] == {"fmt": 0.7}  # latest wins
    history = api.get("/api/rewards", params={"target_id": step_id}).json()
    assert [r["value"] for r in history] == [0.5, 0.7]  # append-only
    bad = api.post(
        "/api/rewards",
        json={
            "rewards": [
                {"target": "step", "target_id": step_id, "name": "fmt", "value": 1.0},
                {"target": "step", "target_id": "no-such-step", "name": "fmt", "value": 1.0},
            ]
        },
    )
    assert "no-such-step" in assert_envelope(bad, 404)["message"]
    assert len(api.get("/api/rewards", params={"target_id": step_id}).json()) == 2  # none added
    assert_envelope(api.get("/api/steps/no-such-step"), 404)


def test_group_of_four_with_two_unrewarded_reports_null_not_zero(api: httpx.Client) -> None:
    """C16: rewards [-1.0, -1.0, missing, missing]."""
    assert api.put("/api/groups/g16", json={"expected_size": 4}).status_code == 200
    for i in range(4):
        api.post("/api/trajectories", json={"id": f"g16-{i}", "group_id": "g16"})
        chat(api, f"g16-{i}")
    for i in range(2):
        api.post(f"/api/trajectories/g16-{i}/complete", json={"reward": -1.0})
    for i in range(2, 4):
        api.post(f"/api/trajectories/g16-{i}/complete")
    assert api.get("/api/groups/g16").json()["status"] == "complete"
    rewarded = api.get("/api/trajectories", params={"group_id": "g16", "rewarded": True}).json()
    unrewarded = api.get("/api/trajectories", params={"group_id": "g16", "rewarded": False}).json()
    assert sorted(t["id"] for t in rewarded["data"]) == ["g16-0", "g16-1"]
    assert sorted(t["id"] for t in unrewarded["data"]) == ["g16-2", "g16-3"]
    assert all("final" not in t["rewards"] for t in unrewarded["data"])


def test_rewarded_trajectory_without_steps_is_flagged_empty_once_closed(
    api: httpx.Client,
) -> None:
    """C15: the agent's call bypassed capture; the trajectory only has a reward. While open it
    may still get its steps, so the flag comes when it closes."""
    api.post("/api/trajectories", json={"id": "c15"})
    api.post(
        "/api/rewards",
        json={
            "rewards": [{"target": "trajectory", "target_id": "c15", "name": "final", "value": 1}]
        },
    )
    assert api.get("/api/trajectories/c15").json()["flags"] == []
    assert api.post("/api/trajectories/c15/complete").json()["flags"] == ["empty"]
    listed = api.get("/api/trajectories", params={"flag": "empty"}).json()["data"]
    assert [t["id"] for t in listed] == ["c15"]


def test_reward_before_the_first_step_leaves_the_trajectory_trainable(api: httpx.Client) -> None:
    api.post("/api/trajectories", json={"id": "emp-1"})
    reward = {"target": "trajectory", "target_id": "emp-1", "name": "final", "value": 1}
    assert api.post("/api/rewards", json={"rewards": [reward]}).status_code == 201
    assert chat(api, "emp-1").status_code == 200
    completed = api.post("/api/trajectories/emp-1/complete")
    assert completed.json()["flags"] == [] and len(completed.json()["steps"]) == 1
    assert api.get("/api/trajectories", params={"flag": "empty"}).json()["data"] == []


@pytest.mark.parametrize("value", ["1", True, "0.5", None])
def test_reward_backfill_of_a_non_number_is_400_and_records_nothing(
    api: httpx.Client, value: object
) -> None:
    assert chat(api, "typed").status_code == 200
    reward = {"target": "trajectory", "target_id": "typed", "name": "final", "value": value}
    refused = api.post("/api/rewards", json={"rewards": [reward]})
    assert assert_envelope(refused, 400)["param"] is not None
    assert api.get("/api/rewards", params={"trajectory_id": "typed"}).json() == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # not JSON (RFC 8259): the strict parser refuses the body before any field is read
        ('{"reward": NaN}', None),  # what json.dumps(float("nan")) sends
        ('{"reward": Infinity}', None),
        ('{"reward": -Infinity}', None),
        # a reward is a JSON number: a string or a boolean is refused, never coerced to 1.0
        ('{"reward": "1"}', "reward"),
        ('{"reward": true}', "reward"),
        ('{"reward": 1.0, "reward_name": ""}', "reward_name"),
        ('{"reward": 1.0, "reward_name": "' + "n" * 101 + '"}', "reward_name"),
        ('{"reward": 1.0, "author": "' + "a" * 201 + '"}', "author"),
    ],
)
def test_complete_with_an_invalid_final_reward_is_400_and_leaves_the_trajectory_open(
    api: httpx.Client, body: str, param: str | None
) -> None:
    assert chat(api, "bad-final").status_code == 200
    refused = api.post(
        "/api/trajectories/bad-final/complete",
        content=body,
        headers={"content-type": "application/json"},
    )
    assert assert_envelope(refused, 400)["param"] == param
    detail = api.get("/api/trajectories/bad-final").json()
    assert detail["status"] == "open" and detail["rewards"] == {}
    assert api.get("/api/rewards", params={"trajectory_id": "bad-final"}).json() == []
    assert chat(api, "bad-final").status_code == 200  # still open: calls are recorded
    completed = api.post("/api/trajectories/bad-final/complete", json={"reward": 0.5})
    assert completed.status_code == 200 and completed.json()["rewards"]["final"] == 0.5


def test_filters_and_cursor_pages_cover_every_trajectory_once(api: httpx.Client) -> None:
    for i in range(5):
        api.post(
            "/api/trajectories",
            json={"id": f"page-{i}", "channel": "val" if i % 2 else "train", "tags": ["math"]},
        )
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2, "tag": "math"}
        if cursor:
            params["cursor"] = cursor
        page = api.get("/api/trajectories", params=params).json()
        seen += [t["id"] for t in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sorted(seen) == [f"page-{i}" for i in range(5)]  # 3 pages: 2 + 2 + 1
    val = api.get("/api/trajectories", params={"channel": "val"}).json()["data"]
    assert sorted(t["id"] for t in val) == ["page-1", "page-3"]
    chat(api, "page-0")
    found = api.get("/api/trajectories", params={"q": "capybara"}).json()["data"]
    assert [t["id"] for t in found] == ["page-0"]
    assert_envelope(api.get("/api/trajectories", params={"cursor": "garbage"}), 400)


@pytest.mark.parametrize(
    ("instant", "trajectory_id"),
    [
        ("0001-01-01T00:00:00+05:00", "page-0"),  # year 0 in UTC
        ("9999-12-31T23:00:00-05:00", "page-0"),  # year 10000 in UTC
        ("2026-01-01T00:00:00+00:00", "page\u0000-0"),  # NUL: PostgreSQL refuses it in text
        ("2026-01-01T00:00:00+00:00", 7),
    ],
)
def test_forged_cursor_is_refused_with_400(
    api: httpx.Client, instant: str, trajectory_id: object
) -> None:
    forged = base64.urlsafe_b64encode(json.dumps([instant, trajectory_id]).encode()).decode()
    error = assert_envelope(api.get("/api/trajectories", params={"cursor": forged}), 400)
    assert "is not one this API returned" in error["message"]
    assert (error["code"], error["param"]) == ("invalid_cursor", "cursor")


@pytest.mark.parametrize(
    "cursor",
    [
        "garbage",
        "",  # a client that sent next_cursor null as "" would read page 1 again, forever
        "e30=",  # base64 of {}
        "bm90IGpzb24=",  # base64 of "not json"
        "WyIyMDI2LTAxLTAxVDAwOjAwOjAwKzAwOjAwIl0=",  # base64 of one item, no id
        "été",  # not base64's alphabet
    ],
)
def test_a_garbled_or_empty_cursor_is_a_400_invalid_cursor_not_the_first_page(
    api: httpx.Client, cursor: str
) -> None:
    api.post("/api/trajectories", json={"id": "page-only"})
    error = assert_envelope(api.get("/api/trajectories", params={"cursor": cursor}), 400)
    assert (error["code"], error["param"]) == ("invalid_cursor", "cursor")
    assert error["message"].startswith(f"cursor {cursor!r} is not one this API returned")


def test_an_issued_cursor_wrapped_padded_or_rewritten_is_a_400_not_the_next_page(
    api: httpx.Client,
) -> None:
    for i in range(2):
        api.post("/api/trajectories", json={"id": f"wrap-{i}"})
    issued = api.get("/api/trajectories", params={"limit": 1}).json()["next_cursor"]
    created, trajectory_id = json.loads(base64.urlsafe_b64decode(issued))
    naive = created.rsplit("+", 1)[0]  # the same instant without the offset the API writes
    for cursor in (
        f"!!{issued}!",  # b64decode skips characters outside its alphabet
        f"{issued}====",  # and padding past the first
        f" {issued}",
        base64.urlsafe_b64encode(json.dumps([naive, trajectory_id]).encode()).decode(),
    ):
        error = assert_envelope(api.get("/api/trajectories", params={"cursor": cursor}), 400)
        assert (error["code"], error["param"]) == ("invalid_cursor", "cursor"), cursor
    assert api.get("/api/trajectories", params={"cursor": issued}).status_code == 200


def test_reward_functions_run_on_completion_and_failures_are_recorded(
    api: httpx.Client,
) -> None:
    chat(api, "fn-1")
    chat(api, "fn-1")
    api.post("/api/trajectories/fn-1/complete")
    deadline = time.monotonic() + 20
    records: list[dict[str, Any]] = []
    while time.monotonic() < deadline and len(records) < 2:
        records = api.get("/api/rewards", params={"trajectory_id": "fn-1"}).json()
        time.sleep(0.1)
    by_name = {r["name"]: r for r in records}
    assert by_name["steps_times_half"]["value"] == 1.0  # 0.5 * 2 steps
    assert by_name["broken"]["value"] is None
    assert "reward model unreachable" in by_name["broken"]["error"]
    assert api.get("/api/trajectories/fn-1").json()["rewards"] == {"steps_times_half": 1.0}


def test_openapi_documents_every_pool_route(api: httpx.Client) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    assert {
        "/api/trajectories",
        "/api/trajectories/{trajectory_id}",
        "/api/trajectories/{trajectory_id}/complete",
        "/api/trajectories/{trajectory_id}/abandon",
        "/api/trajectories/{trajectory_id}/fail",
        "/api/groups/{group_id}",
        "/api/steps/{step_id}",
        "/api/steps/stale",
        "/api/rewards",
        "/api/summary",
    } <= set(paths)


def test_concurrent_creation_of_a_groups_members_creates_each_once(
    pool_settings: PoolSettings,
) -> None:
    # Found by the demo: members of one group created at once raced on the group row (500).
    from concurrent.futures import ThreadPoolExecutor

    from datapool.db import make_engine
    from datapool.lifecycle import transitions as lifecycle
    from datapool.steps.store import PoolStore

    engine = make_engine(pool_settings.resolved_database_url())
    store = PoolStore(engine, pool_settings)

    def create(i: int) -> str:
        return lifecycle.create_trajectory(store.sessions, f"race-{i}", group_id="race-group").id

    with ThreadPoolExecutor(max_workers=8) as executor:
        created = sorted(executor.map(create, range(16)))
    assert created == sorted(f"race-{i}" for i in range(16))
    with pytest.raises(Exception, match="exists already"):
        create(0)
    engine.dispose()


def test_group_reopens_when_a_member_joins_after_it_completed(api: httpx.Client) -> None:
    assert api.put("/api/groups/gl", json={"expected_size": 1}).status_code == 200
    in_group = {"x-trajgate-group": "gl"}
    assert api.post("/t/gl-1/v1/chat/completions", json=CHAT, headers=in_group).status_code == 200
    api.post("/api/trajectories/gl-1/complete")
    assert api.get("/api/groups/gl").json()["status"] == "complete"  # 1 closed of 1, none open
    assert api.post("/t/gl-2/v1/chat/completions", json=CHAT, headers=in_group).status_code == 200
    group = api.get("/api/groups/gl").json()
    assert group["members"] == {"complete": 1, "open": 1}
    assert group["status"] == "open" and group["completed_at"] is None
    api.post("/api/trajectories/gl-2/complete")
    group = api.get("/api/groups/gl").json()
    assert group["status"] == "complete" and group["completed_at"] is not None


def test_group_status_follows_its_expected_size_and_registered_members(
    api: httpx.Client,
) -> None:
    api.put("/api/groups/gs", json={"expected_size": 1})
    api.post("/api/trajectories", json={"id": "gs-1", "group_id": "gs"})
    api.post("/api/trajectories/gs-1/complete")
    assert api.get("/api/groups/gs").json()["status"] == "complete"
    reopened = api.put("/api/groups/gs", json={"expected_size": 2}).json()  # 1 closed of 2
    assert reopened["status"] == "open" and reopened["completed_at"] is None
    api.post("/api/trajectories", json={"id": "gs-2", "group_id": "gs"})
    api.post("/api/trajectories/gs-2/complete")
    assert api.get("/api/groups/gs").json()["status"] == "complete"  # 2 closed of 2
    api.post("/api/trajectories", json={"id": "gs-3", "group_id": "gs"})  # registered, open
    assert api.get("/api/groups/gs").json()["status"] == "open"
    assert api.put("/api/groups/gs", json={"expected_size": 1}).json()["status"] == "open"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"group_id": "g" * 201}, "group_id"),  # the column holds 200 characters
        ({"group_id": "two words"}, "group_id"),
        ({"group_id": ""}, "group_id"),
        ({"channel": "c" * 101}, "channel"),  # the column holds 100 characters
        ({"channel": "-train"}, "channel"),
    ],
)
def test_registering_a_trajectory_with_a_bad_group_or_channel_is_400_and_creates_nothing(
    api: httpx.Client, fields: dict[str, str], param: str
) -> None:
    refused = api.post("/api/trajectories", json={"id": "bad-attr", **fields})
    assert assert_envelope(refused, 400)["param"] == param
    assert_envelope(api.get("/api/trajectories/bad-attr"), 404)


def test_putting_a_group_with_an_overlong_id_is_400(api: httpx.Client) -> None:
    refused = api.put(f"/api/groups/{'g' * 201}", json={"expected_size": 2})
    assert assert_envelope(refused, 400)["param"] == "group_id"
    assert_envelope(api.get(f"/api/groups/{'g' * 200}"), 404)


def test_closing_a_closed_trajectory_again_is_idempotent_or_409(api: httpx.Client) -> None:
    assert chat(api, "twice").status_code == 200
    assert api.post("/api/trajectories/twice/complete", json={"reward": 1.0}).status_code == 200
    again = api.post("/api/trajectories/twice/complete")
    assert again.status_code == 200 and again.json()["rewards"]["final"] == 1.0  # same state
    late_reward = assert_envelope(
        api.post("/api/trajectories/twice/complete", json={"reward": 0.0}), 409
    )
    assert late_reward["code"] == "trajectory_closed"
    assert late_reward["message"].startswith("refused the final reward: ")
    assert "already complete" in late_reward["message"]
    other_status = assert_envelope(api.post("/api/trajectories/twice/abandon"), 409)
    assert other_status["message"].startswith("refused marking it abandoned: ")
    detail = api.get("/api/trajectories/twice").json()
    assert (detail["status"], detail["rewards"]["final"]) == ("complete", 1.0)


def test_stale_steps_are_those_more_than_k_versions_old_in_keyset_pages(
    api: httpx.Client, pool_settings: PoolSettings
) -> None:
    from dataclasses import replace

    from datapool.db import make_engine
    from datapool.steps.records import CallRecord, ChoiceRecord
    from datapool.steps.store import PoolStore

    call = CallRecord(
        request={"model": "m", "messages": [{"role": "user", "content": "q"}]},
        upstream_request={"model": "m"},
        model="m",
        upstream="test://",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=[1, 2],
        prompt_tokens=2,
        choices=[ChoiceRecord(0, [3], [-0.1], {"role": "assistant", "content": "a"}, "stop")],
    )
    engine = make_engine(pool_settings.resolved_database_url())
    try:
        store = PoolStore(engine, pool_settings)
        made = {
            version: store.record_call(f"stale-{i}", replace(call, policy_version=version))[0]
            for i, version in enumerate([0, 1, 2, 3])
        }
        made_v0b = store.record_call("stale-4", call)[0]
    finally:
        engine.dispose()
    # current 3, K 1: stale means version < 3 - 1 = 2, i.e. v0 (two steps) and v1 (one).
    expected = [*sorted([(0, made[0]), (0, made_v0b)]), (1, made[1])]
    pages: list[list[dict[str, Any]]] = []
    params: dict[str, Any] = {"current_version": 3, "max_versions_behind": 1, "limit": 2}
    while True:
        page = api.get("/api/steps/stale", params=params).json()
        pages.append(page)
        if len(page) < 2:
            break
        last = page[-1]
        params |= {"after_version": last["policy_version"], "after_step_id": last["step_id"]}
    assert [len(p) for p in pages] == [2, 1]
    assert [(r["policy_version"], r["step_id"]) for p in pages for r in p] == expected
    half = api.get("/api/steps/stale", params={"current_version": 3, "after_version": 0})
    assert assert_envelope(half, 400)["param"] == "after_step_id"


def test_registering_an_existing_trajectory_is_409_and_a_nan_reward_bound_is_400(
    api: httpx.Client,
) -> None:
    assert api.post("/api/trajectories", json={"id": "twice"}).status_code == 201
    error = assert_envelope(api.post("/api/trajectories", json={"id": "twice"}), 409)
    assert error["code"] == "trajectory_exists" and "'twice' exists already" in error["message"]
    for bound in ("nan", "inf", "-inf"):
        refused = api.get("/api/trajectories", params={"reward_min": bound})
        assert refused.status_code == 400, (bound, refused.text)
    assert api.get("/api/trajectories", params={"reward_max": "0.5"}).status_code == 200


def test_an_unknown_field_is_a_400_naming_it_and_nothing_changes(api: httpx.Client) -> None:
    """A misspelt field is refused on every /api and /admin body, never dropped: the request
    would otherwise act without it (a completion without its reward cannot be retried)."""
    refused = api.post("/api/trajectories", json={"id": "uf-1", "tagz": ["a"]})
    assert assert_envelope(refused, 400)["param"] == "tagz"
    assert_envelope(api.get("/api/trajectories/uf-1"), 404)
    assert api.post("/api/trajectories", json={"id": "uf-1"}).status_code == 201

    error = assert_envelope(api.post("/api/trajectories/uf-1/complete", json={"rewrd": 1}), 400)
    assert error["param"] == "rewrd" and "unknown field 'rewrd'" in error["message"]
    assert api.get("/api/trajectories/uf-1").json()["status"] == "open"
    completed = api.post("/api/trajectories/uf-1/complete", json={"reward": 1})
    assert completed.status_code == 200, completed.text
    assert completed.json()["rewards"] == {"final": 1.0}

    item = {"target": "trajectory", "target_id": "uf-1", "name": "judge", "value": 0.5}
    misspelt_item = api.post("/api/rewards", json={"rewards": [item, {**item, "sorce": "rule"}]})
    assert assert_envelope(misspelt_item, 400)["param"] == "rewards.1.sorce"
    extra_top = api.post("/api/rewards", json={"rewards": [item], "dry_run": True})
    assert assert_envelope(extra_top, 400)["param"] == "dry_run"
    history = api.get("/api/rewards", params={"trajectory_id": "uf-1"}).json()
    assert "judge" not in [r["name"] for r in history]  # neither batch wrote anything

    assert assert_envelope(api.put("/api/groups/uf-g", json={"size": 2}), 400)["param"] == "size"
    assert_envelope(api.get("/api/groups/uf-g"), 404)
    label = {"target": "trajectory", "target_id": "uf-1", "qualty": "good"}
    assert assert_envelope(api.post("/api/labels", json=label), 400)["param"] == "qualty"
    assert api.get("/api/labels", params={"trajectory_id": "uf-1"}).json() == []
    key = api.post("/admin/api-keys", json={"name": "k", "chanel": "train"})
    assert assert_envelope(key, 400)["param"] == "chanel"
    assert api.get("/admin/api-keys").json() == []


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/api/groups/ty-g", {"expected_size": "4"}, "expected_size"),
        ("/api/groups/ty-g", {"expected_size": True}, "expected_size"),
        ("/api/groups/ty-g", {"expected_size": 4.0}, "expected_size"),
        ("/api/trajectories", {"id": 5}, "id"),
        ("/api/trajectories", {"id": "ty-1", "tags": [1]}, "tags.0"),
        ("/api/trajectories/ty-1/complete", {"reward": True}, "reward"),
        ("/api/trajectories/ty-1/complete", {"reward_name": 5, "reward": 1.0}, "reward_name"),
        ("/admin/policy-versions", {"version": "1", "model_name": "m"}, "version"),
        ("/admin/policy-versions", {"version": 1, "model_name": "m", "activate": 1}, "activate"),
    ],
)
def test_a_value_of_another_json_type_is_a_400_never_coerced(
    api: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    """No string read as a number, no boolean as 1, no number as a string: as the lease routes
    refuse ``lease_s: "30"``, the pool routes refuse ``expected_size: "4"``."""
    if "/complete" in path:
        assert api.post("/api/trajectories", json={"id": "ty-1"}).status_code == 201
    method = api.put if path.startswith("/api/groups/") else api.post
    assert assert_envelope(method(path, json=body), 400)["param"] == param
    assert_envelope(api.get("/api/groups/ty-g"), 404)
    if "/complete" in path:
        assert api.get("/api/trajectories/ty-1").json()["status"] == "open"
    else:
        assert_envelope(api.get("/api/trajectories/ty-1"), 404)
    assert api.get("/admin/policy-versions").json() == []


def test_put_group_changes_only_the_fields_it_names_and_status_is_refused(
    api: httpx.Client,
) -> None:
    created = api.put("/api/groups/pg", json={})
    assert created.status_code == 200, created.text
    assert (created.json()["expected_size"], created.json()["status"]) == (None, "open")
    assert api.put("/api/groups/pg", json={"expected_size": 2}).json()["expected_size"] == 2
    kept = api.put("/api/groups/pg", json={})
    assert kept.status_code == 200 and kept.json()["expected_size"] == 2  # left out: unchanged

    error = assert_envelope(api.put("/api/groups/pg", json={"status": "complete"}), 400)
    assert error["param"] == "status" and "derived" in error["message"]
    both = api.put("/api/groups/pg", json={"expected_size": 3, "status": "open"})
    assert assert_envelope(both, 400)["param"] == "status"
    group = api.get("/api/groups/pg").json()
    assert (group["expected_size"], group["status"]) == (2, "open")  # nothing changed

    cleared = api.put("/api/groups/pg", json={"expected_size": None})
    assert cleared.status_code == 200 and cleared.json()["expected_size"] is None


def test_trajectory_tags_and_metadata_past_their_bounds_are_400_and_register_nothing(
    api: httpx.Client,
) -> None:
    """Defaults: 256 tags of at most 128 characters, metadata of at most 64 KiB as compact JSON
    (``{"x":"..."}`` is 8 bytes around its value)."""
    at_bounds = {
        "id": "lim-ok",
        "tags": [f"{i:03d}" + "t" * 125 for i in range(256)],
        "metadata": {"x": "m" * (65536 - 8)},
    }
    accepted = api.post("/api/trajectories", json=at_bounds)
    assert accepted.status_code == 201, accepted.text
    assert len(accepted.json()["tags"]) == 256

    past = [
        ({"tags": [str(i) for i in range(257)]}, "tags", "257 tags"),
        ({"tags": ["ok", "t" * 129]}, "tags.1", "129 characters"),
        ({"metadata": {"x": "m" * (65536 - 7)}}, "metadata", "65537 bytes"),
        ({"metadata": {"x": "é" * 32765}}, "metadata", "65538 bytes"),  # UTF-8 bytes, not chars
    ]
    for index, (fields, param, said) in enumerate(past):
        refused = api.post("/api/trajectories", json={"id": f"lim-{index}", **fields})
        error = assert_envelope(refused, 400)
        assert error["param"] == param and said in error["message"], error
        assert_envelope(api.get(f"/api/trajectories/lim-{index}"), 404)


def test_tag_and_metadata_bounds_are_settings(
    emulator: EmulatorThread, sqlite_pool: PoolSettings
) -> None:
    settings = GatewaySettings(
        upstream_url=emulator.url,
        port=free_port(),
        max_trajectory_tags=2,
        max_tag_chars=3,
        max_metadata_bytes=18,  # {"k":"0123456789"}
    )
    server = BackgroundServer(create_app(settings, sqlite_pool), port=settings.port).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as api:
            ok = {"id": "s-ok", "tags": ["abc", "d"], "metadata": {"k": "0123456789"}}
            assert api.post("/api/trajectories", json=ok).status_code == 201
            for fields, param in [
                ({"tags": ["a", "b", "c"]}, "tags"),
                ({"tags": ["abcd"]}, "tags.0"),
                ({"metadata": {"k": "01234567890"}}, "metadata"),
            ]:
                refused = api.post("/api/trajectories", json={"id": "s-no", **fields})
                assert assert_envelope(refused, 400)["param"] == param
            # a label's tags are the trajectory's too (listing pages return them): same bounds
            label = {"target": "trajectory", "target_id": "s-ok", "quality": "good"}
            bulk = {"target": "trajectory", "filter": {"trajectory_ids": ["s-ok"]}}
            for fields, param in [
                ({"tags": ["a", "b", "c"]}, "tags"),
                ({"remove_tags": ["abcd"]}, "remove_tags.0"),
            ]:
                for path, body in (("/api/labels", label), ("/api/labels/bulk", bulk)):
                    refused = api.post(path, json={**body, **fields})
                    assert assert_envelope(refused, 400)["param"] == param, path
            assert api.get("/api/labels", params={"trajectory_id": "s-ok"}).json() == []
            within = api.post("/api/labels", json={**label, "tags": ["abc", "d"]})
            assert within.status_code == 201, within.text
    finally:
        server.stop()


def test_history_filters_that_match_nothing_answer_an_empty_list(api: httpx.Client) -> None:
    """A query parameter filters a list (200 [], as /api/trajectories?group_id= and
    /api/labels?trajectory_id= do); only an id in the path is looked up (404)."""
    assert api.get("/api/rewards", params={"trajectory_id": "nope"}).json() == []
    assert api.get("/api/rewards", params={"target_id": "nope"}).json() == []
    assert api.get("/api/labels", params={"trajectory_id": "nope"}).json() == []
    assert api.get("/api/trajectories", params={"group_id": "nope"}).json()["data"] == []
    assert assert_envelope(api.get("/api/trajectories/nope"), 404)["param"] == "trajectory_id"


def test_a_batch_spec_or_filter_value_of_another_json_type_is_a_400_naming_it(
    api: httpx.Client,
) -> None:
    """A batch spec and a bulk label's filter are strict as every other body: ``"4"`` read as 4
    would build a batch the sender did not describe (and ``1`` read as true a flag)."""
    assert api.post("/api/trajectories", json={"id": "st-1"}).status_code == 201
    wrong_type = api.post("/api/batches", json={"algorithm": "sft", "group_size": "4"})
    assert assert_envelope(wrong_type, 400)["param"] == "group_size"
    flag_as_number = api.post("/api/batches", json={"algorithm": "sft", "scale_by_std": 1})
    assert assert_envelope(flag_as_number, 400)["param"] == "scale_by_std"
    bulk = {"target": "trajectory", "quality": "good", "filter": {"policy_version": "4"}}
    assert assert_envelope(api.post("/api/labels/bulk", json=bulk), 400)["param"] == (
        "filter.policy_version"
    )
    assert api.get("/api/labels", params={"trajectory_id": "st-1"}).json() == []
    # the two times stay ISO 8601 text or Unix seconds, as documented
    for after in ("2020-01-01T00:00:00Z", 1577836800):
        bulk = {"target": "trajectory", "quality": "good", "filter": {"created_after": after}}
        labelled = api.post("/api/labels/bulk", json=bulk)
        assert labelled.status_code == 201, labelled.text
