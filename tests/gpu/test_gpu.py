"""On a CUDA machine: the NCCL path that the CPU tests cannot reach. Skipped, with the reason, elsewhere.

- a 1-rank run through the deepspeed launcher picks NCCL and the device of its LOCAL_RANK, and trains
  in bf16 at ZeRO-2; with 2+ GPUs, a 2-rank run of the same global batch gives every step's loss within
  bf16 noise of it (2^-7 of the loss: benchmarks/gpu_checks.py's BF16_REL_TOL);
- preflight on localhost reports CUDA and NCCL versions and an NCCL all-reduce's bus bandwidth;
- benchmarks/gpu_check.sh's throughput check (GPT-2 124M, bf16, ZeRO-2) prints tokens/s, MFU and peak memory;
- setup.sh has built DeepSpeed's FusedAdam and CPUAdam into DeepSpeed (no JIT build on first use),
  and preflight reports them installed.

The 2-GPU layout checks (fp32 DP2 / TP2 / PP2 against 1 GPU, bf16 with fp32 accumulation, resume under
TP2 and PP2, the export's logits) are in test_gpu_layouts.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_checks import BF16_REL_TOL, losses, worst
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
        "d = ranks.launch_env(); ranks.init_distributed(d)\n"
        "print('backend', dist.get_backend(), 'device', torch.cuda.current_device(), 'local', d.local_rank)\n"
        "ranks.leave_distributed()\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", "29591",
         "--no_local_rank", str(probe)],
        cwd=ROOT, env={**gpu_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "backend nccl device 0 local 0" in out.stdout


# tiny's micro batch of 16: a global batch of 32 is an accumulation of 2 on 1 GPU and of 1 on 2
BF16_ZERO2 = ["precision.bf16=true", "zero.stage=2", "batch.global_batch_sequences=32", "schedule.max_steps=30",
              "schedule.warmup_steps=3", "logging.log_interval=1", "logging.sample_tokens=0",
              "checkpoint.interval=1000"]  # fmt: skip


def bf16_zero2(data: Path, run_dir: Path, gpus: int, port: int) -> dict[int, float]:
    """The tiny preset in bf16 at ZeRO-2 on `gpus` GPUs through the deepspeed launcher; its losses."""
    out = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--master_port", str(port),
         "pretrain/main.py", f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={data}",
         f"--set=logging.run_dir={run_dir}", *(a for s in BF16_ZERO2 for a in ("--set", s))],
        cwd=ROOT, env=gpu_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return losses(run_dir)


@pytest.fixture(scope="module")
def one_gpu_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    work = tmp_path_factory.mktemp("bf16")
    return bf16_zero2(work / "d", work / "run1", 1, 29592), work / "d"


def test_bf16_zero2_trains_on_the_gpu(one_gpu_bf16):
    got = list(one_gpu_bf16[0].values())
    assert len(got) == 30 and got[-1] < got[0] - 0.5


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"needs 2 CUDA GPUs, found {torch.cuda.device_count()}"
)
def test_two_gpus_give_the_losses_of_one_within_bf16_noise(one_gpu_bf16, tmp_path):
    want, data = one_gpu_bf16
    got = bf16_zero2(data, tmp_path / "run2", 2, 29594)
    diff, step = worst(got, want, relative=True)
    assert diff <= BF16_REL_TOL, f"step {step}: {got[step]} on 2 GPUs, {want[step]} on 1"


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
        [str(ROOT / "benchmarks" / "gpu_check.sh"), "--only", "throughput", "--work", str(tmp_path)],
        cwd=ROOT,
        env={**gpu_env(), "STEPS": "20", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("PASS throughput: "))
    for needle in ["tokens/s", "MFU", "peak memory"]:
        assert needle in line
    assert Path(tmp_path / "runs" / "throughput" / "metrics.csv").is_file()


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
