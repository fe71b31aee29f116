"""`pretrain plot RUN_DIR`: a PNG of a run's metrics.csv: loss (train and val), LR and tokens/s, with
its resumes and world-size changes marked (from starts.csv, which each start of training appends to).

The PNG goes to exactly the path given (`--out`, default RUN_DIR/metrics.png), written atomically, and
only over nothing or a PNG: never over a directory or another file. A row of metrics.csv or starts.csv
that is not numbers (a damaged or hand-edited file) is left out and counted, never a traceback."""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pretrain.errors import DataError, OutputError, require
from pretrain.files import make_dir, not_ours, read_csv_tolerant, write_atomic

STARTS = "starts.csv"
METRICS = {"step", "loss", "val_loss", "lr", "tokens_per_s", "tokens_per_s_per_rank"}  # what is drawn
# Suffixes of image and document formats that are not PNG: a PNG written under one would be misnamed.
NOT_PNG = {".jpg", ".jpeg", ".svg", ".svgz", ".pdf", ".eps", ".ps", ".tif", ".tiff", ".webp", ".gif", ".bmp"}


def _series(rows: list[dict[str, float | None]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        step, value = r.get("step"), r.get(key)
        if step is not None and value is not None:
            xs.append(step)
            ys.append(value)
    return xs, ys


def _skipped(path: Path, count: int, lines: list[int]) -> str:
    s = "" if count == 1 else "s"
    where = f" (line{'' if len(lines) == 1 else 's'} {', '.join(map(str, lines[:5]))}{', ...' if len(lines) > 5 else ''})"
    return (
        f"{path}: skipped {count} malformed row{s}{where if lines else ''}: a cell that is not a number, "
        "more cells than the header, or bytes that are not text"
    )


def _read(path: Path, columns: set[str]) -> tuple[list[str], list[dict[str, float | None]], list[int]]:
    if not path.is_file():
        what = "not a regular file" if path.exists() else "no such file"
        raise DataError(f"{path}: {what} (is {path.parent} a run directory?)")
    try:
        return read_csv_tolerant(path, columns)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from e


def run_events(run_dir: Path, report: Callable[[str], None] | None = None) -> list[tuple[int, str]]:
    """(step, label) of each resume (or restart) of the run, naming a world-size change, from
    starts.csv; none for a run without one (written before it existed). Malformed rows are skipped
    and `report`ed."""
    path = run_dir / STARTS
    if not path.is_file():
        return []
    _, rows, bad = _read(path, {"step", "world_size"})
    starts, odd = [], 0
    for r in rows:
        step, world = r.get("step"), r.get("world_size")
        if step is None or world is None:
            continue  # a start that recorded no step: nothing to mark
        if not (0 <= step < 2**63 and 1 <= world < 2**31 and step == int(step) and world == int(world)):
            odd += 1  # numbers, but not a step and a world size
            continue
        starts.append((int(step), int(world)))
    if (bad or odd) and report is not None:
        report(_skipped(path, len(bad) + odd, bad))
    events = []
    for (_, before), (step, world) in itertools.pairwise(starts):
        label = f"resume at step {step}" if step else "restart from step 0"
        events.append((step, label + (f", world size {before} → {world}" if world != before else "")))
    return events


def output_path(run_dir: Path, out: str | Path | None) -> Path:
    """Where the PNG goes: exactly `out` (default RUN_DIR/metrics.png), or one OutputError with the
    fix: a directory, a suffix of another image format, or a file that is not a PNG."""
    flag = f"--out {out}" if out is not None else f"{run_dir / 'metrics.png'} (the default --out)"
    path = Path(out) if out is not None else run_dir / "metrics.png"
    if str(out).endswith(os.sep) or path.is_dir():
        raise OutputError(
            f"{flag}: is a directory; --out names the PNG file to write, e.g. --out {path / 'metrics.png'}"
        )
    if path.suffix.lower() in NOT_PNG:
        raise OutputError(
            f"{flag}: plot writes a PNG, not a {path.suffix} file: name it {path.with_suffix('.png').name} "
            "(or give no suffix)"
        )
    if not_ours([path], lambda data: data.startswith(b"\x89PNG")):
        fix = "choose another file" if out is not None else "pass --out to write elsewhere"
        raise OutputError(f"{flag}: exists and is not a PNG; refusing to overwrite it: {fix}")
    return path


def _draw(ax: Any, series: tuple[list[float], list[float]], **style: Any) -> None:
    """A line, with a marker on each point where there are too few for a line to show (a run of
    one logged step drew empty panels)."""
    xs, ys = series
    ax.plot(xs, ys, marker="o" if len(xs) < 3 else None, markersize=4, **style)


def plot_run(
    run_dir: Path, out: str | Path | None = None, report: Callable[[str], None] | None = None
) -> Path:
    """Write the PNG to exactly `output_path(run_dir, out)` and return that path. Rows left out of
    metrics.csv or starts.csv are `report`ed, with their count and line numbers."""
    target = output_path(run_dir, out)
    path = run_dir / "metrics.csv"
    header, rows, bad = _read(path, METRICS)
    if not {"step", "loss"} <= set(header):
        raise DataError(
            f"{path}: not a run's metrics.csv (its first line is not a header with step and loss columns)"
        )
    if bad and report is not None:
        report(_skipped(path, len(bad), bad))
    if not any(r.get("loss") is not None for r in rows):
        raise DataError(f"{path}: no training steps logged yet")
    events = run_events(run_dir, report)

    matplotlib = require("matplotlib", "`pretrain plot`", "plot")  # only to draw: seconds to import
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, (ax_loss, ax_lr, ax_tps) = plt.subplots(3, 1, figsize=(9, 9), sharex=True, layout="constrained")
    fig.suptitle(f"{run_dir.resolve().name}: {path}", fontsize=11)

    _draw(ax_loss, _series(rows, "loss"), label="train", color="tab:blue", linewidth=1.2)
    vx, vy = _series(rows, "val_loss")
    if vx:  # no val legend without val points
        ax_loss.plot(vx, vy, "o-", label="val", color="tab:orange", markersize=4, linewidth=1.2)
        ax_loss.legend()
    ax_loss.set_ylabel("loss (cross-entropy, nats)")
    ax_loss.set_title("Loss")
    ax_loss.grid(alpha=0.3)

    _draw(ax_lr, _series(rows, "lr"), color="tab:green", linewidth=1.2)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title("Learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax_lr.grid(alpha=0.3)

    _draw(ax_tps, _series(rows, "tokens_per_s"), color="tab:purple", linewidth=1.2, label="all ranks")
    px, py = _series(rows, "tokens_per_s_per_rank")
    if px and py != _series(rows, "tokens_per_s")[1]:
        ax_tps.plot(px, py, color="tab:gray", linewidth=1.0, linestyle="--", label="per rank")
        ax_tps.legend()
    ax_tps.set_ylabel("tokens / s")
    ax_tps.yaxis.set_major_formatter(EngFormatter())
    ax_tps.set_ylim(bottom=0)
    ax_tps.set_title("Throughput")
    ax_tps.set_xlabel("optimizer step")
    ax_tps.grid(alpha=0.3)

    for step, label in events:
        resized = "world size" in label
        for ax in (ax_loss, ax_lr, ax_tps):
            ax.axvline(step, color="tab:red" if resized else "tab:gray", linestyle=":", linewidth=1.2)
        ax_loss.annotate(
            label,
            xy=(step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            rotation=90,
            va="top",
            fontsize=8,
            color="tab:red" if resized else "tab:gray",
        )

    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=110)  # PNG whatever the name: matplotlib would add ".png"
    finally:
        plt.close(fig)
    make_dir(target.parent, "--out", OutputError)
    try:
        write_atomic(target, png.getvalue())
    except OSError as e:
        raise OutputError(f"--out {target}: cannot write it ({e.strerror or e}); choose another path") from e
    return target
