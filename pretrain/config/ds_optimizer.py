"""DeepSpeed's `optimizer` and `scheduler` sections translated into the tree's `optimizer` and
`schedule`, where the tree can express them, with the reason where it cannot."""

from __future__ import annotations

import json
from typing import Any

from pretrain.config.ds_keys import AUTO
from pretrain.config.ds_values import Reading, is_number, is_whole, type_problem
from pretrain.errors import did_you_mean

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
    _read_adam_params(r, r.mapping("optimizer.params", opt.get("params", {})), adam=kind.lower() == "adam")


def _read_adam_params(r: Reading, params: dict[str, Any], *, adam: bool) -> None:
    """The optimizer's params, each into its `optimizer` field, accepted as DeepSpeed's default, or
    refused with the reason (`adam`: DeepSpeed's type Adam, where adam_w_mode false means L2)."""
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
        elif k == "adam_w_mode" and v is False and adam:
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
