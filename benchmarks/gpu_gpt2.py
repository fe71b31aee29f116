"""GPT-2 124M on GPUs: our path (DeepSpeed, bf16, torch.compile, FusedAdam, SDPA flash attention)
beside a plain PyTorch loop (bf16 autocast, torch.compile, fused torch AdamW) on the same model and data.

    .venv/bin/python benchmarks/gpu_gpt2.py                 # one GPU, then all GPUs of the node if > 1
    .venv/bin/python benchmarks/gpu_gpt2.py --cpu-smoke     # the same code end to end on the CPU, tiny

Prints tokens/s, MFU against the device's bf16 peak (pretrain.training.metrics' datasheet table) and peak
memory of each, as medians of alternating rounds. Our path is the run's own `setup()` and, per
step, what `train()` does (`train_step()`, the non-finite-loss agreement); the data is the real
pipeline's (a generated text, char tokens, the embedding padded to GPT-2's 50304 rows, so the
model is GPT-2 124M's shape). With more than one GPU the script starts itself under torchrun on all
of them for our path (the plain loop stays on one GPU). `--cpu-smoke` shrinks the model to 2 layers
and the run to a few steps, trains in fp32 with torch's AdamW in place of FusedAdam (a CUDA
kernel), and runs the all-ranks part on 2 CPU ranks (gloo), so every line of the script is exercised.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from plain_loop import plain_step  # noqa: E402

from pretrain.cluster.hardware import device_peak_tflops  # noqa: E402
from pretrain.config.presets import build  # noqa: E402
from pretrain.config.tree import RunConfig, analytic_flops_per_token  # noqa: E402
from pretrain.data.dataset import resolve_vocab  # noqa: E402
from pretrain.data.prepare import prepare  # noqa: E402
from pretrain.training.distributed import ranks  # noqa: E402
from pretrain.training.faults import Faults  # noqa: E402
from pretrain.training.loop import train_step  # noqa: E402
from pretrain.training.metrics import PhaseTimer, peak_memory_bytes, quiet_monitor  # noqa: E402
from pretrain.training.model.gpt import GPT  # noqa: E402
from pretrain.training.run import setup  # noqa: E402
from pretrain.training.schedule import lr_at  # noqa: E402

VOCAB = 50304  # GPT-2's 50257 rounded up to a multiple of 64, as nanoGPT does


def corpus(path: Path, n_chars: int) -> Path:
    """A generated text: random words, enough for the run's batches; throughput does not read it."""
    rng = random.Random(0)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
        for _ in range(5000)
    ]
    with path.open("w") as f:
        written = 0
        while written < n_chars:
            line = " ".join(rng.choice(words) for _ in range(12)) + ".\n"
            f.write(line)
            written += len(line)
    return path


def config(args: argparse.Namespace, work: Path, run: str, extra: list[str]) -> RunConfig:
    smoke = args.cpu_smoke
    shape = ["model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64"] if smoke else []
    return build(
        "gpt2-124m",
        overrides=[
            *shape,
            f"model.vocab_size={VOCAB}",
            "model.dropout=0.0",
            "data.tokenizer=char",
            f"data.corpus={work / 'corpus.txt'}",
            f"data.dataset_dir={work / 'data'}",
            "loader.verify_shards=false",
            f"batch.micro_batch_size={args.micro_batch}",
            "batch.gradient_accumulation_steps=1",
            f"zero.stage={args.zero}",
            f"precision.bf16={not smoke}",
            f"optimizer.fused_adam={not smoke}",
            "compile.enabled=true",
            "schedule.max_steps=1000000",
            "schedule.warmup_steps=10",
            "logging.progress_bar=off",
            f"logging.run_dir={work / run}",
            *extra,
        ],
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )


@contextlib.contextmanager
def flash_attention(device: torch.device) -> Iterator[None]:
    """On CUDA, SDPA may only use the flash kernel (an error, not a silent fallback, if it cannot)."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        yield


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ours(cfg: RunConfig, dist: ranks.Dist) -> tuple[Callable[[int], torch.Tensor], torch.device]:
    run = setup(cfg, dist, None)
    quiet_monitor(run.engine)  # as train() does: its log, not the engine, writes to the monitor
    timer, faults = PhaseTimer(run.engine.device), Faults(cfg.run_dir(), 1, env={})

    def step(i: int) -> torch.Tensor:
        lr = lr_at(i, cfg.optimizer.lr, cfg.schedule)
        for group in run.engine.optimizer.param_groups:
            group["lr"] = lr
        loss, _, verdict = train_step(
            run, timer, faults, batch_start=run.train_data.consumed_samples, want_grad_norm=False
        )
        bad, _, _ = verdict.wait()
        if bad:
            raise RuntimeError(f"non-finite loss at step {i}")
        return loss

    return step, run.engine.device


def plain(cfg: RunConfig, device: torch.device) -> Callable[[int], torch.Tensor]:
    """nanoGPT's loop (plain_loop.py): bf16 autocast, torch.compile, fused AdamW, clip_grad_norm_."""
    return plain_step(
        cfg, device, compiled=True, bf16=cfg.precision.bf16, fused=True, verify=False, prefetch=2
    )


def timed(
    step: Callable[[int], torch.Tensor], start: int, n: int, device: torch.device
) -> tuple[float, float]:
    """(seconds for n steps, their mean loss): one host sync at the end, as a log interval has."""
    sync(device)
    t = time.perf_counter()
    total = torch.zeros((), device=device)
    for i in range(start, start + n):
        total += step(i)
    loss = float(total.item()) / n
    sync(device)
    return time.perf_counter() - t, loss


def measure(
    loops: dict[str, Callable[[int], torch.Tensor]],
    cfg: RunConfig,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, dict[str, float]]:
    """Alternating rounds of each loop; medians of tokens/s, MFU, and the peak memory of each."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokens = cfg.batch.micro_batch_size * cfg.model.block_size * args.steps * world
    flops = analytic_flops_per_token(cfg.model)
    peak_tflops, source = device_peak_tflops(device, "bf16" if cfg.precision.bf16 else "fp32")
    done = dict.fromkeys(loops, 0)
    for name, step in loops.items():
        t = time.perf_counter()
        with flash_attention(device):
            timed(step, 0, args.warmup, device)  # compiles
        done[name] = args.warmup
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"  {name}: {args.warmup} warm-up steps (compilation) {time.perf_counter() - t:.1f} s",
                flush=True,
            )
    rates: dict[str, list[float]] = {k: [] for k in loops}
    mem: dict[str, float] = dict.fromkeys(loops, 0.0)
    for r in range(args.rounds):
        for name in list(loops) if r % 2 == 0 else list(reversed(loops)):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with flash_attention(device):
                dt, _ = timed(loops[name], done[name], args.steps, device)
            done[name] += args.steps
            rates[name].append(tokens / dt)
            mem[name] = max(mem[name], peak_memory_bytes(device) / 2**30)  # the process's peak RSS on a CPU
    out = {}
    for name, v in rates.items():
        tps = statistics.median(v)
        mfu = tps / world * flops / (peak_tflops * 1e12) if peak_tflops else float("nan")
        out[name] = {
            "tokens_per_s": tps,
            "mfu": mfu,
            "peak_mem_gib": mem[name],
            "peak_tflops": peak_tflops or 0.0,
        }
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"  {name:<34} {tps:>12,.0f} tokens/s   MFU {100 * mfu:5.1f}% of {peak_tflops or 0:.4g} TFLOP/s "
                f"per device ({source})   peak memory {mem[name]:.2f} GiB",
                flush=True,
            )
    return out


def all_ranks(args: argparse.Namespace, work: Path, n: int) -> None:
    """This script again, under torchrun on n ranks, our path only."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
        "--master_addr", "127.0.0.1", "--master_port", "29617", __file__, "--ours-only",
        "--work", str(work), "--rounds", str(args.rounds), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--micro-batch", str(args.micro_batch), "--zero", str(args.zero),
    ] + (["--cpu-smoke"] if args.cpu_smoke else [])  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if args.cpu_smoke:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run(cmd, env=env, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="Tiny model on the CPU: checks the script end to end."
    )
    ap.add_argument("--rounds", type=int, default=5, help="Alternating rounds.")
    ap.add_argument("--steps", type=int, default=20, help="Steps per loop per round.")
    ap.add_argument("--warmup", type=int, default=5, help="Untimed steps per loop (compilation).")
    ap.add_argument("--micro-batch", type=int, default=16, help="Sequences of 1024 tokens per GPU per step.")
    ap.add_argument("--zero", type=int, default=1, choices=[0, 1, 2], help="ZeRO stage of our path.")
    ap.add_argument("--ours-only", action="store_true", help=argparse.SUPPRESS)  # the torchrun children
    ap.add_argument("--work", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpu_smoke:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if "--rounds" not in sys.argv:
            args.rounds, args.steps, args.warmup, args.micro_batch = 2, 2, 2, 2
    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_gpt2_"))
    if dist.is_main and not args.ours_only:
        (work / "corpus.txt").parent.mkdir(parents=True, exist_ok=True)
        corpus(work / "corpus.txt", 2_000_000 if args.cpu_smoke else 20_000_000)
        prepare(config(args, work, "prep", []).data)
    cfg = resolve_vocab(config(args, work, f"ours{dist.world_size}", []), VOCAB)
    if args.ours_only:
        step, device = ours(cfg, dist)
        dist.log(f"our path on {dist.world_size} ranks:")
        res = measure({f"ours, {dist.world_size} ranks": step}, cfg, args, device)
        if dist.is_main:
            (work / "all_ranks.json").write_text(json.dumps(res))
        return
    step, device = ours(cfg, dist)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    m = cfg.model
    print(
        f"{name}: GPT {m.n_layer}/{m.n_head}/{m.n_embd}, block {m.block_size}, vocab {VOCAB}, "
        f"{GPT(m).num_params() / 1e6:.1f}M params; micro batch {cfg.batch.micro_batch_size}; "
        f"{'bf16' if cfg.precision.bf16 else 'fp32'}; ZeRO-{args.zero}; compile on; {args.rounds} rounds of "
        f"{args.steps} steps; torch {torch.__version__}",
        flush=True,
    )
    res = measure({"ours (DeepSpeed)": step, "plain PyTorch loop": plain(cfg, device)}, cfg, args, device)
    ratio = res["ours (DeepSpeed)"]["tokens_per_s"] / res["plain PyTorch loop"]["tokens_per_s"]
    print(f"  ours / plain: {ratio:.3f}", flush=True)
    n = torch.cuda.device_count() if device.type == "cuda" else (2 if args.cpu_smoke else 1)
    if n > 1:
        print(f"all {n} {'GPUs' if device.type == 'cuda' else 'CPU ranks (smoke)'} of the node:", flush=True)
        all_ranks(args, work, n)
        got = json.loads((work / "all_ranks.json").read_text())
        for k, v in got.items():
            scale = v["tokens_per_s"] / res["ours (DeepSpeed)"]["tokens_per_s"]
            print(f"  {k}: {v['tokens_per_s']:,.0f} tokens/s, {scale:.2f}x one rank", flush=True)


if __name__ == "__main__":
    main()
    ranks.leave_distributed()  # not after an error: another rank may be inside a collective
