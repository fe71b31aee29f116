"""`pretrain plan` under tensor x pipeline x data parallelism: what a rank holds, the bubble, the
model-parallel communication, the layouts that fit, and the Llama 2 presets on A100-80GB nodes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pretrain.cli import main
from pretrain.cluster.hardware import gpu_memory_gb
from pretrain.config.layout import Layout, layout_of
from pretrain.config.presets import PRESETS, build
from pretrain.config.tree import analytic_flops_per_token, analytic_num_params
from pretrain.plan.layout import stage_shares
from pretrain.plan.stages import plan_stages
from pretrain.plan.timing import Rates, bubble_fraction, hardware_flops_per_token, predict_step
from tests.conftest import ROOT, subprocess_env
from tests.test_plan_target import configured_row

A100X64 = ROOT / "hostfiles" / "a100x64"  # 8 nodes x 8 A100-80GB
A100X16 = ROOT / "hostfiles" / "a100x16"  # 2 nodes x 8

# A llama small enough to count by hand: no biases, RoPE (no wpe), untied, 2 key/value heads.
SMALL = [
    "model.arch=llama", "model.n_layer=4", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=64",
    "model.intermediate_size=128", "model.block_size=32", "model.vocab_size=100", "model.tie_embeddings=false",
    "model.activation_checkpointing=false", "model.dropout=0", "batch.micro_batch_size=2",
    "batch.gradient_accumulation_steps=8", "precision.bf16=true", "zero.stage=1",
    "parallel.partition_method=uniform",
]  # fmt: skip


def small(*extra: str, world: int = 8) -> object:
    return build("tiny", overrides=[*SMALL, *extra], world_size=world)


def rates(**kw: float) -> Rates:
    base = dict(
        peak_tflops=100.0, mfu=0.5, busbw=10e9, optimizer_s_per_param=1e-10, host_optimizer_s_per_param=1e-9
    )
    return Rates(**{**base, **kw}, sources={}, node_busbw=100e9, ranks_per_node=4)  # type: ignore[arg-type]


def test_one_stage_one_rank_is_the_whole_model():
    for name in PRESETS:
        for ckpt in ("false", "true"):
            cfg = build(name, overrides=["model.vocab_size=1000", f"model.activation_checkpointing={ckpt}"])
            (share,) = stage_shares(cfg, Layout())
            assert share.params == analytic_num_params(cfg.model)
            if ckpt == "false":
                assert hardware_flops_per_token(cfg.model) == pytest.approx(
                    analytic_flops_per_token(cfg.model)
                )


def test_memory_per_rank_of_tp2_pp2_by_hand():
    cfg = small("parallel.tensor=2", "parallel.pipeline=2")
    assert layout_of(cfg, 8).shape == (2, 2) and layout_of(cfg, 8).data == 2
    # d 64, kv 2 x 16 = 32, f 128. A block: c_attn 64 x (64 + 2 x 32) + c_proj 64 x 64 = 12288 and the
    # SwiGLU 2 x 64 x 128 + 128 x 64 = 24576, split over 2 tensor ranks; its 2 norms (128) whole.
    block = (12288 + 24576) // 2 + 128
    embedding, head = 100 * 64, 64 + 100 * 64  # wte; ln_f + lm_head, whole on each tensor rank
    # 'uniform' cuts [embedding, 4 blocks, head] into [embedding + 2 blocks] and [2 blocks + head]
    first, last = stage_shares(cfg, Layout(2, 2, 2))
    assert (first.blocks, first.first, first.last, first.params) == (2, True, False, 2 * block + embedding)
    assert (last.blocks, last.first, last.last, last.params) == (2, False, True, 2 * block + head)
    # ZeRO-1 over the 2 data-parallel ranks, bf16 summed in fp32 (the default): DeepSpeed's
    # BF16_Optimizer, 2 bytes a parameter, 2 of bf16 gradients, 4 of its whole fp32 gradient buffer, and
    # 12 / 2 of fp32 master weights and Adam state
    states = [14 * first.params, 14 * last.params]
    # Activations a micro batch a block: the norms' inputs, attention's and the MLP's (4 x 64) whole, q,
    # k, v, attention out and SwiGLU's four (2 x 64 + 2 x 32 + 4 x 128) halved, x s 32 x b 2 x 2 bytes.
    per_block = (4 * 64 + (2 * 64 + 2 * 32 + 4 * 128) // 2) * 32 * 2 * 2
    embedded, logits = 32 * 2 * 64 * 2, 32 * 2 * 100 * (2 + 4)
    activations = [
        2 * (2 * per_block + embedded),
        1 * (2 * per_block + logits),
    ]  # 1F1B: 2 in flight on stage 0
    # No reduce buckets: after backward the engine all-reduces the fp32 buffer, under 5e8 elements
    # concatenated (4 bytes a parameter) and cast to bf16 (2), once the activations are freed.
    after = [6 * first.params, 6 * last.params]
    totals = [s + max(a, w) for s, a, w in zip(states, activations, after, strict=True)]
    assert after[1] > activations[1] and totals[0] > totals[1]
    row = next(p for p in plan_stages(cfg, 8, device_gb=1.0) if p.stage == 1)
    assert (row.layout, row.pipeline_stage, row.rank_params) == ("TP2 x PP2 x DP2", 0, first.params)
    assert row.device_total_gb * 1e9 == pytest.approx(totals[0])
    assert row.activations_gb * 1e9 == pytest.approx(activations[0])
    # pipeline: ZeRO 0 and 1 only, and 1 alone with gradient clipping (DeepSpeed clips stage 0 by stage 0)
    assert [p.stage for p in plan_stages(cfg, 8, device_gb=1.0)] == [1]
    assert [
        p.stage for p in plan_stages(small("parallel.pipeline=2", "optimizer.grad_clip=0"), 8, device_gb=1.0)
    ] == [0, 1]


def test_bubble_and_model_parallel_communication():
    assert bubble_fraction(Layout(1, 4, 1), 12) == pytest.approx(3 / 15)
    assert bubble_fraction(Layout(8, 1, 8), 12) == 0.0
    cfg = small("parallel.tensor=2", "parallel.pipeline=2")
    t = predict_step(cfg, 8, stage=1, offload_optimizer=False, offload_param=False, rates=rates())
    assert t.layout == "TP2 x PP2 x DP2" and t.bubble_fraction == pytest.approx(1 / 9)
    x = 2 * 32 * 64 * 2  # a micro batch's activations, bf16 bytes
    # 4 all-reduces a block, 2 blocks, 8 micro batches, a ring moving 2X (t - 1)/t, on the node's bus
    assert t.tp_comm_s == pytest.approx(2 * 4 * 8 * 2 * x * (1 / 2) / 100e9)
    # each stage sends one way per micro batch: the first its activations, the last their gradients;
    # the 8 ranks span 2 nodes of 4, so at the world's bus
    assert t.pp_comm_s == pytest.approx(8 * x / 10e9)
    assert t.bubble_s == pytest.approx((t.compute_s + t.tp_comm_s + t.pp_comm_s) * (2 - 1) / 8)
    assert t.step_s == pytest.approx(
        t.compute_s + t.tp_comm_s + t.pp_comm_s + t.bubble_s + t.exposed_comm_s + t.optimizer_s
    )
    # compute: the heavier stage's FLOPs a rank (a half of its blocks; the lm_head whole on the last)
    single = predict_step(
        small(world=1), 1, stage=1, offload_optimizer=False, offload_param=False, rates=rates()
    )
    assert t.compute_s < single.compute_s / 2
    assert t.tokens_per_s == pytest.approx(2 * 32 * 8 * 2 / t.step_s)  # 2 data-parallel replicas
    recompute = small("parallel.tensor=2", "parallel.pipeline=2", "parallel.activation_checkpoint_interval=1")
    r = predict_step(recompute, 8, stage=1, offload_optimizer=False, offload_param=False, rates=rates())
    assert r.tp_comm_s == pytest.approx(t.tp_comm_s * 6 / 4)  # the recomputed forward all-reduces again


def plan_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_device_memory_from_its_name():
    assert gpu_memory_gb("A100-80GB") == 80.0 and gpu_memory_gb("NVIDIA A100-SXM4-40GB") == 40.0
    assert gpu_memory_gb("H100") == 80.0 and gpu_memory_gb("A100") is None  # 40 or 80: the name must say


def test_llama_70b_on_8_nodes_of_8_a100_80gb_fits():
    """The issue's done-when point, as a user types it."""
    out = subprocess.run(
        [sys.executable, "-m", "pretrain", "plan", "--preset", "llama-70b", "--hostfile", str(A100X64),
         "--gpu", "A100-80GB"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "layout: TP8 x PP4 x DP2 = 64 ranks" in text
    assert "device memory 80.0 GB (--gpu: A100-80GB)" in text
    row = configured_row(text)
    assert row["stage"].startswith("*1 ")  # this config: ZeRO-1
    memory = float(row["device total"])
    assert row["fits"] == row["host fits"] == "yes" and 20 < memory < 80
    time_row = next(line for line in text.splitlines() if line.startswith("*ZeRO-1"))
    step_s, days = float(time_row.split("|")[1]), float(time_row.split("|")[-1])
    assert step_s > 0 and days == pytest.approx(step_s * 500_000 / 86400, rel=0.01)
    assert "bubble: (p - 1) / (m + p - 1) = 3 / (512 + 3) = 0.6%" in text
    assert "TP comm: 6 all-reduces a block" in text


def test_when_nothing_fits_the_layouts_that_do_are_listed_as_overrides(capsys):
    args = ["llama-7b", "--hostfile", str(A100X16), "--gpu", "A100", "--gpu-gb", "24"]
    text = plan_text(capsys, *args, "--set", "parallel.pipeline=2")
    assert "Nothing fits TP1 x PP2 x DP8 on 24.0 GB devices. Layouts that fit, fastest first" in text
    listed = [line for line in text.split("Layouts that fit")[1].splitlines() if " --set " in line]
    assert 0 < len(listed) <= 5
    steps = [float(line.split("|")[1]) for line in listed]
    assert steps == sorted(steps)
    # each is the overrides that give it: planned with them, this config's row fits, at that step time
    for line in listed[:2]:
        sets = line.split("| --set ")[1].split(" --set ")
        again = plan_text(capsys, *args, "--set", "parallel.pipeline=2", *(f"--set={s}" for s in sets))
        mine = configured_row(again)
        assert mine["fits"] == mine["host fits"] == "yes"
        assert "= 512 sequences per step" in again.split("\n")[1]  # the global batch kept
        step = next(r for r in again.splitlines() if r.startswith("*ZeRO-")).split("|")[1]
        assert float(step) == float(line.split("|")[1])
    plan = json.loads(plan_text(capsys, *args, "--set", "parallel.pipeline=2", "--json"))
    assert plan["layout"] == {"tensor": 1, "pipeline": 2, "data": 8}
    assert plan["layouts_that_fit"] and plan["layouts_searched"] >= len(plan["layouts_that_fit"])
    assert {"tp_comm_s", "pp_comm_s", "bubble_s", "bubble_fraction", "layout"} <= set(plan["step_times"][0])


@pytest.mark.parametrize(
    ("preset", "hostfile", "layout"),
    [
        ("llama-7b", A100X16, "TP1 x PP1 x DP16"),
        ("llama-13b", A100X16, "TP2 x PP1 x DP8"),
        ("llama-70b", A100X64, "TP8 x PP4 x DP2"),
    ],
)
def test_the_llama_presets_fit_their_layout(preset, hostfile, layout, capsys):
    plan = json.loads(plan_text(capsys, preset, "--hostfile", str(hostfile), "--gpu", "A100-80GB", "--json"))
    cfg = build(preset)
    mine = next(s for s in plan["stages"] if s["stage"] == cfg.zero.stage and s["offload"] == "none")
    assert mine["layout"] == layout and mine["fits"] is True
    assert plan["layouts_that_fit"] is None  # nothing to search: the configured layout fits
    assert plan["step_times"][0]["layout"] == layout
