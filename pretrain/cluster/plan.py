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
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pretrain.cluster.hardware import GPU_PEAK_TFLOPS, device_peak_tflops, gpu_peak_tflops
from pretrain.config.ds_render import render_deepspeed
from pretrain.config.tree import (
    ModelConfig,
    RunConfig,
    analytic_flops_per_token,
    analytic_num_params,
    load_file,
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
    comm_gb_per_step: float  # per rank, as in the paper (elements x bytes, no (N-1)/N factor)
    fits: bool | None
    host_fits: bool | None  # the offloaded states of a node's ranks in its host memory


@dataclass
class Target:
    """What a plan is for: the ranks, and the memory of a rank's device and of a node's host."""

    world: int
    ranks_per_node: int | None = None  # default: min(world, 8)
    device_gb: float | None = None
    device_src: str = ""
    host_gb: float | None = None


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
    n_params: int, *, stage: int, world: int, precision: str, offload_optimizer: bool, offload_param: bool
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


def working_bytes(cfg: RunConfig, n_params: int, *, stage: int, world: int) -> float:
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
    # Values kept per token: the two norms' inputs (2h); attention's input, q, k, v and output
    # (3h + 2 kv, flash attention keeps no T x T scores); the MLP's input and hidden activations,
    # GELU's c_fc output and GELU output (2f), or SwiGLU's gate, up, silu(gate) and product (4f).
    # For gpt2 (f = 4h, kv = h) that is Korthikanti's 32 sbh bytes at a = 2, without masks.
    kv, f = m.kv_heads * m.head_size, m.ffn_hidden
    per_token = 2 * h + (3 * h + 2 * kv) + h + (4 if m.arch == "llama" else 2) * f
    per_layer = per_token * s * b * a + masks
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


# ---------------------------------------------------------------------------------------------
# Step time


@dataclass
class Rates:
    """What a step's time is predicted from, each with where it came from."""

    peak_tflops: float  # one rank's device peak, TFLOP/s
    mfu: float  # the fraction of the peak that forward + backward reach
    busbw: float  # all-reduce bus bandwidth, bytes/s
    optimizer_s_per_param: float  # an optimizer step on the device, seconds per parameter
    host_optimizer_s_per_param: float  # the same on the host, under optimizer offload
    sources: dict[str, str]


@dataclass
class StepTime:
    stage: int
    offload: str
    compute_s: float
    comm_s: float  # all of the step's communication
    exposed_comm_s: float  # what compute does not hide
    optimizer_s: float
    step_s: float
    tokens_per_s: float  # all ranks
    days: float  # to train schedule.max_steps steps


def hardware_flops_per_token(m: ModelConfig) -> float:
    """The FLOPs a token costs the device: the model's, plus the forward pass again for the blocks
    that activation checkpointing recomputes in backward (2N of the 6N)."""
    return analytic_flops_per_token(m) * (4 / 3 if m.activation_checkpointing else 1.0)


def elem_bytes(precision: str) -> int:
    """Bytes of a communicated gradient or parameter element."""
    return 2 if precision in ("bf16", "fp16") else 4


def predict_step(
    cfg: RunConfig, world: int, *, stage: int, offload_optimizer: bool, offload_param: bool, rates: Rates
) -> StepTime:
    """One optimizer step of `cfg` at this stage and offload, on `world` ranks."""
    m, b = cfg.model, cfg.batch
    n = analytic_num_params(m)
    tokens = b.micro_batch_size * b.gradient_accumulation_steps * m.block_size  # per rank
    compute = hardware_flops_per_token(m) * tokens / (rates.peak_tflops * 1e12 * rates.mfu)
    comm = comm_seconds(
        n,
        stage=stage,
        grad_accum=b.gradient_accumulation_steps,
        precision=cfg.precision.name,
        world=world,
        busbw=rates.busbw,
    )
    window = 0.0
    if cfg.zero.overlap_comm:
        window = {2: 2 / 3 * compute, 3: compute}.get(stage, 0.0)
    exposed = max(0.0, comm - window)
    partition = n if stage == 0 else n / world
    per_param = rates.host_optimizer_s_per_param if offload_optimizer else rates.optimizer_s_per_param
    optimizer = partition * per_param
    step = compute + exposed + optimizer
    return StepTime(
        stage=stage,
        offload="optimizer+params" if offload_param else "optimizer" if offload_optimizer else "none",
        compute_s=compute,
        comm_s=comm,
        exposed_comm_s=exposed,
        optimizer_s=optimizer,
        step_s=step,
        tokens_per_s=tokens * world / step,
        days=step * cfg.schedule.max_steps / 86400,
    )


def comm_seconds(
    n_params: int, *, stage: int, grad_accum: int, precision: str, world: int, busbw: float
) -> float:
    """A step's communication at `busbw`: the ZeRO paper's bytes (an all-reduce of X counted as
    2X) times (N-1)/N, as a ring moves them."""
    if world <= 1:
        return 0.0
    return comm_elements(n_params, stage, grad_accum) * elem_bytes(precision) * (world - 1) / world / busbw


# Assumed when neither a flag, a previous run nor preflight gives them.
ASSUMED_MFU = 0.4
ASSUMED_BUSBW = {"cuda": 100e9, "cuda-multinode": 20e9, "cpu": 1e9}  # bytes/s: NVLink, IB, gloo on loopback
ASSUMED_OPTIMIZER_S = {"cuda": 2e-11, "cpu": 2e-9}  # per parameter: 32 bytes at 1.6 TB/s; a CPU core
ASSUMED_HOST_OPTIMIZER_S = 1e-9  # DeepSpeedCPUAdam per parameter, a few cores per rank
PREFLIGHT_FILE = "preflight.json"  # where `pretrain preflight` leaves its all-reduce, in the run dir


def resolve_rates(
    cfg: RunConfig,
    world: int,
    ranks_per_node: int,
    *,
    device: str | None = None,
    peak_tflops: float | None = None,
    mfu: float | None = None,
    busbw_gbs: float | None = None,
    from_runs: list[Path] | None = None,
) -> Rates:
    """The rates for `predict_step`: flags first, then a previous run's measurements, preflight's
    bus bandwidth, this machine's device; assumptions last, each source named."""
    src: dict[str, str] = {}
    kind = "cpu" if device == "cpu" or (device is None and not torch.cuda.is_available()) else "cuda"
    if peak_tflops is not None:
        peak, src["peak"] = peak_tflops, "--peak-tflops"
    elif device not in (None, "cpu"):
        table = gpu_peak_tflops(str(device), cfg.precision.name)
        if table is None:
            raise ConfigError(
                [f"--device {device}: not in the peak table ({', '.join(GPU_PEAK_TFLOPS)})"], "plan"
            )
        peak, src["peak"] = table, f"{device} datasheet"
    elif cfg.logging.peak_tflops is not None:
        peak, src["peak"] = cfg.logging.peak_tflops, "logging.peak_tflops"
    else:
        peak, src["peak"] = _local_peak(cfg, ranks_per_node)
    multinode = world > ranks_per_node
    busbw, src["busbw"] = _busbw(cfg, world, kind, multinode=multinode, given=busbw_gbs)
    rates = Rates(
        peak_tflops=peak,
        mfu=ASSUMED_MFU,
        busbw=busbw,
        optimizer_s_per_param=ASSUMED_OPTIMIZER_S[kind],
        host_optimizer_s_per_param=ASSUMED_HOST_OPTIMIZER_S,
        sources=src,
    )
    src["mfu"] = src["optimizer"] = "assumed"
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
    cfg: RunConfig, world: int, kind: str, *, multinode: bool, given: float | None
) -> tuple[float, str]:
    if given is not None:
        return given * 1e9, "--busbw"
    path = cfg.run_dir() / PREFLIGHT_FILE
    try:
        measured = json.loads(path.read_text())["allreduce"]
        return float(measured["busbw"]), f"{path}: {measured['world']}-rank all-reduce, {measured['backend']}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
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
    world = b.data_parallel_size or 1
    n = analytic_num_params(m)
    comm = comm_seconds(
        n,
        stage=z.stage,
        grad_accum=b.gradient_accumulation_steps,
        precision=run.precision.name,
        world=world,
        busbw=rates.busbw,
    )
    exposed = comm if z.stage < 2 or not z.overlap_comm else 0.0  # inside backward, or hidden by it
    compute = max(fwd_bwd - exposed, 1e-9)
    tokens = b.micro_batch_size * b.gradient_accumulation_steps * m.block_size
    per_param = optimizer / (n if z.stage == 0 else n / world)
    if z.offload_optimizer:
        rates.host_optimizer_s_per_param = per_param
    else:
        rates.optimizer_s_per_param = per_param
    rates.sources["optimizer"] = f"{run_dir}: optimizer {optimizer * 1e3:.1f} ms a step"
    return hardware_flops_per_token(m) * tokens / compute / (rates.peak_tflops * 1e12)


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
    cfg: RunConfig,
    world: int,
    *,
    device_gb: float | None,
    gpus_per_node: int | None = None,
    host_gb: float | None = None,
) -> list[StagePlan]:
    """Every stage with and without offload, for this config's model, batch and precision."""
    n = analytic_num_params(cfg.model)
    largest = largest_layer_params(cfg)
    precision = cfg.precision.name
    act = activation_bytes(cfg)
    out = []
    for stage, off, par in VARIANTS:
        params, grads, optim, host = model_states(
            n, stage=stage, world=world, precision=precision, offload_optimizer=off, offload_param=par
        )
        working = working_bytes(cfg, n, stage=stage, world=world)
        states = params + grads + optim
        total = states + act + working
        ds_dev, ds_host = deepspeed_estimate(
            n,
            largest,
            stage=stage,
            world=world,
            gpus_per_node=gpus_per_node or min(world, 8),
            offload_optimizer=off,
            offload_param=par,
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
                host_fits=None if host_gb is None else host * min(world, gpus_per_node or 8) / GB <= host_gb,
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


def render_plan(cfg: RunConfig, to: Target, rates: Rates | None = None) -> str:
    world, device_gb = to.world, to.device_gb
    b, m = cfg.batch, cfg.model
    n = analytic_num_params(m)
    tbs = b.sequences
    lines = [
        f"{cfg.preset}: {n / 1e6:.2f}M parameters (Ψ), {m.arch}, {m.n_layer} layers, n_embd {m.n_embd}, "
        f"context {m.block_size}, vocab {m.vocab_size}, {cfg.precision.name}",
        f"batch: micro {b.micro_batch_size} x accumulation {b.gradient_accumulation_steps} x data-parallel "
        f"{b.data_parallel_size} = {tbs} sequences per step",
        f"tokens: {tbs * m.block_size:,} per step, {tbs * m.block_size * cfg.schedule.max_steps:,} in "
        f"{cfg.schedule.max_steps:,} steps",
        "",
        "DeepSpeed JSON (rendered):",
        json.dumps(render_deepspeed(cfg), indent=2),
        "",
        f"Memory per rank in GB, world size {world}; device memory {_gb(device_gb)} GB ({to.device_src}); "
        f"host memory {_gb(to.host_gb)} GB a node.",
        "Model states by the ZeRO paper (see `pretrain/cluster/plan.py`); DeepSpeed's estimate assumes 16-bit "
        "training (2 + 18 bytes/param), gives host memory per node, and does not model stage 0.",
    ]
    header = (
        "stage  offload            params  grads  optim   host | states  activ  work | device total"
        " | DS device  DS host/node | comm/step | fits | host fits"
    )
    lines += [header, "-" * len(header)]
    chosen = (cfg.zero.stage, cfg.zero.offload_optimizer, cfg.zero.offload_param)
    for p in plan_stages(
        cfg, world, device_gb=device_gb, gpus_per_node=to.ranks_per_node, host_gb=to.host_gb
    ):
        mark = "*" if (p.stage, p.offload != "none", p.offload == "optimizer+params") == chosen else " "
        lines.append(
            f"{mark}{p.stage:<5} {p.offload:<17} {_gb(p.params_gb):>7} {_gb(p.grads_gb):>6} "
            f"{_gb(p.optimizer_gb):>6} {_gb(p.host_gb):>6} | {_gb(p.model_states_gb):>6} "
            f"{_gb(p.activations_gb):>6} {_gb(p.working_gb):>5} | {_gb(p.device_total_gb):>12} | "
            f"{_gb(p.ds_device_gb):>9} {_gb(p.ds_host_gb):>13} | {_gb(p.comm_gb_per_step):>9} | "
            f"{_yes(p.fits):>4} | {_yes(p.host_fits)}"
        )
    lines += [
        "* this config. activ: activations of one micro batch "
        f"({'with' if m.activation_checkpointing else 'without'} activation checkpointing). work: DeepSpeed's "
        "gradient reduction buffers (and stage 3's gathered largest layer). comm: what each rank sends per optimizer step (2Ψ stages 0-2, 3Ψ "
        "stage 3, per micro step where the stage reduces each one). host fits: the offloaded states of "
        "a node's ranks in its host memory."
    ]
    if rates is not None:
        lines += ["", *render_times(cfg, world, rates)]
    return "\n".join(lines)


def _yes(x: bool | None) -> str:
    return "-" if x is None else "yes" if x else "NO"


def step_times(cfg: RunConfig, world: int, rates: Rates) -> list[StepTime]:
    """`predict_step` for every stage and offload that `plan_stages` lists."""
    return [
        predict_step(cfg, world, stage=stage, offload_optimizer=off, offload_param=par, rates=rates)
        for stage, off, par in VARIANTS
    ]


def render_times(cfg: RunConfig, world: int, rates: Rates) -> list[str]:
    m, b = cfg.model, cfg.batch
    total_tokens = b.sequences * m.block_size * cfg.schedule.max_steps
    src = rates.sources
    lines = [
        f"Time per step, world size {world}: peak {rates.peak_tflops:.3g} TFLOP/s a rank ({src['peak']}); "
        f"MFU of forward+backward {rates.mfu:.2f} ({src['mfu']}); all-reduce bus bandwidth "
        f"{rates.busbw / 1e9:.3g} GB/s ({src['busbw']}); optimizer {rates.optimizer_s_per_param * 1e9:.3g} ns "
        f"a parameter, {rates.host_optimizer_s_per_param * 1e9:.3g} on the host ({src['optimizer']}).",
    ]
    header = "ZeRO    offload            compute   comm  exposed  optimizer |   step s |    tokens/s | days"
    lines += [header, "-" * len(header)]
    chosen = (cfg.zero.stage, cfg.zero.offload_optimizer, cfg.zero.offload_param)
    for t in step_times(cfg, world, rates):
        mark = "*" if (t.stage, t.offload != "none", t.offload == "optimizer+params") == chosen else " "
        lines.append(
            f"{mark}ZeRO-{t.stage:<2} {t.offload:<17} {t.compute_s:>8.3g} {t.comm_s:>6.3g} {t.exposed_comm_s:>8.3g} "
            f"{t.optimizer_s:>10.3g} | {t.step_s:>8.3g} | {t.tokens_per_s:>11,.0f} | {t.days:.3g}"
        )
    lines.append(
        f"days: to train schedule.max_steps = {cfg.schedule.max_steps:,} steps ({total_tokens:,} tokens). "
        "Seconds per optimizer step; exposed: the communication compute does not hide."
    )
    return lines


def plan_json(cfg: RunConfig, to: Target, rates: Rates | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "params": analytic_num_params(cfg.model),
        "world_size": to.world,
        "device_gb": to.device_gb,
        "host_gb": to.host_gb,
        "stages": [
            asdict(p)
            for p in plan_stages(
                cfg, to.world, device_gb=to.device_gb, gpus_per_node=to.ranks_per_node, host_gb=to.host_gb
            )
        ],
    }
    if rates is not None:
        out["rates"] = asdict(rates)
        out["step_times"] = [asdict(t) for t in step_times(cfg, to.world, rates)]
    return out
