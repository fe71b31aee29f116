"""Our DeepSpeed path against a plain PyTorch loop, eager and compiled: same model, data, batch, schedule.

    .venv/bin/python benchmarks/vs_plain_torch.py            # full: both sizes, ~9 min (compile cache warm)
    .venv/bin/python benchmarks/vs_plain_torch.py --quick    # smoke: 2 rounds, few steps, ~2 min (cache warm)

One process, four loops per model size, each built once and then timed in alternating rounds (so
other load on the machine hits them all alike); the figures are medians over the rounds:
- plain eager: the textbook loop, GPT + torch.optim.AdamW (defaults) + clip_grad_norm_ + the LR
  schedule, on the same ShardedLoader, the loss summed on the device and read once per log interval;
- plain compiled: the same with `torch.compile(model)`;
- ours eager / ours compiled (`compile.enabled=true`): the run's own `setup()` (DeepSpeed engine
  at ZeRO 0, its data loader) and, per step, what `train()` does: the LR, `train_step()`, the
  ranks' non-finite-loss agreement and the loss sum.
Sizes: the 4-layer / 4-head / 128-wide model (block 64, micro batch 12), and the `medium` preset's
model (6/6/384, block 256, dropout 0.2) at micro batch `--medium-micro-batch` (8: a step of seconds,
not tens of seconds, on a CPU). Achieved GFLOP/s (6N + attention per token) is printed next to a
fp32 GEMM peak measured in the same run (2048^2, best window, between rounds). Tokens per CPU
second of this process (`time.process_time`) are printed too: other processes' load barely moves them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plain_loop import plain_step  # noqa: E402

from pretrain.cluster.hardware import gemm_tflops  # noqa: E402
from pretrain.config.presets import build  # noqa: E402
from pretrain.config.tree import RunConfig, analytic_flops_per_token  # noqa: E402
from pretrain.data.dataset import load_manifest, resolve_vocab  # noqa: E402
from pretrain.data.prepare import prepare  # noqa: E402
from pretrain.training.distributed import ranks  # noqa: E402
from pretrain.training.faults import Faults  # noqa: E402
from pretrain.training.loop import train_step  # noqa: E402
from pretrain.training.metrics import PhaseTimer, quiet_monitor  # noqa: E402
from pretrain.training.model.gpt import GPT  # noqa: E402
from pretrain.training.run import setup  # noqa: E402
from pretrain.training.schedule import lr_at  # noqa: E402

SIZES = {
    "4/4/128": ("tiny", ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=64",
                         "batch.micro_batch_size=12"]),
    "medium": ("medium", []),
}  # fmt: skip
LOOPS = ("plain eager", "plain compiled", "ours eager", "ours compiled")
FP32_BASELINE = "plain eager fp32"  # with --precision bf16: the fp32 textbook loop, for reference


def config(preset: str, shape: list[str], run_dir: Path, data: Path, extra: list[str]) -> RunConfig:
    corpus = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    return build(
        preset,
        overrides=[
            *shape,
            "batch.gradient_accumulation_steps=1",
            "zero.stage=0",
            f"data.corpus={corpus if corpus.is_file() else 'shakespeare'}",
            f"data.dataset_dir={data}",
            "data.tokenizer=char",
            "schedule.max_steps=100000",
            "schedule.warmup_steps=10",
            "logging.progress_bar=off",
            f"logging.run_dir={run_dir}",
            *extra,
        ],
        world_size=1,
    )


class Loop:
    """One training loop, built once; `steps(n)` runs n steps, reading the loss once at the end."""

    def __init__(self, step: Callable[[int], torch.Tensor]) -> None:
        self.step, self.done = step, 0

    def steps(self, n: int) -> float:
        loss_sum = torch.zeros(())
        for _ in range(n):
            loss_sum += self.step(self.done)
            self.done += 1
        return float(loss_sum.item()) / n  # the one host sync per log interval, as in train()


def plain_loop(cfg: RunConfig, compiled: bool, bf16: bool = False) -> Loop:
    """The reference: a textbook PyTorch loop (plain_loop.py; torch AdamW's defaults), compiled if
    `compiled`, the forward under bf16 autocast if `bf16` (fp32 weights and optimizer)."""
    return Loop(plain_step(cfg, torch.device("cpu"), compiled=compiled, bf16=bf16))


def our_loop(cfg: RunConfig, dist: ranks.Dist) -> Loop:
    """Our path: `setup()` builds the engine and loaders as a run does; each step is train()'s."""
    run = setup(cfg, dist, None)
    quiet_monitor(run.engine)  # as train() does: its log, not the engine, writes to the monitor
    timer = PhaseTimer(run.engine.device)
    faults = Faults(cfg.run_dir(), cfg.batch.sequences, env={})

    def step(i: int) -> torch.Tensor:
        lr = lr_at(i, cfg.optimizer.lr, cfg.schedule)
        for group in run.engine.optimizer.param_groups:
            group["lr"] = lr
        batch_start = run.train_data.consumed_samples
        loss, _, verdict = train_step(run, timer, faults, batch_start=batch_start, want_grad_norm=False)
        bad, _, _ = verdict.wait()
        if bad:
            raise RuntimeError(f"non-finite loss at step {i}")
        return loss

    return Loop(step)


def bench_size(
    name: str, preset: str, shape: list[str], args: argparse.Namespace, work: Path, dist: ranks.Dist
) -> dict[str, float]:
    data = work / "data"
    base = config(preset, shape, work / "run", data, [])
    vocab = load_manifest(prepare(base.data))["tokenizer"]["vocab_size"]

    def cfg(extra: list[str]) -> RunConfig:
        return resolve_vocab(config(preset, shape, work / f"run-{uuid.uuid4().hex[:6]}", data, extra), vocab)

    c = cfg([])
    m, b = c.model, c.batch
    tokens_per_step = b.micro_batch_size * m.block_size
    flops_per_token = analytic_flops_per_token(m)
    steps = args.steps if name == "4/4/128" else args.medium_steps
    print(
        f"\n== {name}: {m.n_layer} layers, {m.n_head} heads, n_embd {m.n_embd}, block {m.block_size}, "
        f"dropout {m.dropout}, vocab {vocab}, {GPT(m).num_params() / 1e6:.2f}M params; micro batch "
        f"{b.micro_batch_size}; {args.rounds} rounds of {steps} steps per loop",
        flush=True,
    )
    bf16 = args.precision == "bf16"
    loops: dict[str, Loop] = {}
    for loop in (*LOOPS, *([FP32_BASELINE] if bf16 else [])):
        t = time.perf_counter()
        if loop == FP32_BASELINE:
            loops[loop] = plain_loop(c, compiled=False)
        elif loop.startswith("plain"):
            loops[loop] = plain_loop(c, compiled=loop.endswith("compiled"), bf16=bf16)
        else:
            extra = [f"compile.enabled={loop.endswith('compiled')}", f"precision.bf16={bf16}"]
            loops[loop] = our_loop(cfg(extra), dist)
        loops[loop].steps(args.warmup)  # compiles, warms the allocator and the prefetch
        print(
            f"  built {loop} and ran {args.warmup} warm-up steps: {time.perf_counter() - t:.1f} s", flush=True
        )
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    a, bm = torch.randn(2048, 2048, generator=g).to(dtype), torch.randn(2048, 2048, generator=g).to(dtype)
    rates: dict[str, list[float]] = {k: [] for k in loops}
    cpu_rates: dict[str, list[float]] = {k: [] for k in loops}  # per CPU second of this process
    gemm = 0.0
    for r in range(args.rounds):
        order = list(loops) if r % 2 == 0 else list(reversed(loops))  # neither first nor last always
        for k in order:
            t, c = time.perf_counter(), time.process_time()
            loops[k].steps(steps)
            rates[k].append(steps * tokens_per_step / (time.perf_counter() - t))
            cpu_rates[k].append(steps * tokens_per_step / (time.process_time() - c))
        gemm = max(gemm, gemm_tflops(a, bm, 0.5))
        line = ", ".join(f"{k} {rates[k][-1]:,.0f}" for k in loops)
        print(f"  round {r + 1}: tokens/s {line}; GEMM {1000 * gemm:.1f} GFLOP/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_rates.items()}
    print(
        f"\n  {'loop':<16} {'tokens/s':>10} {'GFLOP/s':>8} {'of GEMM':>8}   {'tokens/CPU-s':>12}"
        f"   (medians of {args.rounds} rounds)"
    )
    for k, v in med.items():
        gflops = v * flops_per_token / 1e9
        print(
            f"  {k:<16} {v:>10,.0f} {gflops:>8.1f} {100 * gflops / (1000 * gemm):>7.1f}%   {cpu_med[k]:>12,.0f}"
        )
    print(
        f"  {args.precision} GEMM peak (2048^2, {torch.get_num_threads()} threads, best window): {1000 * gemm:.1f} GFLOP/s"
    )
    pe, pc, oe, oc = (med[k] for k in LOOPS)
    print(
        f"  ratios: ours compiled / plain eager {oc / pe:.3f}; ours compiled / plain compiled {oc / pc:.3f}; "
        f"ours eager / plain eager {oe / pe:.3f}; plain compiled / plain eager {pc / pe:.3f}",
        flush=True,
    )
    if bf16:
        print(
            f"  against the fp32 plain eager loop: ours compiled (bf16) {oc / med[FP32_BASELINE]:.3f}; "
            f"ours eager (bf16) {oe / med[FP32_BASELINE]:.3f}; plain eager (bf16) {pe / med[FP32_BASELINE]:.3f}",
            flush=True,
        )
    pe, pc, oe, oc = (cpu_med[k] for k in LOOPS)
    print(
        f"  per CPU second (steadier under other load): ours compiled / plain eager {oc / pe:.3f}; "
        f"ours compiled / plain compiled {oc / pc:.3f}; ours eager / plain eager {oe / pe:.3f}",
        flush=True,
    )
    return {**med, "gemm_gflops": 1000 * gemm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="Alternating rounds per size.")
    ap.add_argument("--steps", type=int, default=40, help="Steps per loop per round, 4/4/128.")
    ap.add_argument("--medium-steps", type=int, default=3, help="Steps per loop per round, medium.")
    ap.add_argument("--medium-micro-batch", type=int, default=8, help="Micro batch of the medium model.")
    ap.add_argument(
        "--warmup", type=int, default=3, help="Untimed steps per loop (compilation happens here)."
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared box).")
    ap.add_argument("--sizes", default="4/4/128,medium", help="Comma-separated: 4/4/128, medium.")
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: the plain loops under bf16 autocast, ours with precision.bf16 (DeepSpeed's bf16), "
        "and a fifth loop, the plain eager one in fp32, for reference.",
    )
    ap.add_argument("--quick", action="store_true", help="2 rounds, 15 and 1 steps: a smoke run.")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.medium_steps, args.warmup = 2, 15, 1, 2

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs, load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="vs_plain_torch_"))
    for name in args.sizes.split(","):
        preset, shape = SIZES[name]
        if name == "medium":
            shape = [*shape, f"batch.micro_batch_size={args.medium_micro_batch}"]
        bench_size(name, preset, shape, args, work / name.replace("/", "-"), dist)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")


if __name__ == "__main__":
    main()
    ranks.leave_distributed()  # not after an error: another rank may be inside a collective
