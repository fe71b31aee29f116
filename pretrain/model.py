"""A GPT language model in one file: token (+ learned or rotary position) embeddings, pre-LayerNorm
transformer blocks with causal self-attention and a GELU MLP, and a language-model head tied to
the token embedding.

The model is a plain nn.Module and knows nothing about DeepSpeed or process groups; engine.py
wraps it. Two things are shaped for ZeRO-3 all the same: `init_weights` initialises one module's
own parameters, so it can be re-run module by module on gathered parameters, and
`flops_per_token` is computed from the config, which still holds when the parameters are partitioned.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from pretrain.config import ModelConfig


def _vocab_size(cfg: ModelConfig) -> int:
    if cfg.vocab_size is None:
        raise ValueError(
            "model.vocab_size is None: set it to the tokenizer's vocabulary size (or larger) before "
            "building the model"
        )
    return cfg.vocab_size


def rope_cache(block_size: int, head_size: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotation angle of every (position, frequency) pair, each (block_size, hs/2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)  # (hs/2,)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair (x[..., i], x[..., i + hs/2]) of x (B, nh, T, hs) by its position's angle."""
    # Cast to x's dtype so bf16 activations stay bf16 (and SDPA sees one dtype for q, k and v).
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)  # (B, nh, T, hs/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        # key, query and value projections for all heads in one matmul
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        setattr(self.c_proj, "is_residual_proj", True)  # noqa: B010 (nn.Module's setattr is typed for tensors)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        B, T, C = x.size()  # batch, sequence length, n_embd
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if rope is not None:
            # Positions enter only here: rotating q and k makes q·k depend on their distance.
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        setattr(self.c_proj, "is_residual_proj", True)  # noqa: B010
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    rope_cos: Tensor  # (block_size, hs/2), buffers present only with position="rope"
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        vocab_size = _vocab_size(cfg)
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        # Weight tying (Press & Wolf 2017): the output projection is the token embedding.
        self.lm_head.weight = self.wte.weight
        if cfg.position == "rope":
            # Computed once and shared by every layer. Non-persistent: they follow the model across
            # devices but are derived from the config, so they stay out of checkpoints.
            cos, sin = rope_cache(cfg.block_size, cfg.n_embd // cfg.n_head, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self.init_weights)

    def init_weights(self, module: nn.Module) -> None:
        """Initialise `module`'s own parameters (not its children's), GPT-2 style."""
        if isinstance(module, nn.Linear):
            # Each block adds two residual projections to the stream; scaling them by 1/sqrt(2L)
            # keeps the residual stream's variance from growing with depth (GPT-2 paper).
            residual = getattr(module, "is_residual_proj", False)
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if residual else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if idx.size(1) > self.cfg.block_size:
            raise ValueError(
                f"cannot forward a sequence of length {idx.size(1)}: block_size is {self.cfg.block_size}"
            )
        T = idx.size(1)
        x = self.wte(idx)  # token embeddings (B, T, C)
        rope: tuple[Tensor, Tensor] | None = None
        if self.wpe is not None:
            pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
            x = x + self.wpe(pos)  # position embeddings (T, C) broadcast over the batch
        else:
            rope = (self.rope_cos[:T], self.rope_sin[:T])  # (T, hs/2) each
        x = self.drop(x)
        for block in self.h:
            if self.cfg.activation_checkpointing and self.training:
                # Keep only each block's input; recompute its activations during backward.
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        x = self.ln_f(x)

        if targets is not None:
            logits = self.lm_head(x)  # (B, T, V)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return logits, loss
        # Inference: only the last position's logits are needed; the list index keeps the time dim.
        return self.lm_head(x[:, [-1], :]), None  # (B, 1, V)

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameter count; the tied wte/lm_head weight is counted once. non_embedding drops wte and wpe."""
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
        """AdamW groups: decay the 2-D weights of Linear layers; not biases, LayerNorms or embeddings.

        lm_head's weight is wte's, an embedding, so it is not decayed.
        """
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        linear = {id(m.weight) for m in self.modules() if isinstance(m, nn.Linear)} - embeddings
        params = list(self.parameters())  # each shared tensor once
        return [
            {"params": [p for p in params if id(p) in linear], "weight_decay": weight_decay, "name": "decay"},
            {"params": [p for p in params if id(p) not in linear], "weight_decay": 0.0, "name": "no_decay"},
        ]

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens, feeding each prediction back in.

        Call model.eval() first, or dropout stays on. The generator must be on idx's device.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        for _ in range(max_new_tokens):
            # Crop the context to the last block_size tokens: the model sees no further back.
            idx_cond = idx if idx.size(1) <= self.cfg.block_size else idx[:, -self.cfg.block_size :]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature  # (B, V)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx_next = torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx


def analytic_num_params(cfg: ModelConfig) -> int:
    """The parameter count of GPT(cfg) in closed form (tied lm_head counted once, with wte)."""
    V, T, d, L = _vocab_size(cfg), cfg.block_size, cfg.n_embd, cfg.n_layer
    b = 1 if cfg.bias else 0  # each bias vector exists only with cfg.bias
    layer_norm = d + b * d  # weight (+ bias)
    attention = (d * 3 * d + b * 3 * d) + (d * d + b * d)  # c_attn (qkv) + c_proj
    mlp = (d * 4 * d + b * 4 * d) + (4 * d * d + b * d)  # c_fc + c_proj
    block = 2 * layer_norm + attention + mlp  # = 12 d^2 + 13 d with bias, 12 d^2 + 2 d without
    return (
        V * d  # wte, which is also lm_head's weight
        + (T * d if cfg.position == "learned" else 0)  # wpe; RoPE has no parameters
        + L * block  # transformer blocks
        + layer_norm  # ln_f
    )


def analytic_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs (forward + backward) per token, in the PaLM convention (appendix B), as
    nanoGPT's estimate_mfu uses it: 6*N + 12*L*n_head*head_dim*T.

    N is every parameter except the position embedding: each weight costs a multiply and an add
    forward and twice that backward. The tied wte weight stays in N as the lm_head matmul (the
    embedding lookup itself is free). The second term is the attention scores and their weighted
    sum over the full T x T matrix, causal mask ignored. Computed from the config, not the
    parameters, so it holds wherever the parameters live.
    """
    n = analytic_num_params(cfg) - (cfg.block_size * cfg.n_embd if cfg.position == "learned" else 0)
    head_dim = cfg.n_embd // cfg.n_head
    return 6 * n + 12 * cfg.n_layer * cfg.n_head * head_dim * cfg.block_size
