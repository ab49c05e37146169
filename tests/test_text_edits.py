"""Edits of one text into another (``datapool.queries.edits``), and the trajectory view's use
of them (``conversation_deltas``): a system message that changed in a few characters is sent as
those characters, and rebuilds exactly. Expected edits derived by hand."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from datapool.models import Step
from datapool.queries.conversation import conversation_deltas
from datapool.queries.edits import apply_edits, text_edits


def test_equal_texts_need_no_edit() -> None:
    assert text_edits("cch=abcde;", "cch=abcde;") == []


def test_a_text_changed_in_one_place_is_one_edit_of_the_characters_that_differ() -> None:
    # "cch=abc" (7 characters) and ";" are shared: characters 7 and 8, "de", become "f1".
    assert text_edits("cch=abcde;", "cch=abcf1;") == [[7, 9, "f1"]]
    # Appended, then cut: an edit at the end, then one that inserts nothing.
    assert text_edits("ab", "abcd") == [[2, 2, "cd"]]
    assert text_edits("abcd", "ab") == [[2, 4, ""]]


def test_a_text_changed_in_two_far_places_is_two_edits_not_one_spanning_both() -> None:
    filler = "filler words here. " * 10  # 190 characters shared between the changes
    base = "one. " + filler + "two."  # "two" at 5 + 190 = 195 to 198
    text = "ONE. " + filler + "TWO."
    assert text_edits(base, text) == [[0, 3, "ONE"], [195, 198, "TWO"]]


def test_edits_rebuild_the_text_exactly_for_any_pair() -> None:
    rng = random.Random(7)
    alphabet = ["a", "b", ". ", ", ", "\\n", "é", "\U0001f600", "x" * 30]
    for _ in range(3000):
        base = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        chars = list(base)
        for _ in range(rng.randint(0, 4)):
            at = rng.randint(0, len(chars))
            chars[at : at + rng.randint(0, 5)] = rng.choice(alphabet)
        text = "".join(chars)
        edits = text_edits(base, text)
        assert apply_edits(base, edits) == text, (base, text, edits)
        starts = [e[0] for e in edits]
        assert starts == sorted(starts)


def test_edits_out_of_order_or_past_the_end_are_refused() -> None:
    with pytest.raises(ValueError, match="out of order"):
        apply_edits("abcdef", [[3, 4, "x"], [1, 2, "y"]])
    with pytest.raises(ValueError, match="past 6 characters"):
        apply_edits("abcdef", [[5, 9, "x"]])


# The trajectory view's use of them: a replaced system message as edits of a text sent once.
PROMPT = "Read before you edit; run the tests that cover a change. " * 40  # 2,320 characters
OTHER = "Plan first, then write the plan to PLAN.md before any edit. " * 40


def system(cch: int, prompt: str = PROMPT) -> dict[str, Any]:
    return {"role": "system", "content": f"x-billing: cch={cch:05x};\n{prompt}"}


def answer(turn: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"answer {turn}"}


def chain(systems: list[dict[str, Any]]) -> list[Step]:
    """Steps of one conversation: turn t sends ``systems[t]``, the task, then each earlier
    answer and a user reply to it; its response is ``answer(t)``."""
    rows: list[Step] = []
    for turn, first in enumerate(systems):
        messages = [first, {"role": "user", "content": "task"}]
        for k in range(turn):
            messages += [answer(k), {"role": "user", "content": f"reply {k}"}]
        rows.append(
            Step(
                id=f"s{turn}",
                parent_step_id=f"s{turn - 1}" if turn else None,
                canonical={"messages": messages},
                response_message=answer(turn),
            )
        )
    return rows


def rebuilt(rows: list[Step]) -> list[list[Any]]:
    """Each step's messages from the view's fields alone (docs/inspector.md)."""
    deltas, _, texts = conversation_deltas(rows)
    full: dict[str, list[Any]] = {}
    for row in rows:
        delta = deltas[row.id]
        head = (
            [*full[row.parent_step_id], answer(int(row.parent_step_id[1:]))]
            if row.parent_step_id
            else []
        )
        heads = [json.loads(apply_edits(texts[h["text"]], h["edits"])) for h in delta["head_edits"]]
        covered = head[delta["messages_replaced"] : delta["messages_base"]]
        full[row.id] = [*heads, *covered, *delta["messages_added"]]
    return [full[row.id] for row in rows]


def test_a_system_message_that_changes_by_its_cch_is_one_edit_of_the_first_ones_text() -> None:
    rows = chain([system(t) for t in range(4)])
    deltas, _, texts = conversation_deltas(rows)
    # Step 0's system message is shipped in its messages and, once, as the text the others edit.
    assert texts == {"h0": json.dumps(system(0))}
    # Its JSON text: '{"role": "system", "content": "x-billing: cch=' is 46 characters, then the
    # 5 hex digits, of which turn 1's (00001) and turn 3's (00003) differ from 00000 in the last.
    assert [deltas[f"s{t}"]["head_edits"] for t in (1, 3)] == [
        [{"text": "h0", "edits": [[50, 51, "1"]]}],
        [{"text": "h0", "edits": [[50, 51, "3"]]}],
    ]
    assert [deltas[f"s{t}"]["messages_added"] for t in (1, 2)] == [
        [{"role": "user", "content": "reply 0"}],
        [{"role": "user", "content": "reply 1"}],
    ]
    assert json.dumps(rebuilt(rows)) == json.dumps([row.canonical["messages"] for row in rows])


def test_a_system_message_that_really_changed_is_sent_whole_once_and_then_edited() -> None:
    rows = chain([system(0), system(1), system(2, OTHER), system(3, OTHER), system(4)])
    deltas, _, texts = conversation_deltas(rows)
    # Turn 2's prompt shares little with h0: its own text becomes h1, which turn 3 edits; turn 4
    # went back, but its predecessor is h1's, so it is sent whole as h2 (a step edits the text
    # its predecessor came from, never a chain of steps).
    assert texts == {
        "h0": json.dumps(system(0)),
        "h1": json.dumps(system(2, OTHER)),
        "h2": json.dumps(system(4)),
    }
    assert [deltas[f"s{t}"]["head_edits"][0]["text"] for t in range(1, 5)] == [
        "h0",
        "h1",
        "h1",
        "h2",
    ]
    assert deltas["s2"]["head_edits"][0]["edits"] == []
    assert json.dumps(rebuilt(rows)) == json.dumps([row.canonical["messages"] for row in rows])
