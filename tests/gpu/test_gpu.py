"""On a CUDA machine: the NCCL path that the CPU tests cannot reach. Skipped, with the reason, elsewhere.

- a 1-rank run through the deepspeed launcher picks NCCL and the device of its LOCAL_RANK, in bf16
  at ZeRO-2 (and, with 2+ GPUs, a 2-rank run gives per-step losses within bf16 noise of it);
- preflight on localhost reports CUDA and NCCL versions and an NCCL all-reduce's bus bandwidth;
- benchmarks/gpu_check.sh (GPT-2 124M, bf16, ZeRO-2) prints tokens/s, MFU and peak memory;
- setup.sh has built DeepSpeed's FusedAdam and CPUAdam into DeepSpeed (no JIT build on first use),
  and preflight reports them installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, TINY_SHAKESPEARE, subprocess_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


def gpu_env() -> dict[str, str]:
    env = subprocess_env()
    env.pop("DS_ACCELERATOR", None)  # let DeepSpeed pick CUDA
    return env


def test_nccl_backend_and_local_rank_device(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from pretrain.training import engine\n"
        "d = engine.launch_env(); engine.init_distributed(d)\n"
        "print('backend', dist.get_backend(), 'device', torch.cuda.current_device(), 'local', d.local_rank)\n"
        "engine.leave_distributed()\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "29591",
         "--no_local_rank", str(probe)],
        cwd=ROOT, env={**gpu_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "backend nccl device 0 local 0" in out.stdout


def test_bf16_zero2_trains_on_the_gpu(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "29592",
         "pretrain/main.py", f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={tmp_path / 'd'}",
         f"--set=logging.run_dir={run_dir}", "--set", "precision.bf16=true", "--set", "zero.stage=2",
         "--set", "schedule.max_steps=30", "--set", "schedule.warmup_steps=3", "--set", "logging.log_interval=1",
         "--set", "logging.sample_tokens=0", "--set", "checkpoint.interval=1000"],
        cwd=ROOT, env=gpu_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = (run_dir / "metrics.csv").read_text().splitlines()
    losses = [float(line.split(",")[1]) for line in text[1:] if line.split(",")[1]]
    assert len(losses) == 30 and losses[-1] < losses[0] - 0.5


def test_preflight_reports_cuda_nccl_and_bus_bandwidth(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots={torch.cuda.device_count()}\n")
    out = subprocess.run(
        [sys.executable, "-m", "pretrain", "preflight", "--hostfile", str(hostfile), "--no-ssh", "--master-port", "29593",
         "--allreduce-mb", "64", f"--set=data.corpus={TINY_SHAKESPEARE}",
         f"--set=data.dataset_dir={tmp_path / 'no-data'}", f"--set=logging.run_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=gpu_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    row = out.stdout.splitlines()[1]
    assert f"{torch.cuda.device_count()} cuda" in row and str(torch.version.cuda) in row, out.stdout
    assert "FAIL localhost: data:" in out.stdout  # no dataset prepared: named, and nothing launched


def test_gpu_check_benchmark(tmp_path):
    out = subprocess.run(
        [str(ROOT / "benchmarks" / "gpu_check.sh")],
        cwd=ROOT,
        env={**gpu_env(), "STEPS": "20", "WORK": str(tmp_path), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for needle in ["tokens/s", "MFU", "peak memory"]:
        assert needle in out.stdout
    assert Path(tmp_path / "run" / "metrics.csv").is_file()


def test_setup_built_the_deepspeed_ops_the_presets_use(tmp_path):
    """After ./setup.sh under a CUDA torch (PRETRAIN_BUILD_OPS not 0): FusedAdam and CPUAdam are
    prebuilt, so no rank of any run compiles them, and preflight says so."""
    out = subprocess.run(
        [sys.executable, "-c", "from deepspeed.git_version_info import installed_ops as o; "
         "print(o.get('fused_adam'), o.get('cpu_adam'))"],
        env=gpu_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.split() == ["True", "True"], "run ./setup.sh (it builds them)\n" + out.stderr[-2000:]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    out = subprocess.run(
        [sys.executable, "-m", "pretrain", "preflight", "--hostfile", str(hostfile), "--no-ssh", "--no-allreduce",
         "--preset", "gpt2-124m", "--set", "zero.offload_optimizer=true", "--set", "zero.stage=2",
         f"--set=logging.run_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=gpu_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "cpu_adam:installed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
