"""bf16 at the sizes the presets name: gradients summed in fp32 over hundreds of micro batches, and
losses summed in fp32, by the real DeepSpeed engine on gloo ranks.

- Gradients: the micro batches' bf16 gradients of one step, summed by DeepSpeed at ZeRO 1, 2, 3 and
  under optimizer offload, against their exact sum (tests/accumulation_worker.py). Bound 1e-5: an
  fp32 sum of 256 terms is off by about 2e-8 relative (measured), a bf16 one by about 2e-2, so the
  bound separates them by three orders either way.
- Losses: DeepSpeed's pipeline engine sums the micro batches' losses in the loss's dtype. A bf16 PP2
  run of 64 micro batches a step must log the losses of a one-rank bf16 run within bf16 noise: the
  two compute the same bf16 matmuls in another order (measured: at most 2e-3 over 4 steps), where a
  bf16 loss sum is off by up to 4e-2 at 16 micro batches, and a bf16 running sum of 512 losses of
  about 4.2 stops growing at 2048 (a mean of 4.0).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, cli, subprocess_env, torchrun

NOISE = 0.01  # bf16 noise between layouts, see the module doc
BF16 = ["precision.bf16=true", "zero.stage=1", "batch.micro_batch_size=1", "checkpoint.interval=1000"]
M64 = [*BF16, "batch.gradient_accumulation_steps=64", "schedule.max_steps=4", "logging.eval_interval=4"]
M512 = [*BF16, "batch.gradient_accumulation_steps=512", "schedule.max_steps=1", "schedule.warmup_steps=0"]
M512 += ["schedule.warmup_type=linear", "logging.eval_interval=1"]
# A run at ZeRO-1 with bf16 sums, resumed with fp32 sums (DeepSpeed's ZeRO optimizer, then its
# BF16_Optimizer: another optimizer class, the same optimizer state).
ACCUM = [
    "precision.bf16=true",
    "zero.stage=1",
    "batch.gradient_accumulation_steps=4",
    "checkpoint.interval=3",
]


@pytest.fixture(scope="module")
def one_rank(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("prec1")
    jobs = [
        {"name": "m64", "run": "m64", "overrides": M64},
        {"name": "m512", "run": "m512", "overrides": M512},
    ]
    return torchrun(1, 0, char_dataset, out, jobs)


@pytest.fixture(scope="module")
def two_ranks(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("prec2")
    bf16_sums, fp32_sums = "precision.grad_accum_dtype=bf16", "precision.grad_accum_dtype=fp32"
    # Data-parallel runs first: DeepSpeed keeps a tensor-parallel run's groups for the process's life.
    jobs = [
        {"name": "bf16_full", "run": "bf16_full", "overrides": [*ACCUM, bf16_sums, "schedule.max_steps=6"]},
        {"name": "bf16_first", "run": "across", "overrides": [*ACCUM, bf16_sums, "schedule.max_steps=3"]},
        {
            "name": "fp32_resume",
            "run": "across",
            "overrides": [*ACCUM, fp32_sums, "schedule.max_steps=6"],
            "resume": "auto",
        },
        {"name": "pp2_m64", "run": "pp2_m64", "overrides": [*M64, "parallel.pipeline=2"]},
        {"name": "pp2_m512", "run": "pp2_m512", "overrides": [*M512, "parallel.pipeline=2"]},
        {"name": "tp2_m64", "run": "tp2_m64", "overrides": [*M64, "parallel.tensor=2"]},
    ]
    return torchrun(2, 29601, char_dataset, out, jobs, timeout=1200)


def losses(result: dict) -> dict[int, float]:
    return {int(k): v for k, v in result["losses"].items()}


def test_bf16_gradients_are_summed_in_fp32_at_every_zero_stage(tmp_path):
    """Two data-parallel ranks, 256 micro batches a step: DeepSpeed's accumulated gradient against
    the exact sum, with fp32 sums (the default) and with bf16 sums (asked for)."""
    variants = ["zero1_fp32", "zero2_fp32", "zero3_fp32", "zero2_offload_fp32", "zero1_bf16", "zero2_bf16"]
    out = tmp_path / "accumulation.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", "29603", str(ROOT / "tests" / "accumulation_worker.py"), str(out), ",".join(variants),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=ROOT, env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    got = json.loads(out.read_text())
    for name in variants:
        err, dtype = got[name]["relative_error"], got[name]["accum_dtype"]
        if name.endswith("_fp32"):
            assert err < 1e-5 and dtype == "torch.float32", (name, got[name])
        else:
            assert err > 1e-3 and dtype == "torch.bfloat16", (name, got[name])  # what the bound catches
    # ZeRO-1 without offload: DeepSpeed's BF16_Optimizer, whose fp32 buffer is whole on every rank
    assert got["zero1_fp32"]["optimizer"] == "BF16_Optimizer"
    assert got["zero3_fp32"]["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["pp2", "tp2"])
def test_bf16_layouts_log_one_ranks_losses_over_64_micro_batches(one_rank, two_ranks, layout):
    want, got = losses(one_rank["m64"]), losses(two_ranks[f"{layout}_m64"])
    assert sorted(got) == sorted(want) == [1, 2, 3, 4]
    assert max(abs(got[s] - want[s]) for s in want) < NOISE, (got, want)
    assert abs(two_ranks[f"{layout}_m64"]["val_loss"] - one_rank["m64"]["val_loss"]) < NOISE


@pytest.mark.distributed
def test_a_pipeline_sums_512_micro_batches_losses_in_fp32(one_rank, two_ranks):
    """A bf16 sum of 512 losses of about 4.17 (ln 65, the char vocabulary) stalls at 2048: its mean
    would read 4.0."""
    want, got = losses(one_rank["m512"])[1], losses(two_ranks["pp2_m512"])[1]
    assert abs(got - want) < NOISE and abs(want - 4.17) < 0.1, (got, want)
    assert abs(two_ranks["pp2_m512"]["val_loss"] - one_rank["m512"]["val_loss"]) < NOISE


@pytest.mark.distributed
def test_a_resume_may_change_the_accumulation_dtype(two_ranks):
    """bf16 sums to fp32 sums at ZeRO-1 on two ranks (another DeepSpeed optimizer class): the first
    step after the resume has the uninterrupted run's loss exactly (the same weights and data), the
    next ones differ only by the sums' rounding (the optimizer state came across)."""
    full, resumed = losses(two_ranks["bf16_full"]), losses(two_ranks["fp32_resume"])
    assert two_ranks["fp32_resume"]["start_step"] == 3 and sorted(resumed) == [4, 5, 6]
    assert resumed[4] == full[4]
    assert max(abs(resumed[s] - full[s]) for s in (5, 6)) < 1e-3, (resumed, full)
    assert "this resume changes precision.grad_accum_dtype from bf16 to fp32" in two_ranks["_stdout"]


def config(*args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    done = cli("config", *args)
    return done, (yaml.safe_load(done.stdout) if done.returncode == 0 else {})


def test_the_llama_presets_render_fp32_sums():
    done = cli("render", "--preset", "llama-7b", "--world-size", "16")
    assert done.returncode == 0, done.stderr
    ds = json.loads(done.stdout)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
    for name in ("llama7b_2x8", "llama13b_8x8", "llama70b_8x8", "zero2"):
        on_disk = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
        assert on_disk["data_types"] == {"grad_accum_dtype": "fp32"}, name


def test_bf16_sums_are_rendered_only_when_asked_and_say_what_they_cost():
    args = [
        "--set",
        "precision.bf16=true",
        "--set",
        "zero.stage=1",
        "--set",
        "precision.grad_accum_dtype=bf16",
    ]
    args += ["--set", "batch.gradient_accumulation_steps=8"]
    done = cli("render", *args)
    assert done.returncode == 0, done.stderr
    ds = json.loads(done.stdout)
    assert ds["data_types"] == {"grad_accum_dtype": "bf16"} and "communication_data_type" not in ds
    assert "the gradients of 8 micro batches are summed in bf16" in done.stderr
    done, cfg = config(*args)
    assert cfg["precision"]["grad_accum_dtype"] == "bf16" and "summed in bf16" in done.stderr
    done, cfg = config("--set", "precision.bf16=true", "--set", "zero.stage=1")
    assert cfg["precision"]["grad_accum_dtype"] == "fp32" and done.stderr == ""


def test_fp32_sums_at_zero_stage_0_are_one_clear_error():
    done, _ = config("--set", "precision.bf16=true")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        "precision.grad_accum_dtype fp32 (the default under bf16) needs zero.stage 1, 2 or 3" in done.stderr
    )
    assert "Set zero.stage=1" in done.stderr and "precision.grad_accum_dtype=bf16" in done.stderr
    done, cfg = config("--set", "precision.bf16=true", "--set", "precision.grad_accum_dtype=bf16")
    assert done.returncode == 0 and cfg["zero"]["stage"] == 0


def test_deepspeed_extra_cannot_set_the_accumulation_under_bf16():
    done, _ = config(
        "--set", "precision.bf16=true", "--set", "zero.stage=1",
        "--set", "deepspeed_extra={data_types: {grad_accum_dtype: bf16}}",
    )  # fmt: skip
    assert done.returncode == 2
    assert (
        "'data_types.grad_accum_dtype' under bf16 is modeled by the tree: set precision.grad_accum_dtype"
        in (done.stderr)
    )


@pytest.mark.parametrize(
    ("stage", "data_types", "want", "note"),
    [
        (1, {"grad_accum_dtype": "bf16"}, "bf16", None),
        (2, {"grad_accum_dtype": "fp32"}, "fp32", None),
        (2, None, "fp32", "DeepSpeed's own would sum them in bf16"),
        (0, None, "bf16", "bf16 at ZeRO stage 0 sums the micro batches' gradients in bf16"),
    ],
)
def test_a_foreign_json_keeps_what_it_says_of_the_accumulation(tmp_path, stage, data_types, want, note):
    ds: dict = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
    }  # fmt: skip
    if data_types is not None:
        ds["data_types"] = data_types
    path = tmp_path / "foreign.json"
    path.write_text(json.dumps(ds))
    done, cfg = config("--preset", "tiny", "--ds", str(path))
    assert done.returncode == 0, done.stderr
    assert cfg["precision"]["grad_accum_dtype"] == want and "data_types" not in cfg.get("deepspeed_extra", {})
    if note:
        assert note in done.stderr
    rendered = cli("render", "--preset", "tiny", "--ds", str(path))
    assert json.loads(rendered.stdout)["data_types"] == {"grad_accum_dtype": want}


def test_tf32_is_one_switch_through_the_api_this_torch_has():
    """precision.tf32 sets fp32 matmuls on CUDA through torch's newer `fp32_precision` or its older
    `allow_tf32` switches, never both (torch 2.9 and later raise on a mix), and MFU's peak reads it."""
    from pretrain.cluster.hardware import gpu_peak_tflops, set_tf32, tf32_enabled

    was = tf32_enabled()
    try:
        set_tf32(True)
        assert tf32_enabled()
        set_tf32(False)
        assert not tf32_enabled()
    finally:
        set_tf32(was)
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == 156.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB", "fp32", tf32=False) == 19.5
