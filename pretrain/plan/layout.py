"""What a layout of ranks (config/layout.py: tensor x pipeline x data-parallel) means for each rank:
the pipeline stages DeepSpeed cuts and what each of their ranks holds (parameters, FLOPs), and the ZeRO stages and offloads each
layout allows. `memory` counts a rank's bytes from it, `plan` its step time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from pretrain.config.batch import BatchConfig
from pretrain.config.ds_render import pipeline_checkpoint_interval
from pretrain.config.engine_sections import OptimizerConfig
from pretrain.config.layout import Layout
from pretrain.config.tree import ModelConfig, RunConfig

# (stage, offload_optimizer, offload_param): every stage, with and without offload.
VARIANTS = [(0, False, False)] + [
    (s, off, par)
    for s in (1, 2, 3)
    for off, par in ((False, False), (True, False), (True, True))
    if s == 3 or not par
]


@dataclass(frozen=True)
class StageShare:
    """One pipeline stage as each of its tensor-parallel ranks holds it."""

    index: int
    blocks: int
    first: bool  # holds the embeddings (wte, wpe)
    last: bool  # holds ln_f and the lm_head (under pipeline, a tied lm_head's own copy of wte)
    params: int  # on each rank of the stage: 1/tensor of the blocks' matrices, the rest whole
    flops_per_token: float  # forward + backward on each rank, the recomputed forward included


def layer_params(m: ModelConfig) -> tuple[int, int, int, int]:
    """(embedding, a block's tensor-parallel part, a block's replicated part, head) parameters.

    AutoTP splits a block's four matrices (and their biases, counted with them) over the tensor
    ranks (`ds_render.autotp_layer_specs`); the norms, the embeddings and the lm_head stay whole on
    every rank. A tied lm_head is wte: one copy without pipeline, one on the first and one on the last
    stage with it (TiedLayerSpec), so the head's count includes it either way."""
    d, vocab, f = m.n_embd, m.vocab_size or 0, m.ffn_hidden
    kv, b = m.kv_heads * m.head_size, 1 if m.bias else 0
    norm = d + b * d
    attention = d * (d + 2 * kv) + b * (d + 2 * kv) + d * d + b * d
    mlp = (2 if m.arch == "llama" else 1) * (d * f + b * f) + f * d + b * d
    embedding = vocab * d + (m.block_size * d if m.position == "learned" else 0)
    return embedding, attention + mlp, 2 * norm, norm + vocab * d


def recomputes(cfg: RunConfig, pipeline: int) -> int:
    """Blocks between activation checkpoints (0: none): the pipeline's interval with stages, else
    model.activation_checkpointing's one block."""
    return pipeline_checkpoint_interval(cfg) if pipeline > 1 else int(cfg.model.activation_checkpointing)


def stage_shares(cfg: RunConfig, layout: Layout) -> list[StageShare]:
    """Each pipeline stage's blocks, parameters and FLOPs per rank.

    The stages are cut as DeepSpeed's PipelineModule cuts the layer list [embedding, block x L,
    head] (`parallel.partition_method`: 'uniform' by layer count, 'parameters' by parameter count,
    with DeepSpeed's own partition functions); the embeddings weigh on the first stage, the head on
    the last, whole on each of their tensor ranks."""
    m, tp, pp = cfg.model, layout.tensor, layout.pipeline
    emb, sharded, whole, head = layer_params(m)
    n_layer = m.n_layer
    block_params = sharded / tp + whole
    attention_flops = 12 * m.n_head * m.head_size * m.block_size  # the scores and their weighted sum
    block_flops = (6 * sharded + attention_flops) / tp + 6 * whole
    if recomputes(cfg, pp):
        block_flops *= 4 / 3  # the forward again in backward (2N of the 6N)
    head_flops = 6 * head  # ln_f and the lm_head matmul, whole on every tensor rank; the lookups are free
    if pp == 1:
        tied = (m.vocab_size or 0) if m.tie_embeddings else 0  # one wte, which is the lm_head
        cuts = [0, n_layer + 2]
    else:
        tied = 0
        cuts = _partition(
            (emb, *([sharded + whole] * n_layer), head), pp, cfg.parallel.partition_method == "uniform"
        )
    out = []
    for i in range(pp):
        start, stop = cuts[i], cuts[i + 1]
        blocks = len(range(max(start, 1), min(stop, n_layer + 1)))
        first, last = start == 0 < stop, stop == n_layer + 2 > start
        params = blocks * block_params + (emb if first else 0) + (head if last else 0) - tied * m.n_embd
        flops = blocks * block_flops + (head_flops if last else 0)
        out.append(StageShare(i, blocks, first, last, round(params), flops))
    return out


@functools.lru_cache(maxsize=256)
def _partition(weights: tuple[int, ...], parts: int, uniform: bool) -> list[int]:
    """DeepSpeed's own cut of a PipelineModule's layers (`deepspeed.runtime.utils`)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform  # seconds to import

    if uniform:
        return list(partition_uniform(num_items=len(weights), num_parts=parts))
    return [int(c) for c in partition_balanced(weights=list(weights), num_parts=parts)]


def in_flight(layout: Layout, share: StageShare, *, batch: BatchConfig) -> int:
    """Micro batches whose activations a stage keeps at once: one without pipeline; under the 1F1B
    schedule stage s runs pipeline - s forwards before its first backward (all m when m is fewer)."""
    return min(layout.pipeline - share.index, batch.gradient_accumulation_steps)


def layout_variants(layout: Layout, *, optimizer: OptimizerConfig) -> list[tuple[int, bool, bool]]:
    """The (stage, offload_optimizer, offload_param) that combine with a layout, as
    `tree.parallel_problems` allows them: ZeRO 0-1 without offload under pipeline (1 alone with
    gradient clipping), 0-2 with tensor parallel, everything with data parallelism alone."""
    if layout.pipeline > 1:
        lowest = 1 if optimizer.grad_clip > 0 else 0
        return [v for v in VARIANTS if lowest <= v[0] <= 1 and not v[1]]
    if layout.tensor > 1:
        return [v for v in VARIANTS if v[0] <= 2]
    return list(VARIANTS)
