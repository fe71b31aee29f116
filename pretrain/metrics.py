"""Training metrics: one CSV row per logged step, and a one-line summary on stdout (rank 0)."""

from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

FIELDS = [
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "tokens_seen",
    "val_loss",
    "val_ppl",
    "elapsed_s",
]


class MetricsLog:
    """Appends to `metrics.csv` in the run dir (a resumed run continues the same file)."""

    def __init__(
        self, run_dir: Path, max_steps: int, enabled: bool = True, out: IO[str] = sys.stdout
    ) -> None:
        self.enabled = enabled
        self.max_steps = max_steps
        self.out = out
        self.start = time.perf_counter()
        self.path = run_dir / "metrics.csv"
        if enabled:
            new = not self.path.exists()
            self._file = self.path.open("a", newline="")
            self._csv = csv.DictWriter(self._file, fieldnames=FIELDS)
            if new:
                self._csv.writeheader()

    def log(self, step: int, **values: Any) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        row = {"step": step, "elapsed_s": round(elapsed, 3), **values}
        self._csv.writerow({k: _fmt(row.get(k)) for k in FIELDS})
        self._file.flush()
        self.out.write(self._line(step, row) + "\n")
        self.out.flush()

    def _line(self, step: int, row: dict[str, Any]) -> str:
        parts = [f"step {step:>6}/{self.max_steps}"]
        if row.get("loss") is not None:
            parts.append(f"loss {row['loss']:.4f}")
        if row.get("val_loss") is not None:
            parts.append(f"val_loss {row['val_loss']:.4f} val_ppl {row['val_ppl']:.2f}")
        if row.get("lr") is not None:
            parts.append(f"lr {row['lr']:.2e}")
        if row.get("grad_norm") is not None:
            parts.append(f"gnorm {row['grad_norm']:.3f}")
        if row.get("tokens_per_s") is not None:
            parts.append(f"{row['tokens_per_s']:,.0f} tok/s")
        if row.get("step_time_s") is not None:
            parts.append(f"{row['step_time_s'] * 1000:.0f} ms/step")
            done = max(step, 1)
            eta = (self.max_steps - step) * row["step_time_s"] if step < self.max_steps else 0.0
            parts.append(f"eta {_duration(eta)}" if done else "")
        return " | ".join(p for p in parts if p)

    def close(self) -> None:
        if self.enabled:
            self._file.close()


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.6g}"
    return "" if v is None else v


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
