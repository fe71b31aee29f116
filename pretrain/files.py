"""Files that are either whole or absent, and sizes as people read them.

Every file the package writes goes through `AtomicFile`: written under a temporary name next to
its final one, flushed and fsynced, renamed into place, and its directory fsynced. A crash at any
moment leaves the previous file (or none), never a torn one. A directory built in one piece (a
dataset, an export, a universal checkpoint) is staged beside its final name and swapped in by
`replace_dir`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import IO, Any


def temp_name(path: Path) -> Path:
    """Where `path` is written before it is renamed into place (this process's own name)."""
    return path.with_name(f"{path.name}.tmp-{os.getpid()}")


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
    """Put the finished directory `staging` at `out`: its files are fsynced, whatever was at
    `out` is renamed aside, the new one renamed in, and only then the old one deleted."""
    for p in staging.rglob("*"):
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(staging)
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)
    fsync_dir(out.parent)


def format_bytes(n: float) -> str:
    """A size in decimal units: "512 B", "3.2 MB", "1000.0 TB"."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
