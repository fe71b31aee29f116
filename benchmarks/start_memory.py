"""Peak host memory a rank holds at start: one rank against tensor and pipeline parallelism.

    .venv/bin/python benchmarks/start_memory.py [--layers 24 --n-embd 1536 --vocab 8192] [--layouts one,tp2,pp2,tp2-whole]

For each layout, starts the ranks (`torch.distributed.run`, gloo on the CPU) running this file as a
worker, which builds the engine as `pretrain train` does (the rendered DeepSpeed JSON,
`engine.build_model`, `engine.initialize`) and reports, per rank: its RSS before the model (torch,
DeepSpeed and the process group), and its peak RSS (VmHWM) when `deepspeed.initialize` has returned,
i.e. at the first step. On the CPU the device is the host, so the model is in these figures.

ZeRO-0 in fp32 by default: AdamW's moments are made at the first step, so the peak at start is the
model and whatever its construction held on the way. `tp2-whole` is the same TP2 run built the way
DeepSpeed's engine shards a model itself: the GPT built whole, AutoTP cutting it inside
`deepspeed.initialize` (the baseline). Prints a table; `--json` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {  # name: (ranks, overrides, build whole and let DeepSpeed shard it)
    "one": (1, [], False),
    "tp2": (2, ["parallel.tensor=2"], False),
    "pp2": (2, ["parallel.pipeline=2"], False),
    "tp2-whole": (2, ["parallel.tensor=2"], True),
}


def shape(args: argparse.Namespace) -> list[str]:
    return [
        f"model.n_layer={args.layers}",
        f"model.n_head={args.n_embd // 64}",
        f"model.n_embd={args.n_embd}",
        "model.block_size=64",
        f"model.vocab_size={args.vocab}",
        f"zero.stage={args.stage}",
        "batch.micro_batch_size=1",
        "batch.gradient_accumulation_steps=2",  # a pipeline needs micro batches to pass along
        "optimizer.fused_adam=false",
        "optimizer.grad_clip=0",  # a pipeline at stage 0 clips by the first stage's norm (refused)
    ]


def _kib(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(args: argparse.Namespace) -> None:
    import gc

    import torch.distributed as tdist

    from pretrain.config.ds_render import render_deepspeed
    from pretrain.config.presets import build
    from pretrain.training.distributed import engine, ranks

    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    _, overrides, whole = LAYOUTS[args.layout]
    cfg = build("tiny", overrides=[*shape(args), *overrides], world_size=dist.world_size)
    ds_config = render_deepspeed(cfg)
    gc.collect()
    tdist.barrier()
    before = _kib("VmRSS")
    # tp2-whole: the GPT built whole, for DeepSpeed's engine to shard it inside initialize
    model = engine.build_gpt(cfg, ds_config, ranks.device()) if whole else engine.build_model(cfg, ds_config)
    eng = engine.initialize(cfg, model, ds_config)
    peak = _kib("VmHWM")
    params = sum(p.numel() for p in eng.module.parameters())
    figures = [None] * dist.world_size
    tdist.all_gather_object(figures, {"before": before, "peak": peak, "params": params})
    if dist.is_main:
        Path(args.out).write_text(json.dumps(figures))
    ranks.leave_distributed()


def run(layout: str, args: argparse.Namespace, work: Path) -> list[dict[str, int]]:
    from pretrain.cluster.reach import free_port

    ranks = LAYOUTS[layout][0]
    out = work / f"{layout}.json"
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
                "127.0.0.1", "--master_port", str(free_port())] if ranks > 1 else []  # fmt: skip
    cmd = [sys.executable, *launcher, __file__, "--worker", "--layout", layout, "--out", str(out)]
    cmd += ["--layers", str(args.layers), "--n-embd", str(args.n_embd), "--vocab", str(args.vocab)]
    cmd += ["--stage", str(args.stage)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if not out.is_file():
        raise SystemExit(f"{layout}: the ranks failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    if proc.returncode != 0:  # after the figures were gathered: gloo's teardown at exit (SIGABRT)
        print(f"note: {layout}: the ranks exited with {proc.returncode} after reporting", file=sys.stderr)
    return list(json.loads(out.read_text()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--stage", type=int, default=0, help="ZeRO stage (0: the model alone at start)")
    p.add_argument("--layouts", default="one,tp2,pp2,tp2-whole")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[str, list[dict[str, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts.split(","):
            results[layout] = run(layout, args, Path(tmp))
    one = max(r["peak"] for r in results["one"]) if "one" in results else None
    n = results[next(iter(results))][0]["params"] if "one" not in results else results["one"][0]["params"]
    print(
        f"{args.layers} layers, n_embd {args.n_embd}, vocab {args.vocab}: {n / 1e6:.0f}M parameters, ZeRO-{args.stage}, fp32"
    )
    print(
        f"{'layout':<10} {'rank':>4} {'params':>9} {'RSS before':>11} {'peak RSS':>9} {'peak - before':>14} {'peak / one rank':>16}"
    )
    for layout, ranks in results.items():
        for rank, r in enumerate(ranks):
            ratio = f"{r['peak'] / one:.2f}" if one else "-"
            print(
                f"{layout:<10} {rank:>4} {r['params'] / 1e6:>8.0f}M {r['before'] / 2**20:>9.0f}MB "
                f"{r['peak'] / 2**20:>7.0f}MB {(r['peak'] - r['before']) / 2**20:>12.0f}MB {ratio:>16}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
