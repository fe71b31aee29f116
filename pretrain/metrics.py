"""What the run measures about itself: step-phase timing, throughput, MFU and memory per rank, and
where it goes: `metrics.csv` + `ranks.csv`, DeepSpeed's monitors (TensorBoard, csv_monitor, W&B),
a line on stdout and a progress bar (rank 0).

Host syncs: none per step. Phase times are host timestamps on the CPU (where ops are synchronous)
and CUDA events on a GPU, read at log steps only; the per-rank numbers travel in one all_gather at
each log step, which is also where the loss is summed.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import platform
import resource
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as tdist
from tqdm import tqdm

from pretrain.files import write_atomic

FIELDS = [
    "step",
    "loss",
    "lr",
    "grad_norm",
    "loss_scale",
    "tokens_per_s",
    "tokens_per_s_per_rank",
    "samples_per_s",
    "mfu",
    "step_time_s",
    "data_s",
    "fwd_bwd_s",
    "optimizer_s",
    "peak_mem_gb",
    "tokens_seen",
    "val_loss",
    "val_ppl",
    "elapsed_s",
]
RANK_FIELDS = [
    "step",
    "rank",
    "tokens_per_s",
    "samples_per_s",
    "step_time_s",
    "data_s",
    "fwd_bwd_s",
    "optimizer_s",
    "peak_mem_gb",
]
# starts.csv: one row per start of the run's training (a first start, or a resume), for `pretrain plot`.
START_FIELDS = ["step", "world_size", "time"]

PHASES = ("data", "fwd_bwd", "optimizer")

# ---------------------------------------------------------------------------------------------
# Device peak FLOP/s, the denominator of MFU

# Dense (no sparsity) tensor-core peaks per GPU from the vendors' datasheets, in TFLOP/s.
# fp32 is the plain fp32 rate; with TF32 matmuls allowed the tf32 rate applies.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
}


def gpu_peak_tflops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The table's peak for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), or None if unknown."""
    kind = "tf32" if precision == "fp32" and tf32 else precision
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):  # 'H100 PCIe' before 'H100'
        if all(part in device_name for part in key.split()):
            return GPU_PEAK_TFLOPS[key][kind]
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("PRETRAIN_CACHE_DIR", Path.home() / ".cache" / "pretrain"))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_tflops(dtype: torch.dtype = torch.float32, probe_s: float = 0.3) -> float:
    """This process's matmul rate on the CPU (its torch thread count), measured once and cached.

    A square GEMM of a fixed size (1024 in fp32, 512 in 16-bit types, which most CPUs run far
    slower) is timed repeatedly for `probe_s` seconds, at least 3 times; the best rate is the peak,
    the least disturbed by other load. The cache is keyed by CPU model, thread count, dtype and
    torch version; delete the file to probe again. On a loaded machine the probe reads low: MFU
    takes the larger of it and `cpu_fma_peak_tflops` (see `device_peak_tflops`).
    """
    threads = torch.get_num_threads()
    key = f"{_cpu_name()} | {threads} threads | {dtype} | torch {torch.__version__}"
    path = _cache_dir() / "cpu_peak_flops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return float(cache[key])
    n = 1024 if dtype == torch.float32 else 512
    # Its own generator: drawing from the global one would shift the dropout masks of the run
    # that probes (the first on a machine) against every later, cached one.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    tflops = gemm_tflops(a, b, probe_s)
    cache[key] = tflops
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(cache, indent=1) + "\n")  # ranks of other runs may read it meanwhile
    return tflops


def gemm_tflops(a: torch.Tensor, b: torch.Tensor, seconds: float, windows: int = 5) -> float:
    """The best rate of `a @ b` over `windows` windows of `seconds / windows` each (at least 3 GEMMs
    a window), with a pause between windows: the best window is the least disturbed by other load."""
    n, k, m = a.shape[0], a.shape[1], b.shape[1]
    torch.mm(a, b)  # warm up
    rate = 0.0
    for w in range(windows):
        if w:
            time.sleep(min(0.05, seconds / windows))  # let a burst of other load pass
        deadline, reps = time.perf_counter() + seconds / windows, 0
        while reps < 3 or time.perf_counter() < deadline:
            t = time.perf_counter()
            torch.mm(a, b)
            rate = max(rate, 2 * n * k * m / (time.perf_counter() - t))
            reps += 1
    return rate / 1e12


def _cpu_flags_and_mhz(cpuinfo: str | None) -> tuple[set[str], float]:
    """The first CPU's flags and clock in /proc/cpuinfo (or the text given); empty and 0 if unread."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set(), 0.0
    flags: set[str] = set()
    mhz = 0.0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "cpu MHz" and not mhz:
            mhz = float(value) if value.strip().replace(".", "", 1).isdigit() else 0.0
    return flags, mhz


def cpu_native_bf16(cpuinfo: str | None = None) -> str | None:
    """The CPU's bf16 matrix instructions (`amx_bf16`, `avx512_bf16`), which oneDNN uses for bf16
    matmuls at two or more times the fp32 rate; None if it has neither (or /proc/cpuinfo says not)."""
    flags, _ = _cpu_flags_and_mhz(cpuinfo)
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


def cpu_fma_peak_tflops(
    threads: int, cpuinfo: str | None = None, dtype: torch.dtype = torch.float32
) -> float | None:
    """The CPU's theoretical peak in `dtype`: cores x clock x FLOPs a cycle, from the flags.

    fp32: two FMA units of the widest vector width listed (AVX-512: 16 lanes, AVX2 + FMA: 8).
    bf16: AMX tiles (`amx_bf16`: 1024 multiply-adds a cycle), else AVX-512 BF16 dot products
    (`avx512_bf16`: two bf16 products per fp32 lane, twice fp32), else the fp32 peak (the CPU
    computes bf16 in fp32). fp16 the same with `amx_fp16` and `avx512_fp16`. An upper bound (some
    cores have one FMA unit, or split AVX-512), so MFU against it never reads above 100%, however
    loaded the machine. None if /proc/cpuinfo does not say."""
    flags, mhz = _cpu_flags_and_mhz(cpuinfo)
    lanes = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 4 if "sse2" in flags else 0
    if not (lanes and mhz > 0):
        return None
    per_cycle = 2 * 2 * lanes  # 2 units x (multiply + add) x lanes
    half = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}
    if dtype in half:
        amx, avx512 = half[dtype]
        if amx in flags and "amx_tile" in flags:
            per_cycle = 2 * 1024  # one AMX unit: 1024 multiply-adds a cycle
        elif avx512 in flags:
            per_cycle *= 2
    cores = min(threads, os.cpu_count() or threads)
    return cores * mhz * 1e6 * per_cycle / 1e12


def device_peak_tflops(
    device: torch.device, precision: str, override: float | None = None
) -> tuple[float | None, str]:
    """Peak TFLOP/s of one rank's device for MFU, and where the number came from."""
    if override is not None:
        return override, "logging.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, precision, tf32=torch.backends.cuda.matmul.allow_tf32)
        return peak, (f"{name} datasheet" if peak else f"{name}: unknown peak, set logging.peak_tflops")
    if device.type == "cpu":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        threads = torch.get_num_threads()
        probed = cpu_peak_tflops(dtype)
        fma = cpu_fma_peak_tflops(threads, dtype=dtype)
        if fma is not None and fma >= probed:
            return fma, f"CPU {precision} FMA peak, {threads} threads (matmul probe: {probed:.3g})"
        return probed, f"CPU matmul probe, {threads} threads"
    return None, f"{device.type}: unknown peak, set logging.peak_tflops"


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux /proc), the interpreter's start-up included."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------
# Memory


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank so far: CUDA max allocated, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc), 0 where unavailable."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ---------------------------------------------------------------------------------------------
# Step-phase timing


class PhaseTimer:
    """Wall time of each phase of the steps of one log interval: data, fwd_bwd, optimizer.

    `phase(name)` ends the current phase and starts `name`; `stop()` ends it. On the CPU each mark
    is a perf_counter() read (CPU ops run synchronously). On CUDA each mark records an event on the
    current stream, so nothing waits; `totals()` synchronises once, at a log step, and reads the
    GPU-side times, so host work hidden behind queued kernels costs nothing, as it should.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._sums = dict.fromkeys(PHASES, 0.0)
        self._events: list[tuple[str, Any, Any]] = []
        self._current: str | None = None
        self._mark: Any = None

    def _now(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def phase(self, name: str) -> None:
        now = self._now()
        self._close(now)
        self._current, self._mark = name, now

    def stop(self) -> None:
        if self._current is not None:
            self._close(self._now())
            self._current = None

    def _close(self, now: Any) -> None:
        if self._current is None:
            return
        if self.cuda:
            self._events.append((self._current, self._mark, now))
        else:
            self._sums[self._current] += now - self._mark

    def totals(self) -> dict[str, float]:
        """Seconds per phase since the last reset (synchronises on CUDA)."""
        if self.cuda and self._events:
            self._events[-1][2].synchronize()
            for name, start, end in self._events:
                self._sums[name] += start.elapsed_time(end) / 1000.0
            self._events.clear()
        return dict(self._sums)


# ---------------------------------------------------------------------------------------------
# One log interval, all ranks


@dataclass
class RankInterval:
    """One rank's view of a log interval."""

    loss_sum: float
    interval_s: float
    data_s: float
    fwd_bwd_s: float
    optimizer_s: float
    peak_mem_bytes: float


def gather_interval(
    loss_sum: torch.Tensor, timer: PhaseTimer, interval_s: float, device: torch.device
) -> list[RankInterval]:
    """Every rank's loss sum, phase times and peak memory, on every rank: one all_gather, one sync."""
    phases = timer.totals()
    mine = torch.tensor(
        [interval_s, *(phases[p] for p in PHASES), float(peak_memory_bytes(device))],
        dtype=torch.float64,
        device=device,
    )
    mine = torch.cat([loss_sum.detach().double().reshape(1), mine])
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        parts = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
        tdist.all_gather(parts, mine)
        rows = torch.stack(parts).tolist()
    else:
        rows = [mine.tolist()]
    return [RankInterval(*row) for row in rows]


def summarize(
    ranks: list[RankInterval],
    steps: int,
    samples_per_rank_step: int,
    block_size: int,
    micro_steps: int,
    flops_per_token: float | None = None,
    peak_tflops: float | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The log row (totals over ranks) and one row per rank, for `steps` optimizer steps.

    Step time is the slowest rank's interval (ranks meet at every gradient reduction); phase times
    are the mean over ranks, per step. MFU is the model FLOPs done per second over the peak of all
    ranks' devices.
    """
    world = len(ranks)
    dt = max(r.interval_s for r in ranks) / steps
    samples_per_s = samples_per_rank_step * world / dt
    tokens_per_s = samples_per_s * block_size
    row: dict[str, Any] = {
        "loss": sum(r.loss_sum for r in ranks) / (steps * micro_steps * world),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_rank": tokens_per_s / world,
        "samples_per_s": samples_per_s,
        "step_time_s": dt,
        "data_s": sum(r.data_s for r in ranks) / world / steps,
        "fwd_bwd_s": sum(r.fwd_bwd_s for r in ranks) / world / steps,
        "optimizer_s": sum(r.optimizer_s for r in ranks) / world / steps,
        "peak_mem_gb": max(r.peak_mem_bytes for r in ranks) / 1e9,
        "mfu": (
            flops_per_token * tokens_per_s / (peak_tflops * 1e12 * world)
            if flops_per_token and peak_tflops
            else None
        ),
    }
    per_rank = []
    for i, r in enumerate(ranks):
        rdt = r.interval_s / steps
        per_rank.append(
            {
                "rank": i,
                "tokens_per_s": samples_per_rank_step * block_size / rdt,
                "samples_per_s": samples_per_rank_step / rdt,
                "step_time_s": rdt,
                "data_s": r.data_s / steps,
                "fwd_bwd_s": r.fwd_bwd_s / steps,
                "optimizer_s": r.optimizer_s / steps,
                "peak_mem_gb": r.peak_mem_bytes / 1e9,
            }
        )
    return row, per_rank


# ---------------------------------------------------------------------------------------------
# Where the numbers go

# metrics.csv column -> monitor tag. DeepSpeed's own monitor events are "Train/Samples/<name>"
# against samples seen; these follow it, so TensorBoard and W&B share one x axis. DeepSpeed's
# per-step writes of lr and loss_scale are turned off (`quiet_monitor`): they come from here, at
# the log steps, with the rest.
_TAGS = {
    "loss": "Train/Samples/train_loss",
    "lr": "Train/Samples/lr",
    "loss_scale": "Train/Samples/loss_scale",
    "grad_norm": "Train/Samples/grad_norm",
    "tokens_per_s": "Throughput/tokens_per_s",
    "tokens_per_s_per_rank": "Throughput/tokens_per_s_per_rank",
    "samples_per_s": "Throughput/samples_per_s",
    "mfu": "Throughput/mfu",
    "step_time_s": "Time/step_s",
    "data_s": "Time/data_s",
    "fwd_bwd_s": "Time/fwd_bwd_s",
    "optimizer_s": "Time/optimizer_s",
    "peak_mem_gb": "Memory/peak_gb_max_rank",
    "val_loss": "Eval/Samples/val_loss",
    "val_ppl": "Eval/Samples/val_ppl",
}


def quiet_monitor(engine: Any) -> Any:
    """Take DeepSpeed's monitor for the run's log and stop the engine writing to it each step.

    With a monitor on, `engine.step()` writes the LR (and the fp16 loss scale) at every step, and
    DeepSpeed's TensorBoard writer flushes its event file on every write: a file write per step,
    on a shared filesystem a round trip. The run's log writes both at the log steps, with the other
    metrics, through the same monitor (whose `write_events` does not look at `enabled`). Returns
    the monitor, or None when none is on."""
    monitor = getattr(engine, "monitor", None)
    if monitor is None or not getattr(monitor, "enabled", False):
        return None
    monitor.enabled = False  # what the engine checks before its per-step writes
    return monitor


def available_monitors(ds_config: dict[str, Any], warn: bool = True) -> dict[str, Any]:
    """Drop the W&B and TensorBoard sections whose package is not installed (DeepSpeed would raise)."""
    out = dict(ds_config)
    for key, module in (("wandb", "wandb"), ("tensorboard", "tensorboard")):
        if out.get(key, {}).get("enabled") and importlib.util.find_spec(module) is None:
            out.pop(key)
            if warn:
                fix = " (pip install 'pretrain[wandb]')" if key == "wandb" else ""
                print(
                    f"logging.{key} is on but `{module}` is not installed{fix}: not logging to it", flush=True
                )
    return out


WANDB_RUN_ID = "wandb_run_id"  # in the run directory: the W&B run a resume continues


def start_wandb(run_dir: Path, ds_config: dict[str, Any], config: dict[str, Any], resuming: bool) -> Any:
    """Start the W&B run before DeepSpeed's monitor does (rank 0, logging.wandb on and installed):
    named after the run directory, with the resolved config, and with the id kept in the run
    directory, so that a resume (or a supervisor's restart) continues the same W&B run. DeepSpeed's
    own `wandb.init` then returns this run. Returns it, or None when W&B is off."""
    section = ds_config.get("wandb", {})
    if not section.get("enabled"):
        return None
    import wandb  # seconds: only with W&B on

    id_file = run_dir / WANDB_RUN_ID
    run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
    if not run_id:
        run_id = secrets.token_hex(6)  # a W&B run id: [a-z0-9]
        write_atomic(id_file, run_id + "\n")
    run = wandb.init(
        project=section.get("project"),
        group=section.get("group"),
        entity=section.get("team"),
        name=run_dir.resolve().name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
    )
    # After init: a resumed run's config takes the new values (a changed world size, say).
    run.config.update(config, allow_val_change=True)
    return run


def progress_enabled(mode: bool | str, stream: IO[str] = sys.stderr) -> bool:
    """logging.progress_bar: true, false or 'auto' (only when the stream is a terminal)."""
    return stream.isatty() if mode == "auto" else bool(mode)


def _phase_split(row: dict[str, Any]) -> str:
    split = "/".join(f"{1000 * row.get(p + '_s', 0.0):.0f}" for p in PHASES)
    return f"{row['step_time_s'] * 1000:.0f} ms/step (data/fwd+bwd/opt {split})"


# The stdout line of a log step: each part shown when its key is in the row.
_LINE: list[tuple[str, Any]] = [
    ("loss", lambda r: f"loss {r['loss']:.4f}"),
    ("val_loss", lambda r: f"val_loss {r['val_loss']:.4f} val_ppl {r['val_ppl']:.2f}"),
    ("lr", lambda r: f"lr {r['lr']:.2e}"),
    ("grad_norm", lambda r: f"gnorm {r['grad_norm']:.3f}"),
    ("loss_scale", lambda r: f"scale {r['loss_scale']:g}"),
    ("tokens_per_s", lambda r: f"{r['tokens_per_s']:,.0f} tok/s"),
    ("mfu", lambda r: f"mfu {100 * r['mfu']:.1f}%"),
    ("step_time_s", _phase_split),
    ("peak_mem_gb", lambda r: f"peak {r['peak_mem_gb']:.2f} GB"),
]


class MetricsLog:
    """Rank 0's log: `metrics.csv` (a resumed run continues it), `ranks.csv`, DeepSpeed's monitors,
    a line per log step on stdout and a tqdm bar with an ETA on stderr."""

    def __init__(
        self,
        run_dir: Path,
        max_steps: int,
        enabled: bool = True,
        out: IO[str] = sys.stdout,
        monitor: Any = None,
        start_step: int = 0,
        progress: bool | str = False,
        world_size: int | None = None,
    ) -> None:
        self.enabled = enabled
        self.max_steps = max_steps
        self.out = out
        self.monitor = monitor  # from quiet_monitor: None when no monitor is on
        self.start = time.perf_counter()
        self.path = run_dir / "metrics.csv"
        self.bar: Any = None
        if not enabled:
            return
        self._file, self._csv = _open_csv(self.path, FIELDS)
        self._rank_file, self._rank_csv = _open_csv(run_dir / "ranks.csv", RANK_FIELDS)
        if world_size is None:
            world_size = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
        starts, writer = _open_csv(run_dir / "starts.csv", START_FIELDS)
        with starts:
            writer.writerow(
                {"step": start_step, "world_size": world_size, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
            )
        if progress_enabled(progress):
            self.bar = tqdm(
                total=max_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr
            )

    def log(self, step: int, samples: int | None = None, **values: Any) -> None:
        """One row of metrics.csv, a line on stdout and (with `samples`, the x axis) monitor events."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        row = {"step": step, "elapsed_s": round(elapsed, 3), **values}
        self._csv.writerow({k: _fmt(row.get(k)) for k in FIELDS})
        self._file.flush()
        line = self._line(step, row)
        if self.bar is not None:
            self.bar.write(line, file=self.out)
        else:
            self.out.write(line + "\n")
            self.out.flush()
        if self.monitor is not None and samples is not None:
            events = [
                (_TAGS[k], float(v), samples) for k, v in values.items() if k in _TAGS and v is not None
            ]
            if events:
                self.monitor.write_events(events)  # one call: DeepSpeed's TensorBoard flushes per call

    def log_ranks(self, step: int, rows: list[dict[str, Any]], samples: int | None = None) -> None:
        if not self.enabled:
            return
        for r in rows:
            self._rank_csv.writerow({k: _fmt({"step": step, **r}.get(k)) for k in RANK_FIELDS})
        self._rank_file.flush()
        if self.monitor is not None and samples is not None and len(rows) > 1:
            events = []
            for r in rows:
                events.append((f"Memory/peak_gb_rank{r['rank']}", float(r["peak_mem_gb"]), samples))
                events.append((f"Throughput/tokens_per_s_rank{r['rank']}", float(r["tokens_per_s"]), samples))
            self.monitor.write_events(events)

    def progress(self, step: int, loss: float | None = None, tokens_per_s: float | None = None) -> None:
        """Advance the bar to `step` (cheap; no host sync: values are the last logged ones)."""
        if self.bar is None:
            return
        if loss is not None and tokens_per_s is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self.bar.update(step - self.bar.n)

    def _line(self, step: int, row: dict[str, Any]) -> str:
        parts = [f"step {step:>6}/{self.max_steps}"]
        parts += [show(row) for key, show in _LINE if row.get(key) is not None]
        if row.get("step_time_s") is not None:
            eta = (self.max_steps - step) * row["step_time_s"] if step < self.max_steps else 0.0
            parts.append(f"eta {_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._rank_file.close()
            if self.bar is not None:
                self.bar.close()
        if self.monitor is not None:
            # DeepSpeed's TensorBoard writer flushes per event batch; close it so the file is final.
            tb = getattr(self.monitor, "tb_monitor", None)
            writer = getattr(tb, "summary_writer", None)
            if writer is not None:
                writer.flush()


def _open_csv(path: Path, fields: list[str]) -> tuple[IO[str], csv.DictWriter[str]]:
    """Open for appending; a file with other columns (an older version's) is rewritten first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header, rows = reader.fieldnames, list(reader)
        if header != fields:
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                w.writeheader()
                w.writerows(rows)
    new = not path.exists()
    file = path.open("a", newline="")
    writer = csv.DictWriter(file, fieldnames=fields)
    if new:
        writer.writeheader()
    return file, writer


def read_csv(path: Path) -> list[dict[str, float | None]]:
    """metrics.csv back as numbers (empty cells are None)."""
    with path.open(newline="") as f:
        return [
            {k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return "" if v is None else v


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
