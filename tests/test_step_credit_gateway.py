"""Step-level credit end to end, on SQLite and PostgreSQL: real agents call the real vLLM
through the gateway, revisiting one state (a greedy first answer, then the same tool result);
the real completion hooks run a step reward function on every step; a batch with step rewards
and anchor-state grouping (GiGPO) materialises with the anchor sub-groups and hand-derived
advantages; the trainer trains on its rows (loss finite, every LoRA weight moves)."""

from __future__ import annotations

import math
import time
from typing import Any

import httpx
import pytest
import torch
from gateway_helpers import gateway_with
from tests_support import free_port

from datapool.settings import PoolSettings
from trainer_bridge.client import PoolClient, train_batch
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.trainer import PolicyTrainer
from trajgate.vllm_server import VLLMServer

TASK = [{"role": "user", "content": "Find the weather in Paris, then report it."}]


def rollout(api: httpx.Client, trajectory_id: str, seed: int) -> None:
    """Three turns: a greedy first answer (the same in every rollout), the same tool result,
    then sampled answers (a different seed per rollout)."""
    messages: list[dict[str, Any]] = list(TASK)
    for turn in range(3):
        sampling = {"temperature": 0} if turn == 0 else {"temperature": 1.0, "seed": seed}
        response = api.post(
            f"/t/{trajectory_id}/v1/chat/completions",
            json={"model": "tiny", "messages": messages, "max_tokens": 8, **sampling},
            headers={"X-Trajgate-Group": "weather"},
        )
        assert response.status_code == 200, response.text
        content = response.json()["choices"][0]["message"]["content"]
        observation = "sunny, 21 C" if turn == 0 else f"result of attempt {seed}.{turn}"
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": observation},
        ]


def wait_for_step_rewards(api: httpx.Client, trajectory_id: str, steps: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        history = api.get("/api/rewards", params={"trajectory_id": trajectory_id}).json()
        if sum(1 for r in history if r["target"] == "step") >= steps:
            return
        time.sleep(0.2)  # the complete endpoint woke the hooks; they run after it
    raise AssertionError(f"the step rewards of {trajectory_id} never landed: {history}")


def test_revisited_states_of_real_rollouts_form_anchor_sub_groups_and_the_rows_train(
    vllm: VLLMServer, pool_settings: PoolSettings, tiny_model_dir: Any
) -> None:
    pool = pool_settings.model_copy(
        update={"step_reward_functions": ["pool_reward_fns:step_position"]}
    )
    with (
        gateway_with(pool, free_port(), upstream_url=vllm.url) as server,
        httpx.Client(base_url=server.url, timeout=120) as api,
    ):
        for i, reward in enumerate([1.0, 0.0, 1.0]):
            rollout(api, f"w-{i}", seed=i + 1)
            done = api.post(f"/api/trajectories/w-{i}/complete", json={"reward": reward})
            assert done.status_code == 200, done.text
        for i in range(3):
            wait_for_step_rewards(api, f"w-{i}", steps=3)
        ready = api.get(
            "/api/trajectories/w-0/readiness", params={"step_reward_name": "step_position"}
        ).json()
        assert ready["ready"] is True and len(ready["step_rewards"]) == 3
        waiting = api.get(
            "/api/groups/weather/readiness", params={"step_reward_name": "judge"}
        ).json()
        assert waiting["ready"] is False  # nobody posted 'judge': missing is not 0
        assert all(len(m["unrewarded_steps"]) == 3 for m in waiting["members"])
        lacking = [v for m in waiting["members"] for v in m["unrewarded_steps"].values()]
        assert lacking == [["judge"]] * 9
        created = api.post(
            "/api/batches",
            json={
                "name": "gigpo",
                "step_reward_names": ["step_position"],
                "step_advantage": "anchor_state",
                "gamma": 0.5,
                "scale_by_std": False,
            },
        )
        assert created.status_code == 201, created.text
        batch = created.json()
        anchor = batch["manifest"]["step_credit"]["anchor"]
        # steps 0 (the task) and 1 (greedy answer + the same tool result) of all three rollouts
        # share their state; the sampled third turns do not
        assert anchor["subgroup_sizes"] == {"3": 2}
        assert anchor["steps_in_subgroups"] == 6 and anchor["steps_alone"] == 3
        with PoolClient(server.url) as client:
            lease = client.lease("trainer-0", lease_s=600, batch_id=batch["id"])
            assert lease is not None
            table = client.rows(lease.batch_id)
            rows = table.to_pylist()
            step_index = {
                step_id: api.get(f"/api/steps/{step_id}").json()["step_index"]
                for r in rows
                for step_id in r["step_ids"]
            }
            # step_position gives r_k = 0.25 k; gamma 0.5, R on the last step:
            # R = 1: G_2 = 0.5 + 1 = 1.5, G_1 = 0.25 + 0.5 * 1.5 = 1.0, G_0 = 0.5 * 1.0 = 0.5
            # R = 0: G_2 = 0.5, G_1 = 0.25 + 0.25 = 0.5, G_0 = 0.25
            # sub-group of steps 0 {0.5, 0.25, 0.5}: mean 5/12 -> A^S = +1/12, -1/6, +1/12;
            # steps 1 {1, 0.5, 1}: mean 5/6 -> +1/6, -1/3, +1/6; steps 2 alone -> 0.
            # grpo without std on R = [1, 0, 1]: mean 2/3 -> A^E = +1/3, -2/3, +1/3.
            step_part = {(1.0, 0): 1 / 12, (0.0, 0): -1 / 6, (1.0, 1): 1 / 6, (0.0, 1): -1 / 3}
            for r in rows:
                k = step_index[r["step_ids"][0]]
                episode = 1 / 3 if r["reward"] == 1.0 else -2 / 3
                assert r["step_return"] == pytest.approx(
                    {0: 0.5, 1: 1.0, 2: 1.5}[k]
                    if r["reward"] == 1.0
                    else {0: 0.25, 1: 0.5, 2: 0.5}[k]
                )
                assert r["process_reward"] == 0.25 * k
                assert r["anchor_group_size"] == (3 if k < 2 else 1)
                expected = episode + step_part.get((r["reward"], k), 0.0)
                assert r["advantage"] == pytest.approx(expected), (k, r["reward"])

            trainer = PolicyTrainer(
                TrainerSettings(model_dir=tiny_model_dir, lora_rank=4, learning_rate=1e-2)
            )
            tensors = train_batch(table, pad_token_id=0)
            named = dict(trainer.model.named_parameters())
            before = {name: p.detach().clone() for name, p in named.items()}
            losses = [trainer.update(tensors).loss for _ in range(2)]  # LoRA B starts at 0
            assert all(math.isfinite(loss) for loss in losses)
            changed = {n for n, p in named.items() if not torch.equal(before[n], p.detach())}
            assert changed == {n for n, p in named.items() if p.requires_grad}
            client.ack(lease, policy_version_trained=1)
