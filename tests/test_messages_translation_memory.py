"""The Messages dialect's memory of recent translations (``gateway.dialects.translation_memory``):
a call that re-sends its history gets the very chat body a translation from scratch gives,
while only its new messages are translated."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.dialects.messages import request
from gateway.dialects.messages.request import translate_request
from gateway.dialects.translation_memory import ENTRIES_PER_KEY, TranslationMemory
from gateway.errors import InvalidRequestError

DATA = Path(__file__).parent / "data"
SYSTEM = [{"type": "text", "text": "You are a coding agent."}]


TASK = "Fix the failing test in tests/test_parser.py. " * 12  # longer than KEY_BYTES (512)


def turn_messages(turn: int, task: str = TASK) -> list[dict[str, Any]]:
    """A Claude Code-shaped history of ``turn`` exchanges: blocks, tool_use and tool_result,
    thinking, a string content now and then."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    for k in range(turn):
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": f"step {k}", "signature": "s"},
                    {"type": "text", "text": f"Reading file {k}."},
                    {"type": "tool_use", "id": f"toolu_{k}", "name": "Read", "input": {"n": k}},
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{k}", "content": f"line {k}"},
                    {"type": "text", "text": "go on"},
                ],
            }
        )
    return messages


def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    # parsed again, as every call's body is: no object is shared with an earlier call's
    parsed: dict[str, Any] = orjson.loads(
        orjson.dumps({"model": "tiny", "max_tokens": 16, "system": SYSTEM, "messages": messages})
    )
    return parsed


def counting_translations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of Messages messages ``_message`` translates, call by call."""
    calls: list[int] = [0]
    original = request._message

    def counted(message: Any, param: str) -> list[dict[str, Any]]:
        calls[-1] += 1
        return original(message, param)

    monkeypatch.setattr(request, "_message", counted)
    return calls


def test_a_session_translates_each_new_message_once_into_the_same_chat_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = counting_translations(monkeypatch)
    memory = TranslationMemory()
    with_memory, whole = [], []
    for turn in range(12):
        calls[-1] = 0
        kept = translate_request(body(turn_messages(turn)), memory=memory).chat_body
        with_memory.append(calls[-1])
        calls[-1] = 0
        alone = translate_request(body(turn_messages(turn))).chat_body
        whole.append(calls[-1])
        assert orjson.dumps(kept) == orjson.dumps(alone)
    # turn 0 has one message; each later turn adds an assistant and a user message: 2
    # translated with the memory, 1 + 2t without it
    assert with_memory == [1] + [2] * 11
    assert whole == [1 + 2 * t for t in range(12)]


def test_a_rewritten_earlier_message_is_translated_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = TranslationMemory()
    translate_request(body(turn_messages(5)), memory=memory)
    rewritten = turn_messages(6)
    rewritten[4]["content"][0]["content"] = "line 1, edited"  # a tool result the agent compacted
    calls = counting_translations(monkeypatch)
    chat = translate_request(body(rewritten), memory=memory).chat_body
    assert calls == [len(rewritten)]
    assert chat == translate_request(body(rewritten)).chat_body
    assert chat["messages"][6] == {"role": "tool", "tool_call_id": "1", "content": "line 1, edited"}


def test_rollouts_of_one_task_each_continue_their_own_history(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = TranslationMemory()
    rollouts = [turn_messages(3) for _ in range(ENTRIES_PER_KEY)]
    for r, messages in enumerate(rollouts):
        messages[-1]["content"][1]["text"] = f"rollout {r}"  # same task, histories part here
        translate_request(body(messages), memory=memory)
    calls = counting_translations(monkeypatch)
    counts = []
    for r, messages in enumerate(rollouts):
        messages.append({"role": "assistant", "content": f"done {r}"})
        messages.append({"role": "user", "content": "thanks"})
        chats = []
        for kept in (memory, None):
            calls[-1] = 0
            chats.append(translate_request(body(messages), memory=kept).chat_body)
            counts.append(calls[-1])
        assert chats[0] == chats[1]
    # each rollout found its own entry: 2 new messages translated with the memory, then the
    # whole history (9 messages) without it, per rollout
    assert counts == [2, 9] * ENTRIES_PER_KEY


def test_a_bad_new_message_is_refused_as_without_memory() -> None:
    memory = TranslationMemory()
    translate_request(body(turn_messages(2)), memory=memory)
    bad = turn_messages(3)
    bad[-1]["content"][0] = {"type": "image", "source": {}}
    for kept in (memory, None):
        with pytest.raises(InvalidRequestError) as caught:
            translate_request(body(bad), memory=kept)
        assert caught.value.param == "messages.6.content.0.type"


def test_claude_codes_recorded_request_translates_the_same_after_its_first_turn() -> None:
    recorded = json.loads((DATA / "claude_code_request.json").read_text())
    first = {**recorded, "messages": recorded["messages"][:1]}
    memory = TranslationMemory()
    translate_request(first, memory=memory)
    assert translate_request(recorded, memory=memory).chat_body == (
        translate_request(recorded).chat_body
    )


def test_a_body_sent_again_is_kept_once() -> None:
    memory = TranslationMemory()
    for _ in range(3):  # a client's retry of the same call
        translate_request(body(turn_messages(4)), memory=memory)
    assert memory.held_bytes == 4 * len(orjson.dumps(turn_messages(4)))


def test_a_history_no_longer_than_the_key_is_not_kept() -> None:
    memory = TranslationMemory()
    translate_request(body(turn_messages(0, task="short")), memory=memory)
    assert memory.held_bytes == 0


def test_memory_stays_within_its_bytes() -> None:
    memory = TranslationMemory(max_bytes=200_000)
    for task in range(40):
        translate_request(body(turn_messages(20, task=f"{task} {TASK}")), memory=memory)
        assert memory.held_bytes <= 200_000
    assert memory.held_bytes > 0


def _rollouts(count: int) -> list[list[dict[str, Any]]]:
    """``count`` sessions of one task, parting at their last message."""
    rollouts = [turn_messages(3) for _ in range(count)]
    for r, messages in enumerate(rollouts):
        messages[-1]["content"][1]["text"] = f"rollout {r}"
    return rollouts


def _continued(
    memory: TranslationMemory[None], rollouts: list[list[dict[str, Any]]], calls: list[int]
) -> list[int]:
    """Each rollout's next call through ``memory``: the messages each one translated."""
    counts = []
    for r, messages in enumerate(rollouts):
        messages += [
            {"role": "assistant", "content": f"done {r}"},
            {"role": "user", "content": "thanks"},
        ]
        calls[-1] = 0
        chat = translate_request(body(messages), memory=memory).chat_body
        counts.append(calls[-1])
        assert chat == translate_request(body(messages)).chat_body
    return counts


def test_over_its_bytes_the_memory_drops_the_least_recent_entry_not_its_whole_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sessions sharing a head share a group: a memory full of them drops one entry at a time
    (before, the whole group went, so every session translated whole)."""
    rollouts = _rollouts(4)
    entry_bytes = 4 * len(orjson.dumps(rollouts[0]))
    memory = TranslationMemory(max_bytes=3 * entry_bytes + 10)  # three of the four
    for messages in rollouts:
        translate_request(body(messages), memory=memory)
    assert memory.held_bytes == 3 * entry_bytes
    calls = counting_translations(monkeypatch)
    # the latest continue (each grown entry then pushes the least recent out); the first,
    # dropped when the fourth came, translates whole
    later_first = [rollouts[3], rollouts[2], rollouts[0]]
    assert _continued(memory, later_first, calls) == [2, 2, 9]
