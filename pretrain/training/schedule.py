"""Learning rate: linear warmup from a small start to the peak, then cosine down to a floor."""

from __future__ import annotations

import math

from pretrain.config.tree import ScheduleConfig


def lr_at(step: int, peak: float, cfg: ScheduleConfig) -> float:
    """LR for optimizer step `step` (0-based)."""
    floor = cfg.min_lr_ratio * peak
    if step < cfg.warmup_steps:
        start = cfg.warmup_start_ratio * peak
        return start + (peak - start) * step / cfg.warmup_steps
    if step >= cfg.max_steps:
        return floor
    progress = (step - cfg.warmup_steps) / (cfg.max_steps - cfg.warmup_steps)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
