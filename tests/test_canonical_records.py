"""One canonical call record from every dialect: the same conversation sent as chat,
Responses or Messages gives the same record, the same built-in reward and the same break kind
for the same history change; a side call is a new root of the trajectory's tree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update

from datapool import db
from datapool.db import make_engine
from datapool.models import Step
from datapool.rewards.functions import tool_call_format
from datapool.rewards.values import RewardContext
from datapool.settings import PoolSettings
from datapool.steps.canonical import Message, ToolCall
from datapool.steps.prefix import classify_divergence
from datapool.steps.records import CallRecord, ChoiceRecord
from datapool.steps.store import PoolStore
from gateway.dialects import Dialect
from gateway.dialects.chat_completions import ChatCompletions
from gateway.dialects.messages import Messages
from gateway.dialects.responses import Responses

SYSTEM = "You answer with the weather tool."
TASK = "Weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGUMENTS = json.dumps({"city": "Paris"})  # '{"city": "Paris"}', as Messages serialises input
GENERATED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": ARGUMENTS}}
    ],
}


def chat_body(system: str, arguments: str, result: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": TASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": result},
        ],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}],
    }


def responses_body(system: str, arguments: str, result: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_output_tokens": 8,
        "instructions": system,
        "input": [
            {"role": "user", "content": TASK},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": result},
        ],
        "tools": [{"type": "function", "name": "weather", "parameters": SCHEMA}],
    }


def messages_body(system: str, arguments: str, result: str) -> dict[str, Any]:
    return {
        "model": "tiny",
        "max_tokens": 8,
        "system": system,
        "messages": [
            {"role": "user", "content": TASK},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_c1",
                        "name": "weather",
                        "input": json.loads(arguments),
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_c1", "content": result}],
            },
        ],
        "tools": [{"name": "weather", "input_schema": SCHEMA}],
    }


DIALECTS: list[tuple[Dialect, Any]] = [
    (ChatCompletions(), chat_body),
    (Responses(), responses_body),
    (Messages(), messages_body),
]


def record(dialect: Dialect, body: dict[str, Any], prompt: list[int]) -> CallRecord:
    """The call as the gateway records it: the dialect's one translation and its record."""
    prepared = dialect.prepare(body)
    return CallRecord(
        request=body,
        upstream_request=prepared.upstream_body,
        model="tiny",
        upstream="http://up",
        policy_version=0,
        latency_ms=1.0,
        prompt_token_ids=prompt,
        prompt_tokens=len(prompt),
        choices=[ChoiceRecord(0, [7, 8], [-0.5, -0.5], GENERATED, "tool_calls")],
        endpoint=dialect.name,
        canonical=dialect.canonical(prepared.upstream_body),
        history_field=dialect.history_field,
    )


@pytest.fixture
def store(tmp_path: Path) -> PoolStore:
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    db.upgrade(url)
    return PoolStore(make_engine(url), PoolSettings(data_dir=tmp_path / "d", database_url=url))


def test_the_same_conversation_in_three_dialects_gives_one_canonical_record() -> None:
    records = [
        dialect.canonical(dialect.prepare(body(SYSTEM, ARGUMENTS, "sunny")).upstream_body)
        for dialect, body in DIALECTS
    ]
    assert records[0] == records[1] == records[2]
    assert records[0].messages is not None and len(records[0].messages) == 4
    assert records[0].messages[2].tool_calls[0].arguments == ARGUMENTS
    assert records[0].tool_named("weather") is not None


@pytest.mark.parametrize(("dialect", "body"), DIALECTS, ids=lambda d: getattr(d, "name", ""))
def test_tool_call_format_finds_the_generated_call_in_every_dialect(
    store: PoolStore, dialect: Dialect, body: Any
) -> None:
    store.record_call("t", record(dialect, body(SYSTEM, ARGUMENTS, "sunny"), [1, 2, 3]))
    context = RewardContext("t", None, None, {}, store.steps_of("t"))
    # One generated call, naming an offered tool with its required key: 1/1 (not None, not 0).
    assert tool_call_format(context) == 1.0


# (what the agent changed in turn 2, the kind every dialect must record)
CHANGES = [
    ("arguments re-serialised", {"arguments": '{"city":"Paris"}'}, "tool_arguments_changed"),
    ("a turn rewritten", {"result": "rainy"}, "history_rewritten"),
    ("a system message changed", {"system": SYSTEM + " Be brief."}, "system_changed"),
]


@pytest.mark.parametrize(("what", "change", "kind"), CHANGES, ids=[c[0] for c in CHANGES])
def test_the_same_history_change_is_the_same_break_kind_in_every_dialect(
    store: PoolStore, what: str, change: dict[str, str], kind: str
) -> None:
    kinds = []
    # The Messages API sends a tool call's input as an object, serialised by the gateway:
    # a Messages client cannot re-serialise arguments, so that change is the other two's.
    dialects = DIALECTS[:2] if "arguments" in change else DIALECTS
    for dialect, body in dialects:
        trajectory_id = f"{dialect.name}-{what}"
        store.record_call(trajectory_id, record(dialect, body(SYSTEM, ARGUMENTS, "sunny"), [1, 2]))
        args = {"system": SYSTEM, "arguments": ARGUMENTS, "result": "sunny", **change}
        # Turn 2 resends the history changed; its tokens leave turn 1's at offset 1.
        store.record_call(
            trajectory_id,
            record(dialect, body(args["system"], args["arguments"], args["result"]), [1, 9, 9]),
        )
        second = store.steps_of(trajectory_id)[1]
        assert "prefix_break" in second.flags
        kinds.append(second.divergence_kind)
    assert kinds == [kind] * len(dialects)


@pytest.mark.parametrize(("dialect", "body"), DIALECTS, ids=lambda d: getattr(d, "name", ""))
def test_a_call_with_another_system_prompt_and_task_is_a_new_root_not_a_break(
    store: PoolStore, dialect: Dialect, body: Any
) -> None:
    store.record_call("s", record(dialect, body(SYSTEM, ARGUMENTS, "sunny"), [1, 2]))
    side = body("Write a title for the conversation.", ARGUMENTS, "sunny")
    if dialect.name == "responses":
        side["input"] = [{"role": "user", "content": "Title?"}]
    else:
        side["messages"] = [{"role": "user", "content": "Title?"}]
    store.record_call("s", record(dialect, side, [5, 6]))
    main, title = store.steps_of("s")
    assert (title.parent_step_id, title.divergence_kind) == (None, "side_call")
    assert "prefix_break" not in title.flags
    # The next main-chain call extends turn 1: no break, whatever the side call did.
    store.record_call("s", record(dialect, body(SYSTEM, ARGUMENTS, "sunny"), [1, 2, 7, 8, 4]))
    third = store.steps_of("s")[2]
    assert third.parent_step_id == main.id and "prefix_break" not in third.flags


def test_migration_0013_gives_steps_stored_before_it_their_canonical_record(
    tmp_path: Path,
) -> None:
    """Rows as the code before 0013 wrote them (no canonical, no history_field), of all four
    dialects, get their record from their stored requests."""
    url = f"sqlite:///{tmp_path / 'old.sqlite3'}"
    db.upgrade(url)
    store = PoolStore(make_engine(url), PoolSettings(data_dir=tmp_path / "d", database_url=url))
    calls = [
        record(dialect, body(SYSTEM, ARGUMENTS, "sunny"), [1, 2]) for dialect, body in DIALECTS
    ]
    completion = {"model": "tiny", "prompt": "Weather?", "max_tokens": 4}
    calls.append(
        CallRecord(
            request=completion,
            upstream_request={**completion, "return_token_ids": True, "logprobs": 1},
            model="tiny",
            upstream="http://up",
            policy_version=0,
            latency_ms=1.0,
            prompt_token_ids=[3],
            prompt_tokens=1,
            choices=[ChoiceRecord(0, [4], [-0.1], {"text": "x"}, "length")],
            endpoint="completions",
        )
    )
    for position, call in enumerate(calls):
        store.record_call(f"old-{position}", call)
    expected = {f"old-{i}": call.canonical for i, call in enumerate(calls)}
    # What the pool held before 0013: neither column; then the migration runs.
    db.downgrade(url, "0014")  # the bodies whole, as 0013 left them
    with store.engine.begin() as connection:
        connection.execute(update(Step).values(canonical=None, history_field=None))
    db.downgrade(url, "0012")
    db.upgrade(url)
    with store.engine.connect() as connection:
        fields = dict(connection.execute(select(Step.endpoint, Step.history_field)).all())
    assert fields == {
        "chat.completions": "messages",
        "responses": "input",
        "messages": "messages",
        "completions": None,
    }
    store = PoolStore(make_engine(url), store.settings)
    for trajectory_id, canonical in expected.items():
        (step,) = store.steps_of(trajectory_id)
        if canonical is not None:
            assert step.call == canonical
        else:
            assert step.call is not None and step.call.prompt == "Weather?"
            assert step.call.messages is None and step.call.sampling["max_tokens"] == 4


def test_migration_0013_gives_delta_stored_turns_the_records_and_bases_the_pool_writes(
    tmp_path: Path,
) -> None:
    """Two turns per dialect, the second's request and record stored as deltas on the first:
    the migration's frozen rules (migrations.legacy) rebuild both as the live code wrote them."""
    url = f"sqlite:///{tmp_path / 'chain.sqlite3'}"
    db.upgrade(url)
    store = PoolStore(make_engine(url), PoolSettings(data_dir=tmp_path / "d", database_url=url))
    expected = {}
    for dialect, body in DIALECTS:
        second = body(SYSTEM, ARGUMENTS, "sunny")
        name = dialect.history_field
        assert name is not None
        # The first turn asks the task alone (chat's history holds the system message too).
        first = {**second, name: second[name][: 2 if dialect.name == "chat.completions" else 1]}
        for call in (record(dialect, first, [1, 2]), record(dialect, second, [1, 2, 7, 8, 4])):
            store.record_call(f"chain-{dialect.name}", call)
        expected[f"chain-{dialect.name}"] = (first, second)
    with store.engine.connect() as connection:
        written = connection.execute(
            select(Step.id, Step.canonical, Step.canonical_base).order_by(Step.id)
        ).all()
    assert [base for _, _, base in written].count(None) == 0
    assert any(base for _, _, base in written)  # the second turns are deltas
    db.downgrade(url, "0014")  # the bodies whole, as 0013 left them
    with store.engine.begin() as connection:
        connection.execute(update(Step).values(canonical=None, history_field=None))
    db.downgrade(url, "0012")
    db.upgrade(url)
    with store.engine.connect() as connection:
        migrated = connection.execute(
            select(Step.id, Step.canonical, Step.canonical_base).order_by(Step.id)
        ).all()
    # The bases as the pool wrote them; the records themselves are compared as read back below
    # (the stored columns may differ in form: the writer keeps a list that extends the parent's
    # as a delta, migration 0015 only where the upstream body does).
    assert [(i, base) for i, _, base in migrated] == [(i, base) for i, _, base in written]
    store = PoolStore(make_engine(url), store.settings)
    for dialect, _ in DIALECTS:
        first, second = expected[f"chain-{dialect.name}"]
        steps = store.steps_of(f"chain-{dialect.name}")
        assert [step.call for step in steps] == [
            dialect.canonical(dialect.prepare(b).upstream_body) for b in (first, second)
        ]


def test_a_message_resent_as_its_string_is_no_change_of_the_history() -> None:
    """Claude Code's environment message: one text block on the call that carries the cache
    breakpoint, its string on the next. The break (the tool call the template re-renders) is
    read at the echo, not at that message (it was read as ``system_changed``)."""
    environment = "# Environment"
    system = Message("system", "You are a coding agent.")
    user = Message("user", "Write hello.py.")
    as_block = Message("system", [{"type": "text", "text": environment}])
    call = Message("assistant", tool_calls=(ToolCall("c1", "Read", '{"file_path":"hello.py"}'),))
    result = Message("tool", "File does not exist.", tool_call_id="c1")
    resent = [system, user, Message("system", environment), call, result]
    assert classify_divergence([system, user, as_block], call, resent) == "tool_call_rerendered"
    edited = [system, user, Message("system", environment + "!"), call, result]
    assert classify_divergence([system, user, as_block], call, edited) == "system_changed"


def test_a_dropped_middle_turn_is_history_truncated_and_an_edited_one_is_rewritten() -> None:
    """History H = [system, u0, a0, u1, a1] then the answer a2. Dropping the whole turn (u0,
    a0) and going on keeps H's messages in order (a subsequence): truncated. Editing u0 instead
    keeps nothing after the difference: rewritten. A conversation's start ending in a system
    block (Claude Code's) is a side call whether the block sits first or last."""
    system, environment = Message("system", "Agent."), Message("system", "# Environment")
    u0, a0 = Message("user", "q0"), Message("assistant", "r0")
    u1, a1 = Message("user", "q1"), Message("assistant", "r1")
    answer, u2 = Message("assistant", "r2"), Message("user", "q2")
    parent = [system, u0, a0, u1, a1]
    assert classify_divergence(parent, answer, [system, u1, a1, answer, u2]) == "history_truncated"
    assert classify_divergence(parent, answer, [system, u1, a1, u2]) == "history_truncated"
    assert classify_divergence(parent, answer, [system, u0, u2]) == "history_rewritten"
    edited = [system, Message("user", "q0!"), a0, u1, a1, answer, u2]
    assert classify_divergence(parent, answer, edited) == "history_rewritten"
    start = [system, u0, environment]
    for other in ([Message("system", "Sub-agent."), u1, environment], [system, u1]):
        assert classify_divergence(start, a0, other) == "side_call"


def test_a_conversation_start_is_a_side_call_however_short_the_parents_history() -> None:
    """A title call ``[system, user]`` after a first turn ``[user] → answer`` (as long as that
    history), and a sub-agent's ``[system B, user, system]`` after ``[system A, user] → answer``
    (as long too), are new roots: both were breaks (``history_rewritten``, ``system_changed``)
    that the main chain's next exact turn was flagged after as well."""
    task, answer = Message("user", "Task one."), Message("assistant", "Done.")
    assert classify_divergence([task], answer, [Message("system", "Title."), task]) == "side_call"
    main = [Message("system", "Main agent."), task]
    sub = [Message("system", "Sub-agent."), Message("user", "Find it."), Message("system", "Env")]
    assert classify_divergence(main, answer, sub) == "side_call"
    # Not a start (it has the answer and goes on): still explained as a change of the chain.
    went_on = [Message("system", "Other."), task, answer, Message("user", "next")]
    assert classify_divergence(main, answer, went_on) == "system_changed"
