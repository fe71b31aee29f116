"""The run dir: what a run records about itself at start (resolved config, DeepSpeed JSON, versions,
code), and the lock that keeps a second run out of it while one uses it."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from pretrain.config.tree import RunConfig, to_yaml
from pretrain.errors import OutputError
from pretrain.files import write_atomic

PACKAGES = ["pretrain", "torch", "deepspeed", "numpy", "pydantic", "tiktoken", "mpi4py"]


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    try:
        import torch  # loaded already where a run records its versions

        out["cuda"] = str(torch.version.cuda)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return out


def code_version() -> dict[str, Any]:
    """The git commit of this source tree, and whether it had uncommitted changes."""
    root = Path(__file__).resolve().parents[2]  # pretrain/training/rundir.py -> the source tree

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def record(run_dir: Path, cfg: RunConfig, ds_config: dict[str, Any]) -> None:
    """Write the run's identity next to its logs and checkpoints (rank 0 only)."""
    write_atomic(run_dir / "config.yaml", to_yaml(cfg))
    write_atomic(run_dir / "ds_config.json", json.dumps(ds_config, indent=2) + "\n")
    info = {"versions": package_versions(), "code": code_version(), "argv": sys.argv}
    write_atomic(run_dir / "versions.json", json.dumps(info, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# One run per run dir

LOCK = ".lock"
# What a run writes at the top of its run dir (besides its checkpoints dir and monitor dirs).
RUN_FILES = ("config.yaml", "ds_config.json", "versions.json", "metrics.csv")


class RunDirLock:
    """An exclusive OS lock on `RUN_DIR/.lock`, held by rank 0 for the whole run. It dies with its
    process (kill -9 included), so nothing stale is ever left to clean up; the file itself stays and
    names the last holder."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(
                fd, fcntl.LOCK_EX | fcntl.LOCK_NB
            )  # on NFS, Linux takes it as a POSIX lock: all hosts see it
        except OSError as e:
            holder = os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip() or "unknown holder"
            os.close(fd)
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise OutputError(f"{self.path}: cannot lock the run dir ({e.strerror or e})") from e
            raise OutputError(
                f"run dir {self.path.parent} is in use by another run ({holder}); two runs in one run dir "
                "would mix their checkpoints: wait for it to end or stop it, or set logging.run_dir to "
                "another directory"
            ) from e
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
            self.fd = None


class CheckpointDirLock:
    """An exclusive OS lock on the checkpoint dir itself (flock of the directory: no file is added
    to it), held by rank 0 for the whole run beside the run dir's: two runs with their own run dirs
    but one `checkpoint.dir` would otherwise prune each other's checkpoints. Where the file system
    cannot lock a directory (NFS takes flock as a POSIX lock, which needs a file open for writing),
    the lock is a `.lock` file in it."""

    def __init__(self, ckpt_dir: Path) -> None:
        self.path = ckpt_dir
        self.lock: RunDirLock | None = None
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise OutputError(
                    f"checkpoint dir {self.path} is in use by another run (with a run dir of its own); two runs "
                    "saving into one checkpoint dir would delete each other's checkpoints: set checkpoint.dir "
                    "to another directory"
                ) from e
            self.lock = RunDirLock(self.path)  # a file lock instead
            try:
                self.lock.acquire()
            except OutputError as again:
                raise OutputError(str(again).replace("run dir", "checkpoint dir", 1)) from e
            return
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def holder(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s lock now (host, pid, since), or None if no run does. Takes nothing."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip() or "unknown holder"
    finally:
        os.close(fd)
    return None


_HELD: dict[str, RunDirLock | CheckpointDirLock] = {}  # this process's locks, released when it exits


def is_run_dir(run_dir: Path) -> bool:
    """`run_dir` holds a run's record (written by `record`): this program's to write into."""
    try:
        info = json.loads((run_dir / "versions.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and {"versions", "argv"} <= info.keys()


def claim(run_dir: Path, ckpt_dir: Path) -> RunDirLock:
    """Make `run_dir` this run's: create it, refuse one that holds files of the names a run writes
    that no run wrote (a person's own config.yaml is never overwritten), and lock it and the
    checkpoint dir (`CheckpointDirLock`)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        file = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), run_dir)
        raise OutputError(
            f"logging.run_dir {run_dir}: {file} is a file, not a directory; set logging.run_dir to a directory"
        ) from e
    except OSError as e:
        raise OutputError(f"logging.run_dir {run_dir}: cannot create it ({e.strerror or e})") from e
    if not is_run_dir(run_dir):
        names = (*RUN_FILES, ckpt_dir.name) if ckpt_dir.parent == run_dir else RUN_FILES
        foreign = [n for n in names if (run_dir / n).exists() or (run_dir / n).is_symlink()]
        if foreign:
            raise OutputError(
                f"logging.run_dir {run_dir}: holds {', '.join(foreign)} but no run's record (versions.json); "
                "a run would overwrite them: set logging.run_dir to a new or empty directory"
            )
    key = str(run_dir.resolve())
    for held in (key, f"{key} checkpoints"):  # this process ran in this dir before (runs one after another)
        if held in _HELD:
            _HELD.pop(held).release()
    lock = _HELD[key] = RunDirLock(run_dir)
    try:
        lock.acquire()
    except PermissionError as e:
        raise OutputError(f"logging.run_dir {run_dir}: not writable ({e.strerror}); make it writable") from e
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        return lock  # no checkpoint dir to lock: `checkpoint.preflight` names the problem and the fix
    ckpt_lock = CheckpointDirLock(ckpt_dir)
    try:
        ckpt_lock.acquire()
    except BaseException:
        _HELD.pop(key).release()
        raise
    _HELD[f"{key} checkpoints"] = ckpt_lock
    return lock
