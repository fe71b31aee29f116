"""Local staging of shards (loader.cache_dir): each shard copied once to node-local disk, verified, read there.

A run's loader reads the shards where they lie (often a parallel file system). With loader.cache_dir set,
every rank, before its loader opens a split, stages that split's shards: it finds or makes a verified
copy of each in the cache and hands the loader the copies' paths. The loader opens (memory-maps) every
shard of its split at construction anyway, so staging them all then costs no start-up a lazier scheme
would save; the tokens are the same bytes, so the batches are bit-identical with and without a cache.

Layout: `<cache_dir>/<key>/<shard file name>`, where the key is the first 16 hex digits of the sha256 of
the dataset's shard list (every split's names, token counts and sha256s): two datasets share a directory
only if their shards are the same. Beside each copy:
- `<name>.ok`, the marker, written once the copy's payload sha256 matched the manifest's: that sha256,
  and the copy's size, mtime and inode as verification found them. A later run reuses a copy whose
  marker agrees with the manifest and with the copy's stat without hashing it again (a stat, not a
  read of the shard: start-up stays cheap). A copy changed since (written to, truncated, replaced) has
  another size, mtime or inode and is copied again. What a stat cannot see, bits rotting on the disk,
  is what loader.verify_shards is for: with it on, a reused copy is hashed again (on the first rank of
  each host, as the loader would hash the originals), and a mismatch is refused, the copy removed, so
  the next run copies it afresh. Refused rather than replaced: other ranks may already read that copy.
  The marker's mtime is the copy's last use, for eviction.
- `<name>.lock`, the shard's flock, held while a process checks, copies or evicts it: a second rank of
  the node waits for the first's copy, then reuses it.
- `<name>.tmp-<pid>`, a copy in progress: copied, fsynced, verified, then renamed over `<name>`. Never
  read: a killed copy's leftover is removed by the next process that holds the shard's lock.

Size: before a copy, if the cache would pass loader.cache_max_gb, the least recently used copies of the
datasets this run does not read are evicted. If it still does not fit, or the disk fills during the copy,
the shard is read in place with one warning line, and no partial copy is left behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.data.dataset import SPLITS, Dataset
from pretrain.data.shards import payload_sha256, read_header
from pretrain.errors import DataError
from pretrain.files import FileLock, format_bytes, fsync_dir, temp_name, write_atomic

MARKER = ".ok"
LOCK = ".lock"
_HOLDER = "pretrain train (staging a shard)"
_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full disk or quota: read in place instead


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def dataset_key(dataset: Dataset) -> str:
    """The directory of `dataset`'s copies in the cache: a hash of its shard list, every split's."""
    shards = {
        split: [[e["path"], int(e["n_tokens"]), e["sha256"]] for e in dataset.manifest[split]]
        for split in SPLITS
    }
    return hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Staged:
    """What staging one split gave: the paths to read, one list per dataset, and what it did."""

    paths: list[list[Path]] = field(default_factory=list)
    staged: int = 0
    reused: int = 0
    in_place: int = 0
    copied_bytes: int = 0

    def summary(self, cache_dir: Path, split: str) -> str:
        return (
            f"loader.cache_dir {cache_dir}: {split} shards: {self.staged} staged ({format_bytes(self.copied_bytes)} "
            f"copied), {self.reused} reused, {self.in_place} read in place"
        )


def stage_datasets(
    datasets: list[Dataset],
    split: str,
    *,
    cache_dir: str | Path,
    max_gb: float,
    verify: bool,
    warn: Callable[[str], None] = _stderr,
) -> Staged:
    """Each dataset's `split` shards as this rank should read them: their verified copies in
    `cache_dir`, or, where the cache is full, the originals. With `verify`, every path returned has
    had its payload hashed against the manifest in this call (copies always are, when made)."""
    root = Path(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"loader.cache_dir {root}: cannot create it ({e.strerror or e}): point loader.cache_dir at a writable "
            "node-local directory, or unset it"
        ) from e
    cache = _Cache(root, int(max_gb * 1e9), {dataset_key(d) for d in datasets}, warn)
    staged = Staged()
    for d in datasets:
        key_dir = root / dataset_key(d)
        key_dir.mkdir(exist_ok=True)
        group = []
        for entry in d.manifest[split]:
            path, outcome = cache.stage(
                d.dir / entry["path"], key_dir / entry["path"], entry["sha256"], verify=verify
            )
            group.append(path)
            if outcome == "staged":
                staged.staged += 1
                staged.copied_bytes += path.stat().st_size
            elif outcome == "reused":
                staged.reused += 1
            else:
                staged.in_place += 1
        staged.paths.append(group)
    return staged


class _Cache:
    """The cache directory as one rank stages into it: `keep` are the keys of this run's datasets,
    never evicted by it."""

    def __init__(self, root: Path, max_bytes: int, keep: set[str], warn: Callable[[str], None]) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.keep = keep
        self.warn = warn

    def stage(self, source: Path, copy: Path, sha256: str, *, verify: bool) -> tuple[Path, str]:
        """(the path to read, 'staged' | 'reused' | 'in_place'), under the shard's lock."""
        lock = FileLock(copy.with_name(copy.name + LOCK), _HOLDER)
        lock.acquire(exclusive=True, wait=True)
        try:
            _remove_leftovers(copy)
            if _verified(copy, sha256):
                if verify and payload_sha256(copy) != sha256:
                    _drop(copy)
                    raise DataError(
                        f"{copy}: this cached copy of {source} no longer matches its sha256 (the disk changed it "
                        "after it was verified): it is removed now, start the run again to copy it afresh"
                    )
                os.utime(copy.with_name(copy.name + MARKER))  # its last use, for eviction
                return copy, "reused"
            _drop(copy)  # a copy changed since its verification, or one never verified
            size = source.stat().st_size
            if not self._make_room(size):
                self.warn(
                    f"warning: {source}: read in place, its {format_bytes(size)} do not fit in loader.cache_dir "
                    f"{self.root} under loader.cache_max_gb {self.max_bytes / 1e9:g}: raise loader.cache_max_gb, "
                    "or free space there"
                )
                return self._in_place(source, sha256, verify=verify), "in_place"
            try:
                _copy_verified(source, copy, sha256)
            except OSError as e:
                if e.errno not in _FULL:
                    raise DataError(f"{source}: cannot copy it to {copy}: {e.strerror or e}") from e
                self.warn(
                    f"warning: {source}: read in place, the disk of loader.cache_dir {self.root} is full "
                    f"({e.strerror}): free space there, or lower loader.cache_max_gb to what it holds"
                )
                return self._in_place(source, sha256, verify=verify), "in_place"
            return copy, "staged"
        finally:
            lock.release()

    def _in_place(self, source: Path, sha256: str, *, verify: bool) -> Path:
        if verify and payload_sha256(source) != sha256:
            raise DataError(
                f"{source}: its payload sha256 differs from the manifest's {sha256[:12]}: the shard changed "
                "since the dataset was prepared, prepare it again (`pretrain data prepare --force`)"
            )
        return source

    def _make_room(self, size: int) -> bool:
        """Whether `size` more bytes fit under the bound, after evicting the least recently used
        copies of other datasets (each under its lock: a copy being staged is left alone)."""
        used = sum(p.stat().st_size for p in self.root.glob("*/*") if p.is_file())
        if used + size <= self.max_bytes:
            return True
        evictable = sorted(self._evictable())
        if used - sum(p.stat().st_size for _, p in evictable) + size > self.max_bytes:
            return False  # evicting all the others would not make room: leave them be
        for _, copy in evictable:
            lock = FileLock(copy.with_name(copy.name + LOCK), _HOLDER)
            if not lock.acquire(exclusive=True):
                continue
            try:
                if copy.is_file():
                    used -= copy.stat().st_size
                    _drop(copy)  # a process reading it keeps its mapping: the file goes when it closes it
            finally:
                lock.release()
            if used + size <= self.max_bytes:
                return True
        return False

    def _evictable(self) -> list[tuple[float, Path]]:
        """(last use, copy) of every copy of a dataset this run does not read."""
        out = []
        for d in self.root.iterdir():
            if d.name in self.keep or not d.is_dir():
                continue
            for p in d.iterdir():
                if p.name.endswith((MARKER, LOCK)) or ".tmp-" in p.name:
                    continue
                marker = p.with_name(p.name + MARKER)
                out.append((marker.stat().st_mtime if marker.exists() else 0.0, p))
        return out


def _verified(copy: Path, sha256: str) -> bool:
    """Whether `copy` is as its marker says it was when its sha256 was found to be `sha256`."""
    try:
        marker = json.loads(copy.with_name(copy.name + MARKER).read_text(encoding="utf-8"))
        st = copy.stat()
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker == {
        "sha256": sha256,
        "stat": [st.st_size, st.st_mtime_ns, st.st_ino],
    }


def _copy_verified(source: Path, copy: Path, sha256: str) -> None:
    """Copy to a temporary name, fsync, check the copy's header and payload sha256, rename, then
    write the marker. On any failure nothing of the copy is left."""
    tmp = temp_name(copy)
    try:
        shutil.copyfile(source, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        got = payload_sha256(tmp)
        if read_header(tmp).sha256 != sha256 or got != sha256:
            raise DataError(
                f"{source}: its copy's payload sha256 is {got[:12]}, the manifest lists {sha256[:12]}: the shard "
                "changed since the dataset was prepared, prepare it again (`pretrain data prepare --force`)"
            )
        os.replace(tmp, copy)
        fsync_dir(copy.parent)
        st = copy.stat()
        marker = {"sha256": sha256, "stat": [st.st_size, st.st_mtime_ns, st.st_ino]}
        write_atomic(copy.with_name(copy.name + MARKER), json.dumps(marker))
    except BaseException:
        tmp.unlink(missing_ok=True)
        _drop(copy)  # renamed, but no marker written (a full disk): it would never be used
        raise


def _drop(copy: Path) -> None:
    """Remove a copy, its marker first: a copy without one is never used."""
    copy.with_name(copy.name + MARKER).unlink(missing_ok=True)
    copy.unlink(missing_ok=True)


def _remove_leftovers(copy: Path) -> None:
    """The temporary files of killed copies of this shard (its lock is held: no one is writing them)."""
    for pattern in (f"{copy.name}.tmp-*", f"{copy.name}{MARKER}.tmp-*"):
        for p in copy.parent.glob(pattern):
            p.unlink(missing_ok=True)
