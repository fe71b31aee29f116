"""On 2 CUDA GPUs: the layouts and precisions of benchmarks/gpu_check.sh that 2 GPUs can hold, one test each.

One run of the script on the first 2 GPUs (`--gpus 2`, about 5 minutes) serves every test, as the CPU
tests share their torchrun jobs: every step's fp32 loss of DP2, TP2 and PP2 within 1e-4 of 1 GPU's
(TF32 off); bf16 with the gradients summed in fp32 at DP2, 32 micro batches a rank, within 2^-7 of the
loss of 1 GPU's 64; TP2 and PP2 resumed from a checkpoint into a new run dir giving the uninterrupted
run's losses; the Hugging Face export of the TP2 run giving the checkpoint's logits in transformers.
What each check runs and why its tolerance is what it is: benchmarks/gpu_checks.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, subprocess_env

GPUS = torch.cuda.device_count()
TWO_GPU_CHECKS = ["fp32-dp2", "fp32-tp2", "fp32-pp2", "bf16-dp2", "resume-tp2", "resume-pp2", "export"]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, found {GPUS}"),
]


@pytest.fixture(scope="module")
def checks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    work = tmp_path_factory.mktemp("gpu_check")
    out = subprocess.run(
        [str(ROOT / "benchmarks" / "gpu_check.sh"), "--gpus", "2", "--only", ",".join(TWO_GPU_CHECKS),
         "--work", str(work), "--json", str(work / "checks.json")],
        cwd=ROOT, env={**subprocess_env(), "PYTHON": sys.executable},  # the script sets DS_ACCELERATOR
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert (work / "checks.json").is_file(), out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)
    return dict(json.loads((work / "checks.json").read_text())["checks"])


@pytest.mark.parametrize("name", TWO_GPU_CHECKS)
def test_two_gpu_check(checks, name):
    assert checks[name]["status"] == "PASS", checks[name]["line"]
