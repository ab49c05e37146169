"""Time filters and text search give the same answers on SQLite and PostgreSQL, through the pool
API, the inspector's list and batch-spec filters (``TrajectoryFilter``): an offset names an
instant (SQLite stores naive UTC text), timestamps come back in UTC, and LIKE's wildcards in
``q`` or a tag match only themselves."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from batch_helpers import call, make_store
from fastapi.testclient import TestClient
from sqlalchemy import text, update

from datapool.curation.selection import TrajectoryFilter, select_trajectory_ids
from datapool.lifecycle import transitions as lifecycle
from datapool.models import Trajectory
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore
from gateway.app import create_app
from gateway.dialects.chat_completions import ChatCompletions
from gateway.settings import GatewaySettings

PARIS = timezone(timedelta(hours=1))
# Rows a, b, c created 15:10, 15:20, 15:30 UTC; 16:20+01:00 is 15:20 UTC, b's instant.
CREATED = {"a": "15:10:00", "b": "15:20:00", "c": "15:30:00"}
B_IN_PARIS = "2026-11-30T16:20:00+01:00"
B_IN_UTC = "2026-11-30T15:20:00Z"


@pytest.fixture
def store(pool_settings: PoolSettings) -> Iterator[PoolStore]:
    store = make_store(pool_settings)
    yield store
    store.engine.dispose()


@pytest.fixture
def client(store: PoolStore, pool_settings: PoolSettings) -> Iterator[TestClient]:
    app = create_app(GatewaySettings(), pool_settings)
    with TestClient(app, base_url="http://127.0.0.1") as test_client:
        yield test_client


def stored_text(store: PoolStore, trajectory_id: str) -> str:
    with store.engine.connect() as connection:
        return str(
            connection.execute(
                text("SELECT created_at FROM trajectories WHERE id = :id"), {"id": trajectory_id}
            ).scalar_one()
        )


@pytest.fixture
def timed(store: PoolStore) -> PoolStore:
    """Trajectories a, b, c with ``created_at`` written by raw SQL in each backend's own
    format, as rows written before timestamps were converted to UTC on bind would be."""
    sqlite = store.engine.dialect.name == "sqlite"
    for tid in CREATED:
        lifecycle.create_trajectory(store.sessions, tid)
    with store.engine.begin() as connection:
        for tid, clock in CREATED.items():
            # SQLAlchemy's SQLite storage format; PostgreSQL parses the offset itself.
            stamp = f"2026-11-30 {clock}.000000" if sqlite else f"2026-11-30 {clock}+00"
            connection.execute(
                text("UPDATE trajectories SET created_at = :at WHERE id = :id"),
                {"at": stamp, "id": tid},
            )
    return store


def api_ids(client: TestClient, **params: Any) -> list[str]:
    page = client.get("/api/trajectories", params=params).json()
    return sorted(row["id"] for row in page["data"])


def inspector_ids(client: TestClient, **params: Any) -> list[str]:
    page = client.get("/api/inspector/trajectories", params=params).json()
    return sorted(row["id"] for row in page["data"])


def spec_ids(store: PoolStore, **where: Any) -> list[str]:
    with store.sessions() as session:
        return sorted(select_trajectory_ids(session, TrajectoryFilter(**where)))


def test_created_after_with_an_offset_names_the_same_instant_as_utc(
    timed: PoolStore, client: TestClient
) -> None:
    # created_after is inclusive (>=), created_before exclusive (<): b = 15:20 UTC splits them.
    for at in (B_IN_PARIS, B_IN_UTC):
        assert api_ids(client, created_after=at) == ["b", "c"], at
        assert api_ids(client, created_before=at) == ["a"], at
        assert inspector_ids(client, created_after=at) == ["b", "c"], at
        assert inspector_ids(client, created_before=at) == ["a"], at
        instant = datetime.fromisoformat(at)
        assert spec_ids(timed, created_after=instant) == ["b", "c"], at
        assert spec_ids(timed, created_before=instant) == ["a"], at
    # A time without an offset is UTC on both backends (PostgreSQL no longer uses its session
    # time zone): 15:20 naive is b's instant.
    assert api_ids(client, created_after="2026-11-30T15:20:00") == ["b", "c"]


def test_timestamps_are_stored_as_utc_text_and_read_back_in_utc(
    timed: PoolStore, client: TestClient
) -> None:
    # 16:40+01:00 is 15:40 UTC; on SQLite the stored text keeps the format of rows a-c.
    with timed.sessions.begin() as session:
        session.execute(
            update(Trajectory)
            .where(Trajectory.id == "b")
            .values(created_at=datetime(2026, 11, 30, 16, 40, tzinfo=PARIS))
        )
    if timed.engine.dialect.name == "sqlite":
        assert stored_text(timed, "a") == "2026-11-30 15:10:00.000000"
        assert stored_text(timed, "b") == "2026-11-30 15:40:00.000000"
    expected = {
        "a": datetime(2026, 11, 30, 15, 10, tzinfo=UTC),
        "b": datetime(2026, 11, 30, 15, 40, tzinfo=UTC),
        "c": datetime(2026, 11, 30, 15, 30, tzinfo=UTC),
    }
    for path in ("/api/trajectories", "/api/inspector/trajectories"):
        rows = client.get(path).json()["data"]
        created = {row["id"]: datetime.fromisoformat(row["created_at"]) for row in rows}
        assert created == expected, path
        # An explicit zero offset, so a browser's Date() never reads it as local time.
        assert all(value.utcoffset() == timedelta(0) for value in created.values()), path
    with timed.sessions() as session:
        b = session.get(Trajectory, "b")
        assert b is not None and b.created_at == expected["b"]
    # Cursor pages carry b's time back and forth: newest first, one row a page.
    seen: list[str] = []
    params: dict[str, Any] = {"limit": 1}
    while True:
        page = client.get("/api/trajectories", params=params).json()
        seen += [row["id"] for row in page["data"]]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    assert seen == ["b", "c", "a"]


def record(store: PoolStore, trajectory_id: str, content: str) -> None:
    """Trajectory ``trajectory_id`` with one step whose request is one user message."""
    lifecycle.create_trajectory(store.sessions, trajectory_id)
    request = {"messages": [{"role": "user", "content": content}]}
    canonical = ChatCompletions().canonical(request)  # what the pool reads of a call
    record = dataclasses.replace(call([1, 2], [3]), request=request, canonical=canonical)
    store.record_call(trajectory_id, record)


def test_like_wildcards_in_q_match_only_themselves(store: PoolStore, client: TestClient) -> None:
    record(store, "percent", "50% off snake-case")
    record(store, "underscore", "snake_case name")
    record(store, "path", "open C:\\temp\\x")
    record(store, "quoted", 'say "hi" and café')
    everyone = ["path", "percent", "quoted", "underscore"]
    for ids in (api_ids, inspector_ids):
        assert ids(client, q="%") == ["percent"]
        assert ids(client, q="_") == ["underscore"]
        assert ids(client, q="0%") == ["percent"]
        assert ids(client, q="e_c") == ["underscore"]  # not 'snake-case'
        assert ids(client, q="\\") == ["path"]
        assert ids(client, q="C:\\TEMP") == ["path"]  # any case
        assert ids(client, q='"hi"') == ["quoted"]  # matched as the JSON spells it: \"hi\"
        assert ids(client, q="café") == ["quoted"]  # stored as caf\u00e9
        # q searches the whole request JSON, keys and roles included, not only message text.
        assert ids(client, q="role") == everyone
        assert ids(client, q="nowhere") == []


def test_q_finds_words_of_a_tool_list_stored_once_for_every_step(
    store: PoolStore, client: TestClient
) -> None:
    """A tool list of 512 bytes or more is a shared ``json_blobs`` row, not part of each step's
    canonical JSON; q still finds its words, on no other trajectory."""
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "description": "x" * 100}}
        for i in range(6)
    ]
    tools[3]["function"]["description"] = "Frobnicates the widget."
    request = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    lifecycle.create_trajectory(store.sessions, "tooled")
    store.record_call(
        "tooled",
        dataclasses.replace(
            call([1, 2], [3]), request=request, canonical=ChatCompletions().canonical(request)
        ),
    )
    record(store, "plain", "no tools here")
    with store.engine.connect() as connection:
        canonical = connection.execute(text("SELECT canonical FROM steps")).scalars().all()
    assert not any("Frobnicates" in str(value) for value in canonical)  # stored as a blob
    for ids in (api_ids, inspector_ids):
        assert ids(client, q="frobnicates the") == ["tooled"]
        assert ids(client, q="no tools") == ["plain"]


def test_a_tag_with_an_underscore_matches_only_itself(store: PoolStore, client: TestClient) -> None:
    lifecycle.create_trajectory(store.sessions, "exact", tags=["a_b"])
    lifecycle.create_trajectory(store.sessions, "lookalike", tags=["axb"])
    lifecycle.create_trajectory(store.sessions, "percent", tags=["50%"])
    assert api_ids(client, tag="a_b") == ["exact"]
    assert inspector_ids(client, tag="a_b") == ["exact"]
    assert spec_ids(store, tags=["a_b"]) == ["exact"]
    assert api_ids(client, tag="%") == []


# Instants Python's datetime cannot hold in UTC: 00:00:01+07:00 on 1 January of year 1 is
# 17:00:01 UTC on 31 December of year 0, and 23:59:59-07:00 on 31 December 9999 is 06:59:59
# UTC in year 10000 (main converted them in the query: OverflowError, 500).
BEFORE_YEAR_1 = "0001-01-01T00:00:01+07:00"
AFTER_YEAR_9999 = "9999-12-31T23:59:59-07:00"


@pytest.mark.parametrize(
    ("path", "param", "value"),
    [
        ("/api/trajectories", "created_after", BEFORE_YEAR_1),
        ("/api/trajectories", "created_before", AFTER_YEAR_9999),
        ("/api/inspector/trajectories", "created_after", BEFORE_YEAR_1),
        ("/api/inspector/trajectories", "created_before", AFTER_YEAR_9999),
        ("/api/inspector/trajectory-ids", "created_after", BEFORE_YEAR_1),
        ("/api/inspector/trajectory-ids", "created_before", AFTER_YEAR_9999),
        ("/api/charts", "since", "0001-01-01T00:00:00+01:00"),
    ],
)
def test_a_time_outside_utc_range_is_400_naming_the_parameter(
    timed: PoolStore, client: TestClient, path: str, param: str, value: str
) -> None:
    answer = client.get(
        path, params={param: value, "bucket_s": 1} if param == "since" else {param: value}
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_request")
    assert (
        "expected an instant from 0001-01-01T00:00:00Z to 9999-12-31T23:59:59.999999Z"
        in (error["message"])
    )
    # The bounds themselves, in UTC, are instants like any other.
    edge = "0001-01-01T00:00:00Z" if param != "created_before" else "9999-12-31T23:59:59Z"
    assert client.get(path, params={param: edge}).status_code == 200


def test_a_filter_body_time_outside_utc_range_is_400_and_labels_nothing(
    timed: PoolStore, client: TestClient
) -> None:
    body = {"target": "trajectory", "tags": ["x"], "filter": {"created_after": BEFORE_YEAR_1}}
    answer = client.post("/api/labels/bulk", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "filter.created_after"


# 253402300800 s is 10000-01-01T00:00:00Z, one second past UTC's range; pydantic alone read any
# number past 2e10 as milliseconds: 253402300800 ms is 1978-01-11T21:31:40.8Z, so main filtered
# by a 1978 date. A number is Unix seconds here, whatever its size.
PAST_YEAR_9999_S = 253402300800


def test_a_filter_body_number_is_unix_seconds_never_milliseconds(
    timed: PoolStore, client: TestClient
) -> None:
    body = {"target": "trajectory", "tags": ["x"], "filter": {"created_after": PAST_YEAR_9999_S}}
    answer = client.post("/api/labels/bulk", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "filter.created_after"
    assert "a number is Unix seconds" in error["message"]
    # b's instant, 2026-11-30T15:20:00Z, as seconds: 20,787 days and 55,200 s after the epoch.
    b_s = 20787 * 86400 + 15 * 3600 + 20 * 60
    assert spec_ids(timed, created_after=b_s) == ["b", "c"]
    assert api_ids(client, created_after=str(b_s)) == ["b", "c"]
    assert (
        client.get("/api/trajectories", params={"created_before": PAST_YEAR_9999_S}).json()[
            "error"
        ]["param"]
        == "created_before"
    )
