"""Prepare as many tasks (`data.tasks`): each stage a set of independent tasks that an executor runs
(executors.py: this host's cores, Slurm or Ray), dedup global across all of them. With data.tasks
unset, one task of each stage runs in this process, its encode step's chunks spread over
`data.workers` processes (workers.py), and the shards keep one host's names (`train_00000.bin`).

    plan (here) ─ encode ─ exact ─ bands ─ clusters ─ write ─ here: shards moved in, manifest

- plan: the corpus in corpus order, cut into units (a chunk, or a compressed file that its task
  decompresses itself), dealt out to `tasks` runs of about equal input bytes, one file per task
  (one host: every input file, which its task cuts into chunks itself).
- encode (one task per run): read, clean, split, hash, MinHash and tokenize, as one host's workers
  do (encode.py); the tokens and a table of each document go to the task's directory.
- exact (as many tasks as runs): the hashes by hash % tasks; in each part, every document whose hash
  an earlier one had is removed (the first in corpus order is kept, and named as its match).
- bands (as many tasks as runs): each MinHash band, by its first value % parts (bands x parts at
  least the tasks), sorted: the buckets holding two or more documents that exact dedup kept.
- clusters (one task): in corpus order, a document is a near duplicate when a bucket it is in holds
  an earlier document that was kept (the earliest such is its match). That is what datasketch's
  MinHashLSH, queried and filled with the kept documents in corpus order, decides, so the kept set
  is the same for any number of tasks.
- write (one task per run): the kept documents of each run into its own shards, `train_tNNNNN_*`;
  here, `dedup_removed.jsonl`: the first DEDUP_LISTED removed documents, each with its match.

Every task writes into a directory of its own and renames it into place when it is whole, so a
task that dies leaves nothing a later stage reads, and one run again writes the same bytes. The
work directory sits beside the dataset (`.NAME.tasks`) and outlives a failed or stopped prepare:
the same command again runs only the tasks that did not finish. It is named by what it builds
(config, inputs, tokenizer, tasks): a prepare of anything else starts it afresh. Once the dataset
is swapped in, it goes (one host's also when the prepare fails or is stopped: prepare.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pretrain.config.tree import DataConfig
from pretrain.data.chunks import Chunk, file_chunks, plan_tasks, read_chunk
from pretrain.data.clean import Cleaner, CleanStats
from pretrain.data.dataset import SPLITS
from pretrain.data.encode import Setup, encode_task
from pretrain.data.fingerprint import input_files, output_config
from pretrain.data.report import (
    Progress,
    lsh_misses,
    manifest_report,
    no_document,
    split_warnings,
    stats_line,
)
from pretrain.data.shards import ShardInfo, ShardWriter, dtype_for_vocab
from pretrain.data.tokenizer import Tokenizer
from pretrain.data.workdir import (
    Unit,
    building,
    load_npy,
    load_setup,
    load_shards,
    load_stats,
    load_units,
    open_work,
    raw_array,
    save_npy,
    save_setup,
    save_shards,
    save_stats,
    save_units,
    task_dir,
    work_dir,
)
from pretrain.data.workers import Workers
from pretrain.errors import DataError

WORK_VERSION = 3  # 2: hand-offs as checked JSON and .npy, no pickle; 3: each removed one's kept match
DEDUP_REMOVED = "dedup_removed.jsonl"  # in a dataset dedup removed documents from: each, and its kept match
DEDUP_LISTED = 10_000  # the removed documents it names at most, the first in corpus order
FAULT_KILL = "PRETRAIN_FAULT_KILL_TASK"  # "STAGE:RANK": that task SIGKILLs itself, the first time only
_WRITE_TOKENS = 1 << 22  # tokens a write task copies at a time: its memory stays flat


def work_key(cfg: DataConfig, inputs: dict[str, Any], tok: Tokenizer) -> str:
    """What a work directory builds: a prepare of anything else does not reuse its tasks."""
    what = {
        "version": WORK_VERSION,
        "config": output_config(cfg),
        "inputs": inputs.get("digest"),
        "val": (inputs.get("val") or {}).get("digest"),
        "tokenizer": tok.fingerprint(),
        "tasks": cfg.tasks,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _fault(job: Job, stage: str, rank: int) -> None:
    """PRETRAIN_FAULT_KILL_TASK=STAGE:RANK (in the prepare's environment, carried by the job to
    wherever its tasks run): that task dies by SIGKILL mid-way, once (tests)."""
    if job.fault != f"{stage}:{rank}":
        return
    flag = job.root / f"fault-{stage}-{rank}"
    if not flag.exists():
        flag.touch()
        os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# plan


def plan(cfg: DataConfig, work: Path, total_bytes: int) -> None:
    """Deal the corpus out to cfg.tasks runs of about equal input bytes, in corpus order: one list
    of units per task (`plan/tNNNNN.json`), written as the corpus is walked. With data.tasks unset,
    the one task's units are the input files, not walked here."""
    tasks, done = cfg.tasks or 1, work / "plan" / "done"
    if done.is_file():
        return
    (work / "plan").mkdir(exist_ok=True)
    if cfg.tasks is None:
        save_units(work / "plan" / "t00000.json", [Unit(file=f) for f in input_files(cfg)])
        done.touch()
        return
    if not total_bytes:  # not known from the fingerprint: walk the corpus once more
        total_bytes = sum(size for _, size in _units(cfg))
    units: list[Unit] = []
    current, seen = 0, 0

    def flush(upto: int) -> None:
        nonlocal current, units
        while current < upto:
            save_units(work / "plan" / f"t{current:05d}.json", units)
            current, units = current + 1, []

    for unit, size in _units(cfg):
        flush(min(tasks - 1, seen * tasks // max(total_bytes, 1)))
        units.append(unit)
        seen += size
    flush(tasks)
    done.touch()


def _units(cfg: DataConfig) -> Iterator[tuple[Unit, int]]:
    for file in input_files(cfg):
        if file.format == "hf-stream":
            raise DataError(
                f"{cfg.corpus}: a streamed dataset (data.hf_streaming) is read from its start by one process, "
                "so it cannot be cut into data.tasks: save it to disk first (datasets' save_to_disk) and point "
                "data.corpus there, or leave data.tasks unset"
            )
        if file.compression:
            yield Unit(file=file), file.size
            continue
        for piece in file_chunks(
            file,
            chunk_bytes=cfg.chunk_bytes,
            text_split_bytes=cfg.text_split_bytes,
            text_field=cfg.text_field,
        ):
            chunk = replace(piece, split=file.split) if file.split else piece
            yield Unit(chunks=(chunk,)), chunk.input_bytes


def _chunk_lists(job: Job, units: list[Unit]) -> Iterator[list[Chunk]]:
    """A run's chunks, in corpus order: a unit's chunk, or a file's chunks one by one (one host:
    grouped into worker tasks of about chunk_bytes, as the vocabulary passes group them)."""
    chunk_bytes, text_split_bytes, text_field = job.chunking
    if job.one_host:
        files = (u.file for u in units if u.file is not None)
        yield from plan_tasks(
            files, chunk_bytes=chunk_bytes, text_split_bytes=text_split_bytes, text_field=text_field
        )
        return
    for unit in units:
        if unit.file is None:
            yield list(unit.chunks)
            continue
        for piece in file_chunks(
            unit.file, chunk_bytes=chunk_bytes, text_split_bytes=text_split_bytes, text_field=text_field
        ):
            yield [replace(piece, split=unit.file.split) if unit.file.split else piece]


# ---------------------------------------------------------------------------------------------
# The work every task reads: the setup (tokenizer included), the offsets of each run's documents


@dataclass(frozen=True)
class Job:
    """What every task of a prepare reads; picklable (the executors send it to the tasks)."""

    work: str
    tasks: int
    chunking: tuple[int, int, str]  # chunk_bytes, text_split_bytes, text_field
    exact: bool
    near: bool
    perms: int
    hashranges: tuple[tuple[int, int], ...]  # the MinHash bands, as one host's MinHashLSH cuts them
    parts: int  # each band's buckets in this many parts, by their first value
    shard_tokens: int
    dtype: str  # the tokens'
    fault: str | None = None  # PRETRAIN_FAULT_KILL_TASK
    one_host: bool = (
        False  # data.tasks unset: one task of each stage, in this process; one host's shard names
    )
    workers: int = 0  # worker processes the encode task spreads its chunks over (workers.py); 0: in its own

    @property
    def root(self) -> Path:
        return Path(self.work)

    def setup(self) -> Setup:
        return load_setup(self.root)

    def offsets(self) -> np.ndarray:
        """Global index of each run's first document, and the total at the end: (tasks + 1,)."""
        return load_npy(self.root / "offsets.npy")

    def docs(self, rank: int, name: str) -> np.ndarray:
        return load_npy(task_dir(self.root, "encode", rank) / f"{name}.npy", mmap=True)

    def signatures(self, rank: int) -> np.ndarray:
        n = len(self.docs(rank, "lengths"))
        path = task_dir(self.root, "encode", rank) / "sig.bin"
        return raw_array(path, np.dtype(np.uint32), (n, self.perms))

    def removed(self, name: str) -> np.ndarray:
        path = self.root / f"{name}.npy"
        return load_npy(path) if path.is_file() else np.empty(0, dtype=np.int64)

    def matched(self, name: str) -> np.ndarray:
        """The kept document each of `removed(name)` matched, in the same order."""
        path = self.root / f"{name}_kept.npy"
        return load_npy(path) if path.is_file() else np.empty(0, dtype=np.int64)


def make_job(cfg: DataConfig, work: Path, setup: Setup, *, workers: int = 0) -> Job:
    clean = cfg.clean
    hashranges: tuple[tuple[int, int], ...] = ()
    if clean.near_dedup:
        from datasketch import MinHashLSH  # the near-dedup extra, checked by prepare

        lsh = MinHashLSH(threshold=clean.near_dedup_threshold, num_perm=clean.minhash_perms)
        hashranges = tuple((int(a), int(b)) for a, b in lsh.hashranges)
    tasks = cfg.tasks or 1
    bands = max(len(hashranges), 1)
    if cfg.tasks is not None:  # one host's encode step is given it here (Encode.setup)
        save_setup(work, setup)
    return Job(
        work=str(work),
        tasks=tasks,
        chunking=(cfg.chunk_bytes, cfg.text_split_bytes, cfg.text_field),
        exact=clean.exact_dedup,
        near=clean.near_dedup,
        perms=clean.minhash_perms,
        hashranges=hashranges,
        parts=-(-tasks // bands),
        shard_tokens=cfg.shard_tokens,
        dtype=setup.dtype,
        fault=os.environ.get(FAULT_KILL),
        one_host=cfg.tasks is None,
        workers=workers if cfg.tasks is None else 0,
    )


@dataclass(frozen=True)
class _Task:
    """A stage's task: builds its directory (`build`) beside where it goes and renames it into place
    when whole; a task whose directory is there already was done by an earlier try."""

    job: Job
    stage: ClassVar[str] = ""

    def __call__(self, rank: int, world_size: int) -> None:
        with building(task_dir(self.job.root, self.stage, rank)) as tmp:
            if tmp is not None:
                self.build(tmp, rank, world_size)

    def build(self, tmp: Path, rank: int, world_size: int) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# encode


_TABLE = ("lengths", "sizes", "is_val", "hashes", "has_shingles")


@dataclass(frozen=True)
class Encode(_Task):
    """A run's documents read, cleaned, hashed and tokenized, chunk by chunk in corpus order (in
    job.workers processes, or here). One host's, run in this process, is given the setup (not read
    back from the work directory) and `read(bytes)`, told of each chunk's input bytes (the progress)."""

    stage: ClassVar[str] = "encode"
    setup: Setup | None = field(default=None, compare=False)
    read: Callable[[int], None] | None = field(default=None, compare=False)

    def build(self, tmp: Path, rank: int, world_size: int) -> None:
        job = self.job
        units = load_units(job.root / "plan" / f"t{rank:05d}.json")
        table: dict[str, list[np.ndarray]] = {k: [] for k in _TABLE}
        stats, cpu = CleanStats(), 0.0
        results = Workers(job.workers).map(encode_task, self.setup or job.setup(), _chunk_lists(job, units))
        with (
            open(tmp / "tokens.bin", "wb") as tokens,
            open(tmp / "sig.bin", "wb") as sig,
            open(tmp / "names.jsonl", "w") as names,
            contextlib.closing(results),  # stops the workers at once on an error
        ):
            for i, (chunks, r) in enumerate(results):
                if i == 1:
                    _fault(job, "encode", rank)
                if self.read is not None:
                    self.read(sum(c.input_bytes for c in chunks))
                stats.add(r.stats)
                cpu += r.cpu_s
                names.writelines(json.dumps(name) + "\n" for name in r.names)
                tokens.write(r.tokens.tobytes())
                if r.signatures is not None:
                    sig.write(np.ascontiguousarray(r.signatures, dtype=np.uint32).tobytes())
                for k in _TABLE:
                    table[k].append(getattr(r, k))
        _fault(job, "encode", rank)
        for k, parts in table.items():
            save_npy(tmp / f"{k}.npy", np.concatenate(parts) if parts else _empty(k))
        save_stats(tmp / "stats.json", stats, cpu)


def _empty(name: str) -> np.ndarray:
    kind = {"lengths": np.int64, "sizes": np.int64, "is_val": bool, "hashes": np.uint64}
    return np.empty(0, dtype=kind.get(name, bool))


def write_offsets(job: Job) -> np.ndarray:
    counts = [len(job.docs(t, "lengths")) for t in range(job.tasks)]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    save_npy(job.root / "offsets.npy", offsets)
    return offsets


# ---------------------------------------------------------------------------------------------
# exact: hash % tasks parts, the first of each hash in corpus order kept


@dataclass(frozen=True)
class Exact(_Task):
    stage: ClassVar[str] = "exact"

    def build(self, tmp: Path, part: int, parts: int) -> None:
        job = self.job
        offsets = job.offsets()
        hashes, ids = [], []
        for t in range(job.tasks):
            h = np.asarray(job.docs(t, "hashes"))
            sel = np.flatnonzero(h % np.uint64(parts) == part)
            hashes.append(h[sel])
            ids.append(sel + offsets[t])
        h, i = np.concatenate(hashes), np.concatenate(ids)
        order = np.lexsort((i, h))  # by hash, then corpus order
        h, i = h[order], i[order]
        again = np.zeros(len(h), dtype=bool)
        again[1:] = h[1:] == h[:-1]
        first = np.maximum.accumulate(np.where(again, 0, np.arange(len(h))))  # each hash's first, kept
        removed, kept = i[again], i[first][again]
        order = np.argsort(removed)
        save_npy(tmp / "removed.npy", removed[order].astype(np.int64))
        save_npy(tmp / "kept.npy", kept[order].astype(np.int64))


def gather_removed(job: Job, stage: str, parts: int, name: str) -> np.ndarray:
    """The removed documents of every part of a stage, sorted, saved as `name`.npy in the work, and
    the kept one each matched as `name`_kept.npy."""
    dirs = [task_dir(job.root, stage, p) for p in range(parts)]
    found = [load_npy(d / "removed.npy") for d in dirs]
    matched = [load_npy(d / "kept.npy") for d in dirs]
    removed = np.concatenate(found).astype(np.int64) if found else np.empty(0, dtype=np.int64)
    kept = np.concatenate(matched).astype(np.int64) if matched else np.empty(0, dtype=np.int64)
    order = np.argsort(removed, kind="stable")
    save_npy(job.root / f"{name}.npy", removed[order])
    save_npy(job.root / f"{name}_kept.npy", kept[order])
    return removed[order]


def _in_range(removed: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The removed documents of one run, [lo, hi), as indexes local to it."""
    a, b = np.searchsorted(removed, [lo, hi])
    return removed[a:b] - lo


# ---------------------------------------------------------------------------------------------
# bands: the buckets of one band (one part of it) that hold two or more documents


@dataclass(frozen=True)
class Bands(_Task):
    """Task `rank` of `n` takes the band parts rank, rank + n, ... (bands x parts in all), one after
    the other: its memory is one band part's."""

    stage: ClassVar[str] = "bands"

    def build(self, tmp: Path, rank: int, n: int) -> None:
        job = self.job
        members, sizes = [], []
        for index in range(rank, len(job.hashranges) * job.parts, n):
            m, k = self.band_part(index)
            members.append(m)
            sizes.append(k)
        save_npy(tmp / "members.npy", np.concatenate(members) if members else np.empty(0, np.int64))
        save_npy(tmp / "sizes.npy", np.concatenate(sizes) if sizes else np.empty(0, np.int64))

    def band_part(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The buckets of two or more of one band's part: band index // parts, values whose first
        is part (index % parts) modulo parts."""
        job = self.job
        band, part = divmod(index, job.parts)
        start, end = job.hashranges[band]
        offsets, exact_removed = job.offsets(), job.removed("exact_removed")
        keys, ids = [], []
        for t in range(job.tasks):
            use = np.asarray(job.docs(t, "has_shingles")).copy()
            use[_in_range(exact_removed, int(offsets[t]), int(offsets[t + 1]))] = False
            sel = np.flatnonzero(use)
            rows = np.asarray(job.signatures(t)[sel, start:end])
            mine = rows[:, 0] % np.uint32(job.parts) == part if len(rows) else np.zeros(0, bool)
            keys.append(rows[mine])
            ids.append(sel[mine] + offsets[t])
        k = np.concatenate(keys) if keys else np.empty((0, end - start), np.uint32)
        i = np.concatenate(ids) if ids else np.empty(0, np.int64)
        return _buckets(k, i)


def _buckets(keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Documents that share a key (a row of `keys`), bucket by bucket, each in corpus order: the
    members of the buckets of two or more, concatenated, and each bucket's size."""
    if len(ids) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    order = np.lexsort((ids, *keys.T[::-1]))  # by the band's values, then corpus order
    keys, ids = keys[order], ids[order]
    new = np.ones(len(ids), dtype=bool)
    new[1:] = (keys[1:] != keys[:-1]).any(axis=1)
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, len(ids)))
    shared = sizes >= 2
    take = np.repeat(shared, sizes)
    return ids[take].astype(np.int64), sizes[shared].astype(np.int64)


# ---------------------------------------------------------------------------------------------
# clusters: in corpus order, a document in a bucket with a kept earlier one is a near duplicate


@dataclass(frozen=True)
class Clusters(_Task):
    stage: ClassVar[str] = "clusters"

    def build(self, tmp: Path, rank: int, world_size: int) -> None:
        job = self.job
        members, sizes = [], []
        for j in range(job.tasks):
            members.append(load_npy(task_dir(job.root, "bands", j) / "members.npy"))
            sizes.append(load_npy(task_dir(job.root, "bands", j) / "sizes.npy"))
        removed, kept = near_matches(np.concatenate(members), np.concatenate(sizes))
        save_npy(tmp / "removed.npy", removed)
        save_npy(tmp / "kept.npy", kept)


def near_removed(members: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The documents that one host's MinHashLSH query over the kept documents would call near
    duplicates (near_matches), without the kept ones they matched."""
    return near_matches(members, sizes)[0]


def near_matches(members: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The near duplicates, given every bucket of two or more (`members`, `sizes`), and the kept
    document each matched: in corpus order, a document goes when one of its buckets already holds a
    kept one (the earliest such is its match), and is kept (marking its buckets) when none does."""
    if len(members) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    bucket = np.repeat(np.arange(len(sizes)), sizes)
    order = np.lexsort((bucket, members))
    doc, bucket = members[order], bucket[order]
    starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
    ends = np.append(starts[1:], len(doc))
    keeper = np.full(len(sizes), -1, dtype=np.int64)  # the kept document of each bucket
    removed, kept = [], []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        mine = keeper[bucket[s:e]]
        if (mine >= 0).any():
            removed.append(int(doc[s]))
            kept.append(int(mine[mine >= 0].min()))
        else:
            keeper[bucket[s:e]] = doc[s]
    return np.array(removed, dtype=np.int64), np.array(kept, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# write: one run's kept documents into its own shards


@dataclass(frozen=True)
class Write(_Task):
    stage: ClassVar[str] = "write"
    moved: tuple[int, str] | None  # (a document, the split it goes to instead): the last one, at times

    def build(self, tmp: Path, rank: int, world_size: int) -> None:
        job = self.job
        offsets = job.offsets()
        lo, hi = int(offsets[rank]), int(offsets[rank + 1])
        keep = np.ones(hi - lo, dtype=bool)
        for name in ("exact_removed", "near_removed"):
            keep[_in_range(job.removed(name), lo, hi)] = False
        is_val = np.asarray(job.docs(rank, "is_val")).copy()
        if self.moved is not None and lo <= self.moved[0] < hi:
            is_val[self.moved[0] - lo] = self.moved[1] == "val"
        lengths = np.asarray(job.docs(rank, "lengths"))
        dtype = np.dtype(job.dtype)
        _fault(job, "write", rank)
        shards = _write_run(tmp, rank, job, keep, is_val, lengths, dtype)
        save_shards(tmp / "shards.json", shards)


def _write_run(
    tmp: Path, rank: int, job: Job, keep: np.ndarray, is_val: np.ndarray, lengths: np.ndarray, dtype: np.dtype
) -> dict[str, list[ShardInfo]]:
    path = task_dir(job.root, "encode", rank) / "tokens.bin"
    tokens = raw_array(path, dtype, (int(lengths.sum()),))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    shards = {}
    for split in SPLITS:
        prefix = split if job.one_host else f"{split}_t{rank:05d}"
        writer = ShardWriter(tmp, prefix, dtype, shard_tokens=job.shard_tokens)
        sel = np.flatnonzero(keep & (is_val == (split == "val")))
        # Batches of about _WRITE_TOKENS tokens (a longer document alone): memory flat in the run's size.
        cut = np.flatnonzero(np.diff(np.cumsum(lengths[sel]) // _WRITE_TOKENS)) + 1
        for docs in np.split(sel, cut):
            parts = [tokens[starts[i] : ends[i]] for i in docs.tolist()]
            if parts:
                writer.write(np.concatenate(parts), lengths[docs])
        shards[split] = writer.close()
    return shards


# ---------------------------------------------------------------------------------------------
# Here, between the stages: what the runs kept, and the last document's split


@dataclass
class Kept:
    """What the runs kept, in one pass over their tables."""

    per_run: list[int]
    last: int | None  # global index of the last kept document
    last_split: str
    other_split_empty: bool  # no other kept document is in the split the last one is not in
    bytes_out: int  # UTF-8 bytes of the kept documents
    largest: tuple[int, int]  # (tokens, global index) of the largest kept document; (0, -1) with none


def kept_documents(job: Job) -> Kept:
    offsets = job.offsets()
    removed = np.union1d(job.removed("exact_removed"), job.removed("near_removed"))
    per_run, counts, last, last_val = [], {True: 0, False: 0}, None, False
    bytes_out, largest = 0, (0, -1)
    for t in range(job.tasks):
        lo, hi = int(offsets[t]), int(offsets[t + 1])
        keep = np.ones(hi - lo, dtype=bool)
        keep[_in_range(removed, lo, hi)] = False
        is_val = np.asarray(job.docs(t, "is_val"))
        per_run.append(int(keep.sum()))
        for v in (True, False):
            counts[v] += int((keep & (is_val == v)).sum())
        bytes_out += int(np.asarray(job.docs(t, "sizes"))[keep].sum())
        if keep.any():
            i = int(np.flatnonzero(keep)[-1])
            last, last_val = lo + i, bool(is_val[i])
            lengths = np.where(keep, np.asarray(job.docs(t, "lengths")), -1)
            if lengths.max() > largest[0]:
                largest = (int(lengths.max()), lo + int(np.argmax(lengths)))
    if last is not None:
        counts[last_val] -= 1
    return Kept(per_run, last, "val" if last_val else "train", counts[not last_val] == 0, bytes_out, largest)


def run_of(job: Job, doc: int) -> tuple[int, int]:
    """(the run, the index in it) of a global document index."""
    offsets = job.offsets()
    t = int(np.searchsorted(offsets, doc, side="right")) - 1
    return t, doc - int(offsets[t])


def name_of(job: Job, doc: int) -> str:
    t, i = run_of(job, doc)
    with open(task_dir(job.root, "encode", t) / "names.jsonl") as f:
        name: str = json.loads(next(itertools.islice(f, i, None)))
    return name


def text_of(job: Job, doc: int, clean: Any) -> str:
    """The cleaned text of one document, read again from its run's units."""
    t, i = run_of(job, doc)
    units = load_units(job.root / "plan" / f"t{t:05d}.json")
    cleaner, seen = Cleaner(clean), 0
    for chunks in _chunk_lists(job, units):
        for c in chunks:
            for d in read_chunk(c, job.chunking[2], cleaner, CleanStats()):
                if seen == i:
                    return d.text
                seen += 1
    raise DataError(f"document {doc} is not in run {t} any more: its input changed during the prepare")


def run_stats(job: Job) -> tuple[CleanStats, float]:
    stats, cpu = CleanStats(), 0.0
    for t in range(job.tasks):
        s, c = load_stats(task_dir(job.root, "encode", t) / "stats.json")
        stats.add(s)
        cpu += c
    return stats, cpu


def count_removed(job: Job, stats: CleanStats) -> None:
    """The documents exact and near dedup removed, with their bytes, into `stats`."""
    offsets = job.offsets()
    for name, step in (("exact_removed", "exact_duplicate"), ("near_removed", "near_duplicate")):
        removed = job.removed(name)
        for t in range(job.tasks):
            local = _in_range(removed, int(offsets[t]), int(offsets[t + 1]))
            if len(local):
                entry = stats.removed.setdefault(step, [0, 0])
                entry[0] += len(local)
                entry[1] += int(np.asarray(job.docs(t, "sizes"))[local].sum())


def written_shards(job: Job, staging: Path) -> dict[str, list[ShardInfo]]:
    """Every run's shards, in run order, moved into the dataset's staging directory."""
    shards: dict[str, list[ShardInfo]] = {s: [] for s in SPLITS}
    for t in range(job.tasks):
        d = task_dir(job.root, "write", t)
        for split, infos in load_shards(d / "shards.json").items():
            for info in infos:
                target = staging / info.path.name
                os.replace(d / info.path.name, target)
                shards[split].append(replace(info, path=target))
    return shards


def dedup_removed(job: Job, staging: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """`dedup_removed.jsonl` in the dataset's staging directory: the first DEDUP_LISTED removed
    duplicates in corpus order, one JSON line each with the kept document it matched and their
    similarity (exact: 1.0; near: the share of equal MinHash values, the estimated Jaccard). Returns
    the report's entry for it (path, lines written, duplicates in all) and an example of each kind."""
    parts = [
        (job.removed(name), job.matched(name), kind)
        for kind, name, on in (("exact", "exact_removed", job.exact), ("near", "near_removed", job.near))
        if on
    ]
    removed = np.concatenate([r for r, _, _ in parts]) if parts else np.empty(0, np.int64)
    matched = np.concatenate([k for _, k, _ in parts]) if parts else np.empty(0, np.int64)
    kinds = [kind for r, _, kind in parts for _ in range(len(r))]
    listed = np.argsort(removed, kind="stable")[:DEDUP_LISTED].tolist()
    names = _names(job, {int(removed[j]) for j in listed} | {int(matched[j]) for j in listed})
    examples: dict[str, str] = {}
    with open(staging / DEDUP_REMOVED, "w") as f:
        for j in listed:
            doc, kept, kind = int(removed[j]), int(matched[j]), kinds[j]
            similarity = 1.0 if kind == "exact" else _signature_share(job, doc, kept)
            line = {
                "kind": kind,
                **_document(names[doc]),
                "kept": _document(names[kept]),
                "similarity": similarity,
            }
            f.write(json.dumps(line) + "\n")
            examples.setdefault(
                f"{kind}_duplicate",
                f"{names[doc]} removed, a copy of {names[kept]}"
                if kind == "exact"
                else f"{names[doc]} removed, near {names[kept]} (estimated Jaccard {similarity:.2f})",
            )
    return {"path": DEDUP_REMOVED, "written": len(listed), "total": len(removed)}, examples


def _names(job: Job, docs: set[int]) -> dict[int, str]:
    """The names of some documents, in one pass over each run's names that holds one of them."""
    by_run: dict[int, set[int]] = {}
    for doc in docs:
        t, i = run_of(job, doc)
        by_run.setdefault(t, set()).add(i)
    offsets, names = job.offsets(), {}
    for t, wanted in sorted(by_run.items()):
        with open(task_dir(job.root, "encode", t) / "names.jsonl") as f:
            for i, line in enumerate(itertools.islice(f, max(wanted) + 1)):
                if i in wanted:
                    names[int(offsets[t]) + i] = json.loads(line)
    return names


def _document(name: str) -> dict[str, Any]:
    """A document's name ("part0.jsonl@1234": its file and the byte or row it starts at) as a line's fields."""
    source, _, at = name.rpartition("@")
    if source and at.isdigit():
        return {"document": name, "source": source, "offset": int(at)}
    return {"document": name, "source": name, "offset": None}  # a text file, or a piece of one (`#N`)


def _signature_share(job: Job, a: int, b: int) -> float:
    """The share of equal MinHash values between two documents' signatures: their estimated Jaccard."""
    (ta, ia), (tb, ib) = run_of(job, a), run_of(job, b)
    sig_a, sig_b = np.asarray(job.signatures(ta)[ia]), np.asarray(job.signatures(tb)[ib])
    return round(float(np.mean(sig_a == sig_b)), 4)


def largest_named(job: Job, kept: Kept) -> tuple[int, str, str]:
    """(tokens, name, split) of the largest kept document, as split_warnings takes it."""
    tokens, doc = kept.largest
    if doc < 0:
        return 0, "", ""
    t, i = run_of(job, doc)
    return tokens, name_of(job, doc), "val" if bool(job.docs(t, "is_val")[i]) else "train"


def one_document(job: Job, doc: int, cfg: DataConfig, tok: Tokenizer, staging: Path) -> dict:
    """The one kept document, cut at (1 - val_fraction) of its characters into train and val:
    nanoGPT's recipe for tiny-shakespeare (first 90% train, last 10% val)."""
    text = text_of(job, doc, cfg.clean)
    cut = int(len(text) * (1 - cfg.val_fraction))
    if not 0 < cut < len(text):
        raise DataError(
            f"{cfg.corpus}: its one document ({len(text)} characters) is too short to split into train and val"
        )
    eot = [] if tok.eot_token is None else [tok.eot_token]
    dtype = dtype_for_vocab(tok.vocab_size)
    shards = {}
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        writer = ShardWriter(staging, split, dtype, shard_tokens=job.shard_tokens)
        ids = np.concatenate([tok.encode_array(part), np.array(eot, dtype=np.int64)]).astype(dtype)
        writer.write(ids, [ids.size])
        shards[split] = writer.close()
    return shards


class Timer:
    def __init__(self, log: Callable[[str], None] | None) -> None:
        self.log, self.t0 = log, time.perf_counter()

    def say(self, what: str) -> None:
        if self.log:
            self.log(f"{what} ({time.perf_counter() - self.t0:.1f} s)")


# ---------------------------------------------------------------------------------------------
# The driver: every stage on data.executor (one host: here), then the shards and the report


def build(
    cfg: DataConfig,
    tok: Tokenizer,
    setup: Setup,
    *,
    out: Path,
    staging: Path,
    inputs: dict[str, Any],
    workers: int = 0,
    log: Callable[[str], None] | None,
) -> tuple[dict[str, list[ShardInfo]], dict[str, Any], Path]:
    """Run the stages (each task not already done by an earlier try) and move the written shards
    into `staging`; returns them, the report and the work directory (removed by the caller once
    the dataset is in place). The report holds nothing of how or where the tasks ran, so the
    manifest is the same on every executor; one host's (data.tasks unset: each stage's one task
    here, the encode step's chunks in `workers` processes, with the "prepare" progress) also holds
    its seconds, workers, CPU seconds and the exact stage's index bytes, as it always did."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    work = work_dir(out)
    open_work(work, work_key(cfg, inputs, tok))
    plan(cfg, work, int(inputs.get("bytes") or 0))
    job = make_job(cfg, work, setup, workers=workers)
    progress = Progress("prepare", inputs.get("bytes"), log) if job.one_host else None
    try:
        shards, kept, notes = _stages(
            cfg, job, tok, setup, staging, progress, total=inputs.get("bytes"), log=log
        )
        if progress is not None:
            progress.update(0, sum(kept.per_run))
    finally:
        if progress is not None:
            progress.close()
    own_val = (inputs.get("val") or {}).get("split")
    if own_val:
        notes.insert(0, f"val is the dataset's own {own_val!r} split (data.val_fraction not used)")
    stats, task_cpu = run_stats(job)
    count_removed(job, stats)
    kept_n = sum(kept.per_run)
    report = manifest_report(
        stats,
        cfg.clean,
        kept=kept_n,
        bytes_out=kept.bytes_out,
        notes=notes,
        shards=shards,
        seconds=time.perf_counter() - t0,
    )
    if len(job.removed("exact_removed")) or len(job.removed("near_removed")):
        report["dedup_removed"], examples = dedup_removed(job, staging)
        report["examples"] = dict(sorted({**report["examples"], **examples}.items()))
    if job.near:
        start, end = job.hashranges[0]
        report["near_dedup_lsh"] = lsh_misses(
            len(job.hashranges), end - start, cfg.clean.near_dedup_threshold
        )
    report["warnings"] = (
        []
        if own_val
        else split_warnings(cfg, tokens=report["tokens"], kept=kept_n, largest=largest_named(job, kept))
    )
    if job.one_host:
        # CPU seconds: the encode step's (in the workers, or here with none) and this process's own share.
        main_cpu = time.process_time() - cpu0 - (task_cpu if job.workers == 0 else 0.0)
        report["cpu_seconds"] = {"tasks": round(task_cpu, 3), "main": round(main_cpu, 3)}
        report["workers"] = job.workers
        # the exact stage's hashes and document indexes, all in memory at once here (one part of all)
        report["dedup_index_bytes"] = 16 * int(job.offsets()[-1]) if job.exact else 0
    else:
        del report["seconds"]  # of this try, not of the dataset: the log says it
        report["tasks"] = cfg.tasks
    return shards, report, work


def _stages(
    cfg: DataConfig,
    job: Job,
    tok: Tokenizer,
    setup: Setup,
    staging: Path,
    progress: Progress | None,
    *,
    total: int | None,
    log: Callable[[str], None] | None,
) -> tuple[dict[str, list[ShardInfo]], Kept, list[str]]:
    """encode, exact, bands, clusters and write, each on data.executor (one host: here); the shards
    moved into `staging`, what was kept, and the notes for the report."""
    timer = Timer(None if job.one_host else log)
    logs = job.root / "logs"

    def stage(name: str, step: Callable[[int, int], None], tasks: int) -> None:
        if job.one_host:  # one task, run here: no executor's log or marker to keep
            step(0, 1)
            return
        from pretrain.data.executors import run_stage  # datatrove, and Ray, only for data.tasks

        run_stage(cfg, logs / name, name, step, tasks, log=log)

    encode = Encode(job, setup, progress.update) if progress is not None else Encode(job)
    stage("encode", encode, job.tasks)
    write_offsets(job)
    timer.say(f"encoded {job.tasks} tasks")
    if job.exact:
        stage("exact", Exact(job), job.tasks)
        gather_removed(job, "exact", job.tasks, "exact_removed")
    if job.near:
        stage("bands", Bands(job), job.tasks)
        stage("clusters", Clusters(job), 1)
        gather_removed(job, "clusters", 1, "near_removed")
    if job.exact or job.near:
        timer.say("deduplicated across every task")
    kept = kept_documents(job)
    if kept.last is None:
        stats, _ = run_stats(job)
        count_removed(job, stats)
        raise no_document(cfg.corpus, total, f" ({stats_line(stats)})")
    notes: list[str] = []
    if sum(kept.per_run) == 1:
        shards = one_document(job, kept.last, cfg, tok, staging)
        notes.append("one document: cut at characters into train and val")
    else:
        moved = None
        if kept.other_split_empty:
            other = "val" if kept.last_split == "train" else "train"
            moved = (kept.last, other)
            notes.append(
                f"no document hashed to {other}; the last one ({name_of(job, kept.last)}) went there"
            )
        stage("write", Write(job, moved), job.tasks)
        shards = written_shards(job, staging)
    timer.say(f"wrote {sum(len(s) for s in shards.values())} shards")
    return shards, kept, notes
