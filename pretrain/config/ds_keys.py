"""The DeepSpeed config's keys, as this project knows them: those the tree renders itself, those it
passes through in `deepspeed_extra`, and the sections it models in part. `ds_render` writes with
them and `ds_read` reads with them; a test checks them against DeepSpeed's sources.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.errors import did_you_mean

AUTO = "auto"  # the Hugging Face Trainer's placeholder: here, "the tree's value"
RECORD = "pretrain"  # the top-level key of a rendered JSON that records what it was rendered for

# DeepSpeed's monitors (deepspeed/monitor/config.py) that the tree models, in `logging`. Those with
# files write under the run dir, each in its own subdirectory (DeepSpeed's `job_name`).
MONITORS = ("tensorboard", "csv_monitor", "wandb")
MONITOR_DIRS = {"tensorboard": "tensorboard", "csv_monitor": "csv_monitor"}


# Top-level keys of DeepSpeed's config that this tree writes itself (ds_render renders them).
MODELED_DEEPSPEED_KEYS = {
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "gradient_clipping",
    "bf16",
    "fp16",
    "zero_optimization",
    "tensorboard",
    "csv_monitor",
    "wandb",
    "compile",  # DeepSpeed's DeepCompile switches: the tree's `compile` section (ds_read reads them)
    "tensor_parallel",  # AutoTP: the tree's parallel.tensor, and the partition of this GPT's layers
    "pipeline",  # the pipeline engine's section: parallel.pipeline and its partitioning
}

# Every other top-level key DeepSpeed's config parser reads (deepspeed/runtime/config.py and the
# sub-configs it loads). A test checks each is still a string constant in DeepSpeed's sources.
DEEPSPEED_PASSTHROUGH_KEYS = {
    "scheduler",
    "steps_per_print",  # the rendered JSON's default is quiet (pretrain logs itself); a JSON's own wins
    "wall_clock_breakdown",
    "prescale_gradients",
    "gradient_predivide_factor",
    "sparse_gradients",
    "communication_data_type",
    "seq_parallel_communication_data_type",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "amp",
    "torch_autocast",
    "graph_harvesting",
    "disable_allgather",
    "dump_state",
    "memory_breakdown",
    "sparse_attention",
    "activation_checkpointing",
    "flops_profiler",
    "comms_logger",
    "comet",
    "aio",
    "checkpoint",
    "data_types",
    "elasticity",
    "autotuning",
    "progressive_layer_drop",
    "curriculum_learning",
    "data_efficiency",
    "compression_training",
    "eigenvalue",
    "quantize_training",
    "nebula",
    "dataloader_drop_last",
    "use_data_before_expert_parallelism",
    "timers",
    "weight_quantization",
    "hybrid_engine",
    "use_node_local_storage",
}


def unknown_deepspeed_keys(extra: dict[str, Any]) -> list[str]:
    known = DEEPSPEED_PASSTHROUGH_KEYS | MODELED_DEEPSPEED_KEYS
    return [
        f"'{key}' is not a DeepSpeed config key{did_you_mean(key, known)}"
        for key in extra
        if key not in known
    ]


# zero_optimization keys the `zero` section models: DeepSpeed's name -> the section's field.
ZERO_KEYS = {
    "stage": "stage",
    "overlap_comm": "overlap_comm",
    "contiguous_gradients": "contiguous_gradients",
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
}

# fp16 keys the `precision` section models: DeepSpeed's name -> field.
FP16_KEYS = {
    "enabled": "fp16",
    "loss_scale": "loss_scale",
    "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_loss_scale",
}

# Top-level keys that change what is trained: a key DeepSpeed does not know that is close to one of
# these is an error (DeepSpeed would silently train without it), any other unknown key a warning.
TRAINING_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "zero_optimization",
    "tensor_parallel", "pipeline", "activation_checkpointing", "communication_data_type",
    "prescale_gradients", "gradient_predivide_factor",
}  # fmt: skip

# What DeepSpeed 0.19 uses where a JSON that names them leaves them out.
ADAM_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # FusedAdam, CPUAdam
FP16_DEFAULTS = {"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}


def zero_defaults(stage: int) -> dict[str, Any]:
    """DeepSpeedZeroConfig's defaults for the knobs the `zero` section models."""
    return {
        "stage": stage, "overlap_comm": stage == 3, "contiguous_gradients": True,
        "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
        "offload_optimizer": False, "offload_param": False,
    }  # fmt: skip


# Modeled sections whose other knobs may pass through in `deepspeed_extra`: section -> modeled keys.
# tensor_parallel keys the `parallel` section models (partition_config is rendered from the model).
TENSOR_PARALLEL_KEYS = {"autotp_size": "tensor"}
# pipeline keys the `parallel` section models: DeepSpeed's name -> field.
PIPELINE_KEYS = {
    "stages": "pipeline",
    "partition": "partition_method",
    "activation_checkpoint_interval": "activation_checkpoint_interval",
}

PARTLY_MODELED = {
    "zero_optimization": set(ZERO_KEYS),
    "tensor_parallel": set(TENSOR_PARALLEL_KEYS) | {"partition_config"},
    "pipeline": set(PIPELINE_KEYS),
    "fp16": set(FP16_KEYS),
    "bf16": {"enabled"},
}

# Unmodeled zero_optimization knobs that "auto" sizes from the model width (n_embd) when the JSON is
# rendered, with the Hugging Face Trainer's formulas. ("auto" in a modeled key keeps the tree's value.)
ZERO_AUTO: dict[str, Callable[[int], int]] = {
    "stage3_prefetch_bucket_size": lambda hidden: int(0.9 * hidden * hidden),
    "stage3_param_persistence_threshold": lambda hidden: 10 * hidden,
}
# DeepSpeed reads the same two knobs under their field names too (pydantic aliases): one rule for both.
ZERO_AUTO |= {"prefetch_bucket_size": ZERO_AUTO["stage3_prefetch_bucket_size"]}
ZERO_AUTO |= {"param_persistence_threshold": ZERO_AUTO["stage3_param_persistence_threshold"]}


def auto_paths(node: Any, prefix: str = "") -> list[str]:
    """The dotted paths under `node` whose value is the string "auto"."""
    if node == "auto":
        return [prefix]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in auto_paths(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in auto_paths(v, f"{prefix}.{i}")]
    return []
