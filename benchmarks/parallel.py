"""`pretrain plan` against measurement for data, tensor and pipeline parallelism and a mix: the `small`
preset on gloo ranks here, the same global batch in every layout.

    .venv/bin/python benchmarks/parallel.py [--steps 10] [--repeats 2] [--out benchmarks/results]

As `benchmarks/plan_check.py` does for the ZeRO stages:

1. Measures the all-reduce bus bandwidth between 2 and between 4 local ranks (`pretrain preflight`'s probe).
2. Trains each layout for --steps steps under `torchrun` (the real engine), --repeats times in turn,
   and takes the median step time of the logged steps after the first (the median over the repeats).
   Memory: one more run of each layout gives each rank's peak RSS (`ranks.csv`), less that layout's
   footprint with a near-empty model (interpreter, torch, DeepSpeed, gloo: what the plan does not
   count), measured the same way. These ranks run with glibc's mmap threshold fixed at 64 KiB
   (`MALLOC_MMAP_THRESHOLD_`; not in the timed runs, where it costs system time), so that every tensor
   above it is its own mapping, unmapped when freed, and peak RSS follows peak live memory as
   `max_memory_allocated` does on a GPU. Under glibc's default the threshold rises to the size of each
   mapped chunk freed (up to 32 MiB), after which freed activations and gradients stay resident in the
   heap: measured on DP2 with probes of glibc's in-use bytes (mallinfo2) at every phase, peak RSS above
   the footprint was 197 MB where peak live memory was 120 MB; with the fixed threshold, 118 MB.
3. Predicts each layout's step time and memory per rank with `pretrain.plan.timing` and `.plan`, its rates
   calibrated once, on the DP2 runs (`pretrain plan --from-run`), with the bus bandwidth of its world.

Writes parallel.md (the table) to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from plan_check import QUIET, ROOT, TINY_SHAKESPEARE, bus_bandwidth, measured_step_s, report, train

from pretrain.config.layout import layout_of
from pretrain.config.presets import build
from pretrain.config.tree import RunConfig
from pretrain.data.dataset import resolve_vocab
from pretrain.data.prepare import prepare
from pretrain.files import read_csv
from pretrain.plan.layout import stage_shares
from pretrain.plan.memory import bucket_written_bytes
from pretrain.plan.rates import resolve_rates
from pretrain.plan.stages import plan_stages
from pretrain.plan.timing import predict_step

CORPUS = TINY_SHAKESPEARE if TINY_SHAKESPEARE.is_file() else ROOT / "tests" / "data" / "tinyshakespeare.txt"
MICRO, SEQUENCES = 4, 16  # micro batch, and the global batch every layout keeps
# name: (ranks, tensor, pipeline). Without data parallelism a step is 4 micro batches, so PP2's
# bubble is (p - 1) / (m + p - 1) = 1/5 of its time.
LAYOUTS = {"DP2": (2, 1, 1), "TP2": (2, 2, 1), "PP2": (2, 1, 2), "TP2xPP2": (4, 2, 2)}
CALIBRATION = "DP2"
# On the CPU, attention dropout sends SDPA to its math kernel, which keeps three fp32 (B, heads, T, T)
# matrices a layer (12.6 MB here at micro 4) that the plan, counting fused attention as on GPUs, leaves
# out; without dropout SDPA's fused CPU kernel keeps none, as the plan counts.
NO_DROPOUT = ("model.dropout=0",)
# A near-empty model of the same layout: its peak RSS is the process's footprint the plan leaves out.
EMPTY = ("model.n_layer=2", "model.n_head=2", "model.n_embd=32")
# Freed tensors leave RSS (see the docstring). Only in the memory runs: a mapping per tensor costs
# system time (a step of DP2 takes 1.3x as long), so the timed runs keep glibc's default.
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}

MEMORY_NOT_MET = (
    "Memory is not within 30%: a rank's peak RSS above its footprint is {:.2f}-{:.2f}x the plan's resident "
    "figure here."
)


def sets(name: str, data: Path, run: Path, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    nproc, tensor, pipeline = LAYOUTS[name]
    accum = SEQUENCES * tensor * pipeline // (MICRO * nproc)  # micro x accum x data-parallel = SEQUENCES
    return [
        f"data.corpus={CORPUS}", f"data.dataset_dir={data}", f"logging.run_dir={run}",
        f"schedule.max_steps={steps}", "schedule.warmup_steps=1", "zero.stage=1", *NO_DROPOUT,
        f"batch.micro_batch_size={MICRO}", f"batch.gradient_accumulation_steps={accum}", f"parallel.tensor={tensor}",
        f"parallel.pipeline={pipeline}", *extra, *QUIET,
    ]  # fmt: skip


def config(name: str, over: list[str]) -> RunConfig:
    return resolve_vocab(build("small", overrides=over, world_size=LAYOUTS[name][0]))


def rank_peaks_gb(run: Path) -> list[float]:
    """Each rank's peak memory over the run (`ranks.csv`: the peak so far, at every logged step)."""
    peaks: dict[int, float] = {}
    for r in read_csv(run / "ranks.csv"):
        if r.get("peak_mem_gb"):
            rank = int(r["rank"] or 0)
            peaks[rank] = max(peaks.get(rank, 0.0), float(r["peak_mem_gb"] or 0.0))
    return [peaks[k] for k in sorted(peaks)]


def predicted_gb(cfg: RunConfig, world: int) -> tuple[float, float, int]:
    """The plan's memory for the rank that needs the most at this config's ZeRO stage: its device total,
    the part of it resident on a CPU (the total less the reduce buckets' pages no gradient is written
    into, which a GPU's allocator hands out but a CPU never maps in), and its pipeline stage."""
    row = next(
        p
        for p in plan_stages(cfg, world, device_gb=None)
        if p.stage == cfg.zero.stage and p.offload == "none"
    )
    share = stage_shares(cfg, layout_of(cfg, world))[row.pipeline_stage]
    unwritten = row.working_gb - bucket_written_bytes(cfg, share.params, stage=row.stage) / 1e9
    return row.device_total_gb, row.device_total_gb - unwritten, row.pipeline_stage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="parallel-"))
    data = work / "data"
    prepare(build("small", overrides=[f"data.corpus={CORPUS}", f"data.dataset_dir={data}"]).data)
    busbw = {n: bus_bandwidth(n) for n in sorted({nproc for nproc, *_ in LAYOUTS.values()})}
    for n, bw in busbw.items():
        print(f"all-reduce bus bandwidth, {n} gloo ranks: {bw / 1e9:.2f} GB/s", flush=True)

    runs: dict[str, list[Path]] = {name: [] for name in LAYOUTS}
    for i in range(args.repeats):  # in turn, so a slow spell of a shared machine touches every layout
        for name, (nproc, *_) in LAYOUTS.items():
            run = work / f"{name}_{i}"
            train(nproc, sets(name, data, run, args.steps))
            runs[name].append(run)
            print(
                f"{name} run {i + 1}: {measured_step_s(run):.3f} s/step",
                flush=True,
            )
    footprint: dict[str, list[float]] = {}
    memory: dict[str, list[float]] = {}
    os.environ.update(MMAP_THRESHOLD)  # the memory runs' ranks (plan_check.env copies os.environ)
    for name, (nproc, *_) in LAYOUTS.items():
        train(nproc, sets(name, data, work / f"{name}_memory", args.steps))
        memory[name] = rank_peaks_gb(work / f"{name}_memory")
        run = work / f"{name}_empty"
        over = sets(name, data, run, 3, EMPTY)
        train(nproc, over)
        _, counted, _ = predicted_gb(config(name, over), nproc)
        footprint[name] = [peak - counted for peak in rank_peaks_gb(run)]
    for key in MMAP_THRESHOLD:
        os.environ.pop(key)

    rows = []
    for name, (nproc, *_) in LAYOUTS.items():
        cfg = config(name, sets(name, data, runs[name][0], args.steps))
        rates = resolve_rates(cfg, nproc, nproc, busbw_gbs=busbw[nproc] / 1e9, from_runs=runs[CALIBRATION])
        t = predict_step(
            cfg, nproc, stage=cfg.zero.stage, offload_optimizer=False, offload_param=False, rates=rates
        )
        step = statistics.median(measured_step_s(run) for run in runs[name])
        used = [peak - base for peak, base in zip(memory[name], footprint[name], strict=True)]
        total, gb, stage = predicted_gb(cfg, nproc)
        b = cfg.batch
        rows.append((name, nproc, cfg, t, step, used, gb, stage, b, rates, total))

    rates = rows[0][-2]
    cores = os.cpu_count() or 1
    lines = [
        f"`small` preset (3.2M parameters, fp32, ZeRO-1), {SEQUENCES} sequences of 256 a step in every layout, "
        f"gloo ranks on this CPU ({cores} cores), {args.steps} steps each, {args.repeats} runs of each in turn; "
        f"rates from the {CALIBRATION} runs: MFU {rates.mfu:.3f} of {rates.peak_tflops:.3g} TFLOP/s a rank, "
        f"optimizer {rates.optimizer_s_per_param * 1e9:.3g} ns a parameter; bus bandwidth measured: "
        + ", ".join(f"{bw / 1e9:.2f} GB/s on {n} ranks" for n, bw in busbw.items())
        + ".",
        "Memory: each rank's peak RSS less the same layout's footprint with a near-empty model (interpreter, "
        "torch, DeepSpeed, gloo: "
        + ", ".join(f"{name} {statistics.fmean(fp):.2f} GB" for name, fp in footprint.items())
        + ") against the plan's device total (states, activations, buffers) for the rank that needs the most, "
        "less the reduce buckets' pages no gradient is written into (DeepSpeed allocates the two ZeRO-1 buckets "
        "at reduce_bucket_size, 5e8 fp32 elements: a GPU holds all of it, a CPU maps in only what is written). "
        "The memory runs' ranks have glibc's mmap threshold fixed at 64 KiB, so that freed tensors leave RSS; "
        "the timed runs keep glibc's default.",
        "",
        "| layout | ranks | micro x accum x DP | predicted s/step | measured s/step | steps/s | predicted / "
        "measured | predicted GB a rank (device total) | of it resident on a CPU | measured GB per rank | "
        "predicted / measured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, nproc, cfg, t, step, used, gb, stage, b, _, total in rows:
        mark = " (calibration)" if name == CALIBRATION else ""
        where = f" (stage {stage})" if cfg.parallel.pipeline > 1 else ""
        shared = f"; {t.core_share:.2g} core a rank" if t.core_share < 1 else ""
        lines.append(
            f"| {t.layout}{mark} | {nproc}{shared} | {b.micro_batch_size} x {b.gradient_accumulation_steps} x "
            f"{b.data_parallel_size} | {t.step_s:.3f} | {step:.3f} | {1 / step:.2f} | {t.step_s / step:.2f} | "
            f"{total:.3f}{where} | {gb:.3f} | {' / '.join(f'{u:.3f}' for u in used)} | {gb / max(used):.2f} |"
        )
    time_off = max(abs(t.step_s / step - 1) for name, _, _, t, step, *_ in rows if name != CALIBRATION)
    mem_off = max(abs(gb / max(used) - 1) for _, _, _, _, _, used, gb, *_ in rows)
    lines += [
        "",
        f"largest difference outside the calibration run: step time {100 * time_off:.0f}%, memory "
        f"{100 * mem_off:.0f}% (goal: within 30%)",
    ]
    if mem_off > 0.3:
        ratios = [max(used) / gb for _, _, _, _, _, used, gb, *_ in rows]
        lines.append(MEMORY_NOT_MET.format(min(ratios), max(ratios)))
    report(lines, Path(args.out) / "parallel.md")


if __name__ == "__main__":
    main()
