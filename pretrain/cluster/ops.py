"""DeepSpeed's C++ ops a run loads, and their JIT build: said before it starts, and never a silent wait.

An op that is not built into DeepSpeed (`DS_BUILD_...=1` at install: setup.sh with a CUDA torch, or
with PRETRAIN_BUILD_OPS=1) is compiled on first use into the torch extensions directory
(TORCH_EXTENSIONS_DIR, or ~/.cache/torch_extensions/py311_cpu), under torch's FileBaton: a plain
`lock` file that the builder creates (O_EXCL) and keeps open while it builds, and that every other
process polls, silently, until it is gone. A builder killed mid-build (`kill -9`, OOM, a SIGTERM
without a handler) leaves the file, and every later run then waits on it forever before its first
step. Before `deepspeed.initialize`, `wait_for_op_builds` looks at the lock of each op the config loads:

- no lock: nothing to wait for (a note if the op will be compiled now, and why);
- a process on this host holds it open: a build is running; wait for it, saying whose, and refuse
  if the holder exits leaving the file;
- no process on this host holds it: on a local filesystem no other host can either, so it is stale:
  one error naming the file and the fix. On a network filesystem another host sharing the directory
  may be building; wait, saying so, and call it stale once it is older than any build takes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pretrain.cluster.probe import _extensions_dir
from pretrain.errors import LaunchError

# Filesystems a lock may be shared on between hosts (/proc/self/mountinfo's type; fuse.* too).
NETWORK_FS = {
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "afs",
    "ocfs2", "gfs2", "panfs", "wekafs", "orangefs", "pvfs2", "quobyte", "9p", "virtiofs",
}  # fmt: skip
# No build takes this long (a CUDA FusedAdam for many architectures takes minutes): a lock that old
# on a network filesystem, held by no process here, is stale whoever took it.
STALE_AFTER_S = 30 * 60
POLL_S = 1.0


class BuildLockError(LaunchError):
    """A stale build lock. Every rank of the host sees the same file: its local rank 0 says so, and
    the others exit without a word (a non-zero local rank is never global rank 0, which prints a
    collective error)."""

    def __init__(self, message: str, local_rank: int) -> None:
        super().__init__(message)
        self.collective = local_rank != 0


def needed_ops(ds: dict[str, Any]) -> list[str]:
    """DeepSpeed's C++ ops a rendered DeepSpeed config loads, as its engine picks the optimizer
    (DeepSpeedEngine.get_optimizer_configuration): Adam/AdamW becomes torch.optim.AdamW with
    "torch_adam", DeepSpeedCPUAdam (cpu_adam) when the optimizer is offloaded, FusedAdam otherwise,
    on every accelerator (the CPU accelerator has its own FusedAdam build)."""
    opt = ds.get("optimizer") or {}
    adam = str(opt.get("type", "")).lower() in ("adam", "adamw")
    if not adam or (opt.get("params") or {}).get("torch_adam"):
        return []
    offload = (ds.get("zero_optimization") or {}).get("offload_optimizer") or {}
    return ["cpu_adam"] if offload.get("device") in ("cpu", "nvme") else ["fused_adam"]


def wait_for_op_builds(ds: dict[str, Any]) -> None:
    """Before `deepspeed.initialize`: each op `ds` loads that DeepSpeed JIT-builds is free to build
    or load, waiting (said once, on local rank 0) while a process here builds it; a stale lock is a
    BuildLockError naming the file and the fix. Ops built into DeepSpeed are not looked at."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    def say(line: str) -> None:
        if local_rank == 0:
            print(line, flush=True)

    root = Path(_extensions_dir(torch))
    for op in needed_ops(ds):
        if installed_ops.get(op) and accelerator_name == get_accelerator()._name:
            continue  # loaded from DeepSpeed's package, never built
        build_dir = root / op
        _wait_unlocked(op, build_dir / "lock", say, local_rank)
        if local_rank == 0 and (why := _builds_now(op, build_dir, torch.__file__)):
            say(
                f"building DeepSpeed's {op} op into {build_dir} ({why}; a minute or two): "
                "PRETRAIN_BUILD_OPS=1 ./setup.sh builds it into DeepSpeed once instead"
            )


def _wait_unlocked(op: str, lock: Path, say: Callable[[str], None], local_rank: int) -> None:
    """Return once `lock` is gone; raise BuildLockError if it is stale. See the module docstring."""
    said: set[str] = set()
    while True:
        try:
            st = lock.stat()
        except FileNotFoundError:
            return
        holders = _holders(lock)
        age = time.time() - st.st_mtime
        if holders:
            if "held" not in said:
                say(
                    f"waiting for DeepSpeed's {op} op: {_who(holders)} on this host is building it and holds "
                    f"{lock} (for {age:.0f} s now); this run goes on when it is done"
                )
                said.add("held")
        elif not _on_network_fs(lock) or age > STALE_AFTER_S:
            time.sleep(0.2)  # FileBaton.release closes its file a moment before it removes it
            try:
                if lock.stat().st_ino != st.st_ino or _holders(lock):
                    continue
            except FileNotFoundError:
                return
            raise BuildLockError(_stale(op, lock, st.st_mtime), local_rank)
        elif "remote" not in said:
            say(
                f"waiting for DeepSpeed's {op} op: {lock} was taken {age:.0f} s ago by no process on this host; "
                f"another host sharing {lock.parent.parent} may be building it. If none is, remove it "
                f"(rm {lock}); after {STALE_AFTER_S // 60} min it counts as stale"
            )
            said.add("remote")
        time.sleep(POLL_S)


def _stale(op: str, lock: Path, taken: float) -> str:
    build_dir = lock.parent
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(taken))
    orphans = _working_in(build_dir)
    first = f"stop them first (kill {' '.join(map(str, orphans))}), then " if orphans else ""
    left = (
        f"; compilers of that build still run there ({_who(orphans)}), and would write over a new one"
        if orphans
        else ""
    )
    if (build_dir / f"{op}.so").is_file():
        fix = f"{first}remove the lock (rm {lock}) and start again"
    else:  # nothing was built: start the build from a clean directory
        fix = f"{first}remove the unfinished build (rm -r {build_dir}) and start again: the op is built anew"
    return (
        f"{lock} is a stale lock of DeepSpeed's {op} op build, taken {when} by a build that was interrupted "
        f"(no process on this host holds it{left}), and every run would wait on it forever: {fix}"
    )


def _holders(lock: Path) -> list[int]:
    """The processes on this host that have `lock` open (FileBaton's builder keeps it open)."""
    try:
        st = lock.stat()
    except FileNotFoundError:
        return []
    found = []
    for pid in _pids():
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or another user's (who cannot have built in this user's cache)
            continue
        for fd in fds:
            try:
                f = os.stat(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if (f.st_dev, f.st_ino) == (st.st_dev, st.st_ino):
                found.append(pid)
                break
    return found


def _working_in(build_dir: Path) -> list[int]:
    """The processes whose working directory is `build_dir`: ninja's compilers run there, each in a
    process group of its own, so a `kill -9` of the run's group leaves them compiling."""
    try:
        st = build_dir.stat()
    except OSError:
        return []
    found = []
    for pid in _pids():
        try:
            cwd = os.stat(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if (cwd.st_dev, cwd.st_ino) == (st.st_dev, st.st_ino):
            found.append(pid)
    return found


def _pids() -> list[int]:
    me = os.getpid()
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]
    except OSError:
        return []


def _who(pids: list[int]) -> str:
    def name(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return "?"

    shown = ", ".join(f"{pid} ({name(pid)})" for pid in pids[:4])
    return f"pid{'s' if len(pids) > 1 else ''} {shown}{', ...' if len(pids) > 4 else ''}"


def _on_network_fs(path: Path, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether `path` is on a filesystem other hosts may share (the longest mount point above it)."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return False
    where, best, kind = str(path.resolve()), -1, ""
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        mount = fields[4].replace("\\040", " ")
        fstype = line.split(" - ", 1)[1].split()[0]
        inside = where == mount or where.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best:
            best, kind = len(mount), fstype
    return kind in NETWORK_FS or kind.startswith("fuse.")


def _builds_now(op: str, build_dir: Path, torch_file: str) -> str:
    """Why the op will be compiled now, or '' if torch will load the build in `build_dir` as it is:
    none there yet, or one of another environment (ninja rebuilds it for this one's torch, and that
    environment rebuilds it back on its next run)."""
    if not (build_dir / f"{op}.so").is_file():
        return "first use here"
    try:
        ninja = (build_dir / "build.ninja").read_text(errors="replace")
    except OSError:
        return ""
    ours = str(Path(torch_file).parent / "include")
    if ours not in ninja:
        return (
            "the build there is another environment's, which will build it back in turn: give each "
            f"environment a TORCH_EXTENSIONS_DIR of its own, e.g. {sys.prefix}/torch_extensions"
        )
    return ""
