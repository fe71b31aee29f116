"""`pretrain plan`: what a run will cost per rank before it is launched.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, section 3): mixed-precision Adam keeps
2 bytes of 16-bit parameters, 2 of 16-bit gradients and K = 12 of fp32 optimizer state (master
weights, momentum, variance) per parameter, and stage 1 partitions the optimizer state over the N
data-parallel ranks, stage 2 also the gradients, stage 3 also the parameters:

    stage 0: (2 + 2 + K) Ψ      stage 1: (2 + 2) Ψ + K Ψ / N
    stage 2: 2 Ψ + (2 + K) Ψ / N    stage 3: (2 + 2 + K) Ψ / N

In fp32 the parameters and gradients take 4 bytes each. K stays 12 at stages 1-3, where DeepSpeed's
ZeRO optimizer keeps its own fp32 copy of each rank's partition, and is 8 at stage 0 (torch AdamW:
momentum and variance only). Offloading the optimizer moves K Ψ / N to host memory and adds an
fp32 copy of the partition's gradients there (4 Ψ / N); the gradients stay on the device as before
(measured: DeepSpeed keeps the gradient partition on the device under offload too). Offloading
parameters (stage 3) moves the parameters to the host.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"): 34 s b h bytes per layer at 16 bits, of which 2 s b h are dropout masks; the 5 a s^2 b
attention-matrix term is absent because SDPA does not keep the matrix. The logits (s b V) and their
fp32 softmax are added, as they dominate small models with large vocabularies.

Communication per step (the paper, section 7) is 2 Ψ elements for stages 0-2 (all-reduce = reduce-
scatter + all-gather) and 3 Ψ for stage 3 (parameters all-gathered in forward and in backward,
gradients reduce-scattered). With gradient accumulation stage 2 reduces gradients at every micro
step, and stage 3 gathers and reduces at every micro step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.config import RunConfig
from pretrain.ds_config import render_deepspeed
from pretrain.model import analytic_num_params

GB = 1e9


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
    comm_gb_per_step: float  # per rank, as in the paper (elements x bytes, no (N-1)/N factor)
    fits: bool | None


def bytes_per_param(precision: str, stage: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter."""
    if precision in ("bf16", "fp16"):
        return 2, 2, 12
    return 4, 4, (8 if stage == 0 else 12)


def largest_layer_params(cfg: RunConfig) -> int:
    """The most parameters any one module holds (ZeRO-3 gathers one module's at a time)."""
    m = cfg.model
    d, vocab = m.n_embd, m.vocab_size or 0
    b = 1 if m.bias else 0
    return max(vocab * d, 4 * d * d + b * 4 * d, 3 * d * d + b * 3 * d)


def model_states(
    n_params: int, stage: int, world: int, precision: str, offload_optimizer: bool, offload_param: bool
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer) bytes on the device and bytes on the host, per rank."""
    p, g, k = bytes_per_param(precision, stage)
    psi, n = float(n_params), float(world)
    params = p * psi / (n if stage >= 3 else 1)
    grads = g * psi / (n if stage >= 2 else 1)
    optim = k * psi / (n if stage >= 1 else 1)
    host = 0.0
    if offload_optimizer:
        # The fp32 state, and an fp32 copy of the partition's gradients for the CPU optimizer; the
        # gradients themselves still pass through the device (DeepSpeed keeps their partition there).
        host += optim + 4 * psi / n
        optim = 0.0
    if offload_param:
        host += params
        params = 0.0
    return params, grads, optim, host


def working_bytes(cfg: RunConfig, n_params: int, stage: int, world: int) -> float:
    """Buffers DeepSpeed adds on the device while it reduces gradients (read from its sources):

    - stage 0: the gradients flattened into one all-reduce buffer of up to 5e8 elements (none with
      one rank: pretrain then skips the reduction);
    - stages 1-2: the reduce bucket, two of them when `overlap_comm` double-buffers;
    - stage 3: the largest layer's parameters and gradients gathered at once, and a reduce bucket.
    """
    p, g, _ = bytes_per_param(cfg.precision.name, stage)
    z = cfg.zero
    bucket = min(z.reduce_bucket_size, n_params)
    if stage == 0:
        return 0.0 if world == 1 else float(g * min(n_params, 500_000_000))
    if stage in (1, 2):
        return float(g * bucket * (2 if z.overlap_comm else 1))
    return float(largest_layer_params(cfg) * (p + g) + g * bucket)


def activation_bytes(cfg: RunConfig) -> float:
    """Activations kept for backward by one micro batch on one rank."""
    m = cfg.model
    s, b, h, L = m.block_size, cfg.batch.micro_batch_size, m.n_embd, m.n_layer
    vocab = m.vocab_size or 0
    a = 2 if cfg.precision.name in ("bf16", "fp16") else 4  # bytes per activation value
    masks = 2 * s * b * h if m.dropout > 0 else 0  # 1-byte dropout masks: attention out + MLP out
    per_layer = 16 * s * b * h * a + masks  # Korthikanti's 32 sbh bytes at a = 2, without masks
    # With checkpointing: each block's input, and one block's activations while it is recomputed.
    layers = L * s * b * h * a + per_layer if m.activation_checkpointing else L * per_layer
    logits = s * b * vocab * (a + 4)  # the logits and cross-entropy's fp32 softmax
    return float(layers + logits + s * b * h * a)  # + the embedding output


def comm_elements(n_params: int, stage: int, grad_accum: int) -> float:
    """Elements each rank sends per optimizer step, ZeRO paper accounting."""
    psi = float(n_params)
    if stage <= 1:
        return 2 * psi
    if stage == 2:
        return grad_accum * psi + psi  # a reduce-scatter per micro step, one all-gather per step
    return 3 * psi * grad_accum


def deepspeed_estimate(
    n_params: int,
    largest: int,
    stage: int,
    world: int,
    gpus_per_node: int,
    offload_optimizer: bool,
    offload_param: bool,
) -> tuple[float | None, float | None]:
    """DeepSpeed's own (device, host) model-state estimate in bytes per rank; None at stage 0."""
    nodes = max(1, world // gpus_per_node)
    per_node = min(world, gpus_per_node)
    if stage in (1, 2):
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


def plan_stages(
    cfg: RunConfig, world: int, device_gb: float | None, gpus_per_node: int | None = None
) -> list[StagePlan]:
    """Every stage with and without offload, for this config's model, batch and precision."""
    n = analytic_num_params(cfg.model)
    largest = largest_layer_params(cfg)
    precision = cfg.precision.name
    act = activation_bytes(cfg)
    out = []
    variants = [(0, False, False)] + [
        (s, off, par)
        for s in (1, 2, 3)
        for off, par in ((False, False), (True, False), (True, True))
        if s == 3 or not par
    ]
    for stage, off, par in variants:
        params, grads, optim, host = model_states(n, stage, world, precision, off, par)
        working = working_bytes(cfg, n, stage, world)
        states = params + grads + optim
        total = states + act + working
        ds_dev, ds_host = deepspeed_estimate(
            n, largest, stage, world, gpus_per_node or min(world, 8), off, par
        )
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
                comm_gb_per_step=comm_elements(n, stage, cfg.batch.gradient_accumulation_steps)
                * (2 if precision in ("bf16", "fp16") else 4)
                / GB,
                fits=None if device_gb is None else total / GB <= device_gb,
            )
        )
    return out


def default_device_gb(world: int) -> tuple[float | None, str]:
    """One rank's memory here: the first GPU's, or on a CPU this host's RAM shared by the ranks."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GB, f"{props.name}"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024 / GB
                return total / world, f"host RAM {total:.1f} GB / {world} CPU ranks"
    except OSError:
        pass
    return None, "unknown (pass --device-gb)"


def _gb(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def render_plan(
    cfg: RunConfig, world: int, device_gb: float | None, device_src: str, gpus_per_node: int | None
) -> str:
    b, m = cfg.batch, cfg.model
    n = analytic_num_params(m)
    tbs = b.train_batch_size or 0
    lines = [
        f"{cfg.preset}: {n / 1e6:.2f}M parameters (Ψ), {m.n_layer} layers, n_embd {m.n_embd}, "
        f"context {m.block_size}, vocab {m.vocab_size}, {cfg.precision.name}",
        f"batch: micro {b.micro_batch_size} x accumulation {b.gradient_accumulation_steps} x data-parallel "
        f"{b.data_parallel_size} = {tbs} sequences per step",
        f"tokens: {tbs * m.block_size:,} per step, {tbs * m.block_size * cfg.schedule.max_steps:,} in "
        f"{cfg.schedule.max_steps:,} steps",
        "",
        "DeepSpeed JSON (rendered):",
        json.dumps(render_deepspeed(cfg), indent=2),
        "",
        f"Memory per rank in GB, world size {world}; device memory {_gb(device_gb)} GB ({device_src}).",
        "Model states by the ZeRO paper (see `pretrain/plan.py`); DeepSpeed's estimate assumes 16-bit "
        "training (2 + 18 bytes/param), gives host memory per node, and does not model stage 0.",
    ]
    header = (
        "stage  offload            params  grads  optim   host | states  activ  work | device total"
        " | DS device  DS host/node | comm/step | fits"
    )
    lines += [header, "-" * len(header)]
    chosen = (cfg.zero.stage, cfg.zero.offload_optimizer, cfg.zero.offload_param)
    for p in plan_stages(cfg, world, device_gb, gpus_per_node):
        mark = "*" if (p.stage, p.offload != "none", p.offload == "optimizer+params") == chosen else " "
        lines.append(
            f"{mark}{p.stage:<5} {p.offload:<17} {_gb(p.params_gb):>7} {_gb(p.grads_gb):>6} "
            f"{_gb(p.optimizer_gb):>6} {_gb(p.host_gb):>6} | {_gb(p.model_states_gb):>6} "
            f"{_gb(p.activations_gb):>6} {_gb(p.working_gb):>5} | {_gb(p.device_total_gb):>12} | "
            f"{_gb(p.ds_device_gb):>9} {_gb(p.ds_host_gb):>13} | {_gb(p.comm_gb_per_step):>9} | "
            f"{'-' if p.fits is None else 'yes' if p.fits else 'NO'}"
        )
    lines += [
        "* this config. activ: activations of one micro batch "
        f"({'with' if m.activation_checkpointing else 'without'} activation checkpointing). work: DeepSpeed's "
        "gradient reduction buffers (and stage 3's gathered largest layer). comm: what each rank sends per optimizer step (2Ψ stages 0-2, 3Ψ "
        "stage 3, per micro step where the stage reduces each one)."
    ]
    return "\n".join(lines)


def plan_json(
    cfg: RunConfig, world: int, device_gb: float | None, gpus_per_node: int | None = None
) -> dict[str, Any]:
    return {
        "params": analytic_num_params(cfg.model),
        "world_size": world,
        "device_gb": device_gb,
        "stages": [asdict(p) for p in plan_stages(cfg, world, device_gb, gpus_per_node)],
    }
