"""Behaviour logprobs of the distribution that sampled (invariant 9), on the real
vLLM run as ``trajgate vllm start`` runs it (``--logprobs-mode processed_logprobs``).

A row sampled at temperature 0.6 must store log pi(a | s) = log_softmax(logits / 0.6)[a], which
the test computes itself from the tiny model's weights with transformers (float32), and the
trainer, dividing the row's logits by its temperature, must find the same values (importance
ratio exp(old - behaviour) = 1 on the first update). vLLM's default raw logprobs are
log_softmax(logits)[a], temperature 1: ~0.1-1 nats away here, so the comparison fails on them.

A row sampled with top-p 0.8 is narrowed: with the channel policy 'override' the gateway sends
top_p 1.0 (recorded) and the row is an ordinary temperature-0.6 row; with 'flag' (default) vLLM
samples the nucleus, stores the logprobs of that truncated distribution (checked against a
nucleus computed here), and the step is flagged ``narrowed``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from batch_helpers import make_store
from gateway_helpers import gateway_with, steps_of
from tests_support import free_port

from datapool.batches.build import build_rows
from datapool.batches.spec import BatchSpec
from datapool.settings import PoolSettings
from trainer_bridge.client import train_batch
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.trainer import PolicyTrainer
from trajgate.vllm_server import VLLMServer

# |stored - recomputed| per token, in nats: the CPU build in float32 (measured ~1e-7).
TOLERANCE = 1e-5
TEMPERATURE = 0.6
TOP_P = 0.8
PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]


def _logits(model: Any, step: Any) -> torch.Tensor:
    """The logits ``[R, V]`` that predicted each response token of ``step``."""
    prompt, response = step.prompt_token_ids, step.response_token_ids
    ids = torch.tensor([prompt + response])  # [1, P + R]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [P + R, V]
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1]  # [R, V]


def _picked(log_probs: torch.Tensor, step: Any) -> torch.Tensor:
    return log_probs.gather(-1, torch.tensor(step.response_token_ids)[:, None])[:, 0]  # [R]


def _nucleus_log_softmax(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """log_softmax over the smallest set of tokens whose probability reaches ``top_p`` (the
    rest at -inf), as vLLM's ``apply_top_k_top_p``: drop the least likely tokens while the
    cumulative probability from the bottom stays <= 1 - top_p, never the most likely."""
    ascending, order = logits.sort(dim=-1)  # [R, V]
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    masked = torch.full_like(logits, float("-inf")).scatter(
        -1, order, ascending.masked_fill(drop, float("-inf"))
    )
    return masked.log_softmax(dim=-1)


def _call(url: str, trajectory: str, channel: str, stream: bool, **fields: Any) -> None:
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 12, "seed": 3, **fields}
    response = httpx.post(
        f"{url}/t/{trajectory}/v1/chat/completions",
        json={**body, "stream": stream},
        headers={"X-Trajgate-Channel": channel},
        timeout=120,
    )
    assert response.status_code == 200, response.text


def test_behaviour_logprobs_are_those_of_the_sampling_temperature_and_train_at_ratio_one(
    vllm: VLLMServer, tiny_model_dir: Path, sqlite_pool: PoolSettings
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with gateway_with(
        sqlite_pool,
        free_port(),
        upstream_url=vllm.url,
        sampling_policy={"override": "override", "strict": "refuse"},
    ) as gateway:
        for stream in (False, True):
            _call(gateway.url, f"t06-{stream}", "train", stream, temperature=TEMPERATURE)
        _call(gateway.url, "topp-override", "override", True, temperature=TEMPERATURE, top_p=TOP_P)
        _call(gateway.url, "topp-flag", "train", False, temperature=TEMPERATURE, top_p=TOP_P)
        refused = httpx.post(
            f"{gateway.url}/t/topp-refused/v1/chat/completions",
            json={"model": "tiny", "messages": PROMPT, "max_tokens": 4, "top_p": TOP_P},
            headers={"X-Trajgate-Channel": "strict"},
            timeout=60,
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "top_p"
        assert refused.json()["error"]["code"] == "sampling_refused"
        for trajectory in ("t06-False", "t06-True", "topp-override", "topp-flag"):
            complete = httpx.post(
                f"{gateway.url}/api/trajectories/{trajectory}/complete",
                json={"reward": 1.0 if "True" in trajectory else 0.0},
                timeout=30,
            )
            assert complete.is_success, complete.text

    at_temperature = [
        *steps_of(sqlite_pool, "t06-False"),
        *steps_of(sqlite_pool, "t06-True"),
        *steps_of(sqlite_pool, "topp-override"),
    ]
    assert len(at_temperature) == 3 and steps_of(sqlite_pool, "topp-refused") == []
    for step in at_temperature:
        stored = torch.tensor(step.response_logprobs)  # [R]
        logits = _logits(model, step)  # [R, V]
        expected = _picked(torch.log_softmax(logits / TEMPERATURE, dim=-1), step)  # [R]
        raw = _picked(torch.log_softmax(logits, dim=-1), step)  # [R]: vLLM's default
        assert float((stored - expected).abs().max()) < TOLERANCE, (
            "not the logprobs of temperature 0.6: does this vLLM run --logprobs-mode "
            "processed_logprobs (trajgate vllm start does)? Restart it, or leave "
            "TRAJGATE_TEST_VLLM_PORT unset"
        )
        assert float((stored - raw).abs().max()) > 100 * TOLERANCE  # the test can fail
        assert step.sampling["logprobs_temperature"] == TEMPERATURE
        assert "narrowed" not in step.flags and "raw_logprobs" not in step.flags

    overridden = at_temperature[2]
    assert overridden.upstream_request["top_p"] == 1.0
    assert overridden.sampling["replaced"] == {"top_p": TOP_P}
    assert overridden.sampling["policy"] == "override"

    (narrowed,) = steps_of(sqlite_pool, "topp-flag")
    assert "narrowed" in narrowed.flags and narrowed.sampling["narrowed_by"] == ["top_p"]
    nucleus = _nucleus_log_softmax(_logits(model, narrowed) / TEMPERATURE, TOP_P)  # [R, V]
    stored = torch.tensor(narrowed.response_logprobs)
    assert float((stored - _picked(nucleus, narrowed)).abs().max()) < TOLERANCE

    # The rows of the temperature-0.6 steps carry 0.6; trained on, their ratio is 1.
    store = make_store(sqlite_pool)
    spec = BatchSpec(algorithm="reinforce_pp", exclude_batched=False)
    table, _ = build_rows(store, spec)
    rows = {r["trajectory_id"]: r for r in table.to_pylist()}
    assert set(rows) >= {"t06-False", "t06-True"}
    for trajectory in ("t06-False", "t06-True"):
        assert rows[trajectory]["temperature"] == pytest.approx(TEMPERATURE)
        assert '"logprobs_temperature": 0.6' in rows[trajectory]["sampling_json"]
    chosen = table.filter(
        [t in ("t06-False", "t06-True") for t in table["trajectory_id"].to_pylist()]
    )
    trainer = PolicyTrainer(TrainerSettings(model_dir=tiny_model_dir, lora_rank=0))
    metrics = trainer.update(train_batch(chosen, pad_token_id=0))
    # exp(old - behaviour) on every sampled token, before the update: 1 within 1e-5.
    assert metrics.logprob_gap_max_abs < TOLERANCE
