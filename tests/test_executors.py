"""run_stage on this host (data.executor 'local'): every task runs once, a relaunch skips the completed
ones, and a task that raises or is killed with SIGKILL is named in one DataError, without a hang.
Slurm and Ray: tests/test_multinode.py."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import pytest

from pretrain.config.tree import DataConfig
from pretrain.data.executors import run_stage
from pretrain.errors import DataError
from tests.stage_steps import ToyStep, runs

TASKS = 5


def local(workers: int) -> DataConfig:
    return DataConfig.model_validate({"executor": "local", "tasks": TASKS, "workers": workers})


def outputs(out: Path) -> list[str]:
    return [(out / f"rank{r}.txt").read_text().split()[0] for r in range(TASKS)]


@pytest.fixture
def out(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    return tmp_path / "out"


@pytest.mark.parametrize("workers", [2, 0])
def test_every_task_runs_once_and_a_relaunch_skips_them(out, tmp_path, workers):
    lines: list[str] = []
    run_stage(local(workers), tmp_path / "logs", "encode", ToyStep(str(out)), TASKS, log=lines.append)
    assert outputs(out) == [str(r) for r in range(TASKS)]
    assert [runs(out, r) for r in range(TASKS)] == [1] * TASKS
    assert sorted(p.name for p in (tmp_path / "logs" / "completions").iterdir()) == [
        f"{r:05d}" for r in range(TASKS)
    ]
    where = "on this host" if workers else "in this process"
    assert lines == [f"stage encode: 5 of 5 tasks to run {where}", "stage encode: 5/5 tasks done"]
    run_stage(local(workers), tmp_path / "logs", "encode", ToyStep(str(out)), TASKS)
    assert [runs(out, r) for r in range(TASKS)] == [1] * TASKS


def test_a_task_killed_by_sigkill_is_named_and_rerun_alone(out, tmp_path):
    logs = tmp_path / "logs"
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        run_stage(local(2), logs, "encode", ToyStep(str(out), kill_rank=2), TASKS)
    assert time.monotonic() - start < 30
    assert str(e.value) == (
        "data prepare stage 'encode' (data.executor 'local'): 1 of 5 tasks did not complete: rank 2 (killed "
        f"by SIGKILL, out of memory?, log {logs}/logs/task_00002.log): fix what their logs name and rerun the "
        "prepare, which reruns only the tasks that did not complete"
    )
    assert [runs(out, r) for r in range(TASKS)] == [1] * TASKS
    run_stage(local(2), logs, "encode", ToyStep(str(out), kill_rank=2), TASKS)
    assert [runs(out, r) for r in range(TASKS)] == [1, 1, 2, 1, 1]
    assert outputs(out) == [str(r) for r in range(TASKS)]


def _children() -> set[int]:
    """The live processes whose parent is this one (Linux's /proc); its zombies reaped."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) != os.getpid():
            continue
        if fields[0] == "Z":
            os.waitpid(int(stat.parent.name), 0)
        else:
            pids.add(int(stat.parent.name))
    return pids


@pytest.mark.skipif(sys.platform != "linux", reason="a subreaper and /proc are Linux's")
def test_a_task_killed_by_sigkill_leaves_no_process_behind(out, tmp_path):
    """datatrove's executor starts a manager process in each task: it dies with its task. This process
    is made a subreaper while the stage runs, so an orphan would become its child, and be seen."""
    run_stage(local(2), tmp_path / "warm", "encode", ToyStep(str(out)), TASKS)  # the fork server started
    libc = ctypes.CDLL(None, use_errno=True)
    before = _children()
    assert libc.prctl(36, 1) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        with pytest.raises(DataError):
            run_stage(local(2), tmp_path / "logs", "encode", ToyStep(str(out), kill_rank=2), TASKS)
        time.sleep(0.5)
        left = _children() - before
    finally:
        libc.prctl(36, 0)
    for pid in left:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert not left


@pytest.mark.parametrize("workers", [2, 0])
def test_a_task_that_raises_is_named_with_its_log(out, tmp_path, workers):
    logs = tmp_path / "logs"
    with pytest.raises(DataError) as e:
        run_stage(local(workers), logs, "bands", ToyStep(str(out), raise_rank=1), TASKS)
    message = str(e.value)
    assert message.startswith(
        "data prepare stage 'bands' (data.executor 'local'): 1 of 5 tasks did not complete"
    )
    assert f"rank 1 (ValueError: toy step refuses rank 1, log {logs}/logs/task_00001.log)" in message
    assert "; " not in message
    assert "ValueError: toy step refuses rank 1" in (logs / "logs" / "task_00001.log").read_text()
    assert [runs(out, r) for r in range(TASKS)] == [1] * TASKS  # the others ran to the end


def test_tasks_must_be_at_least_one(tmp_path):
    with pytest.raises(ValueError, match="tasks must be at least 1"):
        run_stage(local(0), tmp_path / "logs", "encode", ToyStep(str(tmp_path)), 0)


def test_slurm_without_sbatch_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    data = DataConfig.model_validate({"executor": "slurm", "tasks": TASKS})
    with pytest.raises(DataError) as e:
        run_stage(data, tmp_path / "logs", "encode", ToyStep(str(tmp_path)), TASKS)
    assert str(e.value) == (
        "data prepare stage 'encode': data.executor 'slurm' needs Slurm's sbatch on this host (the login node), "
        "and there is none on PATH: run the prepare on a host that submits Slurm jobs, or set data.executor "
        "to 'local' or 'ray'"
    )
