"""A stage of a prepare run as independent tasks, on this host, a Slurm cluster or a Ray cluster.

`run_stage` runs every task `step(rank, world_size)` of a stage that has not completed yet, on
`data.executor`, through datatrove's executors and their public API only: each task's log, stats and
completion marker are datatrove's (`logs/logs/task_NNNNN.log`, `logs/stats/`, `logs/completions/NNNNN`),
so a relaunch of the prepare skips the tasks completed before and reruns the others. A task is
idempotent and writes its outputs atomically, so a rerun gives the same bytes. Any task that did not
complete (it raised, or its process was killed, kill -9 and the out-of-memory killer included) is
named, with its log, in one DataError once every other task of the stage has run.

- local: a process per task (a fork server starts them), `data.workers` at once (None: the usable
  cores), or with `data.workers` 0 one after the other in this process. Each runs datatrove's
  `LocalPipelineExecutor` of its one rank (`local_tasks=1`, `local_rank_offset=rank`, one worker,
  which runs it in the calling process). Not one executor of every rank: its Pool waits forever for
  a task whose worker was killed.
- slurm: one job array per stage, submitted with sbatch from this host (a login node) by datatrove's
  `SlurmPipelineExecutor`, and waited for. The compute nodes run this interpreter with this
  process's import paths, so they must see the same file system at the same paths: the venv, the
  code, `logs` and the dataset.
- ray (the `ray` extra): a Ray task per task on the cluster at `data.ray.address` (or on a Ray
  instance started here for the stage), each running its rank's executor as the local tasks do,
  never retried: datatrove's RayPipelineExecutor runs its ranks in a process pool inside an actor,
  which waits forever for a rank whose process was killed. Its workers start with this interpreter
  and this process's import paths: the nodes share the file system, as for Slurm. Usage stats and
  the dashboard are off.

Local and Ray tasks are started and waited for by one loop (`_schedule`), `n` at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import shlex
import shutil
import signal
import site
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from datatrove.executor.local import LocalPipelineExecutor
from datatrove.executor.slurm import SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from loguru import logger

from pretrain.config.tree import DataConfig
from pretrain.data.workers import exit_with_main, fork_server_context
from pretrain.errors import DataError, require
from pretrain.files import write_atomic

Step = Callable[[int, int], None]
Log = Callable[[str], None]

PROGRESS_S = 30.0  # at most one progress line this often
SHOWN_RANKS = 8  # the ranks a failure names one by one; the rest are counted
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class StageStep(PipelineStep):
    """One task of a stage as datatrove's pipeline step: runs `step(rank, world_size)`, yields nothing."""

    name = "pretrain stage"
    type = "pretrain"

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.step = step

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Any]:
        self.step(rank, world_size)
        yield from ()


def run_stage(
    data: DataConfig,
    logs: Path,
    stage: str,
    step: Step,
    tasks: int,
    *,
    log: Log | None = None,
) -> None:
    """Runs every task of the stage not already completed (datatrove's skip_completed) on data.executor, and returns
    when all are completed. Raises pretrain.errors.DataError naming the stage, the executor, the ranks that did not
    complete and where their logs are, when any task failed or was killed (kill -9 included): rerunning the same
    prepare then reruns only those.

    `logs` is the stage's datatrove logging_dir; it persists between prepares. With data.executor 'slurm' or
    'ray' it, the dataset, the code and the venv must be on a file system every node sees at the same paths."""
    if tasks < 1:
        raise ValueError(f"stage {stage!r}: tasks must be at least 1, got {tasks}")
    say = log or (lambda line: None)
    logs.mkdir(parents=True, exist_ok=True)
    if data.executor == "local":
        failed = _run_local(data, logs, stage, step, tasks, say)
    elif data.executor == "slurm":
        failed = _run_slurm(data, logs, stage, step, tasks, say)
    else:
        failed = _run_ray(data, logs, stage, step, tasks, say)
    failed.update({r: "" for r in _incomplete(logs, tasks) if r not in failed})
    if failed:
        raise DataError(_failure(data, logs, stage, tasks, failed))
    say(f"stage {stage}: {tasks}/{tasks} tasks done")


# ---------------------------------------------------------------------------------------------
# what every executor shares: the markers, the message, datatrove's log lines


def _incomplete(logs: Path, tasks: int) -> list[int]:
    """The ranks without datatrove's completion marker."""
    done = {p.name for p in (logs / "completions").glob("*")}
    return [r for r in range(tasks) if f"{r:05d}" not in done]


def _task_log(logs: Path, rank: int) -> Path:
    return logs / "logs" / f"task_{rank:05d}.log"


def _failure(data: DataConfig, logs: Path, stage: str, tasks: int, failed: dict[int, str]) -> str:
    """One sentence: the stage, the executor, each rank that did not complete (why, where its log is), the fix."""
    ranks = sorted(failed)
    shown = [
        f"rank {r} ({failed[r] + ', ' if failed[r] else ''}log {_task_log(logs, r)})"
        for r in ranks[:SHOWN_RANKS]
    ]
    more = f" and {len(ranks) - SHOWN_RANKS} more" if len(ranks) > SHOWN_RANKS else ""
    where = f", Slurm's output in {logs / 'slurm_logs'}" if data.executor == "slurm" else ""
    return (
        f"data prepare stage {stage!r} (data.executor {data.executor!r}): {len(ranks)} of {tasks} tasks did not "
        f"complete: {', '.join(shown)}{more}{where}: fix what their logs name and rerun the prepare, which "
        "reruns only the tasks that did not complete"
    )


class _Discard:
    """A stderr that drops what is written: datatrove's per-task log lines, which it also writes to the task's log."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _datatrove_quiet() -> Iterator[None]:
    """datatrove's log lines of this process off the terminal (its executors log every launch and wait)."""
    logger.disable("datatrove")
    try:
        yield
    finally:
        logger.enable("datatrove")


def _progress(say: Log, stage: str, tasks: int, before: int, todo: int, where: str) -> None:
    done = f" ({before} done before)" if before else ""
    say(f"stage {stage}: {todo} of {tasks} tasks to run {where}{done}")


def _import_paths(step: Step) -> list[str]:
    """Where `pretrain` and the step's module are imported from (unless from site-packages, which the
    same interpreter finds by itself), then this process's PYTHONPATH: what another process of this
    interpreter needs to unpickle the step."""
    site_dirs = {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    paths: list[str] = []
    for name in ("pretrain", type(step).__module__.partition(".")[0]):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file is None:
            continue
        where = Path(file).resolve()
        root = str(where.parents[1] if where.name == "__init__.py" else where.parent)
        if root not in site_dirs and root not in paths:
            paths.append(root)
    extra = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return paths + [p for p in extra if p and p not in paths]


# ---------------------------------------------------------------------------------------------
# one task, through datatrove's public API: the executor of that one rank, run where it is


def _run_rank(step: Step, tasks: int, logs: Path, rank: int) -> None:
    """Task `rank` of `tasks` by datatrove's own executor for that one rank (`local_tasks=1` at
    `local_rank_offset=rank`, one worker: it runs in this process), so its task log, stats and
    completion marker are datatrove's. Its log lines go to the task's log, not to stderr. Whatever
    this process forks meanwhile (the executor's manager process) dies with it, kill -9 included."""
    executor = LocalPipelineExecutor(
        pipeline=[StageStep(step)],
        tasks=tasks,
        workers=1,
        local_tasks=1,
        local_rank_offset=rank,
        logging_dir=str(logs),
        skip_completed=True,
    )
    _Forks.watch()
    _Forks.task_pid = os.getpid()
    try:
        with contextlib.redirect_stderr(_Discard()):
            executor.run()
    finally:
        _Forks.task_pid = 0


class _Forks:
    """While a task runs, a process it forks gets SIGKILL when the task's process ends (Linux's
    PR_SET_PDEATHSIG): datatrove's executor starts a manager process that would outlive a killed task."""

    task_pid = 0  # the process running a task, while it runs one
    watching = False

    @classmethod
    def watch(cls) -> None:
        if not cls.watching and sys.platform == "linux":
            os.register_at_fork(after_in_child=cls._die_with_task)
            cls.watching = True

    @classmethod
    def _die_with_task(cls) -> None:
        if not cls.task_pid:
            return
        pid, cls.task_pid = cls.task_pid, 0
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != pid:  # the task ended before the line above
            os._exit(1)


def _summary(e: BaseException) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# ---------------------------------------------------------------------------------------------
# local and Ray: one loop starts the tasks, `n` at once, and notes each that ends


class _Runner(Protocol):
    """Where the tasks of a stage run: this process, this host's processes, or Ray."""

    def start(self, rank: int) -> None: ...

    def ended(self) -> list[tuple[int, str | None]]:
        """Waits for a task to end; each task that ended since, with why it did not complete (None: it did)."""
        ...

    def stop(self) -> None:
        """Stops every task still running, now."""
        ...


def _schedule(
    runner: _Runner, n: int, *, logs: Path, stage: str, tasks: int, todo: list[int], say: Log
) -> dict[int, str]:
    """The tasks `todo` on `runner`, `n` at once. A task that fails or is killed is noted and the
    others go on; a Ctrl-C (or any error here) stops every running task before it is raised."""
    pending = list(reversed(todo))
    running: set[int] = set()
    failed: dict[int, str] = {}
    done, shown = tasks - len(todo), time.monotonic()
    try:
        while pending or running:
            while pending and len(running) < n:
                rank = pending.pop()
                runner.start(rank)
                running.add(rank)
            for rank, why in runner.ended():
                running.discard(rank)
                if why is None and (logs / "completions" / f"{rank:05d}").is_file():
                    done += 1
                    continue
                failed[rank] = why or "it ended without completing"
                say(f"stage {stage}: task {rank} did not complete ({failed[rank]}), the others go on")
            if time.monotonic() - shown >= PROGRESS_S:
                say(f"stage {stage}: {done}/{tasks} tasks done")
                shown = time.monotonic()
    finally:
        if running:
            runner.stop()
    return failed


@dataclass
class _InProcess:
    """data.workers 0: each task in this process, when it is started."""

    step: Step
    tasks: int
    logs: Path
    outcomes: list[tuple[int, str | None]] = field(default_factory=list)

    def start(self, rank: int) -> None:
        try:
            _run_rank(self.step, self.tasks, self.logs, rank)
            self.outcomes.append((rank, None))
        except Exception as e:
            self.outcomes.append((rank, _summary(e)))

    def ended(self) -> list[tuple[int, str | None]]:
        outcomes, self.outcomes = self.outcomes, []
        return outcomes

    def stop(self) -> None:
        pass


class _Processes:
    """A process per task on this host, started by a fork server (its imports done once)."""

    def __init__(self, step: Step, tasks: int, logs: Path) -> None:
        self.step, self.tasks, self.logs = step, tasks, logs
        self.ctx = fork_server_context(__name__, type(step).__module__)
        self.running: dict[int, tuple[multiprocessing.process.BaseProcess, Connection]] = {}

    def start(self, rank: int) -> None:
        ours, theirs = self.ctx.Pipe()
        task = self.ctx.Process(
            target=_task_process, args=(self.step, self.tasks, self.logs, rank, theirs), daemon=True
        )
        task.start()
        theirs.close()
        self.running[rank] = (task, ours)

    def ended(self) -> list[tuple[int, str | None]]:
        sentinels = set(multiprocessing.connection.wait([proc.sentinel for proc, _ in self.running.values()]))
        outcomes: list[tuple[int, str | None]] = []
        for rank in [r for r, (proc, _) in self.running.items() if proc.sentinel in sentinels]:
            proc, pipe = self.running.pop(rank)
            proc.join()
            outcomes.append((rank, None if proc.exitcode == 0 else _ended(proc, pipe)))
            pipe.close()
        return outcomes

    def stop(self) -> None:
        for proc, _ in self.running.values():
            proc.kill()
        for proc, pipe in self.running.values():
            proc.join()
            pipe.close()
        self.running.clear()


def _task_process(step: Step, tasks: int, logs: Path, rank: int, main: Connection) -> None:
    """A task's own process: Ctrl-C is the main process's to handle, it ends when the main process is gone
    (even by kill -9), and what a failed task raised goes back to the main process in a line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_main, args=(main,), daemon=True).start()
    try:
        _run_rank(step, tasks, logs, rank)
    except Exception as e:
        with contextlib.suppress(OSError):
            main.send_bytes(_summary(e).encode())
        sys.stderr.flush()
        os._exit(1)


def _ended(proc: multiprocessing.process.BaseProcess, pipe: Connection) -> str:
    """Why a task's process ended without completing: what it raised, or the signal that killed it."""
    code = proc.exitcode or 0
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        return f"killed by {name}" + (", out of memory?" if code == -signal.SIGKILL else "")
    with contextlib.suppress(OSError, EOFError):
        if pipe.poll():
            return pipe.recv_bytes().decode(errors="replace")
    return f"exit status {code}"


def _run_local(data: DataConfig, logs: Path, stage: str, step: Step, tasks: int, say: Log) -> dict[int, str]:
    todo = _incomplete(logs, tasks)
    if not todo:
        return {}
    n = data.workers if data.workers is not None else len(os.sched_getaffinity(0))
    _progress(say, stage, tasks, tasks - len(todo), len(todo), "on this host" if n else "in this process")
    runner: _Runner = _Processes(step, tasks, logs) if n else _InProcess(step, tasks, logs)
    return _schedule(
        runner, max(1, min(n, len(todo))), logs=logs, stage=stage, tasks=tasks, todo=todo, say=say
    )


# ---------------------------------------------------------------------------------------------
# slurm


class _SlurmExecutor(SlurmPipelineExecutor):
    """datatrove's Slurm executor, through two of its public methods: without the --partition it
    always renders (None: the cluster's default partition), and without its stats-merging job,
    which would wait forever in the queue for an array that failed (its dependency is afterok)."""

    def get_sbatch_args(self, max_array: int = 1) -> dict[str, Any]:
        args: dict[str, Any] = super().get_sbatch_args(max_array)
        if self.partition is None:
            args.pop("partition", None)
        return args

    def launch_merge_stats(self) -> None:
        pass


@dataclass
class _JobIds:
    """datatrove's job id retriever, keeping every id it reads off sbatch (one array per 1001 tasks)."""

    ids: list[str] = field(default_factory=list)

    def __call__(self, sbatch_output: str) -> str:
        self.ids.append(sbatch_output.split()[-1])
        return self.ids[-1]


def _slurm_env_command(logs: Path, step: Step) -> str:
    """The job's first command: this interpreter's `launch_pickled_pipeline` first on PATH (a wrapper
    in `logs`, which every node sees), and this process's import paths."""
    bin_dir = logs / "bin"
    bin_dir.mkdir(exist_ok=True)
    wrapper = bin_dir / "launch_pickled_pipeline"
    write_atomic(
        wrapper,
        f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m datatrove.tools.launch_pickled_pipeline "$@"\n',
    )
    wrapper.chmod(0o755)
    pythonpath = os.pathsep.join(_import_paths(step))
    return f'export PATH={shlex.quote(str(bin_dir))}:"$PATH" PYTHONPATH={shlex.quote(pythonpath)}'


def _run_slurm(data: DataConfig, logs: Path, stage: str, step: Step, tasks: int, say: Log) -> dict[int, str]:
    if shutil.which("sbatch") is None:
        raise DataError(
            f"data prepare stage {stage!r}: data.executor 'slurm' needs Slurm's sbatch on this host (the login "
            "node), and there is none on PATH: run the prepare on a host that submits Slurm jobs, or set "
            "data.executor to 'local' or 'ray'"
        )
    todo = _incomplete(logs, tasks)
    if not todo:
        return {}
    slurm = data.slurm
    ids = _JobIds()
    executor = _SlurmExecutor(
        pipeline=[StageStep(step)],
        tasks=tasks,
        time=slurm.time,
        partition=slurm.partition,
        cpus_per_task=slurm.cpus_per_task,
        workers=data.workers or -1,
        job_name=f"pretrain-{stage}",
        qos=slurm.qos,
        env_command=_slurm_env_command(logs, step),
        logging_dir=str(logs),
        skip_completed=True,
        job_id_retriever=ids,
        # Whole megabytes: sbatch takes no fractional gigabytes.
        sbatch_args={"mem-per-cpu": f"{max(1, round(slurm.mem_per_cpu_gb * 1024))}M"},
        mail_user=None,
    )
    _progress(say, stage, tasks, tasks - len(todo), len(todo), "on Slurm")
    try:
        with _datatrove_quiet():
            executor.run()
    except subprocess.CalledProcessError as e:
        raise DataError(
            f"data prepare stage {stage!r}: sbatch refused the stage's job array (exit status {e.returncode}, "
            "its error above): check data.slurm (partition, qos, time, cpus_per_task, mem_per_cpu_gb) against "
            "what the cluster allows"
        ) from None
    if ids.ids:
        say(f"stage {stage}: Slurm job {', '.join(ids.ids)}, logs in {logs}")
        _wait_for_jobs(ids.ids, logs, stage, tasks, say)
    return {}


def _wait_for_jobs(ids: list[str], logs: Path, stage: str, tasks: int, say: Log) -> None:
    """Until no task of the job arrays is in Slurm's queue (pending, running, requeued or completing).
    Polls squeue every second at first, then less often, up to every 30 s. An interrupt cancels them."""
    start = shown = time.monotonic()
    failures = 0
    try:
        while True:
            res = subprocess.run(
                ["squeue", "-h", "-o", "%i", "-j", ",".join(ids)], capture_output=True, text=True
            )
            if res.returncode == 0 and not res.stdout.strip():
                return
            if res.returncode != 0 and "invalid job id" in res.stderr.lower():
                return  # gone from slurmctld's memory: long finished
            failures = failures + 1 if res.returncode != 0 else 0
            if failures >= 20:
                raise DataError(
                    f"data prepare stage {stage!r}: squeue failed 20 times in a row while waiting for Slurm job "
                    f"{', '.join(ids)} ({res.stderr.strip()}): check that slurmctld answers, then rerun the "
                    "prepare, which goes on where the job left off"
                )
            elapsed = time.monotonic() - start
            if time.monotonic() - shown >= PROGRESS_S:
                say(f"stage {stage}: {tasks - len(_incomplete(logs, tasks))}/{tasks} tasks done")
                shown = time.monotonic()
            time.sleep(min(30.0, 1.0 + elapsed / 20))
    except BaseException:
        subprocess.run(["scancel", *ids], capture_output=True)
        raise


# ---------------------------------------------------------------------------------------------
# ray


RAY = "a prepare's tasks on Ray (data.executor 'ray')"


def _run_ray(data: DataConfig, logs: Path, stage: str, step: Step, tasks: int, say: Log) -> dict[int, str]:
    ray = require("ray", RAY, "ray")  # a second or two to import: only where it runs
    todo = _incomplete(logs, tasks)
    if not todo:
        return {}
    with _ray_session(ray, data, stage):
        _progress(say, stage, tasks, tasks - len(todo), len(todo), "on Ray")
        runner = _RayTasks(ray, data, step, tasks, logs)
        n = data.workers or len(todo)
        return _schedule(runner, n, logs=logs, stage=stage, tasks=tasks, todo=todo, say=say)


@contextlib.contextmanager
def _ray_session(ray: Any, data: DataConfig, stage: str) -> Iterator[None]:
    """Connected to the Ray cluster at data.ray.address (or to an instance started here), with no
    usage stats sent, here or in the processes this starts; what this started stops at the end."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    started = not ray.is_initialized()
    if started:
        address = data.ray.address or "local"
        try:
            ray.init(
                address=address,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,  # not its notes on starting an instance and on tokens
                configure_logging=True,
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise DataError(
                f"data prepare stage {stage!r}: cannot reach the Ray cluster at data.ray.address {address!r} "
                f"({_summary(e)}): start it (ray start --head on its head node) or correct data.ray.address"
            ) from None
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class _RayTasks:
    """A Ray task per task, none retried (a failed one is named with what it raised, a killed one as
    killed), in workers that start with this interpreter and this process's import paths."""

    def __init__(self, ray: Any, data: DataConfig, step: Step, tasks: int, logs: Path) -> None:
        self.ray, self.step, self.tasks, self.logs = ray, step, tasks, logs
        runtime_env = {
            "py_executable": sys.executable,
            "env_vars": {"PYTHONPATH": os.pathsep.join(_import_paths(step)), "RAY_USAGE_STATS_ENABLED": "0"},
        }
        self.task = ray.remote(_run_rank).options(
            num_cpus=data.ray.cpus_per_task, max_retries=0, runtime_env=runtime_env
        )
        self.running: dict[Any, int] = {}

    def start(self, rank: int) -> None:
        self.running[self.task.remote(self.step, self.tasks, self.logs, rank)] = rank

    def ended(self) -> list[tuple[int, str | None]]:
        ray = self.ray
        ready, _ = ray.wait(list(self.running), num_returns=1)
        outcomes: list[tuple[int, str | None]] = []
        for ref in ready:
            rank = self.running.pop(ref)
            try:
                ray.get(ref)
                outcomes.append((rank, None))
            except ray.exceptions.RayTaskError as e:
                outcomes.append((rank, _summary(e.cause) if e.cause is not None else "it raised"))
            except ray.exceptions.RayError as e:  # its worker died: a signal, the OOM killer, a lost node
                outcomes.append((rank, f"its Ray worker died ({type(e).__name__}), out of memory?"))
        return outcomes

    def stop(self) -> None:
        for ref in self.running:
            with contextlib.suppress(Exception):
                self.ray.cancel(ref, force=True)
        self.running.clear()
