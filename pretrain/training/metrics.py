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
import io
import math
import os
import resource
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as tdist
from tqdm import tqdm

from pretrain.config.mix import BlendSource, is_scheduled, mix_names, mix_text
from pretrain.errors import OutputError
from pretrain.files import format_bytes, write_atomic

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
    data_parallel: int | None = None,
    flops_per_token: float | None = None,
    peak_tflops: float | None = None,
    loss_steps: int | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The log row (totals over ranks) and one row per rank, for `steps` optimizer steps; the loss
    sums over `loss_steps` (default `steps`: more where a resume carried in part of its window).

    Samples are counted once per data-parallel group (`data_parallel`, default: every rank): the
    ranks of one tensor-parallel group or one pipeline work on the same samples.

    Step time is the slowest rank's interval (ranks meet at every gradient reduction); phase times
    are the mean over ranks, per step. MFU is the model FLOPs done per second over the peak of all
    ranks' devices.
    """
    world = len(ranks)
    dt = max(r.interval_s for r in ranks) / steps
    samples_per_s = samples_per_rank_step * (data_parallel or world) / dt
    tokens_per_s = samples_per_s * block_size
    row: dict[str, Any] = {
        "loss": sum(r.loss_sum for r in ranks) / ((loss_steps or steps) * micro_steps * world),
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

# metrics.csv column -> monitor tag, against the optimizer step, the x axis of the console, metrics.csv
# and `pretrain plot` (DeepSpeed's own "Train/Samples/<name>" events count samples: another axis).
# DeepSpeed's per-step writes of lr and loss_scale are turned off (`quiet_monitor`): they come from
# here, at the log steps, with the rest.
_TAGS = {
    "loss": "Train/train_loss",
    "lr": "Train/lr",
    "loss_scale": "Train/loss_scale",
    "grad_norm": "Train/grad_norm",
    "tokens_per_s": "Throughput/tokens_per_s",
    "tokens_per_s_per_rank": "Throughput/tokens_per_s_per_rank",
    "samples_per_s": "Throughput/samples_per_s",
    "mfu": "Throughput/mfu",
    "step_time_s": "Time/step_s",
    "data_s": "Time/data_s",
    "fwd_bwd_s": "Time/fwd_bwd_s",
    "optimizer_s": "Time/optimizer_s",
    "peak_mem_gb": "Memory/peak_gb_max_rank",
    "val_loss": "Eval/val_loss",
    "val_ppl": "Eval/val_ppl",
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

    # DeepSpeed's monitor calls wandb.init again (it returns this run), and that call sets up its
    # logs in WANDB_DIR, by default a ./wandb in whatever directory the run was started from.
    os.environ.setdefault("WANDB_DIR", str(run_dir.resolve()))
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


def percent(x: float) -> str:
    """A share as a percentage, to a tenth of a point, or to two significant digits below 1% (a CPU's
    bf16 peak, AMX's, is 30x its fp32 one: a small model's MFU read 0.0%)."""
    return f"{100 * x:.1f}%" if 100 * x >= 1 or x == 0 else f"{100 * x:.2g}%"


# The stdout line of a log step: each part shown when its key is in the row.
_LINE: list[tuple[str, Any]] = [
    ("loss", lambda r: f"loss {r['loss']:.4f}"),
    ("val_loss", lambda r: f"val_loss {r['val_loss']:.4f} val_ppl {r['val_ppl']:.2f}"),
    ("lr", lambda r: f"lr {r['lr']:.2e}"),
    ("grad_norm", lambda r: f"gnorm {r['grad_norm']:.3f}"),
    ("loss_scale", lambda r: f"scale {r['loss_scale']:g}"),
    ("tokens_per_s", lambda r: f"{r['tokens_per_s']:,.0f} tok/s"),
    ("mfu", lambda r: f"mfu {percent(r['mfu'])}"),
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
        elapsed_before: float = 0.0,
    ) -> None:
        self.enabled = enabled
        self.max_steps = max_steps
        self.out = out
        self.monitor = monitor  # from quiet_monitor: None when no monitor is on
        # elapsed_s counts across resumes: the seconds of training the checkpoint resumed had
        self.start = time.perf_counter() - elapsed_before
        self.path = run_dir / "metrics.csv"
        self.bar: Any = None
        self._mix: str | None = None  # the data mix last said (note_mix)
        if not enabled:
            return
        quiet_writer_threads(run_dir)
        for name, fields in (("metrics.csv", FIELDS), ("ranks.csv", RANK_FIELDS)):
            moved = _set_aside_rows_after(run_dir / name, fields, start_step)
            if moved:
                print(
                    f"{name}: {moved} row{'s' if moved > 1 else ''} after step {start_step}, of an attempt that "
                    f"stopped before its next checkpoint, moved to {ABANDONED.format(Path(name).stem)}",
                    file=out,
                    flush=True,
                )
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

    def log(self, step: int, **values: Any) -> None:
        """One row of metrics.csv, a line on stdout and monitor events, all at optimizer step `step`."""
        if not self.enabled:
            return
        try:
            self._log(step, **values)
        except OSError as e:
            raise write_failed(self.path, e) from None

    def _log(self, step: int, **values: Any) -> None:
        elapsed = time.perf_counter() - self.start
        row = {"step": step, "elapsed_s": round(elapsed, 3), **values}
        self._csv.writerow({k: _fmt(row.get(k)) for k in FIELDS})
        self._file.flush()
        self._say(self._line(step, row))
        if self.monitor is not None:
            events = [(_TAGS[k], float(v), step) for k, v in values.items() if k in _TAGS and v is not None]
            if events:
                self.monitor.write_events(events)  # one call: DeepSpeed's TensorBoard flushes per call

    def _say(self, line: str) -> None:
        """A line on stdout, above the bar if there is one."""
        if self.bar is not None:
            self.bar.write(line, file=self.out)
        else:
            self.out.write(line + "\n")
            self.out.flush()

    def note_mix(self, step: int, blend: Sequence[BlendSource], shares: Sequence[float]) -> None:
        """Say the data mix in force (`shares`, the loader's, of data.blend's datasets): at the start,
        then a line at a log step where it differs from the last one said, to two decimals. Nothing
        for a single dataset."""
        if not self.enabled or len(blend) < 2:
            return
        text = mix_text(mix_names([b.dataset_dir for b in blend]), shares)
        if text == self._mix:
            return
        if self._mix is None:
            weights = [b.weight for b in blend]
            how = " (scheduled in tokens seen: a line here when it changes)" if is_scheduled(weights) else ""
            self._say(f"data mix at step {step}: {text}{how}")
        else:
            self._say(f"step {step}: data mix now {text}")
        self._mix = text

    def log_ranks(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        try:
            for r in rows:
                self._rank_csv.writerow({k: _fmt({"step": step, **r}.get(k)) for k in RANK_FIELDS})
            self._rank_file.flush()
        except OSError as e:
            raise write_failed(self.path.with_name("ranks.csv"), e) from None
        if self.monitor is not None and len(rows) > 1:
            events = []
            for r in rows:
                events.append((f"Memory/peak_gb_rank{r['rank']}", float(r["peak_mem_gb"]), step))
                events.append((f"Throughput/tokens_per_s_rank{r['rank']}", float(r["tokens_per_s"]), step))
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


ABANDONED = "{}.abandoned.csv"  # rows of steps a resumed run trains again, kept beside the log


class LogWriteError(OutputError):
    """Rank 0 could not write its log (a full disk): printed by rank 0, the one that saw it."""

    collective = False


def write_failed(path: Path, e: OSError) -> LogWriteError:
    """One message for a log that cannot be written, naming the file and the room left."""
    where = Path(e.filename) if e.filename else path
    try:
        free = (
            format_bytes(shutil.disk_usage(where.parent if not where.is_dir() else where).free)
            + " free there"
        )
    except OSError:
        free = "its filesystem unreadable"
    return LogWriteError(
        f"{where}: cannot write ({e.strerror or e}; {free}): free space there, or set logging.run_dir on "
        "a larger filesystem, then continue with --resume auto (the checkpoints are intact)"
    )


def quiet_writer_threads(path: Path) -> None:
    """A background writer (TensorBoard's event thread) that fails to write prints one line naming
    the run dir, not a thread's traceback; the next metrics row then stops the run with the fix."""
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError):
            print(f"error: {write_failed(path, args.exc_value)} (in {args.thread.name if args.thread else 'a thread'})",
                  file=sys.stderr, flush=True)  # fmt: skip
            return
        default(args)

    threading.excepthook = hook


def _set_aside_rows_after(path: Path, fields: list[str], step: int) -> int:
    """Move the rows of steps after `step` (a resume's start: an attempt that died after its last
    checkpoint logged them, and this run trains those steps again) from `path` to its
    `*.abandoned.csv`, so that the log holds each step once; returns how many moved."""
    if step <= 0 or not path.is_file():
        return 0
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = reader.fieldnames or fields, list(reader)

    def after(row: dict[str, str]) -> bool:
        try:
            return int(row.get("step") or 0) > step
        except ValueError:
            return False

    late = [r for r in rows if after(r)]
    if not late:
        return 0
    aside = path.with_name(ABANDONED.format(path.stem))
    fresh = not aside.exists()
    with aside.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        if fresh:
            w.writeheader()
        w.writerows(late)
    keep = io.StringIO()
    w = csv.DictWriter(keep, fieldnames=header, extrasaction="ignore")
    w.writeheader()
    w.writerows(r for r in rows if not after(r))
    write_atomic(path, keep.getvalue())
    return len(late)


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


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return "" if v is None else v


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
