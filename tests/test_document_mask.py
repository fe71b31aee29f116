"""Document masks in packed sequences (`loader.document_mask`, `model.document_eot`): the loss of a
packed sequence is the token-weighted loss of its documents run one by one, on the dense mask and on
FlexAttention's block mask, the pipeline's stages compute what the GPT does, the mask off is the
plain causal model, the plan counts each path's mask, and a config that cannot have end-of-text
tokens is refused.

All in-process on one rank: the pipeline's layers are run in order as DeepSpeed's PipelineModule
runs them, each stage's output what its engine would send on. On the CPU torch 2.13's FlexAttention
runs forward only (eagerly, unfused): the flex path's equalities run here under no_grad, and its
backward against the dense path's only on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from pretrain.config.tree import ModelConfig, validate
from pretrain.data.dataset import Dataset
from pretrain.data.fingerprint import output_config
from pretrain.errors import ConfigError, DataError
from pretrain.plan.memory import activation_bytes, document_mask_bytes
from pretrain.training.distributed.pipeline import (
    TIED,
    FinalNorm,
    PipelineBlock,
    Positions,
    TokenEmbedding,
    gpt_names,
    stage_output,
    tied_logits,
)
from pretrain.training.model.gpt import (
    GPT,
    document_block_mask,
    document_mask,
    document_path,
    document_positions,
)
from pretrain.training.run import resolve_document_eot

# FlexAttention on the CPU, eagerly: unfused, as meant for these small equalities (its kernels are CUDA's)
EAGER_FLEX = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
EOT = 0
V, T = 23, 32
SHAPES = {
    "learned": {},
    "rope": {"position": "rope"},
    "llama": {"arch": "llama", "n_head": 4, "n_kv_head": 2, "tie_embeddings": False},
}


def config(eot: int | None, **shape: object) -> ModelConfig:
    base = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": T, "vocab_size": V}
    return ModelConfig.model_validate({**base, **shape, "document_eot": eot})


def packed(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Two rows of T tokens of documents each ended by EOT (the last one cut by the window), their
    next tokens as targets, and each row's document starts (an EOT alone is a document too)."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(1, V, (2, T + 1), generator=g)
    ends = [[4, 5, 17, 30], [0, 11, 12, 25]]  # EOT at these indices: row 0's documents of 5, 1, 12, 13, 1
    for row, cuts in enumerate(ends):
        stream[row, cuts] = EOT
    starts = [[0, *(c + 1 for c in cuts if c + 1 < T)] for cuts in ends]
    return stream[:, :T].contiguous(), stream[:, 1:].contiguous(), starts


@EAGER_FLEX
@pytest.mark.parametrize("path", ["dense", "flex"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_packed_loss_equals_the_token_weighted_losses_of_its_documents_alone(shape: str, path: str):
    torch.manual_seed(0)
    masked = GPT(config(EOT, **SHAPES[shape]), document_attention=path).eval()  # type: ignore[arg-type]
    alone = GPT(config(None, **SHAPES[shape])).eval()  # the plain causal model, the same weights
    alone.load_state_dict(masked.state_dict())
    idx, targets, starts = packed()
    with torch.no_grad():
        loss = masked(idx, targets)[1]
        total, n = 0.0, 0
        for row, row_starts in enumerate(starts):
            for a, b in zip(row_starts, [*row_starts[1:], T], strict=True):
                # the document's inputs alone, at positions 0.., with the targets of the packed stream
                doc_loss = alone(
                    idx[row : row + 1, a:b].contiguous(), targets[row : row + 1, a:b].contiguous()
                )[1]
                total, n = total + float(doc_loss) * (b - a), n + (b - a)
        plain = alone(idx, targets)[1]
    assert loss is not None and plain is not None
    assert abs(float(loss) - total / n) < 1e-5
    assert abs(float(plain) - total / n) > 1e-4  # across documents the plain model computes otherwise


def test_positions_and_mask_of_a_packed_row():
    idx = torch.tensor([[5, EOT, EOT, 7, 8, EOT, 9]])
    pos = document_positions(idx, EOT)
    assert pos.tolist() == [[0, 1, 0, 0, 1, 2, 0]]
    allowed = document_mask(pos, torch.float32)[0, 0] == 0
    assert allowed[4].tolist() == [False, False, False, True, True, False, False]  # 8 sees 7 and itself
    assert allowed[1].tolist() == [True, True, False, False, False, False, False]  # an EOT ends its document


def test_the_block_mask_is_the_dense_masks_rule_in_blocks_of_128():
    """FlexAttention's block mask allows what the dense mask does, pair by pair, and keeps only block
    counts and indices: O(B (T/128)^2) int32, what the plan counts for a CUDA rank."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 6, (2, 300), generator=g)  # many documents, T not a multiple of 128
    pos = document_positions(idx, EOT)
    block = document_block_mask(pos)
    q, kv, h = torch.arange(300)[:, None], torch.arange(300), torch.tensor(0)
    allowed = torch.stack([block.mask_mod(torch.tensor(row), h, q, kv) for row in range(2)])  # (2, T, T)
    assert torch.equal(allowed, document_mask(pos, torch.float32)[:, 0] == 0)
    blocks = [t for t in block.as_tuple() if isinstance(t, torch.Tensor)]
    assert len(blocks) == 8 and all(t.dtype == torch.int32 and t.shape[-1] == 3 for t in blocks)  # 300/128
    starts = [c.cell_contents for c in block.mask_mod.__closure__ or ()]  # the document starts it reads
    kept = blocks + starts
    cfg = validate({"model": {"block_size": 300}, "batch": {"micro_batch_size": 2},
                    "data": {"tokenizer": "gpt2"}, "loader": {"document_mask": True}})  # fmt: skip
    assert document_mask_bytes(cfg, cpu=False) == sum(t.nbytes for t in kept)  # 8 x (2, 1, 3[, 3]) + (2, 300)
    assert document_mask_bytes(cfg, cpu=True) == 300 * 300 * 2 * 4  # the dense fp32 mask


def test_flex_on_cuda_dense_on_the_cpu_and_with_attention_dropout():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert document_path("auto", cuda, attention_dropout=False) == "flex"
    assert document_path("auto", cpu, attention_dropout=False) == "dense"
    assert document_path("auto", cuda, attention_dropout=True) == "dense"  # FlexAttention has no dropout
    assert document_path("flex", cpu, attention_dropout=False) == "flex"
    with pytest.raises(ValueError, match="no attention dropout"):
        document_path("flex", cuda, attention_dropout=True)


def test_mask_off_is_the_plain_causal_model_and_sampling_ignores_the_mask():
    torch.manual_seed(0)
    off = GPT(config(None)).eval()
    on = GPT(config(EOT)).eval()
    on.load_state_dict(off.state_dict())
    idx, targets, _ = packed()
    with torch.no_grad():
        logits = off(idx, targets)[0]
        # the causal transformer written out with SDPA's causal kernel: what the model computed before
        x = off.wte(idx) + off.wpe(torch.arange(T))
        for block in off.h:
            q, k, v = block.attn.c_attn(block.ln_1(x)).split(32, dim=2)
            q, k, v = (t.view(2, T, 2, 16).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, T, 32)
            x = x + block.attn.c_proj(y)
            x = x + block.mlp(block.ln_2(x))
        assert torch.equal(logits, off.lm_head(off.ln_f(x)))
        # sampling (no targets) is one causal sequence, with or without the KV cache
        assert torch.equal(on(idx)[0], off(idx)[0])
        gen = [m.generate(idx[:, :8], 6, generator=torch.Generator().manual_seed(1)) for m in (on, off)]
        assert torch.equal(*gen)


def test_the_packed_forward_compiles_to_one_graph():
    """torch.compile (compile.enabled) of the packed path: no graph break, the same loss and gradients.
    aot_eager traces what inductor does (forward and backward graphs), in seconds rather than a minute."""
    torch.manual_seed(0)
    gpt = GPT(config(EOT, position="rope", activation_checkpointing=True))
    idx, targets, _ = packed()
    loss = gpt(idx, targets)[1]
    assert loss is not None
    loss.backward()
    grads = [p.grad.clone() for p in gpt.parameters() if p.grad is not None]
    gpt.zero_grad()
    compiled = torch.compile(gpt, backend="aot_eager", fullgraph=True)(idx, targets)[1]
    assert compiled is not None
    compiled.backward()
    assert torch.allclose(compiled, loss, atol=1e-6, rtol=0)
    again = [p.grad for p in gpt.parameters() if p.grad is not None]
    assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(again, grads, strict=True))


def test_the_flex_packed_forward_compiles_to_one_graph():
    """The flex path under torch.compile (compile.enabled): the block mask's build and FlexAttention
    in one graph with no break, the eager forward's logits. Forward only: the CPU has no flex backward."""
    torch.manual_seed(0)
    gpt = GPT(config(EOT, arch="llama", n_head=4, n_kv_head=2), document_attention="flex").eval()
    idx, targets, _ = packed()
    with torch.no_grad():
        compiled = torch.compile(gpt, backend="aot_eager", fullgraph=True)(idx, targets)[0]
        eager = GPT(config(EOT, arch="llama", n_head=4, n_kv_head=2), document_attention="dense").eval()
        eager.load_state_dict(gpt.state_dict())
        assert torch.allclose(compiled, eager(idx, targets)[0], atol=1e-5, rtol=0)


def pipeline_layers(gpt: GPT) -> list[torch.nn.Module]:
    """The pipeline's layers of `gpt`'s config, with its weights: embedding, positions, blocks, norm."""
    m = gpt.cfg
    layers = [TokenEmbedding(m), Positions(m), *(PipelineBlock(m) for _ in range(m.n_layer)), FinalNorm(m)]
    weights = gpt.state_dict()
    for layer, prefix in zip(layers, gpt_names(m), strict=False):
        layer.load_state_dict({k: weights[prefix + k] for k in layer.state_dict()})
    return layers


@EAGER_FLEX
@pytest.mark.parametrize("shape", ["learned", "rope"])
def test_pipeline_stages_compute_the_gpts_packed_logits(shape: str):
    torch.manual_seed(0)
    gpt = GPT(config(EOT, **SHAPES[shape])).eval()  # the dense mask on the CPU
    embed, positions, block0, block1, final = pipeline_layers(gpt)
    idx, targets, _ = packed()
    with torch.no_grad():
        want = gpt(idx, targets)[0]
        sent = stage_output(block0(positions(embed(idx))))  # stage 0: embedding, positions, block 0
        assert isinstance(sent, tuple) and len(sent) == 2 and sent[1].dtype == torch.long  # no mask sent
        logits = tied_logits(embed, final(block1(sent)))  # stage 1: block 1 builds the mask again
    assert TIED == "wte" and torch.allclose(logits, want, atol=1e-6, rtol=0)
    for block in (block0, block1):  # FlexAttention's block mask, built again by stage 1 from the positions
        block.document_attention = "flex"
    with torch.no_grad():
        inside = block0(positions(embed(idx)))
        assert (
            type(inside[2]).__name__ == "BlockMask" and len(stage_output(inside)) == 2
        )  # kept within a stage
        flex = tied_logits(embed, final(block1(stage_output(inside))))
    assert torch.allclose(flex, want, atol=1e-5, rtol=0)


def test_document_mask_needs_an_end_of_text_token():
    with pytest.raises(ConfigError) as e:
        validate({"loader": {"document_mask": True}})  # the char tokenizer by default
    said = str(e.value)
    assert "loader.document_mask: the char tokenizer has no end-of-text token" in said and "; " not in said
    assert "set data.tokenizer=gpt2 or bpe (and prepare the data), or loader.document_mask=false" in said
    with pytest.raises(ConfigError, match=r"set loader\.document_mask=true"):
        validate({"model": {"document_eot": 3}, "data": {"tokenizer": "gpt2"}})


def test_the_eot_comes_from_the_manifest_and_a_manifest_without_one_is_refused(tmp_path: Path):
    cfg = validate({"data": {"tokenizer": "gpt2"}, "loader": {"document_mask": True}})
    with_eot = Dataset(tmp_path / "a", {"tokenizer": {"eot_token": 50256}})
    assert resolve_document_eot(cfg, [with_eot]).model.document_eot == 50256
    assert resolve_document_eot(validate({}), [with_eot]).model.document_eot is None  # the mask off
    older = Dataset(tmp_path / "b", {"tokenizer": {}})  # a manifest that records no eot_token
    with pytest.raises(DataError, match=r"b records no end-of-text token.*loader\.document_mask=false"):
        resolve_document_eot(cfg, [with_eot, older])
    given = validate(
        {"data": {"tokenizer": "gpt2"}, "loader": {"document_mask": True}, "model": {"document_eot": 7}}
    )
    with pytest.raises(ConfigError, match=r"leave model\.document_eot unset"):
        resolve_document_eot(given, [with_eot])


def test_a_prepared_dataset_serves_runs_with_and_without_the_mask():
    on = validate({"data": {"tokenizer": "gpt2"}, "loader": {"document_mask": True}})
    assert output_config(on.data) == output_config(validate({"data": {"tokenizer": "gpt2"}}).data)


def test_the_loaders_fields_read_at_their_old_place_in_data_said_once(capsys, monkeypatch):
    import pretrain.config.tree as tree

    monkeypatch.setattr(tree, "_SAID", set())  # once a process: as if no earlier test of this worker said it
    old = validate(
        {"data": {"tokenizer": "gpt2", "document_mask": True, "cache_dir": "/local/nvme", "prefetch": 4}}
    )
    assert (old.loader.document_mask, old.loader.cache_dir, old.loader.prefetch) == (True, "/local/nvme", 4)
    assert old == validate({"data": {"tokenizer": "gpt2", "document_mask": True}}).model_copy(
        update={"loader": old.loader}
    )
    said = capsys.readouterr().err
    assert "note: data.document_mask is now loader.document_mask" in said
    assert said.count("data.document_mask is now") == 1  # once a process
    with pytest.raises(ConfigError, match=r"data\.prefetch is now loader\.prefetch, and both are set"):
        validate({"data": {"prefetch": 4}, "loader": {"prefetch": 8}})


def test_plan_counts_one_mask_a_micro_batch_on_its_path():
    base = validate({"model": {"vocab_size": 50257}, "data": {"tokenizer": "gpt2"}})
    masked = validate(
        {"model": {"vocab_size": 50257}, "data": {"tokenizer": "gpt2"}, "loader": {"document_mask": True}}
    )
    s, b = base.model.block_size, base.batch.micro_batch_size
    assert (
        activation_bytes(masked, cpu=True) - activation_bytes(base, cpu=True) == s * s * b * 4
    )  # dense, fp32
    n = s // 128  # FlexAttention's block mask on CUDA ranks: 8 int32 tensors (b, 1, n[, n]), the starts
    assert activation_bytes(masked) - activation_bytes(base) == 16 * b * n * (n + 1) + 8 * b * s
    dropout = masked.model_copy(update={"model": masked.model.model_copy(update={"dropout": 0.1})})
    assert document_mask_bytes(dropout, cpu=False) == s * s * b * 4  # attention dropout: dense on CUDA too


def test_a_resume_may_turn_document_masks_on_or_off_and_says_so():
    """The weights are the same with and without the mask: not a change of the model (check_compatible
    skips model.document_eot), a warning line each way."""
    from pretrain.training.checkpoint.resume import document_mask_change

    assert document_mask_change(None, None) == [] and document_mask_change(50256, 50256) == []
    (on,) = document_mask_change(None, 50256)
    assert (
        on.startswith("loader.document_mask is on at this resume (it was off")
        and "within their document" in on
    )
    (off,) = document_mask_change(50256, None)
    assert off.startswith("loader.document_mask is off at this resume")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_flex_trains_as_the_dense_mask_on_a_gpu(shape: str):
    """On CUDA FlexAttention (compiled) has a backward: one packed forward and backward give the dense
    path's loss and gradients, for learned positions, RoPE and grouped-query attention."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: FlexAttention has no backward on the CPU")
    torch.manual_seed(0)
    dense = GPT(config(EOT, **SHAPES[shape]), document_attention="dense").cuda()
    flex = GPT(config(EOT, **SHAPES[shape])).cuda()  # auto: flex on CUDA
    flex.load_state_dict(dense.state_dict())
    idx, targets = (t.cuda() for t in packed()[:2])
    losses = []
    for gpt in (dense, flex):
        loss = gpt(idx, targets)[1]
        assert loss is not None
        loss.backward()
        losses.append(float(loss))
    assert abs(losses[0] - losses[1]) < 1e-5
    for (name, a), b in zip(dense.named_parameters(), flex.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
