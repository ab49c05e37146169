"""Lineages: which conversation of its trajectory each step belongs to, named by the
client's headers (Claude Code, Codex, OpenCode, ``X-Trajgate-Lineage``) or inferred from the
continuation; a named lineage's steps get their parent among that lineage's steps only; every
stored pool gets its lineages on migration 0016 by the writer's own rules.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from gateway_helpers import steps_of
from sqlalchemy import select, text
from test_conversation_rows import MODEL, assert_one_row_per_conversation, merged_rows

from datapool import db
from datapool.batches.build import build_rows
from datapool.batches.exports import export_batch
from datapool.batches.spec import BatchSpec
from datapool.db import make_engine
from datapool.lifecycle.transitions import close_trajectory
from datapool.models import Batch, Step, TrajectoryStatus
from datapool.queries.export import export_trajectories
from datapool.queries.lineages import lineage_view
from datapool.settings import PoolSettings
from datapool.steps.records import CallRecord, ChoiceRecord, LineageRecord
from datapool.steps.store import PoolStore
from gateway.app import create_app
from gateway.dialects.chat_completions import ChatCompletions
from gateway.errors import InvalidRequestError
from gateway.proxy.lineages import lineage_of
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings

PARENT = "x-trajgate-lineage-parent"
SESSION = "5f0c7a52-2d7e-4f7e-9d55-0c1d2e3f4a5b"


# -- headers, one client at a time -----------------------------------------------------------


def test_claude_code_names_the_session_for_the_main_agent_and_the_agent_id_for_a_sub_agent() -> (
    None
):
    assert lineage_of({"x-claude-code-session-id": SESSION}) == LineageRecord(SESSION, None, "main")
    sub = {"x-claude-code-session-id": SESSION, "x-claude-code-agent-id": "agent-7"}
    assert lineage_of(sub) == LineageRecord("agent-7", SESSION, "subagent")
    nested = {**sub, "x-claude-code-parent-agent-id": "agent-3"}
    assert lineage_of(nested) == LineageRecord("agent-7", "agent-3", "subagent")


@pytest.mark.parametrize(
    ("request_class", "expected"),
    [
        ("main", LineageRecord(SESSION, None, "main")),
        ("subagent", LineageRecord(SESSION, None, "subagent")),
        ("workflow", LineageRecord(SESSION, None, "subagent")),
        # A lineage that starts at the call, its parent the session's.
        ("compaction", LineageRecord(None, SESSION, "compaction")),
        ("auxiliary", LineageRecord(None, SESSION, "side_call")),
        ("side_reply", LineageRecord(None, SESSION, "side_call")),
        ("a-class-of-a-later-version", LineageRecord(SESSION, None, "main")),
    ],
)
def test_claude_code_request_class_sets_the_lineage_kind(
    request_class: str, expected: LineageRecord
) -> None:
    headers = {"x-claude-code-session-id": SESSION, "x-claude-code-request-class": request_class}
    assert lineage_of(headers) == expected


def test_codex_names_the_thread_and_reads_agent_and_request_kind_from_its_turn_metadata() -> None:
    def metadata(**fields: str) -> str:
        return json.dumps({"session_id": "s-1", "thread_id": "t-1", "turn_id": "u-1", **fields})

    main = {"session-id": "s-1", "thread-id": "s-1", "x-codex-turn-metadata": metadata()}
    assert lineage_of(main) == LineageRecord("s-1", None, "main")
    root = {**main, "x-codex-turn-metadata": metadata(agent_name="/root", request_kind="turn")}
    assert lineage_of(root) == LineageRecord("s-1", None, "main")
    sub = {
        "session-id": "s-1",
        "thread-id": "t-2",
        "x-codex-turn-metadata": metadata(agent_name="/root/explorer"),
    }
    assert lineage_of(sub) == LineageRecord("t-2", "s-1", "subagent")
    compaction = {**main, "x-codex-turn-metadata": metadata(request_kind="compaction")}
    assert lineage_of(compaction) == LineageRecord(None, "s-1", "compaction")
    # Only the metadata (no session headers): its own ids; metadata that is not JSON: ignored.
    assert lineage_of({"x-codex-turn-metadata": metadata()}) == LineageRecord("t-1", None, "main")
    assert lineage_of({"session-id": "s-1", "x-codex-turn-metadata": "{"}) == LineageRecord(
        "s-1", None, "main"
    )


def test_opencode_names_the_session_and_its_parent_session() -> None:
    assert lineage_of({"x-session-id": "ses_a"}) == LineageRecord("ses_a", None, "main")
    child = {"x-session-id": "ses_b", "x-parent-session-id": "ses_a"}
    assert lineage_of(child) == LineageRecord("ses_b", "ses_a", "subagent")


def test_trajgate_headers_come_before_a_clients_own() -> None:
    headers = {
        "x-claude-code-session-id": SESSION,
        "x-trajgate-lineage": "planner",
        "x-trajgate-lineage-parent": "root",
    }
    assert lineage_of(headers) == LineageRecord("planner", "root", "subagent")
    assert lineage_of({"x-trajgate-lineage": "root"}) == LineageRecord("root", None, "main")
    kinds = {"x-trajgate-lineage": "root", "x-trajgate-lineage-kind": "side_call"}
    assert lineage_of(kinds) == LineageRecord(None, "root", "side_call")
    alone = {"x-trajgate-lineage-kind": "compaction", "x-trajgate-lineage-parent": "root"}
    assert lineage_of(alone) == LineageRecord(None, "root", "compaction")


def test_no_lineage_header_leaves_the_lineage_to_the_pool() -> None:
    assert lineage_of({"user-agent": "QwenCode/0.15.10", "x-app": "cli"}) is None
    # A client's own id that cannot be one (over 200 characters) is ignored, not refused.
    assert lineage_of({"x-claude-code-session-id": "x" * 201}) is None


@pytest.mark.parametrize(
    ("headers", "param"),
    [
        ({"x-trajgate-lineage": ""}, "X-Trajgate-Lineage"),
        ({"x-trajgate-lineage": "a b"}, "X-Trajgate-Lineage"),
        ({"x-trajgate-lineage": "x" * 201}, "X-Trajgate-Lineage"),
        (
            {"x-trajgate-lineage": "a", "x-trajgate-lineage-parent": "-b"},
            "X-Trajgate-Lineage-Parent",
        ),
        (
            {"x-trajgate-lineage": "a", "x-trajgate-lineage-kind": "helper"},
            "X-Trajgate-Lineage-Kind",
        ),
        (
            {"x-trajgate-lineage": "a", "x-trajgate-lineage-parent": "a"},
            "X-Trajgate-Lineage-Parent",
        ),
        ({PARENT: "a"}, "X-Trajgate-Lineage"),
        ({"x-trajgate-lineage-kind": "subagent"}, "X-Trajgate-Lineage"),
    ],
)
def test_a_malformed_trajgate_lineage_header_is_refused_naming_it(
    headers: dict[str, str], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        lineage_of(headers)
    assert raised.value.param == param


# -- the writer: parents within a named lineage, inferred lineages ---------------------------


def chat_call(
    messages: list[dict[str, Any]],
    prompt: list[int],
    response: list[int],
    lineage: LineageRecord | None = None,
    *,
    outcome: str = "ok",
) -> CallRecord:
    """A chat call as the gateway records it (its canonical record from the chat dialect),
    answered with ``response`` (logprobs -0.5 each)."""
    dialect = ChatCompletions()
    body = {"model": "tiny", "messages": messages}
    prepared = dialect.prepare(body)
    ok = outcome == "ok"
    return CallRecord(
        request=body,
        upstream_request=prepared.upstream_body,
        model="tiny",
        upstream="http://up",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt if ok else None,
        prompt_tokens=len(prompt) if ok else None,
        choices=[
            ChoiceRecord(
                0,
                response if ok else None,
                [-0.5] * len(response) if ok else None,
                {"role": "assistant", "content": "ok"},
                "stop",
            )
        ],
        outcome=outcome,
        endpoint=dialect.name,
        canonical=dialect.canonical(prepared.upstream_body),
        history_field=dialect.history_field,
        lineage=lineage,
    )


def make_store(pool_settings: PoolSettings) -> PoolStore:
    return PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)


def lineages(store: PoolStore, trajectory_id: str) -> list[tuple[Any, ...]]:
    return [
        (s.lineage_id, s.lineage_parent_id, s.lineage_kind, s.lineage_source)
        for s in store.steps_of(trajectory_id)
    ]


SYSTEM = {"role": "system", "content": "You are an agent."}
TASK = {"role": "user", "content": "Fix the test."}


def test_a_named_sub_agent_whose_prompt_extends_the_main_agents_is_a_root_of_its_own(
    pool_settings: PoolSettings,
) -> None:
    # Two agents of one session with the same system prompt and task; the sub-agent's first
    # prompt [1, 2, 3, 4, 9] happens to extend the main's P + R = [1, 2, 3] + [4]. By tokens it
    # would continue the main's step; named by its header it is the first step of its lineage.
    store = make_store(pool_settings)
    main = LineageRecord(SESSION, None, "main")
    sub = LineageRecord("agent-1", SESSION, "subagent")
    answered = [SYSTEM, TASK, {"role": "assistant", "content": "ok"}]
    [m0] = store.record_call("named", chat_call([SYSTEM, TASK], [1, 2, 3], [4], main))
    [s0] = store.record_call("named", chat_call([*answered, TASK], [1, 2, 3, 4, 9], [5], sub))
    [m1] = store.record_call("named", chat_call([*answered, TASK], [1, 2, 3, 4, 7], [8], main))
    # The sub-agent's next turn extends its own step, and also the main's: its lineage decides.
    [s1] = store.record_call("named", chat_call([*answered, TASK], [1, 2, 3, 4, 9, 5, 6], [7], sub))
    steps = {s.id: s for s in store.steps_of("named")}
    assert [steps[i].parent_step_id for i in (m0, s0, m1, s1)] == [None, None, m0, s0]
    assert [steps[i].extends_parent for i in (m0, s0, m1, s1)] == [None, None, True, True]
    assert [s for s in steps.values() if "prefix_break" in s.flags] == []
    assert lineages(store, "named") == [
        (SESSION, None, "main", "headers"),
        ("agent-1", SESSION, "subagent", "headers"),
        (SESSION, None, "main", "headers"),
        ("agent-1", SESSION, "subagent", "headers"),
    ]


def test_without_headers_a_side_call_starts_a_lineage_and_continuations_stay_in_theirs(
    pool_settings: PoolSettings,
) -> None:
    # main 0, a title call (a conversation start: a new root), main 1, a failed call (hung on
    # the latest step, main 1), the title call continued.
    store = make_store(pool_settings)
    title = [{"role": "system", "content": "Write a title."}, TASK]
    answered = [SYSTEM, TASK, {"role": "assistant", "content": "ok"}, TASK]
    [m0] = store.record_call("inferred", chat_call([SYSTEM, TASK], [1, 2, 3], [4]))
    [t0] = store.record_call("inferred", chat_call(title, [1, 50, 3], [51]))
    [m1] = store.record_call("inferred", chat_call(answered, [1, 2, 3, 4, 6], [7]))
    [failed] = store.record_call("inferred", chat_call(answered, [], [], outcome="upstream_error"))
    titled = [*title, {"role": "assistant", "content": "ok"}, TASK]
    [t1] = store.record_call("inferred", chat_call(titled, [1, 50, 3, 51, 52], [53]))
    steps = {s.id: s for s in store.steps_of("inferred")}
    assert steps[t0].divergence_kind == "side_call" and steps[t1].parent_step_id == t0
    assert steps[failed].parent_step_id == m1
    assert lineages(store, "inferred") == [
        (m0, None, "main", "inferred"),
        (t0, m0, "side_call", "inferred"),
        (m0, None, "main", "inferred"),
        (m0, None, "main", "inferred"),
        (t0, m0, "side_call", "inferred"),
    ]


def test_a_title_call_under_the_sessions_header_is_a_side_call_of_the_session(
    pool_settings: PoolSettings,
) -> None:
    # Claude Code sends its session id on its title calls too, without a request class: within
    # the session's lineage the structure says side call, so it starts its own lineage.
    store = make_store(pool_settings)
    main = LineageRecord(SESSION, None, "main")
    title = [{"role": "system", "content": "Write a title."}, TASK]
    store.record_call("titled", chat_call([SYSTEM, TASK], [1, 2, 3], [4], main))
    [t0] = store.record_call("titled", chat_call(title, [1, 50, 3], [51], main))
    assert lineages(store, "titled")[1] == (t0, SESSION, "side_call", "inferred")
    assert [s for s in store.steps_of("titled") if "prefix_break" in s.flags] == []


def test_a_side_call_named_by_header_is_no_break_of_the_main_chain_that_goes_on_after_it(
    pool_settings: PoolSettings,
) -> None:
    # Claude Code's title call (request class ``auxiliary``) between two main turns: a root by
    # its header, so it starts a tree of its own like an inferred side call; the main turn
    # after it extends m0 and is not a hidden break against the title (the latest step). The
    # same from a writer whose memory is rebuilt from the pool.
    main = LineageRecord(SESSION, None, "main")
    title = LineageRecord(None, SESSION, "side_call")
    answered = [SYSTEM, TASK, {"role": "assistant", "content": "ok"}, TASK]
    store = make_store(pool_settings)
    [m0] = store.record_call("aside", chat_call([SYSTEM, TASK], [1, 2, 3], [4], main))
    store.record_call("aside", chat_call([TASK], [1, 50], [51], title))
    [m1] = store.record_call("aside", chat_call(answered, [1, 2, 3, 4, 5], [6], main))
    store.record_call("aside", chat_call([TASK], [1, 50], [52], title))
    store.engine.dispose()
    store = make_store(pool_settings)
    [m2] = store.record_call(
        "aside", chat_call([*answered, TASK], [1, 2, 3, 4, 5, 6, 7], [8], main)
    )
    steps = {s.id: s for s in store.steps_of("aside")}
    assert [s.flags for s in steps.values() if "prefix_break" in s.flags] == []
    assert [(steps[i].parent_step_id, steps[i].extends_parent) for i in (m1, m2)] == [
        (m0, True),
        (m1, True),
    ]
    store.engine.dispose()


def test_a_fresh_writer_places_a_named_call_within_its_lineage_from_the_stored_steps(
    pool_settings: PoolSettings,
) -> None:
    # The lineage memory rebuilt from the pool (another process, a restart) knows each
    # candidate's lineage: the sub-agent's next turn hangs on its own step.
    sub = LineageRecord("agent-1", SESSION, "subagent")
    main = LineageRecord(SESSION, None, "main")
    answered = [SYSTEM, TASK, {"role": "assistant", "content": "ok"}, TASK]
    first = make_store(pool_settings)
    [m0] = first.record_call("fresh", chat_call([SYSTEM, TASK], [1, 2, 3], [4], main))
    [s0] = first.record_call("fresh", chat_call(answered, [1, 2, 3, 4, 9], [5], sub))
    first.engine.dispose()
    second = make_store(pool_settings)
    [s1] = second.record_call("fresh", chat_call(answered, [1, 2, 3, 4, 9, 5, 6], [7], sub))
    [m1] = second.record_call("fresh", chat_call(answered, [1, 2, 3, 4, 7], [8], main))
    steps = {s.id: s for s in second.steps_of("fresh")}
    assert (steps[s1].parent_step_id, steps[m1].parent_step_id) == (s0, m0)


def test_after_a_compaction_request_the_lineage_goes_on_in_the_compaction_unbroken(
    pool_settings: PoolSettings,
) -> None:
    # Codex's thread: two turns, its compaction request (``request_kind: compaction``: the
    # history + "summarise"), then turns whose history is the summary. Before, the first of
    # those was a prefix break of the thread; now it starts the compaction's row, linked to
    # the thread by ``lineage_parent_id``, and the next turn extends it.
    store = make_store(pool_settings)
    thread = LineageRecord("thread-1", None, "main")
    compaction = LineageRecord(None, "thread-1", "compaction")
    summary = [SYSTEM, {"role": "user", "content": "Summary: the test was fixed."}]
    answered = [SYSTEM, TASK, {"role": "assistant", "content": "ok"}, TASK]
    summarise = [*answered, {"role": "assistant", "content": "ok"}, TASK]
    [t0] = store.record_call("compacted", chat_call([SYSTEM, TASK], [1, 2, 3], [4], thread))
    [t1] = store.record_call("compacted", chat_call(answered, [1, 2, 3, 4, 5], [6], thread))
    [c] = store.record_call(
        "compacted", chat_call(summarise, [1, 2, 3, 4, 5, 6, 7], [8], compaction)
    )
    [p1] = store.record_call("compacted", chat_call(summary, [1, 2, 30], [31], thread))
    going_on = [*summary, {"role": "assistant", "content": "ok"}, TASK]
    [p2] = store.record_call("compacted", chat_call(going_on, [1, 2, 30, 31, 32], [33], thread))
    steps = store.steps_of("compacted")
    assert [s for s in steps if "prefix_break" in s.flags] == []
    assert [s.parent_step_id for s in steps] == [None, t0, None, None, p1]
    assert lineages(store, "compacted") == [
        ("thread-1", None, "main", "headers"),
        ("thread-1", None, "main", "headers"),
        (c, "thread-1", "compaction", "headers"),
        (c, "thread-1", "compaction", "headers"),
        (c, "thread-1", "compaction", "headers"),
    ]
    close_trajectory(store.sessions, "compacted", TrajectoryStatus.COMPLETE, final_reward=1.0)
    rows = build_rows(store, BatchSpec(algorithm="sft", layout="merged"))[0].to_pylist()
    mine = [r for r in rows if r["trajectory_id"] == "compacted"]
    assert [r["step_ids"] for r in mine] == [[t0, t1], [c], [p1, p2]]
    assert [r["lineage_id"] for r in mine] == ["thread-1", c, c]
    store.engine.dispose()


def test_a_second_compaction_compacts_the_first_and_the_rows_chain(
    pool_settings: PoolSettings,
) -> None:
    # The thread is compacted twice: turns t0 t1, compaction c1, turns p1 p2 on its summary,
    # compaction c2 (its history: p2's conversation + "summarise"), turns q1 q2 on the second
    # summary. Both requests name the thread ("thread-1"); the second compacts what c1's
    # conversation holds, so its parent is c1, not the thread: thread-1 <- c1 <- c2.
    store = make_store(pool_settings)
    thread = LineageRecord("thread-1", None, "main")
    compaction = LineageRecord(None, "thread-1", "compaction")
    ok = {"role": "assistant", "content": "ok"}
    answered = [SYSTEM, TASK, ok, TASK]
    summary = [SYSTEM, {"role": "user", "content": "Summary: the test was fixed."}]
    again = [SYSTEM, {"role": "user", "content": "Summary: fixed, then documented."}]

    def record(messages: list[Any], prompt: list[int], lineage: LineageRecord) -> str:
        [step_id] = store.record_call(
            "twice", chat_call(messages, prompt, [prompt[-1] + 1], lineage)
        )
        return step_id

    t0 = record([SYSTEM, TASK], [1, 2, 3], thread)
    t1 = record(answered, [1, 2, 3, 4, 5], thread)
    c1 = record([*answered, ok, TASK], [1, 2, 3, 4, 5, 6, 7], compaction)
    p1 = record(summary, [1, 2, 30], thread)
    p2 = record([*summary, ok, TASK], [1, 2, 30, 31, 32], thread)
    c2 = record([*summary, ok, TASK, ok, TASK], [1, 2, 30, 31, 32, 33, 34], compaction)
    q1 = record(again, [1, 2, 60], thread)
    q2 = record([*again, ok, TASK], [1, 2, 60, 61, 62], thread)
    steps = store.steps_of("twice")
    assert [s for s in steps if "prefix_break" in s.flags] == []
    assert [s.parent_step_id for s in steps] == [None, t0, None, None, p1, None, None, q1]
    assert lineages(store, "twice") == [
        ("thread-1", None, "main", "headers"),
        ("thread-1", None, "main", "headers"),
        (c1, "thread-1", "compaction", "headers"),
        (c1, "thread-1", "compaction", "headers"),
        (c1, "thread-1", "compaction", "headers"),
        (c2, c1, "compaction", "headers"),
        (c2, c1, "compaction", "headers"),
        (c2, c1, "compaction", "headers"),
    ]
    # A fresh writer (its memory rebuilt from the stored lineages) chains a third the same way.
    store.engine.dispose()
    store = make_store(pool_settings)
    c3 = record([*again, ok, TASK, ok, TASK], [1, 2, 60, 61, 62, 63, 64], compaction)
    assert lineages(store, "twice")[-1] == (c3, c2, "compaction", "headers")
    close_trajectory(store.sessions, "twice", TrajectoryStatus.COMPLETE, final_reward=1.0)
    rows = build_rows(store, BatchSpec(algorithm="sft", layout="merged"))[0].to_pylist()
    mine = [r for r in rows if r["trajectory_id"] == "twice"]
    assert [r["step_ids"] for r in mine] == [[t0, t1], [c1], [p1, p2], [c2], [q1, q2], [c3]]
    assert [r["lineage_id"] for r in mine] == ["thread-1", c1, c1, c2, c2, c3]
    store.engine.dispose()


# -- lineage rewards ---------------------------------------------------------------------------


def test_a_lineage_reward_rides_on_that_lineages_row_and_the_trajectory_reward_on_every_row(
    pool_settings: PoolSettings,
) -> None:
    # Main and sub-agent, two turns each, interleaved; the trajectory is rewarded 1.0 and the
    # sub-agent's lineage 0.25 through the API. Merged rows: [main 0, main 1], [sub 0, sub 1].
    store = make_store(pool_settings)
    main = LineageRecord(SESSION, None, "main")
    sub = LineageRecord("agent-1", SESSION, "subagent")
    answered = [SYSTEM, TASK, {"role": "assistant", "content": "ok"}, TASK]
    store.record_call("rewarded", chat_call([SYSTEM, TASK], [1, 2, 3], [4], main))
    store.record_call("rewarded", chat_call([SYSTEM, TASK], [1, 5, 3], [6], sub))
    store.record_call("rewarded", chat_call(answered, [1, 2, 3, 4, 7], [8], main))
    store.record_call("rewarded", chat_call(answered, [1, 5, 3, 6, 7], [9], sub))
    close_trajectory(store.sessions, "rewarded", TrajectoryStatus.COMPLETE, final_reward=1.0)
    reward = {"target": "lineage", "name": "judge", "value": 0.25}
    with TestClient(
        create_app(GatewaySettings(), pool_settings), base_url="http://127.0.0.1"
    ) as api:
        posted = api.post(
            "/api/rewards", json={"rewards": [{**reward, "target_id": "rewarded/agent-1"}]}
        )
        unknown = api.post(
            "/api/rewards", json={"rewards": [{**reward, "target_id": "rewarded/agent-9"}]}
        )
        malformed = api.post("/api/rewards", json={"rewards": [{**reward, "target_id": "agent-1"}]})
    assert posted.status_code == 201, posted.text
    assert unknown.status_code == 404 and "lineage rewarded/agent-9" in unknown.text
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "target_id"
    rows = build_rows(store, BatchSpec(algorithm="sft", layout="merged"))[0].to_pylist()
    mine = [r for r in rows if r["trajectory_id"] == "rewarded"]
    assert [r["lineage_id"] for r in mine] == [SESSION, "agent-1"]
    assert [json.loads(r["lineage_rewards_json"]) for r in mine] == [{}, {"judge": 0.25}]
    assert [json.loads(r["rewards_json"]) for r in mine] == [{"final": 1.0}] * 2
    store.engine.dispose()


# -- migration 0016 --------------------------------------------------------------------------


def test_migration_0016_backfills_the_lineages_the_writer_infers(
    empty_database_url: str, tmp_path: Path
) -> None:
    """A pool written by today's code without headers (a main chain, a side call, a failed
    call, a choice of n=2, the side call continued) loses its lineage columns on downgrade to
    0015 and gets the same values back on upgrade."""
    url = empty_database_url
    db.upgrade(url)
    store = PoolStore(make_engine(url), PoolSettings(data_dir=tmp_path / "d", database_url=url))
    title = [{"role": "system", "content": "Write a title."}, TASK]
    answered = [SYSTEM, TASK, {"role": "assistant", "content": "ok"}, TASK]
    store.record_call("pool", chat_call([SYSTEM, TASK], [1, 2, 3], [4]))
    store.record_call("pool", chat_call(title, [1, 50, 3], [51]))
    store.record_call("pool", chat_call(answered, [1, 2, 3, 4, 6], [7]))
    store.record_call("pool", chat_call(answered, [], [], outcome="upstream_error"))
    two = chat_call(answered, [1, 2, 3, 4, 6, 7, 8], [9])
    two = replace(two, choices=[*two.choices, ChoiceRecord(1, [10], [-0.5], None, "stop")])
    store.record_call("pool", two)
    titled = [*title, {"role": "assistant", "content": "ok"}, TASK]
    store.record_call("pool", chat_call(titled, [1, 50, 3, 51, 52], [53]))
    store.record_call("other", chat_call([SYSTEM, TASK], [1, 2, 3], [4]))
    written = {t: lineages(store, t) for t in ("pool", "other")}
    ids = [s.id for s in store.steps_of("pool")]
    store.engine.dispose()
    m0, t0 = ids[0], ids[1]
    # By hand: the main lineage is named after step 0, the title's after itself.
    main, side = (m0, None, "main", "inferred"), (t0, m0, "side_call", "inferred")
    assert written["pool"] == [main, side, main, main, main, main, side]
    db.downgrade(url, "0015")
    engine = make_engine(url)
    with engine.connect() as connection:
        columns = connection.execute(text("SELECT * FROM steps LIMIT 1")).keys()
    engine.dispose()
    assert "lineage_id" not in columns
    db.upgrade(url)
    store = PoolStore(make_engine(url), PoolSettings(data_dir=tmp_path / "d", database_url=url))
    assert {t: lineages(store, t) for t in ("pool", "other")} == written
    store.engine.dispose()


# -- through the gateway and the real vLLM ---------------------------------------------------


def claude_code_turn(
    server: BackgroundServer, system: str, history: list[Any], seed: int, agent: str | None
) -> list[Any]:
    """One Messages call with Claude Code's headers (its session, and ``agent`` on a
    sub-agent's calls); returns the history with the answer echoed and a new user turn."""
    headers = {"x-claude-code-session-id": SESSION, "x-app": "cli"}
    if agent is not None:
        headers["x-claude-code-agent-id"] = agent
    body = {"model": MODEL, "system": system, "messages": history, "max_tokens": 8}
    answer = httpx.post(
        f"{server.url}/t/claude-code/v1/messages",
        json={**body, "temperature": 1.0},
        headers=headers,
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    echo = {"role": "assistant", "content": answer.json()["content"]}
    return [*history, echo, {"role": "user", "content": f"Go on ({seed})."}]


def test_interleaved_claude_code_agents_are_one_lineage_and_one_row_each(
    gateway: BackgroundServer, pool_settings: PoolSettings, tmp_path: Path
) -> None:
    # The main agent and two sub-agents spawned with the very same prompt take turns: main 0,
    # a 0, b 0, main 1, a 1, b 1. Without headers b 0 is a re-send of a 0 (its twin's lineage);
    # named by ``x-claude-code-agent-id`` each sub-agent is a lineage of its own.
    task = [{"role": "user", "content": "Find where the test is defined."}]
    histories: dict[str | None, list[Any]] = {None: [TASK], "agent-a": task, "agent-b": task}
    systems = {None: "You are the main agent.", "agent-a": "You search.", "agent-b": "You search."}
    for k in range(2):
        for agent in (None, "agent-a", "agent-b"):
            histories[agent] = claude_code_turn(
                gateway, systems[agent], histories[agent], 10 * k + len(agent or ""), agent
            )
    steps = steps_of(pool_settings, "claude-code")
    main, a, b = steps[0::3], steps[1::3], steps[2::3]
    assert [s for s in steps if "prefix_break" in s.flags] == []
    assert [s.parent_step_id for s in steps[:3]] == [None, None, None]
    for chain in (main, a, b):
        assert (chain[1].parent_step_id, chain[1].extends_parent) == (chain[0].id, True)
        assert chain[1].continuation == "exact"
    assert [(s.lineage_id, s.lineage_parent_id, s.lineage_kind) for s in steps[:3]] == [
        (SESSION, None, "main"),
        ("agent-a", SESSION, "subagent"),
        ("agent-b", SESSION, "subagent"),
    ]
    assert [s.lineage_id for s in steps[3:]] == [SESSION, "agent-a", "agent-b"]
    rows = merged_rows(pool_settings, "claude-code")
    assert_one_row_per_conversation(rows, [main, a, b])
    assert [r["lineage_id"] for r in rows] == [SESSION, "agent-a", "agent-b"]
    # The pool export and a batch's messages export carry each step's and row's lineage.
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    export_trajectories(store, ["claude-code"], tmp_path / "steps.jsonl", "jsonl")
    exported = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["lineage_id"] for r in exported] == [SESSION, "agent-a", "agent-b"] * 2
    table = build_rows(store, BatchSpec(algorithm="sft", layout="merged"))[0]
    export_batch(store, Batch(id="b"), table, tmp_path / "rows.jsonl", "messages")
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert [json.loads(line)["lineage_id"] for line in lines] == [SESSION, "agent-a", "agent-b"]
    # The pool API answers each step's lineage.
    detail = httpx.get(f"{gateway.url}/api/trajectories/claude-code", timeout=30).json()
    assert [s["lineage_id"] for s in detail["steps"]] == [SESSION, "agent-a", "agent-b"] * 2
    one = httpx.get(f"{gateway.url}/api/steps/{a[1].id}", timeout=30).json()
    assert (one["lineage_id"], one["lineage_parent_id"]) == ("agent-a", SESSION)
    assert (one["lineage_kind"], one["lineage_source"]) == ("subagent", "headers")
    store.engine.dispose()


def lineage_chat(
    server: BackgroundServer,
    trajectory_id: str,
    messages: list[Any],
    seed: int,
    headers: dict[str, str],
) -> list[Any]:
    """One unary chat call through the gateway with ``headers`` (trajgate's lineage headers),
    freely sampled (4 tokens); returns the history the agent sends next: ``messages``, the
    answer echoed, a new user message."""
    answer = httpx.post(
        f"{server.url}/t/{trajectory_id}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 1.0},
        headers=headers,
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    echo = {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]}
    return [*messages, echo, {"role": "user", "content": f"Go on ({seed})."}]


def test_through_the_gateway_a_compaction_of_a_compaction_is_parented_by_the_first(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # The real vLLM behind the gateway, trajgate's own headers: the thread "thread-1" takes two
    # turns, is compacted (X-Trajgate-Lineage-Kind: compaction), goes on from a summary for two
    # turns, is compacted again and goes on from a second summary. Steps, in call order:
    # t0 t1 c1 p1 p2 c2 q1 q2.
    thread = {"X-Trajgate-Lineage": "thread-1"}
    compact = {**thread, "X-Trajgate-Lineage-Kind": "compaction"}
    summarise = {"role": "user", "content": "Summarise the conversation so far."}
    history = lineage_chat(gateway, "compacted-twice", [SYSTEM, TASK], 0, thread)
    history = lineage_chat(gateway, "compacted-twice", history, 1, thread)
    lineage_chat(gateway, "compacted-twice", [*history[:-1], summarise], 2, compact)
    summary = [SYSTEM, {"role": "user", "content": "Summary: the test was found."}]
    history = lineage_chat(gateway, "compacted-twice", summary, 3, thread)
    history = lineage_chat(gateway, "compacted-twice", history, 4, thread)
    lineage_chat(gateway, "compacted-twice", [*history[:-1], summarise], 5, compact)
    again = [SYSTEM, {"role": "user", "content": "Summary: the test was found and fixed."}]
    history = lineage_chat(gateway, "compacted-twice", again, 6, thread)
    lineage_chat(gateway, "compacted-twice", history, 7, thread)
    steps = steps_of(pool_settings, "compacted-twice")
    t0, t1, c1, p1, p2, c2, q1, q2 = steps
    assert [s for s in steps if "prefix_break" in s.flags] == []
    assert [s.parent_step_id for s in steps] == [None, t0.id, None, None, p1.id, None, None, q1.id]
    assert [(s.lineage_id, s.lineage_parent_id, s.lineage_kind) for s in steps] == [
        ("thread-1", None, "main"),
        ("thread-1", None, "main"),
        (c1.id, "thread-1", "compaction"),
        (c1.id, "thread-1", "compaction"),
        (c1.id, "thread-1", "compaction"),
        (c2.id, c1.id, "compaction"),
        (c2.id, c1.id, "compaction"),
        (c2.id, c1.id, "compaction"),
    ]
    # The merged rows chain thread-1 <- c1 <- c2 through their steps' lineage_parent_id.
    rows = merged_rows(pool_settings, "compacted-twice")
    assert [r["step_ids"] for r in rows] == [
        [t0.id, t1.id],
        [c1.id],
        [p1.id, p2.id],
        [c2.id],
        [q1.id, q2.id],
    ]
    assert [r["lineage_id"] for r in rows] == ["thread-1", c1.id, c1.id, c2.id, c2.id]


def spawn_a_sub_agent_and_a_side_call(server: BackgroundServer, trajectory_id: str) -> None:
    """Six calls through the gateway, named by trajgate's headers: the planner's turn 0, its
    sub-agent "searcher" (parent planner) for two turns, the planner's turn 1, a title call
    (``side_call`` of the planner) and the planner's turn 2."""
    planner = {"X-Trajgate-Lineage": "planner"}
    searcher = {"X-Trajgate-Lineage": "searcher", "X-Trajgate-Lineage-Parent": "planner"}
    title = {**planner, "X-Trajgate-Lineage-Kind": "side_call"}
    main = lineage_chat(server, trajectory_id, [SYSTEM, TASK], 0, planner)
    search = [{"role": "system", "content": "You search."}, TASK]
    search = lineage_chat(server, trajectory_id, search, 1, searcher)
    lineage_chat(server, trajectory_id, search, 2, searcher)
    main = lineage_chat(server, trajectory_id, main, 3, planner)
    lineage_chat(server, trajectory_id, [{"role": "user", "content": "Title this."}], 4, title)
    lineage_chat(server, trajectory_id, main, 5, planner)


def test_the_inspector_view_nests_each_lineage_under_its_spawning_step_with_its_rows(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    # Steps in call order: m0 s0 s1 m1 t0 m2. The searcher's spawning step is the planner's
    # latest call before s0 (m0); the title's is the planner's latest before t0 (m1). Merged
    # rows by first step: 0 = [m0, m1, m2], 1 = [s0, s1], 2 = [t0].
    spawn_a_sub_agent_and_a_side_call(gateway, "spawned")
    m0, s0, s1, m1, t0, m2 = steps_of(pool_settings, "spawned")
    view = httpx.get(f"{gateway.url}/api/inspector/trajectories/spawned", timeout=30).json()
    assert view["lineages"] == [
        {
            "id": "planner",
            "parent_id": None,
            "kind": "main",
            "source": "headers",
            "first_step_id": m0.id,
            "spawning_step_id": None,
            "steps": 3,
            "rows": [{"segment_index": 0, "step_ids": [m0.id, m1.id, m2.id]}],
        },
        {
            "id": "searcher",
            "parent_id": "planner",
            "kind": "subagent",
            "source": "headers",
            "first_step_id": s0.id,
            "spawning_step_id": m0.id,
            "steps": 2,
            "rows": [{"segment_index": 1, "step_ids": [s0.id, s1.id]}],
        },
        {
            "id": t0.id,
            "parent_id": "planner",
            "kind": "side_call",
            "source": "headers",
            "first_step_id": t0.id,
            "spawning_step_id": m1.id,
            "steps": 1,
            "rows": [{"segment_index": 2, "step_ids": [t0.id]}],
        },
    ]
    assert [s["segment_index"] for s in view["steps"]] == [0, 1, 1, 0, 2, 0]
    # The view's rows are the merged batch's rows.
    rows = merged_rows(pool_settings, "spawned")
    assert [r["step_ids"] for r in rows] == [[m0.id, m1.id, m2.id], [s0.id, s1.id], [t0.id]]
    assert [r["segment_index"] for r in rows] == [0, 1, 2]


def test_a_sub_agent_after_a_compaction_is_spawned_by_the_compactions_latest_call(
    pool_settings: PoolSettings,
) -> None:
    # The thread compacts (c1) and goes on in c1 (p1); then a sub-agent whose header names the
    # thread starts (a0). The thread's calls now live in c1, so a0's spawning step is p1, not
    # the thread's last pre-compaction call t0. A failed call of the thread (f) spawns nothing:
    # the sub-agent a1 started after it is still spawned by p1. Rows leave f out.
    store = make_store(pool_settings)
    thread = LineageRecord("thread-1", None, "main")
    sub = LineageRecord("agent-1", "thread-1", "subagent")
    ok = {"role": "assistant", "content": "ok"}
    summary = [SYSTEM, {"role": "user", "content": "Summary."}]
    compaction = LineageRecord(None, "thread-1", "compaction")
    [t0] = store.record_call("spawn", chat_call([SYSTEM, TASK], [1, 2, 3], [4], thread))
    [c1] = store.record_call(
        "spawn", chat_call([SYSTEM, TASK, ok, TASK], [1, 2, 3, 4, 5], [6], compaction)
    )
    [p1] = store.record_call("spawn", chat_call(summary, [1, 2, 30], [31], thread))
    [a0] = store.record_call("spawn", chat_call([SYSTEM, TASK], [1, 2, 40], [41], sub))
    [f] = store.record_call(
        "spawn", chat_call([*summary, ok, TASK], [], [], thread, outcome="upstream_error")
    )
    other = LineageRecord("agent-2", "thread-1", "subagent")
    [a1] = store.record_call("spawn", chat_call([SYSTEM, TASK], [1, 2, 50], [51], other))
    with store.sessions() as session:
        steps = list(
            session.scalars(
                select(Step).where(Step.trajectory_id == "spawn").order_by(Step.step_index)
            )
        )
    found, segment_index = lineage_view(steps, {f: "outcome 'upstream_error'"})
    assert [(x["id"], x["spawning_step_id"]) for x in found] == [
        ("thread-1", None),
        (c1, t0),
        ("agent-1", p1),
        ("agent-2", p1),
    ]
    assert [x["rows"] for x in found] == [
        [{"segment_index": 0, "step_ids": [t0]}],
        [{"segment_index": 1, "step_ids": [c1]}, {"segment_index": 2, "step_ids": [p1]}],
        [{"segment_index": 3, "step_ids": [a0]}],
        [{"segment_index": 4, "step_ids": [a1]}],
    ]
    assert segment_index == {t0: 0, c1: 1, p1: 2, a0: 3, f: None, a1: 4}
    store.engine.dispose()


@pytest.mark.parametrize(
    ("path", "body", "envelope"),
    [
        ("chat/completions", {"messages": [TASK], "max_tokens": 1}, "openai"),
        ("responses", {"input": "hi", "max_output_tokens": 1}, "openai"),
        ("messages", {"messages": [TASK], "max_tokens": 1}, "anthropic"),
    ],
)
def test_a_malformed_lineage_header_is_a_400_in_the_dialects_envelope_and_records_nothing(
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    path: str,
    body: dict[str, Any],
    envelope: str,
) -> None:
    answer = httpx.post(
        f"{gateway.url}/t/bad-lineage/v1/{path}",
        json={"model": MODEL, **body},
        headers={"X-Trajgate-Lineage": "planner", "X-Trajgate-Lineage-Kind": "helper"},
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    if envelope == "anthropic":
        assert answer.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert (error["type"], error["param"]) == (
            "invalid_request_error",
            "X-Trajgate-Lineage-Kind",
        )
    assert "main, subagent, side_call, compaction" in error["message"]
    assert steps_of(pool_settings, "bad-lineage") == []
