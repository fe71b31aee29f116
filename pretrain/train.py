"""The training loop: lr, micro-steps through the DeepSpeed engine, step, log, eval, checkpoint."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from pretrain import checkpoint, rundir
from pretrain import engine as ds_engine
from pretrain.config import ConfigError, RunConfig, check_with_deepspeed, render_deepspeed
from pretrain.corpus import DataError
from pretrain.engine import Dist
from pretrain.evaluate import evaluate, sample
from pretrain.loader import ShardedLoader
from pretrain.metrics import MetricsLog
from pretrain.model import analytic_num_params
from pretrain.prepare import load_manifest
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


def resolve_vocab(cfg: RunConfig, tokenizer_vocab: int) -> RunConfig:
    """Fill model.vocab_size from the tokenizer; a smaller explicit value would index out of range."""
    vocab = cfg.model.vocab_size
    if vocab is None:
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": tokenizer_vocab})})
    if vocab < tokenizer_vocab:
        raise ConfigError([f"model.vocab_size ({vocab}) is smaller than the tokenizer's ({tokenizer_vocab})"])
    return cfg


def train(cfg: RunConfig, dist: Dist, resume: bool = False) -> TrainResult:
    data_dir = cfg.data.resolved_dir()
    manifest = load_manifest(data_dir)
    tokenizer = load_tokenizer(data_dir / "tokenizer.json", cfg.data.tokenizer_path)
    cfg = resolve_vocab(cfg, tokenizer.vocab_size)
    ds_config = render_deepspeed(cfg)
    check_with_deepspeed(ds_config)

    run_dir = cfg.run_dir()
    ckpt_dir = run_dir / cfg.checkpoint.dir
    if dist.is_main:
        rundir.record(run_dir, cfg, ds_config)

    model = ds_engine.build_model(cfg, ds_config)
    engine = ds_engine.initialize(cfg, model, ds_config)
    dev = engine.device
    b = cfg.batch

    def loader(split: str, grad_accum: int, shuffle: bool) -> ShardedLoader:
        return ShardedLoader(
            [data_dir / s["path"] for s in manifest[split]],
            block_size=cfg.model.block_size,
            micro_batch_size=b.micro_batch_size,
            grad_accum=grad_accum,
            rank=dist.rank,
            world_size=dist.world_size,
            seed=cfg.data.seed,
            shuffle=shuffle,
        )

    train_data = loader("train", b.gradient_accumulation_steps, shuffle=True)
    val_data = loader("val", 1, shuffle=False)
    if dist.is_main:
        n_train = sum(s["n_tokens"] for s in manifest["train"])
        n_val = sum(s["n_tokens"] for s in manifest["val"])
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
    if resume and (tag := checkpoint.latest_tag(ckpt_dir)) is not None:
        _check_compatible(checkpoint.read_meta(ckpt_dir, tag), cfg, manifest, ckpt_dir / tag)
        state = checkpoint.load(engine, ckpt_dir, tag)
        step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
        train_data.load_state_dict(state["loader"])
        if dist.is_main:
            print(f"resumed from {ckpt_dir / tag} at step {step}", flush=True)

    log = MetricsLog(run_dir, cfg.schedule.max_steps, enabled=dist.is_main)
    tokens_per_step = b.train_batch_size * cfg.model.block_size  # type: ignore[operator]
    losses: dict[int, float] = {}
    val_loss: float | None = None
    loss_sum = torch.zeros((), device=dev)
    steps_since_log, t_log = 0, time.perf_counter()
    start_step = step
    while step < cfg.schedule.max_steps:
        # 1. learning rate, a pure function of the step, so a resume needs no scheduler state
        lr = lr_at(step, cfg.optimizer.lr, cfg.schedule)
        for group in engine.optimizer.param_groups:
            group["lr"] = lr
        # 2. micro-steps; DeepSpeed reduces gradients and steps the optimizer on the last one
        grad_norm = None
        for _ in range(b.gradient_accumulation_steps):
            x, y = train_data.next_batch()
            _, loss = engine(x.to(dev, non_blocking=True), y.to(dev, non_blocking=True))
            engine.backward(loss)
            if cfg.zero.stage == 0 and engine.is_gradient_accumulation_boundary():
                grad_norm = _grad_norm(engine.module)  # DeepSpeed does not report it at stage 0
            engine.step()
            loss_sum += loss.detach().float()
        step += 1
        steps_since_log += 1
        tokens_seen += tokens_per_step

        # 3. log: the only per-interval host sync (loss all-reduce + .item())
        last = step == cfg.schedule.max_steps
        if step % cfg.logging.log_interval == 0 or last:
            tdist.all_reduce(loss_sum)
            mean_loss = loss_sum.item() / (steps_since_log * b.gradient_accumulation_steps * dist.world_size)
            if grad_norm is None:
                grad_norm = engine.get_global_grad_norm()
            dt = (time.perf_counter() - t_log) / steps_since_log
            losses[step] = mean_loss
            log.log(
                step,
                loss=mean_loss,
                lr=lr,
                grad_norm=_float(grad_norm),
                tokens_per_s=tokens_per_step / dt,
                step_time_s=dt,
                tokens_seen=tokens_seen,
            )
            loss_sum.zero_()
            steps_since_log, t_log = 0, time.perf_counter()

        # 4. evaluate
        if step % cfg.logging.eval_interval == 0 or last:
            val_loss, val_ppl = evaluate(engine, val_data, cfg.logging.eval_batches)
            log.log(step, val_loss=val_loss, val_ppl=val_ppl)
            t_log = time.perf_counter()

        # 5. checkpoint
        if step % cfg.checkpoint.interval == 0 or last:
            client_state = {
                "step": step,
                "tokens_seen": tokens_seen,
                "loader": train_data.state_dict(),
                "config": cfg.model_dump(mode="json"),
                "tokenizer_fingerprint": manifest["tokenizer"]["fingerprint"],
            }
            tag = checkpoint.save(engine, ckpt_dir, step, client_state, cfg.checkpoint.keep_last)
            if dist.is_main:
                print(f"saved checkpoint {ckpt_dir / tag}", flush=True)
            t_log = time.perf_counter()

    text = None
    if cfg.logging.sample_tokens > 0:
        text = sample(engine, tokenizer, cfg.logging.sample_prompt, cfg.logging.sample_tokens, seed=cfg.seed)
        if dist.is_main:
            print(f"\n--- sample ({cfg.logging.sample_tokens} tokens) ---\n{text}\n---", flush=True)
    log.close()
    return TrainResult(start_step, step, losses, val_loss, text, type(engine.basic_optimizer).__name__)


def _grad_norm(module: torch.nn.Module) -> float:
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)).item() if norms else 0.0


def _float(x: Any) -> float | None:
    if x is None:
        return None
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _check_compatible(state: dict[str, Any], cfg: RunConfig, manifest: dict[str, Any], where: Path) -> None:
    """Refuse to continue a checkpoint with another architecture or tokenizer."""
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
