"""What keeps a run of many ranks in step: a small gloo group for host-side agreement, a stop
signal that every rank honours at the same step, the non-finite-loss flag they agree on, the
fault-injection hooks the tests use, and the `Sentinel` that holds the last two and the hang
watchdog for the training loop.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as tdist

from pretrain.config.tree import RunConfig
from pretrain.training.engine import Dist
from pretrain.training.watchdog import Watchdog

# ---------------------------------------------------------------------------------------------
# Collectives over a small gloo group (flags and file lists stay off the GPU); no-ops alone.


def control_group() -> Any:
    """A gloo group of all ranks for host-side agreement (stop, bad step, save errors)."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return None
    return tdist.new_group(backend="gloo")


def world_of(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return tdist.get_rank(group), tdist.get_world_size(group)


def gather(obj: Any, group: Any) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any) -> None:
    if group is not None:
        tdist.barrier(group=group)


# ---------------------------------------------------------------------------------------------
# A rank that is gone

_ROSTER: list[tuple[str, int]] = []  # every rank's (host, pid), gathered at the start of training
# What gloo and NCCL say when the other end of a collective is gone (not a timeout: the watchdog's).
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)


def set_roster(roster: list[tuple[str, int]]) -> None:
    """Every rank's (host, pid), in rank order: who to look for when a collective loses a peer."""
    _ROSTER[:] = roster


def _gone(pid: int) -> bool:
    """The process `pid` (on this host) has exited: no such process, or a zombie not yet reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def lost_rank(e: BaseException, rank: int, wait_s: float = 3.0) -> str | None:
    """If `e` is a collective that failed because another rank is gone: one message saying so,
    naming the ranks on this host that have exited (looked for up to `wait_s`: a crashing rank may
    still be on its way out) or where else to look, and the fix. None for any other error."""
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(m in text for m in _PEER_GONE):
        return None
    first = (text.strip().splitlines() or [""])[0]
    first = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", first)  # gloo's source location
    first = first.split(" This is typically", 1)[0].rstrip(". ")
    here = socket.gethostname()
    local = [(r, pid) for r, (host, pid) in enumerate(_ROSTER) if r != rank and host == here]
    others = sorted({host for r, (host, _) in enumerate(_ROSTER) if host != here})
    deadline = time.monotonic() + wait_s
    while not (gone := [(r, pid) for r, pid in local if _gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if gone:
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
        who = (
            f"{names} on this host {'has' if len(gone) == 1 else 'have'} exited, killed or crashed: "
            "its own output, or the kernel log (`dmesg`: the out-of-memory killer), says why"
        )
    elif others:
        who = (
            f"no rank on this host has exited, so the one lost ran on {', '.join(others[:4])}"
            f"{' ...' if len(others) > 4 else ''}: its output there says why"
        )
    else:
        who = "which one could not be told from here"
    return (
        f"rank {rank} lost another rank in the middle of a collective ({first}): {who}. This rank stopped "
        "without saving: continue from the newest checkpoint with --resume auto (under --max-restarts N "
        "the ranks restart by themselves)"
    )


# ---------------------------------------------------------------------------------------------
# Stopping on a signal, agreeing on a bad step, and the fault-injection hooks the tests use


class StopOnSignal:
    """While installed, SIGTERM and SIGINT only ask the loop to stop: it finishes the step, saves a
    checkpoint on every rank and returns. A repeat is the same request, since launchers pass on what
    their ranks already got (DeepSpeed's launch.py follows a terminal's Ctrl-C with a SIGTERM to each
    rank; the supervisor's torchrun passes on every signal it gets), except a SIGINT that arrives more
    than SAME_REQUEST_S after the first: a person's second Ctrl-C, which interrupts at once.

    What tells the two apart is when each signal arrived, not when its handler ran: Python runs a
    handler between bytecodes of the main thread, which can sit in one C call (a backward, a
    collective, a device sync) for seconds, and a launcher's repeat handled then looked like a second
    Ctrl-C. A thread reads the numbers Python's C-level handler writes to a wakeup pipe the moment a
    signal arrives, and times them."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    SAME_REQUEST_S = 1.0  # a launcher passes a signal on within milliseconds; a person takes longer

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._first_sigint: float | None = None  # when the first SIGINT arrived
        self._interrupt = False  # a person's second Ctrl-C arrived: interrupt the main thread
        self._done = False  # interrupted, or uninstalling: the handler only records from now on
        self._wakeup: tuple[int, int] | None = None  # the pipe's write end, the previous wakeup fd
        self._watcher: threading.Thread | None = None

    def install(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            read, write = os.pipe()
            os.set_blocking(write, False)  # as set_wakeup_fd requires
            self._wakeup = (write, signal.set_wakeup_fd(write, warn_on_full_buffer=False))
            self._watcher = threading.Thread(target=self._watch, args=(read,), daemon=True)
            self._watcher.start()
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def _watch(self, read: int) -> None:
        """The wakeup pipe's reader: times each SIGINT's arrival, and on a person's second Ctrl-C
        has the main thread's handler interrupt it."""
        while data := os.read(read, 64):  # b"": uninstall closed the write end
            now = time.monotonic()
            for signum in data:
                if signum != signal.SIGINT or self._interrupt:
                    continue
                if self._first_sigint is None:
                    self._first_sigint = now
                elif now - self._first_sigint > self.SAME_REQUEST_S:
                    self._interrupt = True
                    # to the main thread, as a signal: _handle, which now raises, runs at its next
                    # instruction (a sleep or a wait there is cut short, if the signal finds it in one)
                    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        os.close(read)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._interrupt and not self._done:
            self._done = True  # once: the watcher's own SIGINT may still be pending
            raise KeyboardInterrupt
        self.signum = self.signum or signum

    def uninstall(self) -> None:
        self._done = True
        if self._wakeup is not None:
            write, previous_fd = self._wakeup
            signal.set_wakeup_fd(previous_fd)
            os.close(write)
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            self._wakeup = self._watcher = None
        # signal.signal runs a pending handler first: ours, which now only records
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def settle(self) -> None:
        """The stop asked for is saved and the process is on its way out: uninstall, and ignore
        SIGTERM and SIGINT from now on, so that a repeat arriving late cannot kill the teardown or
        report a stop "without saving" (DeepSpeed's launch.py sends rank k its SIGTERM only once rank
        k-1 has exited). SIGKILL, and a launcher's after its grace period, still end it."""
        self.uninstall()
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_IGN)


class Agreement:
    """The ranks' agreement on (a non-finite loss on any rank, the signal any rank was asked to stop
    by, or 0, whether any rank's clock has passed schedule.max_hours), the same on every rank once
    `wait()` returns. `start_agreement` sends it off without
    waiting, so the collective's round trip hides behind the step's last backward and update."""

    def __init__(self, flags: torch.Tensor, work: Any) -> None:
        self.flags, self.work = flags, work

    def wait(self) -> tuple[bool, int, bool]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return bool(self.flags[0]), int(self.flags[1]), bool(self.flags[2])


def start_agreement(
    step_loss: torch.Tensor, signum: int | None, group: Any, out_of_time: bool = False
) -> Agreement:
    """Begin agreeing on `step_loss` being finite, on a stop signal and on the run's time being up
    (one host read of the loss; one asynchronous all_reduce over the gloo group, none for a single
    rank)."""
    finite = bool(torch.isfinite(step_loss))
    flags = torch.tensor([0 if finite else 1, signum or 0, int(out_of_time)], dtype=torch.int64)
    work = None
    if group is not None and tdist.get_world_size(group) > 1:
        work = tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=group, async_op=True)
    return Agreement(flags, work)


def agree(step_loss: torch.Tensor, signum: int | None, group: Any) -> tuple[bool, int]:
    """`start_agreement(...).wait()`: (any rank's loss was non-finite, the signal any rank was asked
    to stop by, or 0), the same on every rank."""
    bad, stop, _ = start_agreement(step_loss, signum, group).wait()
    return bad, stop


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


# ---------------------------------------------------------------------------------------------
# The loop's guards, together


class Sentinel:
    """What watches one rank's training loop: the hang watchdog (watchdog.py), the stop signal and
    the fault-injection hooks. Built before the first step, which it gives the watchdog's larger
    allowance; `tick` after every step re-arms the watchdog and fires the faults due after it.

    A context manager: on the way out, even through an error, it stops the watchdog and gives
    SIGTERM and SIGINT back their previous handlers (a failed run stays killable); after a stop it
    was asked for and that the loop saved, it leaves them ignored instead (`StopOnSignal.settle`)."""

    def __init__(self, cfg: RunConfig, dist: Dist, start_step: int) -> None:
        self.rank = dist.rank
        self.watchdog = Watchdog(cfg.watchdog, cfg.run_dir(), rank=dist.rank, world_size=dist.world_size)
        self.watchdog.slow("the first step", start_step)
        self.faults = Faults(cfg.run_dir(), cfg.batch.sequences)
        self._stop = StopOnSignal().install()

    def __enter__(self) -> Sentinel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None and self._stop.signum is not None:
            self._stop.settle()
        else:
            self._stop.uninstall()
        self.watchdog.close()

    @property
    def signum(self) -> int | None:
        """The signal this rank was asked to stop by, if any (the ranks agree on it in the step)."""
        return self._stop.signum

    def expect(self, what: str, step: int) -> None:
        """`what` comes next, after `step`, and may take the watchdog's slow allowance."""
        self.watchdog.slow(what, step)

    def tick(self, step: int) -> None:
        """`step` is done: the next must finish within the watchdog's timeout; the faults injected
        after `step` fire now."""
        self.watchdog.beat(step)
        self.faults.after_step(step, self.rank)
