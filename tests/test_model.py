"""Unit tests of the GPT model: shapes, parameter counts, init, optimizer groups, checkpointing,
causality and sampling. Tiny shapes on CPU; no distributed code."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn as nn

from pretrain.config.tree import ModelConfig, analytic_num_params
from pretrain.training.model.gpt import GPT, Block, apply_rope, rope_cache

VOCAB = 65


def make_cfg(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB, dropout=0.0)
    return ModelConfig(**(base | overrides))


def make_model(seed: int = 0, **overrides: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(make_cfg(**overrides))


def first_block(model: GPT) -> Block:
    block = model.h[0]
    assert isinstance(block, Block)
    return block


def tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_output_shapes(position: str) -> None:
    model = make_model(position=position)
    idx, targets = tokens(3, 10), tokens(3, 10, seed=2)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 10, VOCAB)
    assert loss is not None and loss.ndim == 0
    # At init the prediction is near uniform, so the loss is near ln(V).
    assert abs(loss.item() - math.log(VOCAB)) < 0.5
    logits, loss = model(idx)
    assert logits.shape == (3, 1, VOCAB)
    assert loss is None


def test_loss_ignores_minus_one_targets() -> None:
    model = make_model()
    idx = tokens(2, 8)
    targets = idx.clone()
    targets[:, 4:] = -1
    logits, loss = model(idx, targets)
    expected = nn.functional.cross_entropy(logits[:, :4].reshape(-1, VOCAB), idx[:, :4].reshape(-1))
    assert loss is not None
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize(("n_layer", "n_head", "n_embd"), [(1, 1, 8), (2, 2, 32), (3, 4, 64)])
def test_num_params_matches_formula(
    bias: bool, position: str, n_layer: int, n_head: int, n_embd: int
) -> None:
    cfg = make_cfg(n_layer=n_layer, n_head=n_head, n_embd=n_embd, bias=bias, position=position)
    model = GPT(cfg)
    assert model.num_params() == analytic_num_params(cfg)
    embeddings = VOCAB * n_embd + (cfg.block_size * n_embd if position == "learned" else 0)
    assert model.num_params(non_embedding=True) == analytic_num_params(cfg) - embeddings


def test_tiny_preset_shape_param_count() -> None:
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=128, block_size=256, vocab_size=VOCAB)
    assert analytic_num_params(cfg) == 437_888
    assert GPT(cfg).num_params() == 437_888


def test_gpt2_124m_formula() -> None:
    # The figure GPT-2 small is known by (HF gpt2: 124,439,808), by the formula alone.
    cfg = ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)
    assert analytic_num_params(cfg) == 124_439_808


def test_flops_per_token_convention() -> None:
    cfg = make_cfg()
    model = GPT(cfg)
    n = model.num_params() - cfg.block_size * cfg.n_embd  # everything but wpe
    assert model.flops_per_token() == 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def test_weight_tying() -> None:
    model = make_model()
    assert model.lm_head.weight is model.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # the shared tensor listed once


def test_rope_has_no_position_parameters_and_buffers_stay_out_of_checkpoints() -> None:
    model = make_model(position="rope")
    assert model.wpe is None
    assert {name for name, _ in model.named_buffers()} == {"rope_cos", "rope_sin"}
    assert not any("rope" in key for key in model.state_dict())
    assert not any("rope" in name for name, _ in model.named_parameters())


def test_init_std() -> None:
    L = 8
    model = make_model(n_layer=L, n_head=4, n_embd=256, block_size=16)
    block = first_block(model)
    residual_std = 0.02 / math.sqrt(2 * L)
    for w in (block.attn.c_proj.weight, block.mlp.c_proj.weight):
        assert w.std().item() == pytest.approx(residual_std, rel=0.05)
    for w in (block.attn.c_attn.weight, block.mlp.c_fc.weight, model.wte.weight):
        assert w.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(block.attn.c_attn.bias == 0) and torch.all(block.mlp.c_proj.bias == 0)
    assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)
    assert torch.all(model.ln_f.weight == 1)


def test_init_weights_reinitialises_one_module_only() -> None:
    model = make_model()
    block = first_block(model)
    for p in model.parameters():
        nn.init.constant_(p, 7.0)
    model.init_weights(block.attn.c_proj)
    assert torch.all(block.attn.c_proj.bias == 0)
    assert torch.all(block.attn.c_attn.weight == 7.0)  # a sibling is untouched
    model.init_weights(block)  # a container has no parameters of its own
    assert torch.all(block.ln_1.weight == 7.0)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_param_groups(position: str) -> None:
    model = make_model(position=position)
    groups = model.param_groups(weight_decay=0.1)
    assert [g["name"] for g in groups] == ["decay", "no_decay"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    grouped = [id(p) for g in groups for p in g["params"]]
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == {id(p) for p in model.parameters()}
    decay = {id(p) for p in groups[0]["params"]}
    assert all(p.ndim == 2 for p in groups[0]["params"])
    names = {id(p): name for name, p in model.named_parameters()}
    for pid, name in names.items():
        is_linear_weight = name.endswith("weight") and (".c_" in name)
        assert (pid in decay) == is_linear_weight, name
    assert id(model.wte.weight) not in decay  # also the lm_head weight
    torch.optim.AdamW(groups, lr=1e-3)  # the groups are what AdamW takes


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_activation_checkpointing_matches(position: str) -> None:
    # Dropout on too: non-reentrant checkpointing replays the same RNG state in the recompute.
    plain = make_model(position=position, dropout=0.1)
    ckpt = GPT(make_cfg(position=position, dropout=0.1, activation_checkpointing=True))
    ckpt.load_state_dict(plain.state_dict())
    idx = tokens(2, 12)
    grads = []
    for model in (plain, ckpt):
        model.train()
        torch.manual_seed(3)
        _, loss = model(idx, idx)
        assert loss is not None
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for name, g in grads[0][1].items():
        torch.testing.assert_close(g, grads[1][1][name], msg=name)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_causality(position: str) -> None:
    model = make_model(position=position).eval()
    idx = tokens(2, 12)
    changed = idx.clone()
    changed[:, 8] = (changed[:, 8] + 1) % VOCAB
    before, _ = model(idx, idx)
    after, _ = model(changed, changed)
    torch.testing.assert_close(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_rope_scores_depend_only_on_distance() -> None:
    # The point of RoPE: q·k after rotation depends on the positions only through m - n.
    cos, sin = rope_cache(block_size=16, head_size=8, theta=10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> float:
        return float(apply_rope(q, cos[m], sin[m]) @ apply_rope(k, cos[n], sin[n]))

    assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
    assert score(0, 0) == pytest.approx(float(q @ k), abs=1e-5)  # position 0 is not rotated
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)


def test_too_long_input_raises() -> None:
    model = make_model(block_size=8)
    with pytest.raises(ValueError, match="block_size is 8"):
        model(tokens(1, 9))


def test_vocab_size_required() -> None:
    cfg = make_cfg(vocab_size=None)
    with pytest.raises(ValueError, match="vocab_size"):
        GPT(cfg)
    with pytest.raises(ValueError, match="vocab_size"):
        analytic_num_params(cfg)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_generate(position: str) -> None:
    model = make_model(position=position, block_size=8).eval()
    prompt = tokens(2, 5)
    # 5 + 10 tokens runs past block_size: the context is cropped, not an error.
    out = model.generate(prompt, 10, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 15)
    assert torch.equal(out[:, :5], prompt)
    assert int(out.min()) >= 0 and int(out.max()) < VOCAB
    again = model.generate(prompt, 10, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_generate_top_k_one_is_greedy() -> None:
    model = make_model().eval()
    prompt = tokens(1, 4)
    out = model.generate(prompt, 3, top_k=1)
    idx = prompt
    for _ in range(3):
        logits, _ = model(idx)
        idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, idx)


# ---------------------------------------------------------------------------------------------
# arch llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases


def test_llama_defaults_and_rules() -> None:
    cfg = make_cfg(arch="llama")
    assert (cfg.bias, cfg.position, cfg.kv_heads, cfg.ffn_hidden) == (False, "rope", 2, 128)  # 8/3*32 → 128
    assert cfg.activation == "swiglu" and make_cfg().activation == "gelu"
    assert make_cfg(arch="llama", activation="gelu").activation == "swiglu"  # as recorded before swiglu
    assert make_cfg(arch="llama", n_embd=768, n_head=12).ffn_hidden == 2048  # 8/3*768 = 2048
    assert make_cfg().ffn_hidden == 4 * 32
    for bad, message in [
        (dict(arch="llama", bias=True), "arch llama has no biases"),
        (dict(arch="llama", position="learned"), "arch llama uses rotary positions"),
        (dict(arch="llama", n_head=4, n_kv_head=3), "must divide n_head"),
        (dict(n_kv_head=1), "grouped-query attention: set model.arch=llama"),
        (dict(activation="swiglu"), "swiglu is llama's MLP: set model.arch=llama"),
        (dict(arch="llama", activation="gelu_tanh"), "arch llama's MLP is SwiGLU"),
    ]:
        with pytest.raises(ValueError, match=message):
            make_cfg(**bad)


def test_llama_block_is_rmsnorm_swiglu_gqa_without_biases() -> None:
    model = make_model(arch="llama", n_head=4, n_kv_head=2)
    block = first_block(model)
    assert isinstance(block.ln_1, nn.RMSNorm) and isinstance(model.ln_f, nn.RMSNorm)
    assert block.attn.c_attn.weight.shape == (32 + 2 * 2 * 8, 32)  # q: 4 heads, k and v: 2 heads of 8
    assert block.mlp.c_fc.weight.shape == (2 * 128, 32)  # gate and up
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    x = torch.randn(2, 5, 32)
    gate, up = block.mlp.c_fc(x).chunk(2, dim=-1)
    torch.testing.assert_close(block.mlp(x), block.mlp.c_proj(torch.nn.functional.silu(gate) * up))


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads() -> None:
    # n_kv_head=1: one k/v head serves both query heads; the same as two identical k/v heads.
    gqa = make_model(arch="llama", n_kv_head=1)
    full = GPT(make_cfg(arch="llama"))
    sd = gqa.state_dict()
    for i in range(2):
        q, k, v = sd[f"h.{i}.attn.c_attn.weight"].split([32, 16, 16])
        sd[f"h.{i}.attn.c_attn.weight"] = torch.cat([q, k, k, v, v])
    full.load_state_dict(sd)
    idx = tokens(2, 12)
    torch.testing.assert_close(gqa.eval()(idx, idx)[0], full.eval()(idx, idx)[0])


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(
    ("n_head", "n_kv_head", "intermediate_size"), [(2, None, None), (4, 1, 96), (4, 2, None)]
)
def test_llama_num_params_and_flops(
    tie: bool, n_head: int, n_kv_head: int | None, intermediate_size: int | None
) -> None:
    cfg = make_cfg(
        arch="llama",
        n_head=n_head,
        n_kv_head=n_kv_head,
        intermediate_size=intermediate_size,
        tie_embeddings=tie,
    )
    model = GPT(cfg)
    assert model.num_params() == analytic_num_params(cfg)
    assert (model.lm_head.weight is model.wte.weight) == tie
    # untied: the wte lookup costs nothing, the lm_head matmul counts
    n = model.num_params() - (0 if tie else VOCAB * 32)
    assert model.flops_per_token() == 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def test_tinyllama_formula() -> None:
    # TinyLlama-1.1B's shape with its 32000-token vocabulary: HF's count is 1,100,048,384.
    cfg = ModelConfig(
        arch="llama", n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, intermediate_size=5632,
        block_size=2048, vocab_size=32000, tie_embeddings=False,
    )  # fmt: skip
    assert analytic_num_params(cfg) == 1_100_048_384


@pytest.mark.parametrize("tie", [True, False])
def test_llama_trains_checkpoints_and_decays_an_untied_head(tie: bool) -> None:
    model = make_model(arch="llama", n_kv_head=1, tie_embeddings=tie, dropout=0.1)
    groups = model.param_groups(weight_decay=0.1)
    assert (id(model.lm_head.weight) in {id(p) for p in groups[0]["params"]}) == (not tie)
    assert id(model.wte.weight) in {id(p) for p in groups[1]["params"]}
    ckpt = GPT(
        make_cfg(arch="llama", n_kv_head=1, tie_embeddings=tie, dropout=0.1, activation_checkpointing=True)
    )
    ckpt.load_state_dict(model.state_dict())
    idx = tokens(2, 12)
    losses = []
    for m in (model, ckpt):
        m.train()
        torch.manual_seed(3)
        _, loss = m(idx, idx)
        assert loss is not None
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_llama_causality_and_generate() -> None:
    model = make_model(arch="llama", n_kv_head=1).eval()
    idx = tokens(2, 12)
    changed = idx.clone()
    changed[:, 8] = (changed[:, 8] + 1) % VOCAB
    before, after = model(idx, idx)[0], model(changed, changed)[0]
    torch.testing.assert_close(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])
    out = model.generate(idx[:, :4], 20, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 24)  # past block_size: the context is cropped
