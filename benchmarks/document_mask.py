"""The document mask's memory and a step's time, the dense mask against FlexAttention's block mask.

    .venv/bin/python benchmarks/document_mask.py [--block-size 4096] [--micro-batch 8] [--no-compile]

One process, one micro batch of packed documents (random tokens, an end-of-text token about every
300 tokens), both paths side by side (model/gpt.py's `document_path`):
- the mask: the bytes it keeps for backward (the sum of its tensors' sizes: the dense (B, 1, T, T)
  in fp32 and in bf16; the BlockMask's int32 block counts and indices and the (B, T) document starts
  its rule reads), the peak its build allocates (`built`: the resident peak on the CPU,
  `torch.cuda.max_memory_allocated` on CUDA) and the build's time; the block mask built eagerly and,
  as the CUDA path builds it, under torch.compile (`--no-compile`: eagerly only);
- a step of a 2-layer, 4-head, 128-wide GPT at T, of 256 tokens: forward and backward on each path where it runs
  (on the CPU torch 2.13's FlexAttention has no backward, so there the flex path's forward alone,
  eagerly, which computes the whole score matrix, against the dense path's forward), medians of
  `--rounds`. On the CPU fp32, on CUDA bf16;
- one attention call alone (the step's 4 heads of 32), forward: SDPA with the dense mask, eager
  FlexAttention and, unless `--no-compile`, FlexAttention under torch.compile with the block mask built
  outside its graph (on the CPU Inductor's C++ FlexAttention template runs forward only, and fails to
  lower when the block mask is built inside the same graph: NoValidChoicesError).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pretrain.config.tree import ModelConfig  # noqa: E402
from pretrain.training.model.gpt import (  # noqa: E402
    GPT,
    document_block_mask,
    document_mask,
    document_positions,
)

EOT, VOCAB = 255, 256  # a byte-sized vocabulary: the step's time is its attention's, not its head's
MiB = 2**20


def packed(batch: int, block: int, device: torch.device) -> torch.Tensor:
    """Token ids (batch, block) with an end-of-text token about every 300 tokens."""
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, EOT, (batch, block), generator=g)
    idx[torch.rand(batch, block, generator=g) < 1 / 300] = EOT
    return idx.to(device)


def kept_bytes(mask: torch.Tensor | BlockMask) -> int:
    """The bytes a mask keeps: its tensors, and for a BlockMask the tensors its rule reads."""
    if isinstance(mask, torch.Tensor):
        return mask.nbytes
    tensors = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
    tensors += [
        c.cell_contents for c in mask.mask_mod.__closure__ or () if isinstance(c.cell_contents, torch.Tensor)
    ]
    return sum(t.nbytes for t in tensors)


def built(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int, float]:
    """fn()'s result, the peak bytes it allocated over what was allocated before, and its seconds. On
    CUDA torch's allocator counts; on the CPU the process's peak resident memory (VmHWM, reset through
    /proc/self/clear_refs) over its resident memory before: the transients are far over glibc's mmap
    threshold, so they are mapped for the call and unmapped when freed."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - before, time.perf_counter() - start
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = resident("VmRSS")
    start = time.perf_counter()
    out = fn()
    return out, resident("VmHWM") - before, time.perf_counter() - start


def resident(key: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    line = next(li for li in Path("/proc/self/status").read_text().splitlines() if li.startswith(key + ":"))
    return int(line.split()[1]) * 1024


def mask_table(args: argparse.Namespace, device: torch.device) -> None:
    pos = document_positions(packed(args.micro_batch, args.block_size, device), EOT)
    rows: list[tuple[str, Callable[[], Any]]] = [
        ("dense fp32", lambda: document_mask(pos, torch.float32)),
        ("dense bf16", lambda: document_mask(pos, torch.bfloat16)),
        ("flex, eager build", lambda: document_block_mask(pos, compiled=False)),
    ]
    if args.compile:
        first = time.perf_counter()
        document_block_mask(pos, compiled=True)  # the compile, once a process
        print(f"(create_block_mask compiled in {time.perf_counter() - first:.1f} s)")
        rows.append(("flex, compiled build", lambda: document_block_mask(pos, compiled=True)))
    print(f"\nThe mask of one micro batch, B={args.micro_batch}, T={args.block_size}, on {device.type}:")
    print(f"{'path':<22}{'kept for backward':>20}{'peak while built':>20}{'build s':>10}")
    for name, fn in rows:
        mask, peak, seconds = built(fn, device)
        kept = kept_bytes(mask)
        print(f"{name:<22}{size(kept):>20}{size(peak):>20}{seconds:>10.3f}")
        del mask


def size(n: int) -> str:
    return f"{n / MiB:,.2f} MiB" if n >= MiB else f"{n / 1024:,.1f} KiB"


def step_table(args: argparse.Namespace, device: torch.device) -> None:
    cuda = device.type == "cuda"
    cfg = ModelConfig.model_validate(
        {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": args.block_size, "vocab_size": VOCAB,
         "document_eot": EOT}
    )  # fmt: skip
    dtype = torch.bfloat16 if cuda else torch.float32
    idx = packed(args.step_batch, args.block_size, device)
    targets = idx.roll(-1, dims=1)
    dense = GPT(cfg, document_attention="dense").to(device, dtype)
    flex = GPT(cfg, document_attention="flex").to(device, dtype)
    flex.load_state_dict(dense.state_dict())
    backward = cuda  # FlexAttention has no backward on the CPU in torch 2.13

    def step(gpt: GPT) -> Callable[[], float]:
        def run() -> float:
            if backward:
                loss = gpt(idx, targets)[1]
                assert loss is not None
                loss.backward()
            else:
                with torch.no_grad():
                    loss = gpt(idx, targets)[1]
                    assert loss is not None
            if cuda:
                torch.cuda.synchronize()
            return float(loss)

        return run

    runs = {"dense": step(dense), "flex": step(flex)}
    losses = {name: run() for name, run in runs.items()}  # warm-up (and on CUDA FlexAttention's compile)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):  # alternating, so the machine's load falls on both alike
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    what = "forward + backward" if backward else "forward only (no FlexAttention backward on the CPU)"
    print(f"\nA step of a 2-layer, 4-head, 128-wide GPT, B={args.step_batch}, T={args.block_size}, {dtype}, "
          f"{what}, median of {args.rounds}:")  # fmt: skip
    for name in runs:
        print(f"{name:<8}{statistics.median(times[name]):>10.3f} s   loss {losses[name]:.6f}")


def attention_table(args: argparse.Namespace, device: torch.device) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pos = document_positions(packed(args.step_batch, args.block_size, device), EOT)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(args.step_batch, 4, args.block_size, 32, generator=g).to(device, dtype) for _ in "qkv"
    )
    dense, block = document_mask(pos, dtype), document_block_mask(pos)
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "SDPA, dense mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense),
        "flex, eager": lambda: flex_attention(q, k, v, block_mask=block),
    }
    if args.compile:
        compiled = torch.compile(flex_attention)
        runs["flex, compiled"] = lambda: compiled(q, k, v, block_mask=block)
    want = runs["SDPA, dense mask"]()
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.no_grad():
        for name, run in runs.items():  # warm-up, the compile, and the same output
            assert torch.allclose(run(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-5), name
        for _ in range(args.rounds):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[name].append(time.perf_counter() - start)
    print(f"\nOne attention call, forward, B={args.step_batch}, 4 heads of 32, T={args.block_size}, {dtype}, "
          f"median of {args.rounds} (block sparsity {block.sparsity():.1f}%):")  # fmt: skip
    for name in runs:
        print(f"{name:<20}{statistics.median(times[name]):>10.4f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-size", type=int, default=4096, help="T, the tokens of a sequence.")
    ap.add_argument("--micro-batch", type=int, default=8, help="B of the mask's table.")
    ap.add_argument("--step-batch", type=int, default=1, help="B of the step's table.")
    ap.add_argument("--rounds", type=int, default=3, help="Timed steps of each path.")
    ap.add_argument(
        "--no-compile", dest="compile", action="store_false", help="Build the block mask eagerly only."
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (CPU).")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}")
    mask_table(args, device)
    step_table(args, device)
    attention_table(args, device)


if __name__ == "__main__":
    main()
