"""The Hugging Face directory of an export: transformers loads it as is (model, tokenizer,
generation config, pipeline), gives our logits, and tokenizes exactly as we do, for every
tokenizer kind and every architecture."""

from __future__ import annotations

import json
import stat
import warnings
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from pretrain.config.tree import RunConfig
from pretrain.data.tokenizer import (
    UNK,
    BPETokenizer,
    CharTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    count_words,
    hf_added_tokens,
    hf_vocab_size,
)
from pretrain.export import hf_architecture, write_hf
from pretrain.training.model.gpt import GPT
from tests.conftest import GPT2_RANKS, TINY_SHAKESPEARE

transformers = pytest.importorskip("transformers", reason="transformers is a dev extra")


@cache
def texts() -> tuple[str, str]:
    """tiny-shakespeare's train and val text, cut 90/10 as `pretrain data prepare` cuts one document."""
    text = TINY_SHAKESPEARE.read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


@cache
def tokenizer(kind: str) -> Tokenizer:
    train, val = texts()
    if kind == "char":
        return CharTokenizer.fit([train + val])
    if kind == "gpt2":
        return TiktokenTokenizer(GPT2_RANKS)
    counts: Counter[bytes] = Counter()
    count_words(train, counts)
    return BPETokenizer.train(counts, 1024)


def write_random_export(out: Path, tok: Tokenizer, **model: Any) -> GPT:
    """A randomly initialised model (its weights spread, so the logits differ a lot between
    tokens) written by `write_hf`; returns the model in eval mode."""
    shape = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64, "vocab_size": tok.vocab_size}
    cfg = RunConfig.model_validate({"model": shape | model})
    torch.manual_seed(0)
    ours = GPT(cfg.model).eval()
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.2 * torch.randn_like(p))
    write_hf(out, cfg.model, {k: v.clone() for k, v in ours.state_dict().items()}, "fp32", tok)
    return ours


def logit_difference(ours: GPT, hf_dir: Path, ids: list[int]) -> float:
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    T = ours.cfg.block_size
    idx = torch.tensor([ids[i * T : (i + 1) * T] for i in range(3)])  # (3, T) of real text
    with torch.no_grad():
        logits, _ = ours(idx, idx)  # with targets: logits at every position
        theirs = hf(idx).logits
    # Rows past ours (the char tokenizer's added tokens) are zeros: their logits are 0.
    assert not theirs[..., logits.size(-1) :].any()
    return (logits - theirs[..., : logits.size(-1)]).abs().max().item()


@pytest.mark.parametrize("kind", ["char", "gpt2", "bpe"])
def test_hf_tokenizer_and_logits_match_ours_for_each_tokenizer_kind(kind, tmp_path):
    tok = tokenizer(kind)
    _, val = texts()
    ours = write_random_export(tmp_path / "hf", tok)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tok.encode(val)
    assert theirs(val)["input_ids"] == ids  # the whole validation text, nothing added
    assert theirs.decode(ids) == val
    assert theirs("ROMEO:")["input_ids"] == tok.encode("ROMEO:") != []
    assert len(theirs) == hf_vocab_size(tok) == tok.vocab_size + len(hf_added_tokens(tok))
    if tok.eot_token is not None:  # a literal end-of-text marker is text to us, and to it
        assert theirs("a<|endoftext|>")["input_ids"] == tok.encode("a<|endoftext|>")
        assert theirs.eos_token_id == tok.eot_token
    diff = logit_difference(ours, tmp_path / "hf", ids)
    print(f"{kind}: {len(ids):,} val tokens equal; max |logit difference| vs GPT2LMHeadModel {diff:.1e}")
    assert diff < 1e-5


ARCHS = {
    "gpt2": ({}, "GPT2LMHeadModel", 1e-5),
    "gpt2-nobias-untied": ({"bias": False, "tie_embeddings": False}, "GPT2LMHeadModel", 1e-5),
    "gpt2-rope": ({"position": "rope"}, "GPTNeoXForCausalLM", 1e-5),
    "gpt2-rope-nobias": ({"position": "rope", "bias": False}, "GPTNeoXForCausalLM", 1e-5),
    "pythia": (
        {"position": "rope", "rotary_pct": 0.25, "parallel_residual": True, "tie_embeddings": False},
        "GPTNeoXForCausalLM",
        1e-5,
    ),
    "llama-gqa": ({"arch": "llama", "n_kv_head": 2}, "LlamaForCausalLM", 1e-4),
    "llama-mqa-untied": (
        {"arch": "llama", "n_kv_head": 1, "tie_embeddings": False, "intermediate_size": 96},
        "LlamaForCausalLM",
        1e-4,
    ),
}


@pytest.mark.parametrize("name", list(ARCHS))
def test_hf_model_gives_our_logits_for_each_arch(name, tmp_path):
    model, architecture, tolerance = ARCHS[name]
    tok = tokenizer("char")
    ours = write_random_export(tmp_path / "hf", tok, **model)
    assert hf_architecture(ours.cfg) == architecture
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(hf).__name__ == architecture
    diff = logit_difference(ours, tmp_path / "hf", tok.encode(texts()[1]))
    print(f"{name}: max |logit difference| vs {architecture} {diff:.1e}")
    assert diff < tolerance


def test_pipeline_generation_config_and_greedy_decoding_match(tmp_path):
    tok = tokenizer("gpt2")
    ours = write_random_export(tmp_path / "hf", tok, arch="llama", n_kv_head=2)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == gen["bos_token_id"] == gen["pad_token_id"] == 50256
    assert gen["max_new_tokens"] == 200 and "max_length" not in gen and gen["do_sample"]
    for p in (tmp_path / "hf").iterdir():  # readable by others (umask 022 here): not 0600
        assert stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044, p.name

    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    with warnings.catch_warnings():  # a max_length in the export warned beside every max_new_tokens
        warnings.simplefilter("error")
        out = pipe("ROMEO:", max_new_tokens=8)[0]["generated_text"]
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:")
    # Greedy decoding: HF's generate picks the tokens ours does.
    prompt = torch.tensor([tok.encode("ROMEO:")])
    mine = ours.generate(prompt, 10, top_k=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert theirs.tolist() == mine.tolist()


@pytest.mark.distributed
def test_hf_dir_of_a_trained_export(exported):
    """The export of the shared 2-rank job (char-level, GPT-2 shape, ZeRO-3)."""
    from pretrain.export import load_model, tokenizer_for

    ours, cfg, where = load_model(exported)
    tok = tokenizer_for(where, cfg)
    _, val = texts()
    ids = tok.encode(val)
    assert transformers.AutoTokenizer.from_pretrained(exported / "hf")(val)["input_ids"] == ids
    diff = logit_difference(ours, exported / "hf", ids)
    print(f"trained export: max |logit difference| vs GPT2LMHeadModel {diff:.1e}")
    assert diff < 1e-5
    assert not (exported / "tokenizer.json").exists()  # ours is pretrain_tokenizer.json
    assert sorted(p.name for p in (exported / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for p in [*exported.iterdir(), *(exported / "hf").iterdir()]:
        assert stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044, p.name
    out = transformers.pipeline("text-generation", model=str(exported / "hf"))("ROMEO:", max_new_tokens=5)
    assert out[0]["generated_text"].startswith("ROMEO:")


UNICODE = "café naïve — 😀🎉 中文字 Ωμέγα\tend"


@pytest.mark.parametrize("kind", ["char", "gpt2", "bpe"])
def test_unicode_round_trips_or_is_the_unknown_token(kind, tmp_path):
    """A byte-level BPE round-trips any text; the char tokenizer maps each character it does not know
    to one <unk> (ours refuses it), never dropping it."""
    tok = tokenizer(kind)
    write_random_export(tmp_path / "hf", tok)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = theirs(UNICODE)["input_ids"]
    back = theirs.decode(ids)
    if kind == "char":
        known = set(tok.chars)
        assert back == "".join(c if c in known else UNK for c in UNICODE)
        assert ids.count(theirs.unk_token_id) == sum(c not in known for c in UNICODE) > 0
        assert theirs.decode(ids, skip_special_tokens=True) == "".join(c for c in UNICODE if c in known)
    else:
        assert ids == tok.encode(UNICODE) and back == UNICODE
    assert theirs.pad_token == theirs.eos_token == theirs.bos_token == "<|endoftext|>"
    assert theirs.padding_side == "left"


@pytest.mark.parametrize(
    ("kind", "model"),
    [
        ("char", {}),
        ("char", {"position": "rope"}),
        ("char", {"arch": "llama", "n_kv_head": 2}),
        ("bpe", {}),
        ("bpe", {"position": "rope", "vocab_size": 1088}),  # a padded vocabulary
        ("bpe", {"arch": "llama", "n_kv_head": 2}),
    ],
)
def test_batched_pipeline_pads_and_generates_what_each_prompt_alone_does(kind, model, tmp_path):
    tok = tokenizer(kind)
    write_random_export(tmp_path / "hf", tok, **model)
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    rows = json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]
    assert (
        gen["suppress_tokens"] == list(range(tok.vocab_size, rows))
        if rows > tok.vocab_size
        else "suppress_tokens" not in gen
    )
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "hf"))
    prompts = ["ROMEO:", "JULIET: O Romeo, Romeo!", "A"]  # of different lengths: the batch is padded
    greedy = {"max_new_tokens": 6, "do_sample": False, "return_full_text": False}
    batched = pipe(prompts, batch_size=3, **greedy)
    alone = [pipe(p, **greedy) for p in prompts]
    assert [b[0]["generated_text"] for b in batched] == [a[0]["generated_text"] for a in alone]
    sampled = pipe(prompts, batch_size=3, max_new_tokens=8)  # the generation config's sampling
    for prompt, out in zip(prompts, sampled, strict=True):
        text = out[0]["generated_text"]
        assert text.startswith(prompt) and UNK not in text and len(text) > len(prompt)
