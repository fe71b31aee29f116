#!/usr/bin/env bash
# One-minute GPU check: GPT-2 124M, bf16, ZeRO-2, 50 steps on one GPU through the deepspeed launcher
# (NCCL backend, LOCAL_RANK device), then tokens/s, MFU and peak memory from the run's metrics.csv.
#
#   benchmarks/gpu_check.sh [extra pretrain train args...]
#   STEPS=50 MICRO=16 benchmarks/gpu_check.sh --set model.activation_checkpointing=true
#
#   CORPUS     text to train on (default: tests/data/tinyshakespeare.txt, else the embedded corpus)
#   TOKENIZER  GPT-2 ranks file for offline use (default: tests/data/tokenizers/gpt2.tiktoken if present)
#   WORK       where data and the run go (default: a temporary directory, removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$PWD/.venv/bin/python}
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "gpu_check: no CUDA GPU visible to $python" >&2; exit 2; }
steps=${STEPS:-50}
micro=${MICRO:-16}
shared=$PWD/tests/data
corpus=${CORPUS:-$shared/tinyshakespeare.txt}
[ -f "$corpus" ] || corpus=shakespeare
tok=${TOKENIZER:-$shared/tokenizers/gpt2.tiktoken}
tok_args=()
[ -f "$tok" ] && tok_args=(--set "data.tokenizer_path=$tok")
work=${WORK:-$(mktemp -d)}
[ -n "${WORK:-}" ] || trap 'rm -rf "$work"' EXIT

"$python" -m deepspeed.launcher.runner --num_gpus 1 --master_addr 127.0.0.1 --master_port "${MASTER_PORT:-29590}" \
    pretrain/main.py --preset gpt2-124m --set precision.bf16=true --set zero.stage=2 \
    --set "data.corpus=$corpus" --set data.tokenizer=gpt2 "${tok_args[@]}" \
    --set "data.dataset_dir=$work/data" --set "logging.run_dir=$work/run" \
    --set "schedule.max_steps=$steps" --set schedule.warmup_steps=5 --set "batch.micro_batch_size=$micro" \
    --set batch.gradient_accumulation_steps=1 \
    --set logging.log_interval=1 --set logging.eval_interval=100000 --set logging.sample_tokens=0 \
    --set checkpoint.interval=100000 "$@"

"$python" - "$work/run/metrics.csv" <<'PY'
import csv, statistics, sys
import torch

rows = [r for r in csv.DictReader(open(sys.argv[1])) if r.get("loss")]
steady = rows[min(10, len(rows) // 2):]  # past warm-up: allocator, cuDNN/cuBLAS heuristics
def mean(key):
    vals = [float(r[key]) for r in steady if r.get(key)]
    return statistics.fmean(vals) if vals else float("nan")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, GPT-2 124M bf16 ZeRO-2, {len(rows)} steps")
print(f"  tokens/s     {mean('tokens_per_s'):,.0f}")
print(f"  MFU          {100 * mean('mfu'):.1f}%")
print(f"  peak memory  {max(float(r['peak_mem_gb']) for r in rows if r.get('peak_mem_gb')):.2f} GB")
print(f"  loss         {float(rows[0]['loss']):.3f} -> {float(rows[-1]['loss']):.3f}")
PY
