"""The demo's answer step replayed offline: how fast GRPO moves the tiny model, without vLLM.

The numbers in docs/demo.md ("Offline") come from this script. Per version: the exact expected
reward of the answer step under the trainer's own model (no sampling noise), then 16 groups x 4
answers sampled from that model, GRPO advantages (``datapool.batches.advantages``), and one update
of the real trainer (``trainer_bridge.trainer.PolicyTrainer``, LoRA). The tool call is fixed
(``{"city": "Paris"}``) rather than generated; everything else is the demo's.

    .venv/bin/python scripts/demo_offline.py --lr 1e-2 --rounds 6 --seeds 0 1 2
    .venv/bin/python scripts/demo_offline.py --reward exact --seeds 0   # answer "21" only
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from datapool.batches.advantages import grpo_advantages
from trainer_bridge.collate import collate, row_from_step
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.trainer import PolicyTrainer
from trajgate import demo_task, tinymodel, vllm_server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


def answer_contexts(tokenizer: object) -> list[list[int]]:
    """The prompt ids of the answer step for each of the demo's 8 cities."""
    call = {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    result = json.dumps({"city": "Paris", "temperature_c": 21, "sky": "sunny"})
    contexts = []
    for group in range(len(demo_task.CITIES)):
        messages = [
            {"role": "system", "content": demo_task.SYSTEM_PROMPT},
            {"role": "user", "content": demo_task.question(group)},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": result},
        ]
        contexts.append(
            tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return contexts


def run_arm(model_dir: Path, args: argparse.Namespace, seed: int, shuffle: bool) -> list[float]:
    """Expected reward per version ``[rounds + 1]`` of one arm."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    texts = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    score = (
        demo_task.digit_share if args.reward == "number" else (lambda t: float(t.strip() == "21"))
    )
    reward = torch.zeros(vocab)  # [V]
    reward[: len(texts)] = torch.tensor([score(t) for t in texts])
    contexts = answer_contexts(tokenizer)
    trainer = PolicyTrainer(
        TrainerSettings(model_dir=model_dir, learning_rate=args.lr, seed=seed, device="cpu")
    )
    generator = torch.Generator().manual_seed(seed)
    shuffler = random.Random(seed)
    curve = []
    for version in range(args.rounds + 1):
        with torch.no_grad():
            logprobs = [
                torch.log_softmax(trainer.model(input_ids=torch.tensor([c])).logits[0, -1], -1)
                for c in contexts
            ]  # 8 x [V]
        curve.append(float(np.mean([float((lp.exp() * reward).sum()) for lp in logprobs])))
        if version == args.rounds:
            break
        samples = []  # (group, answer id, behaviour logprob)
        for group in range(args.groups):
            lp = logprobs[group % len(contexts)]
            for answer in torch.multinomial(lp.exp(), args.group_size, True, generator=generator):
                samples.append((group, int(answer), float(lp[answer])))
        rewards = np.array([float(reward[a]) for _, a, _ in samples])
        if shuffle:
            permuted = list(rewards)
            shuffler.shuffle(permuted)
            rewards = np.array(permuted)
        advantages = grpo_advantages(rewards, np.array([g for g, _, _ in samples]))
        rows = [
            row_from_step(contexts[g % len(contexts)], [a], [lp], float(adv))
            for (g, a, lp), adv in zip(samples, advantages, strict=True)
            if adv != 0.0
        ]
        if rows:
            trainer.update(collate(rows, pad_token_id=0))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--reward", choices=["number", "exact"], default="number")
    args = parser.parse_args()
    model_dir = args.model_dir or tinymodel.generate(vllm_server.default_model_dir())
    for shuffle in (False, True):
        for seed in args.seeds:
            curve = run_arm(model_dir, args, seed, shuffle)
            gain = float(np.mean(curve[-2:])) - curve[0]
            arm = "control" if shuffle else "trained"
            print(f"{arm} seed {seed}: {[round(v, 3) for v in curve]} gain {gain:+.3f}", flush=True)


if __name__ == "__main__":
    main()
