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
    candidates = [Candidate("c", [9]), Candidate("a", [1, 2]), Candidate("b", [1, 2, 3, 4])]
    assert choose_parent(candidates, [1, 2, 3, 4, 5]) == Lineage("b", True, None)


def test_prompt_extending_an_earlier_step_but_not_the_latest_is_a_hidden_break() -> None:
    # Turn 0 S=[1,2,3]; turn 1 (P=[1,2,3,4], R=[7,8]) had reasoning the template strips, so
    # turn 2's prompt [1,2,3,4,9] extends turn 0 but leaves turn 1's S=[1,2,3,4,7,8] at 4.
    turn0 = Candidate("t0", [1, 2, 3], prompt_length=2, lineage=Lineage(None, None, None))
    turn1 = Candidate("t1", [1, 2, 3, 4, 7, 8], prompt_length=4, lineage=Lineage("t0", True, None))
    lineage = choose_parent([turn0, turn1], [1, 2, 3, 4, 9])
    assert lineage == Lineage("t0", True, 4, diverges_from="t1")
    assert lineage.is_break


def test_prompt_extending_another_choice_of_the_latest_call_is_no_break() -> None:
    # One call, n=2: the agent goes on from choice 0 ([1,2,5]), not the later choice 1.
    choice0 = Candidate("c0", [1, 2, 5], prompt_length=2, call=0)
    choice1 = Candidate("c1", [1, 2, 6], prompt_length=2, call=0)
    lineage = choose_parent([choice0, choice1], [1, 2, 5, 3])
    assert lineage == Lineage("c0", True, None) and not lineage.is_break


def test_prompt_extending_the_first_answer_after_a_resend_is_no_break_like_a_choice_of_n() -> None:
    # Call 0 answered [1,2] with 5; an identical re-send (call 1) with 6. The agent goes on from
    # the first answer ([1,2,5]): the same case as going on from choice 0 of n=2 above.
    first = Candidate("f", [1, 2, 5], prompt_length=2, call=0, lineage=Lineage(None, None, None))
    resend = choose_parent([first], [1, 2])
    again = Candidate("a", [1, 2, 6], prompt_length=2, call=1, lineage=resend)
    lineage = choose_parent([first, again], [1, 2, 5, 3])
    assert lineage == Lineage("f", True, None) and not lineage.is_break


def test_the_same_prompt_again_is_a_fork_with_its_twins_lineage_not_a_break() -> None:
    root = Candidate("r", [1, 2, 3], prompt_length=2, lineage=Lineage(None, None, None))
    turn1 = Candidate("t1", [1, 2, 3, 4, 5], prompt_length=4, lineage=Lineage("r", True, None))
    # A re-send of the root's request: a second root, not a break from t1.
    again = choose_parent([root, turn1], [1, 2])
    assert again == Lineage(None, None, None, fork_of="r") and not again.is_break
    # A re-send of turn 1's request: t1's sibling under r.
    again = choose_parent([root, turn1], [1, 2, 3, 4])
    assert again == Lineage("r", True, None, fork_of="t1") and not again.is_break
    # A re-send of a step that was itself a break repeats its lineage, without a second break.
    broken = Candidate("b", [1, 9, 8], prompt_length=2, lineage=Lineage("t1", False, 1))
    again = choose_parent([root, turn1, broken], [1, 9])
    assert again == Lineage("t1", False, 1, fork_of="b") and not again.is_break


def test_no_extended_step_links_to_the_latest_with_its_divergence() -> None:
    candidates = [Candidate("a", [1, 2]), Candidate("b", [1, 2, 3, 4])]
    # [1, 5, ...] leaves both at offset 1; the latest ("b") is the parent.
    assert choose_parent(candidates, [1, 5, 6]) == Lineage("b", False, 1)


def test_first_step_of_a_trajectory_has_no_parent() -> None:
    assert choose_parent([], [1, 2]) == Lineage(None, None, None)
