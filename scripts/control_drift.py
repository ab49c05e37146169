"""How far one update moves the SmolLM2 demo's policy towards calling the tool: with the real
rewards (the trained arm) and with shuffled ones (the control), per learning rate.

Reads a batch of a SmolLM2 demo pool (``trajgate demo --model smollm2``: the first update's
batch, ``train-v0``), then for each learning rate given: one update of the real trainer
(``PolicyTrainer``, LoRA rank 8, AdamW, the demo's settings) from the base weights with the
batch's GRPO advantages, and one per shuffle with the rewards permuted across the batch before
the advantages (``trajgate.demo.shuffled_rewards``, the control's rule). Each is measured on the
batch's own first-turn prompts, exactly (no sampling): the probability that the first turn opens
a calculator call (its first tokens are ``CALL_OPENING``, as every sampled call's are),
averaged over the prompts, before and after: the call rate, which the correctness reward
follows (a call's answer is right; a direct one is not). Prints one JSON object.

    .venv/bin/python scripts/control_drift.py --pool .trajgate/demo-<time> \\
        --learning-rate 1e-3 --learning-rate 5e-4 --shuffles 2
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer

from trainer_bridge.client import train_batch
from trainer_bridge.collate import collate, row_from_step
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.trainer import PolicyTrainer
from trajgate import smollm2
from trajgate.demo import PAD_TOKEN_ID, shuffled_rewards


def batch_table(pool: Path, name: str) -> pa.Table:
    """The rows of the pool's batch ``name`` (its manifest names it)."""
    for manifest in sorted((pool / "batches").glob("*/manifest.json")):
        if json.loads(manifest.read_text())["spec"]["name"] == name:
            return pq.read_table(manifest.parent / "rows.parquet")
    raise SystemExit(f"no batch {name!r} under {pool / 'batches'}")


def first_prompts(table: pa.Table) -> list[list[int]]:
    """The prompt ids of each episode's first turn in the batch (its shortest prompt)."""
    firsts: dict[str, list[int]] = {}
    for ids, prompt, trajectory in zip(
        table["input_ids"].to_pylist(),
        table["prompt_tokens"].to_pylist(),
        table["trajectory_id"].to_pylist(),
        strict=True,
    ):
        if trajectory not in firsts or prompt < len(firsts[trajectory]):
            firsts[trajectory] = ids[:prompt]
    return list(firsts.values())


# How every call the model samples begins (the hermes template's form, docs/demo.md), up to
# the name's closing quote, which the model samples merged with the comma after it.
CALL_OPENING = '<tool_call>\n{"name": "calculator'


def call_probability(trainer: PolicyTrainer, prompts: list[list[int]], opening: list[int]) -> float:
    """Mean over ``prompts`` of the policy's probability that the turn begins with the tokens
    ``opening``."""
    rows = [row_from_step(prompt, opening, [0.0] * len(opening), 0.0) for prompt in prompts]
    batch = collate(rows, PAD_TOKEN_ID)
    with torch.no_grad():
        logprobs = trainer.logprobs(batch)  # [B, T]
    opened = (logprobs * batch.loss_mask).sum(dim=1)  # [B]: log P(opening | prompt)
    return float(opened.exp().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=Path, required=True)
    parser.add_argument("--batch", default="train-v0")
    parser.add_argument("--learning-rate", type=float, action="append", required=True)
    parser.add_argument("--shuffles", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    table = batch_table(args.pool, args.batch)
    prompts = first_prompts(table)
    model_dir = smollm2.prepare()
    opening = AutoTokenizer.from_pretrained(model_dir).encode(CALL_OPENING)

    def trainer(learning_rate: float) -> PolicyTrainer:
        return PolicyTrainer(
            TrainerSettings(
                model_dir=model_dir,
                lora_rank=8,
                learning_rate=learning_rate,
                seed=args.seed,
                micro_batch_rows=2,
            )
        )

    before = call_probability(trainer(1e-3), prompts, opening)
    print(json.dumps({"prompts": len(prompts), "call_probability": round(before, 4)}), flush=True)
    results = []
    for rate in args.learning_rate:
        arms: list[tuple[str, pa.Table]] = [("trained", table)]
        arms += [
            (f"shuffled-{k}", shuffled_rewards(table, random.Random(args.seed + k)))
            for k in range(args.shuffles)
        ]
        for arm, rows in arms:
            started = time.monotonic()
            policy = trainer(rate)
            metrics = policy.update(train_batch(rows, PAD_TOKEN_ID))
            after = call_probability(policy, prompts, opening)
            results.append(
                {
                    "learning_rate": rate,
                    "arm": arm,
                    "call_probability_change": round(after - before, 4),
                    "grad_norm": round(metrics.grad_norm, 4),
                    "seconds": round(time.monotonic() - started, 1),
                }
            )
            print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"prompts": len(prompts), "call_probability": before, "results": results}))


if __name__ == "__main__":
    main()
