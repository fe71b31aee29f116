"""A GPT language model in one file, in two architectures (`model.arch`):

- `gpt2`: token (+ learned or rotary position) embeddings, pre-LayerNorm blocks with causal
  self-attention and a GELU MLP, biases (Radford et al. 2019);
- `llama`: pre-RMSNorm blocks with rotary positions, grouped-query attention (n_kv_head key/value
  heads shared by n_head query heads) and a SwiGLU MLP, no biases (Touvron et al. 2023).

The language-model head is tied to the token embedding unless `tie_embeddings` is false. RoPE
rotates the pairs (i, i + hs/2) of each head, Hugging Face's `rotate_half` layout, so exported
q/k weights need no permutation. Generation keeps a KV cache (`KVCache`, `GPT.next_logits`): the
prompt is computed once, then one token a step, with the tokens of a forward of the whole context.

The model is a plain nn.Module and knows nothing about DeepSpeed or process groups; engine.py
wraps it, pipeline.py cuts it into pipeline stages. Three things are shaped for parallelism all the
same: `init_weights` initialises one module's own parameters from a seed of its name
(`init_seed`), so it can be re-run module by module on gathered parameters (ZeRO-3) or on one
pipeline stage's layers alone and give the weights of the whole model; attention reads its head
counts off its projection's width, so it computes with a tensor-parallel rank's share of the heads;
and `flops_per_token` is computed from the config, which still holds when the parameters are partitioned.

Packed documents (`model.document_eot`, set from the dataset by `loader.document_mask`): a training
sequence holds several documents, each ended by the end-of-text token. With it set, a forward given
targets attends within each document only (block-causal: a token sees the earlier tokens of its own
document, the end-of-text token belonging to the document it ends) and positions restart at 0 after
each end-of-text token, for learned positions and RoPE alike, as Megatron's --reset-attention-mask
--reset-position-ids. Both are derived from the token ids (`document_positions`, `document_mask`), so
the loader passes the same batches. Sampling (no targets) is one sequence, as without it. The mask
takes one of two forms (`document_path`), built once per forward and shared by every layer: on CUDA
FlexAttention's block mask (`document_block_mask`: block counts and indices, O(B (T/128)^2) ints,
its fused kernels skipping the blocks no query sees); elsewhere, and with attention dropout in
training, which FlexAttention does not apply, the dense additive (B, 1, T, T) mask to SDPA.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Literal

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from pretrain.config.tree import ModelConfig, analytic_flops_per_token, required_vocab_size


def rope_cache(block_size: int, head_size: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angle of every (position, frequency) pair, each (block_size, hs/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x[..., i], x[..., i + r/2]) of the first r = 2 cos.size(-1) dimensions of
    x (B, nh, T, hs) by its position's angle; the rest (rotary_pct < 1, as Pythia) pass unrotated."""
    # Cast to x's dtype so bf16 activations stay bf16 (and SDPA sees one dtype for q, k and v).
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    r = 2 * cos.size(-1)
    rot, rest = (x, None) if r == x.size(-1) else (x[..., :r], x[..., r:])
    x1, x2 = rot.chunk(2, dim=-1)  # (B, nh, T, r/2) each
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out if rest is None else torch.cat((out, rest), dim=-1)


def document_positions(idx: Tensor, eot: int) -> Tensor:
    """Each token's position in its document (B, T) of idx (B, T): 0 at the row's first token and at
    every token after an end-of-text token `eot`, which ends (and belongs to) the document before it."""
    t = torch.arange(idx.size(1), device=idx.device)  # (T,)
    starts = F.pad(idx[:, :-1] == eot, (1, 0), value=True)  # (B, T): token t begins a document
    first = torch.where(starts, t, 0).cummax(dim=1).values  # (B, T): where t's document begins
    return t - first


def document_mask(pos: Tensor, dtype: torch.dtype) -> Tensor:
    """The additive attention mask (B, 1, T, T) of document positions `pos` (B, T): 0 where query t may
    see key s (s in t's document and not after t: t - pos[t] <= s <= t), -inf elsewhere.

    Additive in the activations' dtype and built once per forward, so every layer passes SDPA the same
    tensor and autograd keeps one copy: a bool mask is converted to a new float tensor by each SDPA
    call, and each layer's copy is kept for its backward."""
    t = torch.arange(pos.size(1), device=pos.device)  # (T,)
    start = (t - pos)[:, :, None]  # (B, T, 1): the first token of each query's document
    allowed = (start <= t) & (t <= t[:, None])  # (B, T, T): key s in [start, t]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device).masked_fill_(~allowed, -math.inf)
    return mask[:, None]  # (B, 1, T, T): one mask for every head


def document_block_mask(pos: Tensor, *, compiled: bool | None = None) -> BlockMask:
    """FlexAttention's block mask of document positions `pos` (B, T), the rule of `document_mask`: for
    each (query block, key block) of 128 x 128 whether it is empty, full or partial, as int32 counts and
    indices (B, 1, T/128[, T/128]); `same_document` decides a partial block's pairs inside the kernel.
    One for every head (H = None), so a tensor rank applies it to its share of the heads. Built under
    torch.compile (`compiled`; None: on CUDA), which evaluates the rule block by block; eagerly it is
    evaluated on all (B, T, T) pairs at once, a transient of about 8 bytes a pair, freed at once."""
    B, T = pos.shape
    start = torch.arange(T, device=pos.device) - pos  # (B, T): the first token of each query's document

    def same_document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        return (kv <= q) & (start[b, q] <= kv)

    build = fused(create_block_mask) if (pos.is_cuda if compiled is None else compiled) else create_block_mask
    return build(same_document, B, None, T, T, device=pos.device)


_FUSED: dict[str, Any] = {}


def fused(fn: Any) -> Any:
    """FlexAttention's `fn` (flex_attention, create_block_mask) under torch.compile, compiled once a
    process: eagerly flex_attention computes the whole (T, T) score matrix and create_block_mask the
    whole (B, T, T) rule; compiled they are fused kernels that skip what is empty. Inside the model's
    own torch.compile (compile.enabled) `fn` itself: that graph fuses it, and no compile is nested."""
    if torch.compiler.is_compiling():
        return fn
    if fn.__name__ not in _FUSED:  # made outside any compile, at the first forward on CUDA
        _FUSED[fn.__name__] = torch.compile(fn)
    return _FUSED[fn.__name__]


DocumentPath = Literal["auto", "flex", "dense"]
Documents = Tensor | BlockMask  # `document_mask`'s (B, 1, T, T), or `document_block_mask`'s


def document_path(choice: DocumentPath, device: torch.device, *, attention_dropout: bool) -> str:
    """How packed documents are attended: FlexAttention ("flex") on CUDA, the dense mask with SDPA
    ("dense") elsewhere, and where attention dropout is on (training, model.dropout > 0): torch 2.13's
    FlexAttention has no backward on the CPU and applies no dropout. `choice` other than "auto" is kept
    (on the CPU FlexAttention runs forward only, eagerly: what the equality tests run)."""
    if choice == "flex" and attention_dropout:
        raise ValueError("FlexAttention applies no attention dropout: train with model.dropout=0 or dense")
    if choice != "auto":
        return choice
    return "flex" if device.type == "cuda" and not attention_dropout else "dense"


def documents_of(
    pos: Tensor, dtype: torch.dtype, choice: DocumentPath, *, attention_dropout: bool
) -> Documents:
    """The mask of document positions `pos` (B, T) on `document_path`'s path, built once a forward."""
    if document_path(choice, pos.device, attention_dropout=attention_dropout) == "flex":
        return document_block_mask(pos)
    return document_mask(pos, dtype)


def norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "llama":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)  # no mean subtraction, no bias
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class KVCache:
    """Every layer's keys and values of the first `pos` tokens of a batch, so that a forward takes
    only the tokens after them (decoding: one) and attends to all. The buffers are (B, nkv, block_size,
    hs), made at a layer's first forward from its keys' shape (under tensor parallelism, this rank's
    heads). The positions of the cached keys are fixed: when the context outgrows block_size and its
    window slides, every position changes and the cache must be filled again (`GPT.next_logits`)."""

    def __init__(self, n_layer: int, block_size: int) -> None:
        self.block_size = block_size
        self.pos = 0  # tokens cached
        self.k: list[Tensor | None] = [None] * n_layer
        self.v: list[Tensor | None] = [None] * n_layer

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k and v (B, nkv, T, hs) at positions pos..pos+T-1; return the keys and values of all
        the tokens so far, (B, nkv, pos+T, hs) each."""
        ck, cv = self.k[layer], self.v[layer]
        if ck is None or cv is None:
            B, nkv, _, hs = k.shape
            ck = self.k[layer] = k.new_empty(B, nkv, self.block_size, hs)
            cv = self.v[layer] = v.new_empty(B, nkv, self.block_size, hs)
        end = self.pos + k.size(2)
        ck[:, :, self.pos : end] = k
        cv[:, :, self.pos : end] = v
        return ck[:, :, :end], cv[:, :, :end]

    def keep(self, rows: Tensor) -> None:
        """Keep these rows of the batch only (the others are done)."""
        self.k = [None if k is None else k[rows] for k in self.k]
        self.v = [None if v is None else v[rows] for v in self.v]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.hs = cfg.n_head, cfg.kv_heads, cfg.head_size
        self.dropout = cfg.dropout
        # query, key and value projections for all heads in one matmul; with grouped-query
        # attention the keys and values have fewer heads (n_kv_head) than the queries
        kv = cfg.kv_heads * cfg.head_size
        self.c_attn = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * kv, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        setattr(self.c_proj, "is_residual_proj", True)  # noqa: B010 (nn.Module's setattr is typed for tensors)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        cache: KVCache | None = None,
        layer: int = 0,
        documents: Documents | None = None,
    ) -> Tensor:
        """Attention over x (B, T, C); `documents`: block-causal, `document_mask`'s (B, 1, T, T) or
        `document_block_mask`'s."""
        B, T, _ = x.size()  # batch, sequence length, n_embd
        qkv = self.c_attn(x)  # (B, T, (nh + 2 nkv) hs)
        # Under tensor parallelism c_attn holds only this rank's share of the heads (q, k and v
        # split alike): the head counts here are read off its output width, not the config.
        tp = (self.n_head + 2 * self.n_kv_head) * self.hs // qkv.size(-1)
        nh, nkv = self.n_head // tp, self.n_kv_head // tp
        q, k, v = qkv.split([nh * self.hs, nkv * self.hs, nkv * self.hs], dim=2)
        q = q.view(B, T, nh, self.hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, nkv, self.hs).transpose(1, 2)  # (B, nkv, T, hs)
        if rope is not None:
            # Positions enter only here: rotating q and k makes q·k depend on their distance.
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if isinstance(documents, BlockMask):
            # FlexAttention: the fused kernel skips the blocks no query sees; no dropout (document_path)
            flex = fused(flex_attention) if q.is_cuda else flex_attention
            y = flex(q, k, v, block_mask=documents, enable_gqa=nkv != nh)  # (B, nh, T, hs)
        else:
            y = self.sdpa(q, k, v, cache, layer, documents)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * self.hs)  # the heads' outputs side by side
        return self.resid_dropout(self.c_proj(y))

    def sdpa(
        self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache | None, layer: int, documents: Tensor | None
    ) -> Tensor:
        """SDPA of q (B, nh, T, hs) over k and v (B, nkv, T, hs): causal, over the cache's keys too, or
        within the documents of the dense mask."""
        T, nh, nkv = q.size(2), q.size(1), k.size(1)
        mask = None if documents is None else documents.to(q.dtype)  # a no-op in the model's own dtype
        if cache is not None:
            past = cache.pos
            all_k, all_v = cache.update(layer, k, v)  # (B, nkv, past+T, hs)
            if past:  # the new tokens see the cached ones too: query t sees keys 0..past+t
                k, v = all_k, all_v
                if T > 1:
                    mask = torch.ones(T, past + T, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None and k.size(2) == T,  # no cached keys, no documents: plain causal
            enable_gqa=nkv != nh,  # each k/v head serves n_head/n_kv_head queries
        )  # (B, nh, T, hs)


class MLP(nn.Module):
    """GELU (gpt2), or SwiGLU (llama, Shazeer 2020): silu(x W_gate) * (x W_up), the two input
    projections fused into c_fc as [gate; up]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.swiglu = cfg.arch == "llama"
        self.gelu = "tanh" if cfg.activation == "gelu_tanh" else "none"  # gpt2's; GPT-2's own is tanh
        hidden = cfg.ffn_hidden
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        setattr(self.c_proj, "is_residual_proj", True)  # noqa: B010
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.c_fc(x)  # (B, T, hidden), or (B, T, 2 hidden) with SwiGLU
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.gelu)  # exact (erf) GELU, or its tanh approximation
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = norm(cfg)
        self.mlp = MLP(cfg)
        self.parallel_residual = cfg.parallel_residual

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
        documents: Documents | None = None,
    ) -> Tensor:
        if self.parallel_residual:  # GPT-NeoX's: both branches read the block's input
            return x + self.attn(self.ln_1(x), rope, cache, layer, documents) + self.mlp(self.ln_2(x))
        x = x + self.attn(self.ln_1(x), rope, cache, layer, documents)
        return x + self.mlp(self.ln_2(x))


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean next-token loss of logits (B, T, V) against targets (B, T) (-1: ignored), in fp32
    whatever the logits' dtype (as autocast computes it): a bf16 loss keeps 8 bits, and the sums of
    losses over micro batches, ranks and log steps are made from it."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1), ignore_index=-1)


def init_seed(seed: int, name: str) -> int:
    """The seed of one module's initial weights: the run's seed and the module's name in GPT (e.g.
    "h.3.attn.c_attn"), so that any part of the model initialised alone gets the weights it has in
    the whole model, whichever rank or pipeline stage builds it."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def init_weights(module: nn.Module, cfg: ModelConfig) -> None:
    """Initialise `module`'s own parameters (not its children's), GPT-2 style."""
    if isinstance(module, nn.Linear):
        # Each block adds two residual projections to the stream; scaling them by 1/sqrt(2L)
        # keeps the residual stream's variance from growing with depth (GPT-2 paper).
        residual = getattr(module, "is_residual_proj", False)
        std = 0.02 / math.sqrt(2 * cfg.n_layer) if residual else 0.02
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
        nn.init.ones_(module.weight)
        bias = getattr(module, "bias", None)  # RMSNorm has none
        if isinstance(bias, Tensor):
            nn.init.zeros_(bias)


def materialize(module: nn.Module, prefix: str, cfg: ModelConfig, *, seed: int, where: torch.device) -> None:
    """Give a module built on the meta device (a block, an embedding, a norm, the head) storage on
    `where` and the initial weights it has in the whole GPT: each submodule from `init_seed(seed, its
    name in GPT)` (`prefix`: the module's own, e.g. "h.3."), drawn on `where`'s generator as a GPT
    built there draws them, and its derived buffers (the RoPE tables) recomputed. A model-parallel
    rank builds its part of the model this way, one layer at a time, and never holds it whole."""
    module.to_empty(device=where)
    with torch.device(where):
        for name, sub in module.named_modules():
            if isinstance(sub, HasDerivedBuffers):
                sub.reset_buffers()
            if any(True for _ in sub.parameters(recurse=False)):
                torch.manual_seed(init_seed(seed, f"{prefix}{name}".strip(".")))
                init_weights(sub, cfg)


class HasDerivedBuffers(nn.Module):
    """A module whose buffers are computed from its config (not learned, not in checkpoints): what
    `materialize` recomputes after giving a meta-built module storage."""

    def reset_buffers(self) -> None:
        raise NotImplementedError


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's decay / no-decay groups of `module`'s parameters (each shared tensor once): decay the
    weights of the projections, not biases, norms or embeddings. A tied lm_head's weight is wte's, an
    embedding, so it is not decayed; an untied one is. A projection is any module with a weight that
    is not an embedding or a norm, so this holds for the layers AutoTP puts in place of the Linear
    ones (a pipeline stage is sharded before its optimizer is built)."""
    kept = (nn.Embedding, nn.LayerNorm, nn.RMSNorm)
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    weights = {
        id(w) for m in module.modules() if isinstance(w := getattr(m, "weight", None), nn.Parameter)
        and not isinstance(m, kept)
    }  # fmt: skip
    decayed = weights - embeddings
    params = list(module.parameters())
    return [
        {"params": [p for p in params if id(p) in decayed], "weight_decay": weight_decay, "name": "decay"},
        {"params": [p for p in params if id(p) not in decayed], "weight_decay": 0.0, "name": "no_decay"},
    ]


class GPT(HasDerivedBuffers):
    rope_cos: Tensor  # (block_size, hs/2), buffers present only with position="rope"
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig, *, document_attention: DocumentPath = "auto") -> None:
        """`document_attention`: how packed documents are attended (`document_path`); auto by the device."""
        super().__init__()
        self.cfg = cfg
        self.document_attention = document_attention
        vocab_size = required_vocab_size(cfg)
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        if cfg.tie_embeddings:
            # Weight tying (Press & Wolf 2017): the output projection is the token embedding.
            self.lm_head.weight = self.wte.weight
        self.reset_buffers()
        self.reset_parameters(0)

    def reset_buffers(self) -> None:
        """The RoPE tables (none with learned positions), computed once and shared by every layer.
        Non-persistent: they follow the model across devices but are derived from the config, so
        they stay out of checkpoints."""
        if self.cfg.position == "rope":
            cos, sin = rope_cache(self.cfg.block_size, self.cfg.rotary_dims, self.cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise `module`'s own parameters; a tied lm_head is wte's weight, initialised as wte."""
        if not (module is self.lm_head and self.cfg.tie_embeddings):
            init_weights(module, self.cfg)

    def reset_parameters(self, seed: int) -> None:
        """Every module's parameters from `init_seed(seed, its name)`."""
        for name, module in self.named_modules():
            if any(True for _ in module.parameters(recurse=False)):
                torch.manual_seed(init_seed(seed, name))
                self.init_weights(module)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, cache: KVCache | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Logits (and the loss, given targets) of idx (B, T). With a cache, idx is the tokens after
        its `pos` cached ones, at positions pos..pos+T-1; their keys and values are added to it. Given
        targets (training, evaluation) with `document_eot` set, each packed document is attended and
        positioned on its own (the module docstring)."""
        start = 0 if cache is None else cache.pos
        T = idx.size(1)
        if start + T > self.cfg.block_size:
            raise ValueError(
                f"cannot forward a sequence of length {start + T}: block_size is {self.cfg.block_size}"
            )
        x = self.wte(idx)  # token embeddings (B, T, C)
        rope: tuple[Tensor, Tensor] | None = None
        eot = self.cfg.document_eot if targets is not None and cache is None else None
        if eot is not None:
            pos = document_positions(idx, eot)  # (B, T): each document's from 0
        else:
            pos = torch.arange(start, start + T, dtype=torch.long, device=idx.device)  # (T,)
        if self.wpe is not None:
            x = x + self.wpe(pos)  # position embeddings (T, C) broadcast over the batch, or (B, T, C)
        elif eot is not None:
            rope = (self.rope_cos[pos][:, None], self.rope_sin[pos][:, None])  # (B, 1, T, hs/2) each
        else:
            rope = (self.rope_cos[start : start + T], self.rope_sin[start : start + T])  # (T, hs/2) each
        documents = None
        if eot is not None:  # one mask for every layer
            dropout = self.training and self.cfg.dropout > 0
            documents = documents_of(pos, x.dtype, self.document_attention, attention_dropout=dropout)
        x = self.drop(x)
        for i, block in enumerate(self.h):
            if self.cfg.activation_checkpointing and self.training:
                # Keep only each block's input; recompute its activations during backward.
                x = checkpoint(block, x, rope, documents=documents, use_reentrant=False)
            else:
                x = block(x, rope, cache, i, documents)
        x = self.ln_f(x)
        if cache is not None:
            cache.pos += T

        if targets is not None:
            logits = self.lm_head(x)  # (B, T, V)
            return logits, cross_entropy(logits, targets)
        # Inference: only the last position's logits are needed; the list index keeps the time dim.
        return self.lm_head(x[:, [-1], :]), None  # (B, 1, V)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; a tied wte/lm_head weight is counted once. non_embedding drops wte and wpe."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if non_embedding:
            n -= self.wte.weight.numel()
            if self.wpe is not None:
                n -= self.wpe.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: `analytic_flops_per_token` of this model's config."""
        return analytic_flops_per_token(self.cfg)

    def param_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW groups: decay the 2-D weights of Linear layers; not biases, norms or embeddings."""
        return param_groups(self, weight_decay)

    def next_logits(self, idx: Tensor, cache: KVCache | None = None) -> Tensor:
        """The logits (B, V) of the token after idx (B, T), from its last block_size tokens: the model
        sees no further back. With a cache, idx is the context of the previous call with one token
        added: only that token is computed. When the context is longer than block_size, its window
        slides by a token every step, which moves every token's position (and with learned positions
        or RoPE alike, changes what the first ones attend to): the cache is filled again from the whole
        window, as a forward without it would compute it. So the cache saves work up to block_size
        tokens, and past it a step costs what it does without one, with the same outputs."""
        idx = idx[:, -self.cfg.block_size :]
        if cache is None:
            return self(idx)[0][:, -1, :]
        if cache.pos != idx.size(1) - 1:  # the first call, or the window slid: (re)fill the cache
            cache.pos = 0
            return self(idx, cache=cache)[0][:, -1, :]
        return self(idx[:, -1:], cache=cache)[0][:, -1, :]  # one new token, at position pos

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        kv_cache: bool = True,
    ) -> Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens, feeding each prediction back in, with a
        KV cache unless kv_cache is false (the same tokens, see `next_logits`).

        Call model.eval() first, or dropout stays on. The generator must be on idx's device.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        cache = KVCache(self.cfg.n_layer, self.cfg.block_size) if kv_cache else None
        for _ in range(max_new_tokens):
            logits = self.next_logits(idx, cache) / temperature  # (B, V)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
