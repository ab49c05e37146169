"""Token lineage between steps (case C01): extends or breaks, and where."""

from __future__ import annotations

from datapool.steps.prefix import Candidate, Lineage, choose_parent, first_divergence


def test_prompt_that_starts_with_the_sequence_extends_it() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3, 4, 5]) is None
    assert first_divergence([], [7]) is None


def test_first_differing_token_is_the_divergence_offset() -> None:
    # index: 0 1 2 ; position 2 differs (3 vs 9)
    assert first_divergence([1, 2, 3], [1, 2, 9, 4]) == 2


def test_prompt_shorter_than_the_sequence_diverges_where_it_ends() -> None:
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_parent_is_the_longest_extended_earlier_step() -> None:
    candidates = [Candidate("a", [1, 2]), Candidate("b", [1, 2, 3, 4]), Candidate("c", [9])]
    assert choose_parent(candidates, [1, 2, 3, 4, 5]) == Lineage("b", True, None)


def test_no_extended_step_links_to_the_latest_with_its_divergence() -> None:
    candidates = [Candidate("a", [1, 2]), Candidate("b", [1, 2, 3, 4])]
    # [1, 5, ...] leaves both at offset 1; the latest ("b") is the parent.
    assert choose_parent(candidates, [1, 5, 6]) == Lineage("b", False, 1)


def test_first_step_of_a_trajectory_has_no_parent() -> None:
    assert choose_parent([], [1, 2]) == Lineage(None, None, None)
