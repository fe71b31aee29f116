"""Files that are either whole or absent, and sizes as people read them.

Every file the package writes goes through `AtomicFile`: written under a temporary name next to
its final one, flushed and fsynced, renamed into place, and its directory fsynced. A crash at any
moment leaves the previous file (or none), never a torn one. A directory built in one piece (a
dataset, an export, a universal checkpoint) is staged beside its final name and swapped in by
`replace_dir`, and only over a new or empty directory or a previous output of the same command
(`check_output_dir`); a single file likewise only over none or a previous output (`not_ours`):
never over what a person put there.

`FileLock` is the OS lock (flock) a command holds on a lock file beside what it writes, so that a
second writer is refused, and readers, while it writes.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import hashlib
import itertools
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from pretrain.errors import PretrainError

NAME_MAX = 255  # bytes in one file name (Linux, macOS)
_ADDED = 24  # room for what is added to a name beside it: ".tmp-<pid>", ".old-<pid>", ".lock", a leading "."


def short_name(name: str) -> str:
    """`name`, or where what is added to it beside it would pass the 255 bytes a file name may
    have, its start and a short hash of the whole (still its own, and the same in every process)."""
    raw = name.encode()
    if len(raw) + _ADDED <= NAME_MAX:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:12]
    return f"{raw[: NAME_MAX - _ADDED - len(digest) - 1].decode(errors='ignore')}~{digest}"


def temp_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (this process's own name)."""
    return path.with_name(f"{short_name(path.name)}.tmp-{os.getpid()}")


def staging_dir(out: Path) -> Path:
    """Where a directory that `replace_dir` puts at `out` is built: beside the directory `out` is
    (where `out` is a link, the one it points to, so that the final rename stays on its file
    system), under a hidden name of this process's that fits whatever the name of `out`."""
    real = Path(os.path.realpath(out))
    return real.with_name(f".{short_name(real.name)}.tmp-{os.getpid()}")


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicFile:
    """A file open for writing under a temporary name; `commit()` puts it at `path`, `discard()`
    removes it. As a context manager it commits on success and discards on an exception."""

    def __init__(self, path: str | Path, mode: str = "wb") -> None:
        self.path = Path(path)
        self.tmp = temp_name(self.path)
        self.f: IO[Any] = open(self.tmp, mode, encoding=None if "b" in mode else "utf-8")  # noqa: SIM115

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def discard(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> IO[Any]:
        return self.f

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.discard()
                raise
        else:
            self.discard()


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` atomically and durably."""
    with AtomicFile(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def default_mode(path: Path) -> None:
    """Give a file another library wrote (safetensors creates 0600 files) the mode `open()` gives
    new files: readable by others unless the umask says otherwise."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def replace_dir(staging: Path, out: Path) -> None:
    """Put the finished directory `staging` (built at `staging_dir(out)`) at `out`: its files are
    fsynced, whatever was at `out` is renamed aside, the new one renamed in, and only then the old
    one deleted. A link at `out` is written through and kept: what it points to is replaced."""
    for p in staging.rglob("*"):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(staging)
    out = Path(os.path.realpath(out))
    if out.exists():
        old = out.with_name(f".{short_name(out.name)}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)
    fsync_dir(out.parent)


def make_dir(path: Path, flag: str, error: type[PretrainError] = PretrainError) -> None:
    """Create the directory `path` (and its parents), or one error naming `flag` and why not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise error(f"{flag} {path}: {file} is a file, not a directory; choose a directory") from e
    except OSError as e:
        raise error(f"{flag} {path}: cannot create it ({e.strerror or e})") from e


def _within(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def check_output_dir(
    out: Path,
    is_previous: Callable[[Path], bool] | None,
    what: str,
    flag: str,
    *,
    is_own_entry: Callable[[Path], bool] | None = None,
    sources: Sequence[Path] = (),
    no_inside: Sequence[Path] = (),
    error: type[PretrainError] = PretrainError,
) -> None:
    """Refuse an output directory whose replacement would lose something this command did not
    write. `out` may be new, empty, or a previous output of the same command (`is_previous`: then it
    is replaced whole, atomically; or, entry by entry, `is_own_entry`: then the error lists the
    entries that are not); never one of `sources` or a directory holding one, nor a directory
    inside one of `no_inside`. The error names `flag`, the setting to change."""
    real = out.resolve()
    for src in sources:
        if _within(src.resolve(), real):
            where = "is" if src.resolve() == real else "holds"
            raise error(
                f"{flag} {out} {where} the {what}'s source {src}; writing there would replace what it "
                f"reads: choose a new directory for {flag}"
            )
    for src in no_inside:
        if _within(real, src.resolve()):
            raise error(
                f"{flag} {out} is inside {src}, which the {what} reads: choose a directory outside it"
            )
    if not out.exists():
        if out.is_symlink() and not real.parent.is_dir():
            raise error(
                f"{flag} {out}: a link to {real}, whose directory {real.parent} does not exist; create "
                f"it, or point {flag} elsewhere"
            )
        return  # new; or a link to a new directory, which is written through the link
    if not out.is_dir():
        raise error(f"{flag} {out}: exists and is not a directory; choose a new directory for {flag}")
    if is_own_entry is not None:
        foreign, kind = sorted(p.name for p in out.iterdir() if not is_own_entry(p)), f"part of a {what}"
    else:
        entries = sorted(p.name for p in out.iterdir())
        previous = is_previous is not None and is_previous(out)
        foreign, kind = ([] if previous else entries), f"a previous {what}"
    if foreign:
        listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise error(
            f"{flag} {out}: holds files that are not {kind} ({listed}); refusing to replace "
            f"them: choose a new or empty directory for {flag}"
        )


def read_bytes(path: Path) -> bytes | None:
    """The bytes of the regular file at `path`; None where there is none or it cannot be read."""
    try:
        return path.read_bytes() if path.is_file() else None
    except OSError:
        return None


def not_ours(paths: Iterable[Path], is_previous: Callable[[bytes], bool]) -> list[Path]:
    """Of the files a command is about to write, those it must not overwrite: something is there
    (a file, a directory, a link) that is not a readable previous output of the command
    (`is_previous`, on its bytes). The caller's error names them and the setting to change."""
    return [
        p
        for p in paths
        if (p.exists() or p.is_symlink()) and ((data := read_bytes(p)) is None or not is_previous(data))
    ]


def format_bytes(n: float) -> str:
    """A size in decimal units: "512 B", "3.2 MB", "1000.0 TB"."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def read_csv(path: Path) -> list[dict[str, float | None]]:
    """A CSV of numbers (metrics.csv) back as numbers; empty cells are None."""
    with path.open(newline="") as f:
        return [
            {k: (float(v) if v not in ("", None) else None) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]


def read_csv_tolerant(
    path: Path, columns: Iterable[str], max_line: int = 1 << 16
) -> tuple[list[str], list[dict[str, float | None]], list[int]]:
    """The numbers in `columns` of a CSV (metrics.csv) from a file that may be damaged or edited:
    its header, its rows, and the line numbers of the rows left out because they are not numbers
    there (a cell that is not a number, more cells than the header, bytes that are not UTF-8 text,
    a line longer than `max_line` bytes). Empty or missing cells are None; other columns are not
    read. Reading never fails on content."""
    wanted = set(columns)
    header: list[str] | None = None
    rows: list[dict[str, float | None]] = []
    bad: list[int] = []
    with path.open("rb") as f:
        for lineno in itertools.count(1):
            raw = f.readline(max_line)
            if not raw:
                break
            if len(raw) == max_line and not raw.endswith(b"\n"):  # skip the rest of a line that long
                while (rest := f.readline(max_line)) and not rest.endswith(b"\n"):
                    pass
                bad.append(lineno)
                continue
            try:
                cells = next(csv.reader([raw.decode("utf-8").rstrip("\r\n")]), [])
            except (UnicodeDecodeError, csv.Error):
                bad.append(lineno)
                continue
            if header is None:
                header = [c.strip() for c in cells]
                continue
            if not cells:
                continue  # a blank line
            try:
                if len(cells) > len(header):
                    raise ValueError("more cells than the header")
                row: dict[str, float | None] = dict.fromkeys(wanted)
                row.update(
                    {
                        k: float(v) if v.strip() else None
                        for k, v in zip(header, cells, strict=False)
                        if k in wanted
                    }
                )
            except ValueError:
                bad.append(lineno)
                continue
            rows.append(row)
    return header or [], rows, bad


# ---------------------------------------------------------------------------------------------
# Locks


class FileLock:
    """An OS lock (flock) on the file `path`: shared (readers) or exclusive (one writer, which
    writes who it is into the file: `what`, host, pid, since when). It dies with its process,
    kill -9 included, so nothing stale is ever left to clean up; `release` removes the file when
    no other process holds it. Where the file cannot be made (a read-only directory) or the file
    system has no locks, `acquire` succeeds without a lock (`locked` is False): readers of a
    dataset on read-only storage still read it."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self.fd: int | None = None
        self.mode: int | None = None  # fcntl.LOCK_SH or LOCK_EX while held
        self.locked = False

    def acquire(self, *, exclusive: bool, wait: bool = False) -> bool:
        """Take the lock; False if another process holds it in a conflicting mode (never with
        `wait`, which blocks until it is free). Any lock this object held before is dropped first."""
        self.release(remove=False)
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError:
                try:
                    fd = os.open(self.path, os.O_RDONLY)  # a reader's lock needs no write access
                except OSError:
                    return self._unlocked(mode)
            try:
                fcntl.flock(fd, mode | (0 if wait else fcntl.LOCK_NB))
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    return False
                return self._unlocked(mode)  # ENOLCK, EOPNOTSUPP...: no locks on this file system
            # The holder before us may have removed the file (and another process made a new one)
            # between our open and our lock: then ours is the lock of no file; take that one's.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except OSError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd, self.mode, self.locked = fd, mode, True
        if exclusive:
            since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            line = f"{self.what}, host {socket.gethostname()}, pid {os.getpid()}, since {since}\n"
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, line.encode(), 0)
            except OSError:
                pass  # opened read-only: the lock holds, it just names no one
        return True

    def _unlocked(self, mode: int) -> bool:
        self.fd, self.mode, self.locked = None, mode, False
        return True

    def release(self, *, remove: bool = True) -> None:
        """Drop the lock; with `remove`, delete the file unless another process holds it too."""
        if self.fd is None:
            self.mode = None
            return
        fd, self.fd, self.mode, self.locked = self.fd, None, None, False
        try:
            if remove:
                try:
                    # Exclusive now (a reader converts: if another holds it, it simply fails).
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                        os.unlink(self.path)
                except OSError:
                    pass
        finally:
            os.close(fd)  # closing drops the lock

    def holder(self) -> str:
        """Who holds the lock, in words: the exclusive holder's own line, or the processes on this
        host that hold it (from /proc/locks, Linux), with their command lines."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return "a process that has released it since"
        try:
            line = os.pread(fd, 512, 0).decode("utf-8", errors="replace").strip()
            holders = _lock_holders(os.fstat(fd))
        finally:
            os.close(fd)
        writers = [h for h in holders if h[1] == "WRITE"]
        if line and (writers or not holders):
            return line  # the writer wrote it: on this host, or another one
        if holders:
            return "; ".join(f"pid {pid} on this host ({_command_line(pid)})" for pid, _ in holders[:3]) + (
                f" and {len(holders) - 3} more" if len(holders) > 3 else ""
            )
        return "another process (on another host, or one /proc/locks does not list)"


def _lock_holders(st: os.stat_result) -> list[tuple[int, str]]:
    """(pid, READ or WRITE) of every other process on this host holding a flock on the file `st`."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found: dict[int, str] = {}
    for line in lines:
        parts = line.split()  # "1: FLOCK  ADVISORY  READ 1234 fe:00:5308674 0 EOF"; waiters have "->"
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == key and parts[4].isdigit():
            pid = int(parts[4])
            if pid != os.getpid():
                found.setdefault(pid, parts[3])
    return sorted(found.items())


def pid_gone(pid: int) -> bool:
    """The process `pid` (on this host) has exited: no such process, or a zombie not yet reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "command unknown"
    words = [w.decode("utf-8", errors="replace") for w in raw.split(b"\0") if w]
    words[:1] = [Path(words[0]).name] if words else []
    text = " ".join(words)
    return text if len(text) <= 120 else text[:117] + "..."
