"""The DeepSpeed JSON: rendered from the tree, read back into it, and checked by DeepSpeed itself.

`render_deepspeed` writes every key the tree models, then the `deepspeed_extra` passthrough;
`tree_from_deepspeed` reads a DeepSpeed JSON back into (a partial dict of) the tree, so that the
JSONs in ds_configs/ (and those users bring) start a run. The monitors (TensorBoard, CSV, W&B) are
DeepSpeed's, configured from `logging`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pretrain.config import (
    DEEPSPEED_PASSTHROUGH_KEYS,
    MODELED_DEEPSPEED_KEYS,
    ZERO_KEYS,
    RunConfig,
    deep_merge,
)
from pretrain.errors import ConfigError, did_you_mean


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
    return deep_merge(out, cfg.deepspeed_extra)


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


_FP16_KEYS = {"initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}


def tree_from_deepspeed(ds: dict[str, Any], source: str = "DeepSpeed JSON") -> dict[str, Any]:
    """Read a DeepSpeed JSON back into (a partial dict of) the tree.

    Keys the tree models go to their section; other keys DeepSpeed knows are kept under
    `deepspeed_extra`; a key DeepSpeed does not know is an error naming it.
    """
    problems: list[str] = []
    tree: dict[str, Any] = {}
    extra: dict[str, Any] = {}

    def put(section: str, key: str, value: Any) -> None:
        tree.setdefault(section, {})[key] = value

    for key, value in ds.items():
        if key == "train_batch_size":
            put("batch", "train_batch_size", value)
        elif key == "train_micro_batch_size_per_gpu":
            put("batch", "micro_batch_size", value)
        elif key == "gradient_accumulation_steps":
            put("batch", "gradient_accumulation_steps", value)
        elif key == "gradient_clipping":
            put("optimizer", "grad_clip", value)
        elif key in ("steps_per_print", "wall_clock_breakdown"):
            continue  # pretrain does its own logging
        elif key == "optimizer":
            problems += _read_optimizer(value, put)
        elif key == "scheduler":
            problems.append(
                "scheduler: pretrain sets the LR itself (warmup + cosine); use the tree's `schedule` section"
            )
        elif key == "bf16":
            put("precision", "bf16", bool(_as_dict(value).get("enabled", False)))
        elif key == "fp16":
            fp16 = _as_dict(value)
            put("precision", "fp16", bool(fp16.get("enabled", False)))
            if fp16.get("loss_scale", 0) not in (0, 0.0):
                problems.append("fp16.loss_scale: only dynamic loss scaling (loss_scale 0) is supported")
            for k, v in fp16.items():
                if k in _FP16_KEYS:
                    put("precision", k, v)
                elif k not in ("enabled", "loss_scale"):
                    extra.setdefault("fp16", {})[k] = v
        elif key == "zero_optimization":
            problems += _read_zero(_as_dict(value), put, extra)
        elif key in MONITORS:
            problems += _read_monitor(key, _as_dict(value), put)
        elif key in DEEPSPEED_PASSTHROUGH_KEYS:
            extra[key] = value
        else:
            problems.append(
                f"'{key}' is not a DeepSpeed config key{did_you_mean(key, DEEPSPEED_PASSTHROUGH_KEYS | MODELED_DEEPSPEED_KEYS)}"
            )
    for key in MONITORS:
        if key not in ds:  # a DeepSpeed JSON without a monitor section has it off
            put("logging", key, False)
    if problems:
        raise ConfigError(problems, source)
    if "fp16" in extra:
        problems.append("fp16: keys " + ", ".join(sorted(extra["fp16"])) + " are not supported")
        raise ConfigError(problems, source)
    b = tree.get("batch", {})
    tbs, micro, acc = (
        b.pop("train_batch_size", None),
        b.get("micro_batch_size"),
        b.get("gradient_accumulation_steps", 1),
    )
    if tbs is not None and micro is not None:
        if tbs % (micro * acc):
            raise ConfigError(
                [
                    f"train_batch_size ({tbs}) is not a multiple of micro batch ({micro}) x accumulation ({acc})"
                ],
                source,
            )
        b["data_parallel_size"] = tbs // (micro * acc)
    if extra:
        tree["deepspeed_extra"] = extra
    return tree


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _read_optimizer(value: Any, put: Any) -> list[str]:
    opt = _as_dict(value)
    kind = opt.get("type", "")
    if str(kind).lower() not in ("adamw", "adam"):
        return [f"optimizer.type: pretrain trains with AdamW, got {kind!r}"]
    problems = []
    params = _as_dict(opt.get("params", {}))
    for k, v in params.items():
        if k in ("lr", "betas", "eps", "weight_decay"):
            put("optimizer", k, tuple(v) if k == "betas" else v)
        elif k == "torch_adam":
            put("optimizer", "fused_adam", not v)
            if v:
                put("optimizer", "torch_fused", bool(params.get("fused", False)))
        elif k == "fused" and params.get("torch_adam"):
            continue  # read with torch_adam
        elif k == "adam_w_mode" and (v or str(kind).lower() == "adamw"):
            continue
        else:
            problems.append(f"optimizer.params.{k}: not supported by pretrain")
    return problems


def _read_zero(zero: dict[str, Any], put: Any, extra: dict[str, Any]) -> list[str]:
    problems = []
    for k, v in zero.items():
        if k in ZERO_KEYS:
            put("zero", ZERO_KEYS[k], v)
        elif k in ("offload_optimizer", "offload_param"):
            off = _as_dict(v)
            device = off.get("device", "none")
            if device not in ("cpu", "none", None):
                problems.append(
                    f"zero_optimization.{k}.device: only 'cpu' offload is modeled, got {device!r}"
                )
            put("zero", k, device == "cpu")
            if "pin_memory" in off:
                put("zero", "pin_memory", bool(off["pin_memory"]))
            for ok in set(off) - {"device", "pin_memory"}:
                extra.setdefault("zero_optimization", {}).setdefault(k, {})[ok] = off[ok]
        else:
            extra.setdefault("zero_optimization", {})[k] = v
    return problems


def _read_monitor(key: str, section: dict[str, Any], put: Any) -> list[str]:
    """A monitor section back into `logging`. Output paths are not read: pretrain writes every
    monitor under the run dir (`logging.run_dir`), so the rendered path follows the run."""
    known = {"enabled", "output_path", "job_name", "project", "group", "team"}
    known -= {"output_path", "job_name"} if key == "wandb" else {"project", "group", "team"}
    problems = [f"{key}.{k}: not a DeepSpeed {key} key" for k in section if k not in known]
    put("logging", key, bool(section.get("enabled", False)))
    if key == "wandb":
        for k in ("project", "group", "team"):
            if k in section:
                put("logging", f"wandb_{k}", section[k])
    return problems


def check_with_deepspeed(ds: dict[str, Any]) -> None:
    """Run DeepSpeed's own config parser over a rendered JSON (no process group needed)."""
    # torch and DeepSpeed only here: rendering and reading back stay light for the CLI.
    import torch.distributed as tdist
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = json.loads(json.dumps(ds))
    if not (tdist.is_available() and tdist.is_initialized()):
        # Without a process group DeepSpeed assumes world size 1 for its batch check; the tree
        # has already checked train_batch_size against the world size, so let DeepSpeed derive it.
        ds.pop("train_batch_size", None)
    try:
        DeepSpeedConfig(ds)
    except (ValidationError, ValueError, AssertionError, KeyError, TypeError) as e:
        raise ConfigError([f"DeepSpeed rejects the config: {e}"], "DeepSpeed config") from e
