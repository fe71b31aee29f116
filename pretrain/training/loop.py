"""The training loop: lr, micro-steps through the DeepSpeed engine, step, log, eval, checkpoint.

`train()` reads top to bottom in paper order; `setup()` (run.py) does everything before the first step,
`train_step()` is one optimizer step's micro-steps, `_on_bad_step()` skips or rolls back after a
non-finite loss or a loss spike.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pretrain.cluster.hardware import cpu_native_bf16, device_peak_tflops
from pretrain.config.tree import RunConfig, analytic_flops_per_token
from pretrain.data.dataset import TOKENIZER_FILE
from pretrain.errors import CheckpointError
from pretrain.training.checkpoint import store as checkpoint
from pretrain.training.checkpoint.resume import Checkpoint
from pretrain.training.checkpoint.resume import find as find_checkpoint
from pretrain.training.checkpoint.resume import load as load_checkpoint
from pretrain.training.distributed import engine as ds_engine
from pretrain.training.distributed.ranks import Dist, gather
from pretrain.training.evaluate import evaluate, sample
from pretrain.training.faults import Faults
from pretrain.training.guards import Agreement, OptimizerSkip, Sentinel, SpikeRule, mean_loss, start_agreement
from pretrain.training.metrics import (
    MetricsLog,
    PhaseTimer,
    gather_interval,
    quiet_monitor,
    seconds_since_process_start,
    summarize,
)
from pretrain.training.run import Run, setup
from pretrain.training.schedule import lr_at


@dataclass(kw_only=True)
class TrainResult:
    start_step: int
    final_step: int
    losses: dict[int, float]  # logged train loss by step
    val_loss: float | None
    sample: str | None
    optimizer: str  # class of the optimizer DeepSpeed built (e.g. DeepSpeedCPUAdam under offload)
    skipped_steps: list[int] = field(default_factory=list)  # steps retried after a non-finite loss or spike
    rollbacks: list[int] = field(default_factory=list)  # the step each rollback went back to
    stopped_by: str | None = None  # the signal that stopped the run early (after a checkpoint)
    ended_by: str = "max_steps"  # what ended it: max_steps, max_tokens, max_hours, or the signal


@dataclass
class Progress:
    """Where the run is: what a checkpoint restores, and what it has skipped."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_hours: float = 0.0  # hours of training up to the checkpoint restored (see Clock)
    skip_batches: set[int] = field(default_factory=set)  # batch starts that made the run roll back
    bad_streak: list[int] = field(default_factory=list)  # batch starts of the bad steps in a row
    skipped_steps: list[int] = field(default_factory=list)
    rollbacks: list[int] = field(default_factory=list)
    # The log window a checkpoint was saved in the middle of: its steps, the micro-steps of each, and
    # every rank's loss sum over them.
    loss_window: tuple[int, int, list[float]] = (0, 1, [])
    # stability.spike_factor's rule and the accepted steps' losses it judges by (saved, restored)
    spikes: SpikeRule = field(default_factory=lambda: SpikeRule(None, 1))
    skip: OptimizerSkip | None = None  # how a spike's update is skipped (the rule on, no pipeline)

    def advance(self, tokens: int, loss: torch.Tensor | None = None) -> int:
        """One more step done, on `tokens` tokens, of agreed mean `loss` on the device (None: the
        spike rule is off); it ends a streak of bad steps. Returns the steps done."""
        self.bad_streak.clear()
        self.spikes.accept(loss)
        self.step += 1
        self.tokens_seen += tokens
        return self.step


class Interval:
    """What accumulates between two log steps: the loss on the device (no host sync until the log
    step), phase times, steps and wall time."""

    def __init__(self, dev: torch.device) -> None:
        self.loss_sum = torch.zeros((), device=dev)
        self.timer = PhaseTimer(dev)
        self.reset()

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.timer.reset()
        self.steps, self.t0 = 0, time.perf_counter()
        self.loss_steps = 0  # the steps the loss is a mean over: these, and those a resume carried in

    def add(self, step_loss: torch.Tensor) -> None:
        """One more step, with its summed loss (still on the device)."""
        self.loss_sum += step_loss
        self.steps += 1
        self.loss_steps += 1

    def carry_in(self, window: tuple[int, int, list[float]], rank: int, world_size: int, micro: int) -> None:
        """Start with the steps of the log window a resumed checkpoint was saved in the middle of, so
        that the first logged loss is the mean over the same steps as in an uninterrupted run: this
        rank's own sum (bit for bit) on the same layout, else an equal share of their mean."""
        steps, was_micro, sums = window
        if not steps or not sums:
            return
        same = len(sums) == world_size and was_micro == micro
        self.loss_sum.fill_(sums[rank] if same else sum(sums) / len(sums) / was_micro * micro)
        self.loss_steps = steps

    def restart_clock(self) -> None:
        """Leave what just ran (an evaluation, a checkpoint save) out of the interval's throughput."""
        self.t0 = time.perf_counter()


class Clock:
    """The run's hours of training, against schedule.max_hours: those up to the checkpoint it
    resumed from, plus the wall time since this process reached its first step (its evaluations and
    saves included; its start-up, the engine build and the checkpoint load, not)."""

    def __init__(self, hours_before: float) -> None:
        self.before, self.t0 = hours_before, time.monotonic()

    def hours(self) -> float:
        return self.before + (time.monotonic() - self.t0) / 3600

    def spent(self, limit: float | None) -> bool:
        return limit is not None and self.hours() >= limit


def train(cfg: RunConfig, dist: Dist, resume: bool | str | None = None) -> TrainResult:
    """Train `cfg` on this rank. `resume`: "auto" (or True) continues from the newest valid
    checkpoint in the run's checkpoint dir, if any; a path continues from that checkpoint."""
    run = setup(cfg, dist, resume)
    cfg, max_hours = run.cfg, run.cfg.schedule.max_hours
    progress = _start(run)
    start_step = progress.step
    end = _end_step(run, progress)  # max_steps, or the step at which the tokens seen reach max_tokens
    with Sentinel(cfg, dist, start_step) as sentinel:  # watchdog, stop signal, faults
        run_state = checkpoint.run_state(cfg, run.datasets, dist.is_main)
        saver = checkpoint.Saver(run.ctrl, asynchronous=cfg.checkpoint.async_save)
        # peak: the device's TFLOP/s per rank, for the MFU
        log, peak = _open_log(run, start_step, end, elapsed_before=progress.elapsed_hours * 3600)
        interval = Interval(run.engine.device)
        interval.carry_in(
            progress.loss_window, dist.rank, dist.world_size, cfg.batch.gradient_accumulation_steps
        )
        timer, faults = interval.timer, sentinel.faults
        losses: dict[int, float] = {}
        val_loss: float | None = None
        stop_requested = 0  # the signal that asked the run to stop, agreed by all ranks
        # Hours of training: the checkpoint's (every rank reads the same one), then this process's.
        clock = Clock(max(gather(progress.elapsed_hours, run.ctrl)))
        out_of_time = _spent_at_start(run, progress, clock, end)
        while progress.step < end and not out_of_time:
            step = progress.step  # the steps done; this one is step + 1
            log_due = cfg.logging.log_due(step + 1, end)
            # 1. learning rate, a pure function of the step, so a resume needs no scheduler state
            lr = _set_lr(run, step)
            batch_start = run.train_data.consumed_samples
            if batch_start in progress.skip_batches:  # it made the run roll back: move the data past it
                _skip_batch(run, step, batch_start)
                continue
            # 2. micro-steps; DeepSpeed reduces gradients and steps the optimizer on the last one
            step_loss, grad_norm, verdict = train_step(
                run,
                timer,
                faults,
                batch_start=batch_start,
                want_grad_norm=log_due,
                signum=sentinel.signum,
                out_of_time=clock.spent(max_hours),
                spikes=progress.spikes if progress.spikes.on else None,
                skip=progress.skip,
            )
            # 2b. all ranks agree on a non-finite loss anywhere, a stop signal and the clock passing
            # schedule.max_hours: one host read of the loss a step, the price of never training on a NaN
            # (the collective went off before the last backward; the spike rule's verdict, judged on the
            # device, came in the same read). A bad step (a loss spike too) is not counted: the next
            # batch is tried for it; M in a row roll back. Time up ends the run after this step.
            bad, stop_requested, out_of_time = verdict.wait()
            if bad or verdict.spike:
                out_of_time = False  # asked again after the retried step, which saves
                saver.wait()  # a rollback picks among committed checkpoints
                if _on_bad_step(
                    run,
                    progress,
                    sentinel,
                    batch_start=batch_start,
                    spike=verdict.spike,
                    skipped=verdict.skipped,
                ):
                    interval.reset()
                continue
            if step == start_step:
                _log_first_step(dist)
            interval.add(step_loss)
            step = progress.advance(run.tokens_per_step, verdict.loss)
            # 3. log: the metrics' one host sync, once per log interval (one all_gather, then .tolist())
            if log_due:
                losses[step] = _log(run, log, interval, progress, lr=lr, grad_norm=grad_norm, peak=peak)
                interval.reset()
            else:
                log.progress(step)
            # 4. evaluate
            if evaluated := cfg.logging.eval_due(step, end):
                val_loss = _evaluate(run, log, sentinel, step=step)
                interval.restart_clock()
            # 5. checkpoint: every interval, at the end, and when a signal or max_hours stops the run
            if cfg.checkpoint.due(step, end, stop_requested=bool(stop_requested) or out_of_time):
                val = val_loss if evaluated else None
                last = step >= end or bool(stop_requested) or out_of_time  # the run ends: wait for it
                _save(
                    run,
                    progress,
                    run_state,
                    sentinel,
                    interval,
                    saver,
                    val_loss=val,
                    hours=clock.hours(),
                    last=last,
                )
                interval.restart_clock()
            if stop_requested:  # saved on every rank just above
                break
            sentinel.tick(step)
        saver.wait()  # the end of the run: nothing is left in flight
    return _finish(
        run,
        log,
        progress,
        start_step=start_step,
        losses=losses,
        val_loss=val_loss,
        signum=stop_requested,
        ended_by=_ended_by(run, progress, stop_requested, out_of_time),
    )


StepResult = tuple[torch.Tensor, torch.Tensor | None, Agreement]


def train_step(
    run: Run,
    timer: PhaseTimer,
    faults: Faults,
    *,
    batch_start: int,
    want_grad_norm: bool,
    signum: int | None = None,
    out_of_time: bool = False,
    spikes: SpikeRule | None = None,
    skip: OptimizerSkip | None = None,
) -> StepResult:
    """One optimizer step: forward and backward on each micro batch, DeepSpeed stepping on the
    last. Returns the summed loss and the gradient norm (every step where the loop clips at stage 0;
    at other stage-0 runs when asked; else None), both left on the device, and the ranks' agreement
    on a non-finite loss, a stop signal (`signum`) or the time being up (`out_of_time`), started
    after the last forward. With the spike rule (`spikes`), the ranks' mean loss is judged on the
    device after the last forward, and a spike's update is not applied (`skip`; `Agreement.spike`
    says why). A pipeline's step is `pipeline_step`'s."""
    if run.pipelined:
        return pipeline_step(run, timer, faults, batch_start, want_grad_norm, signum, out_of_time, spikes)
    engine, dev, cfg = run.engine, run.engine.device, run.cfg
    grad_norm = None
    step_loss = torch.zeros((), device=dev)
    verdict: Agreement | None = None
    micro_steps = cfg.batch.gradient_accumulation_steps
    for i in range(micro_steps):
        timer.phase("data")
        x, y = run.train_data.next_batch()
        x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        timer.phase("fwd_bwd")  # the gradient reduction happens in backward
        _, loss = engine(x, y)
        if (factor := faults.loss_factor(batch_start, run.dist.rank)) is not None:
            loss = loss * factor  # test hooks: PRETRAIN_FAULT_NAN_STEPS, PRETRAIN_FAULT_SPIKE_STEPS
        step_loss += loss.detach().float()
        if i == micro_steps - 1:
            agreed = mean_loss(step_loss, micro_steps) if spikes is not None else None
            verdict = start_agreement(step_loss, signum, run.ctrl, out_of_time, loss=agreed, rule=spikes)
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary():
            if ds_engine.clips_itself(cfg, run.layout):
                # Stage 0 in fp32: one foreach pass clips the (already reduced) gradients and gives
                # the norm, with no all_reduce of a norm every rank already has (DeepSpeed's way).
                grad_norm = torch.nn.utils.clip_grad_norm_(run.params, cfg.optimizer.grad_clip, foreach=True)
            elif want_grad_norm and run.layout.zero_stage == 0:
                grad_norm = _grad_norm(
                    engine.module, tensor=run.layout.tensor_parallel
                )  # DeepSpeed reports none
        timer.phase("optimizer")
        if verdict is not None and verdict.spiked and skip is not None:
            # every rank judged the same loss by the same window: all of them skip the update
            skip.skipping = verdict.skipped = True
        try:
            engine.step()
        finally:
            if skip is not None:
                skip.skipping = False
    timer.stop()
    assert verdict is not None
    return step_loss, grad_norm, verdict


def pipeline_step(
    run: Run,
    timer: PhaseTimer,
    faults: Faults,
    batch_start: int,
    want_grad_norm: bool,
    signum: int | None,
    out_of_time: bool = False,
    spikes: SpikeRule | None = None,
) -> StepResult:
    """One optimizer step through DeepSpeed's pipeline engine, which runs the micro-batches itself
    (`train_batch`: its 1F1B schedule over the stages, the reductions, the optimizer step). Returns
    what `train_step` does; the agreement starts after the step, whose loss only the engine knows, so
    a spike's update has been applied: the loop rolls back, as after an applied NaN update."""
    engine, micro_steps = run.engine, run.cfg.batch.gradient_accumulation_steps
    timer.phase("data")
    # Every stage reads the step's micro-batches (the first uses the inputs, the last the labels), so
    # that every rank's loader stands at the same position, the one a checkpoint records.
    batches = [run.train_data.next_batch() for _ in range(micro_steps)]
    # Test hook (PRETRAIN_FAULT_NAN_STEPS): the loss of the first data-parallel rank, on the last
    # stage, where the loss is computed.
    first = engine.is_last_stage() and engine.grid.get_data_parallel_rank() == 0
    engine.module.loss_fn.poison = first and faults.nan(batch_start, 0)
    timer.phase("fwd_bwd")
    mean_loss = engine.train_batch(iter(batches))  # the mean over the micro-batches, on every stage
    step_loss = mean_loss.detach().float().reshape(()) * micro_steps
    if faults.spike(batch_start, run.dist.rank):
        step_loss = step_loss * faults.SPIKE  # test hook: PRETRAIN_FAULT_SPIKE_STEPS (the loss only)
    agreed = mean_loss(step_loss, micro_steps) if spikes is not None else None
    verdict = start_agreement(step_loss, signum, run.ctrl, out_of_time, loss=agreed, rule=spikes)
    timer.stop()
    return step_loss, engine.get_global_grad_norm() if want_grad_norm else None, verdict


BF16_PAYS_FROM = 384  # n_embd from which bf16 trains faster than fp32 on a CPU with bf16 matmuls


def _end_step(run: Run, progress: Progress) -> int:
    """The step the run ends at: schedule.max_steps, or the first step at which the tokens seen reach
    schedule.max_tokens, counted from where `progress` stands (a resume that changed the global
    batch still ends at the token budget)."""
    s = run.cfg.schedule
    if s.max_tokens is None:
        return s.max_steps
    left = max(0, s.max_tokens - progress.tokens_seen)
    return min(s.max_steps, progress.step + -(-left // run.tokens_per_step))


def _spent_at_start(run: Run, progress: Progress, clock: Clock, end: int) -> bool:
    """Whether schedule.max_hours was spent before this resume, decided on the checkpoint's hours,
    which every rank has agreed on (this process's own clock is each rank's, and the ranks agree on it
    in the step). Says so, or that the step budget is spent."""
    max_hours = run.cfg.schedule.max_hours
    if max_hours is not None and clock.before >= max_hours and progress.step < end:
        run.dist.log(
            f"schedule.max_hours ({max_hours:g}) is spent: the run has trained {clock.before:.4g} h up to "
            f"step {progress.step}; raise schedule.max_hours to train on"
        )
        return True
    if progress.step >= end:
        run.dist.log(_nothing_to_train(run, progress))
    return False


def _nothing_to_train(run: Run, progress: Progress) -> str:
    """What a resume whose budget is already spent says (it ran, logged nothing and exited 0)."""
    s = run.cfg.schedule
    if s.max_tokens is not None and progress.tokens_seen >= s.max_tokens:
        spent = f"schedule.max_tokens ({s.max_tokens:,}): {progress.tokens_seen:,} tokens seen"
        fix = "schedule.max_tokens"
    else:
        spent, fix = f"schedule.max_steps ({s.max_steps})", "schedule.max_steps"
    return f"nothing to train: the run resumed at step {progress.step}, which reaches {spent}; raise {fix} to train on"


def _ended_by(run: Run, progress: Progress, signum: int, out_of_time: bool) -> str:
    """What ended the run: the signal, max_hours, max_tokens or max_steps."""
    max_tokens = run.cfg.schedule.max_tokens
    if signum:
        return signal.Signals(signum).name
    if out_of_time:
        return "max_hours"
    return "max_tokens" if max_tokens is not None and progress.tokens_seen >= max_tokens else "max_steps"


def _start(run: Run) -> Progress:
    """Where the run starts: step 0, or the checkpoint it resumes from."""
    progress = Progress(spikes=SpikeRule.of(run.cfg.stability, run.engine.device))
    if progress.spikes.on and not run.pipelined:  # a pipeline's step is inside train_batch: it rolls back
        progress.skip = OptimizerSkip(run.engine.basic_optimizer)
    if run.resume_from is not None:
        _restore(run, run.resume_from, progress)
    return progress


def _open_log(
    run: Run, start_step: int, end: int, *, elapsed_before: float
) -> tuple[MetricsLog, float | None]:
    """The metrics log, and the device peak (TFLOP/s per rank) that MFU is measured against: model
    FLOPs per token (6N + attention) against the device's peak, known to rank 0."""
    cfg, dist, engine = run.cfg, run.dist, run.engine
    peak_tflops, peak_source = (
        device_peak_tflops(engine.device, cfg.precision.name, cfg.logging.peak_tflops)
        if dist.is_main
        else (None, "")
    )
    dist.log(
        f"MFU against a peak of {f'{peak_tflops:.3g} TFLOP/s per rank' if peak_tflops else 'unknown'} ({peak_source})"
    )
    # Only where it was measured to pay: at n_embd 384 (the medium preset) bf16 ran 1.6x fp32 on a
    # Zen 4 CPU; at n_embd 128 it did not (0.99x; 94 s against 71 on an AMX CPU), its matrices too
    # small for the bf16 optimizer's per-parameter work to pay off.
    bf16_pays = cfg.model.n_embd >= BF16_PAYS_FROM
    if (
        engine.device.type == "cpu"
        and cfg.precision.name == "fp32"
        and bf16_pays
        and (isa := cpu_native_bf16())
    ):
        dist.log(
            f"this CPU multiplies bf16 natively ({isa}): at n_embd {cfg.model.n_embd}, --set precision.bf16=true "
            "trains faster (1.6x for the medium preset, n_embd 384, on a Zen 4 CPU; no faster at n_embd 128; "
            "see docs/speed.md)"
        )
    log = MetricsLog(
        cfg.run_dir(),
        end,
        enabled=dist.is_main,
        monitor=quiet_monitor(engine),
        start_step=start_step,
        progress=cfg.logging.progress_bar,
        elapsed_before=elapsed_before,
    )
    log.note_mix(start_step, cfg.data.blend, run.train_data.mix())  # a blend's mix, where the data stands
    return log, peak_tflops


def _set_lr(run: Run, step: int) -> float:
    """Set the LR of step `step` (0-based) on every parameter group; returns it."""
    lr = lr_at(step, run.cfg.optimizer.lr, run.cfg.schedule, run.cfg.total_steps)
    for group in run.engine.optimizer.param_groups:
        group["lr"] = lr
    return lr


def _skip_batch(run: Run, step: int, batch_start: int) -> None:
    """Move the data past the global batch at `batch_start`, one that made the run roll back."""
    for _ in range(run.cfg.batch.gradient_accumulation_steps):
        run.train_data.next_batch()
    run.dist.log(f"step {step + 1}: skipped the batch at sample {batch_start} (it led to a rollback)")


def _log_first_step(dist: Dist) -> None:
    since = seconds_since_process_start()
    dist.log(
        f"first step done {since:.1f} s after the command started" if since is not None else "first step done"
    )


def _evaluate(run: Run, log: MetricsLog, sentinel: Sentinel, *, step: int) -> float:
    """Evaluate after `step` and log the val loss and perplexity; returns the val loss."""
    sentinel.expect("the evaluation", step)
    val_loss, val_ppl = evaluate(
        run.engine, run.val_data, run.cfg.logging.eval_batches, pipelined=run.pipelined
    )
    log.log(step, val_loss=val_loss, val_ppl=val_ppl)
    return val_loss


def _save(
    run: Run,
    progress: Progress,
    run_state: dict[str, Any],
    sentinel: Sentinel,
    interval: Interval,
    saver: checkpoint.Saver,
    *,
    val_loss: float | None,
    hours: float,
    last: bool,
) -> None:
    """Save the checkpoint of `progress.step` on every rank; `val_loss`: evaluated at this step;
    `hours`: of training so far, over every resume. Between two log steps, every rank's loss sum so
    far goes with it (one gather), for the resume. In the background with checkpoint.async_save,
    unless `last` (the run ends after it): then it waits for the save in flight and for itself."""
    sentinel.expect("the checkpoint save", progress.step)
    if saver.busy:
        run.dist.log(f"step {progress.step}: waiting for the checkpoint save in flight")
    micro = run.cfg.batch.gradient_accumulation_steps
    window = (
        interval.loss_steps,
        micro,
        gather(float(interval.loss_sum), run.ctrl) if interval.loss_steps else [],
    )
    state = checkpoint.client_state(
        run_state,
        step=progress.step,
        tokens_seen=progress.tokens_seen,
        elapsed_hours=hours,
        loader=run.train_data.state_dict(),
        val_loss=val_loss,
        skip_batches=progress.skip_batches,
        loss_window=window,
        recent_losses=progress.spikes.recent,
        group=run.ctrl,
    )
    tag = checkpoint.save(
        run.engine,
        run.ckpt_dir,
        state,
        step=progress.step,
        policy=run.cfg.checkpoint,
        group=run.ctrl,
        tokenizer_file=run.datasets[0].dir / TOKENIZER_FILE,
        faults=sentinel.faults,
        saver=saver,
        wait=last or saver.background is None,
        report=run.dist.log,
    )
    if last or saver.background is None:
        run.dist.log(f"saved checkpoint {run.ckpt_dir / tag}")
    else:
        run.dist.log(f"saving checkpoint {run.ckpt_dir / tag} in the background")


def _finish(
    run: Run,
    log: MetricsLog,
    progress: Progress,
    *,
    start_step: int,
    losses: dict[int, float],
    val_loss: float | None,
    signum: int,
    ended_by: str,
) -> TrainResult:
    """The end of the run: the stop by signal `signum` (0: none) or by schedule.max_hours, or the
    final sample (logging.sample_tokens); then the result."""
    cfg, dist = run.cfg.logging, run.dist
    stopped_by = signal.Signals(signum).name if signum else None
    text = None
    if stopped_by:
        dist.log(f"stopped by {stopped_by} at step {progress.step}; resume with --resume auto")
    elif ended_by == "max_hours":
        dist.log(
            f"stopped by schedule.max_hours ({run.cfg.schedule.max_hours:g}) at step {progress.step}; to train "
            "on, resume with --resume auto and a larger schedule.max_hours"
        )
    elif progress.step == start_step:
        pass  # nothing trained (a spent budget, said at start): no sample of what was there
    elif cfg.sample_tokens > 0 and run.pipelined:
        dist.log(
            "no final sample from a pipeline (each stage holds part of the model): pretrain sample RUN_DIR"
        )
    elif cfg.sample_tokens > 0:
        text = sample(
            run.engine, run.tokenizer, cfg.sample_prompt, max_new_tokens=cfg.sample_tokens, seed=run.cfg.seed
        )
        dist.log(f"\n--- sample ({cfg.sample_tokens} tokens) ---\n{text}\n---")
    log.close()
    return TrainResult(
        start_step=start_step,
        final_step=progress.step,
        losses=losses,
        val_loss=val_loss,
        sample=text,
        optimizer=type(run.engine.basic_optimizer).__name__,
        skipped_steps=progress.skipped_steps,
        rollbacks=progress.rollbacks,
        stopped_by=stopped_by,
        ended_by=ended_by,
    )


def _log(
    run: Run,
    log: MetricsLog,
    interval: Interval,
    progress: Progress,
    *,
    lr: float,
    grad_norm: torch.Tensor | None,
    peak: float | None,
) -> float:
    """A log step: every rank's interval in one all_gather, one row; returns the train loss. `peak`:
    the device's TFLOP/s per rank that MFU is measured against (None: unknown, or not rank 0)."""
    cfg, engine, b = run.cfg, run.engine, run.cfg.batch
    ranks = gather_interval(
        interval.loss_sum, interval.timer, time.perf_counter() - interval.t0, engine.device
    )
    row, per_rank = summarize(
        ranks,
        steps=interval.steps,
        loss_steps=interval.loss_steps,
        samples_per_rank_step=b.micro_batch_size * b.gradient_accumulation_steps,
        block_size=cfg.model.block_size,
        micro_steps=b.gradient_accumulation_steps,
        data_parallel=b.data_parallel_size,
        flops_per_token=analytic_flops_per_token(cfg.model),
        peak_tflops=peak,
    )
    norm = grad_norm if grad_norm is not None else engine.get_global_grad_norm()
    loss_scale = getattr(engine.optimizer, "loss_scale", None) if cfg.precision.fp16 else None
    values = dict(
        lr=lr, grad_norm=_float(norm), loss_scale=_float(loss_scale), tokens_seen=progress.tokens_seen
    )
    log.log(progress.step, **values, **row)
    log.note_mix(progress.step, cfg.data.blend, run.train_data.mix())  # a line if a scheduled mix moved
    log.log_ranks(progress.step, per_rank)
    log.progress(progress.step, row["loss"], row["tokens_per_s"])
    return float(row["loss"])


def _on_bad_step(
    run: Run,
    progress: Progress,
    sentinel: Sentinel,
    *,
    batch_start: int,
    spike: str | None = None,
    skipped: bool = False,
) -> bool:
    """After a non-finite loss or a loss spike (`spike`: why it is one; `skipped`: its update was
    skipped by OptimizerSkip): skip the step (the update was not applied) or, after
    stability.max_bad_steps in a row or an applied update, roll back to the newest checkpoint and skip
    the batches that led there. Returns True if it rolled back."""
    sentinel.expect("the retry after a bad step (or its rollback)", progress.step)
    dist, policy = run.dist, run.cfg.stability
    kind, why = ("loss spike", spike) if spike else ("non-finite loss", "non-finite loss")
    progress.bad_streak.append(batch_start)
    # stage 0 in fp32 applies even a NaN update, and a pipeline has applied a spike's before it is known
    applied = run.engine.was_step_applied() and not skipped
    streak = len(progress.bad_streak)
    if not applied and streak < policy.max_bad_steps:
        progress.skipped_steps.append(progress.step + 1)
        dist.log(
            f"step {progress.step + 1}: {why}, update skipped ({streak} in a row, rollback at {policy.max_bad_steps})"
        )
        return False
    if len(progress.rollbacks) >= policy.max_rollbacks:
        raise CheckpointError(
            f"step {progress.step + 1}: {kind} again after {len(progress.rollbacks)} rollbacks "
            f"(stability.max_rollbacks), stopping: resume with a larger stability.max_rollbacks"
            f"{' or spike_factor' if spike else ''}, or a lower optimizer.lr"
        )
    target = find_checkpoint(
        run.ckpt_dir,
        "auto",
        layout=run.layout,
        checksums=run.cfg.checkpoint.checksums,
        group=run.ctrl,
    )
    if target is None:
        raise CheckpointError(
            f"step {progress.step + 1}: {kind} {streak} steps in a row"
            f"{' and the update was applied' if applied else ''}, and no checkpoint to roll back to: save one "
            f"before this step (a smaller checkpoint.interval){' or raise stability.spike_factor' if spike else ''}"
        )
    progress.skip_batches.update(progress.bad_streak)
    progress.bad_streak.clear()
    dist.log(
        f"step {progress.step + 1}: {why}{', the update applied' if applied else f' ({streak} in a row)'}: "
        f"rolling back to {target.path}, the batches at samples {sorted(progress.skip_batches)} will be skipped"
    )
    _restore(run, target, progress)
    progress.rollbacks.append(progress.step)
    return True


def _restore(run: Run, ckpt: Checkpoint, progress: Progress) -> None:
    """Load a checkpoint into the engine, the loader, the RNGs and `progress`."""
    dist = run.dist
    state = load_checkpoint(run.engine, ckpt)
    progress.step = int(state["step"])
    progress.tokens_seen = int(state["tokens_seen"])
    progress.elapsed_hours = float(state.get("elapsed_hours", 0.0))  # none in older checkpoints
    progress.skip_batches |= {int(s) for s in state.get("skip_batches", [])}
    progress.spikes.restore(state.get("recent_losses", []))  # the spike rule's window, as it was
    window = state.get("loss_window") or {}  # none in a checkpoint saved before it was kept
    progress.loss_window = (
        int(window.get("steps", 0)),
        int(window.get("micro_steps", 1)),
        [float(x) for x in window.get("loss_sums", [])],
    )
    run.train_data.load_state_dict(state["loader"])
    rng = checkpoint.restore_rng(
        state.get("rng"), rank=dist.rank, world_size=dist.world_size, seed=run.cfg.seed, step=progress.step
    )
    how = "universal checkpoint, " if ckpt.universal else ""
    dist.log(f"resumed from {ckpt.path} at step {progress.step} ({how}RNG {rng})")


def _grad_norm(module: torch.nn.Module, *, tensor: bool = False) -> torch.Tensor | None:
    """Global L2 norm of the (reduced, unclipped) gradients, left on the device: no host sync here.
    With tensor parallelism (`tensor`) a split parameter's gradient is a shard: their squares are
    summed over the tensor-parallel group (one all_reduce), the whole ones counted once."""
    if not tensor:
        norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else None
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils import groups

    whole: list[torch.Tensor] = []
    split: list[torch.Tensor] = []
    for p in module.parameters():
        if p.grad is not None:
            (split if is_model_parallel_parameter(p) else whole).append(p.grad.detach().float().pow(2).sum())
    dev = next(module.parameters()).device
    total, shards = (torch.stack(xs).sum() if xs else torch.zeros((), device=dev) for xs in (whole, split))
    torch.distributed.all_reduce(shards, group=groups.get_tensor_model_parallel_group())
    return (total + shards).sqrt()


def _float(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)
