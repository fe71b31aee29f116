"""The hang watchdog: when no step completes in time, every rank writes its Python stacks to the
run dir and exits non-zero, so that a supervisor (`train --max-restarts`, Slurm) restarts the run
from its newest checkpoint instead of leaving it hung until the job's wall-clock limit.

The loop, through `guards.Sentinel`, re-arms it after every step (`beat`) and gives the long phases
(the first step, an evaluation, a checkpoint save) the larger allowance (`slow`). Two watchers share
the deadline:

- a Python thread, which at the deadline writes `<run_dir>/hang/step_<N>/rank<R>.txt` (N: the last
  step completed) with the host, time and step, prints one line on stderr and exits with
  `EXIT_CODE`. It runs whenever the main thread waits in C code that lets go of the GIL: a gloo or
  NCCL collective, a read, a sleep, and Python code of any kind;
- faulthandler's C thread, `FALLBACK_S` later, for a rank whose main thread holds the GIL in C
  code (the Python thread cannot run then): it writes the stacks to stderr and exits with code 1.

A rank that fires waits `EXIT_AFTER_S` before exiting, so that the ranks blocked in a collective on
it (their deadlines are the same, give or take a step's skew) write their stacks too, before its
exit breaks their collective.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from pretrain.config.run_sections import WatchdogConfig
from pretrain.files import AtomicFile

EXIT_CODE = 124  # as timeout(1); any non-zero exit is a failure the supervisor restarts
FALLBACK_S = 10.0  # faulthandler's C thread fires this long after the deadline
EXIT_AFTER_S = FALLBACK_S + 2  # a rank that fired exits this long after its deadline


@dataclass(frozen=True, kw_only=True)
class _Armed:
    """One deadline, replaced as a whole (the watching thread reads it without a lock)."""

    deadline: float  # time.monotonic()
    step: int  # the last step completed
    since: float  # time.time() when armed
    waiting_for: str  # "step 6", "the checkpoint save", ...
    seconds: int
    setting: str  # the config field that gave `seconds`


class Watchdog:
    """Watches one rank's training loop; a context manager that stops watching on the way out.
    With `cfg.timeout_s == 0` it does nothing."""

    def __init__(self, cfg: WatchdogConfig, run_dir: Path, *, rank: int, world_size: int) -> None:
        self.cfg, self.run_dir, self.rank, self.world_size = cfg, run_dir, rank, world_size
        self._armed: _Armed | None = None
        self._fallback_at = 0.0  # when faulthandler's C thread fires (monotonic); 0: not armed
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def beat(self, step: int) -> None:
        """`step` is done: the next must finish within `timeout_s`."""
        self._arm(step, f"step {step + 1}", seconds=self.cfg.timeout_s, setting="watchdog.timeout_s")

    def slow(self, what: str, step: int) -> None:
        """`what` comes next, after `step`: it may take up to `slow_timeout_s`."""
        self._arm(step, what, seconds=self.cfg.slow_timeout_s, setting="watchdog.slow_timeout_s")

    def close(self) -> None:
        """Stop watching (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._armed = None
        if self._fallback_at:
            faulthandler.cancel_dump_traceback_later()
            self._fallback_at = 0.0
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def path(self, step: int) -> Path:
        """Where this rank's stacks go after `step`: hang/step_<N>/rank<R>.txt, or rank<R>.<k>.txt
        when a previous attempt hung after the same step."""
        base = self.run_dir / "hang" / f"step_{step:08d}"
        path, k = base / f"rank{self.rank}.txt", 1
        while path.exists():
            path, k = base / f"rank{self.rank}.{k}.txt", k + 1
        return path

    # -----------------------------------------------------------------------------------------

    def _arm(self, step: int, what: str, *, seconds: int, setting: str) -> None:
        if not self.cfg.timeout_s or self._closed:
            return
        if not seconds:  # slow_timeout_s = 0: this phase is not watched
            self._armed = None
            if self._fallback_at:
                faulthandler.cancel_dump_traceback_later()
                self._fallback_at = 0.0
            return
        now = time.monotonic()
        previous = self._armed
        armed = _Armed(
            deadline=now + seconds,
            step=step,
            since=time.time(),
            waiting_for=what,
            seconds=seconds,
            setting=setting,
        )
        self._armed = armed
        # The C fallback must fire after the Python thread has had its chance (a margin of
        # FALLBACK_S / 2) and at most FALLBACK_S after the deadline; re-arming it starts a thread,
        # so it is re-armed only when the deadline moves out of that window (every few seconds).
        if not (armed.deadline + FALLBACK_S / 2 <= self._fallback_at <= armed.deadline + FALLBACK_S):
            self._fallback_at = armed.deadline + FALLBACK_S
            faulthandler.dump_traceback_later(self._fallback_at - now, exit=True, file=2)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="pretrain-watchdog", daemon=True)
            self._thread.start()
        elif previous is None or armed.deadline < previous.deadline:
            self._wake.set()  # the thread sleeps until the old deadline: make it look again

    def _watch(self) -> None:
        while not self._closed:
            self._wake.clear()  # before reading the deadline, so that no re-arm is missed
            armed = self._armed
            if armed is None:
                self._wake.wait()
                continue
            left = armed.deadline - time.monotonic()
            if left > 0:
                self._wake.wait(left)
                continue
            self._fire(armed)

    def _fire(self, armed: _Armed) -> None:
        # Keep a C deadline over the dump itself: the file system of the run dir may be what hangs.
        faulthandler.dump_traceback_later(EXIT_AFTER_S + FALLBACK_S, exit=True, file=2)
        host = socket.gethostname()
        last = "no step yet" if armed.step == 0 else f"the last completed step was {armed.step}"
        head = (
            f"watchdog: rank {self.rank} of {self.world_size} on {host} (pid {os.getpid()}): "
            f"{armed.waiting_for} did not finish within {armed.seconds} s ({armed.setting})"
        )
        try:
            path = self.path(armed.step)
            path.parent.mkdir(parents=True, exist_ok=True)
            with AtomicFile(path, "w") as f:
                f.write(
                    f"{head}\n"
                    f"waiting since {_utc(armed.since)}; {last}\n"
                    f"stacks written at {_utc(time.time())}, most recent call first:\n\n"
                )
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            where = f"stacks in {path}"
        except OSError as e:
            print(f"{head}; could not write {self.run_dir / 'hang'} ({e}); stacks follow", file=sys.stderr)
            faulthandler.dump_traceback(2, all_threads=True)
            where = "stacks above"
        print(
            f"{head}; {last}; {where}; exiting with code {EXIT_CODE} so that a supervisor restarts the "
            f"run (raise {armed.setting} if this is legitimately slow, 0 turns it off)",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(max(0.0, armed.deadline + EXIT_AFTER_S - time.monotonic()))
        os._exit(EXIT_CODE)


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
