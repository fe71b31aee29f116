"""The checks of benchmarks/gpu_check.sh: the CUDA path end to end on the GPUs of one node, through the
project's own commands (`pretrain data prepare`, `train --nproc-per-node`, `preflight`, `export`,
`plan --json`), one line a check (`PASS name: figures`, `FAIL name: reason`, `SKIP name: reason`),
then a summary; exit status 1 if any check failed, 2 if none could start.

    benchmarks/gpu_check.sh                          # every check, on every visible GPU
    benchmarks/gpu_check.sh --gpus 2                 # on the first 2 only, as on a 2-GPU machine
    benchmarks/gpu_check.sh --only fp32-tp2,export   # some checks (and the runs they compare with)
    benchmarks/gpu_check.sh --list --gpus 2          # what would run, and each skip's reason
    benchmarks/gpu_check.sh --cpu                    # dry run: gloo ranks on the CPU, tiny shapes

The checks (GPUs needed; each compares with the figure or tolerance named):

- ops (1): DeepSpeed's FusedAdam and CPUAdam are built into DeepSpeed (setup.sh, PRETRAIN_BUILD_OPS),
  as preflight reports them (`probe.check_ops`), and each takes an Adam step with the torch
  extensions directory pointed at an empty one: nothing is JIT-built.
- nccl (2, takes all): `pretrain preflight` on `localhost slots=N`, its timed NCCL all-reduce
  (256 MiB) correct and its bus bandwidth at least MIN_BUSBW_GBS (default 5 GB/s, under half of what
  one PCIe 3 x16 link carries, so that only a transport far below the node's fails it; the figure
  itself is the record).
- throughput (1): GPT-2 124M, bf16, ZeRO-2, torch.compile, STEPS (50) steps of MICRO (16) on one GPU:
  tokens/s, MFU and peak memory (the runs of the other checks wait, so the figures are its own).
- memory (2, takes all): GPT-2 124M, bf16, ZeRO-2 on N ranks for 10 steps: each rank's
  torch.cuda.max_memory_allocated (ranks.csv) against `pretrain plan --json`'s device total for the
  same config and world size, within a factor MEM_FACTOR (default 1.5) either way.
- fp32-dp2, fp32-tp2, fp32-pp2 (2), fp32-tp2pp2 (4): the `tiny` preset (2 blocks, 2 heads, so a tensor
  rank holds one head and a stage one block), fp32 with precision.tf32=false, ZeRO-1, 16 sequences a
  step (the accumulation derived for each layout), 20 steps; every step's loss within FP32_TOL of the
  1-rank run's.
- bf16-dp2 (2): bf16 with the gradients summed in fp32 (precision.grad_accum_dtype=fp32), ZeRO-1, 128
  sequences a step of micro batches of 2 (64 micro batches on 1 rank, 32 a rank on 2), 20 steps; every
  step's loss within BF16_REL_TOL of the 1-rank bf16 run's.
- resume-tp2, resume-pp2 (2): 12 steps with dropout 0.1 (so the RNG states matter) and a checkpoint at
  6; the same run resumed from step 6 into a new run dir; steps 7-12 within FP32_TOL of the
  uninterrupted run's (the figure says whether they were bit-exact as logged).
- export (2): `pretrain export` of the fp32-tp2 run's last checkpoint (its shards merged); transformers'
  model from the export's hf/ directory gives the checkpoint's logits within LOGIT_TOL on 3 blocks of
  the corpus's last tenth, and its tokenizer the same ids.

Tolerances:

- FP32_TOL = 1e-4 on a loss of about 4 (2.5e-5 of it). The CPU tests hold the layouts within 1e-5
  (tests/test_parallel.py: the same fp32 arithmetic in another order moves the last bits of a step,
  1e-7 relative; 20 Adam steps carry that to 5e-7). On a GPU, cuBLAS picks other kernels for a
  tensor rank's half-width matrices, and SDPA's fp32 backward and NCCL sum in other orders, so the
  reordering is several times that; metrics.csv also keeps 6 significant digits (5e-6 at a loss of 4).
  1e-4 leaves a factor of 10 over those and stays 100 times under what a wrong shard, head, batch or
  restored state does (1e-2 at the first affected step).
- BF16_REL_TOL = 2**-7 of the 1-rank loss: one bf16 ulp at the loss's magnitude (bf16's 8-bit
  significand spaces numbers 2**-8 to 2**-7 of their value apart), i.e. the two runs' losses are not
  told apart in bf16. With the gradients summed in fp32 on both sides, what differs is DP2's reduction
  of bf16 gradients; a wrong split of the batch or a micro batch lost moves the losses by more.
- LOGIT_TOL = 1e-4 on logits of order 1: fp32 with TF32 off, transformers' layers (GPT-2's
  Conv1D, its attention) run other kernels than ours, a few fp32 ulps a layer (the CPU test holds
  1e-5); a misnamed, transposed or missing tensor moves them by more than 1e-1.

`--cpu` runs every check's commands and comparisons on gloo ranks (DS_ACCELERATOR=cpu, 2 of them unless
--gpus says otherwise) with tiny shapes and few steps; `ops` and `memory` report what they found as
a SKIP (DeepSpeed's ops are prebuilt only under a CUDA torch; a CPU rank's peak RSS is not device
memory). Every command's output is in WORK/logs/NAME.log; WORK is kept when a check failed.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import csv
import difflib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
TEST_DATA = ROOT / "tests" / "data"

FP32_TOL = 1e-4
BF16_REL_TOL = 2.0**-7
LOGIT_TOL = 1e-4

# name -> GPUs it needs (`nccl` and `memory` take all there are)
NEEDS = {
    "ops": 1,
    "nccl": 2,
    "throughput": 1,
    "memory": 2,
    "fp32-dp2": 2,
    "fp32-tp2": 2,
    "fp32-pp2": 2,
    "fp32-tp2pp2": 4,
    "bf16-dp2": 2,
    "resume-tp2": 2,
    "resume-pp2": 2,
    "export": 2,
}
ALONE = ("ops", "nccl", "throughput", "memory")  # one at a time, before the others: their figures are records
ONE_RANK = "1 rank's"
FP32_LAYOUTS = {
    "fp32-dp2": [],
    "fp32-tp2": ["parallel.tensor=2"],
    "fp32-pp2": ["parallel.pipeline=2"],
    "fp32-tp2pp2": ["parallel.tensor=2", "parallel.pipeline=2"],
}


@dataclass(frozen=True)
class Sizes:
    """The shapes and lengths of the runs: the real ones on GPUs, tiny ones for the CPU dry run."""

    char_model: tuple[str, ...]  # overrides of the `tiny` preset's shape
    fp32: tuple[int, int, int]  # micro batch, global batch in sequences, steps
    bf16: tuple[int, int, int]
    resume: tuple[int, int]  # steps, the checkpoint resumed from
    gpt2_model: tuple[str, ...]  # overrides of `gpt2-124m`'s shape
    gpt2_name: str
    throughput: tuple[int, int]  # micro batch, steps
    memory: tuple[int, int]
    compile: bool
    timeout_s: float  # a run's, before it is stopped and its check fails (the throughput run: twice it)


def gpu_sizes() -> Sizes:
    return Sizes(
        char_model=(),
        fp32=(4, 16, 20),
        bf16=(2, 128, 20),
        resume=(12, 6),
        gpt2_model=(),
        gpt2_name="GPT-2 124M",
        throughput=(int(os.environ.get("MICRO", "16")), int(os.environ.get("STEPS", "50"))),
        memory=(8, 10),
        compile=True,
        timeout_s=300,
    )


CPU_SIZES = Sizes(
    char_model=("model.n_embd=32", "model.block_size=32"),
    fp32=(2, 8, 6),
    bf16=(1, 16, 4),
    resume=(6, 3),
    gpt2_model=("model.n_layer=2", "model.n_head=2", "model.n_embd=64", "model.block_size=64"),
    gpt2_name="GPT-2 of 2 blocks 64 wide",
    throughput=(2, 4),
    memory=(2, 3),
    compile=False,
    timeout_s=600,
)


class Failed(Exception):
    """A check's reason to fail, one line."""


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or SKIP
    text: str
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def line(self) -> str:
        return f"{self.status} {self.name}: {' '.join(self.text.split())}"


class Pool:
    """The devices, handed out k at a time in the order they are asked for (a 4-GPU run is not
    starved by 2-GPU ones) and given back when the command that held them ends."""

    def __init__(self, ids: list[str]) -> None:
        self.ids, self.free = ids, list(ids)
        self.cond = threading.Condition()
        self.queue: deque[object] = deque()

    @contextlib.contextmanager
    def take(self, k: int) -> Iterator[list[str]]:
        if k == 0:
            yield []
            return
        ticket = object()
        with self.cond:
            self.queue.append(ticket)
            self.cond.wait_for(lambda: self.queue[0] is ticket and len(self.free) >= k)
            self.queue.popleft()
            got, self.free = self.free[:k], self.free[k:]
            self.cond.notify_all()
        try:
            yield got
        finally:
            with self.cond:
                self.free = sorted(self.free + got, key=self.ids.index)
                self.cond.notify_all()


@dataclass
class Ctx:
    cpu: bool
    devices: list[str]  # CUDA_VISIBLE_DEVICES entries, or CPU rank slots
    work: Path
    sizes: Sizes
    corpus: str
    tokenizer: Path | None
    pool: Pool
    executor: cf.ThreadPoolExecutor
    runs: dict[str, cf.Future[Any]] = field(default_factory=dict)  # runs and datasets, started once
    lock: threading.Lock = field(default_factory=threading.Lock)

    def env(self, ids: list[str], extra: dict[str, str] | None = None) -> dict[str, str]:
        """A command's environment: this one's without a launcher's rank variables, on its devices."""
        launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in launcher}
        env["PYTHONUNBUFFERED"] = "1"
        if self.cpu or not ids:  # no GPU: hidden, so that a command meant for the CPU stays there
            env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        else:
            env.update(DS_ACCELERATOR="cuda", CUDA_VISIBLE_DEVICES=",".join(ids))
        return {**env, **(extra or {})}

    def command(
        self,
        name: str,
        argv: list[str],
        devices: int,
        timeout: float = 600,
        env: dict[str, str] | None = None,
        stdout: Path | None = None,
    ) -> str:
        """Run one command on `devices` devices from the pool, its output to WORK/logs/NAME.log (its
        stdout to `stdout` if given); that output, or Failed with its last line. Past `timeout` it gets
        SIGTERM (the supervisor passes it to the ranks, which save and stop), then SIGKILL."""
        log = self.work / "logs" / f"{name}.log"
        with self.pool.take(devices) as ids, log.open("w") as f:
            f.write(f"$ {shlex.join(argv)}\n")
            f.flush()
            out = stdout.open("w") if stdout else f
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env=self.env(ids, env),
                stdout=out,
                stderr=subprocess.STDOUT if out is f else f,
            )
            if out is not f:
                out.close()  # the child holds its own copy
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise Failed(f"{name}: timed out after {timeout:.0f} s (log {log})") from None
        text = log.read_text(errors="replace")
        if rc != 0:
            raise Failed(f"{name}: exit status {rc}: {last_line(text)} (log {log})")
        return text

    def pretrain(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "pretrain", *args]

    def data(self, kind: str) -> list[str]:
        """The data overrides of the `char` (tiny's) or `gpt2` (GPT-2 BPE) dataset, prepared once."""
        sets = [f"data.corpus={self.corpus}", f"data.dataset_dir={self.work / 'data' / kind}"]
        if kind == "gpt2":
            sets.append("data.tokenizer=gpt2")
            if self.tokenizer is not None:
                sets.append(f"data.tokenizer_path={self.tokenizer}")
        with self.lock:
            if f"data-{kind}" not in self.runs:
                preset = "gpt2-124m" if kind == "gpt2" else "tiny"
                argv = self.pretrain("data", "prepare", "--preset", preset, *sets_args(sets))
                self.runs[f"data-{kind}"] = self.executor.submit(self.command, f"data-{kind}", argv, 0)
            prepared = self.runs[f"data-{kind}"]
        prepared.result()
        return sets

    def train(
        self, name: str, ranks: int, preset: str, sets: list[str], resume: Path | None = None, slow: float = 1
    ) -> cf.Future[Path]:
        """`pretrain train --nproc-per-node RANKS` into WORK/runs/NAME, started once however many checks
        ask for it; its run dir."""

        def go() -> Path:
            kind = "gpt2" if preset.startswith("gpt2") else "char"
            run_dir = self.work / "runs" / name
            argv = self.pretrain(
                "train", "--nproc-per-node", str(ranks), "--preset", preset,
                *sets_args([*self.data(kind), *BASE, *sets, f"logging.run_dir={run_dir}"]),
                *(["--resume", str(resume)] if resume else []),
            )  # fmt: skip
            self.command(name, argv, ranks, timeout=self.sizes.timeout_s * slow)
            return run_dir

        with self.lock:
            if name not in self.runs:
                self.runs[name] = self.executor.submit(go)
            return self.runs[name]


BASE = [
    "logging.log_interval=1",
    "logging.sample_tokens=0",
    "logging.progress_bar=off",
    "logging.tensorboard=false",
]


def sets_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


def last_line(text: str) -> str:
    """The line that says what went wrong: the last non-empty one."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def probe_result(text: str) -> dict[str, Any]:
    """The JSON line a probe (`--ops-probe`, `--hf-logits`) printed last."""
    found = [ln for ln in text.splitlines() if ln.startswith("gpu_check-result: ")]
    if not found:
        raise Failed(f"the probe printed no result: {last_line(text)}")
    return dict(json.loads(found[-1].split(": ", 1)[1]))


# ---------------------------------------------------------------------------------------------
# What a run left behind, and how two runs compare


def metric_rows(run_dir: Path, name: str = "metrics.csv") -> list[dict[str, str]]:
    path = run_dir / name
    if not path.is_file():
        raise Failed(f"{path}: missing")
    with path.open() as f:
        return list(csv.DictReader(f))


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> training loss, from metrics.csv (logged every step, 6 significant digits)."""
    return {int(r["step"]): float(r["loss"]) for r in metric_rows(run_dir) if r.get("loss")}


def worst(got: dict[int, float], want: dict[int, float], relative: bool = False) -> tuple[float, int]:
    """The largest |got - want| over the steps (over |want| if `relative`), and its step; Failed if
    the runs did not log the same steps."""
    if not want or set(got) != set(want):
        raise Failed(f"logged steps {span(got)}, the run compared with logged {span(want)}")
    diff = {s: abs(got[s] - want[s]) / (abs(want[s]) if relative else 1.0) for s in want}
    step = max(diff, key=lambda s: diff[s])
    return diff[step], step


def agreement(diff: float, step: int, steps: dict[int, float], whose: str, of: str = "") -> str:
    """How close two runs' losses came, in words: equal as logged, or their largest difference."""
    if diff == 0:
        return f"losses equal to {whose} as logged (6 digits) over steps {span(steps)}"
    return f"losses within {diff:.1e}{of} of {whose} over steps {span(steps)} (the most at step {step})"


def plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def span(steps: dict[int, float]) -> str:
    return f"{min(steps)}-{max(steps)}" if steps else "none"


def step_dir(run_dir: Path, step: int | None = None) -> Path:
    """The run's checkpoint of `step` (default: its newest)."""
    found = {
        int(m.group(1)): p
        for p in (run_dir / "checkpoints").glob("step_*")
        if (m := re.fullmatch(r"step_(\d+)", p.name)) and p.is_dir()
    }
    if not found or (step is not None and step not in found):
        raise Failed(f"{run_dir}/checkpoints: no checkpoint of step {step if step is not None else 'any'}")
    return found[step if step is not None else max(found)]


# ---------------------------------------------------------------------------------------------
# The checks


def check_ops(ctx: Ctx) -> Result:
    ext = ctx.work / "torch_extensions"  # empty: a JIT build would leave its files here
    argv = [sys.executable, __file__, "--ops-probe", "--device", "cpu" if ctx.cpu else "cuda"]
    got = probe_result(ctx.command("ops", argv, 1, timeout=300, env={"TORCH_EXTENSIONS_DIR": str(ext)}))
    states = got["states"]
    found = ", ".join(
        f"{k} {v['state']}" + (f" ({v['why']})" if v.get("why") else "") for k, v in states.items()
    )
    if ctx.cpu:
        return Result(
            "ops", "SKIP", f"--cpu: DeepSpeed's ops are built into it under a CUDA torch only; found {found}"
        )
    if not all(v["state"] == "installed" for v in states.values()):
        raise Failed(
            f"{found}: run ./setup.sh under the CUDA torch (PRETRAIN_BUILD_OPS=1, the default, builds them)"
        )
    if got["jit_built"]:
        raise Failed(
            f"a step JIT-built {', '.join(got['jit_built'])} although DeepSpeed reports the ops installed"
        )
    text = (
        f"fused_adam and cpu_adam installed in DeepSpeed {got['deepspeed']}; FusedAdam and DeepSpeedCPUAdam "
        f"each took a step in {got['seconds']:.1f} s with nothing JIT-built"
    )
    return Result("ops", "PASS", text, {"seconds": got["seconds"]})


def check_nccl(ctx: Ctx) -> Result:
    from pretrain.cluster.reach import free_port

    n = len(ctx.devices)
    hostfile = ctx.work / "hostfile"
    hostfile.write_text(f"localhost slots={n}\n")
    run_dir = ctx.work / "runs" / "nccl"
    argv = ctx.pretrain(
        "preflight", "--hostfile", str(hostfile), "--no-ssh", "--master-port", str(free_port()),
        "--preset", "tiny", *sets_args([*ctx.data("char"), f"logging.run_dir={run_dir}"]),
    )  # fmt: skip
    try:
        ctx.command("nccl", argv, n, timeout=300)
    except Failed as e:
        log = (ctx.work / "logs" / "nccl.log").read_text(errors="replace")
        said = [ln for ln in log.splitlines() if ln.startswith("FAIL ")]
        raise Failed(said[0] if said else str(e)) from None
    a = json.loads((run_dir / "preflight.json").read_text())["allreduce"]
    busbw, floor = a["busbw"] / 1e9, float(os.environ.get("MIN_BUSBW_GBS", "5"))
    figures = {
        "busbw_gbs": busbw,
        "algbw_gbs": a["algbw"] / 1e9,
        "world": a["world"],
        "backend": a["backend"],
    }
    text = (
        f"bus bandwidth {busbw:.2f} GB/s (algorithm {a['algbw'] / 1e9:.2f} GB/s): {a['bytes'] / 2**20:.0f} MiB "
        f"all-reduced over {a['world']} ranks ({a['backend']}) in {a['seconds'] * 1e3:.2f} ms"
    )
    if not a["correct"]:
        raise Failed(f"{text}, but the sum was wrong")
    if not ctx.cpu and busbw < floor:
        raise Failed(f"{text}: under the floor of {floor:g} GB/s (MIN_BUSBW_GBS)")
    return Result("nccl", "PASS", text + ("" if ctx.cpu else f" (floor {floor:g} GB/s)"), figures)


def gpt2_sets(ctx: Ctx, micro: int, steps: int, compile_: bool) -> list[str]:
    return [
        *ctx.sizes.gpt2_model,
        "precision.bf16=true",
        "zero.stage=2",
        f"optimizer.fused_adam={not ctx.cpu}",  # the CPU build's FusedAdam would be JIT-compiled
        f"compile.enabled={compile_}",
        f"batch.micro_batch_size={micro}",
        "batch.gradient_accumulation_steps=1",
        f"schedule.max_steps={steps}",
        f"schedule.warmup_steps={min(5, steps - 1)}",
        "logging.eval_interval=100000",
        "checkpoint.interval=100000",
    ]


def check_throughput(ctx: Ctx) -> Result:
    micro, steps = ctx.sizes.throughput
    sets = gpt2_sets(ctx, micro, steps, ctx.sizes.compile)
    run = ctx.train("throughput", 1, "gpt2-124m", sets, slow=2).result()  # compilation: a minute or two
    rows = [r for r in metric_rows(run) if r.get("loss")]
    steady = rows[min(10, len(rows) // 2) :]  # past warm-up: compilation, the allocator, cuBLAS heuristics

    def mean(key: str) -> float:
        vals = [float(r[key]) for r in steady if r.get(key)]
        return sum(vals) / len(vals) if vals else float("nan")

    first, last = float(rows[0]["loss"]), float(rows[-1]["loss"])
    peak = max(float(r["peak_mem_gb"]) for r in rows if r.get("peak_mem_gb"))
    figures = {
        "tokens_per_s": mean("tokens_per_s"),
        "mfu": mean("mfu"),
        "peak_mem_gb": peak,
        "steps": len(rows),
    }
    text = (
        f"{ctx.sizes.gpt2_name} bf16 ZeRO-2, micro batch {micro}, compile {'on' if ctx.sizes.compile else 'off'}, "
        f"{len(rows)} steps: {figures['tokens_per_s']:,.0f} tokens/s, MFU {100 * figures['mfu']:.1f}%, "
        f"peak memory {peak:.2f} GB, loss {first:.3f} -> {last:.3f}"
    )
    if not last < first:
        raise Failed(f"{text}: the loss did not fall")
    return Result("throughput", "PASS", text, figures)


def check_memory(ctx: Ctx) -> Result:
    n = len(ctx.devices)
    micro, steps = ctx.sizes.memory
    sets = gpt2_sets(ctx, micro, steps, False)
    run = ctx.train("memory", n, "gpt2-124m", sets).result()
    peaks: dict[int, float] = {}
    for r in metric_rows(run, "ranks.csv"):
        if r.get("peak_mem_gb"):
            peaks[int(r["rank"])] = max(peaks.get(int(r["rank"]), 0.0), float(r["peak_mem_gb"]))
    argv = ctx.pretrain("plan", "--preset", "gpt2-124m", *sets_args([*ctx.data("gpt2"), *sets]))
    planned = ctx.work / "runs" / "memory-plan.json"
    ctx.command("memory-plan", [*argv, "--world-size", str(n), "--json"], 0, stdout=planned)
    plan = json.loads(planned.read_text())
    want = next(s for s in plan["stages"] if s["stage"] == 2 and s["offload"] == "none")["device_total_gb"]
    if sorted(peaks) != list(range(n)):
        raise Failed(f"ranks.csv has peaks of ranks {sorted(peaks)}, not of all {n}")
    lo, hi = min(peaks.values()), max(peaks.values())
    factor = float(os.environ.get("MEM_FACTOR", "1.5"))
    figures = {"peak_gb_by_rank": peaks, "plan_gb": want, "ratio_min": lo / want, "ratio_max": hi / want}
    text = (
        f"{ctx.sizes.gpt2_name} bf16 ZeRO-2, micro batch {micro}, {n} ranks: peak {lo:.2f}-{hi:.2f} GB a rank, plan "
        f"{want:.2f} GB: measured / plan {lo / want:.2f}-{hi / want:.2f}"
    )
    if ctx.cpu:
        return Result(
            "memory", "SKIP", f"--cpu: {text} (a CPU rank's peak is its RSS, not device memory)", figures
        )
    if not (1 / factor <= lo / want and hi / want <= factor):
        raise Failed(f"{text}: outside {factor:g}x (MEM_FACTOR)")
    return Result("memory", "PASS", f"{text} (within {factor:g}x)", figures)


def fp32_sets(ctx: Ctx) -> list[str]:
    micro, batch, steps = ctx.sizes.fp32
    return [
        *ctx.sizes.char_model,
        "precision.tf32=false",  # fp32 means fp32: no TF32 tensor cores in the matmuls
        "zero.stage=1",
        f"batch.micro_batch_size={micro}",
        f"batch.global_batch_sequences={batch}",
        f"schedule.max_steps={steps}",
        "schedule.warmup_steps=2",
        f"logging.eval_interval={steps // 2}",
        "logging.eval_batches=2",
        f"checkpoint.interval={steps // 2}",
    ]


def check_fp32(ctx: Ctx, name: str) -> Result:
    ref = ctx.train("fp32-ref", 1, "tiny", fp32_sets(ctx))
    got = ctx.train(name, NEEDS[name], "tiny", [*fp32_sets(ctx), *FP32_LAYOUTS[name]])
    want, have = losses(ref.result()), losses(got.result())
    diff, step = worst(have, want)
    text = (
        f"{agreement(diff, step, want, ONE_RANK)} (tolerance {FP32_TOL:.0e}); "
        f"loss {want[min(want)]:.4f} -> {want[max(want)]:.4f}"
    )
    if diff > FP32_TOL:
        raise Failed(text)
    return Result(name, "PASS", text, {"max_diff": diff, "step": step})


def check_bf16(ctx: Ctx) -> Result:
    micro, batch, steps = ctx.sizes.bf16
    sets = [
        *ctx.sizes.char_model,
        "precision.bf16=true",
        "precision.grad_accum_dtype=fp32",
        "zero.stage=1",
        f"batch.micro_batch_size={micro}",
        f"batch.global_batch_sequences={batch}",
        f"schedule.max_steps={steps}",
        "schedule.warmup_steps=2",
        f"logging.eval_interval={steps}",
        "logging.eval_batches=2",
        "checkpoint.interval=100000",
    ]
    ref, got = ctx.train("bf16-ref", 1, "tiny", sets), ctx.train("bf16-dp2", 2, "tiny", sets)
    want, have = losses(ref.result()), losses(got.result())
    diff, step = worst(have, want, relative=True)
    text = (
        f"{agreement(diff, step, want, ONE_RANK, ' of the loss')}, {batch // micro} micro batches "
        f"on 1 rank and {batch // micro // 2} a rank on 2, summed in fp32 (tolerance 2^-7 = {BF16_REL_TOL:.1e} "
        f"of the loss); loss {want[min(want)]:.4f} -> {want[max(want)]:.4f}"
    )
    if diff > BF16_REL_TOL:
        raise Failed(text)
    return Result("bf16-dp2", "PASS", text, {"max_rel_diff": diff, "step": step})


def check_resume(ctx: Ctx, name: str) -> Result:
    steps, at = ctx.sizes.resume
    layout = "parallel.tensor=2" if name == "resume-tp2" else "parallel.pipeline=2"
    sets = [
        *fp32_sets(ctx),
        "model.dropout=0.1",  # so that the generators' states matter
        f"schedule.max_steps={steps}",
        f"checkpoint.interval={at}",
        "checkpoint.keep_last=3",
        layout,
    ]
    full = ctx.train(f"{name}-full", 2, "tiny", sets).result()
    ckpt = step_dir(full, at)
    resumed = ctx.train(f"{name}-resumed", 2, "tiny", sets, resume=ckpt).result()
    want = {s: v for s, v in losses(full).items() if s > at}
    have = losses(resumed)
    diff, step = worst(have, want)
    text = (
        f"resumed from step {at}'s checkpoint into a new run dir: {agreement(diff, step, want, 'the uninterrupted run')} "
        f"(tolerance {FP32_TOL:.0e})"
    )
    if diff > FP32_TOL:
        raise Failed(text)
    return Result(name, "PASS", text, {"max_diff": diff, "bit_exact": have == want})


def check_export(ctx: Ctx) -> Result:
    run = ctx.train("fp32-tp2", 2, "tiny", [*fp32_sets(ctx), *FP32_LAYOUTS["fp32-tp2"]]).result()
    ckpt, out = step_dir(run), ctx.work / "export" / "fp32-tp2"
    ctx.command("export", ctx.pretrain("export", str(ckpt), "--out", str(out)), 0)
    argv = [sys.executable, __file__, "--hf-logits", str(ckpt), str(out), "--text", ctx.corpus]
    got = probe_result(ctx.command("export-logits", [*argv, "--device", "cpu" if ctx.cpu else "cuda"], 1))
    text = (
        f"{got['architecture']} from the export of {ckpt.name} (tensor 2) gives the checkpoint's logits within "
        f"{got['max_diff']:.1e} (tolerance {LOGIT_TOL:.0e}) on {got['shape']} tokens of the corpus's last tenth; "
        f"its tokenizer's ids {'equal' if got['same_ids'] else 'differ from'} ours"
    )
    if got["max_diff"] > LOGIT_TOL or not got["same_ids"]:
        raise Failed(text)
    return Result("export", "PASS", text, {"max_diff": got["max_diff"]})


CHECKS: dict[str, Callable[[Ctx], Result]] = {
    "ops": check_ops,
    "nccl": check_nccl,
    "throughput": check_throughput,
    "memory": check_memory,
    **{name: functools.partial(check_fp32, name=name) for name in FP32_LAYOUTS},
    "bf16-dp2": check_bf16,
    "resume-tp2": functools.partial(check_resume, name="resume-tp2"),
    "resume-pp2": functools.partial(check_resume, name="resume-pp2"),
    "export": check_export,
}


def run_check(ctx: Ctx, name: str) -> Result:
    """One check, whatever it meets: its own verdict, or FAIL with what stopped it, in one line."""
    try:
        return CHECKS[name](ctx)
    except Failed as e:
        return Result(name, "FAIL", str(e))
    except Exception as e:  # a bug in the check itself is still one line, and the others go on
        return Result(name, "FAIL", f"{type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------------------
# Probes: run in their own process, on the devices the pool gave them


def ops_probe(device: str) -> dict[str, Any]:
    """Preflight's report of the two ops and, if both are installed, a step of each optimizer."""
    from importlib.metadata import version

    import torch

    from pretrain.cluster.probe import check_ops

    states = check_ops(["fused_adam", "cpu_adam"])
    out: dict[str, Any] = {"states": states, "deepspeed": version("deepspeed"), "seconds": 0.0}
    if all(s["state"] == "installed" for s in states.values()):
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

        t = time.perf_counter()
        for opt, where in ((FusedAdam, device), (DeepSpeedCPUAdam, "cpu")):
            p = torch.nn.Parameter(torch.ones(8, device=where))
            p.grad = torch.full_like(p, 0.5)
            opt([p], lr=0.1).step()
            if not bool((p < 1).all()):
                raise RuntimeError(f"{opt.__name__} took a step that did not move the parameter")
        out["seconds"] = time.perf_counter() - t
    ext = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    out["jit_built"] = sorted(p.name for p in ext.iterdir()) if ext.is_dir() else []
    return out


def hf_logits(ckpt: Path, export_dir: Path, text_file: str, device: str) -> dict[str, Any]:
    """Our model from the checkpoint (its shards merged as `export` merges them) against transformers'
    from the export's hf/ directory: the largest logit difference on 3 blocks of text, fp32, no TF32."""
    import torch
    import transformers

    from pretrain.export import load_model, tokenizer_for

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ours, cfg, where = load_model(ckpt, device=device)
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(export_dir / "hf")
    hf = hf.to(device).eval()
    tok = tokenizer_for(where, cfg)
    text = Path(text_file).read_text(encoding="utf-8")
    val = text[int(len(text) * 0.9) :][:20000]
    ids = tok.encode(val)
    hf_tok: Any = transformers.AutoTokenizer.from_pretrained(export_dir / "hf")
    same_ids = hf_tok(val)["input_ids"] == ids
    T = cfg.model.block_size
    idx = torch.tensor([ids[i * T : (i + 1) * T] for i in range(3)], device=device)  # (3, T)
    with torch.no_grad():
        logits, _ = ours(idx, idx)  # with targets: the logits at every position
        theirs = hf(idx).logits
    vocab = logits.size(-1)
    if theirs[..., vocab:].any():  # the rows HF's vocabulary adds past ours must score 0
        raise RuntimeError("transformers' logits past our vocabulary are not zero")
    diff = (logits - theirs[..., :vocab]).abs().max().item()
    return {"max_diff": diff, "same_ids": same_ids, "shape": f"3 x {T}", "architecture": type(hf).__name__}


# ---------------------------------------------------------------------------------------------


def die(message: str) -> NoReturn:
    """Nothing could start: one line on stderr, exit status 2."""
    print(f"gpu_check: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def find_devices(args: argparse.Namespace) -> tuple[list[str], str]:
    """The devices the checks may use, and their name for the header; exits 2 without CUDA."""
    if args.cpu:
        return [str(i) for i in range(args.gpus or 2)], f"CPU ({os.cpu_count()} cores)"
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        cuda = torch.version.cuda or "none (a CPU build)"
        die(
            f"no CUDA GPU visible to {sys.executable} (torch {torch.__version__}, CUDA {cuda}); "
            "--cpu runs the checks on CPU ranks"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")][:n] if visible else [str(i) for i in range(n)]
    if args.gpus and args.gpus > n:
        die(f"--gpus {args.gpus}, but {n} CUDA GPUs are visible")
    ids = ids[: args.gpus or n]
    return ids, f"{len(ids)} x {torch.cuda.get_device_name(0)}"


def versions(cpu: bool) -> str:
    """What the figures were measured with, for the record."""
    from importlib.metadata import version

    import torch

    found = [f"torch {torch.__version__}"]
    if not cpu:
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError):
            nccl = "unavailable"
        found += [f"CUDA {torch.version.cuda}", f"NCCL {nccl}"]
    return ", ".join([*found, f"DeepSpeed {version('deepspeed')}"])


def skip_reason(name: str, n: int, unit: str) -> str | None:
    return f"needs {NEEDS[name]} {unit}, found {n}" if NEEDS[name] > n else None


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="Dry run on gloo ranks on the CPU, tiny shapes.")
    ap.add_argument("--gpus", type=int, help="Use the first N GPUs (on --cpu: N ranks, default 2).")
    ap.add_argument("--only", help="Comma-separated checks to run: " + ", ".join(CHECKS) + ".")
    ap.add_argument("--list", action="store_true", help="List the checks and what each needs; run nothing.")
    ap.add_argument(
        "--work", type=Path, default=os.environ.get("WORK") or None, help="Data, runs, logs (WORK)."
    )
    ap.add_argument("--json", type=Path, help="Also write every check's status and figures here.")
    ap.add_argument("--ops-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--hf-logits", nargs=2, type=Path, metavar=("CKPT", "EXPORT"), help=argparse.SUPPRESS)
    ap.add_argument("--text", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()] if args.only else list(CHECKS)
    for n in names:
        if n not in CHECKS:
            close = difflib.get_close_matches(n, CHECKS, n=1)
            ap.error(f"--only: no check {n!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    args.names = [n for n in CHECKS if n in names]
    if args.gpus is not None and args.gpus < 1:
        ap.error("--gpus: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.ops_probe:
        print("gpu_check-result: " + json.dumps(ops_probe(args.device)), flush=True)
        return 0
    if args.hf_logits:
        ckpt, export_dir = args.hf_logits
        print(
            "gpu_check-result: " + json.dumps(hf_logits(ckpt, export_dir, args.text, args.device)), flush=True
        )
        return 0
    unit = "CPU ranks" if args.cpu else "GPUs"
    if args.list:
        n = args.gpus or len(find_devices(args)[0])
        for name in args.names:
            reason = skip_reason(name, n, unit)
            print(f"{name}: needs {NEEDS[name]} {unit}" + (f"; SKIP: {reason}" if reason else ""))
        return 0
    devices, described = find_devices(args)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_check_"))
    if (work / "runs").exists():
        die(f"{work / 'runs'} exists (an earlier check's): give an empty --work (WORK)")
    (work / "logs").mkdir(parents=True, exist_ok=True)
    corpus = os.environ.get("CORPUS") or str(TEST_DATA / "tinyshakespeare.txt")
    tok = Path(os.environ.get("TOKENIZER") or TEST_DATA / "tokenizers" / "gpt2.tiktoken")
    print(
        f"gpu_check: {plural(len(args.names), 'check')} on {described}; {versions(args.cpu)}; "
        f"{'dry run; ' if args.cpu else ''}work dir {work} (each command's output in logs/)",
        flush=True,
    )
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=64) as executor:
        ctx = Ctx(
            cpu=args.cpu,
            devices=devices,
            work=work,
            sizes=CPU_SIZES if args.cpu else gpu_sizes(),
            corpus=corpus,
            tokenizer=tok if tok.is_file() else None,
            pool=Pool(devices),
            executor=executor,
        )
        results: dict[str, Result] = {}

        def done(r: Result) -> None:
            results[r.name] = r
            print(r.line, flush=True)

        runnable = []
        for name in args.names:
            reason = skip_reason(name, len(devices), unit)
            if reason:
                done(Result(name, "SKIP", reason))
            else:
                runnable.append(name)
        for name in [n for n in runnable if n in ALONE]:  # one at a time, nothing else running
            done(run_check(ctx, name))
        pending = [executor.submit(run_check, ctx, n) for n in runnable if n not in ALONE]
        for future in cf.as_completed(pending):
            done(future.result())
    by = {s: [n for n in args.names if results[n].status == s] for s in ("PASS", "FAIL", "SKIP")}
    minutes, seconds = divmod(int(time.perf_counter() - t0), 60)
    print(
        f"gpu_check: {len(by['PASS'])} passed, {len(by['FAIL'])} failed"
        + (f" ({', '.join(by['FAIL'])})" if by["FAIL"] else "")
        + f", {len(by['SKIP'])} skipped of {plural(len(args.names), 'check')} in {minutes}m{seconds:02d}s on {described}"
        + (f"; logs kept in {work / 'logs'}" if by["FAIL"] or args.work else ""),
        flush=True,
    )
    if args.json:
        report = {n: {"status": r.status, "line": r.line, **r.figures} for n, r in results.items()}
        args.json.write_text(json.dumps({"device": described, "checks": report}, indent=1) + "\n")
    if not by["FAIL"] and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if by["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
