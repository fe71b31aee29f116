"""`pretrain plan`'s figures: each ZeRO stage's memory a rank (`plan_stages`) and the run's budget.

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

Under a layout of tensor (t) x pipeline (p) x data-parallel (d) ranks (`parallel`, `Layout`):
- parameters: a rank holds 1/t of its stage's block matrices and its stage's norms, embeddings and
  lm_head whole (AutoTP leaves those unsplit); the stages are cut from [embedding, blocks, head] by
  DeepSpeed's own partition functions (`stage_shares`), and ZeRO's formulas above apply to the
  rank's parameters with N = d. The plan shows the rank that needs the most memory;
- activations: what lies between a column- and a row-parallel matrix is split over t; under the
  1F1B schedule stage s keeps min(p - s, m) micro batches in flight (m = gradient accumulation
  steps), checkpointing every `parallel.activation_checkpoint_interval` blocks.

The time a step takes is `timing`'s, the layouts that fit when this one does not `search`'s, and
what `pretrain plan` prints `report`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.config.layout import layout_of
from pretrain.config.tree import RunConfig
from pretrain.plan.layout import layout_variants, stage_shares
from pretrain.plan.memory import (
    GB,
    deepspeed_estimate,
    host_at_start,
    largest_layer_params,
    rank_memory,
    snapshot_bytes,
)
from pretrain.plan.timing import comm_bytes, pp_comm_bytes, tp_comm_bytes


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
    # An asynchronous save's snapshot in host memory while it is written (checkpoint.async_save):
    host_snapshot_gb: float = 0.0  # the first data-parallel rank's (the weights and its partition)
    host_snapshot_node_gb: float = 0.0  # a node's (host_fits does not count it: a save can go synchronous)


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
    for stage, off, par in layout_variants(layout, optimizer=cfg.optimizer):
        ranks = [
            rank_memory(cfg, layout, sh, stage=stage, offload_optimizer=off, offload_param=par, cpu=cpu_ranks)
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
        # an asynchronous save's snapshot, while it is written: the first data-parallel rank's (the
        # weights and its optimizer partition) and a node's (one such rank, the others' partitions)
        first, other = snapshot_bytes(cfg.precision.name, r.share.params, stage=stage, world=layout.data)
        snap_rank, snap_node = (
            (first, first + other * (host.ranks - 1)) if cfg.checkpoint.async_save else (0, 0)
        )
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
                host_snapshot_gb=snap_rank / GB,
                host_snapshot_node_gb=snap_node / GB,
            )
        )
    return out


def offload_name(offload_optimizer: bool, offload_param: bool) -> str:
    """A row's offload, as the tables and the JSON name it: none, optimizer or optimizer+params."""
    return "optimizer+params" if offload_param else "optimizer" if offload_optimizer else "none"


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
