"""`pretrain plan` for the hosts a run will use, not for the machine it is typed on: the hostfile's
`# pretrain:` line, the note when the target is unknown, memory that agrees with DeepSpeed's own
estimators, and the layouts that fit when nothing does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.cli import main
from pretrain.cluster.launch import hostfile_target
from pretrain.config.presets import build
from pretrain.errors import HostfileError
from pretrain.plan.memory import deepspeed_estimate, largest_layer_params
from pretrain.plan.stages import plan_stages

ROOT = Path(__file__).resolve().parents[1]
A100X16 = ROOT / "hostfiles" / "a100x16"
A100X64 = ROOT / "hostfiles" / "a100x64"


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def configured_row(text: str) -> dict[str, str]:
    """The memory table's row of this config (marked *), its cells by their header ('stage', 'fits', 'host
    fits', ...)."""
    header = next(line for line in text.splitlines() if line.startswith("stage  offload"))
    row = next(line for line in text.splitlines() if line.startswith("*") and line[1].isdigit())
    names = ["stage", *(c.strip() for c in header.split("|")[1:])]
    return dict(zip(names, (c.strip() for c in row.split("|")), strict=True))


def test_the_design_card_plan_is_for_a100s_with_no_extra_flag(capsys):
    text = plan(capsys, "--ds", str(ROOT / "ds_configs" / "zero2_offload.json"), "--hostfile", str(A100X16))
    assert (
        "device memory 80.0 GB (hostfiles/a100x16 line 3: A100-80GB); host memory 1024.0 GB a node"
        in text.replace(str(ROOT) + "/", "")
    )
    assert "peak 312 TFLOP/s a rank (A100-80GB datasheet" in text
    assert "note:" not in text
    row = configured_row(text)
    assert row["stage"].startswith("*2 ")
    assert row["fits"] == "yes" and row["host fits"] == "yes"
    days = float(next(line for line in text.splitlines() if line.startswith("*ZeRO-2")).split("|")[-1])
    assert days < 365  # an A100 plan, not this CPU's thousands of days


def test_a_hostfile_of_other_machines_without_a_device_line_says_it_plans_for_this_one(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-01 slots=8\nnode-02 slots=8\n")
    text = plan(capsys, "gpt2-124m", "--hostfile", str(hostfile))
    note = next(line for line in text.splitlines() if line.startswith("note:"))
    assert "planning step time for this machine's device" in note
    assert f"{hostfile} does not say what its hosts are" in note
    assert "--gpu" in note and "# pretrain: device=A100-80GB host-gb=1024" in note
    # one machine's own hostfile needs no note, nor a named device
    local = tmp_path / "local"
    local.write_text("localhost slots=2\n")
    assert "note:" not in plan(capsys, "tiny", "--hostfile", str(local))
    assert "note:" not in plan(capsys, "gpt2-124m", "--hostfile", str(hostfile), "--gpu", "A100-80GB",
                               "--host-gb", "512")  # fmt: skip
    # the docs' single-node example: memory named, GPU not
    assert "no --gpu names the GPU" in plan(capsys, "gpt2-124m", "--world-size", "16", "--gpu-gb", "80")


def test_the_device_line_is_read_and_every_bad_entry_named(tmp_path):
    good = tmp_path / "good"
    good.write_text("# pretrain: device=H100 host-gb=2048 device-gb=80\nnode-01 slots=8\n")
    assert hostfile_target(good) == (
        {"device": "H100", "host-gb": 2048.0, "device-gb": 80.0},
        f"{good} line 1",
    )
    none = tmp_path / "none"
    none.write_text("# just a comment\nnode-01 slots=8\n")
    assert hostfile_target(none) == ({}, "")
    bad = tmp_path / "bad"
    bad.write_text(
        "#pretrain: device=A100;rm host-gb=lots gpus=8\nnode-01 slots=8\n# pretrain: device=H100\n"
    )
    with pytest.raises(HostfileError) as e:
        hostfile_target(bad)
    text = str(e.value)
    assert "device='A100;rm': a device name" in text
    assert "host-gb='lots': a positive number of GB" in text
    assert "'gpus=8': expected key=value with a key of device" in text
    assert "line 3: a second '# pretrain:' line" in text


def test_a_device_the_plan_cannot_size_is_refused_with_the_fix(tmp_path, capsys):
    assert main(["plan", "gpt2-124m", "--gpu", "A100"]) == 2
    assert "A100 does not say its memory" in capsys.readouterr().err
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# pretrain: device=B200-192GB\nnode-01 slots=8\n")
    assert main(["plan", "gpt2-124m", "--hostfile", str(hostfile)]) == 2
    assert f"{hostfile} line 1: device=B200-192GB: not in the peak table" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("preset", "world", "per_node"),
    [("gpt-6.7b", 16, 8), ("gpt2-124m", 1, 1), ("llama-7b", 64, 8), ("llama-13b", 8, 8)],
)
def test_offload_rows_hold_what_deepspeeds_estimators_say(preset, world, per_node):
    """Model states on the device under every offload (and at stage 2 without) equal DeepSpeed's
    `estimate_zero{2,3}_model_states_mem_needs` within 5%, for 16-bit training with the gradients
    summed in 16 bits, as its estimators count them (tests/test_plan_memory.py: summed in fp32)."""
    overrides = ["model.vocab_size=50257", "precision.grad_accum_dtype=bf16"]
    cfg = build(preset, overrides=overrides, world_size=world)
    assert cfg.precision.bf16
    rows = plan_stages(cfg, world, device_gb=80.0, gpus_per_node=per_node)
    checked = 0
    for row in rows:
        if row.offload == "none" and row.stage != 2:
            continue
        if row.stage == 1:  # DeepSpeed has no estimator for stage 1 (its zero2 one partitions gradients)
            assert row.ds_device_gb is None
            continue
        assert row.model_states_gb == pytest.approx(row.ds_device_gb, rel=0.05), (row.stage, row.offload)
        if row.layout.startswith("TP1 x PP1"):  # the table's column is DeepSpeed's own figure
            dev, _ = deepspeed_estimate(
                row.rank_params, largest_layer_params(cfg), stage=row.stage, world=world, gpus_per_node=per_node,
                offload_optimizer=row.offload != "none", offload_param=row.offload == "optimizer+params",
            )  # fmt: skip
            assert row.ds_device_gb == pytest.approx(dev / 1e9)
        checked += 1
    # stage 2 with and without offload, stage 3 with each offload (tensor parallel: ZeRO 0-2 only)
    assert checked == (2 if cfg.parallel.tensor > 1 else 4)


def test_the_zero_offload_papers_10b_model_fits_one_32gb_v100(capsys):
    """ZeRO-Offload (Ren et al. 2021) trains a 10B GPT-2 on one 32 GB V100: its model states are
    DeepSpeed's 2 bytes a parameter there, the rest on the host."""
    sets = ["model.n_layer=50", "model.n_embd=4096", "model.n_head=32", "zero.stage=2",
            "zero.offload_optimizer=true", "precision.bf16=false", "precision.fp16=true",
            "batch.micro_batch_size=4", "batch.gradient_accumulation_steps=1",
            "model.activation_checkpointing=true"]  # fmt: skip
    args = ["gpt2-124m", "--gpu-gb", "32", "--host-gb", "1500", "--peak-tflops", "125", "--json"]
    out = json.loads(plan(capsys, *args, *(f"--set={s}" for s in sets)))
    row = next(s for s in out["stages"] if s["stage"] == 2 and s["offload"] == "optimizer")
    assert row["model_states_gb"] == pytest.approx(2 * out["params"] / 1e9)
    assert row["model_states_gb"] == pytest.approx(row["ds_device_gb"])
    assert row["fits"] is True and row["host_fits"] is True


def test_when_nothing_fits_70b_the_plan_lists_layouts_that_do(capsys):
    """Llama 70B on 8 nodes of 8 A100-80GB at micro batch 16: the configured TP8 x PP4 x DP2 does not
    fit; the plan lists layouts that do, each as the overrides that give it, the global batch kept."""
    text = plan(
        capsys, "--preset", "llama-70b", "--hostfile", str(A100X64), "--set", "batch.micro_batch_size=16"
    )
    assert "Nothing fits TP8 x PP4 x DP2 on 80.0 GB devices. Layouts that fit, fastest first" in text
    listed = [line for line in text.split("Layouts that fit")[1].splitlines() if " --set " in line]
    assert 0 < len(listed) <= 5
    assert any("batch.micro_batch_size=" in line for line in listed)  # a smaller micro batch, accumulation up
    sets = listed[0].split("| --set ")[1].split(" --set ")
    again = plan(capsys, "--preset", "llama-70b", "--hostfile", str(A100X64), "--set", "batch.micro_batch_size=16",
                 *(f"--set={s}" for s in sets))  # fmt: skip
    assert "= 16384 sequences per step" in again.split("\n")[1]
    mine = configured_row(again)
    assert mine["fits"] == "yes" and mine["host fits"] == "yes"


def test_plans_gpu_flags_keep_their_old_names_said_once(capsys):
    """`--gpu`/`--gpu-gb` were `--device`/`--device-gb`, which `sample` uses for a torch device: the old
    names still plan the same, with one note each; both names at odds are one error."""
    new = plan(capsys, "gpt2-124m", "--world-size", "8", "--gpu", "A100", "--gpu-gb", "80")
    assert main(["plan", "gpt2-124m", "--world-size", "8", "--device", "A100", "--device-gb", "80"]) == 0
    out, err = capsys.readouterr()
    assert out == new
    assert err.count("note: plan --device is now --gpu") == 1 and "--device-gb is now --gpu-gb" in err
    assert main(["plan", "gpt2-124m", "--device", "A100", "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert "--device A100 and --gpu H100: --device is --gpu's old name; give --gpu alone" in err
    assert "Traceback" not in err
