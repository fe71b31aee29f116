"""The device's peak FLOP/s (and a GPU's memory by name): the one answer `train` (the denominator of MFU) and `plan` (a step's
compute time) both use for a machine.

A GPU's peak comes from the vendors' datasheets; a CPU's is the larger of a measured matmul rate
(cached per CPU model, threads, dtype and torch version) and the theoretical FMA peak read from
/proc/cpuinfo, so MFU never reads above 100% on a loaded machine. `logging.peak_tflops` overrides
both.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

import torch

from pretrain.files import write_atomic

# Dense (no sparsity) tensor-core peaks per GPU from the vendors' datasheets, in TFLOP/s.
# fp32 is the plain fp32 rate; with TF32 matmuls allowed the tf32 rate applies.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
}


def set_tf32(on: bool) -> None:
    """Let fp32 matmuls and convolutions on CUDA use TF32 (precision.tf32), through the one API this
    torch has: torch 2.9's `fp32_precision` ("tf32" or "ieee"), or the older `allow_tf32` switches
    (mixing the two raises in torch 2.9 and later)."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = cudnn.fp32_precision = "tf32" if on else "ieee"
    else:
        matmul.allow_tf32 = cudnn.allow_tf32 = on


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA run as TF32 (read through the API `set_tf32` sets)."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        return matmul.fp32_precision == "tf32"
    return bool(matmul.allow_tf32)


def gpu_peak_tflops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The table's peak for a CUDA device name (e.g. 'NVIDIA H100 80GB HBM3'), or None if unknown."""
    kind = "tf32" if precision == "fp32" and tf32 else precision
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):  # 'H100 PCIe' before 'H100'
        if all(part in device_name for part in key.split()):
            return GPU_PEAK_TFLOPS[key][kind]
    return None


# Memory of the GPUs that come in one size only, in GB as the datasheets give it; the A100 comes in
# 40 and 80 GB, so its name must say which (e.g. `A100-80GB`).
GPU_MEMORY_GB: dict[str, float] = {"H100 PCIe": 80.0, "H100": 80.0, "H200": 141.0}


def gpu_memory_gb(device_name: str) -> float | None:
    """A GPU's memory from its name: the size it states (`A100-80GB`, `NVIDIA A100 80GB PCIe`), else
    the table's for a GPU made in one size; None when the name leaves it open."""
    stated = re.search(r"(\d+(?:\.\d+)?)\s*GB", device_name, re.IGNORECASE)
    if stated:
        return float(stated.group(1))
    for key in sorted(GPU_MEMORY_GB, key=len, reverse=True):
        if all(part in device_name for part in key.split()):
            return GPU_MEMORY_GB[key]
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("PRETRAIN_CACHE_DIR", Path.home() / ".cache" / "pretrain"))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_tflops(dtype: torch.dtype = torch.float32, probe_s: float = 0.3) -> float:
    """This process's matmul rate on the CPU (its torch thread count), measured once and cached.

    A square GEMM of a fixed size (1024 in fp32, 512 in 16-bit types, which most CPUs run far
    slower) is timed repeatedly for `probe_s` seconds, at least 3 times; the best rate is the peak,
    the least disturbed by other load. The cache is keyed by CPU model, thread count, dtype and
    torch version; delete the file to probe again. On a loaded machine the probe reads low: MFU
    takes the larger of it and `cpu_fma_peak_tflops` (see `device_peak_tflops`).
    """
    threads = torch.get_num_threads()
    key = f"{_cpu_name()} | {threads} threads | {dtype} | torch {torch.__version__}"
    path = _cache_dir() / "cpu_peak_flops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return float(cache[key])
    n = 1024 if dtype == torch.float32 else 512
    # Its own generator: drawing from the global one would shift the dropout masks of the run
    # that probes (the first on a machine) against every later, cached one.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g).to(dtype), torch.randn(n, n, generator=g).to(dtype)
    tflops = gemm_tflops(a, b, probe_s)
    cache[key] = tflops
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(cache, indent=1) + "\n")  # ranks of other runs may read it meanwhile
    return tflops


def gemm_tflops(a: torch.Tensor, b: torch.Tensor, seconds: float, windows: int = 5) -> float:
    """The best rate of `a @ b` over `windows` windows of `seconds / windows` each (at least 3 GEMMs
    a window), with a pause between windows: the best window is the least disturbed by other load."""
    n, k, m = a.shape[0], a.shape[1], b.shape[1]
    torch.mm(a, b)  # warm up
    rate = 0.0
    for w in range(windows):
        if w:
            time.sleep(min(0.05, seconds / windows))  # let a burst of other load pass
        deadline, reps = time.perf_counter() + seconds / windows, 0
        while reps < 3 or time.perf_counter() < deadline:
            t = time.perf_counter()
            torch.mm(a, b)
            rate = max(rate, 2 * n * k * m / (time.perf_counter() - t))
            reps += 1
    return rate / 1e12


def _cpu_flags_and_mhz(cpuinfo: str | None) -> tuple[set[str], float]:
    """The first CPU's flags and clock in /proc/cpuinfo (or the text given); empty and 0 if unread."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set(), 0.0
    flags: set[str] = set()
    mhz = 0.0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "cpu MHz" and not mhz:
            mhz = float(value) if value.strip().replace(".", "", 1).isdigit() else 0.0
    return flags, mhz


def cpu_native_bf16(cpuinfo: str | None = None) -> str | None:
    """The CPU's bf16 matrix instructions (`amx_bf16`, `avx512_bf16`), which oneDNN uses for bf16
    matmuls at two or more times the fp32 rate; None if it has neither (or /proc/cpuinfo says not)."""
    flags, _ = _cpu_flags_and_mhz(cpuinfo)
    return next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), None)


# /proc/cpuinfo's "cpu MHz" is the clock now (in a VM, often the host's base clock), and cores boost
# above it under load: a 2-core AVX2 VM here ran a GEMM at 2.52 GHz x 32 FLOPs a cycle against a
# "cpu MHz" of 2445. Where the kernel does not give the boost clock (cpufreq's cpuinfo_max_freq,
# absent in most VMs), the bound allows this much above it: server CPUs boost to at most about 1.5x
# their base clock.
BOOST_HEADROOM = 1.5


def _boost_mhz(mhz: float) -> float:
    """This machine's boost clock in MHz: cpufreq's maximum, else `mhz` with BOOST_HEADROOM."""
    try:
        khz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text())
    except (OSError, ValueError):
        return mhz * BOOST_HEADROOM
    return max(mhz, khz / 1000)


def cpu_fma_peak_tflops(
    threads: int, cpuinfo: str | None = None, dtype: torch.dtype = torch.float32
) -> float | None:
    """The CPU's theoretical peak in `dtype`: cores x clock x FLOPs a cycle, from the flags.

    fp32: two FMA units of the widest vector width listed (AVX-512: 16 lanes, AVX2 + FMA: 8).
    bf16: AMX tiles (`amx_bf16`: 1024 multiply-adds a cycle), else AVX-512 BF16 dot products
    (`avx512_bf16`: two bf16 products per fp32 lane, twice fp32), else the fp32 peak (the CPU
    computes bf16 in fp32). fp16 the same with `amx_fp16` and `avx512_fp16`. An upper bound (some
    cores have one FMA unit, or split AVX-512; on this machine the clock is the boost clock, see
    `_boost_mhz`), so MFU against it never reads above 100%, however loaded the machine. None if
    /proc/cpuinfo does not say."""
    live = cpuinfo is None
    flags, mhz = _cpu_flags_and_mhz(cpuinfo)
    if live and mhz > 0:
        mhz = _boost_mhz(mhz)
    lanes = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 4 if "sse2" in flags else 0
    if not (lanes and mhz > 0):
        return None
    per_cycle = 2 * 2 * lanes  # 2 units x (multiply + add) x lanes
    half = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}
    if dtype in half:
        amx, avx512 = half[dtype]
        if amx in flags and "amx_tile" in flags:
            per_cycle = 2 * 1024  # one AMX unit: 1024 multiply-adds a cycle
        elif avx512 in flags:
            per_cycle *= 2
    cores = min(threads, os.cpu_count() or threads)
    return cores * mhz * 1e6 * per_cycle / 1e12


def _threads(n: int) -> str:
    return f"{n} thread{'s' if n != 1 else ''}"


def device_peak_tflops(
    device: torch.device, precision: str, override: float | None = None
) -> tuple[float | None, str]:
    """Peak TFLOP/s of one rank's device for MFU, and where the number came from."""
    if override is not None:
        return override, "logging.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, precision, tf32=tf32_enabled())
        return peak, (f"{name} datasheet" if peak else f"{name}: unknown peak, set logging.peak_tflops")
    if device.type == "cpu":
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        threads = torch.get_num_threads()
        probed = cpu_peak_tflops(dtype)
        fma = cpu_fma_peak_tflops(threads, dtype=dtype)
        if fma is not None and fma >= probed:
            probe = f"a matmul probe ran at {probed:.3g} TFLOP/s"
            return fma, f"CPU {precision} FMA peak, {_threads(threads)} ({probe})"
        return probed, f"CPU matmul probe, {_threads(threads)}"
    return None, f"{device.type}: unknown peak, set logging.peak_tflops"
