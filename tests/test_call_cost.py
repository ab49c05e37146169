"""What one call walks of its history (DESIGN.md invariant 10: cost proportional to what is new),
counted rather than timed: history-sized operations per call, in every dialect, through the
gateway against the emulator with the exact-continuation endpoints."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest
from gateway_helpers import emulated_gateway, steps_of

from datapool.settings import PoolSettings
from datapool.steps.canonical import Message
from gateway.proxy.continuation import history
from trajgate.bench import agent_session
from trajgate.bench.continuation import emulator_answer

PATHS = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}


def test_the_key_of_a_calls_own_turn_is_the_turn_key_of_its_history() -> None:
    # The walk that finds the turn a call extends also keys the turn it becomes: the same key
    # turn_key gives (stored as steps.turn_key, so a turn stored earlier is still found).
    messages = (
        Message("system", content="Be brief."),
        Message("user", content="Hi"),
        Message("assistant", content=" t1 t2"),
        Message("user", content=[{"type": "text", "text": "And?"}]),
    )
    answer = Message("assistant", content=" t3")
    keys = history.history_keys("{}", messages)
    assert keys.answered_by(answer) == history.turn_key("{}", messages, answer)
    assert keys.candidates == history.candidate_keys("{}", messages)
    assert [k for k, _ in keys.candidates] == [2]
    assert keys.candidates[0][1] == history.turn_key("{}", messages[:2], messages[2])


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_an_exact_call_serialises_each_message_of_its_history_once(
    sqlite_pool: PoolSettings, monkeypatch: pytest.MonkeyPatch, dialect: Any
) -> None:
    # Turn t of the scripted session sends the system prompt, the task and t times an answer
    # and a tool result: 2 + 2t canonical messages. Finding the turn it extends and keying the
    # turn it becomes is one walk over them (before: one walk each, 2 * (2 + 2t)).
    forms: list[Message] = []
    history_form = history._history_form

    def counted(message: Message) -> str:
        forms.append(message)
        return history_form(message)

    monkeypatch.setattr(history, "_history_form", counted)
    answer = emulator_answer(2)
    emulator = {"prompt_tokens": 3, "response_tokens": 2, "prompt_ids": "messages"}
    trajectory = f"walks-{dialect}"
    counts = []
    with emulated_gateway(sqlite_pool, **emulator) as server:
        url = f"{server.url}/t/{trajectory}/v1{PATHS[dialect]}"
        for turn in range(4):
            body = agent_session.body(
                dialect, 0, turn, answer, stream=False, response_tokens=2, tool_result_chars=40
            )
            forms.clear()
            reply = httpx.post(url, json=body, timeout=30)
            assert reply.status_code == 200, reply.text
            counts.append(len(forms))
    assert counts == [2 + 2 * turn for turn in range(4)]  # 2, 4, 6, 8
    steps = steps_of(sqlite_pool, trajectory)
    # every later turn still finds the turn it extends: one token sequence
    assert [s.continuation for s in steps] == ["template", "exact", "exact", "exact"]
    assert all(s.turn_key is not None and s.extends_parent is not False for s in steps)


def test_a_long_body_is_parsed_once_without_the_stdlib_parser(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Turn 50 of the scripted chat session: ~65 KB, far more than MAX_JSON_DEPTH objects. The
    # parse is the floor of a call's cost; the strict stdlib parse (hooks in Python) costs
    # several times orjson's, so it runs only where orjson's value could differ.
    import json

    from gateway.proxy import attribution

    raw = json.dumps(
        agent_session.body(
            "chat",
            0,
            50,
            emulator_answer(40),
            stream=False,
            response_tokens=40,
            tool_result_chars=450,
        )
    ).encode()
    stdlib_parses: list[str] = []
    loads = json.loads

    def counted(text: Any, **kwargs: Any) -> Any:
        stdlib_parses.append(text[:20])
        return loads(text, **kwargs)

    monkeypatch.setattr(attribution.json, "loads", counted)
    assert attribution.parse_json(raw) == loads(raw)
    assert stdlib_parses == []
    # An integer past 64 bits keeps its value (orjson would make it a float): the stdlib parse.
    big = attribution.parse_json(b'{"seed": 123456789012345678901234567890, "x": 0.1}')
    assert big == {"seed": 123456789012345678901234567890, "x": 0.1}
    assert type(big["seed"]) is int and len(stdlib_parses) == 1


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"t": NaN}', "NaN is not a JSON number"),
        (b'{"t": 1e999}', "beyond a 64-bit float"),
        (b'{"t": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"t": "\xff"}', "not valid UTF-8"),
        (b'{"t": [1, 2}', "not valid JSON"),
        (b"[" * 129 + b"]" * 129, "nests deeper than 128"),
        (b'{"a": ' * 129 + b"1" + b"}" * 129, "nests deeper than 128"),
        (b'[{"a": "b"}, ' * 200 + b'"\\u0000"' + b"]" * 200, "nests deeper than 128"),
    ],
)
def test_what_the_strict_parse_refuses_is_still_refused(content: bytes, needle: str) -> None:
    from gateway.errors import InvalidRequestError
    from gateway.proxy.attribution import parse_json

    with pytest.raises(InvalidRequestError) as refused:
        parse_json(content, refuse_nul=True)
    assert needle in refused.value.message


def test_a_wide_body_with_a_nul_is_refused_and_a_wide_shallow_one_is_taken() -> None:
    from gateway.errors import InvalidRequestError
    from gateway.proxy.attribution import parse_json

    wide = b"[" + b", ".join([b'{"a": "b"}'] * 300) + b"]"  # 300 objects, 2 levels deep
    assert parse_json(wide, refuse_nul=True) == [{"a": "b"}] * 300
    with pytest.raises(InvalidRequestError) as refused:
        parse_json(wide[:-1] + b', "\\u0000"]', refuse_nul=True)
    assert "NUL character" in refused.value.message


@pytest.mark.parametrize("dialect", ["chat", "messages"])
def test_every_turn_of_a_scripted_session_extends_the_turn_just_before_it_from_memory(
    sqlite_pool: PoolSettings, monkeypatch: pytest.MonkeyPatch, dialect: Any
) -> None:
    # The bench's session echoes the emulator's answer (emulator_answer): turn t (t >= 1)
    # sends 2 + 2t canonical messages, the last one the new tool result, so it extends the turn
    # of the call before it from message 1 + 2t on, found in the gateway's memory: no pool
    # lookup. Before, the emulator's exact answers were a token shorter than its chat answer,
    # so no echo matched the latest turn: every call extended turn 0 (new messages from 3 on)
    # and asked the pool for the t - 1 later keys (find_turn once per call).
    from datapool.steps.store import PoolStore
    from gateway.proxy import routes

    extended: list[tuple[int, int | None]] = []
    find_extension = routes.find_extension

    def recorded(candidates: Any, messages: Any, lookup: Any) -> Any:
        found = find_extension(candidates, messages, lookup)
        extended.append((len(messages), None if found is None else found.new_from))
        return found

    lookups: list[int] = []
    find_turn = PoolStore.find_turn

    def counted(self: PoolStore, trajectory_id: str, keys: Any) -> Any:
        lookups.append(len(keys))
        return find_turn(self, trajectory_id, keys)

    monkeypatch.setattr(routes, "find_extension", recorded)
    monkeypatch.setattr(PoolStore, "find_turn", counted)
    answer = emulator_answer(4)
    emulator = {"prompt_tokens": 3, "response_tokens": 4, "prompt_ids": "messages"}
    trajectory = f"previous-turn-{dialect}"
    with emulated_gateway(sqlite_pool, **emulator) as server:
        url = f"{server.url}/t/{trajectory}/v1{PATHS[dialect]}"
        for turn in range(5):
            body = agent_session.body(
                dialect, 0, turn, answer, stream=False, response_tokens=4, tool_result_chars=40
            )
            reply = httpx.post(url, json=body, timeout=30)
            assert reply.status_code == 200, reply.text
    # turn 0 has no assistant message: no candidate, find_extension is not asked
    assert extended == [(2 + 2 * t, 1 + 2 * t) for t in range(1, 5)]  # (4, 3), (6, 5), ...
    assert lookups == []
    steps = steps_of(sqlite_pool, trajectory)
    assert [s.continuation for s in steps] == ["template"] + ["exact"] * 4
    assert all(s.parent_step_id == p.id for p, s in itertools.pairwise(steps))
