"""TRL 1.16 and verl 0.9.1 (the real libraries) train on the pool's rows: a batch materialised
from real SQLite/PostgreSQL pools goes through TRL's GRPOTrainer on the CPU via ``rollout_func``,
through verl's own ``AgentLoopWorker.generate_sequences`` (an agent loop registered by YAML) into a
``DataProto``, and through TRL's AsyncGRPO data path (its queue dataset, planner and collator) from
leased batches; the tokens, masks, logprobs, advantages and rewards the libraries hold equal the
pool's.

Trajectories (``agent_turns``): two turns, prompt P_1 = 5 ids, R_1 = 2, 3 tool ids, R_2 = 2, so a
merged row is 5 prompt ids then completion C = R_1 + E_2 + R_2 = 7 ids, mask 1 1 0 0 0 1 1.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from batch_helpers import agent_turns, call, logprobs_of, make_store, write_trajectory
from verl.experimental.agent_loop.agent_loop import AgentLoopBase

from datapool.batches.build import materialise, read_rows
from datapool.batches.settings import BatchSettings
from datapool.batches.spec import BatchSpec
from datapool.lifecycle.transitions import close_trajectory
from datapool.models import TrajectoryStatus
from datapool.settings import PoolSettings
from datapool.steps.records import LineageRecord
from trainer_bridge.integrations.rows import PoolRow, pool_rows
from trainer_bridge.integrations.trl import pool_reward, rollout_output
from trainer_bridge.integrations.verl import agent_loop_outputs

EXPECTED_MASK = [1, 1, 0, 0, 0, 1, 1]


def _pool_batch(pool_settings: PoolSettings, tmp_path: Path) -> list[PoolRow]:
    """Two groups of two trajectories, rewards 1/0 and 0/1, one merged row each."""
    store = make_store(pool_settings)
    for i, (group, reward) in enumerate([("g1", 1.0), ("g1", 0.0), ("g2", 0.0), ("g2", 1.0)]):
        write_trajectory(store, f"t{i}", agent_turns(i + 1, 2), group_id=group, reward=reward)
    spec = BatchSpec(layout="merged", algorithm="grpo", exclude_batched=False)
    batch = materialise(store, spec, BatchSettings(batch_uri=str(tmp_path / "batches")))
    return pool_rows(read_rows(batch))


def test_pool_rows_cut_each_merged_row_at_its_first_prompt(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    rows = {row.trajectory_id: row for row in _pool_batch(pool_settings, tmp_path)}
    (p1, r1), (_, r2) = agent_turns(1, 2)
    row = rows["t0"]
    assert row.prompt_ids == p1
    assert row.completion_ids == [*r1, 7, 8, 9, *r2]
    assert row.completion_mask == EXPECTED_MASK
    assert row.completion_logprobs == [*logprobs_of(r1), 0.0, 0.0, 0.0, *logprobs_of(r2)]
    assert (row.group_id, row.reward, row.policy_version) == ("g1", 1.0, 0)
    # grpo in a group of rewards 1, 0: mean 0.5, sample std sqrt(0.5) = 0.7071 -> +-0.7071
    assert rows["t0"].advantage == pytest.approx(0.7071, abs=1e-4)
    assert rows["t1"].advantage == pytest.approx(-0.7071, abs=1e-4)


def test_rollout_output_refuses_an_episode_without_exactly_one_row(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    rows = _pool_batch(pool_settings, tmp_path)
    with pytest.raises(ValueError, match=r"\{'missing': 0\}"):
        rollout_output(rows, ["t0", "missing"])
    with pytest.raises(ValueError, match=r"\{'t0': 2\}"):
        rollout_output([rows[0], rows[0]], ["t0"])


def test_pool_rows_carry_their_lineage_to_trls_and_verls_per_row_fields(
    pool_settings: PoolSettings, tmp_path: Path
) -> None:
    # "spawn": a planner and its sub-agent "searcher" (named by headers) take turns, two each:
    # two merged rows of one trajectory, told apart by lineage_id. "alone": one agent without
    # headers, one row whose lineage is named after its first step.
    store = make_store(pool_settings)
    planner = LineageRecord("planner", None, "main")
    searcher = LineageRecord("searcher", "planner", "subagent")
    main, sub = agent_turns(1, 2), agent_turns(2, 2)
    for k in range(2):
        for turns, lineage in ((main, planner), (sub, searcher)):
            store.record_call("spawn", replace(call(*turns[k]), lineage=lineage))
    close_trajectory(store.sessions, "spawn", TrajectoryStatus.COMPLETE, final_reward=1.0)
    [first, _] = write_trajectory(store, "alone", agent_turns(3, 2), reward=0.0)
    spec = BatchSpec(layout="merged", algorithm="sft", exclude_batched=False)
    batch = materialise(store, spec, BatchSettings(batch_uri=str(tmp_path / "batches")))
    rows = pool_rows(read_rows(batch))
    spawned = [row for row in rows if row.trajectory_id == "spawn"]
    assert [row.lineage_id for row in spawned] == ["planner", "searcher"]
    assert [row.completion_mask for row in spawned] == [EXPECTED_MASK, EXPECTED_MASK]
    outputs = agent_loop_outputs(spawned)
    assert [o.extra_fields["lineage_id"] for o in outputs] == ["planner", "searcher"]
    alone = [row for row in rows if row.trajectory_id == "alone"]
    assert rollout_output(alone, ["alone"])["lineage_id"] == [first]
    store.engine.dispose()


def test_trl_grpo_trainer_updates_on_the_pool_rows_it_received(
    pool_settings: PoolSettings, tmp_path: Path, tiny_model_dir: Path
) -> None:
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = _pool_batch(pool_settings, tmp_path)
    order = ["t0", "t1", "t2", "t3"]  # TRL's groups: consecutive num_generations rows
    answered: list[dict[str, Any]] = []

    def rollout_func(prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        assert len(prompts) == 4
        answer = rollout_output(rows, order)
        answered.append(answer)
        return answer

    seen: list[dict[str, Any]] = []

    class Recording(GRPOTrainer):  # what TRL built from the rollout, as its loss reads it
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            seen.append(out)
            return out

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        learning_rate=1e-2,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        beta=0.0,
    )
    dataset = Dataset.from_dict({"prompt": ["a", "b"] * 4})
    trainer = Recording(
        model=str(tiny_model_dir),
        reward_funcs=pool_reward,
        args=args,
        train_dataset=dataset,
        rollout_func=rollout_func,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert changed, "no weight changed"

    [out] = seen
    by_row = {r.trajectory_id: r for r in rows}
    for i, trajectory_id in enumerate(order):
        row = by_row[trajectory_id]
        n = len(row.completion_ids)
        got_ids = out["completion_ids"][i][:n].tolist()
        assert got_ids == row.completion_ids
        assert out["completion_mask"][i][:n].tolist() == [1] * n
        assert out["tool_mask"][i][:n].tolist() == row.completion_mask
        assert out["sampling_per_token_logps"][i][:n].tolist() == pytest.approx(
            row.completion_logprobs, abs=0
        )
        assert out["prompt_ids"][i][-len(row.prompt_ids) :].tolist() == row.prompt_ids
    # TRL's own advantages from the pool's rewards (1, 0 | 0, 1): +-0.5/(std 0.7071 + 1e-4)
    assert out["advantages"].tolist() == pytest.approx([0.7070, -0.7070, -0.7070, 0.7070], abs=1e-3)


def verl_worker(model_dir: Path, tmp_path: Path, loops: list[dict[str, Any]], length: int) -> Any:
    """verl's own ``AgentLoopWorker`` from verl's own default config (``ppo_trainer.yaml``), its
    agent loops registered by an ``agent_loop_config_path`` YAML file as a user writes it;
    ``length``: the rollout's prompt and response lengths. No LLM client: the loops here never
    call verl's servers (their episodes go through the gateway)."""
    import verl
    import yaml
    from hydra import compose, initialize_config_dir
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    loop_file = tmp_path / "agent_loops.yaml"
    loop_file.write_text(yaml.safe_dump(loops))
    with initialize_config_dir(
        config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None
    ):
        config = compose(
            "ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model_dir}",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.prompt_length={length}",
                f"actor_rollout_ref.rollout.response_length={length}",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loop_file}",
            ],
        )
    return AgentLoopWorker(config, llm_client=None)


def verl_samples(agent_name: str, uids: list[str], **fields: list[Any]) -> Any:
    """A generation batch as verl's trainer hands it to ``generate_sequences``."""
    import numpy as np
    from verl import DataProto

    def column(values: list[Any]) -> Any:
        array = np.empty(len(values), dtype=object)
        array[:] = values
        return array

    return DataProto.from_dict(
        non_tensors={
            "agent_name": column([agent_name] * len(uids)),
            "raw_prompt": column([[{"role": "user", "content": f"task {u}"}] for u in uids]),
            "uid": column(uids),
            **{name: column(values) for name, values in fields.items()},
        }
    )


SERVED: list[PoolRow] = []


class ServedRowsLoop(AgentLoopBase):  # type: ignore[misc]
    """A test agent loop handing back one prepared pool row per sample (the sample's ``row``
    field indexes ``SERVED``), so verl's public path runs on rows from both databases."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        return agent_loop_outputs([SERVED[int(kwargs["row"])]])[0]


def test_verl_generate_sequences_puts_the_pool_rows_into_its_data_proto(
    pool_settings: PoolSettings, tmp_path: Path, tiny_model_dir: Path
) -> None:
    import asyncio

    rows = _pool_batch(pool_settings, tmp_path)
    SERVED[:] = rows
    length = 10
    worker = verl_worker(
        tiny_model_dir,
        tmp_path,
        [{"name": "served", "_target_": f"{__name__}.ServedRowsLoop"}],
        length,
    )
    samples = verl_samples("served", ["g1", "g1", "g2", "g2"], row=[0, 1, 2, 3])
    proto = asyncio.run(worker.generate_sequences(samples))
    batch = proto.batch
    for i, row in enumerate(rows):
        n, p = len(row.completion_ids), len(row.prompt_ids)
        assert batch["prompts"][i, length - p :].tolist() == row.prompt_ids
        assert batch["responses"][i, :n].tolist() == row.completion_ids
        assert batch["response_mask"][i].tolist() == row.completion_mask + [0] * (length - n)
        assert batch["rollout_log_probs"][i, :n].tolist() == row.completion_logprobs
        # the reward sits on the last response token, nowhere else
        expected = [0.0] * length
        expected[n - 1] = row.reward or 0.0
        assert batch["rm_scores"][i].tolist() == expected
        assert proto.non_tensor_batch["trajectory_id"][i] == row.trajectory_id
        assert proto.non_tensor_batch["lineage_id"][i] == row.lineage_id == row.step_ids[0]
        assert proto.non_tensor_batch["policy_version"][i] == row.policy_version


def test_async_grpo_rollout_worker_feeds_trls_own_queue_planner_and_collator_and_acks_once(
    sqlite_pool: PoolSettings, tmp_path: Path
) -> None:
    """TRL's AsyncGRPOTrainer itself needs CUDA (its constructor asks torch.cuda for the device
    name; its loss runs the FA3 tree-attention kernel): here its data path runs on the CPU, the
    classes the trainer builds in ``get_train_dataloader`` and feeds its loss from."""
    from collections import defaultdict

    from accelerate import PartialState
    from gateway_helpers import gateway_with
    from tests_support import free_port
    from trl.experimental.async_grpo.async_grpo_trainer import (
        DataCollatorForRollout,
        FixedCountBatcher,
        RolloutQueueDataset,
    )

    from trainer_bridge.client import PoolClient
    from trainer_bridge.integrations.trl_async import PoolRolloutWorker

    PartialState()  # the trainer's accelerate state, which TRL's dataset logs through
    rows = {r.trajectory_id: r for r in _pool_batch(sqlite_pool, tmp_path)}
    with gateway_with(sqlite_pool, free_port()) as server, PoolClient(server.url) as pool:
        worker = PoolRolloutWorker(pool, "async-trl", poll_interval_s=0.1)
        version = 0
        dataset = RolloutQueueDataset(
            rollout_queue=worker.rollout_buffer,
            model_version_fn=lambda: version,
            check_health_fn=worker.check_health,
            stale_after_s=60,
            metrics=defaultdict(list),
            max_staleness=3,
            poll_interval_s=0.5,
        )
        planner = FixedCountBatcher(dataset, num_processes=1, microbatch_size=4)
        collate = DataCollatorForRollout(pad_token_id=0, num_processes=1)
        worker.start()
        [packed_rows] = next(iter(planner))
        batch = collate([[packed_rows]])
        # every trained token: its target id, behaviour logprob and the row's pool advantage
        targets, logprobs, advantages = [], [], []
        for sample in packed_rows.samples:
            ids = sample["input_ids"].tolist()
            [row] = [r for r in rows.values() if r.prompt_ids + r.completion_ids == ids]
            cut = len(row.prompt_ids)
            for p in range(1, len(ids)):
                if p >= cut and row.completion_mask[p - cut]:
                    targets.append(ids[p])
                    logprobs.append(row.completion_logprobs[p - cut])
                    advantages.append(row.advantage)
        assert len(targets) == 4 * 4  # 4 rows, mask 1 1 0 0 0 1 1
        # one packed row (one rank), [1, M] loss terms
        assert batch["shift_labels"][0][batch["token_index"][0]].tolist() == targets
        assert batch["old_log_probs"][0].tolist() == pytest.approx(logprobs, abs=1e-7)
        assert batch["advantages"][0].tolist() == pytest.approx(advantages, abs=1e-6)
        assert sorted(s["group_id"] for s in packed_rows.samples) == [0, 0, 1, 1]
        # exactly once: acknowledged at the second sync after its last sample was taken
        version = 1
        worker.update_model_version(1)
        assert worker.acked_batches == []
        version = 2
        worker.update_model_version(2)
        assert len(worker.acked_batches) == 1
        assert pool.lease("async-trl", batch_id=worker.acked_batches[0]) is None
        worker.check_health(stale_after_s=60)
        worker.stop()


def test_async_grpo_rollout_worker_gives_back_what_it_did_not_train_at_stop(
    sqlite_pool: PoolSettings, tmp_path: Path
) -> None:
    from gateway_helpers import gateway_with
    from tests_support import free_port

    from trainer_bridge.client import PoolClient
    from trainer_bridge.integrations.trl_async import PoolRolloutWorker

    _pool_batch(sqlite_pool, tmp_path)
    with gateway_with(sqlite_pool, free_port()) as server, PoolClient(server.url) as pool:
        worker = PoolRolloutWorker(pool, "async-trl", poll_interval_s=0.1)
        worker.start()
        first = worker.rollout_buffer.get(timeout=60)  # one of four samples taken
        assert first.model_version == 0
        assert abs(first.advantage) == pytest.approx(0.7071, abs=1e-4)  # grpo, rewards 1 and 0
        worker.stop()
        assert worker.acked_batches == []
        # the nacked batch is leasable again by the same consumer
        lease = pool.lease("async-trl")
        assert lease is not None and lease.rows == 4


def test_async_grpo_rollout_worker_refuses_rows_at_another_temperature(
    sqlite_pool: PoolSettings, tmp_path: Path
) -> None:
    from gateway_helpers import gateway_with
    from tests_support import free_port

    from trainer_bridge.client import PoolClient
    from trainer_bridge.integrations.trl_async import PoolRolloutWorker

    _pool_batch(sqlite_pool, tmp_path)
    with gateway_with(sqlite_pool, free_port()) as server, PoolClient(server.url) as pool:
        worker = PoolRolloutWorker(pool, "async-trl", temperature=0.7, poll_interval_s=0.1)
        worker.start()
        deadline = 60.0
        while deadline > 0:
            try:
                worker.check_health(stale_after_s=600)
            except RuntimeError as error:
                assert "temperature 1.0" in str(error.__cause__)
                break
            time.sleep(0.1)
            deadline -= 0.1
        else:
            pytest.fail("the worker never failed")
        worker.stop()
        assert pool.lease("async-trl") is not None  # nacked: its rows came back
