"""DeepSpeed JSONs written elsewhere, in the tree's terms: `tree_from_deepspeed`, the top-level
reading.

Users bring DeepSpeed JSONs from DeepSpeed's tutorials, the Hugging Face Trainer (full of "auto"),
Megatron-DeepSpeed and GPT-NeoX, and the JSONs `ds_render` wrote. `tree_from_deepspeed` reads them
into the tree key by key: a `Reading` (ds_values.py) takes each value for the tree with a strict
type check, "auto" keeping the tree's value; ds_optimizer.py translates DeepSpeed's optimizer and LR
scheduler where the tree can express them, and says why not where it cannot; the batch, precision,
ZeRO, parallelism and monitors are read here. DeepSpeed's own validators check the other sections
(ds_validators.py, which imports DeepSpeed: the commands that only need the tree never call it).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pretrain.config.ds_keys import (
    ADAM_DEFAULTS,
    AUTO,
    DEEPSPEED_PASSTHROUGH_KEYS,
    FP16_DEFAULTS,
    FP16_KEYS,
    MODELED_DEEPSPEED_KEYS,
    MONITOR_DIRS,
    MONITORS,
    PIPELINE_KEYS,
    RECORD,
    TENSOR_PARALLEL_KEYS,
    TRAINING_KEYS,
    ZERO_AUTO,
    ZERO_KEYS,
    zero_defaults,
)
from pretrain.config.ds_optimizer import read_optimizer, read_scheduler
from pretrain.config.ds_values import Reading, is_whole, shown, without_auto
from pretrain.config.loading import deep_merge
from pretrain.errors import ConfigError, did_you_mean

# ---------------------------------------------------------------------------------------------
# A whole JSON into the tree


def recorded_run(ds: dict[str, Any], source: str = "DeepSpeed JSON") -> dict[str, Any] | None:
    """The partial tree a rendered JSON records (preset, model, tokenizer); None for a JSON written
    elsewhere."""
    record = ds.get(RECORD)
    if record is None:
        return None
    known = {"preset", "model", "tokenizer", "bpe_vocab_size"}
    if not isinstance(record, dict):
        raise ConfigError([f"{RECORD}: expected a mapping (a JSON object), got {shown(record)}"], source)
    problems = [f"{RECORD}.{k}: unknown key{did_you_mean(k, known)}" for k in record if k not in known]
    if not isinstance(record.get("preset"), str):
        problems.append(f"{RECORD}.preset: expected a preset name, got {shown(record.get('preset'))}")
    if not isinstance(record.get("model", {}), dict):
        problems.append(f"{RECORD}.model: expected a mapping (a JSON object), got {shown(record['model'])}")
    if problems:
        raise ConfigError(problems, source)
    tree: dict[str, Any] = {"preset": record["preset"]}
    if "model" in record:
        tree["model"] = record["model"]
    data = {k: record[k] for k in ("tokenizer", "bpe_vocab_size") if k in record}
    if data:
        tree["data"] = data
    return tree


def _read_key(r: Reading, key: str, value: Any) -> None:
    """One top-level key of a DeepSpeed JSON into its section of the tree (the scheduler: later)."""
    if key in _BATCH_KEYS:
        r.put(key, "batch", _BATCH_KEYS[key], value)
    elif key == "gradient_clipping":
        r.put(key, "optimizer", "grad_clip", value)
    elif key in (RECORD, "scheduler") or key.startswith("_"):
        return  # the record: by the caller; the scheduler: last; "_comment" and the like: comments
    elif key in _QUIET:
        if value != _QUIET[key]:  # DeepSpeed's own timers and prints, as the JSON asks
            r.extra[key] = value
    elif key == "optimizer":
        read_optimizer(r, value)
    elif key in ("bf16", "bfloat16", "fp16"):
        _read_precision(r, key, value)
    elif key == "zero_optimization":
        _read_zero(r, value)
    elif key in MONITORS:
        _read_monitor(r, key, value)
    elif key == "compile":
        _read_compile(r, value)
    elif key == "tensor_parallel":
        _read_tensor_parallel(r, value)
    elif key == "pipeline":
        _read_pipeline(r, value)
    elif key in DEEPSPEED_PASSTHROUGH_KEYS:
        r.extra[key] = without_auto(value)
    else:
        known = DEEPSPEED_PASSTHROUGH_KEYS | MODELED_DEEPSPEED_KEYS
        near = did_you_mean(key, TRAINING_KEYS)
        if near:  # DeepSpeed would train without it
            r.problems.append(f"'{key}' is not a DeepSpeed config key{near}")
        else:
            r.warnings.append(
                f"'{key}' is not a DeepSpeed config key{did_you_mean(key, known)}; DeepSpeed ignores it, and so does pretrain"
            )


# What the rendered JSON writes for DeepSpeed's own prints and timers (pretrain logs itself).
_QUIET: dict[str, Any] = {"steps_per_print": 1_000_000_000, "wall_clock_breakdown": False}


def tree_from_deepspeed(
    ds: dict[str, Any],
    source: str = "DeepSpeed JSON",
    base: dict[str, Any] | None = None,
    *,
    world_size: int | None = None,
    record: bool = True,
    quiet: bool = False,
) -> dict[str, Any]:
    """Read a DeepSpeed JSON back into (a partial dict of) the tree (`quiet`: no notes or warnings
    on stderr, for a reading done only to find its problems).

    Keys the tree models go to their section, "auto" keeping the tree's value (`base`: the tree
    without this JSON); DeepSpeed's optimizer and LR scheduler are translated (read_optimizer, read_scheduler); other
    keys DeepSpeed knows are kept under `deepspeed_extra`; anything else is an error, and every error
    is reported at once. `world_size` lets a JSON that leaves the micro batch or the accumulation to
    DeepSpeed derive it as DeepSpeed would. With `record`, a rendered JSON's record (preset, model,
    tokenizer) is part of the tree; `build` uses it as the base instead.
    """
    r = Reading(base or {})
    for key, value in ds.items():
        _read_key(r, key, value)
    foreign = RECORD not in ds
    if foreign:
        _deepspeed_defaults(r, ds)
    if "scheduler" in ds:
        read_scheduler(r, ds["scheduler"])
    _resolve_precision(r, ds)
    _read_accumulation(r, ds, foreign)
    _read_batch(r, ds, world_size)
    for key in MONITORS:
        if key not in ds:  # a DeepSpeed JSON without a monitor section has it off
            r.tree.setdefault("logging", {})[key] = False
    if r.problems:
        raise ConfigError(r.problems, source)
    if not quiet and os.environ.get("RANK", "0") == "0":
        for warning in r.warnings:
            print(f"warning: {source}: {warning}", file=sys.stderr)
        for note in r.notes:
            print(f"note: {source}: {note}", file=sys.stderr)
        if foreign:
            print(f"note: {source}: {provenance(r)}", file=sys.stderr)
    tree = r.tree
    if r.extra:
        tree["deepspeed_extra"] = r.extra
    recorded = recorded_run(ds, source) if record else None
    return deep_merge(recorded, tree) if recorded else tree


def _deepspeed_defaults(r: Reading, ds: dict[str, Any]) -> None:
    """What DeepSpeed uses where a JSON written elsewhere leaves a field out: the named optimizer's
    defaults (and a constant LR without a scheduler), clipping at 1.0, ZeRO-0, bf16 off and fp16's
    dynamic scale.
    The preset keeps only what DeepSpeed does not configure (an optimizer the JSON does not name is the
    training script's: pretrain's)."""
    opt = ds.get("optimizer")
    if isinstance(opt, dict) and isinstance(opt.get("params", {}), dict):
        for k, v in {**ADAM_DEFAULTS, "adam_w_mode": True, "bias_correction": True}.items():
            if k not in opt.get("params", {}):
                r.default("optimizer", k, v)
        if "scheduler" not in ds:  # DeepSpeed's optimizer without a scheduler: its lr throughout
            r.default("schedule", "warmup_steps", 0)
            r.default("schedule", "decay", "constant")
    if "gradient_clipping" not in ds:
        r.default("optimizer", "grad_clip", 1.0)  # DeepSpeed 0.19's GRADIENT_CLIPPING_DEFAULT
    if "bf16" not in ds and "bfloat16" not in ds:  # fp32, or fp16 where the JSON turns it on
        r.default("precision", "bf16", False)
    zero = _as_dict(ds.get("zero_optimization"))
    stage = zero.get("stage", 0)
    for k, v in zero_defaults(stage if stage in (0, 1, 2, 3) else 0).items():
        old_name = {"offload_optimizer": "cpu_offload", "offload_param": "cpu_offload_param"}.get(k)
        if k not in zero and old_name not in zero:
            r.default("zero", k, v)
    fp16 = _as_dict(ds.get("fp16"))
    if fp16.get("enabled") is True:
        for k, v in {**FP16_DEFAULTS, "loss_scale": 0.0}.items():
            if k not in fp16:
                r.default("precision", FP16_KEYS[k], v)


# The tree's fields a DeepSpeed JSON configures, for the provenance line.
_DEEPSPEED_FIELDS = {
    "batch": ("micro_batch_size", "gradient_accumulation_steps"),
    "optimizer": ("lr", "betas", "eps", "weight_decay", "grad_clip", "adam_w_mode", "bias_correction"),
    "schedule": ("max_steps", "warmup_steps", "warmup_type", "warmup_start_ratio", "decay", "min_lr_ratio"),
    "precision": ("bf16", "fp16", "loss_scale", "grad_accum_dtype"),
    "zero": ("stage", "offload_optimizer", "offload_param", "overlap_comm", "reduce_bucket_size"),
}


def provenance(r: Reading) -> str:
    """One line: which of the fields DeepSpeed configures came from the JSON, which from DeepSpeed's
    defaults, which from the preset (or config file, or overrides)."""
    from_json: list[str] = []
    from_base: list[str] = []
    for section, keys in _DEEPSPEED_FIELDS.items():
        for key in keys:
            name = f"{section}.{key}"
            if name in r.defaulted:
                continue
            (from_json if key in r.tree.get(section, {}) else from_base).append(name)
    parts = [
        f"from the JSON: {', '.join(from_json) or 'nothing'}",
        f"from DeepSpeed's defaults: {', '.join(r.defaulted) or 'nothing'}",
        f"from the preset (and any config file or override): {', '.join(from_base) or 'nothing'}",
    ]
    return "; ".join(parts)


_BATCH_KEYS = {
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
}


def _read_batch(r: Reading, ds: dict[str, Any], world_size: int | None) -> None:
    """DeepSpeed's batch rule: given two of (train_batch_size, micro batch, accumulation), the world
    size gives the third; a train_batch_size with both others gives the data-parallel size."""
    if any(p.startswith(tuple(_BATCH_KEYS)) for p in r.problems):
        return
    b = r.tree.setdefault("batch", {})
    tbs = b.pop("train_batch_size", None)
    micro = r.current("batch", "micro_batch_size") if "train_micro_batch_size_per_gpu" in ds else None
    acc = r.current("batch", "gradient_accumulation_steps") if "gradient_accumulation_steps" in ds else None
    if tbs is None:
        if micro is not None and acc is None:
            b["gradient_accumulation_steps"] = 1  # DeepSpeed's rule for a micro batch alone
        return
    if micro is not None and acc is not None:
        if is_whole(micro) and is_whole(acc):
            if tbs % (micro * acc):
                r.problems.append(
                    f"train_batch_size ({tbs}) is not a multiple of train_micro_batch_size_per_gpu ({micro})"
                    f" x gradient_accumulation_steps ({acc})"
                )
            else:
                b["data_parallel_size"] = tbs // (micro * acc)
        return
    if world_size is None:
        b["train_batch_size"] = tbs  # the micro batch or accumulation follows from the world size
        return
    _batch_from_world(r, tbs, micro=micro, acc=acc, world_size=world_size)


def _batch_from_world(r: Reading, tbs: Any, *, micro: Any, acc: Any, world_size: int) -> None:
    """A train_batch_size with one of the micro batch and the accumulation: the other one, from the
    data-parallel size the world size leaves."""
    if micro is not None:
        known, name = micro, "train_micro_batch_size_per_gpu"
    else:
        known, name = acc or 1, "gradient_accumulation_steps"
    mp = r.current("parallel", "tensor") * r.current("parallel", "pipeline")
    dp = world_size // mp if is_whole(mp) and mp >= 1 and world_size % mp == 0 else world_size
    ranks = "the world size" if dp == world_size else "the data-parallel size"
    if not is_whole(known) or tbs % (known * dp):
        r.problems.append(f"train_batch_size ({tbs}) is not a multiple of {name} ({known}) x {ranks} ({dp})")
        return
    derived = tbs // (known * dp)
    r.tree["batch"].update(
        {"micro_batch_size": known, "gradient_accumulation_steps": derived}
        if micro is not None
        else {"micro_batch_size": derived, "gradient_accumulation_steps": known}
    )


def _read_precision(r: Reading, key: str, value: Any) -> None:
    """bf16 (or its old name bfloat16) and fp16: `enabled` and the dynamic loss scaling go to
    `precision`; DeepSpeed's other knobs pass through."""
    section = r.mapping(key, value)
    name = "fp16" if key == "fp16" else "bf16"
    for k, v in section.items():
        where = f"{key}.{k}"
        if k == "enabled":
            r.put(where, "precision", name, v)
        elif name == "fp16" and k in FP16_KEYS:
            r.put(where, "precision", FP16_KEYS[k], v)
        elif v != AUTO:
            r.extra.setdefault(name, {})[k] = v


def _resolve_precision(r: Reading, ds: dict[str, Any]) -> None:
    """fp16 and bf16 where the JSON does not switch them on or off itself. A section left out, or
    without `enabled`, is off, as in DeepSpeed; "auto" keeps the tree's choice (it never means on),
    and so does a section left out beside an "auto" one; either is off beside the other switched on."""
    switch = {"fp16": _switch(ds, "fp16"), "bf16": _switch(ds, "bf16", "bfloat16")}
    for name, other in (("fp16", "bf16"), ("bf16", "fp16")):
        mine = switch[name]
        if mine is False or (
            mine in (None, AUTO) and (switch[other] is True or (mine is None and AUTO not in switch.values()))
        ):
            r.put(name, "precision", name, False)


def _read_accumulation(r: Reading, ds: dict[str, Any], foreign: bool) -> None:
    """Under bf16, `data_types.grad_accum_dtype` is the tree's precision.grad_accum_dtype. A JSON
    written elsewhere that leaves it out keeps DeepSpeed's bf16 sums where DeepSpeed has no other
    (ZeRO stage 0), and gets pretrain's fp32 sums at stages 1-3, said in a note. An fp32
    `communication_data_type` beside fp32 sums is what the tree renders for them, not a passthrough."""
    if r.current("precision", "bf16") is not True:
        return  # fp32, fp16: data_types passes through to DeepSpeed as the JSON has it
    types = r.extra.get("data_types")
    given = types.get("grad_accum_dtype") if isinstance(types, dict) else None
    if isinstance(types, dict) and given is not None:
        r.put("data_types.grad_accum_dtype", "precision", "grad_accum_dtype", given)
        del types["grad_accum_dtype"]
        if not types:
            del r.extra["data_types"]
    elif foreign and "grad_accum_dtype" not in r.base.get("precision", {}):
        _accumulation_default(r)
    fp32_sums = r.current("precision", "grad_accum_dtype") == "fp32"
    if fp32_sums and r.extra.get("communication_data_type") == "fp32":
        del r.extra["communication_data_type"]


def _accumulation_default(r: Reading) -> None:
    """A foreign bf16 JSON silent on the sums: bf16 at stage 0 (DeepSpeed's only), else fp32."""
    if r.current("zero", "stage") == 0:
        r.default("precision", "grad_accum_dtype", "bf16")
        r.notes.append(
            "bf16 at ZeRO stage 0 sums the micro batches' gradients in bf16 (DeepSpeed has no fp32 sum there); "
            "zero.stage=1 with precision.grad_accum_dtype=fp32 sums them in fp32"
        )
    else:
        r.notes.append(
            "bf16 without data_types.grad_accum_dtype: the micro batches' gradients are summed in fp32 "
            "(precision.grad_accum_dtype, pretrain's default; DeepSpeed's own would sum them in bf16, "
            "which precision.grad_accum_dtype=bf16 keeps)"
        )


def _switch(ds: dict[str, Any], *keys: str) -> Any:
    """A precision section's `enabled` as the JSON has it: None if the section is left out."""
    for key in keys:
        if key in ds:
            return _as_dict(ds[key]).get("enabled", False)
    return None


# DeepSpeed's deprecated zero_optimization switches -> the `zero` field each one sets.
_OLD_OFFLOAD = {
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
    "cpu_offload_use_pin_memory": "pin_memory",
}


def _read_zero(r: Reading, value: Any) -> None:
    if isinstance(value, bool):
        r.problems.append(
            f'zero_optimization: {json.dumps(value)} is DeepSpeed\'s old boolean form; write {{"stage": 1}} '
            "(or the stage you mean)"
        )
        return
    for k, v in r.mapping("zero_optimization", value).items():
        where = f"zero_optimization.{k}"
        if k in ZERO_KEYS:
            r.put(where, "zero", ZERO_KEYS[k], v)
        elif k in ("offload_optimizer", "offload_param"):
            _read_offload(r, k, v)
        elif k in _OLD_OFFLOAD:
            r.put(where, "zero", _OLD_OFFLOAD[k], v)
        elif (
            v != AUTO or k in ZERO_AUTO
        ):  # "auto": sized from the model when rendered, or DeepSpeed's default
            r.extra.setdefault("zero_optimization", {})[k] = v


def _read_compile(r: Reading, value: Any) -> None:
    """DeepSpeed's `compile` section configures DeepCompile, its compiler passes, which pretrain does
    not use: compiling is the tree's `compile` section (torch.compile through `engine.compile`).
    DeepCompile left off is accepted; anything else is one problem per key."""
    for k, v in r.mapping("compile", value).items():
        if k == "deepcompile" and v in (False, AUTO):
            continue
        r.problems.append(
            f"compile.{k}: DeepSpeed's DeepCompile is not modeled: pretrain compiles the model with "
            "torch.compile; drop the key and pass --set compile.enabled=true"
        )


def _read_tensor_parallel(r: Reading, value: Any) -> None:
    """AutoTP's degree into parallel.tensor. The partition of the layers is the model's own (rendered
    from the model, see ds_render.autotp_layer_specs), so a JSON's partition_config is read only to be
    replaced; DeepSpeed's other AutoTP knobs pass through."""
    for k, v in r.mapping("tensor_parallel", value).items():
        if k in TENSOR_PARALLEL_KEYS:
            if v == 0:  # DeepSpeed's "off"
                v = 1
            r.put(f"tensor_parallel.{k}", "parallel", TENSOR_PARALLEL_KEYS[k], v)
        elif k == "partition_config":
            if _foreign_partition(v):
                r.notes.append(
                    "tensor_parallel.partition_config: replaced by the partition of this GPT's layers "
                    "(pretrain render shows it)"
                )
        elif v != AUTO:
            r.extra.setdefault("tensor_parallel", {})[k] = v


def _rendered_monitor_path(r: Reading, key: str, k: str) -> str:
    """What pretrain renders for a monitor's output_path (the run dir) or job_name."""
    if k == "job_name":
        return MONITOR_DIRS[key]
    preset = r.base.get("preset") or r.tree.get("preset") or ""
    return str(r.current("logging", "run_dir")).format(preset=preset)


def _foreign_partition(value: Any) -> bool:
    """Whether a partition_config is not the one pretrain renders (its layers and split types)."""
    from pretrain.config.ds_render import autotp_layer_specs
    from pretrain.config.tree import ModelConfig

    ours = [(s["patterns"], s["partition_type"]) for s in autotp_layer_specs(ModelConfig())]
    specs = value.get("layer_specs") if isinstance(value, dict) else None
    theirs = [(s.get("patterns"), s.get("partition_type")) for s in specs or [] if isinstance(s, dict)]
    return theirs != ours or bool(value.get("use_default_specs"))


def _read_pipeline(r: Reading, value: Any) -> None:
    """The pipeline section into `parallel`: stages, partition method, activation checkpointing.
    DeepSpeed's defaults ("stages": "auto", "partition": "best") keep the tree's values."""
    for k, v in r.mapping("pipeline", value).items():
        where = f"pipeline.{k}"
        if k == "partition" and v == "best":
            continue  # DeepSpeed's default, which its PipelineModule does not implement
        if k == "activation_checkpoint_interval" and v == int(
            bool(r.current("model", "activation_checkpointing"))
        ):
            continue  # what the tree's default (None) renders
        if k in PIPELINE_KEYS:
            r.put(where, "parallel", PIPELINE_KEYS[k], v)
        elif v != AUTO:
            r.extra.setdefault("pipeline", {})[k] = v


def _read_offload(r: Reading, key: str, value: Any) -> None:
    where = f"zero_optimization.{key}"
    if value is None:
        r.put(where, "zero", key, False)
        return
    off = r.mapping(where, value)
    device = off.get("device", "none")
    if device == "nvme":
        r.problems.append(
            f"{where}.device: NVMe offload (ZeRO-Infinity) is not modeled: pretrain offloads to CPU "
            'memory only; write "device": "cpu"'
        )
    elif device in ("cpu", "none", None):
        r.put(f"{where}.device", "zero", key, device == "cpu")
    elif device != AUTO:
        r.problems.append(f'{where}.device: expected "cpu" or "none", got {shown(device)}')
    if "pin_memory" in off:
        r.put(f"{where}.pin_memory", "zero", "pin_memory", off["pin_memory"])
    for k, v in off.items():
        if k not in ("device", "pin_memory") and v != AUTO:
            r.extra.setdefault("zero_optimization", {}).setdefault(key, {})[k] = v


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _read_monitor(r: Reading, key: str, value: Any) -> None:
    """A monitor section back into `logging`. Output paths are not read: pretrain writes every
    monitor under the run dir (`logging.run_dir`), so the rendered path follows the run."""
    section = r.mapping(key, value)
    known = (
        {"enabled", "project", "group", "team"} if key == "wandb" else {"enabled", "output_path", "job_name"}
    )
    for k, v in section.items():
        if k not in known:
            r.problems.append(f"{key}.{k}: not a DeepSpeed {key} key{did_you_mean(k, known)}")
        elif k == "enabled":
            r.put(f"{key}.{k}", "logging", key, v)
        elif key == "wandb":
            r.put(f"{key}.{k}", "logging", f"wandb_{k}", v)
        elif v != AUTO and v != _rendered_monitor_path(r, key, k):
            run_dir = _rendered_monitor_path(r, key, "output_path")
            r.warnings.append(
                f"{key}.{k} ({json.dumps(v)}): not used; pretrain writes {key} to {run_dir}/{MONITOR_DIRS[key]} "
                "(logging.run_dir, the run's own directory): set logging.run_dir to write it elsewhere"
            )
    if "enabled" not in section:
        r.put(key, "logging", key, False)  # DeepSpeed's default
