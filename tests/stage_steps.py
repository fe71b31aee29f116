"""Toy stage steps for tests/test_executors.py and tests/test_multinode.py: module level, so that
every process (a fork server's, a Slurm task's, a Ray worker's) imports them by name."""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from pretrain.files import write_atomic


@dataclass
class ToyStep:
    """Writes `out/rank{r}.txt` (its rank, world size and host) atomically, and appends a line to
    `out/runs{r}` at every run. `kill_rank` kills its own process with SIGKILL the first time it runs
    (while `out/killed` is absent), `raise_rank` raises ValueError, every time."""

    out: str
    sleep: float = 0.0
    kill_rank: int | None = None
    raise_rank: int | None = None

    def __call__(self, rank: int, world_size: int) -> None:
        out = Path(self.out)
        with open(out / f"runs{rank}", "a") as f:
            f.write(f"{os.getpid()}\n")
        if rank == self.kill_rank and not (out / "killed").exists():
            (out / "killed").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == self.raise_rank:
            raise ValueError(f"toy step refuses rank {rank}")
        time.sleep(self.sleep)
        write_atomic(out / f"rank{rank}.txt", f"{rank} {world_size} {socket.gethostname()}\n")


def runs(out: Path, rank: int) -> int:
    """How many times rank `rank` ran."""
    path = out / f"runs{rank}"
    return len(path.read_text().splitlines()) if path.exists() else 0
