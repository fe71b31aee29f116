"""Learning rate: a warmup from a small start to the peak (linear, or DeepSpeed's log curve), then a
cosine or linear decay to a floor, or a constant peak.

The curves are DeepSpeed's schedulers' (deepspeed/runtime/lr_schedules.py) where a DeepSpeed JSON
asked for one: WarmupLR is a warmup then constant, WarmupDecayLR a warmup then a linear decay to its
start, WarmupCosineLR a warmup then a cosine to its floor. With `deepspeed_timing`, steps follow
DeepSpeed's engine, which applies the scheduler's value and steps it after each optimizer step, so
optimizer step s trains with the value at the scheduler's iteration s - 1.

The decay ends at `steps`: max_steps, or the fewer steps max_tokens makes (`RunConfig.total_steps`).
max_hours stops a run by the clock and leaves the curve as it is, so a resumed run continues it.
"""

from __future__ import annotations

import math

from pretrain.config.tree import ScheduleConfig


def lr_at(step: int, peak: float, cfg: ScheduleConfig, steps: int | None = None) -> float:
    """LR for optimizer step `step` (0-based) of a run of `steps` steps (None: cfg.max_steps)."""
    end = cfg.max_steps if steps is None else steps
    start, floor = cfg.warmup_start_ratio * peak, cfg.min_lr_ratio * peak
    i = step - 1 if cfg.deepspeed_timing else step  # DeepSpeed's last_batch_iteration
    if i < 0:  # DeepSpeed's schedulers before their first step
        return 0.0 if cfg.decay == "cosine" else start
    if i < cfg.warmup_steps:
        if cfg.warmup_type == "log":
            return start + (peak - start) * math.log(i + 1) / math.log(cfg.warmup_steps)
        return start + (peak - start) * i / cfg.warmup_steps
    if cfg.decay == "constant":
        return peak
    span = max(1, end - cfg.warmup_steps)
    if cfg.decay == "linear":
        return floor + (peak - floor) * max(0.0, (end - i) / span)
    # cosine: DeepSpeed's WarmupCosineLR counts its decay from the step after warmup
    progress = min(1.0, (i + (1 if cfg.deepspeed_timing else 0) - cfg.warmup_steps) / span)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
