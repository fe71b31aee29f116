"""The DeepSpeed JSON: rendered from the tree, read back into it, and checked by DeepSpeed itself.

`render_deepspeed` writes every key the tree models, then the `deepspeed_extra` passthrough, and
records under `pretrain` (a key DeepSpeed ignores) the preset, model and tokenizer it was rendered
for. `tree_from_deepspeed` reads a DeepSpeed JSON back into (a partial dict of) the tree, so that
the JSONs in ds_configs/ start a run on their own, and those users bring (translated by
ds_import.py) start one from a preset. The monitors (TensorBoard, CSV, W&B) are DeepSpeed's,
configured from `logging`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pydantic import ValidationError

from pretrain.config import (
    DEEPSPEED_PASSTHROUGH_KEYS,
    FP16_KEYS,
    MODELED_DEEPSPEED_KEYS,
    ZERO_AUTO,
    ZERO_KEYS,
    RunConfig,
    auto_paths,
    deep_merge,
)
from pretrain.ds_import import (
    AUTO,
    Reading,
    is_number,
    is_whole,
    read_optimizer,
    read_scheduler,
    shown,
    without_auto,
)
from pretrain.errors import ConfigError, did_you_mean

RECORD = "pretrain"  # the top-level key of a rendered JSON that records what it was rendered for


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
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": o.grad_clip,
        "bf16": {"enabled": p.bf16},
        "fp16": {
            "enabled": p.fp16,
            "loss_scale": 0,
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
    }
    out = deep_merge(out, cfg.deepspeed_extra)
    for key, size in ZERO_AUTO.items():  # "auto" in unmodeled ZeRO knobs: sized from the model width
        if out["zero_optimization"].get(key) == AUTO:
            out["zero_optimization"][key] = size(cfg.model.n_embd)
    left = auto_paths(out)  # the tree's rules leave none; DeepSpeed must never see one
    if left:
        raise ConfigError([f"{p}: 'auto' has nothing in the tree to resolve from" for p in left], "render")
    return out


# DeepSpeed's monitors (deepspeed/monitor/config.py) that the tree models, in `logging`. Those with
# files write under the run dir, each in its own subdirectory (DeepSpeed's `job_name`).
MONITORS = ("tensorboard", "csv_monitor", "wandb")
MONITOR_DIRS = {"tensorboard": "tensorboard", "csv_monitor": "csv_monitor"}


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


def tree_from_deepspeed(
    ds: dict[str, Any],
    source: str = "DeepSpeed JSON",
    base: dict[str, Any] | None = None,
    world_size: int | None = None,
    record: bool = True,
) -> dict[str, Any]:
    """Read a DeepSpeed JSON back into (a partial dict of) the tree.

    Keys the tree models go to their section, "auto" keeping the tree's value (`base`: the tree
    without this JSON); DeepSpeed's optimizer and LR scheduler are translated (ds_import.py); other
    keys DeepSpeed knows are kept under `deepspeed_extra`; anything else is an error, and every error
    is reported at once. `world_size` lets a JSON that leaves the micro batch or the accumulation to
    DeepSpeed derive it as DeepSpeed would. With `record`, a rendered JSON's record (preset, model,
    tokenizer) is part of the tree; `build` uses it as the base instead.
    """
    r = Reading(base or {})
    for key, value in ds.items():
        if key in _BATCH_KEYS:
            r.put(key, "batch", _BATCH_KEYS[key], value)
        elif key == "gradient_clipping":
            r.put(key, "optimizer", "grad_clip", value)
        elif key in (RECORD, "scheduler", "steps_per_print", "wall_clock_breakdown"):
            continue  # the record: below; the scheduler: last; pretrain does its own logging
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
        elif key in DEEPSPEED_PASSTHROUGH_KEYS:
            r.extra[key] = without_auto(value)
        else:
            known = DEEPSPEED_PASSTHROUGH_KEYS | MODELED_DEEPSPEED_KEYS
            r.problems.append(f"'{key}' is not a DeepSpeed config key{did_you_mean(key, known)}")
    if "scheduler" in ds:
        read_scheduler(r, ds["scheduler"])
    _resolve_precision(r, ds)
    _read_batch(r, ds, world_size)
    for key in MONITORS:
        if key not in ds:  # a DeepSpeed JSON without a monitor section has it off
            r.tree.setdefault("logging", {})[key] = False
    if r.problems:
        raise ConfigError(r.problems, source)
    if os.environ.get("RANK", "0") == "0":
        for note in r.notes:
            print(f"note: {source}: {note}", file=sys.stderr)
    tree = r.tree
    if r.extra:
        tree["deepspeed_extra"] = r.extra
    recorded = recorded_run(ds, source) if record else None
    return deep_merge(recorded, tree) if recorded else tree


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
    if micro is not None:
        known, name = micro, "train_micro_batch_size_per_gpu"
    else:
        known, name = acc or 1, "gradient_accumulation_steps"
    if not is_whole(known) or tbs % (known * world_size):
        r.problems.append(
            f"train_batch_size ({tbs}) is not a multiple of {name} ({known}) x the world size ({world_size})"
        )
        return
    derived = tbs // (known * world_size)
    b.update(
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
        elif name == "fp16" and k == "loss_scale":
            if is_number(v) and v != 0 and section.get("enabled") is not False:
                r.problems.append(
                    f"{where}: a static loss scale ({v}) is not supported: pretrain scales the loss "
                    "dynamically (loss_scale 0, from 2**initial_scale_power)"
                )
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
    if "enabled" not in section:
        r.put(key, "logging", key, False)  # DeepSpeed's default


def check_with_deepspeed(ds: dict[str, Any]) -> None:
    """Run DeepSpeed's own config parser over a rendered JSON (no process group needed)."""
    # torch and DeepSpeed only here: rendering and reading back stay light for the CLI.
    import torch.distributed as tdist
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    ds = json.loads(json.dumps(ds))
    if not (tdist.is_available() and tdist.is_initialized()):
        # Without a process group DeepSpeed assumes world size 1 for its batch check; the tree
        # has already checked train_batch_size against the world size, so let DeepSpeed derive it.
        ds.pop("train_batch_size", None)
    try:
        DeepSpeedConfig(ds)
    except (DeepSpeedConfigError, ValidationError, ValueError, AssertionError, KeyError, TypeError) as e:
        raise ConfigError([f"DeepSpeed rejects the config: {e}"], "DeepSpeed config") from e
