"""What each ZeRO stage costs, measured: stage x offload x micro batch on N ranks.

    .venv/bin/python benchmarks/zero_stages.py [--nproc 2] [--micro 2,8] [--out DIR] [--quick] [--budget-gb G]

Starts `torchrun --nproc_per_node N` (gloo on the CPU, NCCL on GPUs) running this file as a worker,
which trains each variant for a few steps with the real engine (`pretrain.training.distributed.engine`) and measures per
rank:

- tokens/s over the measured steps;
- model-state memory: the bytes of every live tensor (a census of the Python heap) at the end of
  the last backward pass, before and after DeepSpeed's gradient reduction (the larger), when
  parameters, gradients and optimizer state all exist, less the census before the model was built; next to `pretrain plan`'s formula (all of it in host memory here, offload
  or not, since the device is the CPU);
- peak memory: the peak RSS (CPU) or max allocated (CUDA) over the measured steps, less the memory
  in use before the model was built; next to the plan's states + activations;
- bytes communicated per step, from DeepSpeed's comms logger, counted as the ZeRO paper counts them
  (an all-reduce of X moves 2X, a reduce-scatter or an all-gather of X moves X), next to 2Ψ or 3Ψ.

Writes `zero_stages.csv`, `zero_stages.png` and `zero_stages.md` (the table docs/zero.md quotes) to --out,
by default a run directory of its own (`runs/bench/zero_stages-<time>`, which git ignores): the committed
`benchmarks/results/` changes only when named. Ends with one line, `pick: ZeRO-N ... because ...`: the
variant that measured the most tokens/s (within 5% of it, run-to-run noise on a shared machine, the lowest
stage and least offload) among those whose peak fits `--budget-gb`. `--quick`: a 2-layer model of
n_embd 128, the paper's knobs only, one micro batch, 1 + 2 steps a variant, a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The model: big enough that its states dwarf allocator noise, small enough for 2 CPU cores.
SHAPE = ["model.n_layer=6", "model.n_head=12", "model.n_embd=768", "model.block_size=64"]
QUICK_SHAPE = ["model.n_layer=2", "model.n_head=4", "model.n_embd=128", "model.block_size=64"]  # --quick
VARIANTS = [  # (stage, offload_optimizer, offload_param)
    (0, False, False),
    (1, False, False),
    (1, True, False),
    (2, False, False),
    (2, True, False),
    (3, False, False),
    (3, True, False),
    (3, True, True),
]
# DeepSpeed knobs under which it communicates as the ZeRO paper counts ("paper": every variant), and
# its defaults ("default": stages 1-3 without offload at the first micro batch, to show the gap):
# - stages 1-2: by default each gradient bucket is all-reduced (2Ψ) and only the partition kept,
#   where the paper reduce-scatters (Ψ); `use_multi_rank_bucket_allreduce: false` reduces each
#   slice to its owner instead;
# - stage 3: by default parameters stay gathered between forward and backward when they will be
#   reused within 1e9 elements (`stage3_max_reuse_distance`) or were prefetched (up to 5e7 elements
#   ahead, `stage3_prefetch_bucket_size`), so a model this size is gathered once per step, not
#   twice; and tensors under 1e5 elements are never partitioned
#   (`stage3_param_persistence_threshold`).
KNOBS = {
    1: "use_multi_rank_bucket_allreduce: false",
    2: "use_multi_rank_bucket_allreduce: false",
    3: "stage3_max_reuse_distance: 0, stage3_prefetch_bucket_size: 0, stage3_max_live_parameters: 0, stage3_param_persistence_threshold: 0",
}
# How the paper counts per-rank volume for each collective DeepSpeed's comms logger records (its
# message size is the tensor handed to the call: the shard for all-gathers, the whole for the rest).
VOLUME = {
    "all_reduce": lambda size, n: 2 * size,
    "all_reduce_coalesced": lambda size, n: 2 * size,
    "inference_all_reduce": lambda size, n: 2 * size,
    "reduce_scatter_tensor": lambda size, n: size,
    "reduce_scatter": lambda size, n: size,
    "reduce_scatter_fn": lambda size, n: size,
    "reduce": lambda size, n: size,
    "all_gather_into_tensor": lambda size, n: size * n,
    "allgather_fn": lambda size, n: size * n,
    "all_gather": lambda size, n: size * n,
    "broadcast": lambda size, n: size,
}


def overrides(
    stage: int,
    off: bool,
    par: bool,
    micro: int,
    knobs: str,
    bucket: int,
    run_dir: Path,
    data: Path,
    *,
    quick: bool = False,
) -> list[str]:
    corpus = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    zero = f", zero_optimization: {{{KNOBS[stage]}}}" if knobs == "paper" and stage in KNOBS else ""
    return [
        *(QUICK_SHAPE if quick else SHAPE),
        f"data.corpus={corpus if corpus.is_file() else 'shakespeare'}",
        f"data.dataset_dir={data}",
        f"batch.micro_batch_size={micro}",
        "batch.gradient_accumulation_steps=1",
        f"zero.stage={stage}",
        f"zero.offload_optimizer={str(off).lower()}",
        f"zero.offload_param={str(par).lower()}",
        f"zero.reduce_bucket_size={bucket}",
        f"zero.allgather_bucket_size={bucket}",
        "logging.tensorboard=false",
        f"logging.run_dir={run_dir}",
        f"deepspeed_extra={{comms_logger: {{enabled: true, prof_all: true, verbose: false}}{zero}}}",
    ]


def variant_name(stage: int, off: bool, par: bool, micro: int, knobs: str) -> str:
    return f"zero{stage}{'_offload' if off else ''}{'_param' if par else ''}_micro{micro}_{knobs}"


# ---------------------------------------------------------------------------------------------
# worker: one rank


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so RSS is what is in use


def _rss() -> int:
    from pretrain.training.metrics import current_rss_bytes

    return current_rss_bytes()


def _reset_peak(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS


def _peak(device: Any) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def tensor_census(device_type: str, show: int = 0) -> int:
    """Bytes of every distinct tensor storage alive on the Python heap on this device type; with
    `show`, print the largest storages (shape and dtype of one tensor viewing each)."""
    import torch

    sizes: dict[int, int] = {}
    views: dict[int, str] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == device_type:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
            views.setdefault(storage.data_ptr(), f"{type(obj).__name__} {tuple(obj.shape)} {obj.dtype}")
    for ptr, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:show]:
        print(f"  census: {size / 1e6:9.2f} MB  {views[ptr]}", flush=True)
    return sum(sizes.values())


def comm_volume(world: int) -> tuple[float, dict[str, float]]:
    """Bytes per rank recorded by DeepSpeed's comms logger since its last reset, by op."""
    import deepspeed.comm as dscomm

    by_op: dict[str, float] = {}
    for name, sizes in dscomm.comms_logger.comms_dict.items():
        op = name.split("|")[0].strip()
        rule = VOLUME.get(op)
        if rule is None:
            continue
        for size, record in sizes.items():
            by_op[op] = by_op.get(op, 0.0) + rule(size, world) * record[0]
    return sum(by_op.values()), by_op


def worker(args: argparse.Namespace) -> None:
    """One variant on one rank, in a fresh process: so every measurement starts from the same heap."""
    import deepspeed.comm as dscomm
    import torch.distributed as tdist

    from pretrain.config.ds_render import render_deepspeed
    from pretrain.config.presets import build
    from pretrain.data.dataset import load_manifest, resolve_vocab
    from pretrain.data.loader import ShardedLoader
    from pretrain.training.distributed import engine as ds_engine
    from pretrain.training.distributed import ranks

    stage, off, par = (int(v) for v in args.variant.split(","))
    micro, knobs = int(args.micro), args.knobs
    name = variant_name(stage, bool(off), bool(par), micro, knobs)
    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    work = Path(args.work)
    cfg = build(
        "tiny",
        overrides=overrides(
            stage,
            bool(off),
            bool(par),
            micro,
            knobs,
            args.bucket,
            work / name,
            work / "data",
            quick=args.quick,
        ),
        world_size=dist.world_size,
    )
    manifest = load_manifest(cfg.data.resolved_dir())
    cfg = resolve_vocab(cfg, manifest["tokenizer"]["vocab_size"])
    ds_config = render_deepspeed(cfg)
    dev = ranks.device()

    _trim()
    tdist.barrier()
    base_rss, base_census = _rss(), tensor_census(dev.type)
    model = ds_engine.build_model(cfg, ds_config)
    engine = ds_engine.initialize(cfg, model, ds_config)
    loader = ShardedLoader(
        [cfg.data.resolved_dir() / s["path"] for s in manifest["train"]],
        block_size=cfg.model.block_size,
        micro_batch_size=micro,
        grad_accum=1,
        rank=dist.rank,
        world_size=dist.world_size,
        seed=cfg.data.seed,
    )
    census, t0, base_peak, t_census = 0, 0.0, 0, 0.0
    reduce_gradients = engine.allreduce_gradients

    def census_then_reduce(*a: Any, **k: Any) -> Any:
        # Autograd is done and DeepSpeed's backward epilogue has not reduced (and freed) anything:
        # parameters, full or bucketed gradients and optimizer state all exist; activations are gone.
        nonlocal census, t_census
        t = time.perf_counter()
        census = max(census, tensor_census(dev.type, args.show if dist.is_main else 0) - base_census)
        t_census += time.perf_counter() - t  # the census is not training time
        return reduce_gradients(*a, **k)

    for step in range(args.warmup + args.steps):
        if step == args.warmup:  # the optimizer state exists from here on
            tdist.barrier()
            _trim()
            _reset_peak(dev)
            base_peak = _peak(dev)
            dscomm.comms_logger.reset_data()
            t0 = time.perf_counter()
        last = step == args.warmup + args.steps - 1
        if last:
            engine.allreduce_gradients = census_then_reduce
        x, y = loader.next_batch()
        _, loss = engine(x.to(dev), y.to(dev))
        engine.backward(loss)
        del loss
        if last:
            engine.allreduce_gradients = reduce_gradients
            t = time.perf_counter()
            census = max(census, tensor_census(dev.type) - base_census)  # and after the epilogue
            t_census += time.perf_counter() - t
        engine.step()
    t0 += t_census
    dt = time.perf_counter() - t0
    peak = _peak(dev)
    volume, by_op = comm_volume(dist.world_size)
    row = {
        "name": name,
        "stage": stage,
        "offload": "optimizer+params" if par else "optimizer" if off else "none",
        "micro": micro,
        "knobs": knobs,
        "rank": dist.rank,
        "tokens_per_s": args.steps * micro * cfg.model.block_size / dt,
        "census_gb": census / 1e9,
        "peak_gb": (peak - base_rss) / 1e9 if dev.type == "cpu" else peak / 1e9,
        "peak_above_steady_gb": (peak - base_peak) / 1e9,
        "comm_gb_per_step": volume / args.steps / 1e9,
        "comm_by_op": {k: v / args.steps / 1e9 for k, v in by_op.items()},
        "optimizer": type(engine.basic_optimizer).__name__,
    }
    rows: list[Any] = [None] * dist.world_size
    tdist.all_gather_object(rows, row)
    if dist.is_main:
        (work / "results" / f"{name}.json").write_text(json.dumps(rows, indent=1))
        r0 = rows[0]
        print(
            f"{name}: {sum(r['tokens_per_s'] for r in rows):,.0f} tok/s, states {r0['census_gb']:.3f} GB, "
            f"peak {r0['peak_gb']:.3f} GB, comm {r0['comm_gb_per_step']:.4f} GB/step {r0['comm_by_op']}",
            flush=True,
        )
    tdist.barrier()
    tdist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# driver: launch each variant, then compare with the plan


def predictions(
    micro: int, world: int, bucket: int, work: Path, *, quick: bool = False
) -> dict[tuple[int, str], dict[str, float]]:
    """`pretrain plan`'s numbers for this shape, everything counted as host memory (a CPU run)."""
    from pretrain.config.presets import build
    from pretrain.config.tree import analytic_num_params
    from pretrain.data.dataset import load_manifest
    from pretrain.plan.stages import plan_stages
    from pretrain.plan.timing import comm_elements

    vocab = load_manifest(work / "data")["tokenizer"]["vocab_size"]
    cfg = build(
        "tiny",
        overrides=[
            *overrides(0, False, False, micro, "paper", bucket, work, work / "data", quick=quick),
            f"model.vocab_size={vocab}",
        ],
        world_size=world,
    )
    n = analytic_num_params(cfg.model)
    preds = {}
    for plan in plan_stages(cfg, world, device_gb=None):
        states = plan.model_states_gb + plan.host_gb
        preds[(plan.stage, plan.offload)] = {
            "states_gb": states,
            "peak_gb": states + plan.activations_gb + plan.working_gb,
            # comm_gb_per_step counts fp32 here; the same as the paper's 2Ψ / 3Ψ x 4 bytes
            "comm_gb": comm_elements(n, plan.stage, 1) * 4 / 1e9,
        }
    return preds


def report(
    out: Path, world: int, bucket: int, work: Path, names: list[str], *, quick: bool, budget_gb: float | None
) -> None:
    rows = []
    for name in names:
        ranks = json.loads((work / "results" / f"{name}.json").read_text())
        r0 = ranks[0]
        pred = predictions(r0["micro"], world, bucket, work, quick=quick)[(r0["stage"], r0["offload"])]
        states = max(r["census_gb"] for r in ranks)
        peak = max(r["peak_gb"] for r in ranks)
        comm = max(r["comm_gb_per_step"] for r in ranks)
        rows.append(
            {
                "stage": r0["stage"],
                "offload": r0["offload"],
                "micro": r0["micro"],
                "knobs": r0["knobs"],
                "tokens_per_s": round(sum(r["tokens_per_s"] for r in ranks), 1),
                "states_gb": round(states, 4),
                "states_plan_gb": round(pred["states_gb"], 4),
                "states_err_pct": round(100 * (states / pred["states_gb"] - 1), 1),
                "peak_gb": round(peak, 4),
                "peak_plan_gb": round(pred["peak_gb"], 4),
                "comm_gb": round(comm, 4),
                "comm_theory_gb": round(pred["comm_gb"], 4),
                "comm_err_pct": round(100 * (comm / pred["comm_gb"] - 1), 1),
                "comm_ops": " ".join(f"{k}={v:.4f}" for k, v in sorted(r0["comm_by_op"].items())),
                "optimizer": r0["optimizer"],
            }
        )
    with (out / "zero_stages.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = [
        "| stage | offload | micro | DeepSpeed knobs | tokens/s | model states GB (plan) | err | "
        "peak GB (plan) | comm GB/step (theory) | err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {r['offload']} | {r['micro']} | {r['knobs']} | {r['tokens_per_s']:,.0f} | "
            f"{r['states_gb']:.3f} ({r['states_plan_gb']:.3f}) | {r['states_err_pct']:+.1f}% | "
            f"{r['peak_gb']:.3f} ({r['peak_plan_gb']:.3f}) | {r['comm_gb']:.3f} ({r['comm_theory_gb']:.3f}) | "
            f"{r['comm_err_pct']:+.1f}% |"
        )
    lines += ["", pick(rows, world, budget_gb)]
    (out / "zero_stages.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, out / "zero_stages.png", world)
    print(f"wrote {out}/zero_stages.{{csv,md,png}}")


def pick(rows: list[dict[str, Any]], world: int, budget_gb: float | None) -> str:
    """One line: the stage to pick from the measured rows (the paper's knobs), and why: the most
    tokens/s among the rows whose peak fits `budget_gb` (within 5% of it, the lowest stage and least
    offload), beside the best row of each other stage."""
    measured = [r for r in rows if r["knobs"] == "paper"] or rows
    fitting = [r for r in measured if budget_gb is None or r["peak_gb"] <= budget_gb]
    if not fitting:
        least = min(measured, key=lambda r: r["peak_gb"])
        return (
            f"pick: none; every variant's peak is over {budget_gb} GB a rank, the least ZeRO-{least['stage']} "
            f"{least['offload']} at {least['peak_gb']:.3f} GB"
        )
    most = max(r["tokens_per_s"] for r in fitting)
    best = min(
        (r for r in fitting if r["tokens_per_s"] >= 0.95 * most),
        key=lambda r: (r["offload"] != "none", r["offload"], r["stage"]),
    )
    fits = f"whose peak fits {budget_gb} GB a rank" if budget_gb is not None else "measured"
    why = (
        "the most tokens/s"
        if best["tokens_per_s"] == most
        else "the lowest stage within 5% of the most tokens/s"
    )
    others = []
    for stage in sorted({r["stage"] for r in measured} - {best["stage"]}):
        ok = [r for r in fitting if r["stage"] == stage]
        if not ok:
            others.append(f"ZeRO-{stage} over the budget")
            continue
        r = max(ok, key=lambda r: r["tokens_per_s"])
        others.append(
            f"ZeRO-{stage} {r['offload']} {r['tokens_per_s']:,.0f} tokens/s ({r['tokens_per_s'] / best['tokens_per_s'] - 1:+.0%}), "
            f"{r['peak_gb']:.3f} GB"
        )
    return (
        f"pick: ZeRO-{best['stage']} {best['offload']} (micro {best['micro']}) for this model on {world} ranks, "
        f"because it has {why} of the variants {fits}: {best['tokens_per_s']:,.0f} tokens/s, peak "
        f"{best['peak_gb']:.3f} GB a rank, model states {best['states_gb']:.3f} GB"
        + (f"; {', '.join(others)}." if others else ".")
    )


def plot(rows: list[dict[str, Any]], path: Path, world: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(r: dict[str, Any]) -> str:
        off = {"none": "", "optimizer": "+off", "optimizer+params": "+off+p"}[r["offload"]]
        return f"{r['stage']}{off}\nm{r['micro']}{' dflt' if r['knobs'] == 'default' else ''}"

    x = list(range(len(rows)))
    labels = [label(r) for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(12, 10), layout="constrained")
    w = 0.4
    ax = axes[0]
    ax.bar(
        [i - w / 2 for i in x],
        [r["states_gb"] for r in rows],
        w,
        label="model states, measured (tensor census)",
    )
    ax.bar(
        [i + w / 2 for i in x],
        [r["states_plan_gb"] for r in rows],
        w,
        label="model states, plan (ZeRO formula)",
    )
    ax.plot(x, [r["peak_gb"] for r in rows], "k_", markersize=16, mew=2, label="peak, measured")
    ax.plot(x, [r["peak_plan_gb"] for r in rows], "r_", markersize=16, mew=2, label="peak, plan")
    ax.set_ylabel("GB per rank")
    ax.set_title(f"Memory per rank ({world} ranks, fp32, everything in host memory)")
    ax.set_ylim(0, 1.35 * max(r["peak_gb"] for r in rows))  # room for the legend above the bars
    ax.legend(fontsize=8, ncols=4, loc="upper left")
    ax = axes[1]
    ax.bar([i - w / 2 for i in x], [r["comm_gb"] for r in rows], w, label="measured (DeepSpeed comms logger)")
    ax.bar(
        [i + w / 2 for i in x],
        [r["comm_theory_gb"] for r in rows],
        w,
        label="theory (2Ψ stages 0-2, 3Ψ stage 3)",
    )
    ax.set_ylabel("GB per rank per step")
    ax.set_title("Communication per optimizer step")
    ax.set_ylim(0, 1.3 * max(max(r["comm_gb"], r["comm_theory_gb"]) for r in rows))
    ax.legend(fontsize=8, ncols=2, loc="upper left")
    ax = axes[2]
    ax.bar(x, [r["tokens_per_s"] for r in rows], 0.6, color="tab:purple")
    ax.set_ylabel("tokens / s (all ranks)")
    ax.set_title("Throughput")
    for a in axes:
        a.set_xticks(x, labels, fontsize=8)
        a.grid(axis="y", alpha=0.3)
    axes[2].set_xlabel(
        "ZeRO stage (+off: optimizer offload, +p: parameter offload), micro batch (dflt: DeepSpeed defaults)"
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="Ranks (torchrun --nproc_per_node).")
    ap.add_argument("--micro", default="2,8", help="Micro batch sizes, comma-separated.")
    ap.add_argument("--warmup", type=int, default=2, help="Unmeasured steps per variant.")
    ap.add_argument("--steps", type=int, default=2, help="Measured steps per variant.")
    ap.add_argument("--bucket", type=int, default=2_000_000, help="ZeRO reduce/allgather bucket (elements).")
    ap.add_argument(
        "--out",
        default=None,
        help="Output directory (default: runs/bench/zero_stages-<time>; the committed one is benchmarks/results).",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="A 2-layer model, the paper's knobs, one micro batch, 1 + 2 steps.",
    )
    ap.add_argument(
        "--budget-gb", type=float, default=None, help="Peak GB a rank a variant must fit to be picked."
    )
    ap.add_argument(
        "--work", default=str(Path(tempfile.gettempdir()) / "zero_stages"), help="Data and scratch directory."
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--knobs", default="paper", help=argparse.SUPPRESS)
    ap.add_argument("--show", type=int, default=0, help="Print the largest tensors at the census.")
    ap.add_argument("--stages", default="0,1,2,3", help="Run only these stages (the report reads all).")
    ap.add_argument("--report-only", action="store_true", help="Rebuild CSV/PNG/table from the last results.")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "runs" / "bench" / f"zero_stages-{stamp}"
    work = Path(args.work) / (
        "quick" if args.quick else "full"
    )  # a quick sweep leaves the full one's results
    out.mkdir(parents=True, exist_ok=True)
    (work / "results").mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.micro, args.warmup, args.steps = args.micro.split(",")[0], 1, 2
    micros = [int(m) for m in args.micro.split(",")]
    runs = [(v, m, "paper") for m in micros for v in VARIANTS]
    if not args.quick:
        runs += [((s, False, False), micros[0], "default") for s in (1, 2, 3)]
    names = [variant_name(*v, m, k) for v, m, k in runs]
    if not args.report_only:
        from pretrain.config.presets import build
        from pretrain.data.prepare import prepare

        data_cfg = build(
            "tiny", overrides=overrides(0, False, False, 1, "paper", 1, work, work / "data", quick=args.quick)
        ).data
        prepare(data_cfg, force=True)  # the scratch copy follows the current data format
        env = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"), OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = str(ROOT)
        for (stage, off, par), micro, knobs in runs:
            if str(stage) not in args.stages.split(","):
                continue
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker",
                "--variant", f"{stage},{int(off)},{int(par)}", "--micro", str(micro), "--knobs", knobs,
                "--warmup", str(args.warmup), "--steps", str(args.steps), "--bucket", str(args.bucket),
                "--work", str(work), "--show", str(args.show), *(["--quick"] if args.quick else []),
            ]  # fmt: skip
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith(("zero", "  census"))]
            print("\n".join(lines) or proc.stdout[-3000:] + proc.stderr[-3000:], flush=True)
            proc.check_returncode()
    report(out, args.nproc, args.bucket, work, names, quick=args.quick, budget_gb=args.budget_gb)


if __name__ == "__main__":
    main()
