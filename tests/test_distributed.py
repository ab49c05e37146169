"""The trainer under ``torchrun`` (gloo, 2 processes on CPU): rank 0 leases one batch from a
gateway, each rank trains on its share, gradients are summed over the ranks, rank 0 acks once,
and the resulting weights equal those of one process updating on the whole batch: LoRA sharded
with FSDP2, packed rows and activation checkpointing; full weights sharded with FSDP2, each rank
holding half of them. A trainer killed after an update (before its checkpoint, or after it but
before the ack) resumes from its checkpoint at the right policy version, and every batch is
trained into the final weights exactly once."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import torch
from batch_helpers import agent_turns, make_store, write_trajectory
from deployment_helpers import compose_service_env
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from tests_support import free_port

from datapool.batches.build import BatchSpec, get_batch, materialise, read_rows
from datapool.batches.settings import BatchSettings
from datapool.curation.selection import TrajectoryFilter
from datapool.db import upgrade
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trainer_bridge.client import train_batch
from trainer_bridge.collate import Row, collate, row_from_step
from trainer_bridge.distributed import shard_rows
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.trainer import PolicyTrainer
from trajgate.vllm_server import VLLMServer

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# float32 sums in another order (two shards, packed against padded kernels, other thread counts)
# move gradients by ~1e-7; AdamW's first step is lr * g / (|g| + eps), nearly lr * sign(g), so an
# element whose gradient is that small moves by a visibly different amount (measured: 2.2e-5 in 1
# of 1,536 LoRA weights at lr 1e-2). Far below the update itself (> 1e-3, asserted).
WEIGHT_TOLERANCE = 1e-4
# vLLM (CPU, fp32) with the published adapter against the single process's weights: 4.8e-8 for
# identical weights (tests/test_trainer_bridge.py), plus the weights' float differences above
SERVED_GAP_TOLERANCE = 1e-4


def test_shard_rows_gives_each_rank_every_other_row_longest_first() -> None:
    rows = [Row([1] * n, [1] * n, [0.0] * n, 1.0) for n in (3, 7, 5, 2, 6)]
    # lengths sorted: 7, 6, 5, 3, 2 -> rank 0: 7, 5, 2; rank 1: 6, 3
    assert [len(r.input_ids) for r in shard_rows(rows, 0, 2)] == [7, 5, 2]
    assert [len(r.input_ids) for r in shard_rows(rows, 1, 2)] == [6, 3]


def _assert_halved(reports: dict[int, dict[str, Any]]) -> None:
    """Each of the 2 ranks holds about half of the parameter elements (FSDP2 pads a dimension
    that does not split evenly, so "about": within 1% of the whole)."""
    total = reports[0]["parameters_total"]
    assert total == reports[1]["parameters_total"] > 0
    for rank in (0, 1):
        assert abs(reports[rank]["parameters_held"] - total / 2) <= 0.01 * total


def test_torchrun_two_ranks_update_equals_the_single_process_update(
    vllm: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    upgrade(url)
    pool = PoolSettings(data_dir=tmp_path / "data", database_url=url)
    store = make_store(pool)
    for group in range(3):  # 3 groups of 2, rewards 0 and 1: advantages -1 and +1
        for member in range(2):
            seed = 2 * group + member + 1
            write_trajectory(
                store, f"t{seed}", agent_turns(seed, 2), group_id=f"g{group}", reward=member
            )
    batch_settings = BatchSettings(batch_uri=str(tmp_path / "batches"))
    batch = materialise(store, BatchSpec(algorithm="grpo", group_size=2), batch_settings)
    assert batch.rows == 12  # 6 trajectories x 2 steps

    trainer_env = {
        "TRAJGATE_TRAINER_MODEL_DIR": str(tiny_model_dir),
        "TRAJGATE_TRAINER_DEVICE": "cpu",
        "TRAJGATE_TRAINER_LORA_RANK": "4",
        "TRAJGATE_TRAINER_LEARNING_RATE": "0.01",
        "TRAJGATE_TRAINER_MICRO_BATCH_ROWS": "2",
    }
    adapter = f"dist-{secrets.token_hex(4)}"  # the shared vLLM may serve other runs' adapters
    sharded_env = {  # the torchrun side: the same update, sharded and packed
        "TRAJGATE_TRAINER_ADAPTER_PREFIX": adapter,
        "TRAJGATE_TRAINER_SHARDING": "fsdp2",
        "TRAJGATE_TRAINER_MICRO_BATCH_TOKENS": "40",
        "TRAJGATE_TRAINER_ACTIVATION_CHECKPOINTING": "true",
    }
    gateway = BackgroundServer(  # it loads the adapter into vLLM (POST /admin/weight-updates)
        create_app(GatewaySettings(upstream_url=vllm.url, port=free_port()), pool),
        port=free_port(),
    ).start()
    try:
        # docker-compose.yml's trainer environment, with this machine's values
        env = compose_service_env(
            "trainer",
            {
                "TRAJGATE_DATABASE_URL": url,
                "TRAJGATE_DATA_DIR": str(tmp_path / "data"),
                "TRAJGATE_PAYLOAD_URI": str(tmp_path / "payloads"),
                "TRAJGATE_BATCH_URI": str(tmp_path / "batches"),
                "TRAJGATE_TRAINER_MODEL_DIR": str(tiny_model_dir),
                "TRAJGATE_TRAINER_DEVICE": "cpu",
                "TRAJGATE_TRAINER_POOL_URL": gateway.url,
                "TRAJGATE_TRAINER_VLLM_URLS": vllm.url,
                "TRAJGATE_TRAINER_GATEWAY_URL": gateway.url,
                "TRAJGATE_TRAINER_ADMIN_TOKEN": "unused",
                "TRAJGATE_TRAINER_WEIGHTS_DIR": str(tmp_path / "weights"),
                "TRAJGATE_TRAINER_IDLE_WAIT_S": "0.2",
            },
        )
        done = subprocess.run(
            [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "trainer_bridge.distributed"],
            env={
                **os.environ,
                **env,
                **trainer_env,
                **sharded_env,
                "TRAJGATE_TRAINER_MAX_UPDATES": "1",
                "OMP_NUM_THREADS": "1",
            },
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        detail = httpx.get(f"{gateway.url}/api/batches/{batch.id}", timeout=30).json()
        posted = httpx.get(f"{gateway.url}/api/training-metrics", timeout=30).json()
        versions = httpx.get(f"{gateway.url}/admin/policy-versions", timeout=30).json()
        # the gathered adapter, loaded into the real vLLM, serves version 1
        served = httpx.post(
            f"{vllm.url}/v1/completions",
            json={
                "model": f"{adapter}-v1",
                "prompt": "The weather in Paris is",
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": 0,
                "return_token_ids": True,
                "logprobs": 1,
            },
            timeout=120,
        ).json()["choices"][0]
    finally:
        gateway.stop()
        httpx.post(  # its directory goes with tmp_path
            f"{vllm.url}/v1/unload_lora_adapter", json={"lora_name": f"{adapter}-v1"}, timeout=60
        )
    reports = {
        r["rank"]: r
        for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    }
    assert sorted(reports) == [0, 1]
    assert [u["batch_id"] for u in reports[0]["updates"]] == [batch.id]
    assert [u["batch_id"] for u in reports[1]["updates"]] == [batch.id]
    assert [c["consumer"] for c in detail["consumed_by"]] == ["trainer"]  # acked once
    _assert_halved(reports)

    single = PolicyTrainer(
        TrainerSettings(
            **{k.removeprefix("TRAJGATE_TRAINER_").lower(): v for k, v in trainer_env.items()}
        )
    )
    initial = {k: v.clone() for k, v in get_peft_model_state_dict(single.model).items()}
    metrics = single.update(train_batch(read_rows(get_batch(store, batch.id)), pad_token_id=0))
    expected = get_peft_model_state_dict(single.model)
    got = load_file(str(tmp_path / "weights" / "policy-v1" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(expected)
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in expected)
    assert moved > 1e-3  # the update did something worth comparing
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=WEIGHT_TOLERANCE, rtol=0)
    [version] = [v for v in versions if v["active"]]
    assert (version["version"], version["model_name"]) == (1, f"{adapter}-v1")
    row = row_from_step(
        served["prompt_token_ids"], served["token_ids"], served["logprobs"]["token_logprobs"], 0.0
    )
    sampled = collate([row], pad_token_id=0)
    gap = (single.logprobs(sampled) - sampled.behaviour_logprobs).abs()[sampled.loss_mask.bool()]
    assert float(gap.max()) < SERVED_GAP_TOLERANCE
    for rank in (0, 1):
        update = reports[rank]["updates"][0]
        assert abs(update["loss"] - metrics.loss) < 1e-6
        assert abs(update["grad_norm"] - metrics.grad_norm) < 1e-5
        assert update["tokens"] == metrics.tokens
        assert update["padding_fraction"] == 0.0  # packed
    # rank 0 alone posted the update's metrics, under the consumer id and the published version
    [row] = posted
    assert (row["run"], row["policy_version"], row["step"]) == ("trainer", 1, 1)
    assert abs(row["metrics"]["loss"] - metrics.loss) < 1e-6
    assert row["metrics"]["padding_fraction"] == 0.0


def _torchrun(env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], dict[int, Any]]:
    """``torchrun -m trainer_bridge.distributed`` on 2 CPU ranks; the reports each rank printed."""
    done = subprocess.run(
        [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "trainer_bridge.distributed"],
        env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    reports = {
        r["rank"]: r
        for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    }
    return done, reports


def test_fsdp2_full_weights_resume_after_crashes_and_train_every_batch_once(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    upgrade(url)
    pool = PoolSettings(data_dir=tmp_path / "data", database_url=url)
    store = make_store(pool)
    batch_settings = BatchSettings(batch_uri=str(tmp_path / "batches"))
    batch_ids = []
    for group in range(4):  # 4 batches of one group of 2 (rewards 0, 1), 2 steps each: 4 rows
        for member in range(2):
            seed = 2 * group + member + 1
            write_trajectory(
                store, f"t{seed}", agent_turns(seed, 2), group_id=f"g{group}", reward=member
            )
        spec = BatchSpec(
            algorithm="grpo", group_size=2, filters=TrajectoryFilter(group_ids=[f"g{group}"])
        )
        batch_ids.append(materialise(store, spec, batch_settings).id)
    checkpoints = tmp_path / "checkpoints"
    trainer_env = {
        "TRAJGATE_TRAINER_MODEL_DIR": str(tiny_model_dir),
        "TRAJGATE_TRAINER_DEVICE": "cpu",
        "TRAJGATE_TRAINER_LORA_RANK": "0",
        "TRAJGATE_TRAINER_LEARNING_RATE": "0.001",
        "TRAJGATE_TRAINER_MICRO_BATCH_ROWS": "1",
    }
    gateway = BackgroundServer(
        create_app(GatewaySettings(upstream_url="http://127.0.0.1:9", port=free_port()), pool),
        port=free_port(),
    ).start()
    env = {
        **trainer_env,
        "TRAJGATE_TRAINER_SHARDING": "fsdp2",
        "TRAJGATE_TRAINER_POOL_URL": gateway.url,
        "TRAJGATE_TRAINER_WEIGHTS_DIR": str(tmp_path / "weights"),
        "TRAJGATE_TRAINER_CHECKPOINT_DIR": str(checkpoints),
        "TRAJGATE_TRAINER_IDLE_WAIT_S": "0.2",
    }
    try:
        # 1: one update of batch 0 (version 1), checkpointed, acked; stops between updates
        first, reports = _torchrun({**env, "TRAJGATE_TRAINER_MAX_UPDATES": "1"})
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        _assert_halved(reports)
        assert [u["batch_id"] for u in reports[0]["updates"]] == batch_ids[:1]
        # 2: resumes at version 2, trains batch 1, checkpoints it, dies before the ack
        crashed, _ = _torchrun({**env, "TRAJGATE_TRAINER_CRASH_AT": "checkpointed:1"})
        assert crashed.returncode != 0
        # 3: acks batch 1 from its checkpoint (not trained again), trains batch 2 (version 3),
        # then batch 3 (version 4) and dies before checkpointing it
        crashed, _ = _torchrun({**env, "TRAJGATE_TRAINER_CRASH_AT": "trained:2"})
        assert crashed.returncode != 0
        # 4: batch 3 comes back (nacked at start) and is trained again from version 3's weights
        last, reports = _torchrun({**env, "TRAJGATE_TRAINER_IDLE_EXIT_S": "1"})
        assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
        acked = {
            batch_id: httpx.get(f"{gateway.url}/api/batches/{batch_id}", timeout=30).json()[
                "consumed_by"
            ]
            for batch_id in batch_ids
        }
    finally:
        gateway.stop()
    for rank in (0, 1):
        [update] = reports[rank]["updates"]
        assert (update["batch_id"], update["policy_version"], update["step"]) == (
            batch_ids[3],
            4,
            4,  # the optimizer's steps came back with the checkpoint: 3 + this one
        )
    for version, batch_id in enumerate(batch_ids, start=1):
        assert [(c["consumer"], c["policy_version_trained"]) for c in acked[batch_id]] == [
            ("trainer", version)
        ]
    lineage = json.loads((checkpoints / "update-00000004" / "lineage.json").read_text())
    assert lineage["batches"] == [[b, v] for v, b in enumerate(batch_ids, start=1)]
    assert sorted(p.name for p in checkpoints.glob("update-*")) == [
        "update-00000003",
        "update-00000004",
    ]

    # version 1's full weights (gathered from the shards) are one process's update on batch 0
    single = PolicyTrainer(
        TrainerSettings(
            **{k.removeprefix("TRAJGATE_TRAINER_").lower(): v for k, v in trainer_env.items()}
        )
    )
    initial = {k: v.clone() for k, v in single.model.state_dict().items()}
    single.update(train_batch(read_rows(get_batch(store, batch_ids[0])), pad_token_id=0))
    got = load_file(str(tmp_path / "weights" / "policy-v1" / "model.safetensors"))
    expected = single.model.state_dict()
    # a tied output head is written once, as the embedding (save_pretrained's layout)
    tied = bool(single.model.config.tie_word_embeddings)
    assert sorted(got) == sorted(k for k in expected if not (tied and k == "lm_head.weight"))
    moved = max(float((expected[k] - initial[k]).abs().max()) for k in got)
    assert moved > 5e-4  # the update did something worth comparing (lr 1e-3)
    for key, value in got.items():
        torch.testing.assert_close(value, expected[key], atol=WEIGHT_TOLERANCE / 10, rtol=0)


def test_torchrun_gives_the_batch_back_when_its_update_cannot_be_published(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Publish before ack, as ``trajgate train`` does: with vLLM unreachable and no checkpoints,
    rank 0 tries the publish ``publish_attempts`` (2) times, gives the batch back (nack) and
    both ranks stop with ``PublishFailedError``; the batch is ready again, unconsumed, and no
    version or metrics were registered (rank 0 acked first: the batch was consumed while its
    update died with the process)."""
    url = f"sqlite:///{tmp_path / 'pool.sqlite3'}"
    upgrade(url)
    pool = PoolSettings(data_dir=tmp_path / "data", database_url=url)
    store = make_store(pool)
    for member in range(2):
        write_trajectory(
            store, f"t{member}", agent_turns(member + 1, 2), group_id="g", reward=member
        )
    batch_settings = BatchSettings(batch_uri=str(tmp_path / "batches"))
    batch = materialise(store, BatchSpec(algorithm="grpo", group_size=2), batch_settings)
    gateway = BackgroundServer(
        create_app(GatewaySettings(upstream_url="http://127.0.0.1:9", port=free_port()), pool),
        port=free_port(),
    ).start()
    try:
        done, reports = _torchrun(
            {
                "TRAJGATE_TRAINER_MODEL_DIR": str(tiny_model_dir),
                "TRAJGATE_TRAINER_DEVICE": "cpu",
                "TRAJGATE_TRAINER_LORA_RANK": "4",
                "TRAJGATE_TRAINER_POOL_URL": gateway.url,
                "TRAJGATE_TRAINER_VLLM_URLS": f"http://127.0.0.1:{free_port()}",  # nobody there
                "TRAJGATE_TRAINER_WEIGHTS_DIR": str(tmp_path / "weights"),
                "TRAJGATE_TRAINER_PUBLISH_ATTEMPTS": "2",
                "TRAJGATE_TRAINER_PUBLISH_RETRY_S": "0.05",
                "TRAJGATE_TRAINER_MAX_UPDATES": "1",
                "TRAJGATE_TRAINER_IDLE_WAIT_S": "0.2",
            }
        )
        detail = httpx.get(f"{gateway.url}/api/batches/{batch.id}", timeout=30).json()
        versions = httpx.get(f"{gateway.url}/admin/policy-versions", timeout=30).json()
        posted = httpx.get(f"{gateway.url}/api/training-metrics", timeout=30).json()
    finally:
        gateway.stop()
    assert done.returncode != 0
    assert reports == {}  # neither rank finished
    assert "PublishFailedError" in done.stderr and "failed 2 times" in done.stderr
    assert "try 2 of 2" in done.stderr  # rank 0 said the retry
    assert (detail["status"], detail["consumed_by"], detail["leases"]) == ("ready", [], 1)
    assert versions == [] and posted == []
