"""TRL fed by the pool, on this host's GPU: ``scripts/gpu_check.sh --trainers``.

Two checks, one JSON line each, on synthetic rows in the pool's row format (groups of 2 rows
sharing a prompt, completions of model, tool and model tokens with mask 1/0/1, behaviour
logprobs in [-3, 0), rewards 1/0 per group):

- ``trl_grpo``: TRL's ``GRPOTrainer`` with ``rollout_func`` returning
  ``trainer_bridge.integrations.trl.rollout_output`` of those rows (the CPU test's path, on the
  GPU in bf16): ``loss``, ``weights_changed`` (every trainable tensor that moved, of all),
  ``logprobs_equal`` (TRL's ``sampling_per_token_logps`` are the rows' behaviour logprobs
  exactly), ``seconds_per_step``.
- ``trl_async``: TRL's experimental ``AsyncGRPOTrainer`` fed by ``PoolRolloutWorker`` (the
  worker's own ``samples()`` of a batch table; ``max_held_batches=0`` so it leases nothing: no
  gateway here) with a no-op weight transfer: ``loss``, ``weights_changed``,
  ``seconds_per_step``. Needs CUDA and the FA3 tree-attention kernel (``pip install kernels``;
  it downloads ``kernels-community/flash-attn3`` once); without them the line says
  ``skipped`` and why.

Default model: Qwen2.5-0.5B's shape with random weights (as ``scripts/gpu_check.py``);
``--tiny``: the tests' tiny model (the CPU test). No vLLM, no gateway.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from trainer_bridge.integrations.rows import ROW_COLUMNS

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh --trainers")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model, short rows")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per check")
    parser.add_argument("--groups", type=int, default=None, help="groups (of 2 rows) per step")
    parser.add_argument("--checks", default="trl_grpo,trl_async")
    arguments = parser.parse_args()
    if arguments.groups is None:
        arguments.groups = 2 if arguments.tiny else 8
    return arguments


def _model_dir(tiny: bool, work: Path) -> Path:
    directory = work / "model"
    if tiny:
        from trajgate import tinymodel

        return tinymodel.generate(directory)
    from gpu_check import QWEN2_494M  # this script's folder is first on sys.path
    from transformers import Qwen2ForCausalLM
    from transformers.models.qwen2 import Qwen2Config

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN2_494M)).save_pretrained(directory)
    return directory


def _table(groups: int, vocab: int, longest: int, seed: int) -> pa.Table:
    """A merged batch's columns (docs/batches.md): prompt (mask 0), model tokens (1), tool
    tokens (0), model tokens (1); GRPO advantages of rewards 1/0: +-0.7071."""
    rng = random.Random(seed)
    columns: dict[str, list[Any]] = {name: [] for name in (*ROW_COLUMNS, "temperature")}
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, longest))]
        for member in range(2):
            spans = [rng.randint(4, longest) for _ in range(3)]  # model, tool, model
            ids, mask = list(prompt), [0] * len(prompt)
            for span, bit in zip(spans, (1, 0, 1), strict=True):
                ids += [rng.randrange(vocab) for _ in range(span)]
                mask += [bit] * span
            columns["input_ids"].append(ids)
            columns["loss_mask"].append(mask)
            columns["behaviour_logprobs"].append([-rng.uniform(0, 3) if m else 0.0 for m in mask])
            columns["prompt_tokens"].append(len(prompt))
            columns["trajectory_id"].append(f"s{seed}-g{g}-{member}")
            columns["group_id"].append(f"s{seed}-g{g}")
            columns["segment_index"].append(0)
            columns["policy_version"].append(0)
            columns["reward"].append(float(member))
            columns["advantage"].append(0.7071 if member else -0.7071)
            columns["step_ids"].append([f"s{seed}-g{g}-{member}-step"])
            columns["temperature"].append(1.0)
    return pa.table(columns)


def _changed(before: dict[str, torch.Tensor], model: torch.nn.Module) -> tuple[int, int]:
    after = {n: p for n, p in model.named_parameters() if p.requires_grad}
    moved = sum(not torch.equal(before[n], p.detach()) for n, p in after.items())
    return moved, len(after)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def check_trl_grpo(arguments: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from trainer_bridge.integrations.rows import pool_rows
    from trainer_bridge.integrations.trl import pool_reward, rollout_output

    cuda = torch.cuda.is_available()
    vocab = 2048 if arguments.tiny else 151936
    longest = 12 if arguments.tiny else 256
    batches = [
        pool_rows(_table(arguments.groups, vocab, longest, seed)) for seed in range(arguments.steps)
    ]
    calls: list[int] = []
    received: list[dict[str, Any]] = []

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        rows = batches[len(calls) % len(batches)]
        calls.append(len(prompts))
        if len(prompts) != len(rows):
            raise RuntimeError(f"TRL asked for {len(prompts)} rollouts, the batch has {len(rows)}")
        return rollout_output(rows, [r.trajectory_id for r in rows])

    class Recording(GRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, inputs: Any) -> Any:
            out = super()._generate_and_score_completions(inputs)
            received.append(out)
            return out

    rows_per_step = 2 * arguments.groups
    args = GRPOConfig(
        output_dir=str(work / "trl"),
        use_cpu=not cuda,
        bf16=cuda,
        per_device_train_batch_size=rows_per_step,
        num_generations=2,
        max_steps=arguments.steps,
        learning_rate=1e-5,
        beta=0.0,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Recording(
        model=str(model_dir),
        reward_funcs=pool_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"p{i}" for i in range(rows_per_step * 4)]}),
        rollout_func=rollout_func,
    )
    before = _snapshot(trainer.model)
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    moved, total = _changed(before, trainer.model)
    equal = True
    for out, rows in zip(received, batches, strict=False):
        for i, row in enumerate(rows):
            n = len(row.completion_ids)
            got = out["sampling_per_token_logps"][i][:n].float().cpu().tolist()
            want = torch.tensor(row.completion_logprobs, dtype=torch.float32).tolist()
            equal = equal and got == want
    return {
        "check": "trl_grpo",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "steps": arguments.steps,
        "rows_per_step": rows_per_step,
        "loss": float(result.training_loss),
        "weights_changed": [moved, total],
        "logprobs_equal": equal and len(received) == arguments.steps,
        "seconds_per_step": round(seconds / arguments.steps, 3),
    }


class _NoTransfer:
    """No vLLM here: AsyncGRPO's weight sync with nowhere to send to (counted)."""

    def __init__(self) -> None:
        self.sends = 0

    def init_weight_transfer(self) -> None: ...

    def pause(self) -> None: ...

    def send_weights(self, iterator: Any) -> None:
        self.sends += 1
        for _ in iterator:
            pass

    def resume(self) -> None: ...

    def destroy(self) -> None: ...


def check_trl_async(arguments: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {
            "check": "trl_async",
            "skipped": "needs CUDA: AsyncGRPOTrainer asks torch.cuda for the device name when "
            "built, and its loss runs the FA3 tree-attention kernel",
        }
    try:
        import kernels  # noqa: F401
    except ImportError:
        return {"check": "trl_async", "skipped": "needs the FA3 kernel: pip install kernels"}
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from trainer_bridge.client import PoolClient
    from trainer_bridge.integrations.trl_async import PoolRolloutWorker

    rows_per_step = 2 * arguments.groups
    worker = PoolRolloutWorker(PoolClient("http://127.0.0.1:9"), "gpu-check", max_held_batches=0)
    for seed in range(arguments.steps + 2):  # the planner may hold one micro-batch back
        for sample in worker.samples(_table(arguments.groups, 151936, 256, seed), f"b{seed}"):
            worker.rollout_buffer.put(sample)
    transfer = _NoTransfer()
    args = AsyncGRPOConfig(
        output_dir=str(work / "async"),
        bf16=True,
        per_device_train_batch_size=rows_per_step,
        max_steps=arguments.steps,
        token_budget=0,  # fixed count: rows_per_step samples a micro-batch
        learning_rate=1e-5,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
    )
    trainer = AsyncGRPOTrainer(
        model=str(model_dir),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["p"] * rows_per_step}),
        rollout_worker=worker,
        weight_transfer=transfer,
    )
    before = _snapshot(trainer.model)
    started = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - started
    moved, total = _changed(before, trainer.model)
    return {
        "check": "trl_async",
        "device": torch.cuda.get_device_name(),
        "steps": arguments.steps,
        "rows_per_step": rows_per_step,
        "loss": float(result.training_loss),
        "weights_changed": [moved, total],
        "weight_syncs": transfer.sends,
        "seconds_per_step": round(seconds / arguments.steps, 3),
    }


CHECKS = {"trl_grpo": check_trl_grpo, "trl_async": check_trl_async}


def main() -> None:
    arguments = _arguments()
    with tempfile.TemporaryDirectory(prefix="gpu-check-trainers-") as name:
        work = Path(name)
        model_dir = _model_dir(arguments.tiny, work)
        for check in arguments.checks.split(","):
            if check not in CHECKS:
                raise SystemExit(f"--checks takes {sorted(CHECKS)}; got {check!r}")
            try:
                report = CHECKS[check](arguments, model_dir, work)
            except Exception as error:  # one check's failure is its line, the next still runs
                report = {"check": check, "error": f"{type(error).__name__}: {error}"[:2000]}
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
