"""Named starting points for a run, and the layered build of a run's config.

A preset is a partial tree (a nested dict) merged over the defaults; a run config file, a
DeepSpeed JSON and `--set` overrides go on top, in that order (`build`). The char-level presets
train on one CPU; the GPT-2 sizes use the 50257-token BPE and are meant for GPU clusters. Each
char-level size has a Llama-shaped twin (`llama-tiny`, ...: RMSNorm, SwiGLU, RoPE, grouped-query
attention, no biases), and `llama-1b` is TinyLlama's 1.1B shape for GPU clusters.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from pretrain.config.ds_read import recorded_run, tree_from_deepspeed
from pretrain.config.ds_validators import deepspeed_problems
from pretrain.config.hf import SHAPE_FIELDS, model_shape
from pretrain.config.loading import deep_merge, load_file, merge_layer, parse_override
from pretrain.config.tree import RunConfig, validate
from pretrain.errors import CheckpointError, ConfigError

_GPT2_DATA = {"tokenizer": "gpt2"}


def _gpt2(n_layer: int, n_head: int, n_embd: int, *, lr: float, stage: int, **model: Any) -> dict[str, Any]:
    """GPT-2 shapes (Radford et al. 2019) with the nanoGPT/GPT-3 training recipe, bf16, torch.compile,
    on a100x16."""
    return {
        "model": {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": 1024, **model},
        "data": _GPT2_DATA,
        "optimizer": {"lr": lr, "fused_adam": True},
        "schedule": {"max_steps": 600_000, "warmup_steps": 2000},
        "batch": {"micro_batch_size": 12, "gradient_accumulation_steps": 4},
        "precision": {"bf16": True},
        "zero": {"stage": stage},
        "compile": {"enabled": True},  # on GPUs torch.compile pays for its minute of compiling
        "checkpoint": {"interval": 1000, "keep_last": 3},
        "logging": {"log_interval": 10, "eval_interval": 1000, "eval_batches": 50},
    }


def _char(
    n: int, *, lr: float, max_steps: int, micro_batch: int, dropout: float = 0.0, **sections: Any
) -> dict[str, Any]:
    """n layers of n heads, 64n wide, context 256, char-level; `sections` are merged on top."""
    return deep_merge(
        {
            "model": {"n_layer": n, "n_head": n, "n_embd": 64 * n, "block_size": 256, "dropout": dropout},
            "data": {"tokenizer": "char"},
            "optimizer": {"lr": lr},
            "schedule": {"max_steps": max_steps, "warmup_steps": 100},
            "batch": {"micro_batch_size": micro_batch},
            "checkpoint": {"interval": 500},
        },
        sections,
    )


def _llama(char_preset: dict[str, Any], n_kv_head: int) -> dict[str, Any]:
    """A char-level preset's size and recipe with the Llama block."""
    return deep_merge(char_preset, {"model": {"arch": "llama", "n_kv_head": n_kv_head}})


PRESETS: dict[str, dict[str, Any]] = {
    # Char-level on the embedded Shakespeare corpus; minutes on a laptop CPU.
    "tiny": _char(
        2,
        lr=2e-3,
        max_steps=1500,
        micro_batch=16,
        batch={"gradient_accumulation_steps": 1},
        checkpoint={"keep_last": 2},
        logging={"log_interval": 25, "eval_interval": 250, "eval_batches": 20},
    ),
    "small": _char(4, lr=1e-3, max_steps=2000, micro_batch=32, dropout=0.1),
    "medium": _char(6, lr=1e-3, max_steps=5000, micro_batch=64, dropout=0.2),
    "gpt2-124m": _gpt2(12, 12, 768, lr=6e-4, stage=1),
    "gpt2-350m": _gpt2(24, 16, 1024, lr=3e-4, stage=1),
    "gpt2-774m": _gpt2(36, 20, 1280, lr=2.5e-4, stage=2),
    "gpt2-1.5b": _gpt2(48, 25, 1600, lr=2e-4, stage=2, activation_checkpointing=True),
    # GPT-3 6.7B shape (Brown et al. 2020) for hostfiles/a100x16: 16 x A100-80GB, ZeRO-2 with the
    # fp32 Adam state (12 bytes/param, 80 GB in all) offloaded to CPU memory, 5 GB per rank.
    "gpt-6.7b": {
        "model": {
            "n_layer": 32,
            "n_head": 32,
            "n_embd": 4096,
            "block_size": 2048,
            "activation_checkpointing": True,
        },
        "data": _GPT2_DATA,
        "optimizer": {"lr": 1.2e-4},
        "schedule": {"max_steps": 143_000, "warmup_steps": 2000},
        "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 8},
        "precision": {"bf16": True},
        "zero": {
            "stage": 2,
            "offload_optimizer": True,
            "reduce_bucket_size": 200_000_000,
            "allgather_bucket_size": 200_000_000,
        },
        "checkpoint": {"interval": 500, "keep_last": 2},
        "logging": {"log_interval": 1, "eval_interval": 500, "eval_batches": 20},
    },
}
PRESETS.update(
    {
        "llama-tiny": _llama(PRESETS["tiny"], n_kv_head=1),
        "llama-small": _llama(PRESETS["small"], n_kv_head=2),
        "llama-medium": _llama(PRESETS["medium"], n_kv_head=2),
        # TinyLlama 1.1B's shape (Zhang et al. 2024): 22 layers, 32 query heads sharing 4 key/value
        # heads, SwiGLU 5632 wide, untied embeddings, context 2048; GPT-2's BPE, on a100x16 with ZeRO-2.
        "llama-1b": {
            "model": {
                "arch": "llama",
                "n_layer": 22,
                "n_head": 32,
                "n_kv_head": 4,
                "n_embd": 2048,
                "intermediate_size": 5632,
                "block_size": 2048,
                "tie_embeddings": False,
                "activation_checkpointing": True,
            },
            "data": _GPT2_DATA,
            "optimizer": {"lr": 4e-4, "fused_adam": True},
            "schedule": {"max_steps": 100_000, "warmup_steps": 2000},
            "batch": {"micro_batch_size": 8, "gradient_accumulation_steps": 4},
            "precision": {"bf16": True},
            "zero": {"stage": 2},
            "checkpoint": {"interval": 1000, "keep_last": 3},
            "logging": {"log_interval": 10, "eval_interval": 1000, "eval_batches": 50},
        },
    }
)


def _llama2(
    n_layer: int,
    n_head: int,
    n_embd: int,
    ffn: int,
    *,
    lr: float,
    micro_batch: int,
    accumulation: int,
    stage: int,
    tensor: int,
    pipeline: int = 1,
    n_kv_head: int | None = None,
) -> dict[str, Any]:
    """Llama 2's shapes and recipe (Touvron et al. 2023): context 4096, a 32000-token BPE (trained on the
    corpus here), untied embeddings, RoPE base 10000, AdamW (0.9, 0.95) eps 1e-5, weight decay 0.1,
    clipping 1.0, 2000 warmup steps and a cosine to 10%; 1024 sequences (4M tokens) a step at the
    layout the preset is sized for, with activation checkpointing, in bf16."""
    return {
        "model": {
            "arch": "llama",
            "n_layer": n_layer,
            "n_head": n_head,
            "n_kv_head": n_kv_head or n_head,
            "n_embd": n_embd,
            "intermediate_size": ffn,
            "block_size": 4096,
            "rope_theta": 10000.0,
            "tie_embeddings": False,
            "activation_checkpointing": True,
        },
        "data": {"tokenizer": "bpe", "bpe_vocab_size": 32000},
        "optimizer": {"lr": lr, "eps": 1e-5, "weight_decay": 0.1, "grad_clip": 1.0, "fused_adam": True},
        "schedule": {"max_steps": 500_000, "warmup_steps": 2000, "min_lr_ratio": 0.1},
        "batch": {"micro_batch_size": micro_batch, "gradient_accumulation_steps": accumulation},
        "precision": {"bf16": True},
        "zero": {"stage": stage},
        "parallel": {"tensor": tensor, "pipeline": pipeline},
        "checkpoint": {"interval": 1000, "keep_last": 2},
        "logging": {"log_interval": 1, "eval_interval": 1000, "eval_batches": 20},
    }


# Llama 2 at 7B, 13B and 70B, each in a layout that `pretrain plan` shows fits A100-80GB nodes of 8:
# 7B data-parallel with ZeRO-1 (hostfiles/a100x16: 16 ranks of 4 x 16), 13B tensor-parallel over 2 GPUs
# of a node (a100x16: 8 replicas of 4 x 32), 70B tensor-parallel over a node's 8 GPUs and 4 pipeline
# stages across nodes, ZeRO-1 over the 2 replicas of hostfiles/a100x64 (1 x 512 micro batches).
PRESETS.update(
    {
        "llama-7b": _llama2(32, 32, 4096, 11008, lr=3e-4, micro_batch=4, accumulation=16, stage=1, tensor=1),
        "llama-13b": _llama2(40, 40, 5120, 13824, lr=3e-4, micro_batch=4, accumulation=32, stage=1, tensor=2),
        "llama-70b": _llama2(
            80,
            64,
            8192,
            28672,
            lr=1.5e-4,
            micro_batch=1,
            accumulation=512,
            stage=1,
            tensor=8,
            pipeline=4,
            n_kv_head=8,
        ),
    }
)


def preset_dict(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError([f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}"], "preset")
    return {"preset": name, **copy.deepcopy(PRESETS[name])}


def build(
    preset: str | None = None,
    *,
    config_file: str | Path | None = None,
    ds_file: str | Path | None = None,
    overrides: list[str] | None = None,
    world_size: int | None = None,
    resume: bool = False,
) -> RunConfig:
    """A run's config: the preset < the config file < the DeepSpeed JSON < the overrides, validated
    once for `world_size` (None: the batch's data_parallel_size stays unresolved).

    The preset is `preset`, else the config file's, else (with neither) the one a DeepSpeed JSON
    rendered by pretrain records, with its model and tokenizer; else `tiny`. A DeepSpeed JSON written
    elsewhere says nothing of the model, so it needs a preset or a config file."""
    file_data = load_file(config_file) if config_file else {}
    ds = load_file(ds_file) if ds_file else None
    recorded = recorded_run(ds, str(ds_file)) if ds is not None else None
    named = preset is not None or bool(config_file)
    if ds is not None and not named and recorded is None:
        _refuse_unnamed_model(ds, str(ds_file), world_size)
    base = _base(preset or str(file_data.get("preset", "")) or "tiny", None if named else recorded)
    data = merge_layer(base, file_data)
    over = _overrides(overrides or [])
    tree: dict[str, Any] = {}
    if ds is not None:
        # "auto" in the JSON resolves against the tree without it: the layers below, and the overrides
        tree = tree_from_deepspeed(
            ds, str(ds_file), merge_layer(data, over), world_size=world_size, record=False
        )
        data = merge_layer(data, tree)
    data = merge_layer(data, over)
    if not any("warmup_steps" in layer.get("schedule", {}) for layer in (file_data, tree, over)):
        data = with_preset_warmup_fitted(data, base)
    return _validated(data, world_size, resume=resume)


def _base(preset: str, recorded: dict[str, Any] | None) -> dict[str, Any]:
    """The lowest layer: the preset, or the one a rendered JSON records, with its model and tokenizer."""
    return (
        deep_merge(preset_dict(recorded["preset"]), recorded) if recorded is not None else preset_dict(preset)
    )


def _refuse_unnamed_model(ds: dict[str, Any], ds_file: str, world_size: int | None) -> NoReturn:
    """A DeepSpeed JSON written elsewhere with neither a preset nor a config file: refused, with the
    JSON's own problems (read against the default preset) too, every problem at once."""
    needs = (
        f"{ds_file} was not rendered by pretrain, so it does not say which model to train: pass "
        f"--preset NAME (one of: {', '.join(PRESETS)}) or --config FILE"
    )
    try:
        tree_from_deepspeed(ds, ds_file, preset_dict("tiny"), world_size=world_size, record=False, quiet=True)
    except ConfigError as e:
        raise ConfigError([needs, *e.problems], "DeepSpeed JSON") from None
    raise ConfigError([needs], "DeepSpeed JSON")


def _overrides(items: list[str]) -> dict[str, Any]:
    """The `--set` overrides merged into one layer; every malformed one reported at once."""
    over: dict[str, Any] = {}
    problems: list[str] = []
    for item in items:
        try:
            over = deep_merge(over, parse_override(item))
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems, "override")
    return over


def _validated(data: dict[str, Any], world_size: int | None, *, resume: bool) -> RunConfig:
    """`data` with init_from's shape taken, validated; a directory that cannot give the shape is
    reported with the rest of the config's problems."""
    try:
        data = with_init_from_shape(data, resume=resume)
    except CheckpointError as e:  # the directory's config.json: reported with the rest of the config
        try:
            validate(data, world_size)
        except ConfigError as other:
            raise ConfigError([str(e), *other.problems], other.source) from None
        raise ConfigError([str(e)], "model.init_from") from None
    return validate(data, world_size)


def with_preset_warmup_fitted(data: dict[str, Any], preset: dict[str, Any]) -> dict[str, Any]:
    """`data` with the preset's warmup scaled to a run too short for it (`--set schedule.max_steps=3`
    on a preset that warms up over 100), as nanoGPT's and litgpt's quick runs are accepted: the share
    of the run the preset warms up over, said in one line. A warmup anyone set stays as set (and an
    error where it does not fit)."""
    sched, was = data.get("schedule", {}), preset.get("schedule", {})
    warmup, steps, preset_steps = sched.get("warmup_steps"), sched.get("max_steps"), was.get("max_steps")
    bounded = sched.get("decay", "cosine") != "constant" and not sched.get("deepspeed_timing", False)
    if not (bounded and all(isinstance(x, int) and x > 0 for x in (warmup, steps, preset_steps))):
        return data
    assert isinstance(warmup, int) and isinstance(steps, int) and isinstance(preset_steps, int)
    if warmup < steps:
        return data
    fitted = min(warmup * steps // preset_steps, steps - 1)
    if fitted == 1 and sched.get("warmup_type", "linear") == "log":
        fitted = 0  # a log warmup needs 0 or at least 2 steps
    _note(
        f"schedule.warmup_steps: the preset's {warmup} do not fit schedule.max_steps {steps}: {fitted}, the "
        f"preset's share of the run ({warmup} of {preset_steps}); set schedule.warmup_steps to choose"
    )
    return {**data, "schedule": {**sched, "warmup_steps": fitted}}


_NOTED: set[str] = set()  # a command may build its config more than once: each note is said once


def _note(text: str) -> None:
    if text not in _NOTED and os.environ.get("RANK", "0") == "0":
        _NOTED.add(text)
        print(f"note: {text}", file=sys.stderr)


def with_init_from_shape(data: dict[str, Any], *, resume: bool = False) -> dict[str, Any]:
    """`data` with the model's shape taken from the Hugging Face config.json of `model.init_from`
    where its `config` is true, before validation: the batch (a global batch in tokens), the
    parallel layout and `plan` all see the shape the run will have. The rest stays as given. A
    resume takes the checkpoint's weights, not the directory's: where the directory can no longer be
    read, the shape is the one the run recorded at its start (its run dir's config.yaml)."""
    model = data.get("model")
    if not isinstance(model, dict):
        return data
    spec = model.get("init_from")
    if not (isinstance(spec, dict) and spec.get("config") is True and isinstance(spec.get("path"), str)):
        return data
    try:
        shape = model_shape(spec["path"])
    except CheckpointError:
        recorded = _recorded_model(data) if resume else None
        if recorded is None:
            raise
        shape = {k: recorded[k] for k in SHAPE_FIELDS if k in recorded}
    return {**data, "model": {**model, **shape}}


def _recorded_model(data: dict[str, Any]) -> dict[str, Any] | None:
    """The model section of the run dir's config.yaml (written at a run's start), if there is one."""
    logging, preset = data.get("logging", {}), data.get("preset", "")
    run_dir = logging.get("run_dir") if isinstance(logging, dict) else None
    if not isinstance(run_dir, str):
        return None
    try:
        recorded = load_file(Path(run_dir.format(preset=preset)) / "config.yaml")
    except (ConfigError, OSError, KeyError, ValueError):
        return None
    model = recorded.get("model")
    return model if isinstance(model, dict) else None


def build_checked(ds_file: str | Path | None = None, **build_args: Any) -> RunConfig:
    """`build(ds_file=ds_file, **build_args)`, with every section of the DeepSpeed JSON also checked
    by DeepSpeed's own validators, all problems in one error. Imports DeepSpeed: the commands that
    only need the tree use `build`."""
    if not ds_file:
        return build(**build_args)
    found = deepspeed_problems(load_file(ds_file))
    try:
        cfg = build(ds_file=ds_file, **build_args)
    except ConfigError as e:
        said = {p.split(": ")[0] for p in e.problems}  # one problem per key: build's own says it
        raise ConfigError(e.problems + [p for p in found if p.split(": ")[0] not in said], e.source) from None
    if found:
        raise ConfigError(found, str(ds_file))
    return cfg
