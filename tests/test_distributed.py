"""The trainer under ``torchrun`` (gloo, 2 processes on CPU): rank 0 leases one batch from a
gateway, each rank trains on its share, gradients are summed over the ranks, rank 0 acks once,
and the resulting LoRA weights equal those of one process updating on the whole batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import torch
from batch_helpers import agent_turns, make_store, write_trajectory
from deployment_helpers import compose_service_env
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from tests_support import free_port

from datapool.batches.build import BatchSpec, get_batch, materialise, read_rows
from datapool.batches.settings import BatchSettings
from datapool.db import upgrade
from datapool.settings import PoolSettings
from gateway.app import create_app
from gateway.server import BackgroundServer
from gateway.settings import GatewaySettings
from trainer_bridge.client import train_batch
from trainer_bridge.collate import Row
from trainer_bridge.distributed import shard_rows
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.trainer import PolicyTrainer

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# float32 sums in another order (two shards, other padding widths, other thread counts): far
# below the update itself (> 1e-3, asserted)
WEIGHT_TOLERANCE = 1e-5


def test_shard_rows_gives_each_rank_every_other_row_longest_first() -> None:
    rows = [Row([1] * n, [1] * n, [0.0] * n, 1.0) for n in (3, 7, 5, 2, 6)]
    # lengths sorted: 7, 6, 5, 3, 2 -> rank 0: 7, 5, 2; rank 1: 6, 3
    assert [len(r.input_ids) for r in shard_rows(rows, 0, 2)] == [7, 5, 2]
    assert [len(r.input_ids) for r in shard_rows(rows, 1, 2)] == [6, 3]


def test_torchrun_two_ranks_update_equals_the_single_process_update(
    tiny_model_dir: Path, tmp_path: Path
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
    gateway = BackgroundServer(
        create_app(GatewaySettings(upstream_url="http://127.0.0.1:9", port=free_port()), pool),
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
                "TRAJGATE_TRAINER_VLLM_URLS": "",  # publishing is tested in test_trainer_bridge
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
    finally:
        gateway.stop()
    reports = {
        r["rank"]: r
        for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    }
    assert sorted(reports) == [0, 1]
    assert [u["batch_id"] for u in reports[0]["updates"]] == [batch.id]
    assert [u["batch_id"] for u in reports[1]["updates"]] == [batch.id]
    assert [c["consumer"] for c in detail["consumed_by"]] == ["trainer"]  # acked once

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
    for rank in (0, 1):
        update = reports[rank]["updates"][0]
        assert abs(update["loss"] - metrics.loss) < 1e-6
        assert abs(update["grad_norm"] - metrics.grad_norm) < 1e-5
        assert update["tokens"] == metrics.tokens
    # rank 0 alone posted the update's metrics, under the consumer id and the published version
    [row] = posted
    assert (row["run"], row["policy_version"], row["step"]) == ("trainer", 1, 1)
    assert abs(row["metrics"]["loss"] - metrics.loss) < 1e-6
