"""What keeps a run of many ranks in step: a stop signal that every rank honours at the same step,
the non-finite-loss flag and the step's loss they agree on, the loss-spike rule judged on that loss,
and the `Sentinel` that holds the fault-injection hooks (faults.py) and the hang watchdog
(watchdog.py) for the training loop.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import TracebackType
from typing import Any

import torch
import torch.distributed as tdist

from pretrain.config.run_sections import StabilityConfig
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
    `wait()` returns. `start_agreement` sends it off without waiting, so the collective's round trip
    hides behind the step's last backward and update.

    With the spike rule on, `spiked` (known on this rank at once, the same on every rank) says
    whether the step is a spike, `loss` is the ranks' mean loss on the device, and after `wait()`
    `spike` says why in the words of the log (None: no spike, or a non-finite loss anywhere)."""

    def __init__(
        self,
        flags: torch.Tensor,
        work: Any,
        *,
        loss: torch.Tensor | None = None,
        rule: SpikeRule | None = None,
    ) -> None:
        self.flags, self.work, self.loss, self.rule = flags, work, loss, rule
        self.spiked = bool(flags[3])  # this rank's judgement, which every rank shares (see SpikeRule)
        self.skipped = False  # the optimizer's step was skipped for the spike (OptimizerSkip)
        self.spike: str | None = None  # why the step is a spike, after wait(); None: it is not

    def wait(self) -> tuple[bool, int, bool]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        bad = bool(self.flags[0])
        if self.spiked and not bad and self.spike is None and self.rule is not None and self.loss is not None:
            self.spike = self.rule.why(self.loss)  # host reads, on a spike only: its log line
        return bad, int(self.flags[1]), bool(self.flags[2])


def start_agreement(
    step_loss: torch.Tensor,
    signum: int | None,
    group: Any,
    out_of_time: bool = False,
    *,
    loss: torch.Tensor | None = None,
    rule: SpikeRule | None = None,
) -> Agreement:
    """Begin agreeing on `step_loss` being finite, on a stop signal and on the run's time being up:
    one host read of the loss, the non-finite rule's, and one asynchronous all_reduce over the gloo
    `group` (none for a single rank). With the spike rule on (`rule`, and `loss`, the ranks' mean
    loss on the device, from `mean_loss`), the rule's verdict on `loss` comes along in that same
    host read: the rule adds none of its own."""
    spiked = False
    if rule is None or loss is None:
        finite = bool(torch.isfinite(step_loss))  # the one host read
    else:
        finite, spiked = torch.stack([torch.isfinite(step_loss), rule.judge(loss)]).tolist()  # the one
    flags = torch.tensor([0 if finite else 1, signum or 0, int(out_of_time), int(spiked)], dtype=torch.int64)
    work = None
    if group is not None and tdist.get_world_size(group) > 1:
        work = tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=group, async_op=True)
    return Agreement(flags, work, loss=loss, rule=rule)


def agree(step_loss: torch.Tensor, signum: int | None, group: Any) -> tuple[bool, int]:
    """`start_agreement(...).wait()`: (any rank's loss was non-finite, the signal any rank was asked
    to stop by, or 0), the same on every rank."""
    bad, stop, _ = start_agreement(step_loss, signum, group).wait()
    return bad, stop


# ---------------------------------------------------------------------------------------------
# Loss spikes


def mean_loss(step_loss: torch.Tensor, micro_steps: int) -> torch.Tensor:
    """The mean loss per micro-batch over every rank, on the device, the same bits on every rank:
    each rank's (loss sum, micro-steps) in float64 (a float32 loss is exact in it), gathered by every
    rank over the default process group (NCCL on GPUs: a collective on the device's stream, not a
    host sync), summed in rank order. A gather, not an all_reduce, so that the sum's order is fixed."""
    row = torch.stack(
        [step_loss.detach().reshape(()).double(), torch.full_like(step_loss, micro_steps).double()]
    )
    if tdist.is_initialized() and (world := tdist.get_world_size()) > 1:
        rows = torch.empty(world * 2, dtype=torch.float64, device=row.device)
        tdist.all_gather_into_tensor(rows, row)  # flat: gloo's takes no (world, 2) output
        rows = rows.reshape(world, 2)
    else:
        rows = row.reshape(1, 2)
    return rows[:, 0].sum() / rows[:, 1].sum()


class SpikeRule:
    """stability.spike_factor and spike_window: a step whose loss (the ranks' agreed mean, `mean_loss`)
    exceeds `factor` x the median of the last `window` accepted steps' losses is a spike, and its
    update is skipped (OptimizerSkip). The rule applies once the window is full; skipped steps never
    enter it, and a rollback restores the window of the checkpoint it goes back to (`recent` is saved
    with it).

    Kept on the device: the window is a ring of float64s there, and `judge` and `accept` are device
    ops that read nothing back, so that the rule adds no host sync to a step; how full the ring is,
    and where the next loss goes, the host counts itself. Every rank holds the same window (the
    agreed losses of the same accepted steps) and judges the same agreed loss by it: the ranks agree
    on the verdict without a collective of its own.

    The median, not the mean: a spike that stayed under the factor, or a few high losses (a hard
    stretch of data), pull a mean up and would hide the next spike behind them; the median ignores
    anything in less than half the window. Off (`factor` None), no step is a spike and no loss is
    kept."""

    def __init__(
        self,
        factor: float | None,
        window: int,
        recent: list[float] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.factor, self.window = factor, window
        self._ring = torch.zeros(window if factor is not None else 0, dtype=torch.float64, device=device)
        self._filled = self._next = 0  # losses in the ring; the slot of the next (host counts)
        self.restore(recent or [])

    @classmethod
    def of(cls, policy: StabilityConfig, device: torch.device | None = None) -> SpikeRule:
        return cls(policy.spike_factor, policy.spike_window, device=device)

    @property
    def on(self) -> bool:
        return self.factor is not None

    def judge(self, loss: torch.Tensor) -> torch.Tensor:
        """Whether a step of agreed `loss` is a spike: a bool on the device, not read back. A
        non-finite loss is not a spike: it is the step's other fault."""
        if self.factor is None or self._filled < self.window:
            return torch.zeros((), dtype=torch.bool, device=loss.device)
        return torch.isfinite(loss) & (loss > self.factor * self._median())

    def _median(self) -> torch.Tensor:
        """The median of the full window, as `statistics.median` takes it: the middle value, or the
        mean of the two middle ones."""
        ordered = torch.sort(self._ring).values
        return (ordered[(self.window - 1) // 2] + ordered[self.window // 2]) / 2

    def why(self, loss: torch.Tensor | float) -> str:
        """What the log says of a spike of agreed `loss` (host reads: said on a spike only)."""
        loss, median = float(loss), float(self._median())
        # fixed-point, as the log rows print the loss: never 1e+03, whatever the size
        times = f"{loss / median:.2f}" if median > 0 else "inf"
        return f"loss {loss:.4f} is a spike ({times} x the median of the last {self.window} steps)"

    def accept(self, loss: torch.Tensor | float | None) -> None:
        """A step of agreed `loss` was accepted (its update applied): it enters the window, on the
        device (a copy into the ring, no host read)."""
        if self.factor is None or loss is None:
            return
        self._ring[self._next] = loss
        self._next = (self._next + 1) % self.window
        self._filled = min(self._filled + 1, self.window)

    @property
    def recent(self) -> list[float]:
        """The agreed losses of the last accepted steps, oldest first (a host read: for a checkpoint)."""
        if self._filled < self.window:
            return [float(x) for x in self._ring[: self._filled].tolist()]
        return [float(x) for x in torch.roll(self._ring, -self._next).tolist()]

    def restore(self, recent: list[float]) -> None:
        """The window a checkpoint saved (its newest `window`, if the window has shrunk since)."""
        self._filled = self._next = 0
        if self.factor is None:
            return
        kept = [float(x) for x in recent][-self.window :]
        if kept:
            self._ring[: len(kept)] = torch.tensor(kept, dtype=torch.float64)
        self._filled, self._next = len(kept), len(kept) % self.window


class OptimizerSkip:
    """A spike's update not applied, bit for bit: the optimizer DeepSpeed built (`basic_optimizer`,
    the one its ZeRO, bf16 and fp16 wrappers step) gets a `step` that does nothing while `skipping`,
    so its parameters and state (moments, step counts, on the device or in DeepSpeedCPUAdam's C++)
    stay exactly as before the step. DeepSpeed's own wrappers copy the unchanged fp32 weights back to
    the model's, and zero the gradients, as after any step.

    Not DeepSpeed's overflow skip: it skips only in fp16, bf16 and ZeRO 1 to 3, and only on a
    non-finite gradient (the old way poisoned the loss with NaN, and at stage 0 in fp32, where it
    does not skip, rolled back from disk). Not a 0/1 factor on the gradients either: Adam's moments
    and step count would still move. The host knows the verdict before the step, from the
    non-finite rule's read that every step makes anyway (see start_agreement)."""

    def __init__(self, optimizer: Any) -> None:
        self._step = optimizer.step
        optimizer.step = self._maybe_step  # on the instance, as torch's LR schedulers wrap it
        self.skipping = False

    def _maybe_step(self, *args: Any, **kwargs: Any) -> Any:
        return None if self.skipping else self._step(*args, **kwargs)


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
