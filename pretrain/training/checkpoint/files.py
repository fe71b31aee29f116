"""The bytes of a checkpoint: writing DeepSpeed's files without the zip CRC, hashing and fsyncing them
beside the writing, verifying them in parallel, the host snapshot an asynchronous save writes from,
and the `Recorder` that does all of it for DeepSpeed's checkpoint engine interface (store.py's
`RecordingEngine`). What the files mean, and the commit that makes them a checkpoint: store.py.

Where a synchronous save's time went before (gpt2-124m, ZeRO-2, 2 CPU ranks; docs/checkpoints.md):
torch's zip writer computes a CRC-32 of every record (about 45% of `torch.save`), and then the whole
file was read again for its sha256 (1.1 GB/s on one core). The CRC is redundant beside a digest of
the whole file, and BLAKE3 hashes at 5.6 GB/s on one core where sha256 manages 1.1. So the files are
written with `compute_crc32` off, and hashed with BLAKE3 from the page cache through a mapping (no
copy; cheaper, measured, than hashing the stream that torch hands a Python writer, which it copies
into bytes first). Hash and fsync of one file run on a thread while the next file is serialized.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import torch

DIGEST = "blake3"  # the manifest's digest of each file; checkpoints before it have "sha256"
DIGESTS = (DIGEST, "sha256")
HASH_THREADS = min(8, os.cpu_count() or 1)
# The whole file mapped at once (Linux): one call instead of a page fault every 4 KiB.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def digest_key(entry: dict[str, Any]) -> str | None:
    """Which digest a manifest entry carries (the newest first), None for none."""
    return next((k for k in DIGESTS if k in entry), None)


def _hasher(algo: str) -> Any:
    return blake3.blake3() if algo == DIGEST else hashlib.new(algo)


def describe(path: Path, checksum: bool, fsync: bool = False, *, algo: str = DIGEST) -> dict[str, Any]:
    """{"bytes": size, algo: hex digest (with `checksum`)}; `fsync`: the file's data is on disk
    when this returns. The digest reads the file through a mapping of the page cache."""
    out: dict[str, Any] = {"bytes": path.stat().st_size}
    if not (checksum or fsync):
        return out
    with path.open("rb") as f:
        if checksum:
            h = _hasher(algo)
            if out["bytes"]:
                with mmap.mmap(f.fileno(), 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ) as m:
                    h.update(m)  # BLAKE3 and sha256 release the GIL over a large buffer
            out[algo] = h.hexdigest()
        if fsync:
            os.fsync(f.fileno())
    return out


def describe_all(paths: list[Path], checksum: bool, *, algos: list[str] | None = None) -> list[Any]:
    """`describe` of each path on a pool of threads (hashing releases the GIL, so files are hashed on
    as many cores as there are threads); an OSError comes back in the place of its file's entry."""

    def one(i: int) -> Any:
        try:
            return describe(paths[i], checksum, algo=algos[i] if algos else DIGEST)
        except OSError as e:
            return e

    if len(paths) <= 1:
        return [one(i) for i in range(len(paths))]
    with ThreadPoolExecutor(min(HASH_THREADS, len(paths)), thread_name_prefix="verify") as pool:
        return list(pool.map(one, range(len(paths))))


@contextlib.contextmanager
def without_zip_crc() -> Iterator[None]:
    """`torch.save` in this block skips the CRC-32 of each zip record. `torch.load` never checks it,
    and every file's digest in the manifest covers every byte."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # torch before 2.6 always computes it
        yield
        return
    before = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = before


class FileSink:
    """Hash and fsync each file written, on a thread, while the writer goes on to the next file. A
    failure is kept and comes back from `results`. (Measured against fsyncs of every file at the end,
    as DeepSpeed's save followed by an fsync does: 1.0-1.6 s against 2.8-4.5 s for gpt2-124m's 2 GB at
    ZeRO-2 on 2 ranks; the disk writes one file while the next is serialized.)"""

    def __init__(self, checksum: bool) -> None:
        self.checksum = checksum
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="ckpt-hash")
        self._pending: list[tuple[str, Future[dict[str, Any]]]] = []

    def add(self, path: str) -> None:
        self._pending.append((path, self._pool.submit(describe, Path(path), self.checksum, True)))

    def results(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """({path: entry}, [errors]) of every file added, once each is hashed and on disk."""
        written, errors = {}, []
        for path, fut in self._pending:
            try:
                written[path] = fut.result()
            except OSError as e:
                errors.append(f"{path}: {e}")
        self._pending.clear()
        self._pool.shutdown()
        return written, errors


# ---------------------------------------------------------------------------------------------
# The snapshot an asynchronous save writes from


def snapshot(obj: Any, pool: dict[tuple[int, bool], list[torch.UntypedStorage]] | None = None) -> Any:
    """A copy of `obj` (DeepSpeed's state dict of one file) whose tensors live in host memory of its
    own: training goes on changing the originals while the copy is written. Each storage is copied
    once and its tensors rebuilt as the same views of the copy, so that `torch.save` writes the very
    bytes it would have written from the originals. Containers are copied with their type and
    attributes (a module state dict's `_metadata`); plain values are shared, never changed in place.

    `pool`: host buffers of an earlier snapshot, by (bytes, pinned), taken where one fits instead of
    new memory, whose first touch costs more than the copy itself (page faults: 2.5 s against 0.3 s
    for 3.5 GB here)."""
    storages: dict[tuple[str, int], torch.UntypedStorage] = {}

    def copy_tensor(x: torch.Tensor) -> torch.Tensor:
        st = x.untyped_storage()
        key = (str(st.device), st.data_ptr())
        if key not in storages:
            pin = st.device.type == "cuda"  # a pinned buffer lets the copy run at the bus's speed
            free = (pool or {}).get((st.nbytes(), pin))
            host = (
                free.pop()
                if free
                else torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin).untyped_storage()
            )
            storages[key] = host.copy_(st, non_blocking=pin)
        y = torch.empty(0, dtype=x.dtype).set_(storages[key], x.storage_offset(), x.size(), x.stride())
        return torch.nn.Parameter(y, x.requires_grad) if isinstance(x, torch.nn.Parameter) else y

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return copy_tensor(x)
        if isinstance(x, dict):
            out = copy.copy(x)
            for k, v in x.items():
                out[k] = walk(v)
            return out
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            items = [walk(v) for v in x]
            if all(a is b for a, b in zip(items, x, strict=True)):
                return x  # nothing copied inside (a torch.Size, a tuple of numbers): the same object
            return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        return x

    out = walk(obj)
    if any(k[0].startswith("cuda") for k in storages):
        torch.cuda.synchronize()  # the non-blocking copies have landed before training goes on
    return out


def host_available() -> int | None:
    """Bytes of host memory the kernel can give without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def fits_in_host(nbytes: int, headroom: float = 0.25) -> bool:
    """Whether a snapshot of `nbytes` leaves `headroom` of the host's available memory free."""
    free = host_available()
    return free is None or nbytes <= free * (1 - headroom)


def storages(obj: Any) -> list[torch.UntypedStorage]:
    """The distinct storages of the tensors in `obj` (tensors that share one, a tied embedding's or
    views of a flat buffer, count once)."""
    found: dict[tuple[str, int], torch.UntypedStorage] = {}

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            found.setdefault((str(st.device), st.data_ptr()), st)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(obj)
    return list(found.values())


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct storages in `obj`: what its snapshot holds in host memory."""
    return sum(st.nbytes() for st in storages(obj))


# ---------------------------------------------------------------------------------------------
# The writing of one save, on this rank


class Recorder:
    """This rank's files of one save. Each is written (by `write`: DeepSpeed's own `torch.save`)
    without the zip CRC, then hashed and fsynced on a thread while the next is written, and recorded;
    a failed write or directory (a full disk) is recorded instead of raised, so that every rank still
    reaches DeepSpeed's own barriers and all can fail together. While `capture` is on (an asynchronous
    save), each state dict is snapshotted to host memory and kept, and written later by `write_all`.
    `reset` starts each save."""

    def __init__(self, write: Callable[[Any, str], None]) -> None:
        self._write = write
        self.snapshot_seconds = 0.0  # the copies of asynchronous saves, for the benchmark
        self.pool: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self.written_snapshots: list[Any] = []
        self.on_write: Callable[[str], None] | None = None  # test hook, called after each file
        self.reset(checksums=True, capture=False)

    def reset(self, *, checksums: bool, capture: bool) -> None:
        self.checksums, self.capture = checksums, capture
        # The host buffers of the last snapshot, written by now: the next one copies into them (a
        # synchronous save in between keeps them).
        if self.written_snapshots:
            self.pool = {}
            for sd in self.written_snapshots:
                for st in storages(sd):
                    self.pool.setdefault((st.nbytes(), st.is_pinned()), []).append(st)
            self.written_snapshots = []
        self.sink = FileSink(checksums)
        self.captured: list[tuple[Any, str]] = []
        self.direct: list[str] = []  # files of an asynchronous save written at once, for want of memory
        self.errors: list[str] = []

    def makedirs(self, path: str, exist_ok: bool) -> None:
        try:
            os.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self.errors.append(f"{path}: {e}")

    def save(self, state_dict: Any, path: str) -> None:
        if self.capture and fits_in_host(tensor_bytes(state_dict)):
            t0 = time.perf_counter()
            self.captured.append((snapshot(state_dict, self.pool), path))
            self.snapshot_seconds += time.perf_counter() - t0
            return
        if self.capture:  # no room for its copy: written now, the step waits for this file
            self.direct.append(path)
        self.write(state_dict, path)

    def write(self, state_dict: Any, path: str) -> None:
        if self.errors:
            return  # one failure is enough; don't fill the disk further
        try:
            with without_zip_crc():
                self._write(state_dict, path)
        except (OSError, RuntimeError) as e:  # torch's zip writer reports ENOSPC as a RuntimeError
            self.errors.append(f"{path}: {e}")
            return
        self.sink.add(path)
        if self.on_write is not None:
            self.on_write(path)

    def write_all(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Write what was captured, then wait for every file's hash and fsync: ({path: entry},
        [errors])."""
        while self.captured:
            state_dict, path = self.captured.pop(0)
            self.write(state_dict, path)
            self.written_snapshots.append(state_dict)  # its buffers serve the next snapshot
        written, errors = self.sink.results()
        return written, self.errors + errors


class Background:
    """One job at a time on a thread of its own: the write of a checkpoint while training goes on.
    `wait` returns once the job in flight (if any) is done, and raises what it raised."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Callable[[], None], name: str) -> None:
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as e:  # kept for the main thread, which raises it in `wait`
                self._error = e

        # a daemon: a process that fails or is killed does not wait for a write it will never commit
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
