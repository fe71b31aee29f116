"""`pretrain plot RUN_DIR`: a PNG of a run's metrics.csv: loss (train and val), LR and tokens/s, with
its resumes and world-size changes marked (from starts.csv, which each start of training appends to)."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

from pretrain.errors import DataError, require
from pretrain.files import read_csv

STARTS = "starts.csv"


def _series(rows: list[dict[str, float | None]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        step, value = r.get("step"), r.get(key)
        if step is not None and value is not None:
            xs.append(step)
            ys.append(value)
    return xs, ys


def run_events(run_dir: Path) -> list[tuple[int, str]]:
    """(step, label) of each resume (or restart) of the run, naming a world-size change, from
    starts.csv; none for a run without one (written before it existed)."""
    path = run_dir / STARTS
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        starts = [(int(r["step"]), int(r["world_size"])) for r in csv.DictReader(f) if r.get("step")]
    events = []
    for (_, before), (step, world) in itertools.pairwise(starts):
        label = f"resume at step {step}" if step else "restart from step 0"
        events.append((step, label + (f", world size {before} → {world}" if world != before else "")))
    return events


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write `<run_dir>/metrics.png` (or `out`) and return its path."""
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise DataError(f"{path}: no such file (is {run_dir} a run directory?)")
    rows = read_csv(path)
    if not any(r.get("loss") is not None for r in rows):
        raise DataError(f"{path}: no training steps logged yet")

    matplotlib = require("matplotlib", "`pretrain plot`", "plot")  # only to draw: seconds to import
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    fig, (ax_loss, ax_lr, ax_tps) = plt.subplots(3, 1, figsize=(9, 9), sharex=True, layout="constrained")
    fig.suptitle(f"{run_dir.resolve().name}: {path}", fontsize=11)

    ax_loss.plot(*_series(rows, "loss"), label="train", color="tab:blue", linewidth=1.2)
    vx, vy = _series(rows, "val_loss")
    ax_loss.plot(vx, vy, "o-", label="val", color="tab:orange", markersize=4, linewidth=1.2)
    ax_loss.set_ylabel("loss (cross-entropy, nats)")
    ax_loss.set_title("Loss")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)

    ax_lr.plot(*_series(rows, "lr"), color="tab:green", linewidth=1.2)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_title("Learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax_lr.grid(alpha=0.3)

    ax_tps.plot(*_series(rows, "tokens_per_s"), color="tab:purple", linewidth=1.2, label="all ranks")
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

    for step, label in run_events(run_dir):
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

    out = out or run_dir / "metrics.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
