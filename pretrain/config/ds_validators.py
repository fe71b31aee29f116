"""Every section of a DeepSpeed JSON checked by DeepSpeed's own validators (its pydantic models,
and models built from its tables of defaults), with a "did you mean" for a misspelt key. Imports
DeepSpeed, on first use only."""

from __future__ import annotations

from functools import cache
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from pretrain.config.ds_keys import AUTO, DEEPSPEED_PASSTHROUGH_KEYS
from pretrain.config.ds_values import not_a_mapping, shown, type_problem
from pretrain.errors import did_you_mean

# ---------------------------------------------------------------------------------------------
# DeepSpeed's own validators, for every section

# Top-level scalars DeepSpeed reads (deepspeed/runtime/constants.py), with their types.
_SCALARS: dict[str, Any] = {
    "steps_per_print": int,
    "wall_clock_breakdown": bool,
    "prescale_gradients": bool,
    "gradient_predivide_factor": float,
    "sparse_gradients": bool,
    "communication_data_type": str | None,
    "seq_parallel_communication_data_type": str,
    "zero_allow_untested_optimizer": bool,
    "zero_force_ds_cpu_optimizer": bool,
    "graph_harvesting": bool,
    "disable_allgather": bool,
    "dump_state": bool,
    "memory_breakdown": bool,
    "dataloader_drop_last": bool,
    "use_data_before_expert_parallelism": bool,
    "use_node_local_storage": bool,
}

# Sections read elsewhere: the record of a rendered JSON (recorded_run), and the two ds_optimizer.py
# translates.
_NOT_CHECKED = {"pretrain", "optimizer", "scheduler"}


def _from_defaults(name: str, defaults: dict[str, Any]) -> type[BaseModel]:
    """A pydantic model of a section DeepSpeed reads key by key, from its table of defaults."""
    fields: Any = {k: (type(v) if v is not None else Any, v) for k, v in defaults.items()}
    return create_model(name, __config__=ConfigDict(extra="forbid"), **fields)


@cache
def _deepspeed_models() -> dict[str, type[BaseModel]]:
    """DeepSpeed's config model of each section: its pydantic models, or, for the sections it reads
    key by key, models built from its tables of defaults."""
    # DeepSpeed (and torch) only here: the CLI's light commands never import them.
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.profiling import constants as flops
    from deepspeed.runtime.activation_checkpointing.config import ACT_CHKPT_DEFAULT
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.swap_tensor.aio_config import AIO_DEFAULT_DICT
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

    flops_defaults = {
        getattr(flops, name): getattr(flops, f"{name}_DEFAULT")
        for name in dir(flops)
        if name.startswith("FLOPS_PROFILER_") and hasattr(flops, f"{name}_DEFAULT")
    }
    timers: Any = {"throughput": (DeepSpeedThroughputTimerConfig | None, None)}
    return {
        "zero_optimization": DeepSpeedZeroConfig,
        "fp16": DeepSpeedFP16Config,
        "bf16": DeepSpeedBF16Config,
        "bfloat16": DeepSpeedBF16Config,
        "tensorboard": TensorBoardConfig,
        "csv_monitor": CSVConfig,
        "wandb": WandbConfig,
        "comet": CometConfig,
        "comms_logger": CommsLoggerConfig,
        "compile": CompileConfig,
        "hybrid_engine": HybridEngineConfig,
        "tensor_parallel": TPTrainingConfig,
        "timers": create_model("timers", __config__=ConfigDict(extra="forbid"), **timers),
        "activation_checkpointing": _from_defaults("activation_checkpointing", ACT_CHKPT_DEFAULT),
        "flops_profiler": _from_defaults("flops_profiler", flops_defaults),
        "aio": _from_defaults("aio", AIO_DEFAULT_DICT),
    }


def deepspeed_problems(ds: dict[str, Any]) -> list[str]:
    """Every problem DeepSpeed's own validators find in the sections of a DeepSpeed JSON, with a
    "did you mean" for a misspelt key. "auto" in a known key is left out: pretrain resolves it."""
    from deepspeed.runtime import config  # its tables of removed keys, and why each went

    models = _deepspeed_models()
    removed = getattr(config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS", {})
    removed_zero = getattr(config, "_REMOVED_ZERO_CONFIG_KEYS", {})
    problems = [f"{key}: {removed[key]}" for key in ds if key in removed]
    zero = ds.get("zero_optimization")
    if isinstance(zero, dict):
        problems += [f"zero_optimization.{key}: {removed_zero[key]}" for key in zero if key in removed_zero]
    for key, value in ds.items():
        if key in _NOT_CHECKED or key in removed or value == AUTO:
            continue
        if key in _SCALARS:
            if problem := type_problem(value, _SCALARS[key]):
                problems.append(f"{key}: {problem}")
        elif not isinstance(value, dict) and (key in models or key in DEEPSPEED_PASSTHROUGH_KEYS):
            problems.append(not_a_mapping(key, value))
        elif key in models:
            if key == "zero_optimization":
                value = {k: v for k, v in value.items() if k not in removed_zero}  # said above
            problems += _model_problems(models[key], _known_autos_out(models[key], value), key)
    return problems


def _known_autos_out(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """`data` without the "auto" of known keys (pretrain resolves them). A misspelt key keeps a
    value (DeepSpeed's models drop "auto" ones unseen), so that the validator names it."""
    out = {}
    for k, v in data.items():
        info = _field(model, k)
        sub = _model_of(info.annotation) if info is not None else None
        if v == AUTO and info is not None:
            continue
        out[k] = (
            _known_autos_out(sub, v) if sub is not None and isinstance(v, dict) else None if v == AUTO else v
        )
    return out


def _model_problems(model: type[BaseModel], data: dict[str, Any], where: str) -> list[str]:
    problems = _strict_problems(model, data, where)
    seen = {p.split(": ")[0] for p in problems}
    try:
        model.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = [str(x) for x in err["loc"]]
            at = ".".join([where, *loc])
            if at in seen:
                continue
            if err["type"] == "extra_forbidden":
                names = _names(_model_at(model, loc[:-1]))
                hint = did_you_mean(loc[-1], names)
                if not hint and names:  # nothing near: what this section does take
                    hint = f"; DeepSpeed 0.19 takes {', '.join(sorted(names))}: drop it or use one of those"
                msg = f"unknown key{hint}"
            else:
                msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
                if loc:
                    msg += f" (got {shown(err['input'])})"
            problems.append(f"{at}: {msg}")
    except Exception as e:  # a DeepSpeed validator that raises something else: still one message
        problems.append(f"{where}: DeepSpeed rejects it: {e}")
    return problems


def _strict_problems(model: type[BaseModel], data: dict[str, Any], where: str) -> list[str]:
    """The values of the wrong JSON type, which pydantic's lax mode would take ("true", "2")."""
    problems = []
    for k, v in data.items():
        info = _field(model, k)
        if info is None:
            continue  # unknown: pydantic says so
        sub = _model_of(info.annotation)
        if sub is not None and isinstance(v, dict):
            problems += _strict_problems(sub, v, f"{where}.{k}")
        elif problem := type_problem(v, info.annotation):
            problems.append(f"{where}.{k}: {problem}")
    return problems


def _field(model: type[BaseModel], key: str) -> Any:
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return info
    return None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (also when optional), or None."""
    for a in (annotation, *get_args(annotation)):
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def _model_at(model: type[BaseModel] | None, loc: list[str]) -> type[BaseModel] | None:
    for part in loc:
        info = _field(model, part) if model is not None else None
        model = _model_of(info.annotation) if info is not None else None
    return model


def _names(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return [n for name, info in model.model_fields.items() for n in (name, info.alias) if n]
