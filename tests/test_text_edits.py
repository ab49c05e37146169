"""Edits of one text into another (``datapool.queries.edits``): how the trajectory view ships a
system message that changed in a few characters. Expected edits derived by hand."""

from __future__ import annotations

import random

import pytest

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
