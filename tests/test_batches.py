"""Batches on SQLite and PostgreSQL, from steps written through ``PoolStore.record_call``:
hand-derived group advantages with unrewarded members (C16) and degenerate groups (C17), exact
merged rows, prefix breaks as separate segments, flagged steps kept out, and curation (labels,
rules) changing what a batch holds."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pytest
from batch_helpers import agent_turns, call, logprobs_of, make_store, write_trajectory

from datapool.batches.build import (
    BatchSpec,
    NothingToBatchError,
    build_rows,
    materialise,
    read_rows,
)
from datapool.batches.settings import BatchSettings
from datapool.curation import bulk_labels, labels, readiness
from datapool.curation import rules as curation
from datapool.curation.selection import TrajectoryFilter
from datapool.lifecycle import transitions as lifecycle
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.store import PoolStore

EPS = 1e-6


def rows_by_trajectory(table: pa.Table) -> dict[str, dict[str, object]]:
    return {row["trajectory_id"]: row for row in table.to_pylist()}


def write_group(store: PoolStore, group: str, rewards: list[float | None]) -> list[str]:
    ids = []
    for i, reward in enumerate(rewards):
        tid = f"{group}-m{i}"
        write_trajectory(store, tid, agent_turns(i + 1, 1), group_id=group, reward=reward)
        ids.append(tid)
    return ids


def test_grpo_and_rloo_advantages_match_hand_derived_values_with_unrewarded_members(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    # g1: rewards [1.0, 0.0, unrewarded, 0.5] -> scored 3, mean 0.5,
    #     std = sqrt(((0.5)^2 + (-0.5)^2 + 0^2) / (3 - 1)) = sqrt(0.25) = 0.5
    write_group(store, "g1", [1.0, 0.0, None, 0.5])
    # g2 (C16): two rewarded -1.0, two never rewarded -> scored 2, mean -1, std 0 (degenerate)
    write_group(store, "g2", [-1.0, None, -1.0, None])
    spec = BatchSpec(algorithm="grpo", drop_degenerate_groups=False, exclude_batched=False)
    table, manifest = build_rows(store, spec)
    rows = rows_by_trajectory(table)
    assert set(rows) == {"g1-m0", "g1-m1", "g1-m3", "g2-m0", "g2-m2"}  # unrewarded never enter
    # GRPO: (r - 0.5) / (0.5 + eps)
    assert rows["g1-m0"]["advantage"] == pytest.approx(0.5 / (0.5 + EPS), abs=1e-12)
    assert rows["g1-m1"]["advantage"] == pytest.approx(-0.5 / (0.5 + EPS), abs=1e-12)
    assert rows["g1-m3"]["advantage"] == pytest.approx(0.0, abs=1e-12)
    assert rows["g1-m0"]["group_reward_mean"] == pytest.approx(0.5)
    assert rows["g1-m0"]["group_reward_std"] == pytest.approx(0.5)
    assert rows["g1-m0"]["scored_group_size"] == 3 and rows["g1-m0"]["group_size"] == 4
    assert rows["g1-m0"]["group_degenerate"] is False
    # g2: (-1 - (-1)) / (0 + eps) = 0; scored size 2 of 4 members; degenerate
    assert rows["g2-m0"]["advantage"] == 0.0 and rows["g2-m2"]["advantage"] == 0.0
    assert rows["g2-m0"]["scored_group_size"] == 2 and rows["g2-m0"]["group_size"] == 4
    assert rows["g2-m0"]["group_degenerate"] is True
    assert manifest["not_ready"] == {"unrewarded": 3}
    assert manifest["counts"]["groups_all_fail"] == 1  # every reward of g2 <= fail_reward 0.0

    rloo, _ = build_rows(store, spec.model_copy(update={"algorithm": "rloo"}))
    rows = rows_by_trajectory(rloo)
    # RLOO: r_i - mean of the other rewarded members
    assert rows["g1-m0"]["advantage"] == pytest.approx(1.0 - (0.0 + 0.5) / 2)  # 0.75
    assert rows["g1-m1"]["advantage"] == pytest.approx(0.0 - (1.0 + 0.5) / 2)  # -0.75
    assert rows["g1-m3"]["advantage"] == pytest.approx(0.5 - (1.0 + 0.0) / 2)  # 0.0
    assert rows["g2-m0"]["advantage"] == pytest.approx(-1.0 - (-1.0))  # 0.0
    assert all(not math.isnan(r) for r in rloo["reward"].to_pylist())

    # dropping degenerate groups (the default) removes g2 and says so
    table, manifest = build_rows(store, spec.model_copy(update={"drop_degenerate_groups": True}))
    assert set(rows_by_trajectory(table)) == {"g1-m0", "g1-m1", "g1-m3"}
    assert manifest["counts"]["degenerate_groups_dropped"] == 1


@pytest.mark.parametrize("magnitude", [1e308, 1.7e308])
def test_a_group_of_huge_rewards_gets_the_normalised_grpo_advantage(
    pool_settings: PoolSettings, magnitude: float
) -> None:
    store = make_store(pool_settings)
    # [m, -m]: mean 0, std = sqrt(2) m, A = ±m / (sqrt(2) m + eps) = ±1/sqrt(2) = ±0.70711
    # (the std overflowed: ±0.556 at 1e308). At 1.7e308 the std itself, 2.4e308, is past the
    # float range: the advantage is still ±0.70711, the row's std is inf and the manifest's null.
    write_group(store, "huge", [magnitude, -magnitude])
    table, _ = build_rows(store, BatchSpec(algorithm="grpo", exclude_batched=False))
    rows = rows_by_trajectory(table)
    assert rows["huge-m0"]["advantage"] == pytest.approx(1 / math.sqrt(2), abs=1e-12)
    assert rows["huge-m1"]["advantage"] == pytest.approx(-1 / math.sqrt(2), abs=1e-12)
    std = math.sqrt(2) * magnitude
    assert rows["huge-m0"]["group_reward_std"] == pytest.approx(std)  # inf == approx(inf)
    batch = materialise(store, BatchSpec(algorithm="grpo"))  # the manifest is strict JSON
    assert batch.rows == 2
    (group,) = batch.manifest["groups"]
    assert group["std"] == (None if math.isinf(std) else pytest.approx(std))


def test_degenerate_groups_depend_on_a_configurable_epsilon_and_are_counted(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    write_group(store, "same", [0.6, 0.6, 0.6, 0.6])
    write_group(store, "almost", [0.6, 0.6, 0.6, 0.6000001])
    write_group(store, "wins", [1.0, 1.0])
    write_group(store, "mixed", [1.0, 0.0])
    # "almost": mean 0.6 + 2.5e-8; squared deviations 3 * (2.5e-8)^2 + (7.5e-8)^2 = 7.5e-15;
    # / (4 - 1) = 2.5e-15; std = 5e-8.
    table, manifest = build_rows(store, BatchSpec(degenerate_eps=1e-6))
    assert set(table["group_id"].to_pylist()) == {"mixed"}
    counts = manifest["counts"]
    assert counts["degenerate_groups_dropped"] == 3
    assert counts["groups_all_success"] == 1 and counts["groups_mixed"] == 1
    assert counts["groups_constant"] == 2  # 0.6 is neither >= 1.0 nor <= 0.0
    stats = {g["group_id"]: g for g in manifest["groups"]}
    assert stats["almost"]["std"] == pytest.approx(5e-8, rel=1e-3)
    assert stats["same"]["std"] == 0.0 and stats["same"]["degenerate"] is True

    table, _ = build_rows(store, BatchSpec(degenerate_eps=1e-8))
    assert set(table["group_id"].to_pylist()) == {"mixed", "almost"}

    # the curation rule reports the same facts and excludes with its reason
    _rule, result = curation.create_rule(store, "no-degenerate", "degenerate_group")
    assert result is not None and result.matched == 3
    assert result.counts == {"constant": 2, "all_success": 1, "mixed": 1}
    verdict = readiness.trajectory_readiness(store.sessions, "wins-m0", ["final"])
    assert not verdict.ready
    assert "rule 'no-degenerate'" in verdict.reasons[0] and "all_success" in verdict.reasons[0]


def test_merged_rows_reproduce_every_steps_exact_tokens_with_mask_on_sampled_tokens(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    turns = agent_turns(3, 4)
    write_trajectory(store, "t", turns, reward=1.0)
    steps = store.steps_of("t")
    assert all(s.extends_parent for s in steps[1:])
    spec = BatchSpec(algorithm="reinforce_pp", layout="merged")
    [row] = build_rows(store, spec)[0].to_pylist()
    ids, mask, logprobs = row["input_ids"], row["loss_mask"], row["behaviour_logprobs"]
    last = steps[-1]
    assert ids == last.prompt_token_ids + last.response_token_ids
    sampled = set()
    for step in steps:
        p, r = len(step.prompt_token_ids), len(step.response_token_ids)
        assert ids[:p] == step.prompt_token_ids  # the exact prompt, environment tokens included
        assert ids[p : p + r] == step.response_token_ids
        assert mask[p : p + r] == [1] * r
        assert logprobs[p : p + r] == logprobs_of(step.response_token_ids)
        sampled |= set(range(p, p + r))
    assert [i for i, m in enumerate(mask) if m] == sorted(sampled)  # 1 exactly on sampled tokens
    assert all(logprobs[i] == 0.0 for i in range(len(ids)) if i not in sampled)
    assert row["position_ids"] == list(range(len(ids)))
    assert row["step_ids"] == [s.id for s in steps]

    per_step = build_rows(store, spec.model_copy(update={"layout": "per_step"}))[0].to_pylist()
    for row, step in zip(per_step, steps, strict=True):
        p, r = len(step.prompt_token_ids), len(step.response_token_ids)
        assert row["input_ids"] == step.prompt_token_ids + step.response_token_ids
        assert row["loss_mask"] == [0] * p + [1] * r
        assert row["prompt_tokens"] == p and row["step_ids"] == [step.id]


def test_a_trajectory_with_a_prefix_break_exports_as_separate_segments(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    (p1, r1), (p2, r2) = agent_turns(4, 2)
    p3 = [*p1[:3], 55, 56]  # history rewritten: diverges from step 2's sequence at offset 3
    r3 = [1600, 1601]
    store.record_call("br", call(p1, r1))
    store.record_call("br", call(p2, r2))
    # the same task, then a turn the agent rewrote: a break of the main chain, not a side call
    rewritten = [{"role": "assistant", "content": "rewritten"}, {"role": "user", "content": "go"}]
    store.record_call("br", call(p3, r3, later_messages=rewritten))
    lifecycle.close_trajectory(store.sessions, "br", TrajectoryStatus.COMPLETE, final_reward=1.0)
    steps = store.steps_of("br")
    assert steps[2].extends_parent is False and "prefix_break" in steps[2].flags
    rows = build_rows(store, BatchSpec(algorithm="sft", layout="merged"))[0].to_pylist()
    assert [r["step_ids"] for r in rows] == [[steps[0].id, steps[1].id], [steps[2].id]]
    assert rows[0]["input_ids"] == p2 + r2
    assert rows[1]["input_ids"] == p3 + r3  # starts over with its own prompt (mask 0)
    assert rows[1]["loss_mask"] == [0] * len(p3) + [1] * len(r3)
    assert [r["segment_index"] for r in rows] == [0, 1]


def test_flagged_and_failed_steps_never_enter_a_batch_and_split_merged_rows(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    (p1, r1), (p2, r2), (p3, r3) = agent_turns(5, 3)
    [s1] = store.record_call("fl", call(p1, r1))
    [s2] = store.record_call("fl", call(p2, r2, flags=["ids_incomplete"]))
    store.record_call("fl", call(p3, None, outcome="upstream_error"))
    [s4] = store.record_call("fl", call(p3, r3))
    lifecycle.close_trajectory(store.sessions, "fl", TrajectoryStatus.COMPLETE, final_reward=1.0)
    rows = build_rows(store, BatchSpec(algorithm="sft", layout="merged"))[0].to_pylist()
    assert [r["step_ids"] for r in rows] == [[s1], [s4]]
    assert rows[1]["input_ids"] == p3 + r3
    assert rows[1]["loss_mask"] == [0] * len(p3) + [1] * len(r3)  # s2's response is context
    verdict = readiness.trajectory_readiness(store.sessions, "fl", ["final"])
    assert verdict.ready and s2 in verdict.excluded_steps


def test_an_exclude_label_changes_what_a_batch_contains(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    store = make_store(pool_settings)
    write_trajectory(store, "keep", agent_turns(6, 2), reward=1.0)
    write_trajectory(store, "drop", agent_turns(7, 2), reward=0.0)
    spec = BatchSpec(algorithm="reinforce_pp", exclude_batched=False)
    assert set(build_rows(store, spec)[0]["trajectory_id"].to_pylist()) == {"keep", "drop"}
    [label_id] = labels.add_labels(
        store.sessions, [labels.LabelIn("trajectory", "drop", decision="exclude", author="ann")]
    )
    assert set(build_rows(store, spec)[0]["trajectory_id"].to_pylist()) == {"keep"}
    verdict = readiness.trajectory_readiness(store.sessions, "drop", ["final"])
    assert verdict.reasons == [f"excluded by label #{label_id} (ann)"]
    # a later include label wins again (append-only: the current view is the latest decision)
    labels.add_labels(store.sessions, [labels.LabelIn("trajectory", "drop", decision="include")])
    assert set(build_rows(store, spec)[0]["trajectory_id"].to_pylist()) == {"keep", "drop"}
    # bulk: tag every step of the rewarded-1 trajectories, exclude them by a bulk label
    ids = bulk_labels.bulk_label(
        store.sessions,
        TrajectoryFilter(reward_min=0.5),
        labels.LabelIn("step", "-", tags=["good-run"], decision="exclude"),
    )
    assert len(ids) == 2  # the two steps of "keep"
    assert set(build_rows(store, spec)[0]["trajectory_id"].to_pylist()) == {"drop"}
    settings = BatchSettings(batch_uri=str(tmp_path / "batches"))
    batch = materialise(store, spec, settings)
    assert read_rows(batch)["trajectory_id"].to_pylist() == ["drop", "drop"]


def test_curation_rules_mark_with_their_reason_and_readiness_explains(
    pool_settings: PoolSettings,
) -> None:
    store = make_store(pool_settings)
    write_trajectory(store, "fine", agent_turns(8, 2), reward=1.0)
    [p, r] = agent_turns(9, 1)[0]
    store.record_call("cut", call(p, r, flags=["truncated"], finish_reason="length"))
    lifecycle.close_trajectory(store.sessions, "cut", TrajectoryStatus.COMPLETE, final_reward=1.0)
    lifecycle.create_trajectory(store.sessions, "bypass")  # C15: rewarded, never called
    lifecycle.close_trajectory(
        store.sessions, "bypass", TrajectoryStatus.COMPLETE, final_reward=1.0
    )
    write_trajectory(store, "low", agent_turns(10, 1), reward=-5.0)
    write_trajectory(store, "old", [(p, r)], reward=1.0)
    curation.create_rule(store, "no-truncated", "truncated", params={"target": "trajectory"})
    curation.create_rule(store, "no-empty", "empty")
    curation.create_rule(store, "floor", "reward_threshold", params={"min": -1.0})
    curation.create_rule(store, "dupes", "duplicate_prompt", action="flag")
    ready = {
        t: readiness.trajectory_readiness(store.sessions, t, ["final"])
        for t in ("fine", "cut", "bypass", "low", "old")
    }
    assert ready["fine"].ready and ready["fine"].reasons == []
    assert "excluded by rule 'no-truncated'" in ready["cut"].reasons[0]
    assert "trajectory flagged 'empty'" in ready["bypass"].reasons
    assert any("rule 'no-empty'" in x for x in ready["bypass"].reasons)
    assert (
        "excluded by rule 'floor'" in ready["low"].reasons[0]
        and "-5.0 < min" in ready["low"].reasons[0]
    )
    assert ready["old"].ready and any("flagged by rule 'dupes'" in n for n in ready["old"].notes)
    table, _ = build_rows(store, BatchSpec(algorithm="reinforce_pp"))
    assert set(table["trajectory_id"].to_pylist()) == {"fine", "old"}
    # deleting a rule makes what it excluded eligible again
    [floor] = [x for x in curation.list_rules(store.sessions) if x.name == "floor"]
    curation.delete_rule(store.sessions, floor.id)
    assert readiness.trajectory_readiness(store.sessions, "low", ["final"]).ready
    with pytest.raises(NothingToBatchError):
        build_rows(store, BatchSpec(channel="nothing-here"))


def test_stale_steps_and_reward_modes_reach_rows_as_specified(pool_settings: PoolSettings) -> None:
    store = make_store(pool_settings)
    (p1, r1), (p2, r2), (p3, r3) = agent_turns(11, 3)
    store.record_call("st", call(p1, r1, policy_version=1))
    store.record_call("st", call(p2, r2, policy_version=4))
    store.record_call("st", call(p3, r3, policy_version=5))
    lifecycle.close_trajectory(store.sessions, "st", TrajectoryStatus.COMPLETE, final_reward=2.0)
    spec = BatchSpec(
        algorithm="sft",
        reward_to_steps="discounted",
        gamma=0.5,
        max_staleness_versions=2,
        current_policy_version=5,  # version 1 is 4 behind: dropped; 4 and 5 stay
    )
    table, manifest = build_rows(store, spec)
    assert manifest["counts"]["stale_steps"] == 1
    # S = 2 trainable steps: G_0 = 0.5 * 2.0 = 1.0, G_1 = 2.0; sft's weight 1.0 is discounted
    # the same way: 0.5 * 1.0, then 1.0
    assert table["step_reward"].to_pylist() == [1.0, 2.0]
    assert table["advantage"].to_pylist() == [0.5, 1.0]
    assert table["policy_version"].to_pylist() == [4, 5]
    final = build_rows(store, spec.model_copy(update={"reward_to_steps": "final_step"}))[0]
    assert final["step_reward"].to_pylist() == [2.0] and final["policy_version"].to_pylist() == [5]
    with pytest.raises(ValueError, match="reward_to_steps must be 'broadcast'"):
        BatchSpec(layout="merged", reward_to_steps="final_step")
