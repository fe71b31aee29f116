"""DeepSpeed JSONs written elsewhere, in the tree's terms.

Users bring DeepSpeed JSONs from DeepSpeed's tutorials, the Hugging Face Trainer (full of "auto"),
Megatron-DeepSpeed and GPT-NeoX, and the JSONs `ds_render` wrote. `tree_from_deepspeed` reads
them into the tree with the pieces here: a `Reading` takes each value for the tree with a strict type check, "auto" keeping the tree's
value; `read_optimizer` and `read_scheduler` translate DeepSpeed's optimizer and LR scheduler where
the tree can express them, and say why not where it cannot; `deepspeed_problems` checks the other
sections with DeepSpeed's own validators. It imports DeepSpeed (seconds), so the commands that only
need the tree (`launch-env`, `prepare`) never call it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model

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
from pretrain.config.tree import RunConfig, deep_merge
from pretrain.errors import ConfigError, did_you_mean

# ---------------------------------------------------------------------------------------------
# Values and their types


def shown(value: Any) -> str:
    """A JSON value as the user wrote it, saying when it is a string."""
    text = json.dumps(value, default=str)
    return f"{text} (a string)" if isinstance(value, str) else text


def not_a_mapping(where: str, value: Any) -> str:
    """The problem with a section given as a scalar, with the likely fix (`"zero_optimization": 2`
    meant `{"stage": 2}`; `"fp16": true` meant `{"enabled": true}`)."""
    fix = ""
    if where == "zero_optimization" and value in (0, 1, 2, 3) and not isinstance(value, bool):
        fix = f': write "zero_optimization": {{"stage": {value}}}'
    elif where in ("fp16", "bf16") and isinstance(value, bool):
        fix = f': write "{where}": {{"enabled": {json.dumps(value)}}}'
    return f"{where}: expected a mapping (a JSON object), got {shown(value)}{fix}"


def is_whole(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _accept(value: Any) -> bool:
    return True


# What JSON gives for each annotation type_problem meets, and how its error names it.
_JSON_TYPES: dict[Any, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (is_whole, "a whole number"),
    float: (is_number, "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
    Path: (lambda v: isinstance(v, str), "a path (a string)"),
    dict: (lambda v: isinstance(v, dict), "a mapping (a JSON object)"),
    list: (lambda v: isinstance(v, list), "a list"),
    tuple: (lambda v: isinstance(v, list) and all(is_number(x) for x in v), "a list of numbers"),
}


def type_problem(value: Any, annotation: Any) -> str | None:
    """Why `value`, read from JSON, does not have the type `annotation`; None if it does.

    Stricter than pydantic's lax mode, which takes "true" for true and "2" for 2: in a DeepSpeed JSON
    those are mistakes. Whole-valued floats (5e8) are whole numbers, as JSON writes them."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return type_problem(value, get_args(annotation)[0])
    if origin in (Union, UnionType):
        return _union_problem(value, get_args(annotation))
    if origin is Literal:
        return _literal_problem(value, get_args(annotation))
    ok, want = _JSON_TYPES.get(origin or _as_json(annotation), (_accept, ""))
    return None if ok(value) else f"expected {want}, got {shown(value)}"


def _union_problem(value: Any, members: tuple[Any, ...]) -> str | None:
    """`value` against `A | B | None`: None if any member takes it, else the first member's problem."""
    options = [a for a in members if a is not type(None)]
    if value is None and len(options) < len(members):
        return None
    problems = [type_problem(value, a) for a in options]
    return None if None in problems else problems[0]


def _literal_problem(value: Any, choices: tuple[Any, ...]) -> str | None:
    if any(value == c and type(value) is type(c) for c in choices):
        return None
    return f"expected one of {', '.join(json.dumps(c) for c in choices)}, got {shown(value)}"


def _as_json(annotation: Any) -> Any:
    """The JSON type of an enum (its values' type, int or str) or a section (a mapping)."""
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return int if issubclass(annotation, int) else str if issubclass(annotation, str) else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return dict
    return annotation


@cache
def _field_adapter(section: str, key: str) -> tuple[Any, TypeAdapter[Any]]:
    model = RunConfig.model_fields[section].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel)
    info = model.model_fields[key]
    # a type built at run time: the field's annotation with its bounds (its metadata), not its
    # default or its model's validators
    bounded: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return info.annotation, TypeAdapter(bounded)


def field_value(section: str, key: str, value: Any) -> Any:
    """`value` as the tree's field section.key takes it; ValueError says why it cannot."""
    annotation, adapter = _field_adapter(section, key)
    problem = type_problem(value, annotation)
    if problem:
        raise ValueError(problem)
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        raise ValueError(f"{e.errors()[0]['msg']} (got {shown(value)})") from None


def without_auto(value: Any) -> Any:
    """`value` with every "auto" entry left out: DeepSpeed's default, as the Hugging Face Trainer
    leaves the keys it has nothing for."""
    if isinstance(value, dict):
        return {k: without_auto(v) for k, v in value.items() if v != AUTO}
    return value


# ---------------------------------------------------------------------------------------------
# A JSON on its way into the tree


@dataclass
class Reading:
    """What one DeepSpeed JSON sets in the tree, what it passes through, what is wrong with it.

    `base` is the tree without the JSON (preset, config file, overrides): what "auto" and the LR
    scheduler's ratios resolve against."""

    base: dict[str, Any]
    tree: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    origin: dict[tuple[str, str], str] = field(default_factory=dict)
    defaulted: list[str] = field(default_factory=list)

    def default(self, section: str, key: str, value: Any) -> None:
        """DeepSpeed's default for section.key, where the JSON left it out (and nothing it set has)."""
        if key not in self.tree.get(section, {}):
            self.tree.setdefault(section, {})[key] = field_value(section, key, value)
            self.defaulted.append(f"{section}.{key}")

    def put(self, where: str, section: str, key: str, value: Any, *, replace: bool = False) -> None:
        """Set the tree's section.key from the JSON's `where`. "auto" keeps the tree's value; a value
        of the wrong type, out of bounds, or contradicting another key of the JSON is a problem."""
        if value == AUTO:
            return
        try:
            value = field_value(section, key, value)
        except ValueError as e:
            self.problems.append(f"{where}: {e}")
            return
        had = self.tree.get(section, {})
        if key in had and had[key] != value and not replace:
            self.problems.append(
                f"{where} ({json.dumps(value)}) contradicts {self.origin[(section, key)]} ({json.dumps(had[key])})"
            )
            return
        self.tree.setdefault(section, {})[key] = value
        self.origin[(section, key)] = where

    def current(self, section: str, key: str) -> Any:
        """The tree's section.key as it stands: set by the JSON, else by the base, else the default."""
        for layer in (self.tree, self.base):
            if key in layer.get(section, {}):
                return layer[section][key]
        model = RunConfig.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        return model.model_fields[key].default

    def mapping(self, where: str, value: Any) -> dict[str, Any]:
        """A section of the JSON, which must be a mapping; {} (and a problem) if it is not."""
        if isinstance(value, dict):
            return value
        self.problems.append(not_a_mapping(where, value))
        return {}

    def unknown(self, where: str, section: dict[str, Any], known: set[str] | dict[str, Any]) -> None:
        for k in section:
            if k not in known:
                self.problems.append(f"{where}.{k}: unknown key{did_you_mean(k, list(known))}")


# ---------------------------------------------------------------------------------------------
# The optimizer

_ADAM_PARAMS = {
    "lr", "betas", "eps", "weight_decay", "torch_adam", "fused", "adam_w_mode", "bias_correction",
    "amsgrad", "max_grad_norm",
}  # fmt: skip


# Adam parameters accepted as they are: adam_w_mode under type AdamW (which ignores it), and
# DeepSpeed's defaults.
_ACCEPTED = {"adam_w_mode": (True, False), "bias_correction": (True,), "amsgrad": (False,)}


def read_optimizer(r: Reading, value: Any) -> None:
    """DeepSpeed's Adam (AdamW unless adam_w_mode is false) and AdamW into the `optimizer` section."""
    opt = r.mapping("optimizer", value)
    r.unknown("optimizer", opt, {"type", "params", "legacy_fusion"})
    kind = opt.get("type")
    if not isinstance(kind, str) or kind.lower() not in ("adam", "adamw"):
        r.problems.append(
            f"optimizer.type: {json.dumps(kind)} is not supported: pretrain trains with AdamW; write "
            '"type": "AdamW" (or DeepSpeed\'s "Adam", which is AdamW too), or leave out `optimizer` '
            "and set the tree's `optimizer` section"
        )
        return
    if opt.get("legacy_fusion", False) is not False:
        r.problems.append("optimizer.legacy_fusion: DeepSpeed's legacy fused optimizer is not supported")
    params = r.mapping("optimizer.params", opt.get("params", {}))
    for k, v in params.items():
        where = f"optimizer.params.{k}"
        if k in ("lr", "betas", "eps", "weight_decay"):
            r.put(where, "optimizer", k, v)
        elif k == "torch_adam":
            r.put(where, "optimizer", "fused_adam", not v if isinstance(v, bool) else v)
            if v is True:
                r.put(where, "optimizer", "torch_fused", params.get("fused", False))
        elif k == "fused" and params.get("torch_adam") is True:
            continue  # read with torch_adam: torch.optim.AdamW's fused kernel
        elif k == "bias_correction" and v is False:
            r.put(where, "optimizer", "bias_correction", False)
            if "torch_adam" not in params:  # what DeepSpeed builds for it: FusedAdam (or CPUAdam, offloaded)
                r.put(where, "optimizer", "fused_adam", True)
        elif k == "adam_w_mode" and v is False and kind.lower() == "adam":
            r.put(where, "optimizer", "adam_w_mode", False)  # Adam with L2 regularization
        elif any(v is ok for ok in _ACCEPTED.get(k, ())):
            continue
        elif k == "max_grad_norm":
            r.problems.append(
                f"{where}: DeepSpeed 0.19 refuses the old FusedAdam's own clipping; write "
                f'"gradient_clipping": {json.dumps(v)} at the top level and drop max_grad_norm'
            )
        else:
            why = {
                "amsgrad": ": pretrain's AdamW does not use AMSGrad",
                "fused": ": only with torch_adam true (torch.optim.AdamW's fused kernel)",
            }.get(k, did_you_mean(k, _ADAM_PARAMS))
            r.problems.append(f"{where}: not supported by pretrain{why}")


# ---------------------------------------------------------------------------------------------
# The LR scheduler

REQUIRED = "(required)"

# DeepSpeed's LR schedulers (deepspeed/runtime/lr_schedules.py): each one's parameters with their
# defaults. A test checks them against DeepSpeed's signatures.
SCHEDULERS: dict[str, dict[str, Any]] = {
    "WarmupLR": {
        "warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
        "last_batch_iteration": -1,
    },
    "WarmupDecayLR": {
        "total_num_steps": REQUIRED, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
        "warmup_type": "log", "last_batch_iteration": -1,
    },
    "WarmupCosineLR": {
        "total_num_steps": REQUIRED, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
        "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1,
    },
    "OneCycle": {
        "cycle_min_lr": REQUIRED, "cycle_max_lr": REQUIRED, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
        "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
        "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0, "last_batch_iteration": -1,
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
        "lr_range_test_staircase": False, "last_batch_iteration": -1,
    },
}  # fmt: skip

# Scheduler parameters with a counterpart in the tree: "auto" there keeps the tree's value. In any
# other, "auto" is DeepSpeed's default.
_FROM_TREE = {
    "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
    "warmup_min_ratio", "cos_min_ratio", "lr_range_test_min_lr",
}  # fmt: skip

_INSTEAD = "use the tree's `schedule` section instead (and leave out `scheduler`)"


def _param_type(name: str, default: Any) -> Any:
    kind: Any = (
        str if name == "warmup_type"
        else bool if name in ("cycle_momentum", "lr_range_test_staircase")
        else float if name.endswith(("_lr", "_ratio", "_rate", "_mom"))
        else int
    )  # fmt: skip
    return kind | None if default is None else kind


def _scheduler_param_problems(kind: str, given: dict[str, Any]) -> list[str]:
    """The parameters of DeepSpeed's scheduler `kind` that are unknown, mistyped or missing."""
    defaults, problems = SCHEDULERS[kind], []
    for name, v in given.items():
        where = f"scheduler.params.{name}"
        if name not in defaults:
            problems.append(f"{where}: not a parameter of {kind}{did_you_mean(name, list(defaults))}")
        elif v != AUTO and (problem := type_problem(v, _param_type(name, defaults[name]))):
            problems.append(f"{where}: {problem}")
    for name, default in defaults.items():
        if default == REQUIRED and name not in given:
            problems.append(f"scheduler.params.{name}: {kind} requires it")
    if given.get("last_batch_iteration", -1) not in (-1, AUTO):
        problems.append(
            "scheduler.params.last_batch_iteration: pretrain resumes the LR from its own step count; "
            "leave it -1"
        )
    return problems


def read_scheduler(r: Reading, value: Any) -> None:
    """DeepSpeed's LR scheduler into the tree's `schedule` (and optimizer.lr), where lr_at can draw
    the same curve: linear warmup from warmup_start_ratio x peak, then a cosine to min_lr_ratio x
    peak at max_steps. Read after the optimizer section, whose lr it may set."""
    sched = r.mapping("scheduler", value)
    r.unknown("scheduler", sched, {"type", "params"})
    kind = sched.get("type")
    if not isinstance(kind, str) or kind not in SCHEDULERS:
        r.problems.append(
            f"scheduler.type: {json.dumps(kind)} is not one of DeepSpeed's schedulers ({', '.join(SCHEDULERS)})"
        )
        return
    defaults = SCHEDULERS[kind]
    given = r.mapping("scheduler.params", sched.get("params", {}))
    before = len(r.problems)
    r.problems += _scheduler_param_problems(kind, given)
    if len(r.problems) > before:
        return
    args = {
        k: defaults[k] if v == AUTO and k not in _FROM_TREE else v for k, v in {**defaults, **given}.items()
    }
    if kind in _WARMUPS:
        _warmup_type(r, kind, args["warmup_type"], given)
        r.put("scheduler.type", "schedule", "deepspeed_timing", True)
    if problem := _warmup_past_the_end(kind, args, defaulted="warmup_num_steps" not in given):
        r.problems.append(problem)
        return
    TRANSLATIONS[kind](r, args)
    if len(r.problems) == before:
        fields = [
            ("schedule", k)
            for k in (
                "max_steps",
                "warmup_steps",
                "warmup_type",
                "warmup_start_ratio",
                "decay",
                "min_lr_ratio",
            )
        ]
        became = [
            f"{section}.{key}={_short(r.current(section, key))}"
            for section, key in [*fields, ("optimizer", "lr")]
        ]
        r.notes.append(f"scheduler {kind} became {', '.join(became)} ({_SHAPES[kind]})")


def _warmup_past_the_end(kind: str, a: dict[str, Any], *, defaulted: bool) -> str | None:
    """A warmup that does not end before the schedule does: the LR never reaches its peak. DeepSpeed
    only warns (and WarmupDecayLR then divides by a negative decay length)."""
    warmup, total = a.get("warmup_num_steps"), a.get("total_num_steps")
    if not (is_whole(warmup) and is_whole(total)) or int(warmup) < int(total):  # type: ignore[arg-type]
        return None
    said = f"{warmup}, DeepSpeed's default: the JSON leaves it out" if defaulted else str(warmup)
    return (
        f"scheduler.params.warmup_num_steps ({said}) is not below total_num_steps ({total}): a {kind} run "
        "would never reach warmup_max_lr. Lower warmup_num_steps, or raise total_num_steps"
    )


def _short(value: Any) -> str:
    return f"{value:.6g}" if is_number(value) else str(value)


_SHAPES = {
    "WarmupLR": "warmup, then constant, stepped as DeepSpeed steps it",
    "WarmupDecayLR": "warmup, then a linear decay to the warmup's start, stepped as DeepSpeed steps it",
    "WarmupCosineLR": "warmup, then cosine, stepped as DeepSpeed steps it",
    "LRRangeTest": "a linear rise over the whole run",
}
_WARMUPS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _warmup_type(r: Reading, kind: str, value: Any, given: dict[str, Any]) -> None:
    """warmup_type into schedule.warmup_type. DeepSpeed warms up along its log curve unless told
    "linear", and takes an unknown name for log (with a warning): so does pretrain, with a note."""
    if value == AUTO:
        return
    if value not in ("log", "linear"):
        r.notes.append(
            f"scheduler.params.warmup_type: {value!r} is not log or linear; DeepSpeed warms up along log"
        )
        value = "log"
    r.put("scheduler.params.warmup_type", "schedule", "warmup_type", value)


def _peak(r: Reading, where: str, lr: Any) -> float | None:
    """The peak LR: `lr` if the scheduler gives one (it then sets the optimizer's, as DeepSpeed's
    schedulers do), else the tree's. None if the tree's is not a positive number (validate says so)."""
    if is_number(lr):
        r.put(where, "optimizer", "lr", lr, replace=True)
    peak = r.current("optimizer", "lr")
    return float(peak) if is_number(peak) and peak > 0 else None


def _warmup(r: Reading, *, min_lr: Any, peak: float | None, steps: Any, where: str) -> None:
    if is_number(min_lr) and peak is not None:
        if min_lr > peak:
            r.problems.append(f"{where}: {min_lr} is above the peak LR ({peak})")
        else:
            r.put(where, "schedule", "warmup_start_ratio", min_lr / peak)
    if steps != AUTO:
        # DeepSpeed warms up over at least 2 steps
        r.put("scheduler.params.warmup_num_steps", "schedule", "warmup_steps", max(2, steps))


def _warmup_lr(r: Reading, a: dict[str, Any]) -> float | None:
    peak = _peak(r, "scheduler.params.warmup_max_lr", a["warmup_max_lr"])
    _warmup(
        r,
        min_lr=a["warmup_min_lr"],
        peak=peak,
        steps=a["warmup_num_steps"],
        where="scheduler.params.warmup_min_lr",
    )
    r.put("scheduler.type", "schedule", "decay", "constant")
    return peak


def _warmup_decay_lr(r: Reading, a: dict[str, Any]) -> None:
    """WarmupLR's warmup, then lr = min + (max - min) x (total - step) / (total - warmup): a linear
    decay back to warmup_min_lr at total_num_steps."""
    peak = _warmup_lr(r, a)
    r.put("scheduler.type", "schedule", "decay", "linear", replace=True)
    r.put("scheduler.params.total_num_steps", "schedule", "max_steps", a["total_num_steps"])
    min_lr = a["warmup_min_lr"]
    if is_number(min_lr) and peak is not None and min_lr <= peak:
        r.put("scheduler.params.warmup_min_lr", "schedule", "min_lr_ratio", min_lr / peak)
    elif min_lr == AUTO:  # the decay ends where the warmup starts, whatever resolves it
        r.put(
            "scheduler.params.warmup_min_lr",
            "schedule",
            "min_lr_ratio",
            r.current("schedule", "warmup_start_ratio"),
        )


def _warmup_cosine_lr(r: Reading, a: dict[str, Any]) -> None:
    r.put("scheduler.params.total_num_steps", "schedule", "max_steps", a["total_num_steps"])
    r.put("scheduler.params.warmup_min_ratio", "schedule", "warmup_start_ratio", a["warmup_min_ratio"])
    r.put("scheduler.params.cos_min_ratio", "schedule", "min_lr_ratio", a["cos_min_ratio"])
    r.put("scheduler.type", "schedule", "decay", "cosine")
    _warmup(r, min_lr=None, peak=None, steps=a["warmup_num_steps"], where="")


def _one_cycle(r: Reading, a: dict[str, Any]) -> None:
    r.problems.append(
        "scheduler.params.cycle_second_step_size: OneCycle brings the LR back down linearly to cycle_min_lr "
        "over these steps (then divides it by decay_lr_rate), but pretrain's schedule decays along a "
        "cosine: " + _INSTEAD
    )
    if a["cycle_momentum"]:
        r.problems.append(
            "scheduler.params.cycle_momentum: OneCycle cycles Adam's beta1 between cycle_min_mom and "
            "cycle_max_mom (true is DeepSpeed's default), but pretrain keeps optimizer.betas fixed: "
            + _INSTEAD
        )


def _lr_range_test(r: Reading, a: dict[str, Any]) -> None:
    """lr = min_lr x (1 + rate x step / step_size): lr_at's warmup over the whole run, exactly."""
    rate, size = a["lr_range_test_step_rate"], a["lr_range_test_step_size"]
    if a["lr_range_test_staircase"]:
        r.problems.append(
            "scheduler.params.lr_range_test_staircase: a staircase rise is not pretrain's linear warmup: "
            + _INSTEAD
        )
    if rate < 0:
        r.problems.append(
            f"scheduler.params.lr_range_test_step_rate: {rate} lowers the LR; pretrain's warmup rises"
        )
    if size <= 0:
        r.problems.append(f"scheduler.params.lr_range_test_step_size: must be positive, got {size}")
    min_lr = r.current("optimizer", "lr") if a["lr_range_test_min_lr"] == AUTO else a["lr_range_test_min_lr"]
    steps = r.current("schedule", "max_steps")
    if rate < 0 or size <= 0 or a["lr_range_test_staircase"] or not (is_whole(steps) and is_number(min_lr)):
        return
    growth = 1 + rate * (steps - 1) / size
    r.put("scheduler.params.lr_range_test_min_lr", "optimizer", "lr", min_lr * growth, replace=True)
    r.put("scheduler.type", "schedule", "warmup_steps", steps - 1)
    r.put("scheduler.type", "schedule", "warmup_start_ratio", 1 / growth)
    r.put("scheduler.type", "schedule", "min_lr_ratio", 1.0)
    r.put("scheduler.type", "schedule", "decay", "constant")


TRANSLATIONS = {
    "WarmupLR": _warmup_lr,
    "WarmupDecayLR": _warmup_decay_lr,
    "WarmupCosineLR": _warmup_cosine_lr,
    "OneCycle": _one_cycle,
    "LRRangeTest": _lr_range_test,
}


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

# Sections read elsewhere: the record of a rendered JSON (recorded_run), and the two translated here.
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
