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


class Walked:
    """Counts, per call, the messages whose key (``history._history_form``) and canonical form
    (``chat_completions.serving._message``, which every chat-path dialect's record reads)
    were made: the history-sized operations of a call's walk."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from gateway.dialects.chat_completions import serving

        self.forms: list[Message] = []
        self.canonical: list[Any] = []
        history_form, message = history._history_form, serving._message

        def counted_form(value: Message) -> str:
            self.forms.append(value)
            return history_form(value)

        def counted_message(value: Any) -> Message:
            self.canonical.append(value)
            return message(value)

        monkeypatch.setattr(history, "_history_form", counted_form)
        monkeypatch.setattr(serving, "_message", counted_message)

    def call(self, url: str, body: dict[str, Any]) -> tuple[int, int]:
        self.forms.clear()
        self.canonical.clear()
        reply = httpx.post(url, json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        return len(self.forms), len(self.canonical)


def session_body(dialect: Any, turn: int, answer: str) -> dict[str, Any]:
    return agent_session.body(
        dialect, 0, turn, answer, stream=False, response_tokens=2, tool_result_chars=40
    )


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
def test_an_exact_call_walks_only_the_messages_its_history_added(
    sqlite_pool: PoolSettings, monkeypatch: pytest.MonkeyPatch, dialect: Any
) -> None:
    # Turn t of the scripted session sends the system prompt, the task and t times an answer
    # and a tool result: 2 + 2t canonical messages. Turn 0 walks its 2; every later turn
    # re-sends the last call's 2 + 2(t - 1) messages unchanged, proved by their JSON text
    # (gateway.proxy.continuation.walk), and walks only the 2 it added: keys and canonical
    # forms 2, 2, 2, 2 (before: 2, 4, 6, 8, and before that twice as many keys).
    walked = Walked(monkeypatch)
    answer = emulator_answer(2)
    emulator = {"prompt_tokens": 3, "response_tokens": 2, "prompt_ids": "messages"}
    trajectory = f"walks-{dialect}"
    with emulated_gateway(sqlite_pool, **emulator) as server:
        url = f"{server.url}/t/{trajectory}/v1{PATHS[dialect]}"
        counts = [walked.call(url, session_body(dialect, turn, answer)) for turn in range(4)]
    assert counts == [(2, 2)] * 4
    steps = steps_of(sqlite_pool, trajectory)
    # every later turn still finds the turn it extends: one token sequence
    assert [s.continuation for s in steps] == ["template", "exact", "exact", "exact"]
    assert all(s.turn_key is not None and s.extends_parent is not False for s in steps)


def test_a_client_that_rewrites_an_earlier_message_is_walked_whole_and_recorded_as_before(
    sqlite_pool: PoolSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Turns 0 to 2 as the session sends them; turn 3 re-sends turn 2's history with the task
    # (message 1) rewritten, then the answer and a tool result: the kept walk is not proved
    # (its JSON text differs at message 1), so all 2 + 2 * 3 = 8 messages are walked; no turn
    # is extended (every candidate key covers the task), the template renders the call and the
    # pool records the break where the task's tokens differ, as without a kept walk. Turn 4
    # continues turn 3 exactly again and walks its 2 new messages.
    walked = Walked(monkeypatch)
    answer = emulator_answer(2)
    emulator = {"prompt_tokens": 3, "response_tokens": 2, "prompt_ids": "messages"}
    trajectory = "walks-rewritten"

    def rewritten(turn: int) -> dict[str, Any]:
        body = session_body("chat", turn, answer)
        body["messages"][1] = {**body["messages"][1], "content": "Another task."}
        return body

    with emulated_gateway(sqlite_pool, **emulator) as server:
        url = f"{server.url}/t/{trajectory}/v1/chat/completions"
        counts = [walked.call(url, session_body("chat", turn, answer)) for turn in range(3)]
        counts.append(walked.call(url, rewritten(3)))
        counts.append(walked.call(url, rewritten(4)))
    assert counts == [(2, 2), (2, 2), (2, 2), (8, 8), (2, 2)]
    steps = steps_of(sqlite_pool, trajectory)
    assert [s.continuation for s in steps] == ["template", "exact", "exact", "template", "exact"]
    broken = steps[3]
    assert broken.extends_parent is False and "prefix_break" in broken.flags
    # system (3 ids + E = 4), then the task's ids differ: the first difference is at 4
    assert broken.divergence_offset == 4
    assert steps[4].extends_parent and steps[4].parent_step_id == broken.id


def test_the_walk_memory_keeps_at_most_its_bytes_least_recently_used_first() -> None:
    from gateway.proxy.continuation.walk import Walk, WalkMemory

    def walk(text: bytes) -> Walk:
        return Walk(
            text, "{}", "chat", (Message("user", content="x"),), history.history_keys("{}", ())
        )

    memory = WalkMemory(max_bytes=40)
    memory.keep("a", walk(b"[" + b"1" * 8 + b"]"))  # 10 bytes, counted twice: 20
    memory.keep("b", walk(b"[" + b"2" * 8 + b"]"))  # 20 more: 40, the bound
    assert memory.held_bytes == 40
    assert memory.last("a") is not None  # a is now the most recently used
    memory.keep("c", walk(b"[3]"))  # 6 more: 46 > 40, so b (least recently used) goes
    assert (memory.last("b"), memory.held_bytes) == (None, 26)
    memory.keep("d", walk(b"[" + b"4" * 19 + b"]"))  # 42 bytes alone: never kept
    assert (memory.last("d"), memory.held_bytes) == (None, 26)
    memory.keep("a", walk(b"[5]"))  # replaces a's 20 with 6
    assert memory.held_bytes == 12


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


def test_the_depth_check_takes_128_levels_and_refuses_129_in_a_wide_body() -> None:
    # 200 objects of 2 levels (more brackets than MAX_JSON_DEPTH, so the depth is walked), then
    # a chain of n lists in the top list: depth 1 + n. n = 127 -> 128, taken; n = 128 -> 129.
    from gateway.errors import InvalidRequestError
    from gateway.proxy.attribution import parse_json

    def body(n: int, opener: bytes, closer: bytes) -> bytes:
        return b"[" + b'{"a": [1]}, ' * 200 + opener * n + b"0" + closer * n + b"]"

    for opener, closer in ((b"[", b"]"), (b'{"k": ', b"}")):
        assert len(parse_json(body(127, opener, closer))) == 201
        with pytest.raises(InvalidRequestError) as refused:
            parse_json(body(128, opener, closer))
        assert "nests deeper than 128" in refused.value.message
    assert parse_json(b'"' + b"[" * 200 + b'"') == "[" * 200  # brackets in a string: no depth


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
    from gateway.proxy import preparation

    extended: list[tuple[int, int | None]] = []
    find_extension = preparation.find_extension

    def recorded(candidates: Any, messages: Any, lookup: Any) -> Any:
        found = find_extension(candidates, messages, lookup)
        extended.append((len(messages), None if found is None else found.new_from))
        return found

    lookups: list[int] = []
    find_turn = PoolStore.find_turn

    def counted(self: PoolStore, trajectory_id: str, keys: Any) -> Any:
        lookups.append(len(keys))
        return find_turn(self, trajectory_id, keys)

    monkeypatch.setattr(preparation, "find_extension", recorded)
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


def stdlib_request_hash(dialect: str, body: Any) -> str:
    """The hash every stored step has: the stdlib's sorted, compact JSON (before orjson)."""
    import hashlib
    import json

    text = json.dumps([dialect, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def test_request_hash_is_the_stored_hash_for_every_kind_of_value() -> None:
    import random
    import struct

    from gateway.capture import request_hash

    floats = [1.0, 0.7, 1e-4, 9.9e-5, 1e-5, 1.5e-5, 1e-6, -2.5e-8, 1e15, 1e16, 1.5e300, -0.0]
    rng = random.Random(7)
    for _ in range(50_000):  # 150,000 doubles: raw bit patterns, log-uniform, rounded
        raw = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        if raw == raw and abs(raw) != float("inf"):  # a body holds no NaN or infinity
            floats.append(raw)
        floats.append(10 ** rng.uniform(-12, 20) * rng.choice((1, -1)))
        floats.append(round(rng.random(), rng.randrange(9)))
    texts = ["plain", "caf\u00e9", "\u2028", "\U0001f600", "\x7f", "\x00\x08\x1f", 'q"\\/', "1e-5"]
    bodies: list[Any] = [
        {"model": "m", "temperature": value, "messages": [{"role": "user", "content": "hi"}]}
        for value in floats
    ]
    bodies += [{"messages": [{"content": text, "role": "user"}], "b": 1, "a": 2} for text in texts]
    bodies.append({"seed": 2**70, "Z": [None, True, False, -3], "_": {"y": 1, "x": [{}]}})
    for body in bodies:
        assert request_hash("chat.completions", body) == stdlib_request_hash(
            "chat.completions", body
        ), body


def test_request_hash_of_a_long_turn_takes_orjsons_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Turn 199 of the scripted session (~170 KB, ASCII, temperature 1.0): orjson's text is the
    # stdlib's, so the stdlib never writes it; the hash is the stored one.
    from gateway import capture

    body = agent_session.body(
        "chat", 0, 199, emulator_answer(40), stream=False, response_tokens=40, tool_result_chars=450
    )
    expected = stdlib_request_hash("chat.completions", body)
    written: list[Any] = []
    dumps = capture.json.dumps

    def counted(value: Any, **kwargs: Any) -> str:
        written.append(value)
        return dumps(value, **kwargs)

    monkeypatch.setattr(capture.json, "dumps", counted)
    assert capture.request_hash("chat.completions", body) == expected
    assert written == []


def test_an_exact_unary_call_checks_only_the_prompt_ids_it_reads_anew(
    sqlite_pool: PoolSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # token_ids reads a list of ids in three passes in C (types, min, max). Turn 0 is the
    # template's: the chat endpoint's answer carries the prompt, read once (one pass of min
    # over all of it). An exact unary call's prompt is the turn's own ids, checked when that
    # turn was captured, and the render's suffix: at turn t (t >= 1) no pass over the whole
    # prompt (before: one over the render's ids, and before that a second when the derendered
    # answer's prompt was read), one over the suffix the render added.
    from gateway.engine import wire

    passes: list[int] = []

    def counted_min(values: Any) -> Any:
        if isinstance(values, list):
            passes.append(len(values))
        return min(values)

    monkeypatch.setattr(wire, "min", counted_min, raising=False)
    answer = emulator_answer(2)
    emulator = {"prompt_tokens": 3, "response_tokens": 2, "prompt_ids": "messages"}
    counts = []
    with emulated_gateway(sqlite_pool, **emulator) as server:
        url = f"{server.url}/t/checked-once/v1/chat/completions"
        for turn in range(4):
            passes.clear()
            reply = httpx.post(url, json=session_body("chat", turn, answer), timeout=30)
            assert reply.status_code == 200, reply.text
            counts.append(list(passes))
    steps = steps_of(sqlite_pool, "checked-once")
    assert [s.continuation for s in steps] == ["template", "exact", "exact", "exact"]
    prompts = [len(s.prompt_token_ids or []) for s in steps]
    assert counts[0].count(prompts[0]) == 1
    for turn in (1, 2, 3):
        parent = steps[turn - 1]
        turn_ids = prompts[turn - 1] + len(parent.response_token_ids or [])
        suffix = prompts[turn] - turn_ids  # the parent's answer stopped on the end token
        assert max(counts[turn]) < prompts[turn], (turn, counts[turn], prompts[turn])
        assert suffix in counts[turn], (turn, counts[turn], suffix)


def test_the_writer_finds_an_echo_in_another_form_with_one_dump_of_the_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The parent's history keys H_p = M_p + [R_p]; an agent sends M_p, then its echo of R_p in
    # its own form, then a new message. The shared prefix is M_p (3 items), found from one
    # json.dumps of the first 4 values (before: one dump of 4 and another of 3).
    import json

    from datapool.steps import bodies

    parent = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    parent.append({"role": "assistant", "content": "a", "tool_calls": []})
    response = {"role": "assistant", "content": "b", "refusal": None}
    theirs = [json.dumps(m) for m in [*parent, response]]
    echo = {"role": "assistant", "content": "b"}
    dumps: list[Any] = []
    original = bodies.json.dumps

    def counted(value: Any, **kwargs: Any) -> str:
        dumps.append(value)
        return original(value, **kwargs)

    monkeypatch.setattr(bodies.json, "dumps", counted)
    assert bodies.shared_prefix([*parent, echo, {"role": "user", "content": "n"}], theirs) == 3
    assert len(dumps) == 1
    # the echo as the parent's response: all 4; a history cut to the parent's M_p: 3
    assert bodies.shared_prefix([*parent, response], theirs) == 4
    assert bodies.shared_prefix(parent, theirs) == 3
    # a rewritten message 1: compared item by item, the prefix stops before it (1)
    rewritten = [parent[0], {"role": "user", "content": "v"}, parent[2], echo]
    assert bodies.shared_prefix(rewritten, theirs) == 1
    # an item whose text only starts like the parent's ("1" against "12") is no match
    assert bodies.shared_prefix([12, 5], ["1", "5", "7"]) == 0


def test_a_proved_prefix_gives_shared_prefixs_answer_from_the_parents_text() -> None:
    # The parent's H_p = M_p + [R_p] = [s, u, a] + [r], kept as a ListText (its orjson text,
    # without and with r). Each case: proved_prefix's answer is shared_prefix's.
    import json

    from datapool.steps import bodies

    s, u, a = {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"n": 1}
    r = {"role": "assistant", "content": "b", "refusal": None}
    theirs = [json.dumps(m) for m in (s, u, a, r)]
    proof = bodies.list_text(bodies.orjson_text([s, u, a]), None, r)
    assert proof is not None and proof.has_head
    # the head is the text '[{...},{...},{"n":1}' without its "]": len(orjson text) - 1
    assert proof.head == len(bodies.orjson_text([s, u, a]) or b"") - 1
    assert proof.whole == len(bodies.orjson_text([s, u, a, r]) or b"") - 1
    assert proof.text() == (bodies.orjson_text([s, u, a, r]) or b"")[:-1]
    cases = {
        "echo as sent, then a new message: all 4": ([s, u, a, r, u], 4),
        "the whole H_p and nothing more: 4": ([s, u, a, r], 4),
        "echo in its own form: M_p, 3": ([s, u, a, {"role": "assistant", "content": "b"}], 3),
        "echo with the keys reordered: 3": ([s, u, a, {"content": "b", **r}], 3),
        "M_p alone: 3": ([s, u, a], 3),
        "a number as a float (1.0 is not 1): 2": ([s, u, {"n": 1.0}, r], 2),
        "a rewritten first message: 0": ([{"role": "system", "content": "t"}, u, a, r], 0),
        "an item that only starts like the parent's: 2": ([s, u], 2),
    }
    for name, (values, expected) in cases.items():
        text = bodies.orjson_text(values)
        assert bodies.proved_prefix(values, text, theirs, proof) == expected, name
        # its own ListText, on the parent's buffer where the texts agree: its own text
        own = bodies.list_text(text, proof)
        assert own is not None and own.text() == (text or b"")[:-1], name
        # the parent's text is as it was, whatever its buffer now holds past it
        assert proof.text() == (bodies.orjson_text([s, u, a, r]) or b"")[:-1], name
        assert bodies.shared_prefix(values, theirs) == expected, name
    # a list that extends the parent's extends its buffer in place, nothing copied; one that
    # the buffer's text does not begin (a float where the parent has an int) gets its own
    child = bodies.list_text(bodies.orjson_text([s, u, a, r, u, u]), proof)
    assert child is not None and child.buffer is proof.buffer
    other = bodies.list_text(bodies.orjson_text([s, u, {"n": 1.0}, r]), proof)
    assert other is not None and other.buffer is not proof.buffer
    assert other.grown == other.head == len(bodies.orjson_text([s, u, {"n": 1.0}, r]) or b"") - 1
    # a list orjson cannot write (an integer past 64 bits) is compared by its keys
    assert bodies.orjson_text([2**64]) is None
    assert bodies.proved_prefix([s, u, a, r], None, theirs, proof) == 4
