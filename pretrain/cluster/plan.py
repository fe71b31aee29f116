"""`pretrain plan`: what a run will cost per rank before it is launched.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 3): mixed-precision Adam keeps
2 bytes of 16-bit parameters, 2 of 16-bit gradients and K = 12 of fp32 optimizer state (master
weights, momentum, variance) per parameter, and stage 1 partitions the optimizer state over the N
data-parallel ranks, stage 2 also the gradients, stage 3 also the parameters:

    stage 0: (2 + 2 + K) Ψ      stage 1: (2 + 2) Ψ + K Ψ / N
    stage 2: 2 Ψ + (2 + K) Ψ / N    stage 3: (2 + 2 + K) Ψ / N

In fp32 the parameters and gradients take 4 bytes each. K stays 12 at stages 1-3, where DeepSpeed's
ZeRO optimizer keeps its own fp32 copy of each rank's partition, and is 8 at stage 0 (torch AdamW:
momentum and variance only). In 16-bit training DeepSpeed's step also converts the gradient partition
to fp32 (4 Ψ / N more at stages 1-3), and stage 3 holds the layer it has gathered (its 16-bit
parameters and gradients); with these the count is DeepSpeed's own estimators' at stage 2 (2 Ψ +
18 Ψ / N) and under every offload (stage 2: 2 Ψ; stage 3: 4 L + 2 Ψ / N, or 4 L with the
parameters offloaded, L the largest layer). Offloading the optimizer moves K Ψ / N and the fp32 gradient
partition to host memory, and the 16-bit gradient partition off the device (stage 2 reduces into the
fp32 copy, stage 3 keeps it on the host); stage 1 keeps its full gradients on the device until
backward ends. Offloading parameters (stage 3) moves the parameters
to the host. `model_states` says where each piece is read from DeepSpeed's sources.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"): 34 s b h bytes per layer at 16 bits, of which 2 s b h are dropout masks; the 5 a s^2 b
attention-matrix term is absent because SDPA does not keep the matrix. The logits (s b V) and their
fp32 softmax are added, as they dominate small models with large vocabularies.

Communication per step (the paper, section 7) is 2 Ψ elements for stages 0-2 (all-reduce = reduce-
scatter + all-gather) and 3 Ψ for stage 3 (parameters all-gathered in forward and in backward,
gradients reduce-scattered). With gradient accumulation stage 2 reduces gradients at every micro
step, and stage 3 gathers and reduces at every micro step.

Step time (`predict_step`) adds three parts, per rank:
- compute: the FLOPs of the rank's tokens (6N + attention, `analytic_flops_per_token`, and the
  forward again under activation checkpointing) over the device's peak times the fraction of it
  forward and backward reach;
- communication left exposed: the bytes above over the all-reduce bus bandwidth (nccl-tests'
  convention: an all-reduce of X bytes on N ranks takes 2X (N-1)/N / busbw), less what overlaps
  with compute. DeepSpeed all-reduces after backward at stages 0 and 1 (no overlap); with
  `overlap_comm` stage 2 reduces buckets during backward (two thirds of compute) and stage 3
  prefetches parameters during forward and backward (all of it);
- the optimizer step over the rank's partition (all parameters at stage 0, 1/N from stage 1), at a
  per-parameter cost on the device, or on the host under optimizer offload.
The rates come from flags, from a previous run's metrics (`--from-run`: its forward/backward and
optimizer phase times, less the communication predicted for its own config), or from preflight's
measured bus bandwidth; otherwise from stated assumptions.

Under a layout of tensor (t) x pipeline (p) x data-parallel (d) ranks (`parallel`, `Layout`):
- parameters: a rank holds 1/t of its stage's block matrices and its stage's norms, embeddings and
  lm_head whole (AutoTP leaves those unsplit); the stages are cut from [embedding, blocks, head] by
  DeepSpeed's own partition functions (`stage_shares`), and ZeRO's formulas above apply to the
  rank's parameters with N = d. The plan shows the rank that needs the most memory;
- activations: what lies between a column- and a row-parallel matrix is split over t; under the
  1F1B schedule stage s keeps min(p - s, m) micro batches in flight (m = gradient accumulation
  steps), checkpointing every `parallel.activation_checkpoint_interval` blocks;
- communication: tensor parallel's 4 all-reduces a block a micro batch (2 forward, 2 backward, 2
  more in a recomputed forward) of micro x block x n_embd values, a ring moving 2(t-1)/t of each on
  the node's bus; the pipeline's point-to-point sends of the same size to the neighbour stages (and
  a tied embedding's gradient between the first and the last); ZeRO's over the d ranks;
- step time: the slowest stage's compute and model-parallel communication (neither AutoTP nor the
  pipeline engine overlaps them), stretched by the bubble (p - 1) / (m + p - 1) of the pipeline's
  time, then ZeRO's exposed communication and the optimizer as above.
On a CPU whose node runs more ranks than it has cores (`Rates.cores_per_node`), the ranks share the
cores: a rank computes at cores/ranks of its one-core speed while all compute, and the time one
spends idle (the bubble, a wait on a neighbour) goes to the others, so a step takes at least all its
ranks' work over the cores (`core_share`).
When no ZeRO stage fits the configured layout, `search_layouts` tries the others and lists those
that fit as the `--set` overrides that give them, fastest first.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.cluster.evidence import default_efficiency, gpu_class
from pretrain.cluster.hardware import GPU_PEAK_TFLOPS, device_peak_tflops, gpu_peak_tflops
from pretrain.config.ds_render import pipeline_checkpoint_interval, render_deepspeed
from pretrain.config.tree import (
    ModelConfig,
    RunConfig,
    analytic_num_params,
    data_parallel_of,
    deep_merge,
    load_file,
    parse_override,
    validate,
)
from pretrain.errors import ConfigError, DataError
from pretrain.files import read_csv

GB = 1e9
# (stage, offload_optimizer, offload_param): every stage, with and without offload.
VARIANTS = [(0, False, False)] + [
    (s, off, par)
    for s in (1, 2, 3)
    for off, par in ((False, False), (True, False), (True, True))
    if s == 3 or not par
]


@dataclass
class StagePlan:
    stage: int
    offload: str  # "none", "optimizer", "optimizer+params"
    params_gb: float  # per rank, on the device
    grads_gb: float
    optimizer_gb: float
    host_gb: float  # per rank, offloaded to host memory
    model_states_gb: float  # on the device: params + grads + optimizer
    activations_gb: float
    working_gb: float  # DeepSpeed's gradient buffers, and stage 3's gathered layer
    device_total_gb: float
    ds_device_gb: float | None  # DeepSpeed's estimate_zero{2,3}_model_states_mem_needs
    ds_host_gb: float | None  # per node, as DeepSpeed estimates host memory
    comm_gb_per_step: float  # ZeRO's, per rank, as in the paper (elements x bytes, no (N-1)/N factor)
    fits: bool | None
    host_fits: bool | None  # the offloaded states of a node's ranks in its host memory
    layout: str = "TP1 x PP1 x DP1"
    pipeline_stage: int = 0  # the stage of the rank shown: the one that needs the most memory
    rank_params: int = 0  # the parameters that rank holds (its tensor shard of its stage)
    tp_comm_gb_per_step: float = 0.0  # tensor parallel's all-reduces (counted 2X, as comm_gb_per_step)
    pp_comm_gb_per_step: float = 0.0  # the pipeline's sends to neighbour stages


@dataclass
class Target:
    """What a plan is for: the ranks, and the memory of a rank's device and of a node's host."""

    world: int
    ranks_per_node: int | None = None  # default: min(world, 8)
    device_gb: float | None = None
    device_src: str = ""
    host_gb: float | None = None
    note: str = ""  # what the plan could not know about the target, and the flag that tells it


# ---------------------------------------------------------------------------------------------
# The layout: tensor x pipeline x data-parallel ranks, and what each pipeline stage's ranks hold


@dataclass(frozen=True)
class Layout:
    """A world of ranks as tensor x pipeline x data-parallel groups (DeepSpeed's topology: tensor
    ranks adjacent, then data, pipeline stages outermost)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline * self.data

    def __str__(self) -> str:
        return f"TP{self.tensor} x PP{self.pipeline} x DP{self.data}"


def layout_of(cfg: RunConfig, world: int) -> Layout:
    """`cfg`'s parallel section on `world` ranks, the data-parallel size as the tree derives it."""
    par = cfg.parallel
    dp = data_parallel_of({"world_size": world, "model_parallel": par.model_parallel})
    if dp is None:
        raise ConfigError(
            [f"parallel: tensor x pipeline ({par.model_parallel}) does not divide the world size ({world})"],
            "plan",
        )
    return Layout(par.tensor, par.pipeline, dp)


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


def in_flight(cfg: RunConfig, layout: Layout, share: StageShare) -> int:
    """Micro batches whose activations a stage keeps at once: one without pipeline; under the 1F1B
    schedule stage s runs pipeline - s forwards before its first backward (all m when m is fewer)."""
    return min(layout.pipeline - share.index, cfg.batch.gradient_accumulation_steps)


def bytes_per_param(precision: str, stage: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter."""
    if precision in ("bf16", "fp16"):
        return 2, 2, 12
    return 4, 4, (8 if stage == 0 else 12)


def largest_layer_params(cfg: RunConfig) -> int:
    """The most parameters any one module holds (ZeRO-3 gathers one module's at a time)."""
    m = cfg.model
    d, vocab, f = m.n_embd, m.vocab_size or 0, m.ffn_hidden
    qkv = d + 2 * m.kv_heads * m.head_size  # c_attn's outputs
    fc = (2 if m.arch == "llama" else 1) * f  # c_fc's outputs: SwiGLU fuses gate and up
    b = 1 if m.bias else 0
    return max(vocab * d, fc * d + b * fc, f * d + b * d, qkv * d + b * qkv)


def model_states(
    n_params: int,
    *,
    stage: int,
    world: int,
    precision: str,
    offload_optimizer: bool,
    offload_param: bool,
    gathered: int = 0,
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer) bytes on the device and bytes on the host, per rank.

    On top of the ZeRO paper's count, as DeepSpeed 0.19's ZeRO optimizers run (read from
    `stage_1_and_2.py` and `stage3.py`, and as its estimators count them):
    - in 16-bit training the optimizer step converts the rank's gradient partition to fp32 (4Ψ/N,
      counted with the optimizer: DeepSpeed's "4_grads_32bit"), at stage 3 one sub-group of at most
      `ZERO3_SUB_GROUP` elements at a time;
    - stage 3 gathers one layer's parameters at a time (`gathered`, the largest) and holds its full
      gradients until they are reduce-scattered: p + g bytes of it on the device, offloaded or not;
    - under optimizer offload the gradient partition goes to the host as it is reduced (stage 2's
      `copy_grads_in_partition`, accumulated there across micro steps; stage 3's
      grad_partitions_flat_buffer on the CPU), with its fp32 copy and the fp32 state; stage 1 keeps
      its full gradients on the device until backward ends.
    """
    p, g, k = bytes_per_param(precision, stage)
    psi, n = float(n_params), float(world)
    params = p * psi / (n if stage >= 3 else 1)
    grads = g * psi / (n if stage >= 2 else 1)
    optim = k * psi / (n if stage >= 1 else 1)
    fp32_grads = 0.0
    if stage >= 1 and precision in ("bf16", "fp16"):
        fp32_grads = 4 * (min(psi / n, ZERO3_SUB_GROUP) if stage == 3 else psi / n)
    optim += fp32_grads
    host = 0.0
    if offload_optimizer:
        # The fp32 state and the fp32 copy of the partition's gradients the CPU optimizer steps on.
        host += k * psi / n + 4 * psi / n
        optim = 0.0
        if stage >= 2:
            # Stage 3 keeps the 16-bit gradient partition on the host; stage 2 accumulates the
            # partition's gradients there across micro steps (`async_accumulate_grad_in_cpu_via_gpu`).
            host += grads
            grads = 0.0
    if offload_param:
        host += params
        params = 0.0
    if stage == 3:
        params += p * gathered
        grads += g * gathered
    return params, grads, optim, host


# DeepSpeed's default zero_optimization.sub_group_size: stage 3 steps its optimizer one sub-group of
# at most this many elements at a time.
ZERO3_SUB_GROUP = 1e9


def working_bytes(cfg: RunConfig, n_params: int, *, stage: int, world: int) -> float:
    """Buffers DeepSpeed adds on the device while it reduces gradients (read from its sources):

    - stage 0: the gradients flattened into one all-reduce buffer of up to 5e8 elements (none with
      one rank: pretrain then skips the reduction);
    - stages 1-2: the reduce bucket, two of them when `overlap_comm` double-buffers, each of
      `reduce_bucket_size` elements whatever the model's size: `setup_buckets` allocates them with
      `torch.empty(reduce_bucket_size)` at a step's first backward and frees them after its last
      (measured: 4.0 GB more live at the default 5e8 fp32 elements for a 3.2M- and a 30k-parameter
      model alike). The gradients are written into the first Ψ elements only, so on a CPU the rest
      is never resident (`bucket_written_bytes`), but a GPU's allocator hands out all of it;
    - stage 3: a reduce bucket (the gathered layer is a model state, `model_states`).
    """
    _, g, _ = bytes_per_param(cfg.precision.name, stage)
    z = cfg.zero
    if stage == 0:
        return 0.0 if world == 1 else float(g * min(n_params, 500_000_000))
    if stage in (1, 2):
        return float(g * z.reduce_bucket_size * (2 if z.overlap_comm else 1))
    return float(g * min(z.reduce_bucket_size, n_params))


def bucket_written_bytes(cfg: RunConfig, n_params: int, *, stage: int) -> float:
    """The part of stages 1-2's reduce buckets (`working_bytes`) that gradients are written into: each
    of the rank's Ψ gradients is copied into a bucket once, the buckets taking turns when one fills.
    Only these pages become resident on a CPU; the rest is allocated but never touched."""
    if stage not in (1, 2):
        return working_bytes(cfg, n_params, stage=stage, world=2)
    _, g, _ = bytes_per_param(cfg.precision.name, stage)
    z = cfg.zero
    return float(g * min(n_params, z.reduce_bucket_size * (2 if z.overlap_comm else 1)))


def activation_bytes(cfg: RunConfig, layout: Layout | None = None, share: StageShare | None = None) -> float:
    """Activations kept for backward on one rank: one micro batch's through the whole model, or
    (`layout`, `share`) those of a pipeline stage's micro batches in flight on one of its tensor ranks."""
    m = cfg.model
    layout = layout or Layout()
    s, b, h, tp = m.block_size, cfg.batch.micro_batch_size, m.n_embd, layout.tensor
    blocks, first, last = (
        (m.n_layer, True, True) if share is None else (share.blocks, share.first, share.last)
    )
    vocab = m.vocab_size or 0
    a = 2 if cfg.precision.name in ("bf16", "fp16") else 4  # bytes per activation value
    masks = 2 * s * b * h if m.dropout > 0 else 0  # 1-byte dropout masks: attention out + MLP out
    # Values kept per token: the two norms' inputs (2h); attention's input, q, k, v and output
    # (3h + 2 kv, flash attention keeps no T x T scores); the MLP's input and hidden activations,
    # GELU's c_fc output and GELU output (2f), or SwiGLU's gate, up, silu(gate) and product (4f).
    # For gpt2 (f = 4h, kv = h) that is Korthikanti's 32 sbh bytes at a = 2, without masks. Tensor
    # parallel splits what lies between a column- and a row-parallel matrix (q, k, v, attention's
    # output, the MLP's hidden values) over the tensor ranks; the norms' and the matrices' inputs
    # stay whole on each (no sequence parallelism).
    kv, f = m.kv_heads * m.head_size, m.ffn_hidden
    whole = 2 * h + h + h
    split = 2 * h + 2 * kv + (4 if m.arch == "llama" else 2) * f
    per_layer = (whole + split / tp) * s * b * a + masks
    # With checkpointing: the input of every interval's first block, and one interval's activations
    # while it is recomputed (once, whatever the micro batches in flight).
    every = recomputes(cfg, layout.pipeline)
    kept = math.ceil(blocks / every) * s * b * h * a if every else blocks * per_layer
    recompute = min(every, blocks) * per_layer if every else 0
    logits = s * b * vocab * (a + 4) if last else 0  # the logits and cross-entropy's fp32 softmax
    embedded = s * b * h * a if first else 0  # the embedding output
    count = 1 if share is None else in_flight(cfg, layout, share)
    return float(count * (kept + logits + embedded) + recompute)


def comm_elements(n_params: int, stage: int, grad_accum: int) -> float:
    """Elements each rank sends per optimizer step, ZeRO paper accounting."""
    psi = float(n_params)
    if stage <= 1:
        return 2 * psi
    if stage == 2:
        return grad_accum * psi + psi  # a reduce-scatter per micro step, one all-gather per step
    return 3 * psi * grad_accum


# ---------------------------------------------------------------------------------------------
# Step time


@dataclass
class Rates:
    """What a step's time is predicted from, each with where it came from."""

    peak_tflops: float  # one rank's device peak, TFLOP/s
    mfu: float  # the fraction of the peak that forward + backward reach
    busbw: float  # all-reduce bus bandwidth over the world, bytes/s
    optimizer_s_per_param: float  # an optimizer step on the device, seconds per parameter
    host_optimizer_s_per_param: float  # the same on the host, under optimizer offload
    sources: dict[str, str]
    node_busbw: float | None = None  # all-reduce bus bandwidth within a node; None: busbw
    ranks_per_node: int | None = None  # which groups stay on one node's bus; None: none is told apart
    cores_per_node: int | None = None  # CPU cores a node's ranks share; None: each rank has its own device


def core_share(rates: Rates, ranks: int) -> float:
    """The part of its own core each of `ranks` ranks on one node gets while all compute: 1 on
    devices of their own or with a core each, cores / ranks when the ranks outnumber the CPU's cores."""
    if rates.cores_per_node is None:
        return 1.0
    return min(1.0, rates.cores_per_node / max(1, ranks))


@dataclass
class StepTime:
    stage: int
    offload: str
    compute_s: float  # the slowest pipeline stage's forward + backward on one rank
    comm_s: float  # ZeRO's communication over the data-parallel group
    exposed_comm_s: float  # what compute does not hide of it
    optimizer_s: float
    step_s: float
    tokens_per_s: float  # all ranks
    days: float  # to train the steps the schedule spans (max_steps, or max_tokens' steps)
    layout: str = "TP1 x PP1 x DP1"
    tp_comm_s: float = 0.0  # tensor parallel's all-reduces, on the critical path
    pp_comm_s: float = 0.0  # the pipeline's sends between stages, and the tied embedding's all-reduce
    bubble_fraction: float = 0.0  # (p - 1) / (m + p - 1)
    bubble_s: float = 0.0  # the pipeline filling and draining
    core_share: float = 1.0  # each rank's part of a core when the node's ranks outnumber its cores


def hardware_flops_per_token(m: ModelConfig) -> float:
    """The FLOPs a token costs the device: the model's, plus the forward pass again for the blocks
    that activation checkpointing recomputes in backward (2N of their 6N)."""
    return sum(s.flops_per_token for s in stage_shares(RunConfig(model=m), Layout()))


def elem_bytes(precision: str) -> int:
    """Bytes of a communicated gradient or parameter element."""
    return 2 if precision in ("bf16", "fp16") else 4


def group_busbw(rates: Rates, span: int) -> float:
    """The bus bandwidth of a group whose ranks lie within `span` adjacent ranks: a node's, where
    that stays on one node, else the world's."""
    if rates.node_busbw is not None and rates.ranks_per_node is not None and span <= rates.ranks_per_node:
        return rates.node_busbw
    return rates.busbw


def tp_comm_bytes(cfg: RunConfig, layout: Layout, share: StageShare) -> float:
    """Tensor parallel's all-reduces a step on one rank of `share`, an all-reduce of X counted as
    2X (as `comm_elements`): two a block forward (after attention's and the MLP's row-parallel
    matrix), two backward (before their column-parallel inputs), two more where the forward is
    recomputed, each of a micro batch's activations (micro x block x n_embd values)."""
    if layout.tensor == 1:
        return 0.0
    m, b = cfg.model, cfg.batch
    per_block = 4 + (2 if recomputes(cfg, layout.pipeline) else 0)
    x = b.micro_batch_size * m.block_size * m.n_embd * elem_bytes(cfg.precision.name)
    return float(share.blocks * per_block * b.gradient_accumulation_steps * 2 * x)


def pp_comm_bytes(cfg: RunConfig, layout: Layout, share: StageShare) -> float:
    """What one rank of `share` sends to its neighbour stages a step: a micro batch's activations
    forward and their gradients back (micro x block x n_embd values each), and under tied embeddings
    the all-reduce of wte's gradient between the first and the last stage (counted as 2X)."""
    if layout.pipeline == 1:
        return 0.0
    m, b = cfg.model, cfg.batch
    sends = (0 if share.last else 1) + (0 if share.first else 1)
    x = b.micro_batch_size * m.block_size * m.n_embd * elem_bytes(cfg.precision.name)
    return float(sends * b.gradient_accumulation_steps * x + _tied_bytes(cfg, layout, share))


def _tied_bytes(cfg: RunConfig, layout: Layout, share: StageShare) -> float:
    m = cfg.model
    if layout.pipeline == 1 or not m.tie_embeddings or not (share.first or share.last):
        return 0.0
    return float(2 * (m.vocab_size or 0) * m.n_embd * elem_bytes(cfg.precision.name))


def bubble_fraction(layout: Layout, micro_batches: int) -> float:
    """The share of a 1F1B pipeline step its stages sit idle while it fills and drains."""
    p = layout.pipeline
    return (p - 1) / (micro_batches + p - 1)


@dataclass
class StageTime:
    """One stage's part of a step on one of its ranks, in seconds."""

    compute: float
    tp_comm: float
    pp_comm: float

    @property
    def busy(self) -> float:
        return self.compute + self.tp_comm + self.pp_comm


def stage_times(cfg: RunConfig, layout: Layout, rates: Rates) -> list[StageTime]:
    """Each stage's compute and its model-parallel communication a step (no bubble)."""
    m, b = cfg.model, cfg.batch
    tokens = b.micro_batch_size * b.gradient_accumulation_steps * m.block_size  # each stage sees them all
    tp_bw = group_busbw(rates, layout.tensor)
    pp_bw = group_busbw(rates, layout.world)  # stage neighbours lie tensor x data ranks apart
    t = layout.tensor
    return [
        StageTime(
            compute=sh.flops_per_token * tokens / (rates.peak_tflops * 1e12 * rates.mfu),
            tp_comm=tp_comm_bytes(cfg, layout, sh) * (t - 1) / t / tp_bw,
            # a send of X takes X / busbw; the tied all-reduce between two ranks its 2X x (2 - 1) / 2
            pp_comm=(pp_comm_bytes(cfg, layout, sh) - _tied_bytes(cfg, layout, sh) / 2) / pp_bw,
        )
        for sh in stage_shares(cfg, layout)
    ]


def predict_step(
    cfg: RunConfig, world: int, *, stage: int, offload_optimizer: bool, offload_param: bool, rates: Rates
) -> StepTime:
    """One optimizer step of `cfg` at this stage and offload, on `world` ranks laid out as
    `cfg.parallel` says.

    A step takes the slowest pipeline stage's time (its compute, tensor parallel's all-reduces and its
    sends, all on the critical path: neither AutoTP nor DeepSpeed's pipeline engine overlaps them),
    stretched by the bubble to (m + p - 1) / m of it, then ZeRO's communication over the data-parallel
    group less what overlaps compute, then the optimizer step over the rank's partition. Ranks that
    share a CPU's cores (`core_share` below 1) take at least their mean work over their share of a
    core: the bubble's idle time then goes to the other ranks."""
    layout = layout_of(cfg, world)
    b = cfg.batch
    m_batches = b.gradient_accumulation_steps
    shares = stage_shares(cfg, layout)
    times = stage_times(cfg, layout, rates)
    st = max(times, key=lambda t: t.busy)
    bubble = st.busy * (layout.pipeline - 1) / m_batches
    share = core_share(rates, min(world, rates.ranks_per_node or world))
    pipeline_s = max(st.busy + bubble, statistics.fmean(t.busy for t in times) / share)
    dp = layout.data
    heaviest = max(shares, key=lambda sh: sh.params)  # ZeRO's traffic and the optimizer grow with the shard
    comm = comm_seconds(
        heaviest.params,
        stage=stage,
        grad_accum=m_batches,
        precision=cfg.precision.name,
        world=dp,
        busbw=group_busbw(rates, layout.tensor * dp),
    )
    window = 0.0
    if cfg.zero.overlap_comm:
        window = {2: 2 / 3 * st.compute, 3: st.compute}.get(stage, 0.0)
    exposed = max(0.0, comm - window)
    partition = heaviest.params if stage == 0 else heaviest.params / dp
    per_param = rates.host_optimizer_s_per_param if offload_optimizer else rates.optimizer_s_per_param
    optimizer = partition * per_param / share  # every rank steps at once
    step = pipeline_s + exposed + optimizer
    tokens = b.micro_batch_size * m_batches * cfg.model.block_size  # per data-parallel replica
    return StepTime(
        stage=stage,
        offload="optimizer+params" if offload_param else "optimizer" if offload_optimizer else "none",
        compute_s=st.compute,
        comm_s=comm,
        exposed_comm_s=exposed,
        optimizer_s=optimizer,
        step_s=step,
        tokens_per_s=tokens * dp / step,
        days=step * cfg.total_steps / 86400,
        layout=str(layout),
        tp_comm_s=st.tp_comm,
        pp_comm_s=st.pp_comm,
        bubble_fraction=bubble_fraction(layout, m_batches),
        bubble_s=bubble,
        core_share=share,
    )


def comm_seconds(
    n_params: int, *, stage: int, grad_accum: int, precision: str, world: int, busbw: float
) -> float:
    """A step's communication at `busbw`: the ZeRO paper's bytes (an all-reduce of X counted as
    2X) times (N-1)/N, as a ring moves them, over a data-parallel group of `world` ranks."""
    if world <= 1:
        return 0.0
    return comm_elements(n_params, stage, grad_accum) * elem_bytes(precision) * (world - 1) / world / busbw


# Assumed when neither a flag, a previous run nor preflight gives them.
ASSUMED_MFU = 0.4  # a GPU outside `evidence.FWD_BWD_EFFICIENCY`, or a CPU
ASSUMED_BUSBW = {"cuda": 100e9, "cuda-multinode": 20e9, "cpu": 1e9}  # bytes/s: NVLink, IB, gloo on loopback
# All-reduce bus bandwidth (nccl-tests' busbw) within a node and across nodes, by GPU class: NVLink 3
# (DGX A100: 600 GB/s a GPU both ways; nccl-tests' all_reduce reaches about 230 GB/s) and one HDR
# InfiniBand NIC of 200 Gb/s (25 GB/s) a GPU; NVLink 4 (900 GB/s) and NDR 400 Gb/s (50 GB/s) a GPU.
ASSUMED_GPU_BUSBW = {"A100": (230e9, 20e9), "H100": (450e9, 40e9)}
ASSUMED_OPTIMIZER_S = {"cuda": 2e-11, "cpu": 2e-9}  # per parameter: 32 bytes at 1.6 TB/s; a CPU core
ASSUMED_HOST_OPTIMIZER_S = 1e-9  # DeepSpeedCPUAdam per parameter, a few cores per rank
PREFLIGHT_FILE = "preflight.json"  # where `pretrain preflight` leaves its all-reduce, in the run dir


def resolve_rates(
    cfg: RunConfig,
    world: int,
    ranks_per_node: int,
    *,
    device: str | None = None,
    device_src: str = "",
    peak_tflops: float | None = None,
    mfu: float | None = None,
    busbw_gbs: float | None = None,
    node_busbw_gbs: float | None = None,
    from_runs: list[Path] | None = None,
) -> Rates:
    """The rates for `predict_step`: flags first, then a previous run's measurements, preflight's
    bus bandwidth, this machine's device; assumptions last, each source named. Within a node (tensor
    parallel, and any group that stays on one) the bus is the world's on one node, else NVLink's
    (`--node-busbw`, or assumed)."""
    src: dict[str, str] = {}
    kind = "cpu" if device == "cpu" or (device is None and not torch.cuda.is_available()) else "cuda"
    gpu = None if kind == "cpu" else gpu_class(device or torch.cuda.get_device_name(0))
    if peak_tflops is not None:
        peak, src["peak"] = peak_tflops, "--peak-tflops"
    elif device not in (None, "cpu"):
        table = gpu_peak_tflops(str(device), cfg.precision.name)
        named_by = f"{device_src}: device={device}" if device_src else f"--device {device}"
        if table is None:
            raise ConfigError([f"{named_by}: not in the peak table ({', '.join(GPU_PEAK_TFLOPS)})"], "plan")
        peak, src["peak"] = table, f"{device} datasheet" + (f", {device_src}" if device_src else "")
    elif cfg.logging.peak_tflops is not None:
        peak, src["peak"] = cfg.logging.peak_tflops, "logging.peak_tflops"
    else:
        peak, src["peak"] = _local_peak(cfg, ranks_per_node)
    multinode = world > ranks_per_node
    busbw, src["busbw"] = _busbw(cfg, world, kind, gpu, multinode=multinode, given=busbw_gbs)
    if node_busbw_gbs is not None:
        node_busbw, src["node_busbw"] = node_busbw_gbs * 1e9, "--node-busbw"
    elif not multinode:
        node_busbw, src["node_busbw"] = busbw, "the world's, on one node"
    elif gpu in ASSUMED_GPU_BUSBW:
        node_busbw, src["node_busbw"] = (
            ASSUMED_GPU_BUSBW[gpu][0],
            f"assumed for {gpu} NVLink (pass --node-busbw)",
        )
    else:
        node_busbw, src["node_busbw"] = ASSUMED_BUSBW[kind], "assumed (pass --node-busbw)"
    efficiency, src["mfu"] = default_efficiency(gpu, analytic_num_params(cfg.model)) or (
        ASSUMED_MFU,
        "assumed",
    )
    rates = Rates(
        peak_tflops=peak,
        mfu=efficiency,
        busbw=busbw,
        optimizer_s_per_param=ASSUMED_OPTIMIZER_S[kind],
        host_optimizer_s_per_param=ASSUMED_HOST_OPTIMIZER_S,
        sources=src,
        node_busbw=node_busbw,
        ranks_per_node=ranks_per_node,
        cores_per_node=(os.cpu_count() or 1) if kind == "cpu" else None,
    )
    src["optimizer"] = "assumed"
    mfus = [_calibrate(rates, run_dir) for run_dir in from_runs or []]  # and each the optimizer where it ran
    if mfus:
        rates.mfu = statistics.fmean(mfus)
        rates.sources["mfu"] = "; ".join(f"{r}: forward+backward" for r in from_runs or [])
    if mfu is not None:
        rates.mfu, src["mfu"] = mfu, "--mfu"
    return rates


def _local_peak(cfg: RunConfig, ranks_per_node: int) -> tuple[float, str]:
    """This machine's device peak for one of `ranks_per_node` ranks (they share a CPU's cores):
    the same resolver as the MFU that `train` logs, so both read one number for one machine."""
    if torch.cuda.is_available():
        peak, source = device_peak_tflops(torch.device("cuda", 0), cfg.precision.name)
    else:
        threads = torch.get_num_threads()
        share = max(1, (os.cpu_count() or 1) // ranks_per_node)
        torch.set_num_threads(share)
        try:
            peak, source = device_peak_tflops(torch.device("cpu"), cfg.precision.name)
        finally:
            torch.set_num_threads(threads)
    if peak is None:
        raise ConfigError([f"{source}; or pass --peak-tflops"], "plan")
    return peak, source


def _busbw(
    cfg: RunConfig, world: int, kind: str, gpu: str | None, *, multinode: bool, given: float | None
) -> tuple[float, str]:
    if given is not None:
        return given * 1e9, "--busbw"
    path = cfg.run_dir() / PREFLIGHT_FILE
    try:
        measured = json.loads(path.read_text())["allreduce"]
        return float(measured["busbw"]), f"{path}: {measured['world']}-rank all-reduce, {measured['backend']}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if gpu in ASSUMED_GPU_BUSBW:
        node, fabric = ASSUMED_GPU_BUSBW[gpu]
        what = "InfiniBand across nodes" if multinode else "NVLink"
        return (
            fabric if multinode else node
        ), f"assumed for {gpu} {what} (run `pretrain preflight` to measure it)"
    key = "cuda-multinode" if kind == "cuda" and multinode else kind
    return ASSUMED_BUSBW[key], "assumed (run `pretrain preflight` to measure it)"


def _calibrate(rates: Rates, run_dir: Path) -> float:
    """The MFU of a previous run's forward+backward, and (set in `rates`) its optimizer's cost a
    parameter, from its phase times (medians past its first logged step), on the same peak and bus
    bandwidth as the prediction."""
    try:
        run = validate(load_file(run_dir / "config.yaml"))
        rows = [r for r in read_csv(run_dir / "metrics.csv") if r.get("fwd_bwd_s") and r.get("optimizer_s")]
    except (ConfigError, DataError, OSError, ValueError) as e:
        raise ConfigError([f"--from-run {run_dir}: not a finished run's directory ({e})"], "plan") from None
    if len(rows) < 2:
        raise ConfigError([f"--from-run {run_dir}: fewer than 2 logged steps with phase times"], "plan")
    rows = rows[1:]  # the first interval holds the warm-up
    fwd_bwd = statistics.median(float(r["fwd_bwd_s"] or 0.0) for r in rows)
    optimizer = statistics.median(float(r["optimizer_s"] or 0.0) for r in rows)
    m, b, z = run.model, run.batch, run.zero
    layout = Layout(run.parallel.tensor, run.parallel.pipeline, b.data_parallel_size or 1)
    shares = stage_shares(run, layout)
    heaviest = max(shares, key=lambda sh: sh.params)
    comm = comm_seconds(
        heaviest.params,
        stage=z.stage,
        grad_accum=b.gradient_accumulation_steps,
        precision=run.precision.name,
        world=layout.data,
        busbw=group_busbw(rates, layout.tensor * layout.data),
    )
    exposed = comm if z.stage < 2 or not z.overlap_comm else 0.0  # inside backward, or hidden by it
    # The measured forward+backward holds the slowest stage's compute and model-parallel
    # communication, stretched by the bubble: take both out.
    slowest = max(range(len(shares)), key=lambda i: shares[i].flops_per_token)
    st = stage_times(run, layout, rates)[slowest]
    stretch = 1 + (layout.pipeline - 1) / b.gradient_accumulation_steps
    # A run whose ranks outnumbered the cores computed at its share of a core: take that out too.
    share = core_share(rates, min(layout.world, rates.ranks_per_node or layout.world))
    compute = max((fwd_bwd - exposed) * share / stretch - st.tp_comm - st.pp_comm, 1e-9)
    tokens = b.micro_batch_size * b.gradient_accumulation_steps * m.block_size
    per_param = optimizer * share / (heaviest.params if z.stage == 0 else heaviest.params / layout.data)
    if z.offload_optimizer:
        rates.host_optimizer_s_per_param = per_param
    else:
        rates.optimizer_s_per_param = per_param
    rates.sources["optimizer"] = f"{run_dir}: optimizer {optimizer * 1e3:.1f} ms a step"
    return shares[slowest].flops_per_token * tokens / compute / (rates.peak_tflops * 1e12)


def deepspeed_estimate(
    n_params: int,
    largest: int,
    *,
    stage: int,
    world: int,
    gpus_per_node: int,
    offload_optimizer: bool,
    offload_param: bool,
) -> tuple[float | None, float | None]:
    """DeepSpeed's own (device, host) model-state estimate in bytes per rank; None at stages 0 and 1,
    which it has no estimator for (its zero2 one partitions the gradients, which stage 1 does not)."""
    nodes = max(1, world // gpus_per_node)
    per_node = min(world, gpus_per_node)
    if stage == 2:
        # DeepSpeed only for its estimators: importing it takes seconds.
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(
            n_params, per_node, nodes, cpu_offload=offload_optimizer
        )
        return float(gpu), float(cpu)
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs  # as above

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            n_params,
            largest,
            per_node,
            nodes,
            cpu_offload=offload_optimizer,
            cpu_offload_params=offload_param,
            zero_init=True,
        )
        return float(gpu), float(cpu)
    return None, None


def layout_variants(layout: Layout, cfg: RunConfig) -> list[tuple[int, bool, bool]]:
    """The (stage, offload_optimizer, offload_param) that combine with a layout, as
    `tree.parallel_problems` allows them: ZeRO 0-1 without offload under pipeline (1 alone with
    gradient clipping), 0-2 with tensor parallel, everything with data parallelism alone."""
    if layout.pipeline > 1:
        lowest = 1 if cfg.optimizer.grad_clip > 0 else 0
        return [v for v in VARIANTS if lowest <= v[0] <= 1 and not v[1]]
    if layout.tensor > 1:
        return [v for v in VARIANTS if v[0] <= 2]
    return list(VARIANTS)


def plan_stages(
    cfg: RunConfig,
    world: int,
    *,
    device_gb: float | None,
    gpus_per_node: int | None = None,
    host_gb: float | None = None,
) -> list[StagePlan]:
    """Every ZeRO stage and offload the layout allows, for this config's model, batch, precision and
    layout (`cfg.parallel` on `world` ranks): the memory of the rank that needs the most."""
    layout = layout_of(cfg, world)
    shares = stage_shares(cfg, layout)
    dp, precision = layout.data, cfg.precision.name
    largest = largest_layer_params(cfg)
    per_node = gpus_per_node or min(world, 8)
    out = []
    for stage, off, par in layout_variants(layout, cfg):
        rows = []
        for share in shares:
            params, grads, optim, host = model_states(
                share.params,
                stage=stage,
                world=dp,
                precision=precision,
                offload_optimizer=off,
                offload_param=par,
                gathered=largest,
            )
            working = working_bytes(cfg, share.params, stage=stage, world=dp)
            act = activation_bytes(cfg, layout, share)
            rows.append(
                (params + grads + optim + act + working, share, params, grads, optim, host, act, working)
            )
        total, share, params, grads, optim, host, act, working = max(rows, key=lambda r: r[0])
        states = params + grads + optim
        if layout.tensor * layout.pipeline == 1:
            ds_dev, ds_host = deepspeed_estimate(
                share.params, largest, stage=stage, world=world, gpus_per_node=per_node,
                offload_optimizer=off, offload_param=par,
            )  # fmt: skip
        else:  # DeepSpeed's estimators know data parallelism only: the rank's shard over its group
            ds_dev, _ = deepspeed_estimate(
                share.params, largest, stage=stage, world=dp, gpus_per_node=dp,
                offload_optimizer=off, offload_param=par,
            )  # fmt: skip
            ds_host = None
        out.append(
            StagePlan(
                stage=stage,
                offload="optimizer+params" if par else "optimizer" if off else "none",
                params_gb=params / GB,
                grads_gb=grads / GB,
                optimizer_gb=optim / GB,
                host_gb=host / GB,
                model_states_gb=states / GB,
                activations_gb=act / GB,
                working_gb=working / GB,
                device_total_gb=total / GB,
                ds_device_gb=None if ds_dev is None else ds_dev / GB,
                ds_host_gb=None if ds_host is None else ds_host / GB,
                comm_gb_per_step=comm_elements(share.params, stage, cfg.batch.gradient_accumulation_steps)
                * elem_bytes(precision)
                / GB,
                fits=None if device_gb is None else total / GB <= device_gb,
                host_fits=None if host_gb is None else host * min(world, per_node) / GB <= host_gb,
                layout=str(layout),
                pipeline_stage=share.index,
                rank_params=share.params,
                tp_comm_gb_per_step=tp_comm_bytes(cfg, layout, share) / GB,
                pp_comm_gb_per_step=pp_comm_bytes(cfg, layout, share) / GB,
            )
        )
    return out


def default_device_gb(world: int) -> tuple[float | None, str]:
    """One rank's memory here: the first GPU's, or on a CPU this host's RAM shared by the ranks."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GB, f"{props.name}"
    total = host_memory_gb()
    if total is None:
        return None, "unknown (pass --device-gb)"
    return total / world, f"host RAM {total:.1f} GB / {world} CPU ranks"


def host_memory_gb() -> float | None:
    """This machine's RAM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return None


def _gb(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


@dataclass
class Budget:
    """Which of the run's budgets ends it, and where."""

    binds: str  # max_steps, max_tokens or max_hours
    steps: int  # the step the run ends at (by max_hours: the estimate of the step that passes it)
    tokens: int  # the tokens seen by then
    schedule_steps: int  # the steps the LR schedule is laid out over (max_steps, or max_tokens')
    max_steps: int
    max_tokens: int | None
    max_hours: float | None
    step_s: float | None  # the estimated time of a step of this config (None: no rates)
    hours: float | None  # the estimated hours of training to the end (None: no rates)


def plan_budget(cfg: RunConfig, step_s: float | None) -> Budget:
    """The budget that binds: max_steps or max_tokens, known in steps up front, or max_hours, which
    binds where the estimated time of a step (`step_s`) reaches it in fewer steps; with no estimate
    max_hours cannot be compared and the other two decide."""
    s, tokens = cfg.schedule, cfg.tokens_per_step
    steps = cfg.total_steps
    binds = s.binding(tokens)
    if s.max_hours is not None and step_s:
        by_clock = math.ceil(s.max_hours * 3600 / step_s)  # the step during which the clock passes it
        if by_clock < steps:
            binds, steps = "max_hours", by_clock
    return Budget(
        binds=binds,
        steps=steps,
        tokens=steps * tokens,
        schedule_steps=cfg.total_steps,
        max_steps=s.max_steps,
        max_tokens=s.max_tokens,
        max_hours=s.max_hours,
        step_s=step_s,
        hours=steps * step_s / 3600 if step_s else None,
    )


def render_budget(b: Budget) -> str:
    """The plan's budget line."""
    limits = (
        f"budget: max_steps {b.max_steps:,}, max_tokens {f'{b.max_tokens:,}' if b.max_tokens else 'none'}, "
        f"max_hours {f'{b.max_hours:g}' if b.max_hours else 'none'}."
    )
    est = f"at the {b.step_s:.3g} s a step estimated below for this config" if b.step_s else ""
    if b.binds == "max_hours":
        return (
            f"{limits} schedule.max_hours binds {est}: its {b.max_hours:g} h of training end the run near step "
            f"{b.steps:,} ({b.tokens:,} tokens) of the {b.schedule_steps:,} the LR schedule spans, with a "
            "checkpoint that a resume with a larger max_hours continues"
        )
    hours = f", in {b.hours:.3g} h {est}" if b.hours is not None else ""
    unknown = " (max_hours not compared: no step time)" if b.max_hours and b.step_s is None else ""
    return (
        f"{limits} schedule.{b.binds} binds: the run ends at step {b.steps:,} ({b.tokens:,} tokens){hours}, "
        f"the LR schedule spanning those steps{unknown}"
    )


def _this_config_step_s(cfg: RunConfig, world: int, rates: Rates | None) -> float | None:
    """The estimated seconds of a step at the configured ZeRO stage and offload."""
    if rates is None:
        return None
    z = cfg.zero
    chosen = (
        z.stage,
        "optimizer+params" if z.offload_param else "optimizer" if z.offload_optimizer else "none",
    )
    times = [t.step_s for t in step_times(cfg, world, rates) if (t.stage, t.offload) == chosen]
    return times[0] if times else None


def render_plan(cfg: RunConfig, to: Target, rates: Rates | None = None, *, search: bool = False) -> str:
    """The plan as `pretrain plan` prints it; the layouts that fit follow when nothing fits the
    configured one (or with `search`)."""
    world, device_gb = to.world, to.device_gb
    b, m = cfg.batch, cfg.model
    n = analytic_num_params(m)
    tbs = b.sequences
    layout = layout_of(cfg, world)
    lines = [
        f"{cfg.preset}: {n / 1e6:.2f}M parameters (Ψ), {m.arch}, {m.n_layer} layers, n_embd {m.n_embd}, "
        f"context {m.block_size}, vocab {m.vocab_size}, {cfg.precision.name}",
        f"batch: micro {b.micro_batch_size} x accumulation {b.gradient_accumulation_steps} x data-parallel "
        f"{b.data_parallel_size} = {tbs} sequences per step",
        f"tokens: {tbs * m.block_size:,} per step, {tbs * m.block_size * cfg.total_steps:,} in "
        f"{cfg.total_steps:,} steps",
        render_budget(plan_budget(cfg, _this_config_step_s(cfg, world, rates))),
        f"layout: {layout} = {world} ranks (parallel.tensor x parallel.pipeline x data-parallel)",
        *render_layout(cfg, layout),
        "",
        "DeepSpeed JSON (rendered):",
        json.dumps(render_deepspeed(cfg), indent=2),
        "",
        *([f"note: {to.note}"] if to.note else []),
        f"Memory per rank in GB, {layout}, world size {world}; device memory {_gb(device_gb)} GB "
        f"({to.device_src}); host memory {_gb(to.host_gb)} GB a node.",
        "Model states by the ZeRO paper (see `pretrain/cluster/plan.py`), ZeRO sharding over the "
        f"{layout.data} data-parallel rank{'s' if layout.data > 1 else ''}; DeepSpeed's estimate assumes 16-bit "
        "training (2 + 18 bytes/param), gives host memory per node, and has no estimator for stages 0 and 1.",
    ]
    pp = layout.pipeline > 1
    header = (
        "stage  offload            params  grads  optim   host | states  activ  work | device total"
        " | DS device  DS host/node | comm/step | fits | host fits" + (" | pipeline stage" if pp else "")
    )
    lines += [header, "-" * len(header)]
    chosen = (cfg.zero.stage, cfg.zero.offload_optimizer, cfg.zero.offload_param)
    plans = plan_stages(cfg, world, device_gb=device_gb, gpus_per_node=to.ranks_per_node, host_gb=to.host_gb)
    for p in plans:
        mark = "*" if (p.stage, p.offload != "none", p.offload == "optimizer+params") == chosen else " "
        row = (
            f"{mark}{p.stage:<5} {p.offload:<17} {_gb(p.params_gb):>7} {_gb(p.grads_gb):>6} "
            f"{_gb(p.optimizer_gb):>6} {_gb(p.host_gb):>6} | {_gb(p.model_states_gb):>6} "
            f"{_gb(p.activations_gb):>6} {_gb(p.working_gb):>5} | {_gb(p.device_total_gb):>12} | "
            f"{_gb(p.ds_device_gb):>9} {_gb(p.ds_host_gb):>13} | {_gb(p.comm_gb_per_step):>9} | "
            f"{_yes(p.fits):>4} | {_yes(p.host_fits):<9}" + (f" | {p.pipeline_stage}" if pp else "")
        )
        lines.append(row.rstrip())
    activ = (
        f"activations of the micro batches a stage keeps in flight (1F1B: stage s keeps min(p - s, m); "
        f"activation checkpoint interval {recomputes(cfg, layout.pipeline)})"
        if pp
        else "activations of one micro batch "
        f"({'with' if m.activation_checkpointing else 'without'} activation checkpointing)"
    )
    lines += [
        f"* this config. Each row is the rank that needs the most memory{' (its pipeline stage last)' if pp else ''}. "
        f"activ: {activ}. work: DeepSpeed's "
        "gradient reduction buffers (stage 3's gathered largest layer is in params and grads). comm: what each rank sends per "
        "optimizer step for ZeRO (2Ψ stages 0-2, 3Ψ stage 3, Ψ the rank's parameters, per micro step where the "
        "stage reduces each one). host fits: the offloaded states of a node's ranks in its host memory."
    ]
    if rates is not None:
        lines += ["", *render_times(cfg, world, rates)]
    if device_gb is not None and (search or not any(p.fits and p.host_fits is not False for p in plans)):
        lines += ["", *render_search(cfg, to, rates, fitting=not search)]
    return "\n".join(lines)


def render_layout(cfg: RunConfig, layout: Layout) -> list[str]:
    """What each rank holds under a model-parallel layout (nothing to say without one)."""
    if layout.tensor * layout.pipeline == 1:
        return []
    lines = []
    if layout.tensor > 1:
        lines.append(
            f"  tensor: each rank holds 1/{layout.tensor} of every block's four matrices, heads and MLP width "
            "(AutoTP); the norms, embeddings and lm_head whole"
        )
    shares = stage_shares(cfg, layout)
    if layout.pipeline > 1:
        parts = [
            f"{sh.index}: {'embedding + ' if sh.first else ''}{sh.blocks} blocks{' + head' if sh.last else ''}, "
            f"{sh.params / 1e9:.3g}B"
            for sh in shares
        ]
        lines.append(
            f"  pipeline stages (partition '{cfg.parallel.partition_method}'; parameters a rank): "
            + "; ".join(parts)
        )
    else:
        lines.append(f"  parameters a rank: {shares[0].params / 1e9:.3g}B")
    return lines


def _yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "NO"


def step_times(cfg: RunConfig, world: int, rates: Rates) -> list[StepTime]:
    """`predict_step` for every stage and offload that `plan_stages` lists."""
    return [
        predict_step(cfg, world, stage=stage, offload_optimizer=off, offload_param=par, rates=rates)
        for stage, off, par in layout_variants(layout_of(cfg, world), cfg)
    ]


def render_times(cfg: RunConfig, world: int, rates: Rates) -> list[str]:
    m, b = cfg.model, cfg.batch
    layout = layout_of(cfg, world)
    total_tokens = b.sequences * m.block_size * cfg.total_steps
    src = rates.sources
    node = (
        f"; within a node {rates.node_busbw / 1e9:.3g} GB/s ({src.get('node_busbw', 'given')})"
        if rates.node_busbw is not None and rates.node_busbw != rates.busbw
        else ""
    )
    lines = [
        f"Time per step, {layout}, world size {world}: peak {rates.peak_tflops:.3g} TFLOP/s a rank ({src['peak']}); "
        f"MFU of forward+backward {rates.mfu:.2f} ({src['mfu']}); all-reduce bus bandwidth "
        f"{rates.busbw / 1e9:.3g} GB/s ({src['busbw']}){node}; optimizer {rates.optimizer_s_per_param * 1e9:.3g} ns "
        f"a parameter, {rates.host_optimizer_s_per_param * 1e9:.3g} on the host ({src['optimizer']}).",
    ]
    header = (
        "ZeRO    offload            compute  TP comm  PP comm   bubble   comm  exposed  optimizer |   step s"
        " |    tokens/s | days"
    )
    lines += [header, "-" * len(header)]
    chosen = (cfg.zero.stage, cfg.zero.offload_optimizer, cfg.zero.offload_param)
    times = step_times(cfg, world, rates)
    for t in times:
        mark = "*" if (t.stage, t.offload != "none", t.offload == "optimizer+params") == chosen else " "
        lines.append(
            f"{mark}ZeRO-{t.stage:<2} {t.offload:<17} {t.compute_s:>8.3g} {t.tp_comm_s:>8.3g} {t.pp_comm_s:>8.3g} "
            f"{t.bubble_s:>8.3g} {t.comm_s:>6.3g} {t.exposed_comm_s:>8.3g} "
            f"{t.optimizer_s:>10.3g} | {t.step_s:>8.3g} | {t.tokens_per_s:>11,.0f} | {t.days:.4g}"
        )
    lines.append(
        (
            f"days: to train schedule.max_steps = {cfg.total_steps:,} steps ({total_tokens:,} tokens). "
            if cfg.schedule.binding(cfg.tokens_per_step) == "max_steps"
            else f"days: to train schedule.max_tokens = {cfg.schedule.max_tokens:,} tokens ({cfg.total_steps:,} "
            "steps). "
        )
        + "Seconds per optimizer step on the slowest pipeline stage; comm: ZeRO's over the data-parallel group; "
        "exposed: the part of it compute does not hide."
    )
    if times and times[0].core_share < 1:
        ranks = min(world, rates.ranks_per_node or world)
        lines.append(
            f"cores: {ranks} ranks share {rates.cores_per_node} CPU cores, {times[0].core_share:.2g} of a core each "
            "while all compute; a step takes at least the ranks' mean work over that share (the bubble's idle "
            "time goes to the other ranks), and the optimizer steps on every rank at once."
        )
    x = b.micro_batch_size * m.block_size * m.n_embd
    shares = stage_shares(cfg, layout)
    if layout.tensor > 1:
        tp = layout.tensor
        per_block = 4 + (2 if recomputes(cfg, layout.pipeline) else 0)
        gb = max(tp_comm_bytes(cfg, layout, sh) for sh in shares) / GB
        lines.append(
            f"TP comm: {per_block} all-reduces a block a micro batch (2 forward, 2 backward"
            f"{', 2 in the recomputed forward' if per_block > 4 else ''}) of micro x block x n_embd = {x:,} "
            f"values, a ring moving 2(t - 1)/t = {2 * (tp - 1) / tp:.3g} of each, at "
            f"{group_busbw(rates, tp) / 1e9:.3g} GB/s ({'within a node' if _on_node(rates, tp) else 'across nodes'}): "
            f"{gb:.3g} GB a step (counted 2X), on the critical path."
        )
    if layout.pipeline > 1:
        p, mb = layout.pipeline, b.gradient_accumulation_steps
        f = bubble_fraction(layout, mb)
        lines.append(
            f"bubble: (p - 1) / (m + p - 1) = {p - 1} / ({mb} + {p - 1}) = {f:.1%} of the pipeline's time idle "
            f"(m: batch.gradient_accumulation_steps{'; fewer than 4 x p micro batches: raise it' if mb < 4 * p else ''})."
        )
        gb = max(pp_comm_bytes(cfg, layout, sh) for sh in shares) / GB
        lines.append(
            f"PP comm: each micro batch's activations to the next stage and their gradients back, {x:,} values "
            f"each{', and the tied embedding gradient between the first and last stage' if m.tie_embeddings else ''}, "
            f"at {group_busbw(rates, layout.world) / 1e9:.3g} GB/s: {gb:.3g} GB a step on the busiest stage."
        )
    return lines


def _on_node(rates: Rates, span: int) -> bool:
    return rates.ranks_per_node is not None and span <= rates.ranks_per_node


# ---------------------------------------------------------------------------------------------
# When the configured layout does not fit: the layouts that would


@dataclass
class LayoutOption:
    """A layout that fits, as the overrides that give it."""

    overrides: list[str]
    layout: str
    stage: int
    offload: str
    device_total_gb: float
    step_s: float | None
    days: float | None


def micro_batches(micro: int) -> list[int]:
    """The micro batches the search tries: the configured one and its halves down to 1."""
    out = [micro]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def search_layouts(cfg: RunConfig, to: Target, rates: Rates | None) -> tuple[list[LayoutOption], int]:
    """The layouts of a small search that fit the device (and host), fastest first, and how many
    were tried: tensor 1, 2, 4, 8 up to the ranks of a node, pipeline stages dividing the node count
    or the layers, every ZeRO stage and offload `layout_variants` allows, the micro batch as configured
    and halved down to 1, activation checkpointing as configured and on. The global batch stays: the
    accumulation makes up for the micro batch and the data-parallel size (a layout whose micro batch
    x data-parallel size does not divide it is left out)."""
    world, m, b = to.world, cfg.model, cfg.batch
    per_node = to.ranks_per_node or min(world, 8)
    nodes = max(1, world // per_node)
    base = cfg.model_dump(mode="json")
    base["batch"] |= {"data_parallel_size": None, "train_batch_size": None}
    found, tried = [], 0
    for tp in (t for t in (1, 2, 4, 8) if t <= per_node):
        for pp in (p for p in range(1, m.n_layer + 1) if nodes % p == 0 or m.n_layer % p == 0):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            for micro, ckpt in itertools.product(
                micro_batches(b.micro_batch_size), sorted({m.activation_checkpointing, True})
            ):
                if b.sequences % (micro * dp):
                    continue
                accum = b.sequences // (micro * dp)
                sets = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}"]
                if micro != b.micro_batch_size:
                    sets.append(f"batch.micro_batch_size={micro}")
                if accum != b.gradient_accumulation_steps:
                    sets.append(f"batch.gradient_accumulation_steps={accum}")
                if ckpt != m.activation_checkpointing:
                    sets.append("model.activation_checkpointing=true")
                if pp > 1 and cfg.compile.enabled:
                    sets.append("compile.enabled=false")
                for stage, off, par in layout_variants(Layout(tp, pp, dp), cfg):
                    over = [*sets, f"zero.stage={stage}"]
                    if off != cfg.zero.offload_optimizer:
                        over.append(f"zero.offload_optimizer={str(off).lower()}")
                    if par != cfg.zero.offload_param:
                        over.append(f"zero.offload_param={str(par).lower()}")
                    data: dict[str, Any] = base
                    for item in over:
                        data = deep_merge(data, parse_override(item))
                    tried += 1
                    try:
                        c = validate(data, world)
                    except ConfigError:
                        continue  # a layout the model's shape or ZeRO refuses
                    row = next(
                        p
                        for p in plan_stages(
                            c, world, device_gb=to.device_gb, gpus_per_node=per_node, host_gb=to.host_gb
                        )
                        if (p.stage, p.offload != "none", p.offload == "optimizer+params")
                        == (stage, off, par)
                    )
                    if not row.fits or row.host_fits is False:
                        continue
                    t = None
                    if rates is not None:
                        t = predict_step(
                            c, world, stage=stage, offload_optimizer=off, offload_param=par, rates=rates
                        )
                    found.append(
                        LayoutOption(
                            overrides=over,
                            layout=row.layout,
                            stage=stage,
                            offload=row.offload,
                            device_total_gb=row.device_total_gb,
                            step_s=None if t is None else t.step_s,
                            days=None if t is None else t.days,
                        )
                    )
    found.sort(key=lambda o: (o.step_s if o.step_s is not None else 0.0, o.device_total_gb))
    best: dict[tuple[str, int, str], LayoutOption] = {}
    for o in found:  # the fastest of each layout, stage and offload (a micro batch or checkpointing apart)
        best.setdefault((o.layout, o.stage, o.offload), o)
    return list(best.values()), tried


SEARCH_SHOWN = 5


def render_search(cfg: RunConfig, to: Target, rates: Rates | None, *, fitting: bool) -> list[str]:
    found, tried = search_layouts(cfg, to, rates)
    said = (
        f"Nothing fits {layout_of(cfg, to.world)} on {_gb(to.device_gb)} GB devices."
        if fitting
        else f"Layouts on {to.world} ranks of {_gb(to.device_gb)} GB."
    )
    if not found:
        return [f"{said} No layout of the {tried} searched fits either (tensor 1-8 within a node, pipeline "
                "stages dividing the nodes or layers, ZeRO 0-3, activation checkpointing): more ranks, or a "
                "smaller micro batch."]  # fmt: skip
    lines = [
        f"{said} Layouts that fit, fastest first ({min(len(found), SEARCH_SHOWN)} of the {len(found)} that fit, "
        f"the fastest micro batch and checkpointing of each, of {tried} searched; the global batch of {cfg.batch.sequences} sequences kept):",
        "layout               ZeRO    offload           device GB |   step s |      days | --set",
    ]
    for o in found[:SEARCH_SHOWN]:
        step = "-" if o.step_s is None else f"{o.step_s:.3g}"
        days = "-" if o.days is None else f"{o.days:.4g}"
        lines.append(
            f"{o.layout:<20} ZeRO-{o.stage:<2} {o.offload:<17} {_gb(o.device_total_gb):>9} | {step:>8} | "
            f"{days:>9} | " + " ".join(f"--set {s}" for s in o.overrides)
        )
    return lines


def plan_json(
    cfg: RunConfig, to: Target, rates: Rates | None = None, *, search: bool = False
) -> dict[str, Any]:
    layout = layout_of(cfg, to.world)
    plans = plan_stages(
        cfg, to.world, device_gb=to.device_gb, gpus_per_node=to.ranks_per_node, host_gb=to.host_gb
    )
    out: dict[str, Any] = {
        "params": analytic_num_params(cfg.model),
        "world_size": to.world,
        "layout": asdict(layout),
        "pipeline_stages": [asdict(s) for s in stage_shares(cfg, layout)],
        "device_gb": to.device_gb,
        "device_source": to.device_src,
        "host_gb": to.host_gb,
        "note": to.note or None,
        "stages": [asdict(p) for p in plans],
    }
    out["budget"] = asdict(plan_budget(cfg, _this_config_step_s(cfg, to.world, rates)))
    if rates is not None:
        out["rates"] = asdict(rates)
        out["step_times"] = [asdict(t) for t in step_times(cfg, to.world, rates)]
    out["layouts_that_fit"] = None  # searched when nothing fits, or asked
    if to.device_gb is not None and (search or not any(p.fits and p.host_fits is not False for p in plans)):
        found, tried = search_layouts(cfg, to, rates)
        out["layouts_that_fit"] = [asdict(o) for o in found]
        out["layouts_searched"] = tried
    return out
