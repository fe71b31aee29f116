"""Export: consolidated safetensors from any ZeRO stage, and sampling from an export or a checkpoint
(on the checkpoints of the shared 2-rank job)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import ckpt, cli


@pytest.mark.distributed
def test_export_consolidates_any_zero_stage(two_ranks, exported, tmp_path):
    from safetensors.torch import load_file

    from pretrain.export import consolidated_state_dict, export

    _, out = two_ranks
    z0 = consolidated_state_dict(ckpt(out, "z0_full", 8))
    z2 = consolidated_state_dict(ckpt(out, "z2_full", 8))
    z3 = load_file(str(exported / "model.safetensors"))
    assert set(z3) == set(z0) - {"lm_head.weight"}  # the tied head is stored once
    for k, v in z3.items():
        # every stage's gathering gives stage 0's weights (to rounding: ZeRO averages gradients
        # in another order)
        assert (z2[k] - z0[k]).abs().max() < 1e-5 and (v - z0[k]).abs().max() < 1e-5, k
        assert v.dtype == torch.float32
    export(ckpt(out, "z2_full", 8), tmp_path / "bf16", dtype="bf16", hf=False)
    bf16 = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, z2[k].bfloat16()) for k, v in bf16.items())
    assert not (tmp_path / "bf16" / "hf").exists()
    info = json.loads((exported / "pretrain.json").read_text())
    assert info["step"] == 8 and info["model"]["n_layer"] == 2


@pytest.mark.distributed
def test_sample_from_an_export_and_from_a_checkpoint(two_ranks, exported):
    _, out = two_ranks
    args = [
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "40",
        "--temperature",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "7",
    ]
    a = cli("sample", str(exported), *args)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.stdout.startswith("ROMEO:") and len(a.stdout.strip()) >= 40
    from pretrain.export import generate, load_model, tokenizer_for

    model, cfg, where = load_model(ckpt(out, "z3_full", 8))  # consolidated in memory
    text = generate(model, tokenizer_for(where, cfg), "ROMEO:", 40, 0.9, 20, 7)[0]
    assert a.stdout == text + "\n"
    assert generate(model, tokenizer_for(where, cfg), "ROMEO:", 40, 0.9, 20, 8)[0] != text  # another seed
