#!/usr/bin/env bash
# The GPU check: every path the CPU tests cannot reach (DeepSpeed's CUDA ops, NCCL, fp32 losses of
# DP2 / TP2 / PP2 / TP2xPP2 against one GPU, bf16 with fp32 gradient accumulation, resume under TP2
# and PP2, the Hugging Face export's logits, memory against `pretrain plan`, GPT-2 124M's throughput),
# on the GPUs it finds, through the project's own commands. Under 10 minutes on 8 GPUs. One line a
# check (PASS name: figures, FAIL name: reason, SKIP name: reason), then a summary; exit status 1 if
# any check failed, 2 if nothing could start. What each check does: benchmarks/gpu_checks.py.
#
#   benchmarks/gpu_check.sh                          # every check, on every visible GPU
#   benchmarks/gpu_check.sh --gpus 2                 # on the first 2 GPUs only
#   benchmarks/gpu_check.sh --only fp32-tp2,export   # some checks
#   benchmarks/gpu_check.sh --list --gpus 2          # what would run on 2 GPUs, and each skip's reason
#   benchmarks/gpu_check.sh --cpu                    # dry run on 2 gloo CPU ranks, tiny shapes
#
#   PYTHON         interpreter (default: .venv/bin/python)
#   WORK           data, runs and logs (default: a temporary directory, removed unless a check failed)
#   CORPUS         text to train on (default: tests/data/tinyshakespeare.txt)
#   TOKENIZER      GPT-2 ranks file for offline use (default: tests/data/tokenizers/gpt2.tiktoken)
#   STEPS, MICRO   the throughput run's steps (default 50) and micro batch (default 16)
#   MIN_BUSBW_GBS  the nccl check's floor in GB/s (default 5)
#   MEM_FACTOR     the memory check's allowed factor between measured and planned (default 1.5)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$PWD/.venv/bin/python}
command -v "$python" >/dev/null || { echo "gpu_check: no interpreter $python: run ./setup.sh, or set PYTHON" >&2; exit 2; }
exec "$python" benchmarks/gpu_checks.py "$@"
