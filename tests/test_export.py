"""Export: consolidated safetensors from any ZeRO stage, and sampling from an export or a checkpoint
(on the checkpoints of the shared 2-rank job)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CORPUS, TINY_SHAKESPEARE, ckpt, cli


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
    from pretrain.export import load_model, tokenizer_for
    from pretrain.generate import generate

    model, cfg, where = load_model(ckpt(out, "z3_full", 8))  # consolidated in memory
    text = generate(model, tokenizer_for(where, cfg), "ROMEO:", 40, 0.9, 20, 7)[0]
    assert a.stdout == text + "\n"
    assert generate(model, tokenizer_for(where, cfg), "ROMEO:", 40, 0.9, 20, 8)[0] != text  # another seed


@pytest.mark.distributed
def test_llama_run_with_a_trained_bpe_exports_to_llama_and_samples(tmp_path):
    """prepare (trained BPE) → train a GQA llama → export → LlamaForCausalLM gives our logits and
    its tokenizer our tokens; sampling works from the export and from the checkpoint."""
    transformers = pytest.importorskip("transformers", reason="transformers is a dev extra")
    data = [CORPUS, f"--set=data.dataset_dir={tmp_path / 'data'}", "--set=data.tokenizer=bpe",
            "--set=data.bpe_vocab_size=512"]  # fmt: skip
    done = cli("prepare", *data)
    assert done.returncode == 0, done.stderr[-3000:]
    run = [*data, f"--set=logging.run_dir={tmp_path / 'run'}", "--set=model.n_embd=64", "--set=model.n_head=4",
           "--set=model.n_kv_head=2", "--set=model.block_size=64", "--set=model.tie_embeddings=false",
           "--set=batch.micro_batch_size=4", "--set=schedule.max_steps=4", "--set=schedule.warmup_steps=1",
           "--set=logging.log_interval=1", "--set=logging.eval_interval=100", "--set=logging.sample_tokens=0",
           "--set=checkpoint.interval=4"]  # fmt: skip
    done = cli("train", "--preset", "llama-tiny", *run)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "export"
    done = cli("export", str(tmp_path / "run"), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Hugging Face LlamaForCausalLM dir" in done.stdout
    assert (out / "pretrain_tokenizer.json").is_file() and (out / "tokenizer.tiktoken").is_file()
    assert "lm_head.weight" in load_file(str(out / "model.safetensors"))  # untied: stored

    from pretrain.export import load_model, tokenizer_for

    ours, cfg, where = load_model(out)
    assert cfg.model.arch == "llama" and not cfg.model.bias and cfg.model.position == "rope"
    tok = tokenizer_for(where, cfg)
    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")
    val = text[int(len(text) * 0.9) :]
    ids = tok.encode(val)
    assert transformers.AutoTokenizer.from_pretrained(out / "hf")(val)["input_ids"] == ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_key_value_heads == 2
    idx = torch.tensor([ids[i * 64 : (i + 1) * 64] for i in range(3)])
    with torch.no_grad():
        diff = (ours(idx, idx)[0] - hf(idx).logits).abs().max().item()
    print(f"trained llama (bpe 512): max |logit difference| vs LlamaForCausalLM {diff:.1e}")
    assert diff < 1e-4

    args = ["--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "3"]
    a = cli("sample", str(out), *args)
    assert a.returncode == 0, a.stderr[-3000:]
    assert (ckpt(tmp_path, "run", 4) / "tokenizer.tiktoken").is_file()  # the checkpoint holds the BPE's ranks
    b = cli("sample", str(ckpt(tmp_path, "run", 4)), *args)
    assert b.returncode == 0, b.stderr[-3000:]
    assert a.stdout == b.stdout and a.stdout.startswith("ROMEO:")
