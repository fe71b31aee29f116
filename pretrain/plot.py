"""`pretrain plot RUN_DIR`: a PNG of a run's metrics.csv: loss (train and val), LR and tokens/s."""

from __future__ import annotations

from pathlib import Path

from pretrain.errors import DataError, require
from pretrain.metrics import read_csv


def _series(rows: list[dict[str, float | None]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        step, value = r.get("step"), r.get(key)
        if step is not None and value is not None:
            xs.append(step)
            ys.append(value)
    return xs, ys


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

    out = out or run_dir / "metrics.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
