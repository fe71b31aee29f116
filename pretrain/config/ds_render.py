"""The DeepSpeed JSON rendered from the tree, and checked by DeepSpeed itself.

`render_deepspeed` writes every key the tree models, then the `deepspeed_extra` passthrough, and
records under `pretrain` (a key DeepSpeed ignores) the preset, model and tokenizer it was rendered
for, which `ds_read.recorded_run` reads back. The monitors (TensorBoard, CSV, W&B) are DeepSpeed's,
configured from `logging`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pretrain.config.ds_keys import AUTO, MONITOR_DIRS, RECORD, ZERO_AUTO, auto_paths
from pretrain.config.loading import deep_merge
from pretrain.config.tree import ModelConfig, RunConfig
from pretrain.errors import ConfigError


def render_deepspeed(cfg: RunConfig) -> dict[str, Any]:
    """The DeepSpeed JSON for this run. Needs a resolved data_parallel_size."""
    b, z, p, o = cfg.batch, cfg.zero, cfg.precision, cfg.optimizer
    if b.train_batch_size is None:
        raise ConfigError(["batch.data_parallel_size is unresolved: pass a world size"], "render")
    params: dict[str, Any] = {
        "lr": o.lr,
        "betas": list(o.betas),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
    }
    if not o.bias_correction:
        params["bias_correction"] = False  # FusedAdam and DeepSpeedCPUAdam take it
    if not z.offload_optimizer:
        params["torch_adam"] = not o.fused_adam
        if not o.fused_adam and o.torch_fused:
            params["fused"] = True  # DeepSpeed passes extra params through to torch.optim.AdamW
    zero: dict[str, Any] = {
        "stage": z.stage,
        "overlap_comm": z.overlap_comm,
        "contiguous_gradients": z.contiguous_gradients,
        "reduce_bucket_size": z.reduce_bucket_size,
        "allgather_bucket_size": z.allgather_bucket_size,
    }
    if z.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": z.pin_memory}
    if z.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": z.pin_memory}
    out: dict[str, Any] = {
        RECORD: render_record(cfg),
        "train_batch_size": b.train_batch_size,
        "train_micro_batch_size_per_gpu": b.micro_batch_size,
        "gradient_accumulation_steps": b.gradient_accumulation_steps,
        "optimizer": {"type": "AdamW", "params": params}
        if o.adam_w_mode
        else {"type": "Adam", "params": {**params, "adam_w_mode": False}},
        "gradient_clipping": o.grad_clip,
        "bf16": {"enabled": p.bf16},
        # bf16 gradients summed over the micro batches in fp32 (BF16_Optimizer at stage 1, the ZeRO
        # optimizers' fp32 partition at 2 and 3), and over the data-parallel ranks in fp32 too: in
        # bf16, stage 1 would round the fp32 sum to bf16 to all-reduce it. Without these DeepSpeed
        # sums both in bf16.
        **({"data_types": {"grad_accum_dtype": p.grad_accum_dtype}} if p.bf16 else {}),
        **({"communication_data_type": "fp32"} if p.accumulates_in_fp32 else {}),
        "fp16": {
            "enabled": p.fp16,
            "loss_scale": int(p.loss_scale) if p.loss_scale.is_integer() else p.loss_scale,
            "initial_scale_power": p.initial_scale_power,
            "loss_scale_window": p.loss_scale_window,
            "hysteresis": p.hysteresis,
            "min_loss_scale": p.min_loss_scale,
        },
        "zero_optimization": zero,
        # pretrain logs itself; keep DeepSpeed's own per-step prints out of the way.
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
        **render_monitors(cfg),
        **render_parallel(cfg),
    }
    out = deep_merge(out, cfg.deepspeed_extra)
    for key, size in ZERO_AUTO.items():  # "auto" in unmodeled ZeRO knobs: sized from the model width
        if out["zero_optimization"].get(key) == AUTO:
            out["zero_optimization"][key] = size(cfg.model.n_embd)
    left = auto_paths(out)  # the tree's rules leave none; DeepSpeed must never see one
    if left:
        raise ConfigError([f"{p}: 'auto' has nothing in the tree to resolve from" for p in left], "render")
    return out


def render_parallel(cfg: RunConfig) -> dict[str, Any]:
    """DeepSpeed's `tensor_parallel` (AutoTP) and `pipeline` sections, where the layout has them."""
    par, out = cfg.parallel, {}
    if par.tensor > 1:
        out["tensor_parallel"] = {
            "autotp_size": par.tensor,
            "partition_config": {"use_default_specs": False, "layer_specs": autotp_layer_specs(cfg.model)},
        }
    if par.pipeline > 1:
        out["pipeline"] = {
            "stages": par.pipeline,
            "partition": par.partition_method,
            "activation_checkpoint_interval": pipeline_checkpoint_interval(cfg),
        }
    return out


def autotp_layer_specs(m: ModelConfig) -> list[dict[str, Any]]:
    """How AutoTP splits this GPT's layers (Megatron's layout): the fused q/k/v projection and the
    MLP's input projection by output rows (column-parallel), each sub-matrix (q, k, v; SwiGLU's gate,
    up) split on its own so a rank holds whole heads of each; the two output projections by input
    columns (row-parallel, all-reduced). Embeddings, norms and the head stay whole on every rank."""
    q, kv = m.n_embd, m.kv_heads * m.head_size
    fc: dict[str, Any] = {"patterns": [r".*\.mlp\.c_fc\.weight$"], "partition_type": "column"}
    if m.arch == "llama":
        fc |= {"shape": [2, -1], "partition_dim": 0}  # [gate; up]
    return [
        {
            "patterns": [r".*\.attn\.c_attn\.weight$"],
            "partition_type": "column",
            "shape": [[q, kv, kv], -1],
            "partition_dim": 0,
        },
        {"patterns": [r".*\.attn\.c_proj\.weight$"], "partition_type": "row"},
        fc,
        {"patterns": [r".*\.mlp\.c_proj\.weight$"], "partition_type": "row"},
    ]


def pipeline_checkpoint_interval(cfg: RunConfig) -> int:
    """Layers between activation checkpoints in a pipeline stage (0: none)."""
    given = cfg.parallel.activation_checkpoint_interval
    return given if given is not None else int(cfg.model.activation_checkpointing)


def render_monitors(cfg: RunConfig) -> dict[str, Any]:
    """DeepSpeed's monitor sections (only the enabled ones), all writing under the run dir."""
    lg, out = cfg.logging, {}
    for key, enabled in (("tensorboard", lg.tensorboard), ("csv_monitor", lg.csv_monitor)):
        if enabled:
            out[key] = {"enabled": True, "output_path": str(cfg.run_dir()), "job_name": MONITOR_DIRS[key]}
    if lg.wandb:
        wandb: dict[str, Any] = {"enabled": True, "project": lg.wandb_project}
        if lg.wandb_group is not None:
            wandb["group"] = lg.wandb_group
        if lg.wandb_team is not None:
            wandb["team"] = lg.wandb_team
        out["wandb"] = wandb
    return out


def render_record(cfg: RunConfig) -> dict[str, Any]:
    """What a rendered JSON was rendered for (its `pretrain` key, which DeepSpeed ignores): read
    back without --preset or --config, it is the run's starting point."""
    record: dict[str, Any] = {
        "preset": cfg.preset,
        "model": cfg.model.model_dump(mode="json"),
        "tokenizer": cfg.data.tokenizer,
    }
    if cfg.data.tokenizer == "bpe":
        record["bpe_vocab_size"] = cfg.data.bpe_vocab_size
    return record


def check_with_deepspeed(ds: dict[str, Any]) -> None:
    """Run DeepSpeed's own config parser over a rendered JSON (no process group needed)."""
    # torch and DeepSpeed only here: rendering and reading back stay light for the CLI.
    import torch.distributed as tdist
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    ds = json.loads(json.dumps(ds))
    model_parallel = ds.get("tensor_parallel", {}).get("autotp_size", 1) > 1 or "pipeline" in ds
    if model_parallel or not (tdist.is_available() and tdist.is_initialized()):
        # Without a process group DeepSpeed assumes world size 1 for its batch check, and without
        # the engine's groups it counts every rank as data-parallel; the tree has already checked
        # train_batch_size against the data-parallel size, so let DeepSpeed derive it.
        ds.pop("train_batch_size", None)
    try:
        DeepSpeedConfig(ds)
    except (DeepSpeedConfigError, ValidationError, ValueError, AssertionError, KeyError, TypeError) as e:
        raise ConfigError([f"DeepSpeed rejects the config: {e}"], "DeepSpeed config") from e
