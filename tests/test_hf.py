"""The Hugging Face GPT-2 directory of an export gives our logits in transformers' GPT2LMHeadModel."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.distributed
def test_hf_gpt2_dir_gives_our_logits(exported):
    transformers = pytest.importorskip("transformers", reason="transformers is a dev extra")
    from pretrain.export import load_model

    ours, _, _ = load_model(exported)
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported / "hf").eval()
    idx = torch.randint(
        0, ours.cfg.vocab_size or 2, (3, ours.cfg.block_size), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits, _ = ours(idx, idx)  # with targets: logits at every position
        theirs = hf(idx).logits
    diff = (logits - theirs).abs().max().item()
    print(f"max |logit difference| vs GPT2LMHeadModel: {diff:.1e}")
    assert diff < 1e-5
