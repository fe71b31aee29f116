"""What keeps a run of many ranks in step: a stop signal that every rank honours at the same step,
the non-finite-loss flag and the step's loss they agree on, the loss-spike rule judged on that loss,
and the `Sentinel` that holds the fault-injection hooks (faults.py) and the hang watchdog
(watchdog.py) for the training loop.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import threading
import time
from types import TracebackType
from typing import Any

import torch
import torch.distributed as tdist

from pretrain.config.run_sections import CheckpointConfig
from pretrain.config.tree import RunConfig
from pretrain.training.distributed.ranks import Dist
from pretrain.training.faults import Faults
from pretrain.training.watchdog import Watchdog

# ---------------------------------------------------------------------------------------------
# Stopping on a signal, and agreeing on a bad step


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
    waiting, so the collective's round trip hides behind the step's last backward and update.

    With the spike rule on, every rank's loss comes along (one all_gather instead of the all_reduce)
    and `loss` is then their mean, the same bits on every rank: `judge` compares it to the rule."""

    def __init__(self, flags: torch.Tensor, work: Any, rows: list[torch.Tensor] | None = None) -> None:
        self.flags, self.work, self.rows = flags, work, rows
        self.loss: float | None = None  # the mean loss over the ranks (with the rule on), after wait()
        self.spike: str | None = None  # why the step is a spike, after judge(); None: it is not

    def wait(self) -> tuple[bool, int, bool]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.rows is not None and self.loss is None:
            self._combine(self.rows)
        return bool(self.flags[0]), int(self.flags[1]), bool(self.flags[2])

    def _combine(self, rows: list[torch.Tensor]) -> None:
        """Every rank's row (non-finite, signal, out of time, loss sum, micro-steps), in rank order, to
        the agreed flags and the mean loss per micro-step. `math.fsum` rounds the exact sum once, so
        the mean is the same bits whatever order or CPU sums it."""
        table = torch.stack(rows)
        self.flags = table[:, :3].amax(dim=0).to(torch.int64)
        self.loss = math.fsum(table[:, 3].tolist()) / math.fsum(table[:, 4].tolist())

    def judge(self, rule: SpikeRule) -> str | None:
        """Wait for the agreement and judge its mean loss by `rule`: why the step is a spike (kept in
        `spike`), or None. A non-finite loss anywhere is not a spike: it is the step's other fault."""
        bad, _, _ = self.wait()
        self.spike = None if bad or self.loss is None else rule.judge(self.loss)
        return self.spike


def start_agreement(
    step_loss: torch.Tensor,
    signum: int | None,
    group: Any,
    out_of_time: bool = False,
    *,
    micro_steps: int | None = None,
) -> Agreement:
    """Begin agreeing on `step_loss` being finite, on a stop signal and on the run's time being up
    (one host read of the loss; one asynchronous all_reduce over the gloo group, none for a single
    rank). `micro_steps` (the spike rule is on): `step_loss` sums that many micro-batches' losses,
    and the ranks agree on their mean too (an all_gather instead)."""
    if micro_steps is not None:
        return _start_with_loss(step_loss, signum, group, out_of_time, micro_steps)
    finite = bool(torch.isfinite(step_loss))
    flags = torch.tensor([0 if finite else 1, signum or 0, int(out_of_time)], dtype=torch.int64)
    work = None
    if group is not None and tdist.get_world_size(group) > 1:
        work = tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=group, async_op=True)
    return Agreement(flags, work)


def _start_with_loss(
    step_loss: torch.Tensor, signum: int | None, group: Any, out_of_time: bool, micro_steps: int
) -> Agreement:
    """`start_agreement` with every rank's loss: each rank's row of float64s (a signal number and
    a float32 loss are exact in them) gathered by every rank, which combines them alike. A gather,
    not a sum, because the flags combine by max and the loss by a sum in a fixed order."""
    loss = float(step_loss)  # the one host read
    row = torch.tensor(
        [0 if math.isfinite(loss) else 1, signum or 0, int(out_of_time), loss, micro_steps],
        dtype=torch.float64,
    )
    if group is None or tdist.get_world_size(group) == 1:
        return Agreement(row[:3].to(torch.int64), None, [row])
    rows = [torch.empty_like(row) for _ in range(tdist.get_world_size(group))]
    work = tdist.all_gather(rows, row, group=group, async_op=True)
    return Agreement(row[:3].to(torch.int64), work, rows)


def agree(step_loss: torch.Tensor, signum: int | None, group: Any) -> tuple[bool, int]:
    """`start_agreement(...).wait()`: (any rank's loss was non-finite, the signal any rank was asked
    to stop by, or 0), the same on every rank."""
    bad, stop, _ = start_agreement(step_loss, signum, group).wait()
    return bad, stop


# ---------------------------------------------------------------------------------------------
# Loss spikes


class SpikeRule:
    """checkpoint.spike_factor and spike_window: a step whose loss (the ranks' agreed mean) exceeds
    `factor` x the median of the last `window` accepted steps' losses is a spike, and is skipped as
    a non-finite one is. The rule applies once the window is full; skipped steps never enter it, and
    a rollback restores the window of the checkpoint it goes back to (`recent` is saved with it).

    The median, not the mean: a spike that stayed under the factor, or a few high losses (a hard
    stretch of data), pull a mean up and would hide the next spike behind them; the median ignores
    anything in less than half the window. Off (`factor` None), no step is a spike and no loss is
    kept."""

    def __init__(self, factor: float | None, window: int, recent: list[float] | None = None) -> None:
        self.factor, self.window = factor, window
        self.recent: list[float] = []  # the agreed losses of the last accepted steps, oldest first
        self.restore(recent or [])

    @classmethod
    def of(cls, policy: CheckpointConfig) -> SpikeRule:
        return cls(policy.spike_factor, policy.spike_window)

    @property
    def on(self) -> bool:
        return self.factor is not None

    def judge(self, loss: float) -> str | None:
        """Why a step of (agreed, finite) `loss` is a spike, in the words of the log, or None."""
        if self.factor is None or len(self.recent) < self.window:
            return None
        median = statistics.median(self.recent)
        if not loss > self.factor * median:
            return None
        # fixed-point, as the log rows print the loss: never 1e+03, whatever the size
        times = f"{loss / median:.2f}" if median > 0 else "inf"
        return f"loss {loss:.4f} is a spike ({times} x the median of the last {self.window} steps)"

    def accept(self, loss: float | None) -> None:
        """A step of `loss` was accepted (its update applied): it enters the window."""
        if self.factor is not None and loss is not None:
            self.recent.append(loss)
            del self.recent[: -self.window]

    def restore(self, recent: list[float]) -> None:
        """The window a checkpoint saved (its newest `window`, if the window has shrunk since)."""
        self.recent = [float(x) for x in recent][-self.window :] if self.factor is not None else []


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
