"""What a training step pays besides forward, backward and the optimizer.

    .venv/bin/python benchmarks/step_overhead.py [--rounds 20] [--threads 1]

One process, the 4-layer / 4-head / 128-wide model (block 64, micro batch 12; `--shape 1/1/32`: a
1-layer, 32-wide one, whose step is short enough for the overhead to stand out), ZeRO 0, fp32. Two
step functions on the same engine, model, optimizer and loader, timed in alternating rounds of 10
steps, medians over the rounds:
- bare: the engine's module forward, `loss.backward()`, the torch AdamW step, `zero_grad`;
- ours: what `train()` does each step: the LR, `train_step()` (DeepSpeed's forward / backward /
  step, the timers, clipping and the gradient norm), the ranks' non-finite-loss agreement, the loss sum.
Timed in CPU seconds of this process (`time.process_time`), which other processes' load barely moves;
wall seconds are printed too. The loader's prefetch thread is off, so all work is on this thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pretrain.config.presets import build  # noqa: E402
from pretrain.data.prepare import prepare  # noqa: E402
from pretrain.training import faults, guards  # noqa: E402
from pretrain.training.distributed import ranks  # noqa: E402
from pretrain.training.loop import train_step  # noqa: E402
from pretrain.training.metrics import PhaseTimer, quiet_monitor  # noqa: E402
from pretrain.training.run import setup  # noqa: E402
from pretrain.training.schedule import lr_at  # noqa: E402

COMMON = ["zero.stage=0", "logging.progress_bar=off", "loader.prefetch=0"]
SHAPES = {
    # the model of issue 11's figures
    "4/4/128": ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=64",
                "batch.micro_batch_size=12"],
    # a step of a few ms, where the overhead (per step, mostly not per FLOP) stands out of the noise
    "1/1/32": ["model.n_layer=1", "model.n_head=1", "model.n_embd=32", "model.block_size=32",
               "batch.micro_batch_size=4"],
}  # fmt: skip
SHAPE = [*SHAPES["4/4/128"], *COMMON]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="Alternating rounds of 10 steps each.")
    ap.add_argument("--shape", choices=list(SHAPES), default="4/4/128", help="The model and batch.")
    ap.add_argument("--threads", type=int, default=1, help="torch threads.")
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="step_overhead_"))
    corpus = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    cfg = build(
        "tiny",
        overrides=[*SHAPES[args.shape], *COMMON, f"data.corpus={corpus if corpus.is_file() else 'shakespeare'}",
                   f"data.dataset_dir={work / 'data'}", f"logging.run_dir={work / 'run'}"],
        world_size=1,
    )  # fmt: skip
    prepare(cfg.data)
    run = setup(cfg, dist, None)
    quiet_monitor(run.engine)  # as train() does: its log, not the engine, writes to the monitor
    eng, opt = run.engine, run.engine.optimizer
    timer = PhaseTimer(eng.device)
    injected = faults.Faults(work, 12, env={})
    loss_sum = torch.zeros(())

    def bare() -> None:
        x, y = run.train_data.next_batch()
        _, loss = eng.module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    done = [0]

    def ours() -> None:
        lr = lr_at(done[0], cfg.optimizer.lr, cfg.schedule)
        for g in opt.param_groups:
            g["lr"] = lr
        out = train_step(
            run, timer, injected, batch_start=run.train_data.consumed_samples, want_grad_norm=False
        )
        if len(out) == 3:  # the agreement started inside the step
            out[2].wait()
        else:  # before it was: agree after the step
            guards.agree(out[0], None, run.ctrl)  # type: ignore[attr-defined]
        loss_sum.add_(out[0])
        done[0] += 1

    fns = {"bare fwd/bwd/AdamW": bare, "ours (train()'s step)": ours}
    for f in fns.values():
        for _ in range(5):
            f()
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    wall: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(args.rounds):
        for k in list(fns) if r % 2 == 0 else list(reversed(fns)):  # neither always first
            f = fns[k]
            t, w = time.process_time(), time.perf_counter()
            for _ in range(10):
                f()
            cpu[k].append((time.process_time() - t) / 10)
            wall[k].append((time.perf_counter() - w) / 10)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {args.threads} thread(s)")
    for k in fns:
        print(
            f"{k:<24} {1000 * statistics.median(cpu[k]):7.2f} ms CPU/step, "
            f"{1000 * statistics.median(wall[k]):7.2f} ms wall/step (medians of {args.rounds} rounds of 10)"
        )
    b, o = (statistics.median(cpu[k]) for k in fns)
    print(f"overhead: {1000 * (o - b):.2f} ms CPU/step = {100 * (o - b) / o:.1f}% of our step")


if __name__ == "__main__":
    main()
    ranks.leave_distributed()  # not after an error: another rank may be inside a collective
