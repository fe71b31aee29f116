"""Shared fixtures: the offline data in tests/data, a prepared char-level dataset, and the
2-rank training job whose checkpoints the checkpoint, export and supervisor tests read.

The multi-rank scenarios run as a few torchrun jobs (tests/ckpt_worker.py), each training several
configs in one process group; the tests read what they left behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pretrain.training.checkpoint import store as checkpoint

ROOT = Path(__file__).resolve().parents[1]
# Small public files the tests read, kept in the repository (tests/data/README.md says what each is).
TEST_DATA = ROOT / "tests" / "data"
TINY_SHAKESPEARE = TEST_DATA / "tinyshakespeare.txt"
GPT2_DIR = TEST_DATA / "tokenizers"  # GPT-2's BPE as gpt2.tiktoken and as vocab.bpe + encoder.json
GPT2_RANKS = GPT2_DIR / "gpt2.tiktoken"

# DeepSpeed on this machine: the CPU accelerator, one BLAS thread per rank.
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Any:
    """`build(dir)` (a value JSON keeps) once for the whole run, whichever xdist worker asks first:
    it builds under a lock in the run's temp dir, above each worker's own; the others wait for it and
    read what it left. Alone (no xdist), in this session's temp dir. The value's files are read, not
    changed, by the tests that share them."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent  # pytest-N: this run's, the workers' popen-gwK below
    done = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also on an error
        if not done.exists():
            where = root / name
            where.mkdir(exist_ok=True)
            done.write_text(json.dumps(build(where)))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def char_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-shakespeare prepared char-level once per run (90/10 split, vocab 65)."""
    from pretrain.config.tree import DataConfig
    from pretrain.data.prepare import prepare

    def build(where: Path) -> str:
        out = where / "tinyshakespeare-char"
        return str(prepare(DataConfig(corpus=str(TINY_SHAKESPEARE), tokenizer="char", dataset_dir=str(out))))

    return Path(built_once(tmp_path_factory, "data", build))


def subprocess_env(**extra: str) -> dict[str, str]:
    # A launcher's variables in this process (set by a test calling launch_env) are not the child's.
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


# ---------------------------------------------------------------------------------------------
# The suite runs on two pytest-xdist workers, a file at a time each (pyproject.toml: -n 2 --dist
# loadfile): a file's module fixtures are built once, and its tests never race each other for a port.
# The files that take longest go first (their time measured on 2 cores, docs/testing.md), so that
# both workers end together; those that mostly wait (on a hung rank's timeout, on sshd and Slurm
# in namespaces, on a supervisor's restarts) alternate with those that compute, so that one worker's
# wait is the other's time. xdist keeps this order (--no-loadscope-reorder; by default it would
# hand out the files with the most tests first).

SLOW_FIRST = [  # the rest take a few seconds each, and fill the gaps at the end
    "test_multinode.py", "test_safety.py", "test_watchdog.py", "test_compile.py", "test_supervisor.py",
    "test_parallel.py", "test_cli.py", "test_precision.py", "test_launch.py", "test_checkpoint.py",
    "test_init_from.py", "test_fuzz.py", "test_data_faults.py", "test_ds_corpus.py", "test_export.py",
    "test_budgets.py", "test_distributed.py", "test_metrics.py", "test_start_memory.py",
    "test_docs_commands.py", "test_data_tasks.py", "test_hf_tokenizer.py",
    "test_launch_check.py", "test_fuzz_commands.py", "test_plan_memory.py", "test_gpu_check_script.py",
    "test_data_cli.py", "test_hf.py", "test_plan.py", "test_generate.py", "test_ranks.py",
]  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def weight(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=weight)  # stable: the order within a file, and among the others, is kept


# ---------------------------------------------------------------------------------------------
# Real training jobs, shared by the checkpoint, export and supervisor tests

CORPUS = f"--set=data.corpus={TINY_SHAKESPEARE}"  # what char_dataset was prepared from

BIN = Path(sys.executable).parent


def torchrun(nproc: int, port: int, data: Path, out: Path, jobs: list[dict], timeout: int = 600) -> dict:
    jobs_file = out / f"jobs{nproc}.json"
    jobs_file.write_text(json.dumps(jobs))
    launcher = [
        "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(port),
    ] if nproc > 1 else []  # fmt: skip
    cmd = [
        sys.executable,
        *launcher,
        str(ROOT / "tests" / "ckpt_worker.py"),
        str(data),
        str(out),
        str(jobs_file),
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    results = json.loads((out / f"jobs{nproc}.results.json").read_text())
    return dict(results, _stdout=proc.stdout, _stderr=proc.stderr)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: int = 300, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """`pretrain ARGS` run as a person runs it (in the repository root unless `cwd`), its output kept."""
    return subprocess.run(
        [str(BIN / "pretrain"), *args],
        cwd=cwd,
        env=subprocess_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Checkpoints at 3, 6 and 8 (the end), all kept.
DROPOUT = ["model.dropout=0.1", "checkpoint.interval=3", "checkpoint.keep_last=5"]
LOG3 = ["logging.log_interval=3"]


# test_kill_9_with_supervised_restarts: 12 steps at ZeRO-2, checkpoints every 3.
SUPERVISED = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
              "batch.micro_batch_size=2", "optimizer.lr=3e-3", "schedule.max_steps=12",
              "schedule.warmup_steps=2", "logging.log_interval=1", "logging.eval_interval=6",
              "logging.eval_batches=2", "logging.sample_tokens=0", "zero.stage=2",
              "checkpoint.interval=3"]  # fmt: skip


@pytest.fixture(scope="session")
def two_ranks(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One 2-rank job: uninterrupted and interrupted+resumed runs at ZeRO-2 and ZeRO-3 (with dropout,
    so the RNG states matter), the sources of the world-size change, and NaN and loss-spike injection.
    Once per run: the tests read its checkpoints; test_checkpoint.py alone writes, the universal
    conversions of the ws_* runs, which no other file reads."""

    def build(out: Path) -> dict:
        return {**torchrun(2, 29541, char_dataset, out, _two_rank_jobs()), "_out": str(out)}

    res = built_once(tmp_path_factory, "ckpt2", build)
    return res, Path(res["_out"])


def _two_rank_jobs() -> list[dict]:
    stop = {"PRETRAIN_FAULT_SIGTERM": "1:4"}  # rank 1 only; the run saves after step 5 and stops
    jobs = [
        {"name": "z0_full", "run": "z0_full", "overrides": ["zero.stage=0", *DROPOUT]},
        {"name": "z2_full", "run": "z2_full", "overrides": ["zero.stage=2", *DROPOUT]},
        # a slow filesystem: the background save of step 3 is still in flight when the stop saves step 5
        {
            "name": "z2_stop",
            "run": "z2_res",
            "overrides": ["zero.stage=2", *DROPOUT],
            "env": {**stop, "PRETRAIN_FAULT_SLOW_SAVE": "0.5"},
        },
        # z2_full's saves, synchronous: the same bytes as its background ones
        {
            "name": "z2_sync",
            "run": "z2_sync",
            "overrides": ["zero.stage=2", *DROPOUT, "checkpoint.async_save=false"],
        },
        {"name": "z2_resume", "run": "z2_res", "overrides": ["zero.stage=2", *DROPOUT], "resume": "auto"},
        # ZeRO-3 logs every 3 steps: the stop after step 5 falls inside the window of step 6
        {"name": "z3_full", "run": "z3_full", "overrides": ["zero.stage=3", *DROPOUT, *LOG3]},
        {"name": "z3_stop", "run": "z3_res", "overrides": ["zero.stage=3", *DROPOUT, *LOG3], "env": stop},
        {
            "name": "z3_resume",
            "run": "z3_res",
            "overrides": ["zero.stage=3", *DROPOUT, *LOG3],
            "resume": "auto",
        },
        {"name": "ws_z2", "run": "ws_z2", "overrides": ["zero.stage=2", "checkpoint.interval=4"]},
        {"name": "ws_z3", "run": "ws_z3", "overrides": ["zero.stage=3", "checkpoint.interval=4"]},
        *(
            {
                "name": f"nan_z{stage}",
                "run": f"nan_z{stage}",
                "overrides": [f"zero.stage={stage}", "checkpoint.interval=2", "checkpoint.max_bad_steps=2"],
                "env": {"PRETRAIN_FAULT_NAN_STEPS": "3" if stage == 0 else "3,6,7"},
            }
            for stage in (0, 2, 3)
        ),
        # nan_z2's run with loss spikes on rank 0 instead of NaNs (tests/test_spikes.py)
        {
            "name": "spike_z2",
            "run": "spike_z2",
            "overrides": [
                "zero.stage=2",
                "checkpoint.interval=2",
                "checkpoint.max_bad_steps=2",
                "checkpoint.spike_factor=3",
                "checkpoint.spike_window=2",
            ],
            "env": {"PRETRAIN_FAULT_SPIKE_STEPS": "3,6,7"},
        },
        {"name": "sup_ref", "run": "sup_ref", "overrides": SUPERVISED},  # test_kill_9_...'s reference
    ]
    return jobs


def ckpt(out: Path, run: str, step: int) -> Path:
    return out / run / "checkpoints" / checkpoint.tag_for(step)


@pytest.fixture(scope="session")
def exported(two_ranks, tmp_path_factory) -> Path:
    _, out = two_ranks

    def build(where: Path) -> str:
        dest = where / "z3"
        done = cli("export", str(out / "z3_full"), "--out", str(dest))  # a run dir: its newest checkpoint
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert "step 8" in done.stdout
        return str(dest)

    return Path(built_once(tmp_path_factory, "export", build))


# ---------------------------------------------------------------------------------------------
# Skips: only for want of a GPU, root, a system package or facility (namespaces, cgroups, cpuinfo). Under PRETRAIN_STRICT_SKIPS=1 (.ci/run)
# any other skip fails the run, so the suite never quietly tests less than it says.

ALLOWED_SKIP = re.compile(
    r"GPU|CUDA|needs root|system-deps|system package|network namespaces|cgroup|/proc/cpuinfo", re.IGNORECASE
)
_unexpected_skips: list[str] = []


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


def _note_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = _skip_reason(report)
        if not ALLOWED_SKIP.search(reason):
            _unexpected_skips.append(f"{report.nodeid}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexpected_skips and os.environ.get("PRETRAIN_STRICT_SKIPS") == "1":
        print(
            "\nPRETRAIN_STRICT_SKIPS: tests skipped for a reason other than a GPU, root or a system package:"
        )
        for line in _unexpected_skips:
            print(f"  {line}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
