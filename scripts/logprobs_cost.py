"""What vLLM's processed behaviour logprobs cost against its raw ones (docs/gateway.md,
"Sampling policy and behaviour logprobs"): the same batch of sampled generations under
``--logprobs-mode raw_logprobs`` and ``processed_logprobs``, each mode in its own process (one
engine at a time on the device), timed after a warm-up batch.

Prints one JSON line per mode, ``{"mode", "requests", "tokens", "generated_tokens", "wall_s",
"tokens_per_s"}``, then ``{"processed_over_raw_tokens_per_s": ratio}``. The batch samples at
temperature 0.7 with top-p 0.9 and top-k 50 (the case where, on CUDA, processed logprobs give
up FlashInfer's top-k/top-p kernel) and asks for the sampled token's logprob.

Needs vLLM importable by this interpreter (``scripts/gpu_check.sh --logprobs-cost`` runs it with
``$VLLM_PYTHON``). Flags: ``--model DIR`` (default: the tiny model of ``trajgate model create``),
``--requests N``, ``--tokens T``, ``--dtype``, ``--enforce-eager``, ``--max-model-len`` (4096).
On a CPU build, set vLLM's CPU environment as ``trajgate vllm start`` does:
``VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind`` (its KV cache space, in GiB,
and no thread pinning).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODES = ("raw_logprobs", "processed_logprobs")


def run_mode(args: argparse.Namespace) -> dict[str, object]:
    """Time ``args.requests`` generations of ``args.tokens`` tokens under ``args.mode``."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        logprobs_mode=args.mode,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        seed=0,
    )
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        max_tokens=args.tokens,
        ignore_eos=True,
        logprobs=0,
    )
    prompts = [f"Tell me a long story, number {i}." for i in range(args.requests)]
    llm.generate(prompts[: max(1, args.requests // 8)], params, use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "mode": args.mode,
        "requests": args.requests,
        "tokens": args.tokens,
        "generated_tokens": generated,
        "wall_s": wall_s,
        "tokens_per_s": generated / wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_model = Path(
        os.environ.get("TRAJGATE_HOME", Path.home() / ".cache" / "trajgate"),
        "models",
        "tiny-qwen2",
    )
    parser.add_argument("--model", default=str(default_model))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--mode", choices=MODES, help="one mode in this process (internal)")
    args = parser.parse_args()
    if args.mode is not None:
        print(json.dumps(run_mode(args)), flush=True)
        return
    results = {}
    for mode in MODES:
        child = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--mode", mode],
            capture_output=True,
            text=True,
            check=False,
        )
        line = next((x for x in child.stdout.splitlines() if x.startswith("{")), None)
        if child.returncode != 0 or line is None:
            sys.exit(f"{mode} failed ({child.returncode}):\n{child.stderr[-3000:]}")
        print(line, flush=True)
        results[mode] = json.loads(line)
    ratio = results["processed_logprobs"]["tokens_per_s"] / results["raw_logprobs"]["tokens_per_s"]
    print(json.dumps({"processed_over_raw_tokens_per_s": ratio}), flush=True)


if __name__ == "__main__":
    main()
