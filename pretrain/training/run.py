"""What a run holds before its first step, and `setup()`, which builds it in the order that fails
fastest: the data and its tokenizer, the DeepSpeed config, the run dir, the checkpoint to resume
from, the engine and the loaders. The loop (loop.py) takes it from there.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pretrain.config.ds_render import check_with_deepspeed, render_deepspeed
from pretrain.config.layout import Layout, layout_of
from pretrain.config.presets import PRESETS
from pretrain.config.tree import ModelConfig, RunConfig, analytic_num_params
from pretrain.data.dataset import TOKENIZER_FILE, Dataset, open_datasets, resolve_vocab
from pretrain.data.loader import ShardedLoader
from pretrain.data.staging import stage_datasets
from pretrain.data.tokenizer import Tokenizer, load_tokenizer
from pretrain.errors import CheckpointError, ConfigError, DataError, OutputError
from pretrain.training import rundir
from pretrain.training.checkpoint import store as checkpoint
from pretrain.training.checkpoint.resume import Checkpoint, check_compatible, place_resume
from pretrain.training.checkpoint.resume import find as find_checkpoint
from pretrain.training.distributed import engine as ds_engine
from pretrain.training.distributed.ranks import Dist, control_group, gather, rank_0_acts, set_roster
from pretrain.training.metrics import available_monitors, start_wandb
from pretrain.training.model import init_from


@dataclass
class Run:
    """What `setup` builds: the resolved config, the engine, the data and where checkpoints go."""

    cfg: RunConfig
    dist: Dist
    engine: Any
    datasets: list[Dataset]
    tokenizer: Tokenizer
    train_data: ShardedLoader
    val_data: ShardedLoader
    ckpt_dir: Path
    ctrl: Any  # the gloo group ranks agree through
    resume_from: Checkpoint | None
    layout: Layout  # tensor x pipeline x data and ZeRO, resolved once for the world size
    params: list[torch.nn.Parameter] = field(default_factory=list)  # the module's, listed once for clipping

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.tokens_per_step

    @property
    def pipelined(self) -> bool:
        return self.layout.pipelined


def setup(cfg: RunConfig, dist: Dist, resume: bool | str | None) -> Run:
    """Everything before the first step, in the order that fails fastest: the data and its
    tokenizer, the DeepSpeed config, the run dir, the checkpoint dir and the checkpoint to resume
    from, then the engine and the loaders."""
    datasets = open_datasets(cfg.data)  # data.blend's, or the one prepared; tokenizer checked
    tokenizer = load_tokenizer(datasets[0].dir / TOKENIZER_FILE, cfg.data.tokenizer_path)
    weights, unusable = None, None
    if cfg.model.init_from is not None:  # read as far as its headers; the model's shape from it if asked
        try:
            cfg, weights = init_from.open_checked(
                cfg, tokenizer, datasets[0].manifest["tokenizer"]["fingerprint"]
            )
        except CheckpointError as e:
            if not resume:
                raise
            unusable = e  # a resume takes the checkpoint's weights: said below only if there is none
    cfg = resolve_vocab(cfg, tokenizer.vocab_size)
    cfg = resolve_document_eot(cfg, datasets)
    ds_config = available_monitors(render_deepspeed(cfg), warn=dist.is_main)
    check_with_deepspeed(ds_config)
    run_dir = cfg.run_dir()
    ckpt_dir = run_dir / cfg.checkpoint.dir
    ctrl = control_group()
    # The run dir is this run's alone: rank 0 locks it for the whole run, before anything is written.
    rank_0_acts(lambda: _claim(run_dir, ckpt_dir, resume), ctrl)
    set_roster(gather((socket.gethostname(), os.getpid()), ctrl))  # who each rank is
    # Checkpoints: a writable dir with room for one, and the one to resume from, before any work.
    checkpoint.preflight(
        ckpt_dir, need_bytes=checkpoint.estimate_bytes(cfg), keep=cfg.checkpoint.keep_last, group=ctrl
    )
    resume_from = _resume_from(cfg, dist, datasets, ckpt_dir, resume, ctrl) if resume else None
    if unusable is not None and resume_from is None:
        raise unusable  # no checkpoint: the run starts from init_from, which cannot be used
    # The run's record, once nothing above refused the run: a refused run writes none.
    rank_0_acts(lambda: rundir.record(run_dir, cfg, ds_config), ctrl)
    if dist.is_main:
        start_wandb(
            run_dir,
            ds_config,
            {**cfg.model_dump(mode="json"), "world_size": dist.world_size},
            bool(resume),  # --resume, or a supervised restart: the same W&B run
        )
    weights = _weights_to_load(dist, weights, resume_from, model=cfg.model)
    model = ds_engine.build_model(cfg, ds_config, weights)
    if weights is not None:  # a NaN or inf that any rank read stops every rank, before DeepSpeed starts
        init_from.finite_or_error(weights, gather(weights.non_finite, ctrl))
    engine = ds_engine.initialize(cfg, model, ds_config)
    # The ranks of one tensor-parallel group, and of one pipeline, read the same batches: the
    # data-parallel group's, which is DeepSpeed's (checked against the engine's groups).
    layout = layout_of(cfg, dist.world_size)
    dp_rank, dp_size = ds_engine.data_parallel_rank(layout, dist.rank, engine)
    # Weights come from one seed on every rank; what is random in training (dropout) must differ
    # between data-parallel ranks, or each would drop the same units, and agree within a tensor-
    # parallel group, whose ranks hold the same activations between their sharded layers. A resume
    # restores these generators.
    checkpoint.seed_generators(cfg.seed + 1 + dp_rank)
    place = (dp_rank, dp_size, dist.local_rank)
    run = Run(
        cfg,
        dist,
        engine,
        datasets,
        tokenizer,
        _loader(
            cfg, datasets, place, "train", cfg.batch.gradient_accumulation_steps, shuffle=True, log=dist.log
        ),
        _loader(cfg, datasets, place, "val", 1, shuffle=False, log=dist.log),
        ckpt_dir,
        ctrl,
        resume_from,
        layout,
        list(engine.module.parameters()),  # walking the module for them costs ~0.4 ms a step
    )
    dist.log(_banner(run))
    return run


def resolve_document_eot(cfg: RunConfig, datasets: list[Dataset]) -> RunConfig:
    """`cfg` with model.document_eot filled from the datasets' manifests when loader.document_mask is on:
    the end-of-text token prepare wrote after every document (a blend's datasets share one tokenizer)."""
    if not cfg.loader.document_mask:
        return cfg
    eots = {d.dir: d.manifest["tokenizer"].get("eot_token") for d in datasets}
    lacking = [str(where) for where, eot in eots.items() if type(eot) is not int]
    if lacking:
        raise DataError(
            f"loader.document_mask: the manifest of {', '.join(lacking)} records no end-of-text token to end "
            "documents with (prepared with the char tokenizer, or by an older pretrain): prepare it again with "
            "data.tokenizer=gpt2 or bpe (`pretrain data prepare --force`), or set loader.document_mask=false"
        )
    eot, given = eots[datasets[0].dir], cfg.model.document_eot
    if given not in (None, eot):
        raise ConfigError(
            [
                f"model.document_eot ({given}) is not the dataset's end-of-text token ({eot}): leave "
                "model.document_eot unset (loader.document_mask sets it)"
            ]
        )
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"document_eot": eot})})


def _claim(run_dir: Path, ckpt_dir: Path, resume: bool | str | None) -> None:
    """Rank 0's lock on the run dir, and its refusal of a new run where an earlier one saved."""
    rundir.claim(run_dir, ckpt_dir)
    if not resume and (tags := checkpoint.committed_tags(ckpt_dir)[0]):
        raise OutputError(
            f"{run_dir} holds the checkpoints of an earlier run (newest {tags[-1]}); a new run there "
            "would mix its checkpoints with them: continue it with --resume, or set logging.run_dir "
            f"to a new directory (or remove {ckpt_dir} yourself)"
        )


def _resume_from(
    cfg: RunConfig,
    dist: Dist,
    datasets: list[Dataset],
    ckpt_dir: Path,
    resume: bool | str,
    ctrl: Any,
) -> Checkpoint | None:
    """The checkpoint --resume names (or the newest sound one), checked against this run and put
    in place, or None: the run starts at step 0."""
    spec = "auto" if resume is True else str(resume)
    found = find_checkpoint(
        ckpt_dir,
        spec,
        layout=layout_of(cfg, dist.world_size),
        checksums=cfg.checkpoint.checksums,
        group=ctrl,
        report=dist.log,
    )
    if found is None:
        dist.log(f"no checkpoint to resume from in {ckpt_dir}: starting at step 0")
        return None
    check_compatible(found, cfg, datasets, warn=dist.is_main)
    place_resume(ckpt_dir, found, spec, group=ctrl, report=dist.log)
    return found


def _weights_to_load(
    dist: Dist, weights: init_from.Source | None, resume_from: Checkpoint | None, *, model: ModelConfig
) -> init_from.Source | None:
    """model.init_from's weights, unless a checkpoint's win (a resume)."""
    if model.init_from is not None and resume_from is not None:
        where = weights.dir if weights is not None else model.init_from.path
        dist.log(f"model.init_from {where}: not loaded, the checkpoint's weights win on a resume")
        return None
    if weights is not None:
        dist.log(f"model.init_from: the weights of {weights.dir} ({weights.architecture})")
    return weights


def _loader(
    cfg: RunConfig,
    datasets: list[Dataset],
    place: tuple[int, int, int],
    split: str,
    grad_accum: int,
    *,
    shuffle: bool,
    log: Callable[[str], None],
) -> ShardedLoader:
    """A split's loader for this rank's place (data-parallel rank, size, local rank): train mixes the
    datasets by weight and shuffles, val reads all their val shards in order. With loader.cache_dir, the
    shards are read from their node-local copies (data/staging.py), which staging verifies instead."""
    dp_rank, dp_size, local_rank = place
    groups = [d.shard_paths(split) for d in datasets]
    verify = cfg.loader.verify_shards and local_rank == 0  # one full read per host, not per rank
    if cfg.loader.cache_dir is not None:
        staged = stage_datasets(
            datasets, split, cache_dir=cfg.loader.cache_dir, max_gb=cfg.loader.cache_max_gb, verify=verify
        )
        log(staged.summary(Path(cfg.loader.cache_dir), split))
        groups, verify = staged.paths, False  # every path it returned was verified if `verify` asked
    return ShardedLoader(
        groups if shuffle else [p for g in groups for p in g],
        block_size=cfg.model.block_size,
        micro_batch_size=cfg.batch.micro_batch_size,
        grad_accum=grad_accum,
        rank=dp_rank,
        world_size=dp_size,
        seed=cfg.data.seed,
        shuffle=shuffle,
        verify=verify,
        weights=[d.weight for d in datasets] if shuffle else None,
        prefetch=cfg.loader.prefetch if shuffle else 0,
        # verified shards hold the tokenizer's ids; unverified ones are checked batch by batch
        vocab_size=None if cfg.loader.verify_shards else cfg.model.vocab_size,
    )


def _banner(run: Run) -> str:
    cfg, b, world, lay = run.cfg, run.cfg.batch, run.dist.world_size, run.layout
    layout = (
        f"tensor {lay.tensor} x pipeline {lay.pipeline} x data {lay.data} = "
        if lay.model_parallel > 1
        else ""
    )
    n_train = sum(d.n_tokens("train") for d in run.datasets)
    n_val = sum(d.n_tokens("val") for d in run.datasets)
    return (
        f"{_model_name(cfg)}: {analytic_num_params(cfg.model) / 1e6:.2f}M params, {cfg.model.n_layer} layers, "
        f"{cfg.precision.name}, ZeRO-{lay.zero_stage}{' + offload' if lay.offload_optimizer else ''}, "
        f"{layout}world size {world}\n"
        f"batch {b.micro_batch_size} x {b.gradient_accumulation_steps} x {b.data_parallel_size} = "
        f"{b.sequences} sequences = {run.tokens_per_step:,} tokens/step, {_budget(cfg)}\n"
        f"data {run.datasets[0].dir}: {n_train:,} train / {n_val:,} val tokens, vocab {run.tokenizer.vocab_size}\n"
        f"run dir {cfg.run_dir()}"
    )


def _model_name(cfg: RunConfig) -> str:
    """What the banner calls the model: the Hugging Face model it starts from, the preset's model, or
    the run's own (a preset's name alone said `tiny` for a model that was not the tiny preset's)."""
    if cfg.model.init_from is not None:
        return f"{Path(cfg.model.init_from.path).name} (model.init_from)"
    preset = PRESETS.get(cfg.preset, {}).get("model")
    own = cfg.model.model_dump(exclude={"vocab_size"})  # the vocab comes from the data
    if preset is not None and ModelConfig.model_validate(preset).model_dump(exclude={"vocab_size"}) == own:
        return f"{cfg.preset} preset"
    return f"own model ({cfg.model.arch}, from the {cfg.preset} preset's defaults)"


def _budget(cfg: RunConfig) -> str:
    """The run's length as the banner says it: its steps, the budget that sets them, and max_hours."""
    s = cfg.schedule
    steps = f"{cfg.total_steps} steps"
    if s.max_tokens is not None:
        binds = cfg.schedule.binding(cfg.tokens_per_step)
        steps += f" ({binds} binds: max_steps {s.max_steps}, max_tokens {s.max_tokens:,})"
    return steps + (f", or {s.max_hours:g} h of training if that comes first" if s.max_hours else "")
