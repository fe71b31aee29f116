"""The rates a step's time is predicted from: a device's peak, MFU, bus bandwidth, optimizer cost.

Flags come first, then a previous run's metrics (`--from-run`: its forward/backward and optimizer
phase times, less the communication predicted for its own config), preflight's measured bus
bandwidth, this machine's device; stated assumptions last, each source named in `Rates.sources`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch

from pretrain.cluster.hardware import GPU_PEAK_TFLOPS, device_peak_tflops, gpu_peak_tflops
from pretrain.config.engine_sections import PrecisionConfig
from pretrain.config.layout import Layout, layout_of
from pretrain.config.loading import load_file
from pretrain.config.tree import RunConfig, analytic_num_params, validate
from pretrain.errors import ConfigError, DataError
from pretrain.files import read_csv
from pretrain.plan.evidence import DATA, MODEL, default_efficiency, gpu_class, layout_kind
from pretrain.plan.layout import recomputes, stage_shares
from pretrain.plan.timing import Rates, core_share, exposed_seconds, group_busbw, stage_times

# Assumed when neither a flag, a previous run nor preflight gives them.
ASSUMED_MFU = 0.4  # a GPU outside `evidence.FWD_BWD_EFFICIENCY`, or a CPU
ASSUMED_BUSBW = {"cuda": 100e9, "cuda-multinode": 20e9, "cpu": 1e9}  # bytes/s: NVLink, IB, gloo on loopback
# All-reduce bus bandwidth (nccl-tests' busbw) within a node and across nodes, by GPU class: NVLink 3
# (DGX A100: 600 GB/s a GPU both ways; nccl-tests' all_reduce reaches about 230 GB/s) and one HDR
# InfiniBand NIC of 200 Gb/s (25 GB/s) a GPU; NVLink 4 (900 GB/s) and NDR 400 Gb/s (50 GB/s) a GPU.
ASSUMED_GPU_BUSBW = {"A100": (230e9, 20e9), "H100": (450e9, 40e9)}
ASSUMED_OPTIMIZER_S = {"cuda": 2e-11, "cpu": 2e-9}  # per parameter: 32 bytes at 1.6 TB/s; a CPU core
ASSUMED_HOST_OPTIMIZER_S = 1e-9  # DeepSpeedCPUAdam per parameter, a few cores per rank
# Host <-> GPU copies under offload, bytes/s a GPU: PCIe Gen4 x16 moves 32 GB/s a direction, about 25
# of it in pinned copies; each GPU assumed on a link of its own (a DGX A100's pair of GPUs a PCIe
# switch would halve it where both copy at once).
ASSUMED_PCIE_BW = 25e9
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
    peak, src["peak"] = _peak(cfg, ranks_per_node, device=device, device_src=device_src, given=peak_tflops)
    multinode = world > ranks_per_node
    busbw, src["busbw"] = _busbw(cfg, world, kind, gpu, multinode=multinode, given=busbw_gbs)
    node_busbw, src["node_busbw"] = _node_busbw(busbw, kind, gpu, multinode=multinode, given=node_busbw_gbs)
    layout, n = layout_of(cfg, world), analytic_num_params(cfg.model)
    efficiency, src["mfu"] = default_efficiency(gpu, n, layout_kind(layout.tensor, layout.pipeline)) or (
        ASSUMED_MFU,
        "assumed",
    )
    by_kind = {k: e[0] for k in (DATA, MODEL) if (e := default_efficiency(gpu, n, k))}  # for other layouts
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
        pcie_bw=None if kind == "cpu" else ASSUMED_PCIE_BW,
        mfu_by_layout=by_kind or None,
    )
    src["optimizer"] = "assumed"
    mfus = [_calibrate(rates, run_dir) for run_dir in from_runs or []]  # and each the optimizer where it ran
    if mfus:
        rates.mfu, rates.mfu_by_layout = statistics.fmean(mfus), None
        rates.sources["mfu"] = "; ".join(f"{r}: forward+backward" for r in from_runs or [])
    if mfu is not None:
        rates.mfu, rates.mfu_by_layout, src["mfu"] = mfu, None, "--mfu"
    return rates


def rates_for_layout(rates: Rates, tensor: int, pipeline: int) -> Rates:
    """`rates` for another layout of the same model and GPUs: its kind's efficiency where the MFU is the
    published runs' default (`Rates.mfu_by_layout`), the same rates where a flag or a run gave it."""
    kind = layout_kind(tensor, pipeline)
    if not rates.mfu_by_layout or kind not in rates.mfu_by_layout:
        return rates
    return dataclasses.replace(rates, mfu=rates.mfu_by_layout[kind])


def _peak(
    cfg: RunConfig, ranks_per_node: int, *, device: str | None, device_src: str, given: float | None
) -> tuple[float, str]:
    """One rank's device peak in TFLOP/s and where it came from: --peak-tflops, the named device's
    datasheet, logging.peak_tflops, else this machine's device (`_local_peak`)."""
    if given is not None:
        return given, "--peak-tflops"
    if device not in (None, "cpu"):
        table = gpu_peak_tflops(str(device), cfg.precision.name, tf32=cfg.precision.tf32)
        named_by = f"{device_src}: device={device}" if device_src else f"--gpu {device}"
        if table is None:
            raise ConfigError([f"{named_by}: not in the peak table ({', '.join(GPU_PEAK_TFLOPS)})"], "plan")
        return table, f"{device} datasheet{_tf32_said(precision=cfg.precision)}" + (
            f", {device_src}" if device_src else ""
        )
    if cfg.logging.peak_tflops is not None:
        return cfg.logging.peak_tflops, "logging.peak_tflops"
    return _local_peak(cfg, ranks_per_node)


def _local_peak(cfg: RunConfig, ranks_per_node: int) -> tuple[float, str]:
    """This machine's device peak for one of `ranks_per_node` ranks (they share a CPU's cores):
    the same resolver as the MFU that `train` logs, so both read one number for one machine."""
    if torch.cuda.is_available():  # the config's TF32 switch, not this process's
        name = torch.cuda.get_device_name(0)
        peak = gpu_peak_tflops(name, cfg.precision.name, tf32=cfg.precision.tf32)
        source = (
            f"{name} datasheet{_tf32_said(precision=cfg.precision)}"
            if peak
            else f"{name}: unknown peak, set logging.peak_tflops"
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


def _tf32_said(*, precision: PrecisionConfig) -> str:
    """How a GPU's datasheet peak was read for fp32: the TF32 tensor cores' (precision.tf32) or not."""
    if precision.name != "fp32":
        return ""
    return ", TF32 (precision.tf32)" if precision.tf32 else ", fp32 without TF32 (precision.tf32=false)"


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


def _node_busbw(
    busbw: float, kind: str, gpu: str | None, *, multinode: bool, given: float | None
) -> tuple[float, str]:
    """The all-reduce bus bandwidth within a node, bytes/s, and where it came from: --node-busbw, the
    world's (`busbw`) on one node, else assumed for the GPU's NVLink or the device kind."""
    if given is not None:
        return given * 1e9, "--node-busbw"
    if not multinode:
        return busbw, "the world's, on one node"
    if gpu in ASSUMED_GPU_BUSBW:
        return ASSUMED_GPU_BUSBW[gpu][0], f"assumed for {gpu} NVLink (pass --node-busbw)"
    return ASSUMED_BUSBW[kind], "assumed (pass --node-busbw)"


def _calibrate(rates: Rates, run_dir: Path) -> float:
    """The MFU of a previous run's forward+backward, and (set in `rates`) its optimizer's cost a
    parameter, from its phase times (medians past its first logged step), on the same peak and bus
    bandwidth as the prediction."""
    run, fwd_bwd, optimizer = _phase_times(run_dir)
    m, b, z = run.model, run.batch, run.zero
    layout = Layout(run.parallel.tensor, run.parallel.pipeline, b.data_parallel_size or 1)
    shares = stage_shares(run, layout)
    heaviest = max(shares, key=lambda sh: sh.params)
    # The measured forward+backward holds the slowest stage's compute and model-parallel
    # communication, stretched by the bubble, and the ZeRO communication compute did not hide: take
    # them out. What is hidden depends on the compute it is looking for, hence a few rounds.
    slowest = max(range(len(shares)), key=lambda i: shares[i].flops_per_token)
    st = stage_times(run, layout, rates)[slowest]
    stretch = 1 + (layout.pipeline - 1) / b.gradient_accumulation_steps
    # A run whose ranks outnumbered the cores computed at its share of a core: take that out too.
    share = core_share(rates, min(layout.world, rates.ranks_per_node or layout.world))
    compute = fwd_bwd
    for _ in range(8):
        exposed = exposed_seconds(
            run, heaviest.params, stage=z.stage, world=layout.data,
            busbw=group_busbw(rates, layout.tensor * layout.data), compute_s=compute,
            recompute=bool(recomputes(run, layout.pipeline)),
        )  # fmt: skip
        compute = max((fwd_bwd - exposed) * share / stretch - st.tp_comm - st.pp_comm, 1e-9)
    tokens = b.micro_batch_size * b.gradient_accumulation_steps * m.block_size
    per_param = optimizer * share / (heaviest.params if z.stage == 0 else heaviest.params / layout.data)
    if z.offload_optimizer:
        rates.host_optimizer_s_per_param = per_param
    else:
        rates.optimizer_s_per_param = per_param
    rates.sources["optimizer"] = f"{run_dir}: optimizer {optimizer * 1e3:.1f} ms a step"
    return shares[slowest].flops_per_token * tokens / compute / (rates.peak_tflops * 1e12)


def _phase_times(run_dir: Path) -> tuple[RunConfig, float, float]:
    """A previous run's config and the medians of its forward+backward and optimizer seconds a step,
    past its first logged step."""
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
    return run, fwd_bwd, optimizer
