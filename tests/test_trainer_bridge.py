"""The trainer on the tiny model: updates move every parameter the right way; a LoRA pushed into
the real vLLM changes what it samples, the next steps carry the new policy version, and the
trainer's logprobs of vLLM's sampled tokens match vLLM's behaviour logprobs."""

from __future__ import annotations

import math
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from gateway_helpers import gateway_with, steps_of
from tests_support import free_port

from datapool.settings import PoolSettings
from gateway.server import BackgroundServer
from trainer_bridge.collate import Row, collate, row_from_step
from trainer_bridge.logprobs import token_logprobs
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.sync import WeightSync
from trainer_bridge.trainer import PolicyTrainer, TrainBatch
from trajgate.vllm_server import VLLMServer

PAD_ID = 0
# Mean |trainer - vLLM| logprob of sampled tokens, in nats, on the CPU build with --dtype float32.
# Measured: 1.5e-7 on the base weights, 4.8e-8 with a LoRA adapter (bf16 serving gave 9.3e-4).
BASE_GAP_TOLERANCE = 1e-5
LORA_GAP_TOLERANCE = 1e-5


def _sample(vllm: VLLMServer, prompt: str, seed: int, model: str = "tiny") -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": seed,
        "return_token_ids": True,
        "logprobs": 1,
    }
    choice: dict[str, Any] = httpx.post(
        f"{vllm.url}/v1/completions", json=body, timeout=120
    ).json()["choices"][0]
    return choice


def _rows(vllm: VLLMServer, advantages: list[float]) -> list[Row]:
    rows = []
    for seed, advantage in enumerate(advantages):
        choice = _sample(vllm, "The weather in Paris is", seed)
        rows.append(
            row_from_step(
                choice["prompt_token_ids"],
                choice["token_ids"],
                choice["logprobs"]["token_logprobs"],
                advantage,
            )
        )
    return rows


def _objective(trainer: PolicyTrainer, batch: TrainBatch) -> float:
    """sum_t A * logp(token_t) over sampled tokens: what the update should increase."""
    logprobs = trainer.logprobs(batch)
    return float((logprobs * batch.advantages[:, None] * batch.loss_mask).sum())


def test_full_update_changes_every_parameter_and_raises_the_objective(
    vllm: VLLMServer, tiny_model_dir: Path
) -> None:
    trainer = PolicyTrainer(
        TrainerSettings(
            model_dir=tiny_model_dir, lora_rank=0, learning_rate=1e-3, micro_batch_rows=2
        )
    )
    batch = collate(_rows(vllm, [1.0, -1.0, 1.0, -1.0]), PAD_ID)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    objective_before = _objective(trainer, batch)
    metrics = trainer.update(batch)
    unchanged = [
        name
        for name, p in trainer.model.named_parameters()
        if torch.equal(before[name], p.detach())
    ]
    assert unchanged == []
    assert _objective(trainer, batch) > objective_before
    assert metrics.tokens == 4 * 12 and metrics.grad_norm > 0
    print(
        f"logprob gap on base weights: mean {metrics.logprob_gap_mean_abs:.2e}, "
        f"max {metrics.logprob_gap_max_abs:.2e}"
    )
    assert metrics.logprob_gap_mean_abs < BASE_GAP_TOLERANCE


def test_lora_updates_reach_every_adapter_weight_and_nothing_else(
    vllm: VLLMServer, tiny_model_dir: Path
) -> None:
    trainer = PolicyTrainer(
        TrainerSettings(model_dir=tiny_model_dir, lora_rank=4, learning_rate=1e-2)
    )
    batch = collate(_rows(vllm, [1.0, -1.0]), PAD_ID)
    named = dict(trainer.model.named_parameters())
    before = {name: p.detach().clone() for name, p in named.items()}
    trainer.update(batch)
    trainer.update(batch)  # LoRA B starts at 0, so A only gets a gradient from the 2nd step
    changed = {name for name, p in named.items() if not torch.equal(before[name], p.detach())}
    trainable = {name for name, p in named.items() if p.requires_grad}
    assert changed == trainable
    assert all("lora_" in name for name in trainable)


def _on_policy_batch(trainer: PolicyTrainer) -> TrainBatch:
    """Two rows of fixed token ids whose behaviour logprobs are the trainer's own (gap 0)."""
    rows = [
        row_from_step([5, 9, 13], [21, 34, 55], [0.0] * 3, 1.0),
        row_from_step([7, 11], [89, 144], [0.0] * 2, -1.0),
    ]
    batch = collate(rows, PAD_ID)
    own = trainer.logprobs(batch) * batch.loss_mask  # [B, T]
    return TrainBatch(batch.input_ids, batch.attention_mask, batch.loss_mask, own, batch.advantages)


def _k3_token_mean(policy: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """k3 = e^d - d - 1 with d = ref - logp, averaged over the loss tokens (losses.py)."""
    d = (reference - policy)[mask.bool()]
    return float((d.exp() - d - 1).mean())


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_kl_penalty_measures_the_distance_to_the_frozen_starting_policy(
    tiny_model_dir: Path, lora_rank: int
) -> None:
    # The reference is the starting policy (LoRA: the adapter off; full: a frozen copy), so the
    # first update's KL is exactly 0; after updates the reference has not moved while the policy
    # has, and the reported KL is k3 of the policy's pre-update logprobs against the reference.
    trainer = PolicyTrainer(
        TrainerSettings(
            model_dir=tiny_model_dir, lora_rank=lora_rank, learning_rate=1e-2, kl_coef=0.1
        )
    )
    batch = _on_policy_batch(trainer)
    start = trainer.logprobs(batch)  # [B, T]
    first = trainer.update(batch)
    assert first.kl == 0.0 and first.step == 1
    trainer.update(batch)  # LoRA's B starts at 0: the adapter moves the logprobs from step 2
    before_third = trainer.logprobs(batch)
    reference = trainer.reference_logprobs(batch)
    assert torch.allclose(reference, start, atol=1e-6)
    assert not torch.allclose(before_third, start, atol=1e-3)
    third = trainer.update(batch)
    expected = _k3_token_mean(before_third, reference, batch.loss_mask)
    assert third.kl is not None and third.kl > 0
    assert third.kl == pytest.approx(expected, rel=1e-4)
    assert third.step == 3
    if lora_rank == 0:  # the copy is frozen and not optimised
        assert not any(p.requires_grad for p in trainer.reference.parameters())


def test_kl_is_left_out_of_the_metrics_when_no_reference_is_kept(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(TrainerSettings(model_dir=tiny_model_dir, lora_rank=0))
    metrics = trainer.update(_on_policy_batch(trainer))
    assert metrics.kl is None and "kl" not in metrics.as_dict()
    assert trainer.reference is None
    with pytest.raises(ValueError, match="kl_coef > 0"):
        trainer.reference_logprobs(_on_policy_batch(trainer))


def test_collate_pads_right_longest_first_and_masks_only_sampled_tokens() -> None:
    rows = [row_from_step([1, 2], [3], [-0.5], 1.0), row_from_step([4, 5, 6], [7, 8], [-1, -2], -1)]
    batch = collate(rows, pad_token_id=0)
    assert batch.input_ids.tolist() == [[4, 5, 6, 7, 8], [1, 2, 3, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.behaviour_logprobs.tolist() == [[0, 0, 0, -1, -2], [0, 0, -0.5, 0, 0]]
    assert batch.advantages.tolist() == [-1.0, 1.0]
    with pytest.raises(ValueError, match="ids_incomplete"):
        row_from_step([1], [2, 3], [-0.1], 1.0)


def test_lora_hot_load_changes_sampling_and_the_next_steps_carry_the_new_version(
    vllm: VLLMServer,
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    prefix = f"test-{secrets.token_hex(4)}"  # the shared vLLM may serve other runs' adapters
    sync = WeightSync(gateway.url, base_model_name=vllm.served_model_name, adapter_prefix=prefix)
    sync.register(0, vllm.served_model_name, str(tiny_model_dir))
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    url = f"{gateway.url}/t/sync/v1/chat/completions"
    before = httpx.post(url, json=body, timeout=120).json()["choices"][0]["message"]["content"]

    trainer = PolicyTrainer(
        TrainerSettings(model_dir=tiny_model_dir, lora_rank=8, learning_rate=5e-2)
    )
    batch = collate(_rows(vllm, [1.0, -1.0, 1.0, -1.0]), PAD_ID)
    for _ in range(3):
        trainer.update(batch)
    adapter_dir = trainer.save_for_vllm(tmp_path / "adapter-v1")
    published = sync.publish(1, adapter_dir, "lora")
    assert published.model_name == f"{prefix}-v1"

    after_response = httpx.post(url, json=body, timeout=120)
    after = after_response.json()["choices"][0]["message"]["content"]
    assert after_response.headers["x-trajgate-policy-version"] == "1"
    assert after != before
    first, second = steps_of(pool_settings, "sync")
    assert (first.policy_version, second.policy_version) == (0, 1)
    assert second.upstream_request["model"] == published.model_name

    # The sampler/trainer mismatch: trainer logprobs of the tokens vLLM sampled with the adapter.
    row = row_from_step(
        second.prompt_token_ids, second.response_token_ids, second.response_logprobs, 0.0
    )
    new_batch = collate([row], PAD_ID)
    trainer_logprobs = trainer.logprobs(new_batch)
    mask = new_batch.loss_mask.bool()
    gap = (trainer_logprobs - new_batch.behaviour_logprobs).abs()[mask]
    print(f"logprob gap with LoRA v1: mean {float(gap.mean()):.2e}, max {float(gap.max()):.2e}")
    assert float(gap.mean()) < LORA_GAP_TOLERANCE
    # Its directory goes with tmp_path: released through the gateway, active as it is.
    assert sync.release_adapters(include_active=True) == {vllm.url: [published.model_name]}
    sync.close()


def test_token_logprobs_align_position_t_with_token_t(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 13, 2]])
    logprobs, entropy = token_logprobs(model, ids, torch.ones_like(ids), with_entropy=True)
    logits = model(input_ids=ids).logits
    expected = torch.log_softmax(logits[0, 1], dim=-1)[13]  # token 13 at position 2, from pos 1
    assert float(logprobs[0, 2].detach()) == pytest.approx(float(expected), abs=1e-5)
    assert float(logprobs[0, 0]) == 0.0 and entropy is not None and float(entropy[0, 0]) == 0.0


def test_constrained_steps_carry_masked_logprobs_and_are_flagged(
    gateway: BackgroundServer, pool_settings: PoolSettings, tiny_model_dir: Path
) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    base = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Weather?"}],
        "max_tokens": 48,
        "temperature": 1.0,
    }
    url = f"{gateway.url}/t/constrained/v1/chat/completions"
    forced = {
        **base,
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    assert httpx.post(url, json=forced, timeout=120).is_success
    assert httpx.post(url, json=base, timeout=120).is_success
    trainer = PolicyTrainer(TrainerSettings(model_dir=tiny_model_dir, lora_rank=0))
    gaps = []
    for step in steps_of(pool_settings, "constrained"):
        batch = collate(
            [
                row_from_step(
                    step.prompt_token_ids, step.response_token_ids, step.response_logprobs, 0.0
                )
            ],
            PAD_ID,
        )
        mask = batch.loss_mask.bool()
        gaps.append(float((trainer.logprobs(batch) - batch.behaviour_logprobs).abs()[mask].mean()))
    constrained_step, free_step = steps_of(pool_settings, "constrained")
    assert "constrained" in constrained_step.flags and "constrained" not in free_step.flags
    # Masked logprobs (forced tokens at 0) are far from the policy's own; free sampling matches.
    assert gaps[0] > 1.0 and gaps[1] < BASE_GAP_TOLERANCE


def test_train_loop_leases_trains_acks_and_publishes_the_next_version(
    vllm: VLLMServer,
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    from trainer_bridge.loop import LoopSettings, run_loop

    prefix = f"loop-{secrets.token_hex(4)}"  # the shared vLLM may serve other runs' adapters
    api = httpx.Client(base_url=gateway.url, timeout=120)
    WeightSync(gateway.url).register(0, vllm.served_model_name, str(tiny_model_dir))
    # One group of 4 rollouts of the same task, rewarded 1, 0, 0.5, 0.25 through the API.
    sampled_tokens = 0
    for member, reward in enumerate([1.0, 0.0, 0.5, 0.25]):
        trajectory = f"loop-{member}"
        api.post("/api/trajectories", json={"id": trajectory, "group_id": "loop-g"})
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": "Temperature?"}],
            "max_tokens": 6,
            "temperature": 1.0,
        }
        answered = api.post(f"/t/{trajectory}/v1/chat/completions", json=body)
        assert answered.is_success, answered.text
        sampled_tokens += answered.json()["usage"]["completion_tokens"]
        api.post(
            f"/api/trajectories/{trajectory}/complete", json={"reward": reward}
        ).raise_for_status()
    # Up to 6 tokens each: a rollout sampled at temperature 1 may end early (CI saw 22 of 24).
    assert 4 <= sampled_tokens <= 4 * 6
    loop = LoopSettings(
        gateway_url=gateway.url,
        consumer="loop-test",
        spec={"channel": "train", "algorithm": "grpo", "group_size": 4},
        max_updates=1,
        adapter_dir=tmp_path,
        adapter_prefix=prefix,
    )
    settings = TrainerSettings(model_dir=tiny_model_dir, learning_rate=1e-2, kl_coef=0.05)
    metrics = run_loop(loop, settings, say=lambda _: None)
    assert len(metrics) == 1 and metrics[0]["policy_version"] == 1.0
    assert metrics[0]["tokens"] == sampled_tokens
    # The update's metrics reached the pool for the inspector's training chart.
    [posted] = api.get("/api/training-metrics", params={"run": "loop-test"}).json()
    assert (posted["policy_version"], posted["step"]) == (1, 1)
    values = posted["metrics"]
    assert {
        "loss",
        "kl",
        "clip_fraction",
        "entropy_mean",
        "logprob_gap_mean_abs",
        "grad_norm",
        "tokens_per_s",
        "policy_version",
    } <= set(values)
    assert all(math.isfinite(v) for v in values.values())
    assert values["policy_version"] == 1.0 and values["tokens"] == sampled_tokens
    assert values["kl"] == 0.0  # the first update starts at the reference (adapter B = 0)
    assert values["grad_norm"] > 0 and values["tokens_per_s"] > 0
    assert values["entropy_mean"] > 0
    assert values["logprob_gap_mean_abs"] < LORA_GAP_TOLERANCE
    # A spec naming an algorithm the trainer cannot run is refused before anything is built.
    refused = api.post("/api/batches", json={"algorithm": "ppo"})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "algorithm"
    assert "'grpo', 'rloo', 'reinforce_pp' or 'sft'; got 'ppo'" in error["message"]
    versions = api.get("/admin/policy-versions").json()
    assert [(v["version"], v["active"]) for v in versions] == [(0, False), (1, True)]
    batches = api.get("/api/batches").json()
    assert len(batches) == 1
    # The ack names the version the update produced, as the distributed trainer's does.
    [consumed] = api.get(f"/api/batches/{batches[0]['id']}").json()["consumed_by"]
    assert (consumed["consumer"], consumed["policy_version_trained"]) == ("loop-test", 1)
    after = api.post("/t/loop-after/v1/chat/completions", json=body)
    assert after.headers["x-trajgate-policy-version"] == "1"
    WeightSync(gateway.url, adapter_prefix=prefix).release_adapters(include_active=True)


def test_train_loop_gives_the_batch_back_when_its_update_cannot_be_published(
    vllm: VLLMServer,
    gateway: BackgroundServer,
    pool_settings: PoolSettings,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    """Publish before ack: with vLLM unreachable from the gateway that publishes (a second
    gateway on the same pool, whose replica nothing listens at), the update is tried
    ``publish_attempts`` times (502 ``weight_update_failed`` each), the batch goes back to the
    pool unconsumed and no version is registered (acking first consumed the batch while its
    update died with the process)."""
    from trainer_bridge.loop import LoopSettings, PublishFailedError, run_loop

    api = httpx.Client(base_url=gateway.url, timeout=120)
    WeightSync(gateway.url).register(0, vllm.served_model_name, str(tiny_model_dir))
    for member, reward in enumerate([1.0, 0.0]):
        trajectory = f"unpublished-{member}"
        api.post("/api/trajectories", json={"id": trajectory, "group_id": "unpublished-g"})
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": "Temperature?"}],
            "max_tokens": 4,
            "temperature": 1.0,
        }
        assert api.post(f"/t/{trajectory}/v1/chat/completions", json=body).is_success
        api.post(
            f"/api/trajectories/{trajectory}/complete", json={"reward": reward}
        ).raise_for_status()
    said: list[str] = []
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with gateway_with(pool_settings, free_port(), upstream_url=unreachable) as publisher:
        loop = LoopSettings(
            gateway_url=publisher.url,
            consumer="unpublished",
            spec={"channel": "train", "algorithm": "grpo", "group_size": 2},
            max_updates=1,
            adapter_dir=tmp_path,
            adapter_prefix="unpublished",
            publish_attempts=2,
            publish_retry_s=0.05,
        )
        settings = TrainerSettings(model_dir=tiny_model_dir, learning_rate=1e-2)
        with pytest.raises(PublishFailedError, match="failed 2 times") as failed:
            run_loop(loop, settings, say=said.append)
    assert len(said) == 1 and "try 2 of 2" in said[0]
    assert "502" in str(failed.value.__cause__) and "weight_update_failed" in said[0]
    [batch] = api.get("/api/batches").json()
    assert batch["status"] == "ready", batch
    # Still leasable by the next trainer; and no version 1 was registered.
    assert api.post(
        "/api/batches/lease", json={"consumer": "next", "batch_id": batch["id"]}
    ).is_success
    versions = api.get("/admin/policy-versions").json()
    assert [v["version"] for v in versions] == [0]
    assert not api.get("/api/training-metrics", params={"run": "unpublished"}).json()
    api.close()
