import math
from itertools import pairwise

import pytest

from pretrain.config.tree import ScheduleConfig
from pretrain.training.schedule import lr_at


def test_schedule_key_points():
    cfg = ScheduleConfig(max_steps=1000, warmup_steps=100, warmup_start_ratio=0.01, min_lr_ratio=0.1)
    peak = 6e-4
    assert lr_at(0, peak, cfg) == pytest.approx(0.01 * peak)
    assert lr_at(50, peak, cfg) == pytest.approx(0.01 * peak + 0.99 * peak * 0.5)
    assert lr_at(100, peak, cfg) == pytest.approx(peak)
    assert lr_at(550, peak, cfg) == pytest.approx(0.1 * peak + 0.9 * peak * 0.5)  # cosine midpoint
    assert lr_at(1000, peak, cfg) == pytest.approx(0.1 * peak)
    assert lr_at(5000, peak, cfg) == pytest.approx(0.1 * peak)
    lrs = [lr_at(s, peak, cfg) for s in range(1001)]
    assert all(a <= b for a, b in pairwise(lrs[:101]))
    assert all(a >= b for a, b in pairwise(lrs[100:]))
    assert max(lrs) == pytest.approx(peak)


def test_no_warmup():
    cfg = ScheduleConfig(max_steps=10, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_at(0, 1.0, cfg) == pytest.approx(1.0)
    assert lr_at(5, 1.0, cfg) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
