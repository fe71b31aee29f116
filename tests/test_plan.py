"""`pretrain plan`: the ZeRO paper's memory and communication formulas, the step-time model, and the
command."""

from __future__ import annotations

import json
import os

import pytest

from pretrain.config.presets import build
from pretrain.config.tree import analytic_flops_per_token, analytic_num_params, to_yaml
from pretrain.errors import ConfigError
from pretrain.plan.memory import activation_bytes, deepspeed_estimate, largest_layer_params, model_states
from pretrain.plan.rates import resolve_rates
from pretrain.plan.stages import plan_stages
from pretrain.plan.timing import Rates, comm_bytes, comm_elements, predict_step


@pytest.mark.parametrize(
    ("stage", "expected_gb"),
    # The ZeRO paper's figure 1: Ψ = 7.5B, N = 64, K = 12, mixed precision.
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_model_states_match_the_zero_paper(stage, expected_gb):
    psi, n = 7_500_000_000, 64
    params, grads, optim, host = model_states(
        psi, stage=stage, world=n, precision="bf16", offload_optimizer=False, offload_param=False
    )
    assert host == 0
    # and DeepSpeed's step converts the gradient partition to fp32 at stages 1-3 (4 bytes a parameter)
    fp32_grads = 4 * psi / n if stage else 0
    assert (params + grads + optim - fp32_grads) / 1e9 == pytest.approx(expected_gb, abs=0.05)


def test_offload_moves_optimizer_state_and_params_to_the_host():
    psi, n = 1_000_000, 4
    p, g, o, host = model_states(
        psi, stage=2, world=n, precision="bf16", offload_optimizer=True, offload_param=False
    )
    assert (p, g, o) == (2 * psi, 0, 0)  # the gradient partition is reduced into the host's fp32 copy
    # fp32 state, an fp32 copy of the gradients, and their 16-bit accumulation across micro steps
    assert host == pytest.approx((12 + 4 + 2) * psi / n)
    p, g, o, host = model_states(
        psi, stage=3, world=n, precision="bf16", offload_optimizer=True, offload_param=True, gathered=10
    )
    assert (p, g, o) == (2 * 10, 2 * 10, 0)  # the gathered layer only
    assert host == pytest.approx((12 + 4 + 2 + 2) * psi / n)  # ... and the 16-bit gradients and params
    # stage 1 keeps its full gradients on the device until backward ends
    assert model_states(psi, stage=1, world=n, precision="bf16", offload_optimizer=True, offload_param=False)[
        :3
    ] == (2 * psi, 2 * psi, 0)


def test_fp32_bytes_per_parameter():
    psi = 1000
    # stage 0 with torch AdamW: 4 + 4 + 8; stages 1-3: DeepSpeed's fp32 partition copy adds 4
    assert (
        sum(
            model_states(
                psi, stage=0, world=2, precision="fp32", offload_optimizer=False, offload_param=False
            )
        )
        == 16 * psi
    )
    assert (
        sum(
            model_states(
                psi, stage=3, world=2, precision="fp32", offload_optimizer=False, offload_param=False
            )
        )
        == 20 * psi / 2
    )


def test_communication_volume():
    psi = 100
    assert [comm_elements(psi, s, 1) for s in (0, 1, 2, 3)] == [200, 200, 200, 300]
    assert comm_elements(psi, 2, 4) == 500  # stage 2 reduce-scatters at every micro step
    assert comm_elements(psi, 3, 4) == 1200


def test_communication_bytes_count_gradients_in_the_dtype_they_are_reduced_in():
    """bf16 gradients summed in fp32 are reduced in fp32 (4 bytes), the parameters gathered in bf16 (2);
    summed in bf16, or cast to bf16 by deepspeed_extra's communication_data_type, both take 2 bytes.
    DeepSpeed's stage 0 sums and all-reduces bf16 gradients in bf16."""
    psi, m = 100, 4  # parameters, micro batches

    def cfg(*overrides: str):
        return build("gpt2-124m", overrides=["model.vocab_size=50304", *overrides], world_size=16)

    fp32, bf16 = cfg(), cfg("precision.grad_accum_dtype=bf16")
    cast = cfg("deepspeed_extra={communication_data_type: bf16}")
    grads = {1: psi, 2: m * psi, 3: m * psi}  # gradient elements, then parameter elements
    params = {1: psi, 2: psi, 3: 2 * m * psi}
    for stage in (1, 2, 3):
        mine = comm_bytes(fp32, psi, stage=stage, grad_accum=m)
        assert mine == grads[stage] * 4 + params[stage] * 2, stage
        for other in (bf16, cast):
            assert comm_bytes(other, psi, stage=stage, grad_accum=m) == (grads[stage] + params[stage]) * 2
    assert (
        comm_bytes(fp32, psi, stage=0, grad_accum=m)
        == comm_bytes(bf16, psi, stage=0, grad_accum=m)
        == 2 * psi * 2
    )
    full = cfg("precision.bf16=false")
    assert comm_bytes(full, psi, stage=2, grad_accum=m) == (m * psi + psi) * 4


def test_compared_with_deepspeeds_estimators():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    dev, host = deepspeed_estimate(
        10**9, 10**8, stage=2, world=16, gpus_per_node=8, offload_optimizer=False, offload_param=False
    )
    cpu, gpu = estimate_zero2_model_states_mem_needs(10**9, 8, 2, cpu_offload=False)
    assert (dev, host) == (gpu, cpu)
    assert deepspeed_estimate(
        10**9, 10**8, stage=0, world=16, gpus_per_node=8, offload_optimizer=False, offload_param=False
    ) == (None, None)
    dev3, _ = deepspeed_estimate(
        10**9, 10**8, stage=3, world=16, gpus_per_node=8, offload_optimizer=True, offload_param=True
    )
    assert dev3 == 4 * 10**8  # DeepSpeed: the largest layer only


def test_activations_shrink_with_checkpointing_and_grow_with_the_micro_batch():
    base = build("gpt2-124m", overrides=["model.vocab_size=50257"], world_size=16)
    ckpt = build(
        "gpt2-124m",
        overrides=["model.vocab_size=50257", "model.activation_checkpointing=true"],
        world_size=16,
    )
    big = build("gpt2-124m", overrides=["model.vocab_size=50257", "batch.micro_batch_size=24"], world_size=16)
    assert activation_bytes(ckpt) < 0.7 * activation_bytes(base)
    assert activation_bytes(big) == pytest.approx(2 * activation_bytes(base))
    assert largest_layer_params(base) == 50257 * 768  # the tied embedding


def test_plan_stages_fit_flags():
    cfg = build("gpt-6.7b", overrides=["model.vocab_size=50257"], world_size=16)
    plans = {(p.stage, p.offload): p for p in plan_stages(cfg, 16, device_gb=80.0)}
    assert len(plans) == 8
    assert not plans[(0, "none")].fits  # 6.7B x 16 bytes = 107 GB of model states alone
    assert plans[(2, "optimizer")].fits
    n = analytic_num_params(cfg.model)
    assert plans[(0, "none")].model_states_gb == pytest.approx(16 * n / 1e9)


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    from pretrain.cli import main

    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_plan_command(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text(
        "preset: gpt2-124m\nbatch:\n  gradient_accumulation_steps: 2\nmodel:\n  vocab_size: 50304\n"
    )
    text = run_plan(capsys, str(run), "--world-size", "16", "--gpu-gb", "40")
    assert "micro 12 x accumulation 2 x data-parallel 16 = 384 sequences per step" in text
    assert "tokens: 393,216 per step" in text
    assert '"zero_optimization": {' in text and '"train_batch_size": 384' in text
    rows = [
        line for line in text.splitlines() if line[:2].strip() in ("0", "1", "2", "3", "*0", "*1", "*2", "*3")
    ]
    assert len(rows) == 8 and all(r.rstrip().endswith(("yes", "NO")) for r in rows)
    assert sum(r.startswith("*") for r in rows) == 1  # this config's row is marked

    plan = json.loads(run_plan(capsys, "gpt2-124m", "--world-size", "16", "--json"))
    assert plan["world_size"] == 16 and len(plan["stages"]) == 8
    assert "= 144 sequences" in run_plan(capsys, "gpt2-124m", "--world-size", "3")  # the batch follows N


def rates(**kw: float) -> Rates:
    base = dict(
        peak_tflops=100.0, mfu=0.5, busbw=10e9, optimizer_s_per_param=1e-10, host_optimizer_s_per_param=1e-9
    )
    return Rates(**{**base, **kw}, sources={})  # type: ignore[arg-type]


def test_step_time_adds_compute_exposed_communication_and_the_optimizer():
    cfg = build("gpt2-124m", overrides=["model.vocab_size=50304"], world_size=16)
    m, b = cfg.model, cfg.batch
    n = analytic_num_params(m)
    tokens = b.micro_batch_size * b.gradient_accumulation_steps * m.block_size
    compute = analytic_flops_per_token(m) * tokens / (100e12 * 0.5)
    t0 = predict_step(cfg, 16, stage=0, offload_optimizer=False, offload_param=False, rates=rates())
    assert t0.compute_s == pytest.approx(compute)
    # stage 0: an all-reduce of 2Ψ bf16 gradients (DeepSpeed's stage 0 sums and reduces them in bf16),
    # ring factor (N-1)/N, after backward
    assert t0.comm_s == pytest.approx(2 * n * 2 * 15 / 16 / 10e9) and t0.exposed_comm_s == t0.comm_s
    assert t0.optimizer_s == pytest.approx(n * 1e-10)  # every parameter on every rank
    assert t0.step_s == pytest.approx(t0.compute_s + t0.comm_s + t0.optimizer_s)
    assert t0.days == pytest.approx(t0.step_s * cfg.schedule.max_steps / 86400)
    assert t0.tokens_per_s == pytest.approx(tokens * 16 / t0.step_s)
    t2 = predict_step(cfg, 16, stage=2, offload_optimizer=False, offload_param=False, rates=rates())
    # stage 2: the gradients reduce-scattered at every micro step in fp32 (summed in fp32, the default),
    # the parameters all-gathered once in bf16
    m_steps = b.gradient_accumulation_steps
    assert t2.comm_s == pytest.approx((m_steps * n * 4 + n * 2) * 15 / 16 / 10e9)
    # the reduce-scatters hide in backward at this bandwidth; the gather after the step does not
    assert t2.exposed_comm_s == pytest.approx(n * 2 * 15 / 16 / 10e9)
    assert t2.optimizer_s == pytest.approx(n / 16 * 1e-10)  # the partition only
    slow = predict_step(
        cfg, 16, stage=2, offload_optimizer=False, offload_param=False, rates=rates(busbw=1e6)
    )
    grads, params = m_steps * n * 4 * 15 / 16 / 1e6, n * 2 * 15 / 16 / 1e6
    backward = 2 / 3 * slow.compute_s  # no activation checkpointing: 4N of 6N
    assert slow.exposed_comm_s == pytest.approx(grads - 0.85 * backward + params)
    off = predict_step(cfg, 16, stage=2, offload_optimizer=True, offload_param=False, rates=rates())
    assert off.optimizer_s == pytest.approx(n / 16 * 1e-9) and off.offload == "optimizer"
    assert off.offload_s == 0.0  # no PCIe where the rates name none (the host is the device)
    assert (
        predict_step(cfg, 1, stage=0, offload_optimizer=False, offload_param=False, rates=rates()).comm_s
        == 0.0
    )  # one rank: nothing to reduce


def test_zero3_across_nodes_leaves_its_per_micro_batch_gathers_exposed():
    """GPT-2 124M on 16 ranks at 1 GB/s, accumulation 4: ZeRO-3 gathers the parameters in every micro
    batch's forward and backward and reduce-scatters there too, 4 x 3Ψ, and 85% of each pass hides it;
    ZeRO-2 reduce-scatters 4 x Ψ in backward and gathers Ψ after the step; ZeRO-1 all of 2Ψ after."""
    cfg = build(
        "gpt2-124m",
        overrides=[
            "model.vocab_size=50304",
            "batch.gradient_accumulation_steps=4",
            "batch.micro_batch_size=4",
        ],
        world_size=16,
    )
    n = analytic_num_params(cfg.model)
    r = rates(busbw=1e9)
    t1, t2, t3 = (
        predict_step(cfg, 16, stage=s, offload_optimizer=False, offload_param=False, rates=r)
        for s in (1, 2, 3)
    )
    ring = 15 / 16 / 1e9
    gather, reduce = 4 * n * 2 * ring, 4 * n * 4 * ring  # bf16 parameters, gradients summed in fp32
    compute = t3.compute_s
    assert compute == pytest.approx(analytic_flops_per_token(cfg.model) * 4 * 4 * 1024 / (100e12 * 0.5))
    forward, backward = compute / 3, 2 * compute / 3
    assert t3.comm_s == pytest.approx(2 * gather + reduce)
    assert t3.exposed_comm_s == pytest.approx(
        max(0.0, gather - 0.85 * forward) + max(0.0, gather + reduce - 0.85 * backward)
    )
    assert t3.exposed_comm_s > 0.5 * t3.comm_s  # most of it: the network is slow for this compute
    assert t2.exposed_comm_s == pytest.approx(max(0.0, reduce - 0.85 * backward) + n * 2 * ring)
    assert t1.exposed_comm_s == pytest.approx(t1.comm_s)
    assert t3.step_s > t2.step_s and t3.step_s > t1.step_s


def test_offload_copies_over_pcie():
    """Optimizer offload moves the fp32 gradient partition down (every micro batch at stage 3) and the
    bf16 partition up once a step; parameter offload brings the partition up for every micro batch's
    forward and backward instead. 16 ranks, accumulation 4, at 25 GB/s."""
    cfg = build(
        "gpt2-124m",
        overrides=["model.vocab_size=50304", "batch.gradient_accumulation_steps=4"],
        world_size=16,
    )
    part = analytic_num_params(cfg.model) / 16
    r = rates(pcie_bw=25e9)

    def pcie(stage: int, par: bool = False) -> float:
        return predict_step(
            cfg, 16, stage=stage, offload_optimizer=True, offload_param=par, rates=r
        ).offload_s

    assert pcie(2) == pytest.approx((4 * part + 2 * part) / 25e9)
    assert pcie(3) == pytest.approx((4 * 4 * part + 2 * part) / 25e9)
    assert pcie(3, par=True) == pytest.approx((4 * 4 * part + 2 * 4 * 2 * part) / 25e9)
    none = predict_step(cfg, 16, stage=2, offload_optimizer=False, offload_param=False, rates=r)
    assert none.offload_s == 0.0
    t = predict_step(cfg, 16, stage=2, offload_optimizer=True, offload_param=False, rates=r)
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_comm_s + t.optimizer_s + t.offload_s)


def test_the_host_line_reconciles_deepspeeds_estimate(capsys):
    """GPT 6.7B on two nodes of 8 A100s at ZeRO-2 with offload: DeepSpeed's estimator counts 1.5 x 4
    bytes x Ψ x 16 ranks on each node, the plan 8 ranks x (3 GB + 16 bytes x Ψ / 16)."""
    text = run_plan(capsys, "gpt-6.7b", "--hostfile", "hostfiles/a100x16", "--set", "parallel.tensor=1",
                    "--set", "zero.stage=2", "--set", "zero.offload_optimizer=true")  # fmt: skip
    n = analytic_num_params(build("gpt-6.7b", overrides=["model.vocab_size=50257"]).model)  # gpt2 BPE
    ds, plan = 1.5 * 4 * n * 16 / 1e9, 8 * (3.0 + 16 * n / 16 / 1e9)
    assert f"{ds:.1f}" == "639.2" and f"{plan:.1f}" == "77.3"
    line = next(x for x in text.splitlines() if x.startswith("host vs DeepSpeed:"))
    assert (
        f"DeepSpeed's {ds:.1f} GB a node for ZeRO-2 optimizer (DS host/node) is 1.5 x 4 bytes x 6.66B" in line
    )
    assert "an fp32 copy of the whole model for every rank of every node, counted on each node" in line
    assert f"the plan's {plan:.1f} GB is a node's 8 ranks x (3.000 process" in line
    assert "6.658 offloaded" in line and "no buffer factor" in line
    pick = next(x for x in text.splitlines() if x.startswith("pick: "))
    assert pick.startswith(
        "pick: ZeRO-2 none for this model on 16 x A100-80GB, because it is the fastest that fits"
    )
    assert "ZeRO-3 none" in pick and "exposed communication" in pick
    assert "ZeRO-0 does not fit" in pick


def test_rates_from_a_previous_run(tmp_path):
    cfg = build("small", overrides=["model.vocab_size=65", "zero.stage=0"], world_size=2)
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    header = "step,loss,fwd_bwd_s,optimizer_s,step_time_s\n"
    (tmp_path / "metrics.csv").write_text(
        header + "1,4.0,9.0,9.0,20\n2,3.9,2.0,0.02,2.1\n3,3.8,2.2,0.02,2.3\n"
    )
    r = resolve_rates(cfg, 2, 2, device="cpu", peak_tflops=0.1, busbw_gbs=1.0, from_runs=[tmp_path])
    n = analytic_num_params(cfg.model)
    comm = 2 * n * 4 * (1 / 2) / 1e9  # stage 0, fp32, 2 ranks: exposed inside the measured backward
    tokens = 32 * 256
    share = min(1.0, (os.cpu_count() or 1) / 2)  # its 2 ranks shared this machine's cores, if it has 1
    compute = (2.1 - comm) * share
    assert r.mfu == pytest.approx(analytic_flops_per_token(cfg.model) * tokens / compute / 0.1e12)
    assert r.optimizer_s_per_param == pytest.approx(0.02 * share / n)  # stage 0: every parameter
    assert "fwd" not in r.sources["mfu"] and str(tmp_path) in r.sources["mfu"]
    assert r.sources["busbw"] == "--busbw" and r.sources["peak"] == "--peak-tflops"
    # the prediction for the run's own config gives back its measured step (first row skipped)
    assert predict_step(
        cfg, 2, stage=0, offload_optimizer=False, offload_param=False, rates=r
    ).step_s == pytest.approx(2.1 + 0.02, rel=1e-6)
    with pytest.raises(ConfigError, match="not a finished run's directory"):
        resolve_rates(cfg, 2, 2, device="cpu", peak_tflops=0.1, from_runs=[tmp_path / "nothing"])
    with pytest.raises(ConfigError, match="--gpu B200: not in the peak table"):
        resolve_rates(cfg, 2, 2, device="B200")


def test_plan_takes_the_hostfile_and_prints_step_times(tmp_path, capsys):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots=8\nnode-2 slots=8\n")
    text = run_plan(capsys, "gpt-6.7b", "--hostfile", str(hostfile), "--gpu", "A100", "--gpu-gb", "80",
                    "--host-gb", "1000", "--mfu", "0.45", "--busbw", "25")  # fmt: skip
    assert "micro 4 x accumulation 8 x data-parallel 16 = 512 sequences per step" in text
    assert "peak 312 TFLOP/s a rank (A100 datasheet); MFU of forward+backward 0.45 (--mfu)" in text
    assert "all-reduce bus bandwidth 25 GB/s (--busbw)" in text
    times = [line for line in text.split("Time per step")[1].splitlines() if line[1:].startswith("ZeRO-2 ")]
    assert len(times) == 2 and times[1].startswith("*ZeRO-2  optimizer")  # this config's row
    assert "days: to train schedule.max_steps = 143,000 steps" in text
    plan = json.loads(
        run_plan(capsys, "gpt-6.7b", "--hostfile", str(hostfile), "--gpu", "A100-80GB", "--json")
    )
    assert (
        plan["world_size"] == 16 and len(plan["step_times"]) == 8 and plan["rates"]["mfu"] == 0.64
    )  # A100, data parallel, over 3B: docs/plan.md
    # host memory judged under offload: 8 ranks' CPU Adam state (6.7 GB each) does not fit in 40 GB
    small_host = run_plan(
        capsys, "gpt-6.7b", "--hostfile", str(hostfile), "--gpu", "A100-80GB", "--host-gb", "40"
    )
    row = next(line for line in small_host.splitlines() if line.startswith("*2"))
    assert row.rstrip().endswith("| NO")


@pytest.mark.distributed
def test_plan_reads_the_bus_bandwidth_preflight_measured(char_dataset, tmp_path, capsys):
    import subprocess
    import sys

    from tests.conftest import ROOT, TINY_SHAKESPEARE, subprocess_env

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    sets = [f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={char_dataset}",
            f"--set=logging.run_dir={tmp_path / 'run'}"]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "pretrain", "preflight", "--hostfile", str(hostfile), "--no-ssh", "--master-port", "29583", *sets],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    measured = json.loads((tmp_path / "run" / "preflight.json").read_text())["allreduce"]
    assert measured["world"] == 2 and measured["backend"] == "gloo" and measured["busbw"] > 0
    text = run_plan(capsys, "--hostfile", str(hostfile), *sets)
    assert (
        f"all-reduce bus bandwidth {measured['busbw'] / 1e9:.3g} GB/s ({tmp_path / 'run'}/preflight.json"
        in text
    )


def test_plan_knows_the_llama_shape(capsys):
    v = "model.vocab_size=50257"
    cfg = build("llama-1b", overrides=[v], world_size=16)
    m = cfg.model
    assert (m.arch, m.kv_heads, m.ffn_hidden, m.tie_embeddings) == ("llama", 4, 5632, False)
    n = analytic_num_params(m)
    assert 1.0e9 < n < 1.25e9  # TinyLlama's shape with GPT-2's vocabulary
    # untied: the wte lookup is not a matmul, the lm_head is
    assert analytic_flops_per_token(m) == 6 * (n - 50257 * 2048) + 12 * 22 * 2048 * 2048
    assert largest_layer_params(cfg) == 50257 * 2048
    # Activations per layer: 2h norms + 3h + 2kv attention + h + 4f SwiGLU values a token
    h, kv, f = 2048, 256, 5632
    no_ckpt = build("llama-1b", overrides=[v, "model.activation_checkpointing=false"], world_size=16)
    s, b, a = 2048, 8, 2
    per_layer = (2 * h + 3 * h + 2 * kv + h + 4 * f) * s * b * a
    logits = s * b * 50257 * (a + 4)
    assert activation_bytes(no_ckpt) == 22 * per_layer + logits + s * b * h * a
    # grouped-query attention keeps smaller k and v than full attention
    mha = build(
        "llama-1b", overrides=[v, "model.activation_checkpointing=false", "model.n_kv_head=32"], world_size=16
    )
    assert activation_bytes(mha) - activation_bytes(no_ckpt) == 22 * 2 * (h - kv) * s * b * a
    text = run_plan(capsys, "llama-tiny", "--world-size", "2")
    assert text.startswith(
        f"llama-tiny: {analytic_num_params(build('llama-tiny', overrides=['model.vocab_size=65']).model) / 1e6:.2f}M parameters"
    )
    assert ", llama, 2 layers" in text.splitlines()[0]


def test_the_zero_stages_benchmark_picks_from_its_measured_rows():
    """benchmarks/zero_stages.py's pick line: the most tokens/s among the rows that fit the budget, the
    lowest stage within 5% of it, the default knobs' rows left out."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "zero_stages.py"
    spec = importlib.util.spec_from_file_location("zero_stages", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def row(stage: int, offload: str, tokens: float, peak: float, knobs: str = "paper") -> dict:
        return {"stage": stage, "offload": offload, "micro": 2, "knobs": knobs, "tokens_per_s": tokens,
                "peak_gb": peak, "states_gb": peak / 2}  # fmt: skip

    rows = [row(0, "none", 80, 1.0), row(1, "none", 98, 0.8), row(2, "none", 100, 0.6), row(3, "none", 50, 0.5),
            row(3, "none", 500, 0.5, knobs="default")]  # fmt: skip
    line = bench.pick(rows, 2, None)
    assert line.startswith(
        "pick: ZeRO-1 none (micro 2) for this model on 2 ranks, because it has the lowest stage"
    )
    assert "ZeRO-2 none 100 tokens/s (+2%)" in line and "ZeRO-3 none 50 tokens/s (-49%)" in line
    within = bench.pick(rows, 2, 0.7)  # ZeRO-0 and 1 peak over 0.7 GB
    assert within.startswith(
        "pick: ZeRO-2 none (micro 2) for this model on 2 ranks, because it has the most tokens/s"
    )
    assert "ZeRO-0 over the budget" in within and "ZeRO-3 none 50 tokens/s (-50%)" in within
    assert bench.pick(rows, 2, 0.1).startswith("pick: none; every variant's peak is over 0.1 GB a rank")
