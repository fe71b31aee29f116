"""A model-parallel rank never holds the whole model: its peak host memory at start, measured.

benchmarks/start_memory.py builds the engine as `pretrain train` does, one rank and TP2 and PP2 on
gloo ranks, and reads each rank's RSS before the model and its peak RSS (VmHWM) once
`deepspeed.initialize` has returned. A 113M-parameter GPT (452 MB in fp32) on 16 blocks: a TP2 or PP2
rank holds half the blocks (plus the embedding), and builds one block's part at a time. Bound: what
the model adds to a rank's peak is at most 0.75 of what it adds to one rank's (measured: 0.61 for
TP2, 0.58-0.59 for PP2; the process's own 250 MB and its tensor-parallel groups weigh more at this
size than at 693M, where it is 0.54); a rank that built the whole model before cutting it adds as
much as one rank (measured: 0.99). Memory, not time: the figures do not depend on the machine's speed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, subprocess_env

pytestmark = pytest.mark.distributed


def test_tensor_and_pipeline_ranks_hold_their_part_only(tmp_path):
    out = tmp_path / "start_memory.json"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "start_memory.py"), "--layers", "16", "--n-embd", "768",
        "--vocab", "4096", "--layouts", "one,tp2,pp2", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    (one,) = figures["one"]
    whole = one["peak"] - one["before"]
    assert whole > 0.9 * 4 * one["params"], figures  # the model's fp32 bytes are in one rank's peak
    for layout in ("tp2", "pp2"):
        for rank in figures[layout]:
            assert rank["params"] < 0.55 * one["params"], (layout, figures)
            assert rank["peak"] - rank["before"] <= 0.75 * whole, (layout, figures)
    print(proc.stdout)
