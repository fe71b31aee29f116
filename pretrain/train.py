"""The training loop: lr, micro-steps through the DeepSpeed engine, step, log, eval, checkpoint."""

from __future__ import annotations

import hashlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain import checkpoint, rundir
from pretrain import engine as ds_engine
from pretrain.config import ConfigError, RunConfig, check_with_deepspeed, render_deepspeed
from pretrain.corpus import DataError
from pretrain.engine import Dist
from pretrain.evaluate import evaluate, sample
from pretrain.loader import ShardedLoader
from pretrain.metrics import (
    MetricsLog,
    PhaseTimer,
    available_monitors,
    device_peak_tflops,
    gather_interval,
    summarize,
)
from pretrain.model import analytic_num_params
from pretrain.prepare import open_datasets
from pretrain.schedule import lr_at
from pretrain.tokenizer import load_tokenizer


@dataclass
class TrainResult:
    start_step: int
    final_step: int
    losses: dict[int, float]  # logged train loss by step
    val_loss: float | None
    sample: str | None
    optimizer: str  # class of the optimizer DeepSpeed built (e.g. DeepSpeedCPUAdam under offload)
    skipped_steps: list[int] = field(default_factory=list)  # steps retried after a non-finite loss
    rollbacks: list[int] = field(default_factory=list)  # the step each rollback went back to
    stopped_by: str | None = None  # the signal that stopped the run early (after a checkpoint)


def resolve_vocab(cfg: RunConfig, tokenizer_vocab: int) -> RunConfig:
    """Fill model.vocab_size from the tokenizer; a smaller explicit value would index out of range."""
    vocab = cfg.model.vocab_size
    if vocab is None:
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": tokenizer_vocab})})
    if vocab < tokenizer_vocab:
        raise ConfigError([f"model.vocab_size ({vocab}) is smaller than the tokenizer's ({tokenizer_vocab})"])
    return cfg


def train(cfg: RunConfig, dist: Dist, resume: bool | str | None = None) -> TrainResult:
    """Train `cfg` on this rank. `resume`: "auto" (or True) continues from the newest valid
    checkpoint in the run's checkpoint dir, if any; a path continues from that checkpoint."""
    datasets = open_datasets(cfg.data)  # data.blend's, or the one prepared; tokenizer checked
    data_dir, manifest = datasets[0].dir, datasets[0].manifest
    tokenizer = load_tokenizer(data_dir / "tokenizer.json", cfg.data.tokenizer_path)
    cfg = resolve_vocab(cfg, tokenizer.vocab_size)
    ds_config = available_monitors(render_deepspeed(cfg), warn=dist.is_main)
    check_with_deepspeed(ds_config)

    run_dir = cfg.run_dir()
    ckpt_dir = run_dir / cfg.checkpoint.dir
    if dist.is_main:
        rundir.record(run_dir, cfg, ds_config)
    # Checkpoints: a writable dir with room for one, and the one to resume from, before any work.
    ctrl = checkpoint.control_group()
    checkpoint.preflight(ckpt_dir, checkpoint.estimate_bytes(cfg), cfg.checkpoint.keep_last, ctrl)
    resume_from = None
    if resume:
        resume_from = checkpoint.find(
            ckpt_dir,
            "auto" if resume is True else str(resume),
            dist.world_size,
            cfg.zero.stage,
            cfg.checkpoint.checksums,
            ctrl,
            report=print if dist.is_main else lambda _: None,
        )
        if resume_from is not None:
            _check_compatible(resume_from.meta, cfg, manifest, datasets, resume_from.path, warn=dist.is_main)
        elif dist.is_main:
            print(f"no checkpoint to resume from in {ckpt_dir}: starting at step 0", flush=True)

    model = ds_engine.build_model(cfg, ds_config)
    engine = ds_engine.initialize(cfg, model, ds_config)
    # Weights come from one seed on every rank; what is random in training (dropout) must differ
    # between ranks, or every rank would drop the same units. A resume restores these generators.
    torch.manual_seed(cfg.seed + 1 + dist.rank)
    dev = engine.device
    b = cfg.batch

    def loader(split: str, grad_accum: int, shuffle: bool) -> ShardedLoader:
        return ShardedLoader(
            # train: the datasets mixed by weight; val: all their val shards, in order
            [d.shard_paths(split) for d in datasets]
            if shuffle
            else [p for d in datasets for p in d.shard_paths(split)],
            block_size=cfg.model.block_size,
            micro_batch_size=b.micro_batch_size,
            grad_accum=grad_accum,
            rank=dist.rank,
            world_size=dist.world_size,
            seed=cfg.data.seed,
            shuffle=shuffle,
            verify=cfg.data.verify_shards,
            weights=[d.weight for d in datasets] if shuffle else None,
            prefetch=cfg.data.prefetch if shuffle else 0,
        )

    train_data = loader("train", b.gradient_accumulation_steps, shuffle=True)
    val_data = loader("val", 1, shuffle=False)
    if dist.is_main:
        n_train = sum(d.n_tokens("train") for d in datasets)
        n_val = sum(d.n_tokens("val") for d in datasets)
        print(
            f"{cfg.preset}: {analytic_num_params(cfg.model) / 1e6:.2f}M params, {cfg.model.n_layer} layers, "
            f"{cfg.precision.name}, ZeRO-{cfg.zero.stage}{' + offload' if cfg.zero.offload_optimizer else ''}, "
            f"world size {dist.world_size}\n"
            f"batch {b.micro_batch_size} x {b.gradient_accumulation_steps} x {dist.world_size} = "
            f"{b.train_batch_size} sequences = {b.train_batch_size * cfg.model.block_size:,} tokens/step, "  # type: ignore[operator]
            f"{cfg.schedule.max_steps} steps\n"
            f"data {data_dir}: {n_train:,} train / {n_val:,} val tokens, vocab {tokenizer.vocab_size}\n"
            f"run dir {run_dir}",
            flush=True,
        )

    step, tokens_seen = 0, 0
    skip_batches: set[int] = set()  # batch starts (samples consumed) that made the run roll back
    if resume_from is not None:
        step, tokens_seen, skip_batches = _restore(engine, resume_from, train_data, cfg, dist)
    saved: dict[str, Any] = {
        "config": cfg.model_dump(mode="json"),
        "tokenizer_fingerprint": manifest["tokenizer"]["fingerprint"],
        "data_manifest_sha256": _manifest_sha256(datasets),
        "versions": {"packages": rundir.package_versions(), "code": rundir.code_version()}
        if dist.is_main
        else {},
        "zero_stage": cfg.zero.stage,
        "precision": cfg.precision.name,
    }
    faults = checkpoint.Faults(run_dir, b.train_batch_size)  # type: ignore[arg-type]
    stop = checkpoint.StopOnSignal().install()
    bad_streak: list[int] = []  # batch starts of the non-finite steps in a row so far
    stopping = 0  # the signal that asked the run to stop, agreed by all ranks
    skipped_steps: list[int] = []
    rollbacks: list[int] = []

    # MFU: model FLOPs per token (6N + attention) against the device's peak, known to rank 0.
    peak_tflops, peak_source = (
        device_peak_tflops(dev, cfg.precision.name, cfg.logging.peak_tflops) if dist.is_main else (None, "")
    )
    if dist.is_main:
        peak = f"{peak_tflops:.3g} TFLOP/s per rank" if peak_tflops else "unknown"
        print(f"MFU against a peak of {peak} ({peak_source})", flush=True)
    flops_per_token = engine.module.flops_per_token()
    log = MetricsLog(
        run_dir,
        cfg.schedule.max_steps,
        enabled=dist.is_main,
        monitor=engine.monitor,
        start_step=step,
        progress=cfg.logging.progress_bar,
    )
    tokens_per_step = b.train_batch_size * cfg.model.block_size  # type: ignore[operator]
    losses: dict[int, float] = {}
    val_loss: float | None = None
    loss_sum = torch.zeros((), device=dev)
    timer = PhaseTimer(dev)
    steps_since_log, t_log = 0, time.perf_counter()
    start_step = step
    while step < cfg.schedule.max_steps:
        last = step + 1 == cfg.schedule.max_steps
        log_step = (step + 1) % cfg.logging.log_interval == 0 or last
        # 1. learning rate, a pure function of the step, so a resume needs no scheduler state
        lr = lr_at(step, cfg.optimizer.lr, cfg.schedule)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        batch_start = train_data.consumed_samples
        if batch_start in skip_batches:  # it made the run roll back: move the data past it
            for _ in range(b.gradient_accumulation_steps):
                train_data.next_batch()
            if dist.is_main:
                print(
                    f"step {step + 1}: skipped the batch at sample {batch_start} (it led to a rollback)",
                    flush=True,
                )
            continue
        # 2. micro-steps; DeepSpeed reduces gradients and steps the optimizer on the last one
        grad_norm = None
        step_loss = torch.zeros((), device=dev)
        for _ in range(b.gradient_accumulation_steps):
            timer.phase("data")
            x, y = train_data.next_batch()
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            timer.phase("fwd_bwd")  # the gradient reduction happens in backward
            _, loss = engine(x, y)
            if faults.nan(batch_start, dist.rank):
                loss = loss * float("nan")  # test hook: PRETRAIN_FAULT_NAN_STEPS
            engine.backward(loss)
            step_loss += loss.detach().float()
            if log_step and cfg.zero.stage == 0 and engine.is_gradient_accumulation_boundary():
                grad_norm = _grad_norm(engine.module)  # DeepSpeed does not report it at stage 0
            timer.phase("optimizer")
            engine.step()
        timer.stop()
        # 2b. all ranks agree on a non-finite loss anywhere, and on a stop signal: one host sync a
        # step, the price of never training on a NaN. A bad step is not counted: the next batch
        # is tried for the same step (DeepSpeed skipped the update); M in a row roll back.
        bad, stopping = checkpoint.agree(step_loss, stop.signum, ctrl)
        if bad:
            bad_streak.append(batch_start)
            applied = engine.was_step_applied()  # stage 0 in fp32 applies even a NaN update
            if not applied and len(bad_streak) < cfg.checkpoint.max_bad_steps:
                skipped_steps.append(step + 1)
                if dist.is_main:
                    print(
                        f"step {step + 1}: non-finite loss, update skipped "
                        f"({len(bad_streak)} in a row, rollback at {cfg.checkpoint.max_bad_steps})",
                        flush=True,
                    )
                continue
            if len(rollbacks) >= cfg.checkpoint.max_rollbacks:
                raise checkpoint.CheckpointError(
                    f"step {step + 1}: non-finite loss again after {len(rollbacks)} rollbacks "
                    f"(checkpoint.max_rollbacks); stopping"
                )
            target = checkpoint.find(
                ckpt_dir, "auto", dist.world_size, cfg.zero.stage, cfg.checkpoint.checksums, ctrl
            )
            if target is None:
                raise checkpoint.CheckpointError(
                    f"step {step + 1}: non-finite loss {len(bad_streak)} steps in a row"
                    f"{' and the update was applied' if applied else ''}, and no checkpoint to roll back to"
                )
            skip_batches.update(bad_streak)
            bad_streak.clear()
            if dist.is_main:
                print(
                    f"step {step + 1}: rolling back to {target.path} after non-finite losses"
                    f"{' (the update was applied)' if applied else ''}; "
                    f"the batches at samples {sorted(skip_batches)} will be skipped",
                    flush=True,
                )
            step, tokens_seen, saved_skips = _restore(engine, target, train_data, cfg, dist)
            skip_batches |= saved_skips
            rollbacks.append(step)
            loss_sum.zero_()
            timer.reset()
            steps_since_log, t_log = 0, time.perf_counter()
            continue
        bad_streak.clear()
        loss_sum += step_loss
        step += 1
        steps_since_log += 1
        tokens_seen += tokens_per_step

        # 3. log: the metrics' one host sync, once per log interval (one all_gather, then .tolist())
        if log_step:
            ranks = gather_interval(loss_sum, timer, time.perf_counter() - t_log, dev)
            row, per_rank = summarize(
                ranks,
                steps=steps_since_log,
                samples_per_rank_step=b.micro_batch_size * b.gradient_accumulation_steps,
                block_size=cfg.model.block_size,
                micro_steps=b.gradient_accumulation_steps,
                flops_per_token=flops_per_token,
                peak_tflops=peak_tflops,
            )
            if grad_norm is None:
                grad_norm = engine.get_global_grad_norm()
            loss_scale = getattr(engine.optimizer, "loss_scale", None) if cfg.precision.fp16 else None
            losses[step] = row["loss"]
            samples = int(engine.global_samples)
            log.log(
                step,
                samples=samples,
                lr=lr,
                grad_norm=_float(grad_norm),
                loss_scale=_float(loss_scale),
                tokens_seen=tokens_seen,
                **row,
            )
            log.log_ranks(step, per_rank, samples=samples)
            log.progress(step, row["loss"], row["tokens_per_s"])
            loss_sum.zero_()
            timer.reset()
            steps_since_log, t_log = 0, time.perf_counter()
        else:
            log.progress(step)

        # 4. evaluate
        if step % cfg.logging.eval_interval == 0 or last:
            val_loss, val_ppl = evaluate(engine, val_data, cfg.logging.eval_batches)
            log.log(step, samples=int(engine.global_samples), val_loss=val_loss, val_ppl=val_ppl)
            t_log = time.perf_counter()

        # 5. checkpoint: every interval, at the end, and when a signal asks the run to stop
        if step % cfg.checkpoint.interval == 0 or last or stopping:
            client_state = {
                **saved,
                "step": step,
                "tokens_seen": tokens_seen,
                "loader": train_data.state_dict(),
                "val_loss": val_loss if step % cfg.logging.eval_interval == 0 or last else None,
                "skip_batches": sorted(skip_batches),
                "rng": checkpoint.gather_rng(ctrl),
            }
            tag = checkpoint.save(
                engine,
                ckpt_dir,
                step,
                client_state,
                cfg.checkpoint,
                ctrl,
                data_dir / "tokenizer.json",
                faults,
            )
            if dist.is_main:
                print(f"saved checkpoint {ckpt_dir / tag}", flush=True)
            t_log = time.perf_counter()
        if stopping:
            if dist.is_main:
                print(
                    f"stopped by {signal.Signals(stopping).name} at step {step}; resume with --resume auto",
                    flush=True,
                )
            break
        faults.after_step(step, dist.rank)

    stop.uninstall()
    text = None
    if cfg.logging.sample_tokens > 0 and not stopping:
        text = sample(engine, tokenizer, cfg.logging.sample_prompt, cfg.logging.sample_tokens, seed=cfg.seed)
        if dist.is_main:
            print(f"\n--- sample ({cfg.logging.sample_tokens} tokens) ---\n{text}\n---", flush=True)
    log.close()
    return TrainResult(
        start_step,
        step,
        losses,
        val_loss,
        text,
        type(engine.basic_optimizer).__name__,
        skipped_steps=skipped_steps,
        rollbacks=rollbacks,
        stopped_by=signal.Signals(stopping).name if stopping else None,
    )


def _grad_norm(module: torch.nn.Module) -> torch.Tensor | None:
    """Global L2 norm of the (reduced, unclipped) gradients, left on the device: no host sync here."""
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else None


def _float(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _restore(
    engine: Any, ckpt: checkpoint.Checkpoint, train_data: ShardedLoader, cfg: RunConfig, dist: Dist
) -> tuple[int, int, set[int]]:
    """Load a checkpoint into the engine, the loader and the RNGs: (step, tokens seen, skip batches)."""
    state = checkpoint.load(engine, ckpt)
    step = int(state["step"])
    train_data.load_state_dict(state["loader"])
    rng = checkpoint.restore_rng(state.get("rng"), dist.rank, dist.world_size, cfg.seed, step)
    if dist.is_main:
        how = "universal checkpoint, " if ckpt.universal else ""
        print(f"resumed from {ckpt.path} at step {step} ({how}RNG {rng})", flush=True)
    return step, int(state["tokens_seen"]), {int(s) for s in state.get("skip_batches", [])}


def _manifest_sha256(datasets: list[Any]) -> str:
    """What the run trains on: every dataset's manifest (shards with their sha256) and blend weight."""
    h = hashlib.sha256()
    for d in datasets:
        h.update((d.dir / "manifest.json").read_bytes() + f"\n{d.weight!r}\n".encode())
    return h.hexdigest()


def _check_compatible(
    state: dict[str, Any],
    cfg: RunConfig,
    manifest: dict[str, Any],
    datasets: list[Any],
    where: Path,
    warn: bool = True,
) -> None:
    """Refuse to continue a checkpoint with another architecture or tokenizer; warn on other data."""
    problems = []
    saved_model = state.get("config", {}).get("model", {})
    for key, value in cfg.model.model_dump(mode="json").items():
        if (
            key in saved_model
            and saved_model[key] != value
            and key not in ("dropout", "activation_checkpointing")
        ):
            problems.append(f"model.{key}: checkpoint has {saved_model[key]!r}, this run has {value!r}")
    if state.get("tokenizer_fingerprint") != manifest["tokenizer"]["fingerprint"]:
        problems.append("the tokenizer differs from the one the checkpoint was trained with")
    if problems:
        raise DataError(f"{where}: cannot resume:\n  - " + "\n  - ".join(problems))
    saved_data = state.get("data_manifest_sha256")
    if warn and saved_data and saved_data != _manifest_sha256(datasets):
        print(
            f"warning: {where} was trained on another prepared dataset (its manifest differs); the data "
            "order will not continue exactly",
            flush=True,
        )
