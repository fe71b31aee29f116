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
    - PRETRAIN_FAULT_KILL="RANK:STEP": that rank sends itself SIGKILL after step STEP;
    - PRETRAIN_FAULT_KILL_IN_SAVE="STEP": rank 0 sends itself SIGKILL while saving step STEP,
      after writing its first file;
    - PRETRAIN_FAULT_SIGTERM="RANK:STEP": that rank sends itself SIGTERM after step STEP (the run
      then saves after the next step, on every rank, and stops);
    - PRETRAIN_FAULT_HANG="RANK:STEP": that rank hangs after step STEP, asleep with the GIL released
      (as in a stuck read), while the others wait for it in the next step's collectives;
      "RANK:STEP:gil": in a C call that holds the GIL (the watchdog's C fallback must catch it).
    Each kill or hang happens once per run directory (a marker file `.fault-*` remembers it), so a
    supervised restart gets past it.
    """

    def __init__(self, run_dir: Path, global_batch: int, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        self.run_dir = run_dir
        steps = [int(s) for s in env.get("PRETRAIN_FAULT_NAN_STEPS", "").split(",") if s.strip()]
        self.nan_batches = {(s - 1) * global_batch for s in steps}
        kill = env.get("PRETRAIN_FAULT_KILL", "")
        self.kill = tuple(int(x) for x in kill.split(":")) if kill else None
        in_save = env.get("PRETRAIN_FAULT_KILL_IN_SAVE", "")
        self.kill_in_save = int(in_save) if in_save else None
        term = env.get("PRETRAIN_FAULT_SIGTERM", "")
        self.sigterm = tuple(int(x) for x in term.split(":")) if term else None
        hang = env.get("PRETRAIN_FAULT_HANG", "").split(":")
        self.hang = (int(hang[0]), int(hang[1])) if len(hang) >= 2 else None
        self.hang_holds_gil = hang[2:] == ["gil"]

    def nan(self, batch_start: int, rank: int) -> bool:
        return rank == 0 and batch_start in self.nan_batches

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
        if self.kill_in_save != step or rank != 0:
            return None
        return lambda path: self._die(f"kill-in-save-{step}")

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
