"""Step bodies stored linear in turns in every dialect: a long coding-agent session with a large
tool list costs the same bytes per step at turn 200 as at turn 20, and every body reads back as
the same JSON that was sent (``datapool.steps.bodies``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Connection, text

from datapool import db
from datapool.db import make_engine
from datapool.queries.edits import apply_edits
from datapool.queries.export import export_trajectories
from datapool.rewards.functions import tool_call_format
from datapool.rewards.values import RewardContext
from datapool.settings import PoolSettings
from datapool.steps.bodies import BLOB_MIN_BYTES, RequestMissingError
from datapool.steps.canonical import response_of
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from gateway.app import create_app
from gateway.dialects import Dialect
from gateway.dialects.chat_completions import ChatCompletions
from gateway.dialects.completions.serving import Completions
from gateway.dialects.messages import Messages
from gateway.dialects.responses import Responses
from gateway.settings import GatewaySettings

SYSTEM = "You are a coding agent. Work in the repository, run the tests, keep changes small. " * 8
TASK = "Fix the failing test in tests/test_parser.py."
# 11 tools of ~2.5 KB each, about 28 KB of JSON: the size of Claude Code's tool list.
TOOL_NAMES = ["Bash", "Read", "Write", "Edit", "Glob", "Grep", "LS", "Task", "Todo", "Web", "Ask"]
DESCRIPTION = "Runs the tool on the workspace and returns its output as text. " * 36


def schema(name: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": f"{name}: the file or directory"},
            "command": {"type": "string", "description": "the command line, quoted"},
        },
        "required": ["path"],
    }


def arguments(turn: int) -> str:
    return json.dumps({"path": f"src/module_{turn:03d}.py"})


def result(turn: int) -> str:
    """A ~450-character tool result, different every turn."""
    return (f"turn {turn:03d}: " + "line of output from the tool, " * 15)[:450]


def chat_body(turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK},
    ]
    for turn in range(turns):
        messages += [
            chat_answer(turn),
            {"role": "tool", "tool_call_id": f"c{turn}", "content": result(turn)},
        ]
    tools = [
        {
            "type": "function",
            "function": {"name": n, "description": DESCRIPTION, "parameters": schema(n)},
        }
        for n in TOOL_NAMES
    ]
    return {"model": "tiny", "max_tokens": 40, "messages": messages, "tools": tools}


def chat_answer(turn: int) -> dict[str, Any]:
    """The assistant message of ``turn`` (a tool call), as chat's answer carries it."""
    call = {
        "id": f"c{turn}",
        "type": "function",
        "function": {"name": "Read", "arguments": arguments(turn)},
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def responses_body(turns: int) -> dict[str, Any]:
    items: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for turn in range(turns):
        items += [
            {
                "type": "function_call",
                "call_id": f"c{turn}",
                "name": "Read",
                "arguments": arguments(turn),
            },
            {"type": "function_call_output", "call_id": f"c{turn}", "output": result(turn)},
        ]
    tools = [
        {"type": "function", "name": n, "description": DESCRIPTION, "parameters": schema(n)}
        for n in TOOL_NAMES
    ]
    return {
        "model": "tiny",
        "max_output_tokens": 40,
        "instructions": SYSTEM,
        "input": items,
        "tools": tools,
    }


def messages_body(turns: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    for turn in range(turns):
        use = {
            "type": "tool_use",
            "id": f"toolu_{turn}",
            "name": "Read",
            "input": json.loads(arguments(turn)),
        }
        messages += [
            {"role": "assistant", "content": [use]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": result(turn)}
                ],
            },
        ]
    tools = [{"name": n, "description": DESCRIPTION, "input_schema": schema(n)} for n in TOOL_NAMES]
    return {
        "model": "tiny",
        "max_tokens": 40,
        "system": SYSTEM,
        "messages": messages,
        "tools": tools,
    }


def completions_body(turns: int) -> dict[str, Any]:
    """A completions agent re-sends its whole transcript as one growing prompt string."""
    prompt = SYSTEM + "\n" + TASK + "\n"
    for turn in range(turns):
        prompt += f"Action: Read {arguments(turn)}\nObservation: {result(turn)}\n"
    return {"model": "tiny", "max_tokens": 40, "prompt": prompt}


SESSIONS: list[tuple[Dialect, Callable[[int], dict[str, Any]]]] = [
    (ChatCompletions(), chat_body),
    (Responses(), responses_body),
    (Messages(), messages_body),
    (Completions(), completions_body),
]
PROMPT_TOKENS_PER_TURN = 120  # a tool call echoed and its result (60 tokens per message)
RESPONSE_TOKENS = 40


# Claude Code's attribution line when it believes it talks to Anthropic: first line of its system
# block 0, a ``cch`` that changes on every request (vLLM strips the line before rendering).
BILLING = "x-anthropic-billing-header: cc_version=2.0.76.4f2; cc_entrypoint=sdk-cli; cch={:05x};"
CLAUDE = "You are Claude Code, Anthropic's official CLI for Claude."


def billing(turn: int) -> str:
    return BILLING.format((turn * 40503 + 7) % 0xFFFFF)  # a new value on every turn


def messages_cch_body(turn: int) -> dict[str, Any]:
    """Claude Code's Messages body: system ``[billing line, identity, prompt]``."""
    body = messages_body(turn)
    body["system"] = [
        {"type": "text", "text": billing(turn)},
        {"type": "text", "text": CLAUDE},
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
    ]
    return body


def chat_cch_body(turn: int) -> dict[str, Any]:
    """The same system parts as chat's message 0: the history's first message changes."""
    body = chat_body(turn)
    parts = [billing(turn), CLAUDE, SYSTEM]
    content = [{"type": "text", "text": text} for text in parts]
    body["messages"][0] = {"role": "system", "content": content}
    return body


def responses_cch_body(turn: int) -> dict[str, Any]:
    """The same as the Responses ``input``'s first item (no ``instructions``)."""
    body = responses_body(turn)
    del body["instructions"]
    parts = [billing(turn), CLAUDE, SYSTEM]
    system = {"role": "system", "content": [{"type": "input_text", "text": t} for t in parts]}
    body["input"].insert(0, system)
    return body


CCH_SESSIONS: list[tuple[Dialect, Callable[[int], dict[str, Any]]]] = [
    (ChatCompletions(), chat_cch_body),
    (Responses(), responses_cch_body),
    (Messages(), messages_cch_body),
]


def turn_call(dialect: Dialect, body: dict[str, Any], turn: int) -> CallRecord:
    """Call ``turn`` as the gateway records it: the dialect's one translation and its record;
    its prompt extends the previous call's prompt and response (token lineage: the parent)."""
    prepared = dialect.prepare(body)
    prompt = list(range(200 + turn * (PROMPT_TOKENS_PER_TURN + RESPONSE_TOKENS)))
    response = list(range(len(prompt), len(prompt) + RESPONSE_TOKENS))
    if dialect.name == "completions":
        answer: dict[str, Any] = {"text": f"Action: Read {arguments(turn)}\n"}
    else:
        answer = chat_answer(turn)
    return CallRecord(
        request=body,
        upstream_request=prepared.upstream_body,
        model="tiny",
        upstream="http://up",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        choices=[ChoiceRecord(0, response, [-0.5] * RESPONSE_TOKENS, answer, "tool_calls")],
        endpoint=dialect.name,
        canonical=dialect.canonical(prepared.upstream_body),
        history_field=dialect.history_field,
        sampling={"temperature": 1.0, "max_tokens": 40},
    )


def run_session(
    store: PoolStore,
    dialect: Dialect,
    body: Callable[[int], dict[str, Any]],
    turns: int,
    trajectory_id: str,
) -> list[CallRecord]:
    calls = [turn_call(dialect, body(turn), turn) for turn in range(turns)]
    for call in calls:
        store.record_call(trajectory_id, call)
    return calls


def _value_bytes(value: Any) -> int:
    """What a column value stores: text and binary their length, JSON its text (SQLite hands
    back text, psycopg the decoded value), a number or timestamp 8."""
    if value is None:
        return 0
    if isinstance(value, str | bytes | memoryview):
        return len(value)
    if isinstance(value, dict | list):
        return len(json.dumps(value))
    return 8


def _rows_bytes(connection: Connection, sql: str, **params: Any) -> list[int]:
    return [sum(_value_bytes(v) for v in row) for row in connection.execute(text(sql), params)]


def step_bytes(store: PoolStore, trajectory_id: str) -> list[int]:
    """Per step (step order): the bytes of its ``steps`` row and its ``step_payloads`` row."""
    with store.engine.connect() as connection:
        steps = _rows_bytes(
            connection,
            "SELECT * FROM steps WHERE trajectory_id = :t ORDER BY step_index",
            t=trajectory_id,
        )
        payloads = _rows_bytes(
            connection,
            "SELECT p.* FROM step_payloads p JOIN steps s ON s.id = p.step_id "
            "WHERE s.trajectory_id = :t ORDER BY s.step_index",
            t=trajectory_id,
        )
    return [a + b for a, b in zip(steps, payloads, strict=True)]


def pool_bytes(store: PoolStore) -> int:
    """Everything the pool keeps for its steps: trajectories, steps, payloads, blobs."""
    with store.engine.connect() as connection:
        return sum(
            sum(_rows_bytes(connection, f"SELECT * FROM {table}"))
            for table in ("trajectories", "steps", "step_payloads", "json_blobs")
        )


def same_json(a: Any, b: Any) -> bool:
    """The same JSON text: key order and ``1`` against ``1.0`` count."""
    return json.dumps(a) == json.dumps(b)


def assert_read_back_as_sent(store: PoolStore, trajectory_id: str, calls: list[CallRecord]) -> None:
    steps = store.steps_of(trajectory_id)
    assert len(steps) == len(calls)
    for step, call in zip(steps, calls, strict=True):
        assert same_json(step.request, call.request)
        assert same_json(step.upstream_request, call.upstream_request)
        assert call.canonical is not None and same_json(step.canonical, call.canonical.to_json())
    last = store.get_step(steps[-1].id)
    assert last is not None and same_json(last.upstream_request, calls[-1].upstream_request)


@pytest.mark.parametrize(("dialect", "body"), SESSIONS, ids=lambda d: getattr(d, "name", ""))
def test_a_200_turn_session_stores_the_same_bytes_per_step_at_turn_200_as_at_turn_20(
    pool_settings: PoolSettings, dialect: Dialect, body: Callable[[int], dict[str, Any]]
) -> None:
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    assert len(json.dumps(body(0).get("tools", []))) > 25_000 or dialect.name == "completions"
    calls = run_session(store, dialect, body, 200, "long")
    per_step = step_bytes(store, "long")
    # Each turn appends the same ~1 KB (an echoed tool call, its 450-character result) and
    # samples 40 tokens: what turn 200 stores is what turn 20 stores, give or take digits.
    assert per_step[199] / per_step[19] <= 1.1, (per_step[19], per_step[199])
    # 200 steps of ~3 KB of bodies + ~1.4 KB of tokens, and the tool list once per body form.
    total = pool_bytes(store)
    assert total <= 1_500_000, total
    assert_read_back_as_sent(store, "long", calls)
    store.engine.dispose()


@pytest.mark.parametrize(("dialect", "body"), SESSIONS, ids=lambda d: getattr(d, "name", ""))
def test_a_tool_list_and_system_prompt_are_stored_once_for_a_group(
    sqlite_pool: PoolSettings, dialect: Dialect, body: Callable[[int], dict[str, Any]]
) -> None:
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    run_session(store, dialect, body, 3, "rollout-a")
    with store.engine.connect() as connection:
        blobs = connection.execute(text("SELECT count(*) FROM json_blobs")).scalar_one()
    run_session(store, dialect, body, 3, "rollout-b")  # the same task, another rollout
    with store.engine.connect() as connection:
        again = connection.execute(text("SELECT count(*) FROM json_blobs")).scalar_one()
        big = connection.execute(
            text("SELECT count(*) FROM steps WHERE length(request) >= :n"),
            {"n": BLOB_MIN_BYTES * 8},
        ).scalar_one()
    assert again == blobs  # the second rollout's tool list and first prompt are the first's rows
    assert big <= 2  # only each rollout's first call holds its first messages inline
    store.engine.dispose()


@pytest.mark.parametrize(("dialect", "body"), SESSIONS, ids=lambda d: getattr(d, "name", ""))
def test_a_fresh_process_continues_the_body_deltas_and_reads_them_back(
    sqlite_pool: PoolSettings, dialect: Dialect, body: Callable[[int], dict[str, Any]]
) -> None:
    """A writer whose memory was rebuilt from the pool (another process, a restart) stores the
    next call as a delta too, with no new blob."""
    url = sqlite_pool.resolved_database_url()
    calls = run_session(PoolStore(make_engine(url), sqlite_pool), dialect, body, 20, "t")
    store = PoolStore(make_engine(url), sqlite_pool)
    before = step_bytes(store, "t")
    calls.append(turn_call(dialect, body(20), 20))
    store.record_call("t", calls[-1])
    after = step_bytes(store, "t")
    assert after[20] / after[19] <= 1.1, (before[19], after[20])
    assert_read_back_as_sent(PoolStore(make_engine(url), sqlite_pool), "t", calls)


def test_migration_0015_rewrites_stored_bodies_and_downgrade_writes_them_back_whole(
    empty_database_url: str, tmp_path: Path
) -> None:
    """Steps of all four dialects as 0014 stored them (every body whole but the history
    lists) shrink on upgrade and read back the same; downgrade gives the 0014 form back."""
    url = empty_database_url
    db.upgrade(url)
    settings = PoolSettings(data_dir=tmp_path / "d", database_url=url)
    store = PoolStore(make_engine(url), settings)
    sent = {
        dialect.name: run_session(store, dialect, body, 6, dialect.name)
        for dialect, body in SESSIONS
    }
    compact = pool_bytes(store)
    store.engine.dispose()
    db.downgrade(url, "0014")
    engine = make_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(
            text(
                "SELECT trajectory_id, step_index, history_field, request, upstream_request, "
                "canonical FROM steps"
            )
        ).all()
        whole = sum(
            sum(_rows_bytes(connection, f"SELECT * FROM {t}"))
            for t in ("trajectories", "steps", "step_payloads")
        )
    engine.dispose()
    assert len(rows) == 4 * 6
    for trajectory_id, step_index, field, request, upstream, canonical in rows:
        call = sent[trajectory_id][step_index]
        assert call.canonical is not None
        # 0014's form: every field whole (the tool list inline in each body) but the history
        # lists, which 0007 and 0013 store as deltas; a translated upstream body whole.
        stored, record = _json(request), _json(canonical)
        assert list(stored) == list(call.request)
        for name, value in call.request.items():
            assert name == field or same_json(stored[name], value), name
        for name, value in call.canonical.to_json().items():
            assert name == "messages" or same_json(record[name], value), name
        if upstream is not None:
            assert same_json(_json(upstream), call.upstream_request)
    assert whole > 2 * compact
    db.upgrade(url)
    store = PoolStore(make_engine(url), settings)
    assert pool_bytes(store) < whole / 2
    for trajectory_id, calls in sent.items():
        assert_read_back_as_sent(store, trajectory_id, calls)
    store.engine.dispose()


def test_a_pool_with_list_deltas_refuses_to_downgrade_below_0016_and_stays_as_it_was(
    empty_database_url: str, tmp_path: Path
) -> None:
    """A replaced leading item (a ``cch`` billing line) is stored as a list delta that 0015's
    readers cannot read: the downgrade says so and changes nothing."""
    url = empty_database_url
    db.upgrade(url)
    settings = PoolSettings(data_dir=tmp_path / "d", database_url=url)
    store = PoolStore(make_engine(url), settings)
    dialect, body = CCH_SESSIONS[0]
    calls = run_session(store, dialect, body, 3, "cch")
    store.engine.dispose()
    with pytest.raises(RuntimeError, match="list delta with replaced leading items"):
        db.downgrade(url, "0015")
    store = PoolStore(make_engine(url), settings)
    assert_read_back_as_sent(store, "cch", calls)
    store.engine.dispose()


def _json(value: Any) -> Any:
    """A JSON column as read by raw SQL: text on SQLite, decoded by psycopg on PostgreSQL."""
    return json.loads(value) if isinstance(value, str) else value


@pytest.mark.parametrize(("dialect", "body"), SESSIONS[:3], ids=lambda d: getattr(d, "name", ""))
def test_exports_and_rewards_of_a_long_session_read_the_whole_bodies(
    sqlite_pool: PoolSettings,
    dialect: Dialect,
    body: Callable[[int], dict[str, Any]],
    tmp_path: Path,
) -> None:
    """The tool list a reward function checks a call against, and the messages an export
    writes, are the ones sent, though the pool holds them as a blob and as deltas."""
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    calls = run_session(store, dialect, body, 40, "t")
    # The final step's one tool call names an offered tool with its required key: 1/1.
    assert tool_call_format(RewardContext("t", None, None, {}, store.steps_of("t"))) == 1.0
    out = tmp_path / "steps.jsonl"
    assert export_trajectories(store, ["t"], out, "jsonl") == 40
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, call in zip(rows, calls, strict=True):
        assert call.canonical is not None
        assert row["messages_json"] == json.dumps(call.canonical.to_json()["messages"])


def test_a_rewritten_message_stores_the_upstream_messages_from_it_on_and_reads_back(
    sqlite_pool: PoolSettings,
) -> None:
    """A Messages client that rewrites an old tool result (an agent compacting its context):
    the translated upstream messages are stored from the first one that differs, not whole."""
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    dialect = Messages()
    calls = run_session(store, dialect, messages_body, 10, "t")
    rewritten = messages_body(10)
    # messages: [task, (assistant, result) x 10]; result 3 is at 2 + 2*3 = 8.
    rewritten["messages"][8]["content"][0]["content"] = "(cut)"
    calls.append(turn_call(dialect, rewritten, 10))
    store.record_call("t", calls[-1])
    with store.engine.connect() as connection:
        deltas = connection.execute(
            text("SELECT body_deltas FROM steps WHERE step_index = 10")
        ).scalar_one()
    upstream = calls[-1].upstream_request["messages"]
    # The upstream list starts with the system prompt, so Messages' item 8 is its item 9.
    assert upstream[9]["content"] == "(cut)"
    assert json.loads(deltas)["upstream"]["messages"] == 9
    assert_read_back_as_sent(store, "t", calls)


def test_the_step_api_answers_the_request_as_sent(sqlite_pool: PoolSettings) -> None:
    """``GET /api/steps/{id}`` of a late Messages step: its system prompt and tool list (blobs)
    and its history (deltas) come back as the client sent them, key order included."""
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    calls = run_session(store, Messages(), messages_body, 12, "t")
    last = store.steps_of("t")[-1].id
    with TestClient(create_app(GatewaySettings(), sqlite_pool), base_url="http://127.0.0.1") as api:
        answer = api.get(f"/api/steps/{last}")
    assert answer.status_code == 200
    assert json.dumps(answer.json()["request"]) == json.dumps(calls[-1].request)
    # The body vLLM got (a delta on the parent's, its tool list a blob) comes back whole too.
    assert json.dumps(answer.json()["upstream_request"]) == json.dumps(calls[-1].upstream_request)


@pytest.mark.parametrize(
    ("dialect", "body"),
    [*SESSIONS, *CCH_SESSIONS],
    ids=[*(d.name for d, _ in SESSIONS), *(f"{d.name}-cch" for d, _ in CCH_SESSIONS)],
)
def test_the_writer_dumps_as_many_json_values_at_turn_60_as_at_turn_20(
    sqlite_pool: PoolSettings,
    dialect: Dialect,
    body: Callable[[int], dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Finding what a call shares with its parent takes one ``json.dumps`` per list (of the
    parent's length), then one per new item: the count does not grow with the history (it
    was one per message of every list, 1,244 at turn 200 of a Messages session). A session
    whose first system line changes every call (``*-cch``) too: the run after the replaced
    message is found once and its keys shared with the parent's."""
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    counts: list[int] = []
    real_dumps = json.dumps

    def counting(*args: Any, **kwargs: Any) -> str:
        counts[-1] += 1
        return real_dumps(*args, **kwargs)

    for turn in range(61):
        call = turn_call(dialect, body(turn), turn)
        counts.append(0)
        monkeypatch.setattr(json, "dumps", counting)
        store.record_call("t", call)
        monkeypatch.setattr(json, "dumps", real_dumps)
    assert counts[60] == counts[20], (counts[20], counts[60])
    store.engine.dispose()


def bytes_per_step(
    store: PoolStore, dialect: Dialect, body: Callable[[int], dict[str, Any]], turns: int, t: str
) -> tuple[list[int], list[CallRecord]]:
    """Record ``turns`` calls; per call what the whole pool grew by (its step and payload rows
    and the ``json_blobs`` rows it added)."""
    grown: list[int] = []
    calls: list[CallRecord] = []
    before = pool_bytes(store)
    for turn in range(turns):
        calls.append(turn_call(dialect, body(turn), turn))
        store.record_call(t, calls[-1])
        after = pool_bytes(store)
        grown.append(after - before)
        before = after
    return grown, calls


@pytest.mark.parametrize(("dialect", "body"), CCH_SESSIONS, ids=lambda d: getattr(d, "name", ""))
def test_a_session_whose_first_system_line_changes_every_call_stores_what_changed(
    pool_settings: PoolSettings, dialect: Dialect, body: Callable[[int], dict[str, Any]]
) -> None:
    """A new ``cch`` in the system prompt's first part on every call: the system message is
    stored as that part plus the parent's other parts, the history as the parent's plus what
    was appended, so a step at turn 32 stores what one at turn 4 does, and about what a step
    of the same session with a fixed ``cch`` stores. Before, no body shared a prefix with its
    parent's (message 0 differs), so every step stored its whole history again (measured on
    SQLite, turn 4 against turn 32: chat 7.7 KB -> 45.6 KB, Responses 11.0 -> 66.4 KB, Messages
    9.8 -> 47.6 KB; now 3.1, 4.2 and 4.4 KB at both)."""
    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    grown, calls = bytes_per_step(store, dialect, body, 32, "cch")

    def fixed_cch(turn: int) -> dict[str, Any]:
        return json.loads(json.dumps(body(turn)).replace(billing(turn), billing(0)))

    fixed, _ = bytes_per_step(store, dialect, fixed_cch, 32, "fixed")
    assert grown[31] / grown[3] <= 1.1, grown
    # What changed is one ~95-character text part, in the client's body, the upstream one and
    # the canonical record (each its JSON and its place in a spec, ~200 bytes): measured 0.4
    # to 0.6 KB over the fixed-cch step, against ~20 KB of history stored again before.
    assert grown[31] - fixed[31] <= 1000, (grown[31], fixed[31])
    assert_read_back_as_sent(store, "cch", calls)
    store.engine.dispose()


def test_a_replaced_system_message_reads_back_with_its_own_key_order_and_number_types(
    sqlite_pool: PoolSettings,
) -> None:
    """The replaced message is stored as a delta on the parent's, key by key: its keys come
    back in its own order, and a part that is equal to the parent's as a Python value but not
    as JSON (``1`` against ``1.0``) is its own, not the parent's."""
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)

    def body(turn: int) -> dict[str, Any]:
        sent = chat_cch_body(turn)
        system = sent["messages"][0]
        system["content"][1]["cache"] = 1.0 if turn % 3 else 1  # == 1.0, not the same JSON
        if turn % 2:
            sent["messages"][0] = {"content": system["content"], "role": "system"}
        return sent

    calls = run_session(store, ChatCompletions(), body, 8, "t")
    assert_read_back_as_sent(store, "t", calls)
    fresh = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    calls.append(turn_call(ChatCompletions(), body(8), 8))
    fresh.record_call("t", calls[-1])  # a writer whose memory was rebuilt from the pool
    assert_read_back_as_sent(fresh, "t", calls)
    store.engine.dispose()
    fresh.engine.dispose()


def test_the_trajectory_view_of_a_changing_cch_session_ships_what_each_step_added(
    sqlite_pool: PoolSettings,
) -> None:
    """The inspector's trajectory view of a Messages session with a new ``cch`` on every call:
    no message is a common prefix of a step and its parent (the system message differs), so
    the view names the replaced system message (``messages_replaced``), ships it as an edit of
    the first step's text (``head_edits`` against ``head_texts``) and then what the step
    appended, not the whole history; bytes per step stay flat and the history rebuilds
    exactly. Before, every step shipped its whole history (``messages_base`` 0), then its
    whole system message."""
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    calls = run_session(store, Messages(), messages_cch_body, 32, "long")
    run_session(store, Messages(), messages_cch_body, 8, "short")
    with TestClient(create_app(GatewaySettings(), sqlite_pool), base_url="http://127.0.0.1") as api:
        long, short = (api.get(f"/api/inspector/trajectories/{t}") for t in ("long", "short"))
    assert long.status_code == short.status_code == 200
    assert len(long.content) / 32 <= 1.1 * len(short.content) / 8, (
        len(long.content),
        len(short.content),
    )
    view = long.json()
    # One text: the first step's system message, which every later one is an edit of.
    assert list(view["head_texts"]) == ["h0"]
    steps = view["steps"]
    full: dict[str, list[Any]] = {}
    for k, (step, call) in enumerate(zip(steps, calls, strict=True)):
        parent = next((p for p in steps if p["id"] == step["parent_step_id"]), None)
        head = []
        if parent is not None:
            head = [*full[parent["id"]], response_of(parent["response_message"]).to_json()]
        replaced, base, added = (
            step[key] for key in ("messages_replaced", "messages_base", "messages_added")
        )
        texts = [apply_edits(view["head_texts"][h["text"]], h["edits"]) for h in step["head_edits"]]
        full[step["id"]] = [*map(json.loads, texts), *head[replaced:base], *added]
        assert call.canonical is not None
        assert same_json(full[step["id"]], call.canonical.to_json()["messages"]), f"turn {k}"
        if k:
            # Turn k sends [system, task, (assistant, result) x k]: 2 + 2k messages. Its parent's
            # history and answer are 2 + 2(k - 1) + 1; the answer (tool call ``c{k-1}``) is not
            # the echo the client sends (``toolu_{k-1}``), so the step covers the parent's first
            # 2k, replaces its system message, and appends the echo and the result: 2 messages.
            assert (replaced, base, len(added)) == (1, 2 * k, 2), f"turn {k}"
            # The system message as one edit: the 5 hex digits of its cch (fewer where a digit
            # happens to equal the first step's).
            (edit,) = step["head_edits"][0]["edits"]
            assert len(edit[2]) <= 5 and edit[1] - edit[0] <= 5, f"turn {k}"
    store.engine.dispose()


def test_a_missing_blob_is_an_error_not_a_null_tool_list(sqlite_pool: PoolSettings) -> None:
    """A body whose blob row is gone reads as an error naming the step and the blob, never as
    the null placeholder its stored row holds."""
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    run_session(store, ChatCompletions(), chat_body, 2, "t")
    with store.engine.begin() as connection:
        connection.execute(text("DELETE FROM json_blobs"))
    with store.engine.connect() as connection:
        step_id = connection.execute(text("SELECT id FROM steps WHERE step_index = 1")).scalar_one()
    with pytest.raises(RequestMissingError, match=f"step {step_id} stores its 'tools' as blob"):
        store.get_step(step_id)


STORED_COLUMNS = (
    "request, messages_base, upstream_request, upstream_request_patch, canonical, "
    "canonical_base, body_deltas"
)


def stored_bodies(store: PoolStore, trajectory_id: str) -> list[tuple[Any, ...]]:
    with store.engine.connect() as connection:
        query = f"SELECT {STORED_COLUMNS} FROM steps WHERE trajectory_id = :t ORDER BY step_index"
        return [tuple(row) for row in connection.execute(text(query), {"t": trajectory_id})]


@pytest.mark.parametrize(
    ("dialect", "body"),
    [*SESSIONS, *CCH_SESSIONS],
    ids=[*(d.name for d, _ in SESSIONS), *(f"{d.name}-cch" for d, _ in CCH_SESSIONS)],
)
def test_the_writer_stores_the_same_rows_when_it_proves_the_shared_prefix_from_text(
    sqlite_pool: PoolSettings,
    dialect: Dialect,
    body: Callable[[int], dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each list compared through its parent's ``ListText`` (``bodies.proved_prefix``) is
    stored as when every list was compared by ``json.dumps`` of the parent's length
    (``shared_prefix`` alone): the same step rows, column for column. And no list of the
    history's length is dumped by ``json`` once the parent's text is known (turn 1 on); a
    session whose first system line changes on every call still finds the run after it by
    ``json`` (``head_replaced``)."""
    from datapool.steps import bodies, messages

    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    long_dumps: list[int] = []
    real_dumps = json.dumps

    def counting(value: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(value, list) and len(value) > 12:  # 14 messages at turn 6
            long_dumps.append(len(value))
        return real_dumps(value, *args, **kwargs)

    turns = 12
    for turn in range(turns):
        call = turn_call(dialect, body(turn), turn)
        if turn == turns - 1:
            monkeypatch.setattr(json, "dumps", counting)
        store.record_call("proved", call)
        monkeypatch.setattr(json, "dumps", real_dumps)

    def keys_alone(values: Any, text: Any, theirs: Any, proof: Any) -> int:
        return bodies.shared_prefix(values, theirs)

    monkeypatch.setattr(bodies, "proved_prefix", keys_alone)
    monkeypatch.setattr(messages, "proved_prefix", keys_alone)
    for turn in range(turns):
        store.record_call("compared", turn_call(dialect, body(turn), turn))
    assert stored_bodies(store, "proved") == stored_bodies(store, "compared")
    if (dialect, body) in CCH_SESSIONS:
        assert long_dumps
    else:
        assert long_dumps == []
    store.engine.dispose()
