"""Our DeepSpeed stage-0 path against a plain PyTorch loop: same model, data, batch and schedule.

    .venv/bin/python benchmarks/vs_plain_torch.py [--steps 300] [--repeats 3] [--threads 1]

One process. The plain loop is torch.optim.AdamW (defaults), clip_grad_norm_, the LR schedule and
the same ShardedLoader, with the loss read back at the same log steps. Ours is
`pretrain.train.train` itself (eval and checkpoint only after the last timed step). The two run in
turn, `--repeats` times each, and the tokens/s of the steady state (after the first log interval)
are compared, best of the repeats (the least disturbed by other load on the machine) and median. Each loop's step is split into data / forward+backward / optimizer.
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

from pretrain import engine  # noqa: E402
from pretrain.config import RunConfig  # noqa: E402
from pretrain.dataset import load_manifest, resolve_vocab  # noqa: E402
from pretrain.ds_config import render_deepspeed  # noqa: E402
from pretrain.loader import ShardedLoader  # noqa: E402
from pretrain.metrics import PHASES, PhaseTimer, read_csv  # noqa: E402
from pretrain.model import GPT  # noqa: E402
from pretrain.prepare import prepare  # noqa: E402
from pretrain.presets import build  # noqa: E402
from pretrain.schedule import lr_at  # noqa: E402
from pretrain.train import train  # noqa: E402

SHAPE = [
    "model.n_layer=4",
    "model.n_head=4",
    "model.n_embd=128",
    "model.block_size=64",
    "batch.micro_batch_size=12",
    "batch.gradient_accumulation_steps=1",
    "zero.stage=0",
]


def config(steps: int, log_interval: int, run_dir: Path, data: Path, extra: list[str]) -> RunConfig:
    corpus = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    return build(
        "tiny",
        overrides=[
            *SHAPE,
            f"data.corpus={corpus if corpus.is_file() else 'shakespeare'}",
            f"data.dataset_dir={data}",
            f"schedule.max_steps={steps}",
            "schedule.warmup_steps=10",
            f"logging.log_interval={log_interval}",
            f"logging.eval_interval={steps}",
            "logging.eval_batches=1",
            "logging.sample_tokens=0",
            "logging.progress_bar=off",
            f"logging.run_dir={run_dir}",
            f"checkpoint.interval={steps}",
            *extra,
        ],
        world_size=1,
    )


def plain_torch(cfg: RunConfig, log_interval: int) -> tuple[float, dict[str, float]]:
    """The reference: a textbook PyTorch loop. Returns steady-state tokens/s and the phase split."""
    data_dir = cfg.data.resolved_dir()
    manifest = load_manifest(data_dir)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.model)
    groups = model.param_groups(cfg.optimizer.weight_decay)
    for g in groups:
        g.pop("name")
    o = cfg.optimizer
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    b = cfg.batch
    loader = ShardedLoader(
        [data_dir / s["path"] for s in manifest["train"]],
        block_size=cfg.model.block_size,
        micro_batch_size=b.micro_batch_size,
        grad_accum=1,
        rank=0,
        world_size=1,
        seed=cfg.data.seed,
        shuffle=True,
    )
    timer = PhaseTimer(torch.device("cpu"))
    loss_sum = torch.zeros(())
    t0 = 0.0
    model.train()
    for step in range(cfg.schedule.max_steps):
        if step == log_interval:  # steady state from here, as for ours
            t0 = time.perf_counter()
            timer.reset()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o.lr, cfg.schedule)
        timer.phase("data")
        x, y = loader.next_batch()
        timer.phase("fwd_bwd")
        _, loss = model(x, y)
        loss.backward()
        loss_sum += loss.detach()
        timer.phase("optimizer")
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.stop()
        if (step + 1) % log_interval == 0:
            loss_sum.item()  # the same one host sync per log interval as ours
            loss_sum.zero_()
    dt = time.perf_counter() - t0
    steps = cfg.schedule.max_steps - log_interval
    tokens = steps * b.micro_batch_size * cfg.model.block_size
    return tokens / dt, {p: v / steps for p, v in timer.totals().items()}


def ours(cfg: RunConfig, dist: engine.Dist) -> tuple[float, dict[str, float]]:
    """`pretrain.train.train`, read back from its metrics.csv (rows after the first interval)."""
    train(cfg, dist)
    rows = [r for r in read_csv(cfg.run_dir() / "metrics.csv") if r["tokens_per_s"] is not None][1:]
    steps = cfg.logging.log_interval
    seconds = sum(r["step_time_s"] * steps for r in rows)  # type: ignore[operator]
    tokens = len(rows) * steps * cfg.batch.micro_batch_size * cfg.model.block_size
    split = {p: statistics.fmean(r[f"{p}_s"] for r in rows) for p in PHASES}  # type: ignore[misc]
    return tokens / seconds, split


def breakdown(base: RunConfig, rounds: int = 8, steps: int = 10) -> None:
    """Where DeepSpeed's per-step overhead goes: one engine step (forward, backward, step) on a
    fixed batch, DeepSpeed as it comes and with each of our cuts, against the plain loop's step,
    interleaved in rounds so that other load on the machine hits them all alike."""
    torch.manual_seed(0)
    x = torch.randint(0, base.model.vocab_size or 2, (base.batch.micro_batch_size, base.model.block_size))
    y = torch.randint(0, base.model.vocab_size or 2, x.shape)

    def ds_engine(fused: bool, allreduce: bool) -> object:
        cfg = base.model_copy(update={"optimizer": base.optimizer.model_copy(update={"torch_fused": fused})})
        ds = render_deepspeed(cfg)
        eng = engine.initialize(cfg, engine.build_model(cfg, ds), ds)
        eng.enable_backward_allreduce = allreduce
        return eng

    def ds_step(eng: object) -> None:
        _, loss = eng(x, y)  # type: ignore[operator]
        eng.backward(loss)  # type: ignore[attr-defined]
        eng.step()  # type: ignore[attr-defined]

    model = GPT(base.model)
    opt = torch.optim.AdamW(model.parameters(), lr=base.optimizer.lr)

    def plain_step() -> None:
        _, loss = model(x, y)
        loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(model.parameters(), base.optimizer.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    engines = {
        "DeepSpeed as it comes (per-tensor AdamW, 1-rank all-reduce)": ds_engine(False, True),
        "+ torch AdamW fused=True (optimizer.torch_fused)": ds_engine(True, True),
        "+ no all-reduce over a single rank (what pretrain runs)": ds_engine(True, False),
    }
    fns = {k: (lambda e=e: ds_step(e)) for k, e in engines.items()}
    fns["plain PyTorch step (torch AdamW defaults)"] = plain_step
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        for _ in range(3):
            f()
    for _ in range(rounds):
        for k, f in fns.items():
            t = time.perf_counter()
            for _ in range(steps):
                f()
            times[k].append((time.perf_counter() - t) / steps)
    ref = min(times["plain PyTorch step (torch AdamW defaults)"])
    print(f"\nper-step breakdown, best of {rounds} rounds of {steps} steps (no data loading, no logging):")
    for k, v in times.items():
        print(f"  {k:<62} {1000 * min(v):6.2f} ms/step   plain / this {ref / min(v):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="Optimizer steps per run.")
    ap.add_argument("--log-interval", type=int, default=50, help="Log interval; the first is warmup.")
    ap.add_argument("--repeats", type=int, default=5, help="Runs of each, alternating.")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared box).")
    ap.add_argument("--breakdown", action="store_true", help="Also attribute the per-step overhead.")
    ap.add_argument(
        "--set", dest="extra", action="append", default=[], help="Extra override for our path only."
    )
    args = ap.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    dist = engine.launch_env()
    engine.init_distributed(dist)
    torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="vs_plain_torch_"))
    base = config(args.steps, args.log_interval, work / "run", work / "data", [])
    manifest = load_manifest(prepare(base.data))
    vocab = manifest["tokenizer"]["vocab_size"]
    base = resolve_vocab(base, vocab)
    n_params = GPT(base.model).num_params()
    print(
        f"model: {base.model.n_layer} layers, {base.model.n_head} heads, n_embd {base.model.n_embd}, "
        f"block {base.model.block_size}, vocab {vocab} ({n_params / 1e6:.2f}M params); micro batch "
        f"{base.batch.micro_batch_size}; {args.steps} steps, timed after step {args.log_interval}; "
        f"{args.threads} thread(s); torch {torch.__version__}",
        flush=True,
    )
    results: dict[str, list[tuple[float, dict[str, float]]]] = {"plain": [], "ours": []}
    for i in range(args.repeats):
        results["plain"].append(plain_torch(base, args.log_interval))
        cfg = config(args.steps, args.log_interval, work / f"ours{i}", work / "data", args.extra)
        results["ours"].append(ours(resolve_vocab(cfg, vocab), dist))
        print(
            f"repeat {i + 1}: plain {results['plain'][-1][0]:,.0f} tok/s, ours {results['ours'][-1][0]:,.0f} tok/s",
            flush=True,
        )
    print(
        f"\n{'loop':<34} {'best tok/s':>10} {'median':>8}   median ms/step: {'data':>6} {'fwd+bwd':>8} {'optim':>6}"
    )
    best, med = {}, {}
    for name, label in (("plain", "plain PyTorch (torch AdamW)"), ("ours", "pretrain + DeepSpeed stage 0")):
        runs = sorted(results[name], key=lambda r: r[0])
        best[name] = runs[-1][0]
        med[name], split = runs[len(runs) // 2]
        cols = " ".join(f"{1000 * split[p]:>{w}.2f}" for p, w in zip(PHASES, (6, 8, 6), strict=True))
        print(f"{label:<34} {best[name]:>10,.0f} {med[name]:>8,.0f}                   {cols}")
    print(
        f"ratio ours / plain: {best['ours'] / best['plain']:.3f} best of {args.repeats} "
        f"(the least disturbed run of each), {med['ours'] / med['plain']:.3f} median"
    )
    if args.breakdown:
        breakdown(base)


if __name__ == "__main__":
    main()
