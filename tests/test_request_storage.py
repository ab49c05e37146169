"""Requests stored without repeating themselves: each step's messages as a delta on its parent's
messages + response, the upstream request as a merge patch, read back exactly."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text

from datapool import db
from datapool.db import make_engine
from datapool.models import Step
from datapool.settings import PoolSettings
from datapool.steps.canonical import response_of
from datapool.steps.messages import apply_merge_patch, expand_requests, merge_patch
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from gateway.dialects.chat_completions import ChatCompletions
from gateway.server import BackgroundServer

CHAT = ChatCompletions()


def make_store(pool_settings: PoolSettings) -> PoolStore:
    return PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)


def stored_rows(store: PoolStore, trajectory_id: str) -> list[dict[str, Any]]:
    """The step rows as stored (no reconstruction), in step then choice order."""
    with store.engine.connect() as connection:
        rows = connection.execute(
            select(
                Step.messages_base,
                Step.request,
                Step.upstream_request,
                Step.upstream_request_patch,
            )
            .where(Step.trajectory_id == trajectory_id)
            .order_by(Step.step_index, Step.choice_index)
        )
        return [dict(row._mapping) for row in rows]


# ---- JSON Merge Patch --------------------------------------------------------------------------

# RFC 7396 Appendix A, (target, patch, result); the RFC 7386 examples are the same.
RFC_7396_EXAMPLES: list[tuple[Any, Any, Any]] = [
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    (["a", "b"], ["c", "d"], ["c", "d"]),
    ({"a": "b"}, ["c"], ["c"]),
    ({"a": "foo"}, None, None),
    ({"a": "foo"}, "bar", "bar"),
    ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
    ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
]


@pytest.mark.parametrize(("target", "patch", "result"), RFC_7396_EXAMPLES)
def test_merge_patch_applies_as_rfc_7396_section_2_says(
    target: Any, patch: Any, result: Any
) -> None:
    before = json.dumps(target)
    assert apply_merge_patch(target, patch) == result
    assert json.dumps(target) == before  # the target is never changed in place


def test_merge_patch_holds_only_what_the_gateway_changed_and_refuses_what_it_cannot_say() -> None:
    messages = [{"role": "user", "content": "hi"}]
    client = {"model": "m", "messages": messages, "stream": True, "stream_options": {"a": 1}}
    upstream = {
        **client,
        "stream_options": {"a": 1, "include_usage": True},
        "return_token_ids": True,
        "logprobs": True,
    }
    patch = merge_patch(client, upstream)
    assert patch == {
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "logprobs": True,
    }
    assert json.dumps(apply_merge_patch(client, patch)) == json.dumps(upstream)
    assert merge_patch(client, {"model": "m"}) == {
        "messages": None,
        "stream": None,
        "stream_options": None,
    }
    # A key set to null would read back as removed; 1.0 is not 1; another key order is not the
    # same JSON text: a merge patch cannot say these, so the whole upstream request is kept.
    assert merge_patch({"a": 1}, {"a": None}) is None
    assert merge_patch({"a": 1}, {"a": 1.0}) == {"a": 1.0}
    assert merge_patch({"a": 1, "b": 2}, {"b": 2, "a": 1}) is None


# ---- the store ---------------------------------------------------------------------------------


def agent_call(
    prompt: list[int],
    response: list[int],
    messages: list[dict[str, Any]],
    answer: dict[str, Any] | None,
    *,
    n: int = 1,
    outcome: str = "ok",
) -> CallRecord:
    request = {"model": "tiny", "messages": messages, "temperature": 0.5}
    upstream = {**request, "return_token_ids": True, "logprobs": True}
    choices = [ChoiceRecord(i, response, [-0.25] * len(response), answer, "stop") for i in range(n)]
    return CallRecord(
        request=request,
        upstream_request=upstream,
        canonical=CHAT.canonical(upstream),
        history_field=CHAT.history_field,
        model="tiny",
        upstream="http://up",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt if outcome == "ok" else None,
        prompt_tokens=len(prompt),
        choices=choices if outcome == "ok" else [ChoiceRecord(0, None, None, None, None)],
        outcome=outcome,
    )


SYSTEM = {"role": "system", "content": "You are an agent. " * 50}  # 900 characters
TASK = {"role": "user", "content": "Find the file."}


def answer_of(turn: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"I call the tool, turn {turn}. " * 5}


def tool_of(turn: int) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call-{turn}", "content": f"result {turn} " * 60}


def record_agent(store: PoolStore, trajectory_id: str, turns: int) -> list[list[dict[str, Any]]]:
    """A ``turns``-call agent that resends its whole history each call; returns what it sent."""
    messages: list[dict[str, Any]] = [SYSTEM, TASK]
    prompt = list(range(100))
    sent = []
    for turn in range(turns):
        response = [1000 + turn, 2000 + turn]
        store.record_call(
            trajectory_id, agent_call(prompt, response, list(messages), answer_of(turn))
        )
        sent.append(list(messages))
        messages += [answer_of(turn), tool_of(turn)]  # as an SDK appends them: equal, new dicts
        prompt = [*prompt, *response, 3000 + turn]
    return sent


def test_a_twenty_turn_agent_stores_each_message_once_and_reads_every_request_back(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    sent = record_agent(store, "agent-20", 20)
    steps = make_store(pool_settings).steps_of("agent-20")
    assert [s.request["messages"] for s in steps] == sent
    assert [s.request for s in steps] == [
        {"model": "tiny", "messages": m, "temperature": 0.5} for m in sent
    ]
    assert [s.upstream_request for s in steps] == [
        {
            "model": "tiny",
            "messages": m,
            "temperature": 0.5,
            "return_token_ids": True,
            "logprobs": True,
        }
        for m in sent
    ]
    rows = stored_rows(store, "agent-20")
    # Step k sends 2 + 2k messages; its parent sent 2 + 2(k-1) = 2k and answered A_{k-1}, so
    # the first 2k + 1 are the parent's and only the newest tool result is stored.
    assert [r["messages_base"] for r in rows] == [0] + [2 * k + 1 for k in range(1, 20)]
    assert [r["request"]["messages"] for r in rows[1:]] == [[tool_of(k)] for k in range(19)]
    assert all(r["upstream_request"] is None for r in rows)
    assert all(
        r["upstream_request_patch"] == {"return_token_ids": True, "logprobs": True} for r in rows
    )
    # Storage grows with what is new. Stored: step 0's [S, U], then one tool result per step:
    # S + U + T_0 + ... + T_18 message bytes, plus per step "[" "]" (2 bytes) and ", " between
    # messages (2 bytes), under 100 bytes in all. The final request's messages are
    # S + U + (A_0 + T_0) + ... + (A_18 + T_18) + 2 + 2 * 39 bytes: the stored ones are a part of
    # them (no A_k), so stored <= 1.2 x final holds with room; storing every request whole would
    # be sum over k of (S + U + 2k messages), about 20/2 = 10x the final list.
    stored_bytes = sum(len(json.dumps(r["request"]["messages"])) for r in rows)
    final_bytes = len(json.dumps(sent[-1]))
    whole_bytes = sum(len(json.dumps(m)) for m in sent)
    assert stored_bytes <= 1.2 * final_bytes
    assert whole_bytes > 8 * final_bytes


def test_a_rewritten_history_stores_more_but_reads_back_exactly(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    sent = record_agent(store, "rewrites", 4)
    prompt = list(range(100))
    for turn in range(4):
        prompt = [*prompt, 1000 + turn, 2000 + turn, 3000 + turn]
    # Call 5 edits the task (message 1) and drops a field of the last answer, as an agent that
    # strips thinking does: the prefix with the parent stops at message 1.
    edited = [SYSTEM, {"role": "user", "content": "Find the file, quickly."}]
    for turn in range(4):
        answer = answer_of(turn) if turn < 3 else {"role": "assistant"}
        edited += [answer, tool_of(turn)]
    store.record_call("rewrites", agent_call([*prompt, 5], [6], edited, answer_of(4)))
    # Call 6 truncates the history to its first two messages, with an answer the model never gave.
    truncated = [SYSTEM, TASK, {"role": "assistant", "content": 1.0}]
    store.record_call("rewrites", agent_call([*prompt, 5, 6, 7], [8], truncated, None))
    steps = make_store(pool_settings).steps_of("rewrites")
    assert [s.request["messages"] for s in steps] == [*sent, edited, truncated]
    assert json.dumps(steps[-1].request["messages"][-1]) == '{"role": "assistant", "content": 1.0}'
    rows = stored_rows(store, "rewrites")
    assert rows[4]["messages_base"] == 1 and rows[4]["request"]["messages"] == edited[1:]
    # Call 6's parent is call 5 by tokens; it shares [SYSTEM] only (TASK was edited there).
    assert rows[5]["messages_base"] == 1


def test_n_choices_share_the_request_and_a_failed_call_in_between_reads_back(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    first = [SYSTEM, TASK]
    store.record_call("n2", agent_call(list(range(10)), [11, 12], first, answer_of(0), n=2))
    second = [*first, answer_of(0), tool_of(0)]
    failed = store.record_call("n2", agent_call([0], [], second, None, outcome="upstream_error"))
    third = [*second, answer_of(1), tool_of(1)]
    prompt = [*range(10), 11, 12, 13]
    store.record_call("n2", agent_call(prompt, [14], second, answer_of(1)))
    store.record_call("n2", agent_call([*prompt, 14, 15], [16], third, None))
    steps = make_store(pool_settings).steps_of("n2")
    assert [s.request["messages"] for s in steps] == [first, first, second, second, third]
    assert [s.outcome for s in steps][2] == "upstream_error" and steps[2].id == failed[0]
    rows = stored_rows(store, "n2")
    # The failed call's parent is choice 0 of call 1: [S, U, A_0] are shared, T_0 is new.
    # Call 4's parent is call 3, which saw [S, U, A_0, T_0] and answered A_1.
    assert [r["messages_base"] for r in rows] == [0, 0, 3, 3, 5]
    assert store.get_step(steps[4].id).request["messages"] == third  # type: ignore[union-attr]


def test_rows_written_before_migration_0007_still_read_and_downgrade_restores_them(
    empty_database_url: str, tmp_path: Any
) -> None:
    db.upgrade(empty_database_url)
    settings = PoolSettings(data_dir=tmp_path / "data", database_url=empty_database_url)
    sent = record_agent(make_store(settings), "legacy", 3)
    # Down to 0006 writes every row back whole: the old form, which 0006 code reads directly.
    db.downgrade(empty_database_url, "0006")
    engine = make_engine(empty_database_url)
    with engine.connect() as connection:
        old = connection.execute(
            text("SELECT request, upstream_request FROM steps ORDER BY step_index")
        ).all()
    engine.dispose()
    loads = (lambda v: v) if isinstance(old[0][0], dict) else json.loads
    assert [loads(r[0])["messages"] for r in old] == sent
    assert [loads(r[1])["return_token_ids"] for r in old] == [True, True, True]
    # Up again: those rows stay whole (messages_base NULL), read as they are, and the next call
    # stores its messages as a delta on a legacy parent.
    db.upgrade(empty_database_url)
    store = make_store(settings)
    assert [r["messages_base"] for r in stored_rows(store, "legacy")] == [None, None, None]
    legacy = store.steps_of("legacy")
    assert [s.request["messages"] for s in legacy] == sent
    # The rebuilt steps table kept its payloads (SQLite's DROP must not cascade to them).
    assert [len(s.prompt_token_ids or []) for s in legacy] == [100, 103, 106]
    prompt = [*range(100), 1000, 2000, 3000, 1001, 2001, 3001, 1002, 2002, 3002]
    fourth = [*sent[-1], answer_of(2), tool_of(2)]
    store.record_call("legacy", agent_call(prompt, [9], fourth, None))
    assert stored_rows(store, "legacy")[3]["messages_base"] == 7
    assert make_store(settings).steps_of("legacy")[3].request["messages"] == fourth
    store.engine.dispose()


def test_a_fresh_process_continues_the_delta_chain_after_reading_it_back(
    pool_settings: PoolSettings,
) -> None:
    """The lineage memory of a restarted writer rebuilds the message keys from stored deltas."""
    sent = record_agent(make_store(pool_settings), "restart", 3)
    prompt = [*range(100), 1000, 2000, 3000, 1001, 2001, 3001, 1002, 2002, 3002]
    fourth = [*sent[-1], answer_of(2), tool_of(2)]
    store = make_store(pool_settings)  # a new process: nothing in memory
    store.record_call("restart", agent_call(prompt, [9], fourth, None))
    assert stored_rows(store, "restart")[3]["messages_base"] == 7
    assert make_store(pool_settings).steps_of("restart")[3].request["messages"] == fourth


def test_a_row_changed_after_reading_is_not_written_back_expanded(
    pool_settings: PoolSettings,
) -> None:
    """Readers get the full request as a committed value: flushing a row keeps the delta."""
    store = make_store(pool_settings)
    record_agent(store, "flush", 2)
    with store.sessions.begin() as session:
        rows = list(session.scalars(select(Step).where(Step.trajectory_id == "flush")))
        expand_requests(session, rows)
        expand_requests(session, rows)  # idempotent
        assert len(rows[1].request["messages"]) == 4
        rows[1].flags = ["edited"]
    assert stored_rows(store, "flush")[1]["request"]["messages"] == [tool_of(0)]
    assert make_store(pool_settings).steps_of("flush")[1].request["messages"] == [
        SYSTEM,
        TASK,
        answer_of(0),
        tool_of(0),
    ]


# ---- through the real gateway and the real vLLM -------------------------------------------------


def _chat(gateway: BackgroundServer, trajectory_id: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/t/{trajectory_id}/v1/chat/completions", json=body, timeout=120
    )


def test_every_request_of_a_real_agent_reads_back_as_the_client_sent_it(
    gateway: BackgroundServer, pool_settings: PoolSettings
) -> None:
    """A multi-turn agent (with an n=2 call, a failed call, an edited history and a stream)
    through the gateway: every step's request and upstream request read back exactly."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Count to three."},
    ]
    sent: list[dict[str, Any]] = []  # one per step (an n=2 call is two steps)

    def call(body: dict[str, Any], steps: int = 1) -> dict[str, Any]:
        response = _chat(gateway, "real-agent", body)
        sent.extend([json.loads(json.dumps(body))] * steps)
        return response.json() if not body.get("stream") else {}

    for turn in range(6):
        body: dict[str, Any] = {
            "model": "tiny",
            "messages": list(messages),
            "max_tokens": 6,
            "temperature": 0,
            "seed": turn,
        }
        if turn == 2:
            body["n"] = 2
            body["temperature"] = 1.0
        if turn == 3:  # fails upstream (prompt + max_tokens > 131072) and is recorded
            call({**body, "max_tokens": 200_000})
        if turn == 4:  # the agent edits an earlier message
            body["messages"][1] = {"role": "user", "content": "Count to four."}
            messages[1] = body["messages"][1]
        if turn == 5:
            body["stream"] = True
            call(body)
            break
        answer = call(body, steps=body.get("n", 1))
        message = answer["choices"][0]["message"]
        messages += [message, {"role": "user", "content": f"Go on ({turn})."}]

    store = make_store(pool_settings)
    steps = store.steps_of("real-agent")
    assert len(steps) == len(sent) == 8  # 2 + 2 choices + 1 + failed + edited + streamed
    assert [s.request for s in steps] == sent
    for step, body in zip(steps, sent, strict=True):
        expected_upstream = {**body, "return_token_ids": True, "logprobs": True}
        if body.get("stream"):
            expected_upstream["stream_options"] = {"include_usage": True}
        assert step.upstream_request == expected_upstream
        assert store.get_step(step.id).request == body  # type: ignore[union-attr]
    assert [s.outcome for s in steps].count("upstream_error") == 1
    rows = stored_rows(store, "real-agent")
    assert rows[1]["messages_base"] >= 2  # the second call stored only what was new
    response = httpx.get(f"{gateway.url}/api/steps/{steps[-1].id}", timeout=30)
    assert response.json()["request"] == sent[-1]
    assert response.json()["upstream_request"] == steps[-1].upstream_request
    detail = httpx.get(f"{gateway.url}/api/inspector/trajectories/real-agent", timeout=30)
    assert detail.status_code == 200, detail.text
    # The inspector ships what each step added; along the parent chain it is the full
    # conversation (the edited history included), which it also serves whole on demand.
    shown = detail.json()["steps"]
    by_id = {s["id"]: s for s in shown}
    rebuilt: dict[str, list[Any]] = {}
    for step, body in zip(shown, sent, strict=True):
        parent = by_id.get(step["parent_step_id"])
        head = []
        if parent is not None:
            head = [*rebuilt[parent["id"]], response_of(parent["response_message"]).to_json()]
        rebuilt[step["id"]] = head[: step["messages_base"]] + step["messages_added"]
        history = httpx.get(f"{gateway.url}/api/inspector/steps/{step['id']}/history", timeout=30)
        assert history.json()["request"] == body
        assert rebuilt[step["id"]] == history.json()["canonical"]["messages"]
