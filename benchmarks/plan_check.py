"""`pretrain plan`'s step time against measurement: the `small` preset on N gloo ranks here, at ZeRO
stages 0-3 with and without offload.

    .venv/bin/python benchmarks/plan_check.py [--nproc 2] [--steps 5] [--out benchmarks/results]

1. Measures the all-reduce bus bandwidth between N ranks, as `pretrain preflight` does.
2. Trains each variant for --steps steps under `torchrun` (the real engine) and takes the median
   step time of the logged steps after the first.
3. Predicts each variant's step time with `pretrain.plan.timing.predict_step`, its rates calibrated on the
   stage-0 run (`pretrain plan --from-run`: its forward+backward and optimizer times) and the
   measured bus bandwidth, and prints predicted against measured.

Writes plan_check.md (the table) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pretrain.config.presets import build  # noqa: E402
from pretrain.data.dataset import resolve_vocab  # noqa: E402
from pretrain.data.prepare import prepare  # noqa: E402
from pretrain.files import read_csv  # noqa: E402
from pretrain.plan.layout import VARIANTS  # noqa: E402
from pretrain.plan.rates import resolve_rates  # noqa: E402
from pretrain.plan.timing import predict_step  # noqa: E402

TINY_SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
QUIET = ["logging.eval_interval=100000", "logging.sample_tokens=0", "logging.log_interval=1",
         "checkpoint.interval=100000", "logging.tensorboard=false"]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    out = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out.pop("RANK", None)
    return out


def bus_bandwidth(nproc: int) -> float:
    """A timed 8 MiB all-reduce between nproc local ranks (pretrain/cluster/probe.py, as preflight runs it)."""
    args = {"world": nproc, "master_addr": "127.0.0.1", "master_port": free_port(), "bytes": 8 << 20,
            "iters": 5, "timeout": 120, "rank_base": 0, "slots": nproc}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "pretrain.cluster.probe", "allreduce", json.dumps(args)],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1])["busbw"])


def overrides(data: Path, stage: int, offload: bool, param: bool, steps: int, run: Path) -> list[str]:
    return [
        f"data.corpus={TINY_SHAKESPEARE}", f"data.dataset_dir={data}", f"logging.run_dir={run}",
        f"schedule.max_steps={steps}", "schedule.warmup_steps=1", f"zero.stage={stage}",
        f"zero.offload_optimizer={str(offload).lower()}", f"zero.offload_param={str(param).lower()}", *QUIET,
    ]  # fmt: skip


def train(nproc: int, sets: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           str(ROOT / "pretrain" / "main.py"), "--preset", "small", *(f"--set={s}" for s in sets)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"training failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def measured_step_s(run: Path) -> float:
    rows = [r for r in read_csv(run / "metrics.csv") if r.get("step_time_s")]
    return statistics.median(float(r["step_time_s"] or 0.0) for r in rows[1:])


def report(lines: list[str], path: Path) -> None:
    """Print the table, and write it to `path`."""
    text = "\n".join(lines)
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    if not TINY_SHAKESPEARE.is_file():
        raise SystemExit(f"needs the offline corpus at {TINY_SHAKESPEARE}")
    work = Path(tempfile.mkdtemp(prefix="plan-check-"))
    data = work / "data"
    base = build("small", overrides=[f"data.corpus={TINY_SHAKESPEARE}", f"data.dataset_dir={data}"])
    prepare(base.data)
    busbw = bus_bandwidth(args.nproc)
    print(f"all-reduce bus bandwidth, {args.nproc} gloo ranks: {busbw / 1e9:.2f} GB/s", flush=True)
    measured: dict[tuple[int, bool, bool], float] = {}
    runs: dict[tuple[int, bool, bool], Path] = {}
    for variant in VARIANTS:
        run = work / f"z{variant[0]}{'_off' if variant[1] else ''}{'_param' if variant[2] else ''}"
        train(args.nproc, overrides(data, *variant, args.steps, run))
        measured[variant], runs[variant] = measured_step_s(run), run
        print(f"measured {variant}: {measured[variant]:.3f} s/step", flush=True)
    # Rates from two runs, as `pretrain plan --from-run A --from-run B`: compute and the optimizer on
    # the device from stage 0, the optimizer on the host from stage 1 with offload.
    calibration = [runs[(0, False, False)], runs[(1, True, False)]]
    rows = []
    for variant in VARIANTS:
        cfg = resolve_vocab(
            build(
                "small", overrides=overrides(data, *variant, args.steps, runs[variant]), world_size=args.nproc
            )
        )
        rates = resolve_rates(cfg, args.nproc, args.nproc, busbw_gbs=busbw / 1e9, from_runs=calibration)
        stage, off, par = variant
        t = predict_step(cfg, args.nproc, stage=stage, offload_optimizer=off, offload_param=par, rates=rates)
        rows.append((variant, t, measured[variant]))
    lines = [
        f"`small` preset, {args.nproc} gloo ranks on this CPU, {args.steps} steps each; rates from the "
        f"runs marked (calibration): MFU {rates.mfu:.3f} of {rates.peak_tflops:.3g} TFLOP/s a rank, optimizer "
        f"{rates.optimizer_s_per_param * 1e9:.3g} ns a parameter on the device and "
        f"{rates.host_optimizer_s_per_param * 1e9:.3g} on the host; bus bandwidth {busbw / 1e9:.2f} GB/s measured.",
        "",
        "| stage | offload | predicted s/step | measured s/step | predicted / measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for variant, t, m in rows:
        mark = " (calibration)" if runs[variant] in calibration else ""
        lines.append(f"| {variant[0]} | {t.offload}{mark} | {t.step_s:.3f} | {m:.3f} | {t.step_s / m:.2f} |")
    worst = max(abs(t.step_s / m - 1) for v, t, m in rows if runs[v] not in calibration)
    lines += ["", f"largest difference outside the calibration runs: {100 * worst:.0f}% (goal: within 30%)"]
    report(lines, Path(args.out) / "plan_check.md")


if __name__ == "__main__":
    main()
