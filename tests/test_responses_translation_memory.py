"""The Responses dialect's memory of recent ``input`` translations
(``gateway.dialects.translation_memory``, ``gateway.dialects.responses.request``): a call that
re-sends its ``input`` gets the very chat body a translation from scratch gives, while only
the items it added are translated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.dialects.responses import Responses, request
from gateway.dialects.responses.request import (
    EarlierResponse,
    ResponsesMemory,
    translate_body,
    translate_request,
)
from gateway.errors import InvalidRequestError

DATA = Path(__file__).parent / "data"
# Codex's base instructions open every input: longer than the memory's key (512 bytes).
BASE = "You are a coding agent running in the Codex CLI, a terminal-based assistant. " * 8


def message(role: str, text: str) -> dict[str, Any]:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def reasoning(text: str, *, summary: bool = False) -> dict[str, Any]:
    if summary:
        return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}
    return {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": None,
    }


def call(k: int, n: int = 0) -> dict[str, Any]:
    arguments = json.dumps({"cmd": f"sed -n {k},{k + 40}p src/parser.py"})
    return {
        "type": "function_call",
        "name": "exec_command",
        "arguments": arguments,
        "call_id": f"call_{k}_{n}",
    }


def output(k: int, n: int = 0, size: int = 40) -> dict[str, Any]:
    text = f"Process exited with code 0\nOutput:\nline {k} " + "x" * size
    return {"type": "function_call_output", "call_id": f"call_{k}_{n}", "output": text}


def exchange(k: int, size: int = 40) -> list[dict[str, Any]]:
    """The items one Codex exchange adds, five kinds in turn: reasoning then a call; a text
    answer with two calls (merged into one assistant message); reasoning, then an answer and
    the user's next message; an encrypted-only reasoning (no text) and a summary before a
    call; reasoning before the user's message (an assistant turn of its own)."""
    kind = k % 5
    if kind == 0:
        return [reasoning(f"step {k}"), call(k), output(k, size=size)]
    if kind == 1:
        return [
            message("assistant", f"Reading two files ({k})."),
            call(k, 0),
            call(k, 1),
            output(k, 0, size),
            output(k, 1, size),
        ]
    if kind == 2:
        return [
            reasoning(f"done {k}", summary=True),
            message("assistant", "Done."),
            message("user", "go on"),
        ]
    if kind == 3:
        encrypted = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}
        return [encrypted, reasoning(f"plan {k}", summary=True), call(k), output(k, size=size)]
    return [reasoning(f"look {k}"), message("user", "continue")]


def codex_items(exchanges: int, size: int = 40) -> list[dict[str, Any]]:
    """A Codex-shaped ``input``: developer instructions, environment, task, then
    ``exchanges`` exchanges."""
    items = [
        message("developer", BASE),
        message("user", "<environment_context>\n  <cwd>/work/repo</cwd>\n</environment_context>"),
        message("user", "Fix the failing test in tests/test_parser.py."),
    ]
    for k in range(exchanges):
        items += exchange(k, size)
    return items


def call_lengths(items: list[dict[str, Any]]) -> list[int]:
    """Where the calls of a session cut its items: the first call sends the 3 opening items,
    each later one adds 1 or 2 (in turn), so calls end after every kind of item, a trailing
    reasoning item and a trailing assistant message among them."""
    lengths, n, step = [], 3, 1
    while n <= len(items):
        lengths.append(n)
        n, step = n + step, 3 - step
    return lengths


def body(items: Any, **fields: Any) -> dict[str, Any]:
    # parsed again, as every call's body is: no object is shared with an earlier call's
    parsed: dict[str, Any] = orjson.loads(
        orjson.dumps({"model": "tiny", "instructions": "Be brief.", "input": items, **fields})
    )
    return parsed


def chat_text(translated: Any) -> bytes:
    return orjson.dumps(translated.chat_body)


def counting_items(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of input items the fold translates (``_add_item``), call by call."""
    calls: list[int] = [0]
    original = request._add_item

    def counted(messages: Any, pending: Any, item: Any, param: str) -> str | None:
        calls[-1] += 1
        return original(messages, pending, item, param)

    monkeypatch.setattr(request, "_add_item", counted)
    return calls


def test_the_session_cuts_calls_after_every_kind_of_item() -> None:
    # The fixture the tests below rely on: calls end on a pending reasoning item that a call
    # then continues with a function_call, and on an assistant message a function_call then
    # joins (the message a kept entry shares).
    items = codex_items(20)
    ends = call_lengths(items)
    next_after = {items[n - 1]["type"] + ">" + items[n]["type"] for n in ends if n < len(items)}
    assert {"reasoning>function_call", "message>function_call"} <= next_after


def test_a_codex_session_translates_each_new_item_once_into_the_same_chat_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = counting_items(monkeypatch)
    memory = ResponsesMemory()
    items = codex_items(140)  # 3 + 28 x (3 + 5 + 3 + 4 + 2) = 479 items
    ends = call_lengths(items)
    assert len(ends) > 300
    with_memory, whole = [], []
    for n in ends:
        calls[-1] = 0
        kept = translate_body(body(items[:n]), memory)
        with_memory.append(calls[-1])
        calls[-1] = 0
        alone = translate_body(body(items[:n]))
        whole.append(calls[-1])
        assert chat_text(kept) == chat_text(alone)
        assert kept.history_at == alone.history_at == 1
    # the first call's 3 items, then each call's new ones only (1 and 2 in turn); from
    # scratch every item: at call 200, 2 items against 3 + 100 x (1 + 2) = 303
    assert with_memory == [3] + [1 + i % 2 for i in range(len(ends) - 1)]
    assert whole == ends
    assert (with_memory[200], whole[200]) == (2, 303)


def test_a_rewritten_earlier_item_is_translated_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = ResponsesMemory()
    items = codex_items(12)
    translate_body(body(items[:40]), memory)
    rewritten = items[:42]
    rewritten[5]["output"] = "compacted"  # a tool output the agent shortened
    calls = counting_items(monkeypatch)
    translated = translate_body(body(rewritten), memory)
    assert calls == [42]
    assert chat_text(translated) == chat_text(translate_body(body(rewritten)))


def test_a_body_sent_again_translates_the_same_and_is_kept_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = ResponsesMemory()
    items = codex_items(10)
    n = next(n for n in call_lengths(items) if items[n - 1].get("content") and n > 3)
    assert items[n - 1]["type"] == "reasoning"
    calls = counting_items(monkeypatch)
    for _ in range(3):  # a client's retry: the same body is no continuation of itself
        calls[-1] = 0
        translated = translate_body(body(items[:n]), memory)
        assert calls == [n]
        assert chat_text(translated) == chat_text(translate_body(body(items[:n])))
    # its trailing reasoning became an assistant message of the answer, not of the kept state
    assert translated.chat_body["messages"][-1] == {
        "role": "assistant",
        "content": None,
        "reasoning": items[n - 1]["content"][0]["text"],
    }
    assert memory.held_bytes == 4 * len(orjson.dumps(items[:n]))
    calls[-1] = 0
    after = translate_body(body(items[: n + 2]), memory)  # the call after it resumes the state
    assert calls == [2]
    assert chat_text(after) == chat_text(translate_body(body(items[: n + 2])))


def test_a_kept_assistant_message_is_not_changed_by_a_call_that_adds_a_function_call() -> None:
    memory = ResponsesMemory()
    items = codex_items(2)  # exchange 1 opens with a text answer, then two calls
    answer = items[6]
    assert answer["role"] == "assistant" and items[7]["type"] == items[8]["type"] == "function_call"
    first = translate_body(body(items[:7]), memory)  # ends on the answer
    seen = chat_text(first)
    second = translate_body(body(items[:8]), memory)  # the answer's first call
    third = translate_body(body(items[:9]), memory)  # and its second
    # the earlier calls' bodies, and the state the memory keeps for them, are as they were
    assert chat_text(first) == seen
    assert first.chat_body["messages"][-1] == {
        "role": "assistant",
        "content": [answer_part(answer)],
    }
    assert len(second.chat_body["messages"][-1]["tool_calls"]) == 1
    assert len(third.chat_body["messages"][-1]["tool_calls"]) == 2
    for n, translated in ((7, first), (8, second), (9, third)):
        assert chat_text(translated) == chat_text(translate_body(body(items[:n])))


def answer_part(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "text", "text": item["content"][0]["text"]}


def test_a_refused_call_leaves_the_kept_state_as_it_was() -> None:
    # The refused call's function_call joins the kept answer before its next item fails; the
    # retry continues the same kept entry and must find the answer without that call.
    memory = ResponsesMemory()
    items = codex_items(2)
    translate_body(body(items[:7]), memory)  # ends on the answer
    with pytest.raises(InvalidRequestError):
        translate_body(body([*items[:8], {"type": "web_search_call"}]), memory)
    retried = translate_body(body(items[:9]), memory)
    assert [c["id"] for c in retried.chat_body["messages"][-1]["tool_calls"]] == [
        "call_1_0",
        "call_1_1",
    ]
    assert chat_text(retried) == chat_text(translate_body(body(items[:9])))


def test_a_bad_new_item_is_refused_as_without_memory_and_kept_nowhere() -> None:
    memory = ResponsesMemory()
    items = codex_items(140)
    translate_body(body(items[:300]), memory)
    held = memory.held_bytes
    bad = items[:402]
    bad[401] = message("user", "go on")
    bad[401]["content"][0]["text"] = 5
    for kept in (memory, None):
        with pytest.raises(InvalidRequestError) as caught:
            translate_body(body(bad), kept)
        assert caught.value.param == "input[401].content[0].text"
        assert caught.value.message == "'input[401].content[0].text' must be a string, got int"
    # a body whose input translates but whose tools do not raised too: kept nowhere either
    with pytest.raises(InvalidRequestError) as caught:
        translate_body(body(items[:302], tools=[{"type": "function"}]), memory)
    assert caught.value.param == "tools[0].name"
    assert memory.held_bytes == held
    fixed = translate_body(body(items[:302]), memory)  # still continues the 300 kept
    assert chat_text(fixed) == chat_text(translate_body(body(items[:302])))


def test_a_string_input_is_kept_nowhere() -> None:
    memory = ResponsesMemory()
    translated = translate_body(body("hi " * 400), memory)
    assert translated.chat_body["messages"][-1] == {"role": "user", "content": "hi " * 400}
    assert memory.held_bytes == 0


def test_instructions_and_an_earlier_response_are_no_part_of_what_is_kept() -> None:
    dialect = Responses()
    items = codex_items(6)
    earlier = EarlierResponse(
        request={"model": "tiny", "input": "first", "instructions": "old rules"},
        upstream_request={
            "messages": [
                {"role": "system", "content": "old rules"},
                {"role": "user", "content": "first"},
            ]
        },
        response_message={"role": "assistant", "content": "answer", "reasoning": "why"},
    )
    for n, instructions in ((20, "Be brief."), (22, "Be thorough.")):
        sent = body(items[:n], instructions=instructions, previous_response_id="resp_1")
        prepared = dialect.prepare_call(dialect.prepare(sent), "tiny", "step", earlier)
        alone = translate_request(sent, earlier)
        assert orjson.dumps(prepared.translation.chat_body) == chat_text(alone)
        messages = prepared.upstream_body["messages"]
        assert messages[0] == {"role": "system", "content": instructions}
        assert messages[1:3] == [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "answer", "reasoning": "why"},
        ]
    assert dialect.translations.held_bytes == 4 * len(orjson.dumps(items[:22]))


def test_codexs_recorded_request_translates_the_same_after_its_first_call() -> None:
    recorded = json.loads((DATA / "codex_request.json").read_text())
    memory = ResponsesMemory()
    translate_body({**recorded, "input": recorded["input"][:4]}, memory)
    assert memory.held_bytes > 0
    assert chat_text(translate_body(recorded, memory)) == chat_text(translate_body(recorded))
