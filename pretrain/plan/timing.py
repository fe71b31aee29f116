"""The step-time model: how long one optimizer step takes per ZeRO stage, offload and layout.

Communication per step (the ZeRO paper, Rajbhandari et al. 2020, section 7) is 2 Ψ elements for
stages 0-2 (all-reduce = reduce-scatter + all-gather) and 3 Ψ for stage 3 (parameters all-gathered
in forward and in backward, gradients reduce-scattered). With gradient accumulation stage 2 reduces
gradients at every micro step, and stage 3 gathers and reduces at every micro step. `comm_split`
parts the elements into gradients and parameters, and `comm_bytes` counts each in the dtype it
travels in: a gradient in its communication dtype (`memory.gradient_comm_bytes`: 4 bytes where bf16
gradients are summed in fp32, which are then reduced in fp32 too, 2 where they are summed in bf16,
at stage 0, or where deepspeed_extra's communication_data_type says bf16), a parameter in its own (2
in bf16).

Step time (`predict_step`) adds four parts, per rank:
- compute: the FLOPs of the rank's tokens (6N + attention, `analytic_flops_per_token`, and the
  forward again under activation checkpointing) over the device's peak times the fraction of it
  forward and backward reach;
- communication left exposed (`exposed_seconds`): the bytes above over the all-reduce bus bandwidth
  (nccl-tests' convention: an all-reduce of X bytes on N ranks takes 2X (N-1)/N / busbw), less what
  the compute phase it is issued in hides. DeepSpeed all-reduces after backward at stages 0 and 1
  (no overlap), and stages 1 and 2 all-gather the updated parameters after the optimizer step (no
  overlap). With `overlap_comm` stage 2 reduce-scatters gradient buckets during each micro batch's
  backward, and stage 3 all-gathers each micro batch's parameters during its forward (prefetched)
  and again during its backward, where it also reduce-scatters the gradients. Forward is a third of
  compute (2 of 6N), a quarter under activation checkpointing (2 of 8N), backward the rest. Only
  `OVERLAP` of a phase hides communication (assumed, not measured: each pass's first gather and
  last bucket wait, and the collectives take SMs and memory bandwidth from the kernels they overlap);
  so a stage 3 whose per-micro-batch traffic over a slow network outlasts that part of its passes
  shows the rest exposed;
- under optimizer offload, the copies over PCIe (`offload_seconds`, at `Rates.pcie_bw` a GPU: each
  GPU its own Gen4 x16 link, 25 GB/s of its 32, not overlapped): the fp32 gradient partition to the
  host (at stages 1 and 2 once a step, DeepSpeed 0.19.8 copying the summed partition at the
  accumulation boundary; at stage 3 every micro batch, as stage 3 reduces every micro batch) and the
  updated 16-bit partition back; under parameter offload the partition comes up for every micro
  batch's forward and backward instead and stays on the host after the step;
- the optimizer step over the rank's partition (all parameters at stage 0, 1/N from stage 1), at a
  per-parameter cost on the device, or on the host under optimizer offload (DeepSpeedCPUAdam).
The rates (`Rates`) come from `rates.resolve_rates`.

Under a layout of tensor (t) x pipeline (p) x data-parallel (d) ranks (`parallel`, `Layout`):
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
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pretrain.config.layout import Layout, layout_of
from pretrain.config.tree import ModelConfig, RunConfig
from pretrain.plan.layout import StageShare, layout_variants, recomputes, stage_shares
from pretrain.plan.memory import gradient_comm_bytes

# The part of a compute phase (forward, or backward) that hides the ZeRO communication issued in it,
# under zero.overlap_comm: assumed (see the module's docstring; docs/zero.md). The published runs bound
# it from below: torchtitan's FSDP runs on 64 A100s, communication-bound at the 20 GB/s assumed across
# A100 nodes, fall under 75% of their published tokens/s below 0.8 (docs/plan.md).
OVERLAP = 0.85


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
    pcie_bw: float | None = None  # offload's host <-> GPU copies, bytes/s a GPU; None: the host is the device
    mfu_by_layout: dict[str, float] | None = None  # the default efficiency by `layout_kind`; None: given


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
    offload_s: float = 0.0  # host <-> device copies over PCIe under offload (`offload_seconds`)


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
    group less what overlaps compute, then the optimizer step over the rank's partition and offload's
    copies over PCIe. Ranks that
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
    busbw = group_busbw(rates, layout.tensor * dp)
    comm = comm_seconds(cfg, heaviest.params, stage=stage, grad_accum=m_batches, world=dp, busbw=busbw)
    exposed = exposed_seconds(
        cfg, heaviest.params, stage=stage, world=dp, busbw=busbw, compute_s=st.compute,
        recompute=bool(recomputes(cfg, layout.pipeline)),
    )  # fmt: skip
    partition = heaviest.params if stage == 0 else heaviest.params / dp
    per_param = rates.host_optimizer_s_per_param if offload_optimizer else rates.optimizer_s_per_param
    optimizer = partition * per_param / share  # every rank steps at once
    offload = offload_seconds(
        cfg, partition, stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param,
        pcie_bw=rates.pcie_bw,
    )  # fmt: skip
    step = pipeline_s + exposed + optimizer + offload
    tokens = b.micro_batch_size * m_batches * cfg.model.block_size  # per data-parallel replica
    return StepTime(
        stage=stage,
        offload="optimizer+params" if offload_param else "optimizer" if offload_optimizer else "none",
        compute_s=st.compute,
        comm_s=comm,
        exposed_comm_s=exposed,
        optimizer_s=optimizer,
        offload_s=offload,
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


def exposed_seconds(
    cfg: RunConfig, n_params: int, *, stage: int, world: int, busbw: float, compute_s: float, recompute: bool
) -> float:
    """What compute does not hide of a step's ZeRO communication (`comm_seconds`) on a rank of `n_params`.

    Stages 0 and 1 reduce after backward, and without `zero.overlap_comm` nothing overlaps: all of it.
    Stages 1 and 2 gather the updated parameters once after the step (stage 3's gathers are its micro
    batches'). Stage 2 reduce-scatters each micro batch's gradients in its backward;
    stage 3 gathers each micro batch's parameters in its forward, and again in its backward beside
    the reduce-scatter. Forward takes 1/3 of `compute_s` (1/4 under `recompute`), and `OVERLAP` of a
    phase hides what is issued in it."""
    if world <= 1:
        return 0.0
    m = cfg.batch.gradient_accumulation_steps
    psi, ring = float(n_params), (world - 1) / world / busbw
    grads = m * psi * gradient_comm_bytes(cfg, stage) * ring  # a micro batch's reduce-scatter, every one
    params = psi * elem_bytes(cfg.precision.name) * ring  # one all-gather of the parameters
    if stage < 2 or not cfg.zero.overlap_comm:
        return comm_seconds(cfg, n_params, stage=stage, grad_accum=m, world=world, busbw=busbw)
    forward = compute_s * (1 / 4 if recompute else 1 / 3)
    backward = compute_s - forward
    if stage == 2:
        return max(0.0, grads - OVERLAP * backward) + params
    gathers = m * params  # once a micro batch in forward, and once in backward
    return max(0.0, gathers - OVERLAP * forward) + max(0.0, gathers + grads - OVERLAP * backward)


def offload_seconds(
    cfg: RunConfig,
    partition: float,
    *,
    stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    pcie_bw: float | None,
) -> float:
    """A step's copies between a GPU and its host under offload, for a rank's `partition` of parameters:
    the fp32 gradient partition down (every micro batch at stage 3, which reduces every one; once a step
    at stages 1 and 2) and the updated 16-bit partition up, or under parameter offload the 16-bit
    partition up for every micro batch's forward and backward. Not overlapped with compute; nothing
    where the host is the device (`pcie_bw` None)."""
    if not offload_optimizer or pcie_bw is None:
        return 0.0
    m = cfg.batch.gradient_accumulation_steps
    p = elem_bytes(cfg.precision.name)
    down = 4 * partition * (m if stage == 3 else 1)
    up = 2 * m * p * partition if offload_param else p * partition
    return (down + up) / pcie_bw


def step_times(cfg: RunConfig, world: int, rates: Rates) -> list[StepTime]:
    """`predict_step` for every stage and offload that `plan_stages` lists."""
    return [
        predict_step(cfg, world, stage=stage, offload_optimizer=off, offload_param=par, rates=rates)
        for stage, off, par in layout_variants(layout_of(cfg, world), optimizer=cfg.optimizer)
    ]
