#!/usr/bin/env bash
# The trainer at scale on this host: a few GRPO updates of a randomly initialised Qwen2-shaped
# model of 494M parameters, FSDP2, full weights and LoRA, bf16 on GPUs; prints tokens/s, MFU, peak
# memory, padding fraction and the bf16-vs-fp32 logprob difference as one JSON line per mode.
# Needs torch (CUDA build on a GPU host), transformers and peft; no vLLM, no network.
#
#   scripts/gpu_check.sh                    # every GPU of this host (one rank each)
#   NPROC=2 scripts/gpu_check.sh --tiny     # CPU (gloo): the tests' tiny model, small rows
#   scripts/gpu_check.sh --trainers         # TRL fed by the pool on one GPU (one process):
#                                           # GRPOTrainer, AsyncGRPOTrainer (needs `kernels`)
#   scripts/gpu_check.sh --trainers --tiny  # CPU: GRPOTrainer only (AsyncGRPO needs CUDA)
#
# Flags (scripts/gpu_check.py --help): --modes full,lora --updates N --groups G --group-size S
# --prompt-tokens P --response-tokens R --micro-batch-tokens B --lora-rank R
# --activation-checkpointing. GPU_CHECK_PEAK_TFLOPS sets the bf16 peak of an unlisted GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

# Processed against raw behaviour logprobs: vLLM's sampling throughput in each
# --logprobs-mode, one engine at a time; needs vLLM, found by $VLLM_PYTHON (default python3).
#   VLLM_PYTHON=/path/to/vllm/bin/python scripts/gpu_check.sh --logprobs-cost --model DIR
# Flags (scripts/logprobs_cost.py --help): --requests N --tokens T --dtype D --enforce-eager.
if [ "${1:-}" = "--logprobs-cost" ]; then
  shift
  exec "${VLLM_PYTHON:-python3}" scripts/logprobs_cost.py "$@"
fi
# PYTHON: the interpreter with torch (default: this repository's .venv, else python3)
python=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then python=.venv/bin/python; fi
gpus=$(nvidia-smi -L 2>/dev/null | wc -l || true)
nproc=${NPROC:-$(( gpus > 0 ? gpus : 2 ))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [ "${1:-}" = "--trainers" ]; then  # scripts/gpu_check_trainers.py --help for its flags
  shift
  exec "$python" scripts/gpu_check_trainers.py "$@"
fi
exec "$python" -m torch.distributed.run --standalone --nproc-per-node "$nproc" \
  scripts/gpu_check.py "$@"
