"""Step-level credit: the step-level estimators on numpy, the anchor sub-groups of hand-made
rollouts, and step rewards through readiness into rows on a real pool (SQLite and PostgreSQL).
Every expected value is derived by hand in the comment beside it."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path
from typing import get_args

import numpy as np
import pyarrow.parquet as pq
import pytest
from batch_helpers import agent_turns, call, make_store, write_trajectory
from pydantic import ValidationError

from datapool.batches import stages
from datapool.batches.build import NothingToBatchError, build_rows, materialise, read_rows
from datapool.batches.exports import export_batch
from datapool.batches.rows import StepTokens
from datapool.batches.settings import BatchSettings
from datapool.batches.spec import BatchSpec
from datapool.batches.stages import Group, Member
from datapool.batches.step_advantages import (
    STEP_ALGORITHMS,
    STEP_ESTIMATORS,
    StepParams,
    StepRows,
    anchor_state_advantages,
    discounted_step_returns,
    step_return_advantages,
)
from datapool.curation.readiness import trajectory_readiness
from datapool.lifecycle.transitions import close_trajectory
from datapool.models import Step, TrajectoryStatus
from datapool.rewards.values import RewardIn, add_rewards
from datapool.settings import PoolSettings
from gateway.dialects.chat_completions import ChatCompletions


def params(normalisation: str = "none", gamma: float = 1.0, scale: bool = False) -> StepParams:
    return StepParams(gamma, normalisation, scale, 1e-6)  # type: ignore[arg-type]


def rows(
    trajectory: list[int],
    position: list[int],
    group: list[int],
    reward: list[float],
    outcome: list[float] | None = None,
    anchor: list[int] | None = None,
) -> StepRows:
    b = len(trajectory)
    return StepRows(
        np.array(trajectory),
        np.array(position),
        np.array(group),
        np.array(reward, dtype=np.float64),
        np.array(outcome if outcome is not None else [math.nan] * b, dtype=np.float64),
        np.array(anchor if anchor is not None else [0] * b),
    )


def test_every_step_algorithm_but_none_is_registered() -> None:
    assert set(STEP_ESTIMATORS) == set(STEP_ALGORITHMS) - {"none"}
    assert set(get_args(BatchSpec.model_fields["step_advantage"].annotation)) == set(
        STEP_ALGORITHMS
    )


def test_discounted_step_returns_sum_the_following_rewards_within_each_trajectory() -> None:
    # t0 rows at positions 2, 0, 1 hold rewards 3, 1, 2; t1 one row of 5; gamma 0.5:
    # G_0 = 1 + 0.5*2 + 0.25*3 = 2.75, G_1 = 2 + 0.5*3 = 3.5, G_2 = 3; t1: 5
    returns = discounted_step_returns(
        np.array([3.0, 1.0, 5.0, 2.0]), np.array([0, 0, 1, 0]), np.array([2, 0, 0, 1]), 0.5
    )
    assert returns.tolist() == [3.0, 2.75, 5.0, 3.5]
    with pytest.raises(ValueError, match="gamma must be in"):
        discounted_step_returns(np.zeros(1), np.zeros(1, int), np.zeros(1, int), 1.5)


def test_step_returns_with_group_normalisation_follow_deepseekmath_process_supervision() -> None:
    # one group: t0 rewards [1, 0], t1 [0, 0, 1]; mean 0.4, so centred r~ = [0.6, -0.4 |
    # -0.4, -0.4, 0.6]; gamma 1: t0 G = [0.2, -0.4], t1 G = [-0.2, 0.2, 0.6]
    step_rows = rows([0, 0, 1, 1, 1], [0, 1, 0, 1, 2], [0] * 5, [1, 0, 0, 0, 1])
    credit = step_return_advantages(step_rows, params("group"))
    np.testing.assert_allclose(credit.step_advantage, [0.2, -0.4, -0.2, 0.2, 0.6], atol=1e-12)
    # with the std: unbiased var = (2*0.36 + 3*0.16) / 4 = 0.3, so r~ = 0.6/sqrt(0.3) ... and
    # t0's G_0 = (0.6 - 0.4) / sqrt(0.3) = 0.36515
    scaled = step_return_advantages(step_rows, params("group", scale=True))
    assert scaled.step_advantage[0] == pytest.approx(0.2 / math.sqrt(0.3), rel=1e-5)


def test_step_returns_with_leave_one_out_baseline_follow_prime() -> None:
    # group 0: t0 [1, 0] (mean 0.5), t1 [0.5, 0] (mean 0.25), t2 [1] (mean 1.0); baselines
    # (mean of the others' means): t0 (0.25+1)/2 = 0.625, t1 (0.5+1)/2 = 0.75, t2 0.375;
    # r~: t0 [0.375, -0.625], t1 [-0.25, -0.75], t2 [0.625]; gamma 1 returns:
    # t0 [-0.25, -0.625], t1 [-1.0, -0.75], t2 [0.625]. Group 1 has one rollout: no baseline.
    step_rows = rows(
        [0, 0, 1, 1, 2, 3], [0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1], [1, 0, 0.5, 0, 1, 0.7]
    )
    credit = step_return_advantages(step_rows, params("leave_one_out"))
    np.testing.assert_allclose(credit.step_advantage[:5], [-0.25, -0.625, -1.0, -0.75, 0.625])
    assert math.isnan(credit.step_advantage[5])  # NaN, never 0: no other rollout to compare


def test_a_leave_one_out_baseline_of_huge_step_rewards_does_not_overflow() -> None:
    # one step each, rewards [1.5, 1.5, 0.5] x 1e308 (K mean = 3.5e308 came out inf):
    # baselines (1.5 + 0.5)/2 = 1.0, 1.0, (1.5 + 1.5)/2 = 1.5, so r~ = [0.5, 0.5, -1.0] x 1e308
    step_rows = rows([0, 1, 2], [0, 0, 0], [0, 0, 0], [1.5e308, 1.5e308, 0.5e308])
    credit = step_return_advantages(step_rows, params("leave_one_out"))
    np.testing.assert_allclose(credit.step_advantage, [0.5e308, 0.5e308, -1e308], rtol=1e-12)


def test_anchor_state_advantages_compare_returns_within_each_sub_group() -> None:
    # GiGPO, gamma 0.5, outcome only (no step reward named): R = 1, 0, 1.
    # t0 states A, B; t1 A, B, C; t2 A, D. Returns gamma^(S-1-k) R: t0 [0.5, 1], t1 [0, 0, 0],
    # t2 [0.5, 1]. Sub-group A {0.5, 0, 0.5}: mean 1/3 -> [1/6, -1/3, 1/6]; B {1, 0}: mean
    # 0.5 -> [0.5, -0.5]; C and D alone -> 0.
    step_rows = rows(
        trajectory=[0, 0, 1, 1, 1, 2, 2],
        position=[0, 1, 0, 1, 2, 0, 1],
        group=[0] * 7,
        reward=[math.nan] * 7,
        outcome=[1, 1, 0, 0, 0, 1, 1],
        anchor=[0, 1, 0, 1, 2, 0, 3],
    )
    credit = anchor_state_advantages(step_rows, params(gamma=0.5))
    np.testing.assert_allclose(credit.step_return, [0.5, 1, 0, 0, 0, 0.5, 1])
    np.testing.assert_allclose(
        credit.step_advantage, [1 / 6, 0.5, -1 / 3, -0.5, 0, 1 / 6, 0], atol=1e-12
    )
    assert credit.anchor_group_size.tolist() == [3, 2, 3, 2, 1, 3, 1]
    # with the std (unbiased): A's std = sqrt((1/36 + 1/9 + 1/36) / 2) = sqrt(1/12) = 0.288675,
    # so t0's first step gets (1/6) / 0.288675 = 0.57735; B's std sqrt(0.5): 0.5 / 0.70711
    scaled = anchor_state_advantages(step_rows, params(gamma=0.5, scale=True))
    assert scaled.step_advantage[0] == pytest.approx(1 / 6 / math.sqrt(1 / 12), rel=1e-5)
    assert scaled.step_advantage[1] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)


def test_anchor_state_returns_add_the_named_step_rewards_to_the_outcome() -> None:
    # one trajectory, step rewards [0.2, 0.4], R = 1 on the last step, gamma 1:
    # G = [0.2 + 0.4 + 1, 0.4 + 1] = [1.6, 1.4]
    credit = anchor_state_advantages(
        rows([0, 0], [0, 1], [0, 0], [0.2, 0.4], [1, 1], [0, 1]), params()
    )
    np.testing.assert_allclose(credit.step_return, [1.6, 1.4])


def test_a_spec_refuses_step_credit_it_cannot_build_with_the_fix() -> None:
    with pytest.raises(ValidationError, match="layout must be 'per_step'"):
        BatchSpec(step_reward_names=["prm"], layout="merged")
    with pytest.raises(ValidationError, match="reward_to_steps must be 'broadcast'"):
        BatchSpec(step_advantage="anchor_state", reward_to_steps="discounted")
    with pytest.raises(ValidationError, match="needs at least one step reward name"):
        BatchSpec(step_advantage="step_returns")
    with pytest.raises(ValidationError, match="not in step_reward_names"):
        BatchSpec(step_reward_names=["prm"], step_reward_weights={"judge": 2.0})
    with pytest.raises(ValidationError, match="'sft' uses none"):
        BatchSpec(algorithm="sft", step_advantage="anchor_state")


def _tokens(step_id: str, trajectory_id: str, prompt: list[int], response: list[int]) -> StepTokens:
    return StepTokens(
        Step(id=step_id, trajectory_id=trajectory_id, policy_version=0),
        np.array(prompt, dtype=np.int32),
        np.array(response, dtype=np.int32),
        np.full(len(response), -0.5, dtype=np.float32),
    )


def test_rows_of_rollouts_that_revisit_a_state_share_an_anchor_and_combine_both_advantages() -> (
    None
):
    # The GiGPO case above as rollouts: every first prompt is the task [1, 2, 3] (the task
    # prefix), t0 and t1 both answer 10 and see tool result 20 (state B), t1 goes on (C), t2
    # answers 12 and sees 22 (D). grpo without std: R = [1, 0, 1], mean 2/3, A^E = [1/3, -2/3,
    # 1/3]; A = A^E + A^S: t0 [1/3 + 1/6, 1/3 + 1/2] = [0.5, 0.8333], t1 [-2/3 - 1/3, -2/3 - 1/2,
    # -2/3] = [-1, -1.1667, -0.6667], t2 [1/3 + 1/6, 1/3 + 0] = [0.5, 0.3333]
    task = [1, 2, 3]
    t0 = [_tokens("t0-0", "t0", task, [10]), _tokens("t0-1", "t0", [*task, 10, 20], [30])]
    t1 = [
        _tokens("t1-0", "t1", task, [10]),
        _tokens("t1-1", "t1", [*task, 10, 20], [11]),
        _tokens("t1-2", "t1", [*task, 10, 20, 11, 21], [31]),
    ]
    t2 = [_tokens("t2-0", "t2", task, [12]), _tokens("t2-1", "t2", [*task, 12, 22], [32])]
    members = [
        Member("t0", t0, 1.0, {"final": 1.0}),
        Member("t1", t1, 0.0, {"final": 0.0}),
        Member("t2", t2, 1.0, {"final": 1.0}),
    ]
    groups = [Group("task", members)]
    spec = BatchSpec(step_advantage="anchor_state", gamma=0.5, scale_by_std=False)
    plan = stages.place_rewards(members, spec, Counter())
    scores = stages.score(groups, spec, {"task": 3})
    credit = stages.credit_steps(plan, groups, members, scores, spec)
    table = stages.assemble_table(plan, groups, members, scores, credit, spec).to_pylist()
    by_step = {r["step_ids"][0]: r for r in table}
    expected = {
        "t0-0": 0.5,
        "t0-1": 1 / 3 + 0.5,
        "t1-0": -1.0,
        "t1-1": -2 / 3 - 0.5,
        "t1-2": -2 / 3,
        "t2-0": 0.5,
        "t2-1": 1 / 3,
    }
    for step_id, advantage in expected.items():
        assert by_step[step_id]["advantage"] == pytest.approx(advantage), step_id
    assert by_step["t1-2"]["episode_advantage"] == pytest.approx(-2 / 3)
    assert by_step["t0-1"]["step_advantage"] == pytest.approx(0.5)
    assert by_step["t0-1"]["anchor_key"] == by_step["t1-1"]["anchor_key"]
    assert by_step["t0-0"]["anchor_key"] == by_step["t2-0"]["anchor_key"]
    assert by_step["t2-1"]["anchor_key"] != by_step["t0-1"]["anchor_key"]
    assert [by_step[s]["anchor_group_size"] for s in expected] == [3, 2, 3, 2, 1, 3, 1]
    anchor = credit.report["anchor"]
    assert anchor["steps_in_subgroups"] == 5 and anchor["steps_alone"] == 2
    assert anchor["subgroups"] == 2 and anchor["subgroup_sizes"] == {"2": 1, "3": 1}
    listed = {len(s["steps"]) for s in anchor["subgroups_listed"]}
    assert listed == {2, 3} and anchor["subgroups_listed"][0]["group_id"] == "task"
    # step-level alone, doubled: A = 0 * A^E + 2 * A^S (t0's second step: 2 * 0.5 = 1.0)
    alone = spec.model_copy(update={"episode_advantage_weight": 0.0, "step_advantage_weight": 2.0})
    credit = stages.credit_steps(plan, groups, members, scores, alone)
    table = stages.assemble_table(plan, groups, members, scores, credit, alone).to_pylist()
    assert [r["advantage"] for r in table] == pytest.approx(
        [2 * r["step_advantage"] for r in table]
    )
    assert {r["step_ids"][0]: r["advantage"] for r in table}["t0-1"] == pytest.approx(1.0)


def test_a_trajectory_with_an_unrewarded_step_is_not_ready_until_its_step_reward_arrives(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    ids = write_trajectory(store, "a", agent_turns(1, 2), group_id="g", reward=1.0)
    other = write_trajectory(store, "b", agent_turns(2, 2), group_id="g", reward=0.0)
    add_rewards(
        store.sessions,
        [RewardIn("step", ids[0], "prm", 0.5), *(RewardIn("step", s, "prm", 0.0) for s in other)],
    )
    verdict = trajectory_readiness(store.sessions, "a", ["final"], ["prm"])
    assert not verdict.ready and verdict.unrewarded_steps == {ids[1]: ["prm"]}
    assert verdict.reasons == [
        f"unrewarded step: {ids[1]} has no current step reward 'prm' (missing is not 0)"
    ]
    spec = BatchSpec(
        step_reward_names=["prm"],
        step_advantage="step_returns",
        exclude_batched=False,
        drop_degenerate_groups=False,
    )
    _table, manifest = build_rows(store, spec)
    assert manifest["not_ready"] == {"unrewarded step": 1}  # "a" waits; never scored as 0
    assert manifest["trajectory_ids"] == ["b"]
    with pytest.raises(NothingToBatchError):  # "b" alone is short of a group of 2
        build_rows(store, spec.model_copy(update={"group_size": 2}))
    add_rewards(store.sessions, [RewardIn("step", ids[1], "prm", 1.0)])
    table, manifest = build_rows(store, spec)
    # grpo on R = [1, 0]: A^E = +-0.5/0.70711 = +-0.70711; step returns (gamma 1, none):
    # a: [0.5 + 1.0, 1.0] = [1.5, 1.0]; b: [0, 0]
    by_step = {r["step_ids"][0]: r for r in table.to_pylist()}
    assert json.loads(by_step[ids[0]]["step_rewards_json"]) == {"prm": 0.5}
    assert by_step[ids[0]]["process_reward"] == 0.5
    assert by_step[ids[0]]["step_return"] == 1.5
    assert by_step[ids[0]]["advantage"] == pytest.approx(0.5 / math.sqrt(0.5) + 1.5, rel=1e-5)
    assert by_step[other[1]]["advantage"] == pytest.approx(-0.5 / math.sqrt(0.5), rel=1e-5)
    assert manifest["step_credit"]["step_reward_names"] == ["prm"]
    store.engine.dispose()


def test_exports_carry_each_steps_rewards_and_both_advantages(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = make_store(pool_settings)
    # one task prompt, two different first answers: the first steps share a state
    turns_a = [([1, 2, 3], [10, 11]), ([1, 2, 3, 10, 11, 7], [12, 13])]
    turns_b = [([1, 2, 3], [20, 21]), ([1, 2, 3, 20, 21, 7], [22, 23])]
    a = write_trajectory(store, "a", turns_a, group_id="g", reward=1.0)
    b = write_trajectory(store, "b", turns_b, group_id="g", reward=0.0)
    add_rewards(
        store.sessions,
        [
            RewardIn("step", s, "prm", v)
            for s, v in zip([*a, *b], [0.5, 1.0, 0.0, 0.25], strict=True)
        ],
    )
    spec = BatchSpec(step_reward_names=["prm"], step_advantage="anchor_state", name="x")
    batch = materialise(store, spec, BatchSettings(batch_uri=str(tmp_path / "batches")))
    table = read_rows(batch)
    out = tmp_path / "rows.parquet"
    export_batch(store, batch, table, out, "parquet")
    rows = {r["step_ids"][0]: r for r in pq.read_table(out).to_pylist()}
    # the step reward sits on the row's last sampled token (2 response tokens): [0, r]
    assert rows[a[1]]["response_token_rewards"] == [0.0, 1.0]
    assert rows[b[1]]["process_reward"] == 0.25
    assert rows[a[0]]["advantage"] == pytest.approx(
        rows[a[0]]["episode_advantage"] + rows[a[0]]["step_advantage"]
    )
    jsonl = tmp_path / "rows.jsonl"
    export_batch(store, batch, table, jsonl, "messages")
    records = {r["step_ids"][0]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    assert records[a[1]]["step_rewards"] == {"prm": 1.0}
    assert records[a[1]]["step_advantage"] == rows[a[1]]["step_advantage"]
    assert records[a[1]]["anchor_key"] == rows[a[1]]["anchor_key"]
    # first steps share the task state: one sub-group of 2; second steps differ
    assert rows[a[0]]["anchor_group_size"] == 2 and rows[a[1]]["anchor_group_size"] == 1
    assert batch.manifest["step_credit"]["anchor"]["subgroup_sizes"] == {"2": 1}
    store.engine.dispose()


def test_last_observation_anchors_steps_whose_histories_differ_only_in_earlier_turns(
    pool_settings: PoolSettings,
) -> None:
    # a and b answer the task differently (x, y) and then both see the tool say "sunny": their
    # second prompts differ (the answers are in them), their last observations do not
    store = make_store(pool_settings)
    task = {"role": "user", "content": "weather?"}
    for trajectory_id, answer, reward in (("a", 10, 1.0), ("b", 20, 0.0)):
        said = {"role": "assistant", "content": f"answer {answer}"}
        for prompt, response, messages in (
            ([1, 2, 3], [answer], [task]),
            (
                [1, 2, 3, answer, 7],
                [answer + 1],
                [task, said, {"role": "tool", "content": "sunny"}],
            ),
        ):
            request = {"messages": messages}
            canonical = ChatCompletions().canonical(request)  # what the pool reads
            record = dataclasses.replace(
                call(prompt, response), request=request, canonical=canonical
            )
            store.record_call(trajectory_id, record, group_id="g")
        close_trajectory(
            store.sessions, trajectory_id, TrajectoryStatus.COMPLETE, final_reward=reward
        )
    spec = BatchSpec(step_advantage="anchor_state", exclude_batched=False)
    _table, by_prompt = build_rows(store, spec)
    assert by_prompt["step_credit"]["anchor"]["subgroup_sizes"] == {"2": 1}  # the first steps
    table, by_observation = build_rows(
        store, spec.model_copy(update={"anchor_key": "last_observation"})
    )
    assert by_observation["step_credit"]["anchor"]["subgroup_sizes"] == {"2": 2}
    assert by_observation["step_credit"]["anchor"]["key"] == "last_observation"
    assert set(table["anchor_group_size"].to_pylist()) == {2}
    store.engine.dispose()
