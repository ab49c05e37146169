"""Each stage of ``build_rows`` alone, on hand-made steps and members (no database): what it
keeps, what it drops and counts, and the numbers it computes, derived by hand."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest

from datapool.batches import stages
from datapool.batches.rows import StepTokens
from datapool.batches.spec import BatchSpec
from datapool.batches.stages import Candidates, Group, Member, RowPlan
from datapool.curation.readiness import Verdict
from datapool.errors import InvalidPoolRequestError
from datapool.models import Step, Trajectory

EPS = 1e-6


def tokens(
    step_id: str,
    prompt: list[int],
    response: list[int],
    *,
    trajectory_id: str = "t",
    policy_version: int | None = 0,
) -> StepTokens:
    row = Step(id=step_id, trajectory_id=trajectory_id, policy_version=policy_version)
    return StepTokens(
        row,
        np.array(prompt, dtype=np.int32),
        np.array(response, dtype=np.int32),
        np.full(len(response), -0.5, dtype=np.float32),
    )


def verdict(trajectory_id: str, ready: bool = True, **fields: Any) -> Verdict:
    values: dict[str, Any] = {
        "group_id": None,
        "status": "complete",
        "reasons": [],
        "notes": [],
        "rewards": {"final": 1.0},
        "excluded_steps": {},
        **fields,
    }
    return Verdict(trajectory_id=trajectory_id, ready=ready, **values)


def candidates(
    trajectories: list[Trajectory],
    steps: list[StepTokens | Step],
    verdicts: list[Verdict],
    current_policy_version: int | None = None,
) -> Candidates:
    rows = [s.row if isinstance(s, StepTokens) else s for s in steps]
    return Candidates(
        trajectories=trajectories,
        steps=rows,
        verdicts={v.trajectory_id: v for v in verdicts},
        ready_ids={v.trajectory_id for v in verdicts if v.ready},
        tokens={s.row.id: s for s in steps if isinstance(s, StepTokens)},
        current_policy_version=current_policy_version,
    )


def member(trajectory_id: str, reward: float, *steps: StepTokens) -> Member:
    return Member(trajectory_id, list(steps), reward, {"final": reward})


def one_step(trajectory_id: str, reward: float, prompt_tokens: int, response_tokens: int) -> Member:
    prompt, response = list(range(prompt_tokens)), list(range(response_tokens))
    return member(trajectory_id, reward, tokens(f"{trajectory_id}-s", prompt, response))


def test_trainable_steps_leave_out_excluded_unreported_and_stale_steps_and_count_each() -> None:
    s1 = tokens("s1", [1], [2], policy_version=1)
    s2 = tokens("s2", [1, 2], [3], policy_version=5)
    s3 = Step(id="s3", trajectory_id="t", policy_version=5)  # the engine reported no ids
    s4 = tokens("s4", [1, 2, 3], [4], policy_version=4)
    s5 = tokens("s5", [1, 2, 3, 4], [5], policy_version=5)
    other = tokens("o1", [9], [9], trajectory_id="not-ready")
    found = candidates(
        [Trajectory(id="t"), Trajectory(id="not-ready")],
        [s1, s2, s3, s4, s5, other],
        [verdict("t", excluded_steps={"s2": "label"}), verdict("not-ready", ready=False)],
        current_policy_version=5,
    )
    counts: Counter[str] = Counter()
    spec = BatchSpec(max_staleness_versions=2)
    # stale: version < 5 - 2 = 3, so s1 (version 1) only; the not-ready trajectory is not looked at
    assert stages.trainable_steps(found, spec, counts) == {"t": [s4, s5]}
    assert counts == {"excluded_steps": 1, "steps_without_exact_ids": 1, "stale_steps": 1}


@pytest.mark.parametrize(
    ("policy_version", "current", "max_behind", "stale"),
    [
        (3, 5, 2, False),  # 3 < 5 - 2 = 3 is false: exactly K behind is kept
        (2, 5, 2, True),  # 2 < 3
        (None, 5, 2, False),  # unknown version: never stale
        (0, None, 2, False),  # no reference version: never stale
        (0, 5, None, False),  # no bound: never stale
    ],
)
def test_a_step_is_stale_only_when_more_than_k_versions_behind(
    policy_version: int | None, current: int | None, max_behind: int | None, stale: bool
) -> None:
    spec = BatchSpec(max_staleness_versions=max_behind)
    assert stages.is_stale(policy_version, spec, current) is stale


def test_not_ready_reasons_count_the_first_reason_of_each_trajectory_by_kind() -> None:
    found = candidates(
        [Trajectory(id="a"), Trajectory(id="b"), Trajectory(id="c"), Trajectory(id="d")],
        [],
        [
            verdict("a", ready=False, reasons=["unrewarded: final", "excluded by label #3 (ann)"]),
            verdict("b", ready=False, reasons=["excluded by label #3 (ann)"]),
            verdict("c", ready=False, reasons=["excluded by rule 'floor': -5.0 < min -1.0"]),
            verdict("d"),
        ],
    )
    assert stages.not_ready_reasons(found) == {
        "unrewarded": 1,
        "excluded by label #3": 1,
        "excluded by rule 'floor'": 1,
    }


def test_form_groups_weights_rewards_and_keeps_ungrouped_trajectories_alone() -> None:
    trajectories = [
        Trajectory(id="a", group_id="g"),
        Trajectory(id="solo", group_id=None),
        Trajectory(id="b", group_id="g"),
        Trajectory(id="empty", group_id="g"),
    ]
    both = {"final": 1.0, "judge": 2.0}
    found = candidates(
        trajectories,
        [],
        [
            verdict("a", rewards=both),
            verdict("solo", rewards={"final": 0.0, "judge": 4.0}),
            verdict("b", rewards={"final": 0.0, "judge": 0.0}),
            verdict("empty", rewards=both),
        ],
    )
    step = tokens("s", [1], [2])
    trainable = {"a": [step], "solo": [step], "b": [step]}  # "empty" has no trainable step
    spec = BatchSpec(reward_names=["final", "judge"], reward_weights={"judge": 0.5})
    counts: Counter[str] = Counter()
    groups = stages.form_groups(found, trainable, spec, counts)
    # R = 1 * final + 0.5 * judge: a 1 + 1 = 2.0, solo 0 + 2 = 2.0, b 0.0
    assert [(g.group_id, [(m.trajectory_id, m.reward) for m in g.members]) for g in groups] == [
        ("g", [("a", 2.0), ("b", 0.0)]),
        (None, [("solo", 2.0)]),
    ]
    assert counts == {"trajectories_without_trainable_steps": 1}
    # sft without reward names: R is NaN (never 0)
    sft = stages.form_groups(found, trainable, BatchSpec(algorithm="sft", reward_names=[]), counts)
    assert math.isnan(sft[0].members[0].reward)


def test_keep_groups_applies_group_size_drops_what_grpo_cannot_use_and_reports_each_group() -> None:
    step = tokens("s", [1], [2])
    groups = [
        Group("big", [member("b0", 1.0, step), member("b1", 0.0, step), member("b2", 1.0, step)]),
        Group("short", [member("s0", 1.0, step)]),
        Group("same", [member("c0", 0.5, step), member("c1", 0.5, step)]),
        Group(None, [member("solo", 1.0, step)]),
    ]
    counts: Counter[str] = Counter()
    kept, report = stages.keep_groups(groups, BatchSpec(algorithm="grpo", group_size=2), counts)
    # big keeps its two oldest members [1.0, 0.0]: mean 0.5, std sqrt((0.25 + 0.25) / 1) = 0.7071
    assert [(g.group_id, [m.trajectory_id for m in g.members]) for g in kept] == [
        ("big", ["b0", "b1"])
    ]
    assert counts == {
        "surplus_members_left": 1,
        "groups_mixed": 1,
        "short_groups_dropped": 1,
        "groups_constant": 1,  # [0.5, 0.5]: std 0, neither >= 1.0 nor <= 0.0
        "degenerate_groups_dropped": 1,
        "ungrouped_trajectories_dropped": 1,
    }
    big, same = report
    assert big["mean"] == 0.5 and big["std"] == pytest.approx(math.sqrt(0.5))
    assert big["members_in_batch"] == 2 and big["kind"] == "mixed" and not big["degenerate"]
    assert same["std"] == 0.0 and same["degenerate"] is True

    # reinforce_pp is not group-relative: the degenerate group and the ungrouped one stay
    kept, _ = stages.keep_groups(groups, BatchSpec(algorithm="reinforce_pp"), Counter())
    assert [g.group_id for g in kept] == ["big", "short", "same", None]
    assert [len(g.members) for g in kept] == [3, 1, 2, 1]


def test_keep_groups_shuffles_the_group_order_reproducibly() -> None:
    step = tokens("s", [1], [2])
    groups = [Group(f"g{i}", [member(f"t{i}", float(i % 2), step)]) for i in range(6)]
    spec = BatchSpec(algorithm="sft", shuffle_seed=7)
    first, _ = stages.keep_groups(groups, spec, Counter())
    again, _ = stages.keep_groups(groups, spec, Counter())
    expected = list(groups)
    np.random.default_rng(7).shuffle(expected)  # the same draw as the stage's
    assert [g.group_id for g in first] == [g.group_id for g in again]
    assert [g.group_id for g in first] == [g.group_id for g in expected]
    assert sorted(g.group_id or "" for g in first) == [f"g{i}" for i in range(6)]


def test_fit_token_budget_takes_whole_groups_until_the_next_does_not_fit() -> None:
    groups = [
        Group("a", [one_step("a0", 1.0, 3, 2), one_step("a1", 0.0, 3, 2)]),  # 5 + 5 = 10 tokens
        Group("b", [one_step("b0", 1.0, 2, 2)]),  # 4 tokens
        Group("c", [one_step("c0", 1.0, 1, 1)]),  # 2 tokens
        Group("d", [one_step("d0", 1.0, 1, 0)]),  # 1 token
    ]
    counts: Counter[str] = Counter()
    spec = BatchSpec(max_tokens_per_batch=14)
    # a: 10 <= 14 (4 left); b: 4 <= 4 (0 left); c: 2 > 0 stops, though d alone would not fit either
    fitted = stages.fit_token_budget(groups, spec, counts)
    assert [g.group_id for g in fitted] == ["a", "b"]
    assert counts == {"groups_over_batch_tokens": 2}  # c and d
    assert stages.fit_token_budget(groups, BatchSpec(), counts) == groups  # no budget: all


def test_score_gives_grpo_advantages_group_stats_and_pool_sizes() -> None:
    groups = [
        Group("g", [one_step("a", 1.0, 1, 1), one_step("b", 0.0, 1, 1)]),
        Group(None, [one_step("solo", 3.0, 1, 1)]),
    ]
    scores = stages.score(groups, BatchSpec(algorithm="grpo"), {"g": 4})
    # g: mean 0.5, std sqrt(0.5); A = ±0.5 / (sqrt(0.5) + eps)
    # solo, a group of one: std NaN counts as 0, A = (3 - 3) / (0 + eps) = 0
    a = 0.5 / (math.sqrt(0.5) + EPS)
    assert scores.advantage.tolist() == pytest.approx([a, -a, 0.0], abs=1e-12)
    assert scores.reward.tolist() == [1.0, 0.0, 3.0] and scores.group_index.tolist() == [0, 0, 1]
    assert scores.group_size.tolist() == [4, 1]  # g has 4 members in the pool, 2 in the batch
    assert scores.stats.scored_size.tolist() == [2, 1]
    assert scores.stats.mean.tolist() == [0.5, 3.0]
    assert scores.stats.std[0] == pytest.approx(math.sqrt(0.5)) and math.isnan(scores.stats.std[1])
    assert scores.stats.degenerate.tolist() == [False, True]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("broadcast", [("r0", 1.0), ("r1", 1.0), ("r2", 1.0)]),
        ("final_step", [("r2", 1.0)]),
        # S = 3, gamma 0.5: gamma^(3-1-k) = 0.25, 0.5, 1.0
        ("discounted", [("r0", 0.25), ("r1", 0.5), ("r2", 1.0)]),
    ],
)
def test_reward_shares_follow_reward_to_steps(mode: str, expected: list[tuple[str, float]]) -> None:
    assert stages.reward_shares(["r0", "r1", "r2"], mode, 0.5) == expected
    assert stages.reward_shares([], mode, 0.5) == []


def test_reward_shares_refuse_an_unknown_mode_listing_the_valid_ones() -> None:
    with pytest.raises(InvalidPoolRequestError, match=r"one of \('final_step'.*got 'last'"):
        stages.reward_shares(["r0"], "last", 1.0)


def test_discounted_rows_carry_their_share_of_reward_and_advantage() -> None:
    # three per_step rows of one trajectory, R = 2.0, sft (A = 1.0), gamma 0.5:
    # shares 0.25, 0.5, 1.0 -> step_reward 0.5, 1.0, 2.0 and advantage 0.25, 0.5, 1.0
    steps = [tokens(f"s{k}", [1] * (k + 1), [7, 8], policy_version=3 + k) for k in range(3)]
    groups = [Group(None, [member("t", 2.0, *steps)])]
    spec = BatchSpec(algorithm="sft", reward_to_steps="discounted", gamma=0.5)
    counts: Counter[str] = Counter()
    plan = stages.place_rewards(groups[0].members, spec, counts)
    assert plan.share == [0.25, 0.5, 1.0] and plan.segment_index == [0, 1, 2]
    assert counts == {"steps_over_row_tokens": 0}
    scores = stages.score(groups, spec, {})
    credit = stages.credit_steps(plan, groups, groups[0].members, scores, spec)
    rows = stages.assemble_table(plan, groups, groups[0].members, scores, credit, spec).to_pylist()
    assert [r["step_reward"] for r in rows] == [0.5, 1.0, 2.0]
    assert [r["advantage"] for r in rows] == [0.25, 0.5, 1.0]
    assert [r["reward"] for r in rows] == [2.0, 2.0, 2.0]
    assert [r["input_ids"] for r in rows] == [[1, 7, 8], [1, 1, 7, 8], [1, 1, 1, 7, 8]]
    assert [r["loss_mask"] for r in rows] == [[0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1, 1]]
    assert [r["policy_version"] for r in rows] == [3, 4, 5]
    assert {r["group_id"] for r in rows} == {None} and rows[0]["group_size"] == 1


def test_place_rewards_drops_a_step_over_the_row_cap_and_counts_it() -> None:
    long = tokens("long", [1, 2, 3, 4], [5, 6])  # 6 tokens
    short = tokens("short", [1], [2])  # 2 tokens
    spec = BatchSpec(algorithm="sft", max_tokens_per_row=5)
    counts: Counter[str] = Counter()
    plan = stages.place_rewards([member("t", 1.0, long, short)], spec, counts)
    assert plan.segments == [[short]] and plan.member == [0]
    assert counts == {"steps_over_row_tokens": 1}


def test_shuffle_rows_moves_every_field_of_a_row_together() -> None:
    steps = [[tokens(f"s{i}", [1], [2])] for i in range(5)]
    plan = RowPlan(steps, [0, 1, 2, 3, 4], [0.0, 0.1, 0.2, 0.3, 0.4], [10, 11, 12, 13, 14])
    assert stages.shuffle_rows(plan, None) is plan
    shuffled = stages.shuffle_rows(plan, 3)
    order = np.random.default_rng(3).permutation(5).tolist()  # the stage's draw
    assert shuffled.member == order
    assert shuffled.share == [i / 10 for i in order]
    assert shuffled.segment_index == [10 + i for i in order]
    assert [seg[0].row.id for seg in shuffled.segments] == [f"s{i}" for i in order]
