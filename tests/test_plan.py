"""`pretrain plan`: the ZeRO paper's memory and communication formulas, and the command."""

from __future__ import annotations

import json

import pytest

from pretrain.model import analytic_num_params
from pretrain.plan import (
    activation_bytes,
    comm_elements,
    deepspeed_estimate,
    largest_layer_params,
    model_states,
    plan_stages,
)
from pretrain.presets import build


@pytest.mark.parametrize(
    ("stage", "expected_gb"),
    # The ZeRO paper's figure 1: Ψ = 7.5B, N = 64, K = 12, mixed precision.
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_model_states_match_the_zero_paper(stage, expected_gb):
    params, grads, optim, host = model_states(7_500_000_000, stage, 64, "bf16", False, False)
    assert host == 0
    assert (params + grads + optim) / 1e9 == pytest.approx(expected_gb, abs=0.05)


def test_offload_moves_optimizer_state_and_params_to_the_host():
    psi, n = 1_000_000, 4
    p, g, o, host = model_states(psi, 2, n, "bf16", True, False)
    assert (p, g, o) == (2 * psi, 2 * psi / n, 0)  # the gradient partition stays on the device
    assert host == pytest.approx((12 + 4) * psi / n)  # fp32 state + an fp32 copy of the gradients
    p, g, o, host = model_states(psi, 3, n, "bf16", True, True)
    assert (p, g, o) == (0, 2 * psi / n, 0)
    assert host == pytest.approx((12 + 4 + 2) * psi / n)


def test_fp32_bytes_per_parameter():
    psi = 1000
    # stage 0 with torch AdamW: 4 + 4 + 8; stages 1-3: DeepSpeed's fp32 partition copy adds 4
    assert sum(model_states(psi, 0, 2, "fp32", False, False)) == 16 * psi
    assert sum(model_states(psi, 3, 2, "fp32", False, False)) == 20 * psi / 2


def test_communication_volume():
    psi = 100
    assert [comm_elements(psi, s, 1) for s in (0, 1, 2, 3)] == [200, 200, 200, 300]
    assert comm_elements(psi, 2, 4) == 500  # stage 2 reduce-scatters at every micro step
    assert comm_elements(psi, 3, 4) == 1200


def test_compared_with_deepspeeds_estimators():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    dev, host = deepspeed_estimate(10**9, 10**8, 2, 16, 8, False, False)
    cpu, gpu = estimate_zero2_model_states_mem_needs(10**9, 8, 2, cpu_offload=False)
    assert (dev, host) == (gpu, cpu)
    assert deepspeed_estimate(10**9, 10**8, 0, 16, 8, False, False) == (None, None)
    dev3, _ = deepspeed_estimate(10**9, 10**8, 3, 16, 8, True, True)
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
    text = run_plan(capsys, str(run), "--world-size", "16", "--device-gb", "40")
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
