"""The writer proves what a call shares with its parent at the cost of what is new, and stores
exactly what it stored when it hashed the whole history: every stored row, payload
and blob of a 200-turn session per dialect, one with an early message rewritten at turn 150,
against golden digests written by the code before the change; and the same rows as when every
list is compared by its ``json.dumps`` keys alone (``bodies.shared_prefix``)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text
from test_body_storage import (
    assert_read_back_as_sent,
    chat_body,
    chat_cch_body,
    messages_body,
    messages_cch_body,
    stored_bodies,
    turn_call,
)

from datapool.db import make_engine
from datapool.settings import PoolSettings
from datapool.steps.records import CallRecord
from datapool.steps.store import PoolStore
from gateway.dialects import Dialect
from gateway.dialects.chat_completions import ChatCompletions
from gateway.dialects.messages import Messages

TURNS = 200
EDITED_TURN = 150


def edited_at(body: Callable[[int], dict[str, Any]], turn: int) -> Callable[[int], dict[str, Any]]:
    """``body`` whose call ``turn`` alone has one byte changed in an early history message
    (the tool result of turn 0: ``"turn 000: ..."`` becomes ``"turn 001: ..."``)."""

    def edited(k: int) -> dict[str, Any]:
        sent = body(k)
        if k == turn:
            messages = sent["messages"]
            at = next(i for i, m in enumerate(messages) if "turn 000" in json.dumps(m))
            edited = json.dumps(messages[at]).replace("turn 000", "turn 001", 1)
            messages[at] = json.loads(edited)
        return sent

    return edited


SESSIONS: dict[str, tuple[Dialect, Callable[[int], dict[str, Any]]]] = {
    "chat": (ChatCompletions(), chat_body),
    "messages": (Messages(), messages_body),
    "chat-edited": (ChatCompletions(), edited_at(chat_body, EDITED_TURN)),
    "messages-edited": (Messages(), edited_at(messages_body, EDITED_TURN)),
    # the first system line changes on every call (``bodies.head_replaced``)
    "chat-cch": (ChatCompletions(), chat_cch_body),
    "messages-cch": (Messages(), messages_cch_body),
}

# sha256 of ``snapshot`` on SQLite, written by the writer that hashed each list's whole text
# (``PrefixDigests``, commit ec53e1a).
GOLDEN = {
    "chat": "54789cd9c2fe8139aa5091f858d6359a5827061b0eccc3ca54bcba5d3b17ec15",
    "messages": "9ada93f8c035687ba22e34222f22d6f5c0395ad01affdd2474a1c11afc00ae55",
    "chat-edited": "62726da0a73bfed68019181583ff2ce4507a8086e04d483f23f7000128e0c0f1",
    "messages-edited": "6a5ec7741273ae8bdad0410fc27a73de679340c6106a741b14ba5b12cc296a6a",
    "chat-cch": "48e6b65b88ec98e6f97b6c10e453cdcf3759ca3c12f6f5e8a074f989ea813a85",
    "messages-cch": "86fd80dacec953bd69b0e146d826dbf7bfdeab576d3e8bfb6aebe0b81a65aedb",
}


def record(store: PoolStore, name: str, trajectory_id: str) -> list[CallRecord]:
    dialect, body = SESSIONS[name]
    calls = []
    for turn in range(TURNS):
        calls.append(turn_call(dialect, body(turn), turn))
        store.record_call(trajectory_id, calls[-1])
    return calls


def snapshot(store: PoolStore, trajectory_id: str) -> str:
    """Every stored value of the trajectory's steps, payloads and the blobs it refers to, as
    JSON text with step ids replaced by their step index and timestamps left out."""
    with store.engine.connect() as connection:
        steps = [
            dict(row._mapping)
            for row in connection.execute(
                text("SELECT * FROM steps WHERE trajectory_id = :t ORDER BY step_index"),
                {"t": trajectory_id},
            )
        ]
        payloads = [
            dict(row._mapping)
            for row in connection.execute(
                text(
                    "SELECT p.* FROM step_payloads p JOIN steps s ON s.id = p.step_id "
                    "WHERE s.trajectory_id = :t ORDER BY s.step_index"
                ),
                {"t": trajectory_id},
            )
        ]
        blobs = [
            tuple(row)
            for row in connection.execute(
                text("SELECT sha256, body FROM json_blobs ORDER BY sha256")
            )
        ]

    def plain(row: dict[str, Any]) -> dict[str, Any]:
        return {
            key: value.hex() if isinstance(value, bytes | memoryview) else value
            for key, value in row.items()
            if not key.endswith("_at") and key != "trajectory_id"
        }

    dumped = json.dumps([[plain(r) for r in steps], [plain(r) for r in payloads], blobs])
    for step in steps:
        dumped = dumped.replace(step["id"], f"step-{step['step_index']}")
    return dumped


@pytest.mark.parametrize("name", list(SESSIONS))
def test_a_200_turn_session_is_stored_byte_for_byte_as_before(
    sqlite_pool: PoolSettings, name: str
) -> None:
    store = PoolStore(make_engine(sqlite_pool.resolved_database_url()), sqlite_pool)
    calls = record(store, name, "t")
    digest = hashlib.sha256(snapshot(store, "t").encode()).hexdigest()
    assert digest == GOLDEN.get(name), name
    assert_read_back_as_sent(store, "t", calls)
    # The lineage memory holds each list's text once per chain: the history's texts of all
    # 200 steps are views of one buffer, as long as the last one's; the edited turn and the
    # next one (each differs from its parent at message 3) start one each. A session whose
    # first message changes on every call keeps no text after its first step (no step would
    # begin with its parent's), not one buffer per step.
    # (Messages' ``system`` is no history item: its history extends the parent's; its
    # canonical messages begin with the system message.)
    memory = store._lineage.get("t")
    assert memory is not None
    replaced = {"history": name == "chat-cch", "canonical": "cch" in name}
    for which, replaced_head in replaced.items():
        texts = [
            text
            for c in memory.candidates
            if (text := c.message_text if which == "history" else c.canonical_text) is not None
        ]
        assert len(texts) == (1 if replaced_head else TURNS), (name, which)
        buffers = {id(t.buffer) for t in texts}
        assert len(buffers) == (3 if "edited" in name else 1), (name, which)
        longest = max(len(t.buffer) for t in texts)
        assert longest <= len(json.dumps(calls[-1].upstream_request["messages"])), (name, which)
    store.engine.dispose()


@pytest.mark.parametrize("name", ["chat-edited", "messages-edited"])
def test_an_early_message_changed_at_turn_150_stops_the_shared_prefix_there(
    pool_settings: PoolSettings, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Turn 150 changes one byte of the tool result of turn 0; turn 151 sends it as before.
    Both share only the messages before it with their parent (chat: [system, task, answer 0],
    3; Messages: [task, answer 0], 2; the canonical messages start with the system message in
    both: 3), and the rows are those of a writer that compares every list by its
    ``json.dumps`` keys alone (``bodies.shared_prefix``)."""
    from datapool.steps import bodies, messages

    store = PoolStore(make_engine(pool_settings.resolved_database_url()), pool_settings)
    calls = record(store, name, "proved")
    rows = stored_bodies(store, "proved")  # request, messages_base, ..., canonical_base, ...
    chat = name.startswith("chat")
    first = 3 if chat else 2
    # Turn k extends its parent: its base is the parent's H_p, 2 + 2 (k - 1) + 1 in chat; in
    # Messages the client's echo of the answer is not the chat answer R_p: 1 + 2 (k - 1).
    extends = 3 if chat else 1
    assert rows[EDITED_TURN - 1][1] == extends + 2 * (EDITED_TURN - 2)
    assert [row[1] for row in rows[EDITED_TURN : EDITED_TURN + 2]] == [first, first]
    assert [row[5] for row in rows[EDITED_TURN : EDITED_TURN + 2]] == [3, 3]
    assert rows[EDITED_TURN + 2][1] == extends + 2 * (EDITED_TURN + 1)
    assert_read_back_as_sent(store, "proved", calls)

    def keys_alone(values: Any, text: Any, theirs: Any, proof: Any) -> int:
        return bodies.shared_prefix(values, theirs)

    monkeypatch.setattr(bodies, "proved_prefix", keys_alone)
    monkeypatch.setattr(messages, "proved_prefix", keys_alone)
    record(store, name, "compared")
    assert stored_bodies(store, "compared") == rows
    store.engine.dispose()
