"""scripts/gpu_check.sh in its reduced mode on the CPU (2 gloo ranks, the tiny model): both modes
train, and it reports every figure docs/benchmarks.md quotes from a GPU host."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_reduced_mode_trains_full_and_lora_and_reports_every_figure() -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--tiny", "--updates", "2"],
        env={**os.environ, "NPROC": "2", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = {
        r["mode"]: r
        for r in (json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
    }
    assert sorted(reports) == ["full", "lora"]
    for report in reports.values():
        assert (report["device"], report["world_size"], report["updates"]) == ("cpu", 2, 2)
        assert report["tokens_per_s"] > 0
        assert report["mfu"] is None  # no bf16 peak for a CPU
        assert report["peak_memory_gib"] > 0
        assert report["padding_fraction"] == 0.0  # packed
        assert 0 < report["padding_fraction_unpacked"] < 1  # rows of different lengths
        # fp32 on both sides on the CPU: only summation order differs
        assert report["logprob_diff_max_abs"] < 1e-4
        assert report["grad_norm"] > 0
    # LoRA adds its adapters to the same base: the tiny model's parameters, its untied
    # embedding and output head each 2,048 x 128 (918,656 in all, format 7)
    assert reports["full"]["parameters"] == 918_656 < reports["lora"]["parameters"]


def test_gpu_check_trainers_runs_trls_update_on_pool_rows_and_says_what_needs_cuda() -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--trainers", "--tiny"],
        env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = {
        r["check"]: r
        for r in (
            json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"check"')
        )
    }
    grpo = reports["trl_grpo"]
    assert (grpo["device"], grpo["steps"], grpo["rows_per_step"]) == ("cpu", 2, 4)
    assert grpo["logprobs_equal"] is True  # TRL's old logprobs are the rows' behaviour logprobs
    moved, total = grpo["weights_changed"]
    assert moved == total > 0
    assert math.isfinite(grpo["loss"])
    assert "needs CUDA" in reports["trl_async"]["skipped"]
