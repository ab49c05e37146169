"""The trainer at scale, measured: a few GRPO updates of a randomly initialised model on synthetic
rows in the pool's row format, sharded with FSDP2, full weights and LoRA.

Run it through ``scripts/gpu_check.sh`` (torchrun, one rank per GPU; gloo on CPU). Needs torch,
transformers and peft; no vLLM, no pool, no network. Default: a Qwen2-shaped model of 494M
parameters (Qwen2.5-0.5B's shape: 24 layers, hidden 896, vocabulary 151,936, tied embeddings),
bf16 compute on GPUs (FSDP2's mixed precision), rows packed into token budgets. ``--tiny``: the
tests' tiny Qwen2 (0.92M parameters) and small rows, for the CPU (tests/test_gpu_check.py).

Prints, per mode (``full``, ``lora``), one JSON line from rank 0: ``tokens_per_s`` (every token
of the batch, prompt and response, per second of update, the first update left out as warm-up
when there are several), ``mfu`` (model FLOPs per second over the GPUs' bf16 peak: 8 N per token
for full weights, 2 N for the pre-update logprob pass and 6 N for the forward and backward; 6 N
for LoRA, which skips the frozen weights' gradients; attention's FLOPs left out; null on CPU or
an unknown GPU unless ``GPU_CHECK_PEAK_TFLOPS`` is set), ``peak_memory_gib`` (the largest of the
ranks: CUDA's peak allocation, or the process's peak resident memory on CPU),
``padding_fraction`` (as the trainer posts it; ``padding_fraction_unpacked``: what padded
micro-batches of the same rows would waste), and ``logprob_diff_mean_abs`` /
``logprob_diff_max_abs``: the trainer's logprobs of the last batch's sampled tokens (bf16 on
GPUs, packed) against an fp32 recomputation from the weights it publishes (gathered from the
shards and reloaded in fp32 without sharding: the full weights, or the base and the adapter).
The rows' behaviour logprobs are synthetic, so the update's sampler gap says nothing here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

from trainer_bridge.client import rows_from_table
from trainer_bridge.collate import collate
from trainer_bridge.distributed import GlooWorld, join_ranks, shard_rows
from trainer_bridge.logprobs import token_logprobs
from trainer_bridge.packing import fed_tokens, plan_micro_batches
from trainer_bridge.settings import TrainerSettings
from trainer_bridge.trainer import PolicyTrainer, TrainBatch

# Qwen2.5-0.5B's shape (494M parameters); scripts/gpu_check_trainers.py builds the same model
QWEN2_494M: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}

# dense bf16 peak of one GPU, TFLOP/s (vendor datasheets)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny model, small rows")
    parser.add_argument("--modes", default="full,lora", help="comma-separated: full, lora")
    parser.add_argument("--updates", type=int, default=None, help="updates per mode")
    parser.add_argument("--groups", type=int, default=None, help="groups per batch")
    parser.add_argument("--group-size", type=int, default=8, help="rows per group")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="longest prompt")
    parser.add_argument("--response-tokens", type=int, default=None, help="longest response")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="packing budget")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--activation-checkpointing", action="store_true")
    arguments = parser.parse_args()
    small = arguments.tiny
    defaults = {
        "updates": 2 if small else 4,
        "groups": 2 if small else 8,
        "prompt_tokens": 24 if small else 512,
        "response_tokens": 24 if small else 1024,
        "micro_batch_tokens": 64 if small else 8192,
    }
    for name, value in defaults.items():
        if getattr(arguments, name) is None:
            setattr(arguments, name, value)
    return arguments


def _model_dir(arguments: argparse.Namespace, work: Path) -> Path:
    """Rank 0 writes the model (random weights, fixed seed); the other ranks wait for it."""
    directory = work / "model"
    if dist.get_rank() == 0:
        if arguments.tiny:
            from trajgate import tinymodel

            tinymodel.generate(directory)
        else:
            from transformers import Qwen2Config, Qwen2ForCausalLM

            config = Qwen2Config(**QWEN2_494M)
            torch.manual_seed(0)
            Qwen2ForCausalLM(config).save_pretrained(directory)
    dist.barrier()
    return directory


def _table(arguments: argparse.Namespace, vocab: int, seed: int) -> pa.Table:
    """A batch in the pool's row format: a prompt (mask 0), a response (mask 1), the response's
    behaviour logprobs, one advantage per row (GRPO's: +1 or -1 within each group)."""
    rng = random.Random(seed)
    columns: dict[str, list[Any]] = {
        "input_ids": [],
        "loss_mask": [],
        "behaviour_logprobs": [],
        "advantage": [],
    }
    for _ in range(arguments.groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, arguments.prompt_tokens))]
        for member in range(arguments.group_size):
            length = rng.randint(arguments.response_tokens // 4, arguments.response_tokens)
            response = [rng.randrange(vocab) for _ in range(length)]
            columns["input_ids"].append(prompt + response)
            columns["loss_mask"].append([0] * len(prompt) + [1] * len(response))
            columns["behaviour_logprobs"].append(
                [0.0] * len(prompt) + [-rng.uniform(0.0, 3.0) for _ in response]
            )
            columns["advantage"].append(1.0 if member % 2 else -1.0)
    return pa.table(columns)


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _fp32_logprobs(
    weights: Path, model_dir: Path, lora: bool, batch: TrainBatch, device: torch.device
) -> torch.Tensor:
    """Logprobs ``[B, T]`` of ``batch`` from the published weights, reloaded in fp32 unsharded."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        model_dir if lora else weights, dtype=torch.float32
    )
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, weights)
    model = model.to(device).eval()
    chunks = []
    with torch.no_grad():
        for start in range(0, batch.rows, 4):
            rows = list(range(start, min(start + 4, batch.rows)))
            micro = batch.select(rows).to(device)
            values, _ = token_logprobs(model, micro.input_ids, micro.attention_mask)
            padded = torch.zeros((len(rows), batch.input_ids.shape[1]))
            padded[:, : values.shape[1]] = values.float().cpu()
            chunks.append(padded)
    return torch.cat(chunks)


def _mode(
    arguments: argparse.Namespace, mode: str, model_dir: Path, work: Path, device_name: str
) -> None:
    settings = TrainerSettings(
        model_dir=model_dir,
        lora_rank=arguments.lora_rank if mode == "lora" else 0,
        sharding="fsdp2",
        micro_batch_tokens=arguments.micro_batch_tokens,
        activation_checkpointing=arguments.activation_checkpointing,
        learning_rate=1e-5,
        device=device_name,
    )
    trainer = PolicyTrainer(settings)
    device = trainer.device
    world = GlooWorld(device if device.type == "cuda" else torch.device("cpu"))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    vocab = int(trainer.model.config.vocab_size)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    timed: list[tuple[float, float]] = []  # (tokens, seconds) per update
    batch = None
    metrics = None
    for update in range(arguments.updates):
        rows = rows_from_table(_table(arguments, vocab, seed=update))
        batch = collate(shard_rows(rows, world.rank, world.size), pad_token_id=0)
        tokens = world.sum(float(sum(batch.lengths)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        started = time.perf_counter()
        metrics = trainer.update(batch, world)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timed.append((tokens, time.perf_counter() - started))
    assert batch is not None and metrics is not None
    measured = timed[1:] if len(timed) > 1 else timed
    tokens_per_s = sum(t for t, _ in measured) / sum(s for _, s in measured)
    peak = world.max(float(_peak_memory_bytes(device)))
    plan = plan_micro_batches(batch.lengths, rows=settings.micro_batch_rows, tokens=None)
    unpacked = 1.0 - world.sum(float(sum(batch.lengths))) / world.sum(
        float(fed_tokens(batch.lengths, plan, packed=False))
    )
    trained = trainer.logprobs(batch, world)  # [B, T], bf16 compute on GPUs
    weights = trainer.save_for_vllm(work / f"weights-{mode}")
    dist.barrier()
    if world.rank == 0:
        reference = _fp32_logprobs(weights, model_dir, mode == "lora", batch, device)
        mask = batch.loss_mask.bool()
        diff = (trained - reference).abs()[mask]
        peak_tflops = os.environ.get("GPU_CHECK_PEAK_TFLOPS")
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak_flops = (
            float(peak_tflops) * 1e12
            if peak_tflops
            else next((v * 1e12 for k, v in PEAK_TFLOPS.items() if k in name), None)
        )
        flops_per_token = (8 if mode == "full" else 6) * parameters
        report = {
            "mode": mode,
            "device": name,
            "world_size": world.size,
            "parameters": parameters,
            "updates": arguments.updates,
            "rows_per_update": arguments.groups * arguments.group_size,
            "tokens_per_update": round(timed[-1][0]),
            "tokens_per_s": round(tokens_per_s, 1),
            "mfu": None
            if peak_flops is None
            else round(flops_per_token * tokens_per_s / (peak_flops * world.size), 4),
            "peak_memory_gib": round(peak / 1024**3, 3),
            "padding_fraction": metrics.padding_fraction,
            "padding_fraction_unpacked": round(unpacked, 4),
            "logprob_diff_mean_abs": float(diff.mean()),
            "logprob_diff_max_abs": float(diff.max()),
            "loss": metrics.loss,
            "grad_norm": metrics.grad_norm,
        }
        print(json.dumps(report), flush=True)
    dist.barrier()
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    arguments = _arguments()
    device_name = join_ranks(TrainerSettings(model_dir=Path("."), device="auto")).device
    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as name:
            work = Path(_shared_dir(Path(name)))
            model_dir = _model_dir(arguments, work)
            for mode in arguments.modes.split(","):
                if mode not in ("full", "lora"):
                    raise SystemExit(f"--modes takes full and lora; got {mode!r}")
                _mode(arguments, mode, model_dir, work, device_name)
    finally:
        dist.destroy_process_group()


def _shared_dir(local: Path) -> str:
    """Rank 0's temporary directory, the same path on every rank (one host)."""
    box = [str(local)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    main()
