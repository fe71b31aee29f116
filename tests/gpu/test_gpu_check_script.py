"""benchmarks/gpu_check.sh where no GPU is: it parses and passes shellcheck, plans its skips for a GPU
count, refuses what it cannot do in one line, compares losses as its docstring says, and runs a check
end to end on CPU ranks (`--cpu`, gloo). The whole dry run (`--cpu`, every check, about 3 minutes here)
is left to docs/testing.md's command; the GPU runs themselves are test_gpu_layouts.py's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_checks import BF16_REL_TOL, FP32_TOL, agreement, worst
from tests.conftest import ROOT, subprocess_env

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def gpu_check(*args: str, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args],
        cwd=ROOT,
        env={**subprocess_env(), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_script_parses():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (.ci/system-deps)")
def test_shellcheck():
    out = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_two_gpus_skip_only_the_four_gpu_layout_with_its_reason():
    out = gpu_check("--list", "--gpus", "2")
    assert out.returncode == 0, out.stderr
    skipped = [line for line in out.stdout.splitlines() if "SKIP" in line]
    assert skipped == ["fp32-tp2pp2: needs 4 GPUs; SKIP: needs 4 GPUs, found 2"]
    assert len(out.stdout.splitlines()) == 12


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CUDA GPU is visible: the script would run its checks"
)
def test_without_a_gpu_it_says_so_in_one_line():
    out = gpu_check()
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("gpu_check: no CUDA GPU visible") and out.stderr.count("\n") == 1


def test_an_unknown_check_is_named_with_the_nearest():
    out = gpu_check("--only", "fp32-tp3")
    assert out.returncode == 2 and "no check 'fp32-tp3' (did you mean 'fp32-tp2'?)" in out.stderr


def test_losses_compare_step_by_step():
    want = {1: 4.0, 2: 3.5, 3: 3.0}
    assert worst(dict(want), want) == (0.0, 1)
    assert (
        agreement(0.0, 1, want, "1 rank's") == "losses equal to 1 rank's as logged (6 digits) over steps 1-3"
    )
    diff, step = worst({1: 4.0, 2: 3.5 + 2e-5, 3: 3.0}, want)
    assert step == 2 and diff == pytest.approx(2e-5) and diff < FP32_TOL
    diff, step = worst({1: 4.0, 2: 3.5, 3: 3.0 * (1 + 1e-2)}, want, relative=True)
    assert step == 3 and diff > BF16_REL_TOL  # a percent is more than bf16's noise
    with pytest.raises(Exception, match="logged steps 1-2, the run compared with logged 1-3"):
        worst({1: 4.0, 2: 3.5}, want)


@pytest.mark.distributed
def test_dry_run_of_the_nccl_check_on_cpu_ranks(tmp_path):
    """preflight's all-reduce through the script's device pool, on 2 gloo ranks: about 15 s."""
    out = gpu_check("--cpu", "--only", "nccl", "--work", str(tmp_path), "--json", str(tmp_path / "c.json"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[1].startswith("PASS nccl: bus bandwidth ") and "over 2 ranks (gloo)" in lines[1]
    assert lines[2].startswith("gpu_check: 1 passed, 0 failed, 0 skipped of 1 check in ")
    check = json.loads((tmp_path / "c.json").read_text())["checks"]["nccl"]
    assert check["status"] == "PASS" and check["world"] == 2 and check["busbw_gbs"] > 0
    assert (tmp_path / "logs" / "nccl.log").is_file()
