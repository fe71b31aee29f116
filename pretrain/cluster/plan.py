"""`pretrain plan`: what a run will cost per rank before it is launched.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 3): mixed-precision Adam keeps
2 bytes of 16-bit parameters, 2 of 16-bit gradients and K = 12 of fp32 optimizer state (master
weights, momentum, variance) per parameter, and stage 1 partitions the optimizer state over the N
data-parallel ranks, stage 2 also the gradients, stage 3 also the parameters:

    stage 0: (2 + 2 + K) Ψ      stage 1: (2 + 2) Ψ + K Ψ / N
    stage 2: 2 Ψ + (2 + K) Ψ / N    stage 3: (2 + 2 + K) Ψ / N

In fp32 the parameters and gradients take 4 bytes each. K stays 12 at stages 1-3, where DeepSpeed's
ZeRO optimizer keeps its own fp32 copy of each rank's partition, and is 8 at stage 0 (torch AdamW:
momentum and variance only). What DeepSpeed 0.19.8 allocates on top is read from its sources
(`memory.py` says where). With bf16 gradients summed in 16 bits (precision.grad_accum_dtype bf16),
and fp16, its step converts the gradient partition to fp32 (4 Ψ / N more at stages 1-3), and stage 3
holds the layer it has gathered (its 16-bit parameters and gradients); with these the count is
DeepSpeed's own estimators' at stage 2 (2 Ψ + 18 Ψ / N) and under every offload (stage 2: 2 Ψ;
stage 3: 4 L + 2 Ψ / N, or 4 L with the parameters offloaded, L the largest layer). Offloading the
optimizer moves K Ψ / N and the fp32 gradient partition to host memory, and the 16-bit gradient
partition off the device (stage 2 reduces into the fp32 copy, stage 3 keeps it on the host); stage 1
keeps its full gradients on the device until backward ends. Offloading parameters (stage 3) moves
the parameters to the host.

bf16 gradients summed in fp32 (grad_accum_dtype fp32, the default) take DeepSpeed's fp32 buffer
instead, which the step reads in place (stage 0 sums bf16 only, so its rows sum in bf16):

    stage 1: (2 + 2 + 4) Ψ + K Ψ / N     (BF16_Optimizer: the bf16 gradients and a whole fp32 buffer)
    stage 2: 2 Ψ + (4 + K) Ψ / N    stage 3: (2 + 4 + K) Ψ / N + 4 min(Ψ / N, 1e9) + 4 L

and after backward BF16_Optimizer all-reduces its buffer in fp32 (the rendered communication_data_type),
in place beyond 5e8 elements; cast to bf16 (deepspeed_extra's communication_data_type bf16, DeepSpeed's
own default) it goes through a bf16 copy (2 Ψ), counted against the activations it outlives (smaller
buffers are concatenated first: `memory.allreduce_copy_bytes`). Under optimizer offload the device keeps
2 Ψ + 4 Ψ + 4 Ψ / N at stage 1 (each parameter's fp32 grad_accum, and the partition reduced into),
2 Ψ + 4 Ψ / N at stage 2, and the host (K + 4) Ψ / N ((K + 4 + 4) Ψ / N at stage 3).

Host memory, a rank from its start (`memory.host_at_start`): its process (`memory.PROCESS_HOST_GB`:
torch, DeepSpeed, on a GPU a CUDA context), the model where the host is its device (a CPU rank's
states, or the fp32 model it builds first; a GPU rank builds its model on the GPU), and the
offloaded states. A node holds its ranks'; when that is more than `--host-gb`, the plan names a ZeRO
stage or offload that fits, or the ranks a host that would.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"): 34 s b h bytes per layer at 16 bits, of which 2 s b h are dropout masks; the 5 a s^2 b
attention-matrix term is absent because SDPA does not keep the matrix. The logits (s b V) and their
fp32 softmax are added, as they dominate small models with large vocabularies.

Communication per step (the paper, section 7) is 2 Ψ elements for stages 0-2 (all-reduce = reduce-
scatter + all-gather) and 3 Ψ for stage 3 (parameters all-gathered in forward and in backward,
gradients reduce-scattered). With gradient accumulation stage 2 reduces gradients at every micro
step, and stage 3 gathers and reduces at every micro step. `comm_split` parts the elements into
gradients and parameters, and `comm_bytes` counts each in the dtype it travels in: a gradient in its
communication dtype (`memory.gradient_comm_bytes`: 4 bytes where bf16 gradients are summed in fp32,
which are then reduced in fp32 too, 2 where they are summed in bf16, at stage 0, or where
deepspeed_extra's communication_data_type says bf16), a parameter in its own (2 in bf16).

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
from pretrain.cluster.layout import VARIANTS as VARIANTS  # re-exported for plan's callers
from pretrain.cluster.layout import Layout, StageShare, layout_of, layout_variants, recomputes, stage_shares
from pretrain.cluster.memory import (
    GB,
    PROCESS_HOST_GB,
    deepspeed_estimate,
    gradient_comm_bytes,
    host_at_start,
    rank_memory,
)
from pretrain.cluster.memory import activation_bytes as activation_bytes  # re-exported, as below
from pretrain.cluster.memory import bucket_written_bytes as bucket_written_bytes
from pretrain.cluster.memory import largest_layer_params as largest_layer_params
from pretrain.cluster.memory import model_states as model_states
from pretrain.config.ds_render import render_deepspeed
from pretrain.config.tree import (
    ModelConfig,
    RunConfig,
    analytic_num_params,
    deep_merge,
    load_file,
    parse_override,
    validate,
)
from pretrain.errors import ConfigError, DataError
from pretrain.files import read_csv


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
    host_fits: bool | None  # a node's ranks' host memory from the start (host_node_gb) in its host's
    layout: str = "TP1 x PP1 x DP1"
    pipeline_stage: int = 0  # the stage of the rank shown: the one that needs the most memory
    rank_params: int = 0  # the parameters that rank holds (its tensor shard of its stage)
    tp_comm_gb_per_step: float = 0.0  # tensor parallel's all-reduces (counted 2X, as comm_gb_per_step)
    pp_comm_gb_per_step: float = 0.0  # the pipeline's sends to neighbour stages
    # Host memory from the start (memory.host_at_start), of the rank that needs the most there:
    host_process_gb: float = 0.0  # its process (torch, DeepSpeed, a CUDA context on GPUs)
    host_model_gb: float = 0.0  # the model, where the host is its device (CPU ranks)
    host_rank_gb: float = 0.0  # process + model + the offloaded states (host_gb)
    host_node_gb: float = 0.0  # host_rank_gb x node_ranks
    node_ranks: int = 1  # the ranks of a node


@dataclass
class Target:
    """What a plan is for: the ranks, and the memory of a rank's device and of a node's host."""

    world: int
    ranks_per_node: int | None = None  # default: min(world, 8)
    device_gb: float | None = None
    device_src: str = ""
    host_gb: float | None = None
    note: str = ""  # what the plan could not know about the target, and the flag that tells it
    device: str | None = None  # the device named (a GPU, or 'cpu'); None: this machine's

    @property
    def on_cpu(self) -> bool:
        """Whether the ranks run on CPUs, whose device memory is the host's (as `resolve_rates` decides)."""
        return self.device == "cpu" or (self.device is None and not torch.cuda.is_available())


def comm_split(n_params: int, stage: int, grad_accum: int) -> tuple[float, float]:
    """(gradient elements, parameter elements) each rank sends per optimizer step, ZeRO paper
    accounting: stage 0 all-reduces the gradients (2Ψ); stage 1 reduce-scatters them and all-gathers
    the updated parameters (Ψ each); stage 2 reduce-scatters at every micro step; stage 3 also
    gathers the parameters in every micro step's forward and backward."""
    psi = float(n_params)
    if stage == 0:
        return 2 * psi, 0.0
    if stage == 1:
        return psi, psi
    if stage == 2:
        return grad_accum * psi, psi
    return grad_accum * psi, 2 * psi * grad_accum


def comm_elements(n_params: int, stage: int, grad_accum: int) -> float:
    """Elements each rank sends per optimizer step, ZeRO paper accounting."""
    return sum(comm_split(n_params, stage, grad_accum))


def comm_bytes(cfg: RunConfig, n_params: int, *, stage: int, grad_accum: int) -> float:
    """Bytes each rank sends per optimizer step: the gradients in their communication dtype
    (`memory.gradient_comm_bytes`: fp32 where bf16 gradients are summed in fp32), the parameters in
    theirs (2 bytes in bf16 and fp16)."""
    grads, params = comm_split(n_params, stage, grad_accum)
    return grads * gradient_comm_bytes(cfg, stage) + params * elem_bytes(cfg.precision.name)


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
    """Bytes of a communicated parameter or activation (and of a gradient reduced in the parameters'
    dtype: `memory.gradient_comm_bytes` says which dtype a gradient travels in)."""
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
        cfg,
        heaviest.params,
        stage=stage,
        grad_accum=m_batches,
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
    cfg: RunConfig, n_params: int, *, stage: int, grad_accum: int, world: int, busbw: float
) -> float:
    """A step's communication at `busbw`: the ZeRO paper's bytes (an all-reduce of X counted as
    2X, `comm_bytes`) times (N-1)/N, as a ring moves them, over a data-parallel group of `world` ranks."""
    if world <= 1:
        return 0.0
    return comm_bytes(cfg, n_params, stage=stage, grad_accum=grad_accum) * (world - 1) / world / busbw


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
        table = gpu_peak_tflops(str(device), cfg.precision.name, tf32=cfg.precision.tf32)
        named_by = f"{device_src}: device={device}" if device_src else f"--device {device}"
        if table is None:
            raise ConfigError([f"{named_by}: not in the peak table ({', '.join(GPU_PEAK_TFLOPS)})"], "plan")
        peak = table
        src["peak"] = f"{device} datasheet{_tf32_said(cfg)}" + (f", {device_src}" if device_src else "")
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
    if torch.cuda.is_available():  # the config's TF32 switch, not this process's
        name = torch.cuda.get_device_name(0)
        peak = gpu_peak_tflops(name, cfg.precision.name, tf32=cfg.precision.tf32)
        source = (
            f"{name} datasheet{_tf32_said(cfg)}" if peak else f"{name}: unknown peak, set logging.peak_tflops"
        )
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


def _tf32_said(cfg: RunConfig) -> str:
    """How a GPU's datasheet peak was read for fp32: the TF32 tensor cores' (precision.tf32) or not."""
    if cfg.precision.name != "fp32":
        return ""
    return ", TF32 (precision.tf32)" if cfg.precision.tf32 else ", fp32 without TF32 (precision.tf32=false)"


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
        run,
        heaviest.params,
        stage=z.stage,
        grad_accum=b.gradient_accumulation_steps,
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


def plan_stages(
    cfg: RunConfig,
    world: int,
    *,
    device_gb: float | None,
    gpus_per_node: int | None = None,
    host_gb: float | None = None,
    cpu_ranks: bool = False,
) -> list[StagePlan]:
    """Every ZeRO stage and offload the layout allows, for this config's model, batch, precision and
    layout (`cfg.parallel` on `world` ranks): the memory of the rank that needs the most, and the host
    memory from the start of the rank that needs the most there, times a node's ranks (`cpu_ranks`:
    the ranks' device is the host)."""
    layout = layout_of(cfg, world)
    shares = stage_shares(cfg, layout)
    largest = largest_layer_params(cfg)
    per_node = gpus_per_node or min(world, 8)
    out = []
    for stage, off, par in layout_variants(layout, cfg):
        ranks = [
            rank_memory(cfg, layout, sh, stage=stage, offload_optimizer=off, offload_param=par)
            for sh in shares
        ]
        r = max(ranks, key=lambda x: x.total)
        host = max(
            (
                host_at_start(device_total=x.total, offloaded=x.host, build=x.build, cpu=cpu_ranks,
                              ranks=min(world, per_node))
                for x in ranks
            ),
            key=lambda h: h.rank,
        )  # fmt: skip
        # DeepSpeed's estimators know data parallelism only: with model parallelism, the rank's shard
        # over its data-parallel group, and no host figure
        alone = layout.tensor * layout.pipeline == 1
        ds_dev, ds_host = deepspeed_estimate(
            r.share.params, largest, stage=stage, world=world if alone else layout.data,
            gpus_per_node=per_node if alone else layout.data, offload_optimizer=off, offload_param=par,
        )  # fmt: skip
        out.append(
            StagePlan(
                stage=stage,
                offload="optimizer+params" if par else "optimizer" if off else "none",
                params_gb=r.params / GB,
                grads_gb=r.grads / GB,
                optimizer_gb=r.optim / GB,
                host_gb=r.host / GB,
                model_states_gb=r.states / GB,
                activations_gb=r.act / GB,
                working_gb=(r.working + r.after) / GB,
                device_total_gb=r.total / GB,
                ds_device_gb=None if ds_dev is None else ds_dev / GB,
                ds_host_gb=None if ds_host is None or not alone else ds_host / GB,
                comm_gb_per_step=comm_bytes(
                    cfg, r.share.params, stage=stage, grad_accum=cfg.batch.gradient_accumulation_steps
                )
                / GB,
                fits=None if device_gb is None else r.total / GB <= device_gb,
                host_fits=None if host_gb is None else host.node / GB <= host_gb,
                layout=str(layout),
                pipeline_stage=r.share.index,
                rank_params=r.share.params,
                tp_comm_gb_per_step=tp_comm_bytes(cfg, layout, r.share) / GB,
                pp_comm_gb_per_step=pp_comm_bytes(cfg, layout, r.share) / GB,
                host_process_gb=host.process / GB,
                host_model_gb=host.model / GB,
                host_rank_gb=host.rank / GB,
                host_node_gb=host.node / GB,
                node_ranks=host.ranks,
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
        "Model states by the ZeRO paper and DeepSpeed's buffers (see `pretrain/cluster/memory.py`), ZeRO sharding "
        f"over the {layout.data} data-parallel rank{'s' if layout.data > 1 else ''}; DeepSpeed's estimate assumes "
        "16-bit training summed in 16 bits (2 + 18 bytes/param), gives host memory per node, and has no estimator "
        "for stages 0 and 1.",
    ]
    pp = layout.pipeline > 1
    header = (
        "stage  offload            params  grads  optim   host | states  activ  work | device total"
        " | DS device  DS host/node | comm/step | fits | host/node | host fits"
        + (" | pipeline stage" if pp else "")
    )
    lines += [header, "-" * len(header)]
    plans = plan_stages(
        cfg,
        world,
        device_gb=device_gb,
        gpus_per_node=to.ranks_per_node,
        host_gb=to.host_gb,
        cpu_ranks=to.on_cpu,
    )
    mine = _configured(cfg, plans)
    for p in plans:
        mark = "*" if p is mine else " "
        row = (
            f"{mark}{p.stage:<5} {p.offload:<17} {_gb(p.params_gb):>7} {_gb(p.grads_gb):>6} "
            f"{_gb(p.optimizer_gb):>6} {_gb(p.host_gb):>6} | {_gb(p.model_states_gb):>6} "
            f"{_gb(p.activations_gb):>6} {_gb(p.working_gb):>5} | {_gb(p.device_total_gb):>12} | "
            f"{_gb(p.ds_device_gb):>9} {_gb(p.ds_host_gb):>13} | {_gb(p.comm_gb_per_step):>9} | "
            f"{_yes(p.fits):>4} | {_gb(p.host_node_gb):>9} | {_yes(p.host_fits):<9}"
            + (f" | {p.pipeline_stage}" if pp else "")
        )
        lines.append(row.rstrip())
    lines += [render_legend(cfg, layout), *render_host(cfg, to, plans)]
    if rates is not None:
        lines += ["", *render_times(cfg, world, rates)]
    if device_gb is not None and (search or not any(p.fits and p.host_fits is not False for p in plans)):
        lines += ["", *render_search(cfg, to, rates, fitting=not search, plans=plans)]
    return "\n".join(lines)


def render_legend(cfg: RunConfig, layout: Layout) -> str:
    """The line under the memory table that says what its columns count."""
    m, pp = cfg.model, layout.pipeline > 1
    activ = (
        f"activations of the micro batches a stage keeps in flight (1F1B: stage s keeps min(p - s, m); "
        f"activation checkpoint interval {recomputes(cfg, layout.pipeline)})"
        if pp
        else "activations of one micro batch "
        f"({'with' if m.activation_checkpointing else 'without'} activation checkpointing)"
    )
    p = cfg.precision
    summed = (
        f" Gradients summed over the micro batches in {p.grad_accum_dtype} (precision.grad_accum_dtype), "
        "at stage 0 in bf16 (DeepSpeed's stage 0 sums no bf16 gradient in fp32); at stage 1 without offload "
        "DeepSpeed's BF16_Optimizer keeps a whole fp32 gradient buffer beside the bf16 gradients."
        if p.bf16 and p.accumulates_in_fp32
        else f" Gradients summed in {p.grad_accum_dtype} (precision.grad_accum_dtype)."
        if p.bf16
        else ""
    )
    return (
        f"* this config. Each row is the rank that needs the most memory{' (its pipeline stage last)' if pp else ''}. "
        f"activ: {activ}. work: DeepSpeed's gradient reduction buffers, and BF16_Optimizer's all-reduce copy "
        "after backward (counted against the activations it outlives: the larger of the two); stage 3's gathered "
        "largest layer is in params and grads. comm: what each rank sends per optimizer step for ZeRO (2Ψ "
        "stages 0-2, 3Ψ stage 3, Ψ the rank's parameters, per micro step where the stage reduces each one), "
        f"{_comm_bytes_legend(cfg)}. host/node: a node's ranks' host memory from the start (the process, the "
        f"model where the host is the device, the offloaded states); host fits: it fits the node's.{summed}"
    )


def _comm_bytes_legend(cfg: RunConfig) -> str:
    """The bytes the comm column counts an element at: a gradient in the dtype it is reduced in
    (`memory.gradient_comm_bytes`), a parameter in its own."""
    grads, stage0 = gradient_comm_bytes(cfg, 1), gradient_comm_bytes(cfg, 0)
    at_zero = f" ({stage0} at stage 0)" if stage0 != grads else ""
    return f"a gradient at {grads} bytes{at_zero}, a parameter at {elem_bytes(cfg.precision.name)}"


def _offload_name(offload_optimizer: bool, offload_param: bool) -> str:
    return "optimizer+params" if offload_param else "optimizer" if offload_optimizer else "none"


def _configured(cfg: RunConfig, plans: list[StagePlan]) -> StagePlan | None:
    """The row of `plans` at the configured ZeRO stage and offload."""
    z = cfg.zero
    mine = (z.stage, _offload_name(z.offload_optimizer, z.offload_param))
    return next((p for p in plans if (p.stage, p.offload) == mine), None)


def render_host(cfg: RunConfig, to: Target, plans: list[StagePlan]) -> list[str]:
    """One line: the configured rank's host memory from the start, a node's, and whether its host holds
    it; when not, what would (`host_fixes`)."""
    p = _configured(cfg, plans)
    if p is None:
        return []
    process = "torch and DeepSpeed" if to.on_cpu else "torch, DeepSpeed and a CUDA context"
    model = (
        f"the model {_gb(p.host_model_gb)}, the host being the CPU ranks' device"
        if to.on_cpu
        else "the model 0, built on the GPU"
    )
    parts = (
        f"a rank {_gb(p.host_rank_gb)} GB: its process {_gb(p.host_process_gb)}, assumed for {process} "
        f"(memory.PROCESS_HOST_GB); {model}; offloaded states {_gb(p.host_gb)}"
    )
    need = f"a node's {p.node_ranks} ranks take {_gb(p.host_node_gb)} GB of host memory from the start"
    if to.host_gb is None:
        return [f"host: {need} ({parts}); the host's own is unknown: pass --host-gb."]
    if p.host_fits:
        return [f"host: {need}, of its {_gb(to.host_gb)} GB ({parts})."]
    fixes = "; or ".join(host_fixes(cfg, to, plans, p))
    return [f"host does not fit: {need}, more than its {_gb(to.host_gb)} GB ({parts}). Fix: {fixes}."]


def ranks_a_host(most: int, world: int, tensor: int) -> int:
    """The most ranks up to `most` a host can run that divide the world into whole hosts, whole tensor
    groups a host where it can hold one (tensor parallel's all-reduces stay on a node's bus); 0: none."""
    fits = [k for k in range(min(most, world), 0, -1) if world % k == 0]
    return next((k for k in fits if k % tensor == 0), fits[0] if fits else 0)


def host_fixes(cfg: RunConfig, to: Target, plans: list[StagePlan], mine: StagePlan) -> list[str]:
    """What would make a node's ranks fit its host: another ZeRO stage or offload of this layout that
    fits the device and the host as it is (the first in `VARIANTS` order the config allows); fewer
    ranks a host, at this stage and offload or else at the one fitting the device that takes the
    least host memory; or, where one rank alone does not fit, a larger host."""
    rows: list[tuple[StagePlan, list[str]]] = [(mine, [])] + [
        (p, over)
        for p in plans
        if p is not mine and p.fits and (over := _variant_overrides(cfg, to.world, p)) is not None
    ]
    fixes = [_said(p, over) for p, over in rows[1:] if p.host_fits][:1]
    least = min(rows, key=lambda r: r[0].host_rank_gb)
    tries: list[tuple[StagePlan, list[str]]] = [(mine, [])] if mine.fits or least[0] is mine else []
    for row, sets in [*tries, least]:
        per_host = ranks_a_host(int((to.host_gb or 0.0) // row.host_rank_gb), to.world, cfg.parallel.tensor)
        if per_host:
            with_sets = f"{_said(row, sets)} with " if sets else ""
            return [*fixes, f"{with_sets}{per_host} rank{'s' if per_host > 1 else ''} a host (slots={per_host} "
                    f"in the hostfile: {to.world // per_host} hosts for the {to.world} ranks)"]  # fmt: skip
    row, sets = least
    return [
        *fixes,
        f"hosts of {_gb(row.host_rank_gb)} GB a rank or more"
        + (f", with {_said(row, sets)}" if sets else ""),
    ]


def _variant_overrides(cfg: RunConfig, world: int, p: StagePlan) -> list[str] | None:
    """The `--set` overrides that give row `p`'s ZeRO stage and offload; None where the tree refuses them."""
    z = cfg.zero
    off, par = p.offload != "none", p.offload == "optimizer+params"
    over = [f"zero.stage={p.stage}"] if p.stage != z.stage else []
    over += [f"zero.offload_optimizer={str(off).lower()}"] if off != z.offload_optimizer else []
    over += [f"zero.offload_param={str(par).lower()}"] if par != z.offload_param else []
    return over if with_overrides(cfg, world, over) is not None else None


def _said(p: StagePlan, over: list[str]) -> str:
    """A row as the overrides that give it, and what it takes."""
    return " ".join(f"--set {o}" for o in over) + (
        f" (ZeRO-{p.stage} {p.offload}: {_gb(p.device_total_gb)} GB a device, {_gb(p.host_rank_gb)} GB of host "
        "memory a rank)"
    )


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


def with_overrides(cfg: RunConfig, world: int, overrides: list[str]) -> RunConfig | None:
    """`cfg` with these `--set` overrides on `world` ranks, its batch derived again; None where the
    tree refuses the result (a layout the model's shape or ZeRO does not allow)."""
    data: dict[str, Any] = cfg.model_dump(mode="json")
    data["batch"] |= {"data_parallel_size": None, "train_batch_size": None}
    for item in overrides:
        data = deep_merge(data, parse_override(item))
    try:
        return validate(data, world)
    except ConfigError:
        return None


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
                    tried += 1
                    option = _layout_option(
                        cfg, to, rates, over, stage=stage, offload=_offload_name(off, par)
                    )
                    if option is not None:
                        found.append(option)
    found.sort(key=lambda o: (o.step_s if o.step_s is not None else 0.0, o.device_total_gb))
    best: dict[tuple[str, int, str], LayoutOption] = {}
    for o in found:  # the fastest of each layout, stage and offload (a micro batch or checkpointing apart)
        best.setdefault((o.layout, o.stage, o.offload), o)
    return list(best.values()), tried


def _layout_option(
    cfg: RunConfig, to: Target, rates: Rates | None, overrides: list[str], *, stage: int, offload: str
) -> LayoutOption | None:
    """The layout these overrides give `cfg`, if the tree allows it and it fits the device and the host."""
    c = with_overrides(cfg, to.world, overrides)
    if c is None:
        return None
    plans = plan_stages(
        c, to.world, device_gb=to.device_gb, gpus_per_node=to.ranks_per_node or min(to.world, 8),
        host_gb=to.host_gb, cpu_ranks=to.on_cpu,
    )  # fmt: skip
    row = next(p for p in plans if (p.stage, p.offload) == (stage, offload))
    if not row.fits or row.host_fits is False:
        return None
    t = None
    if rates is not None:
        off, par = offload != "none", offload == "optimizer+params"
        t = predict_step(c, to.world, stage=stage, offload_optimizer=off, offload_param=par, rates=rates)
    return LayoutOption(
        overrides=overrides,
        layout=row.layout,
        stage=stage,
        offload=row.offload,
        device_total_gb=row.device_total_gb,
        step_s=None if t is None else t.step_s,
        days=None if t is None else t.days,
    )


SEARCH_SHOWN = 5


def render_search(
    cfg: RunConfig, to: Target, rates: Rates | None, *, fitting: bool, plans: list[StagePlan]
) -> list[str]:
    """The layouts that fit (`search_layouts`), after what does not fit the configured one (`plans`)."""
    found, tried = search_layouts(cfg, to, rates)
    host_bound = to.host_gb is not None and any(p.fits for p in plans)  # the device would hold a row
    said = (
        f"Nothing fits {layout_of(cfg, to.world)} on {_gb(to.device_gb)} GB devices"
        + (f" and {_gb(to.host_gb)} GB hosts." if host_bound else ".")
        if fitting
        else f"Layouts on {to.world} ranks of {_gb(to.device_gb)} GB."
    )
    if not found:
        fix = (
            "the host line above says what would fit"
            if host_bound
            else "more ranks, or a smaller micro batch"
        )
        return [f"{said} No layout of the {tried} searched fits either (tensor 1-8 within a node, pipeline "
                f"stages dividing the nodes or layers, ZeRO 0-3, activation checkpointing): {fix}."]  # fmt: skip
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
        cfg, to.world, device_gb=to.device_gb, gpus_per_node=to.ranks_per_node, host_gb=to.host_gb,
        cpu_ranks=to.on_cpu,
    )  # fmt: skip
    mine = _configured(cfg, plans)
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
        "process_host_gb": PROCESS_HOST_GB["cpu" if to.on_cpu else "cuda"],  # a rank's, assumed
        "host_fixes": host_fixes(cfg, to, plans, mine)
        if mine is not None and mine.host_fits is False
        else [],
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
