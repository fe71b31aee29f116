"""Faults injected through environment variables, for the tests that kill, hang or poison a rank
at a chosen step (docs/checkpoints.md lists them)."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from pathlib import Path
from typing import Any


class Faults:
    """Faults injected through environment variables, for the tests (documented in the README):

    - PRETRAIN_FAULT_NAN_STEPS="5,6": rank 0's loss is NaN on the batches that steps 5 and 6 of
      an uninterrupted run train on (whenever the run meets those batches);
    - PRETRAIN_FAULT_SPIKE_STEPS="5,6": rank 0's loss is multiplied by SPIKE (a large, finite
      factor) on those batches, for the spike rule (checkpoint.spike_factor);
    - PRETRAIN_FAULT_KILL="RANK:STEP": that rank sends itself SIGKILL after step STEP;
    - PRETRAIN_FAULT_KILL_IN_SAVE="STEP": rank 0 sends itself SIGKILL while saving step STEP,
      after writing its first file (with checkpoint.async_save, on the thread that writes it);
    - PRETRAIN_FAULT_SLOW_SAVE="SECONDS": every rank waits that long after each checkpoint file it
      writes (a slow filesystem: a background save is still in flight at the next save or stop);
    - PRETRAIN_FAULT_SIGTERM="RANK:STEP": that rank sends itself SIGTERM after step STEP (the run
      then saves after the next step, on every rank, and stops);
    - PRETRAIN_FAULT_HANG="RANK:STEP": that rank hangs after step STEP, asleep with the GIL released
      (as in a stuck read), while the others wait for it in the next step's collectives;
      "RANK:STEP:gil": in a C call that holds the GIL (the watchdog's C fallback must catch it).
    Each kill or hang happens once per run directory (a marker file `.fault-*` remembers it), so a
    supervised restart gets past it.
    """

    # Large enough that the loss is a spike against any spike_factor a test sets (one rank of two:
    # the mean is still 500 x), small enough to stay finite in fp16 (a loss near 4 becomes 4000).
    SPIKE = 1000.0

    def __init__(self, run_dir: Path, global_batch: int, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.run_dir = run_dir
        steps = [int(s) for s in env.get("PRETRAIN_FAULT_NAN_STEPS", "").split(",") if s.strip()]
        self.nan_batches = {(s - 1) * global_batch for s in steps}
        spikes = [int(s) for s in env.get("PRETRAIN_FAULT_SPIKE_STEPS", "").split(",") if s.strip()]
        self.spike_batches = {(s - 1) * global_batch for s in spikes}
        kill = env.get("PRETRAIN_FAULT_KILL", "")
        self.kill = tuple(int(x) for x in kill.split(":")) if kill else None
        in_save = env.get("PRETRAIN_FAULT_KILL_IN_SAVE", "")
        self.kill_in_save = int(in_save) if in_save else None
        self.slow_save = float(env.get("PRETRAIN_FAULT_SLOW_SAVE", "") or 0)
        term = env.get("PRETRAIN_FAULT_SIGTERM", "")
        self.sigterm = tuple(int(x) for x in term.split(":")) if term else None
        hang = env.get("PRETRAIN_FAULT_HANG", "").split(":")
        self.hang = (int(hang[0]), int(hang[1])) if len(hang) >= 2 else None
        self.hang_holds_gil = hang[2:] == ["gil"]

    def nan(self, batch_start: int, rank: int) -> bool:
        return rank == 0 and batch_start in self.nan_batches

    def spike(self, batch_start: int, rank: int) -> bool:
        return rank == 0 and batch_start in self.spike_batches

    def loss_factor(self, batch_start: int, rank: int) -> float | None:
        """What this rank's loss on the batch at `batch_start` is multiplied by: NaN, SPIKE or
        nothing (None: one check a micro-step for both hooks)."""
        if rank != 0:
            return None
        if batch_start in self.nan_batches:
            return float("nan")
        return self.SPIKE if batch_start in self.spike_batches else None

    def after_step(self, step: int, rank: int) -> None:
        if self.kill is not None and self.kill == (rank, step):
            self._die(f"kill-{rank}-{step}")
        if self.sigterm is not None and self.sigterm == (rank, step):
            # To this thread, so the handler has run when this returns: os.kill to the process lets the
            # kernel pick any of its threads, and on a loaded machine the flag can come a step late.
            signal.raise_signal(signal.SIGTERM)
        if self.hang is not None and self.hang == (rank, step):
            self._hang(f"hang-{rank}-{step}")

    def kill_in_save_hook(self, step: int, rank: int) -> Any:
        """What runs after each checkpoint file this rank writes for `step`, if anything."""
        kill = self.kill_in_save == step and rank == 0
        if not kill and not self.slow_save:
            return None

        def hook(path: str) -> None:
            time.sleep(self.slow_save)
            if kill:
                self._die(f"kill-in-save-{step}")

        return hook

    def _die(self, name: str) -> None:
        if self._once(name):
            print(f"fault injection: SIGKILL to pid {os.getpid()} ({name})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def _hang(self, name: str) -> None:
        if not self._once(name):
            return
        how = "in a C call holding the GIL" if self.hang_holds_gil else "asleep"
        print(f"fault injection: pid {os.getpid()} hangs {how} from {time.time():.3f} ({name})", flush=True)
        if self.hang_holds_gil:
            libc = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL; sleep(3) is libc's
            while True:
                libc.sleep(3600)
        while True:
            time.sleep(3600)

    def _once(self, name: str) -> bool:
        marker = self.run_dir / f".fault-{name}"
        if marker.exists():
            return False
        marker.write_text("fired\n")
        return True
