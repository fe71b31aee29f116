"""Prepare a dataset: corpus → clean → dedup → tokenize → train/val shards + manifest.

    documents (corpus.py) ─ workers: read, clean, hash, MinHash, tokenize ─┐
                                                                          ├─ main: dedup in corpus
    train_00000.bin ... val_00000.bin ◀─ ShardWriter ◀─ split by name ◀────┘  order, write shards

Worker processes (one per core, started by a fork server) take chunks of input in order and send
back tokens and hashes; the main process keeps the first of each duplicate, so the output does not depend on the
number of workers. Memory stays constant apart from the dedup indexes (see dedup.py). Like any
multiprocessing child, a worker imports the calling program's main module again: keep heavy
imports out of a script's top level.

The dataset is built in a staging directory next to `cfg.resolved_dir()` and swapped in whole
at the end, manifest written last: a failed or interrupted run leaves the previous dataset as it
was, and no file under the final name that looks complete but isn't. A second run with the same
config and input is a no-op; a different one is refused unless `force`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pretrain.config import CleanConfig, DataConfig
from pretrain.corpus import (
    DOWNLOADS,
    Chunk,
    Cleaner,
    CleanStats,
    DataError,
    Document,
    format_of,
    iter_input_files,
    plan_tasks,
    read_chunk,
    shingle_hashes,
)
from pretrain.dedup import ExactDedup, MinHasher, NearDedup, exact_hash
from pretrain.shards import ShardInfo, ShardWriter, dtype_for_vocab, read_header
from pretrain.tokenizer import (
    BPE_RANKS_FILE,
    BPETokenizer,
    CharTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    count_words,
)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
# DataConfig fields that do not change what prepare writes (where inputs come from, how many
# workers, what the loader does): a change in them keeps a prepared dataset valid.
NOT_OUTPUT_FIELDS = frozenset(
    {
        "source",
        "download_dir",
        "tokenizer_path",
        "workers",
        "chunk_bytes",
        "blend",
        "prefetch",
        "verify_shards",
        "dataset_dir",
    }
)
_OWN_FILES = (MANIFEST, TOKENIZER_FILE, BPE_RANKS_FILE)


def output_config(cfg: DataConfig) -> dict[str, Any]:
    return {k: v for k, v in cfg.model_dump(mode="json").items() if k not in NOT_OUTPUT_FIELDS}


def is_val_document(name: str, seed: int, val_fraction: float) -> bool:
    """A document's split: sha256 of (seed, name) read as a uniform number in [0, 1)."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


# ---------------------------------------------------------------------------------------------
# Worker side: one task (a list of chunks) in, its documents' tokens and hashes out.


@dataclass
class _Setup:
    clean: CleanConfig
    text_field: str
    seed: int
    val_fraction: float
    tokenizer: Tokenizer | None = None  # None in the vocabulary passes
    dtype: str = "uint16"


@dataclass
class _Encoded:
    names: list[str]
    is_val: np.ndarray  # (n,) bool
    hashes: np.ndarray  # (n,) uint64, 0 when exact dedup is off
    sizes: np.ndarray  # (n,) UTF-8 bytes of each cleaned document
    lengths: np.ndarray  # (n,) tokens of each document, end-of-text included
    tokens: np.ndarray  # all of them, concatenated
    signatures: np.ndarray | None  # (n, perms) uint32 MinHash, when near dedup is on
    has_shingles: np.ndarray  # (n,) bool: a document without words is not near-deduped
    stats: CleanStats
    cpu_s: float  # the worker's CPU time on this task, its tokenizer threads included


_worker: dict[str, Any] = {}


def _init_worker(setup: _Setup) -> None:
    _worker.clear()
    _worker["setup"] = setup
    _worker["cleaner"] = Cleaner(setup.clean)
    if setup.clean.near_dedup and setup.tokenizer is not None:
        _worker["minhash"] = MinHasher(setup.clean.minhash_perms)


def _documents(task: list[Chunk], stats: CleanStats) -> Iterator[Document]:
    setup: _Setup = _worker["setup"]
    for chunk in task:
        yield from read_chunk(chunk, setup.text_field, _worker["cleaner"], stats)


def _chars_task(task: list[Chunk]) -> tuple[set[str], CleanStats]:
    stats = CleanStats()
    chars: set[str] = set()
    for doc in _documents(task, stats):
        chars.update(doc.text)
    return chars, stats


def _words_task(
    task: list[Chunk], max_docs: int | None = None
) -> tuple[Counter[bytes], list[int], CleanStats]:
    """Pre-tokenized word counts of the task's (first max_docs) documents, and their lengths."""
    stats = CleanStats()
    counts: Counter[bytes] = Counter()
    lengths: list[int] = []
    for doc in itertools.islice(_documents(task, stats), max_docs):
        count_words(doc.text, counts)
        lengths.append(len(doc.text))
    return counts, lengths, stats


def _encode_task(task: list[Chunk]) -> _Encoded:
    cpu0 = time.process_time()
    setup: _Setup = _worker["setup"]
    tok = setup.tokenizer
    assert tok is not None
    stats = CleanStats()
    docs = list(_documents(task, stats))
    n = len(docs)
    data = [d.text.encode("utf-8", errors="surrogatepass") for d in docs]
    hashes = np.zeros(n, dtype=np.uint64)
    if setup.clean.exact_dedup:
        hashes[:] = [exact_hash(b) for b in data]
    signatures, has_shingles = None, np.zeros(n, dtype=bool)
    if "minhash" in _worker:
        signatures = np.zeros((n, setup.clean.minhash_perms), dtype=np.uint32)
        for i, d in enumerate(docs):
            shingles = shingle_hashes(d.text, setup.clean.shingle_words)
            if shingles.size:
                signatures[i] = _worker["minhash"](shingles)
                has_shingles[i] = True
    dtype = np.dtype(setup.dtype)
    eot = None if tok.eot_token is None else np.array([tok.eot_token], dtype=dtype)
    parts: list[np.ndarray] = []
    lengths = np.zeros(n, dtype=np.int64)
    for i, (doc, ids) in enumerate(zip(docs, tok.encode_batch([d.text for d in docs], dtype), strict=True)):
        parts.append(ids)
        lengths[i] = ids.size
        if eot is not None and doc.last:
            parts.append(eot)
            lengths[i] += 1
    return _Encoded(
        names=[d.name for d in docs],
        is_val=np.array([is_val_document(d.name, setup.seed, setup.val_fraction) for d in docs], dtype=bool),
        hashes=hashes,
        sizes=np.array([len(b) for b in data], dtype=np.int64),
        lengths=lengths,
        tokens=np.concatenate(parts) if parts else np.empty(0, dtype=dtype),
        signatures=signatures,
        has_shingles=has_shingles,
        stats=stats,
        cpu_s=time.process_time() - cpu0,
    )


# ---------------------------------------------------------------------------------------------
# Main side

T = TypeVar("T")


class _Workers:
    """Runs task functions in order over a stream of tasks: in worker processes, or in this
    process when there is only one task (or workers=0)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def map(
        self, fn: Callable[[list[Chunk]], T], setup: _Setup, tasks: Iterator[list[Chunk]]
    ) -> Generator[tuple[list[Chunk], T], None, None]:
        if self.n == 0:
            _init_worker(setup)
            for task in tasks:
                yield task, fn(task)
            return
        executor: Executor = ProcessPoolExecutor(
            self.n, mp_context=_mp_context(), initializer=_init_worker, initargs=(setup,)
        )
        pending: deque[tuple[list[Chunk], Future[T]]] = deque()
        try:
            # A bounded window of tasks in flight: memory stays constant however large the corpus.
            for task in tasks:
                pending.append((task, executor.submit(fn, task)))
                if len(pending) > 2 * self.n:
                    t, fut = pending.popleft()
                    yield t, fut.result()
            while pending:
                t, fut = pending.popleft()
                yield t, fut.result()
        finally:
            for _, fut in pending:
                fut.cancel()
            executor.shutdown(wait=True, cancel_futures=True)


def _mp_context() -> multiprocessing.context.BaseContext:
    """Not fork: the caller may hold threads (a process group, a prefetching loader). A fork
    server that has imported this module once starts each worker in milliseconds, for every
    prepare of this process; spawn where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _worker_count(cfg: DataConfig) -> int:
    """data.workers (default: the usable cores), no more than there are tasks, and none (this
    process) for a single task."""
    if cfg.workers is not None:
        wanted = cfg.workers
    else:
        wanted = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n_tasks = sum(1 for _ in itertools.islice(_tasks(cfg), wanted + 1))
    return 0 if n_tasks <= 1 else min(wanted, n_tasks)


def _inputs(cfg: DataConfig) -> Iterator[Any]:
    return iter_input_files(cfg.corpus, cfg.format, cfg.download_dir, cfg.source)


def _tasks(cfg: DataConfig) -> Iterator[list[Chunk]]:
    return plan_tasks(_inputs(cfg), cfg.chunk_bytes, cfg.text_split_bytes)


def input_fingerprint(cfg: DataConfig, fetch: bool = True) -> dict[str, Any]:
    """Files, bytes, and a digest of every input file's name and identity (size and mtime, or
    the sha256 of a download), walked without reading them. With fetch=False a downloadable
    corpus is not fetched: its digest is known from its sha256 alone (its bytes are then None)."""
    h = hashlib.sha256()
    if not fetch and cfg.corpus in DOWNLOADS:
        d = DOWNLOADS[cfg.corpus]
        h.update(f"{d.filename}\0sha256:{d.sha256}\0{format_of(Path(d.filename), cfg.format)}\n".encode())
        return {"files": 1, "bytes": None, "digest": h.hexdigest()}
    n, total = 0, 0
    for f in _inputs(cfg):
        h.update(f"{f.name}\0{f.identity}\0{f.format}\n".encode())
        n += 1
        total += f.size
    return {"files": n, "bytes": total, "digest": h.hexdigest()}


@dataclass
class _Held:
    """The last kept document, written only once the next one comes: at the end it may have to
    fill an empty split, or be the one document cut 90/10."""

    split: str
    tokens: np.ndarray
    name: str
    task: list[Chunk]


def _progress(log: Callable[[str], None] | None, every_s: float = 10.0) -> Callable[[str], None]:
    last = [time.perf_counter()]

    def tick(msg: str) -> None:
        if log is not None and time.perf_counter() - last[0] >= every_s:
            last[0] = time.perf_counter()
            log(msg)

    return tick


def _fit_tokenizer(
    cfg: DataConfig, workers: _Workers, setup: _Setup, log: Callable[[str], None] | None
) -> Tokenizer:
    if cfg.tokenizer == "gpt2":
        return TiktokenTokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "char":
        chars: set[str] = set()
        for _, (task_chars, _) in workers.map(_chars_task, setup, _tasks(cfg)):
            chars |= task_chars
        if not chars:
            raise DataError(
                f"{cfg.corpus}: no document left after cleaning and filtering; nothing to fit a vocabulary on"
            )
        return CharTokenizer(sorted(chars))
    counts: Counter[bytes] = Counter()
    n_chars = 0
    words = workers.map(_words_task, setup, _tasks(cfg))
    try:
        # The sample: whole documents in corpus order until bpe_train_chars, however they are chunked.
        for task, (task_counts, lengths, _) in words:
            ends = n_chars + np.cumsum(lengths, dtype=np.int64)
            if not len(ends) or ends[-1] < cfg.bpe_train_chars:
                counts.update(task_counts)
                n_chars = int(ends[-1]) if len(ends) else n_chars
                continue
            k = int(np.searchsorted(ends, cfg.bpe_train_chars)) + 1  # the documents that reach it
            _init_worker(setup)  # count them again here
            counts.update(_words_task(task, max_docs=k)[0])
            n_chars = int(ends[k - 1])
            break
    finally:
        words.close()  # stops the workers still busy past the training sample
    if not counts:
        raise DataError(
            f"{cfg.corpus}: no document left after cleaning and filtering; nothing to train a BPE on"
        )
    if log:
        log(
            f"training a {cfg.bpe_vocab_size}-token BPE on {n_chars:,} characters ({len(counts):,} distinct words)"
        )
    return BPETokenizer.train(counts, cfg.bpe_vocab_size)


def _encode(
    cfg: DataConfig,
    tok: Tokenizer,
    workers: _Workers,
    setup: _Setup,
    staging: Path,
    log: Callable[[str], None] | None,
) -> tuple[dict[str, list[ShardInfo]], dict[str, Any]]:
    clean = cfg.clean
    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: ShardWriter(staging, s, dtype, cfg.shard_tokens) for s in SPLITS}
    exact = ExactDedup() if clean.exact_dedup else None
    near = NearDedup(clean.near_dedup_threshold, clean.minhash_perms) if clean.near_dedup else None
    stats = CleanStats()
    t0, cpu0, worker_cpu = time.perf_counter(), time.process_time(), 0.0
    tick = _progress(log)
    held: _Held | None = None
    kept, bytes_out, doc_index = 0, 0, 0
    notes: list[str] = []

    def write(split: str, tokens: np.ndarray, lengths: np.ndarray | list[int]) -> None:
        writers[split].write(tokens, lengths)

    results = workers.map(_encode_task, setup, _tasks(cfg))
    try:
        for task, r in results:
            stats.add(r.stats)
            worker_cpu += r.cpu_s
            n = len(r.names)
            keep = np.ones(n, dtype=bool)
            for i in range(n):  # in corpus order: the first of each duplicate is kept
                if exact is not None and exact.seen(int(r.hashes[i])):
                    stats.remove("exact_duplicate", int(r.sizes[i]))
                    keep[i] = False
                elif (
                    near is not None
                    and r.signatures is not None
                    and r.has_shingles[i]
                    and near.seen(doc_index + i, r.signatures[i])
                ):
                    stats.remove("near_duplicate", int(r.sizes[i]))
                    keep[i] = False
            doc_index += n
            idx = np.flatnonzero(keep)
            if idx.size == 0:
                continue
            kept += idx.size
            bytes_out += int(r.sizes[idx].sum())
            ends = np.cumsum(r.lengths)
            starts = ends - r.lengths
            if held is not None:
                write(held.split, held.tokens, [held.tokens.size])
            last = int(idx[-1])
            held = _Held(
                "val" if r.is_val[last] else "train", r.tokens[starts[last] : ends[last]], r.names[last], task
            )
            rest = idx[:-1]
            for split in SPLITS:
                sel = rest[r.is_val[rest] == (split == "val")]
                if sel.size and sel[-1] - sel[0] + 1 == sel.size:  # a run of documents: a view, no copy
                    write(split, r.tokens[starts[sel[0]] : ends[sel[-1]]], r.lengths[sel])
                elif sel.size:
                    write(split, np.concatenate([r.tokens[starts[i] : ends[i]] for i in sel]), r.lengths[sel])
            tick(
                f"prepare: {stats.bytes_in / 1e6:,.0f} MB read, {stats.bytes_in / 1e6 / (time.perf_counter() - t0):.1f}"
                f" MB/s, {kept:,} documents kept"
            )

        if held is None:
            raise DataError(
                f"{cfg.corpus}: no document left after cleaning and filtering ({_one_line(stats)})"
            )
        if kept == 1:
            # One document can't be split by document: cut it at (1 - val_fraction) of its
            # characters instead, nanoGPT's recipe for tiny-shakespeare (first 90% train, last 10% val).
            text = next(
                d.text
                for d in (
                    doc
                    for c in held.task
                    for doc in read_chunk(c, cfg.text_field, Cleaner(clean), CleanStats())
                )
                if d.name == held.name
            )
            cut = int(len(text) * (1 - cfg.val_fraction))
            if not 0 < cut < len(text):
                raise DataError(
                    f"{cfg.corpus}: its one document ({len(text)} characters) is too short to split into train and val"
                )
            eot = [] if tok.eot_token is None else [tok.eot_token]
            for split, part in (("train", text[:cut]), ("val", text[cut:])):
                ids = np.concatenate([tok.encode_array(part), np.array(eot, dtype=np.int64)]).astype(dtype)
                write(split, ids, [ids.size])
            notes.append("one document: cut at characters into train and val")
        else:
            split = held.split
            if split == "train" and writers["val"].n_docs == 0:
                split = "val"
                notes.append(f"no document hashed to val; the last one ({held.name}) went there")
            elif split == "val" and writers["train"].n_docs == 0:
                split = "train"
                notes.append(f"no document hashed to train; the last one ({held.name}) went there")
            write(split, held.tokens, [held.tokens.size])
        shards = {s: writers[s].close() for s in SPLITS}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        results.close()  # stops the workers at once on an error
    seconds = time.perf_counter() - t0
    report: dict[str, Any] = {
        "documents_in": stats.documents_in,
        "documents_out": kept,
        "bytes_in": stats.bytes_in,
        "bytes_out": bytes_out,
        "removed": {k: {"documents": d, "bytes": b} for k, (d, b) in sorted(stats.removed.items())},
        "changed": {k: {"documents": d, "characters": c} for k, (d, c) in sorted(stats.changed.items())},
        "undecodable": {
            "bytes": stats.undecodable_bytes,
            "documents": stats.undecodable_documents,
            "action": clean.on_decode_error,
        },
        "examples": dict(sorted(stats.first_problem.items())),
        "notes": notes,
        "tokens": {s: sum(x.n_tokens for x in shards[s]) for s in SPLITS},
        "seconds": round(seconds, 3),
        # CPU seconds: tasks (in the workers, or here with none) and this process's own share.
        "cpu_seconds": {
            "tasks": round(worker_cpu, 3),
            "main": round(time.process_time() - cpu0 - (worker_cpu if workers.n == 0 else 0.0), 3),
        },
        "workers": workers.n,
        "dedup_index_bytes": (exact.nbytes if exact else 0),
    }
    return shards, report


def _one_line(stats: CleanStats) -> str:
    removed = ", ".join(f"{k}: {d:,}" for k, (d, _) in sorted(stats.removed.items()))
    return f"{stats.documents_in:,} documents read" + (f"; removed {removed}" if removed else "")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def format_report(report: dict[str, Any]) -> str:
    """The cleaning summary, a few lines for a terminal."""
    lines = [
        f"documents: {report['documents_in']:,} in, {report['documents_out']:,} out; "
        f"{_size(report['bytes_in'])} in, {_size(report['bytes_out'])} out "
        f"({report['seconds']:.1f} s, {report['workers']} workers)"
    ]
    if report["removed"]:
        lines.append(
            "removed:  "
            + "; ".join(
                f"{k} {v['documents']:,} docs ({_size(v['bytes'])})" for k, v in report["removed"].items()
            )
        )
    if report["changed"]:
        lines.append(
            "changed:  "
            + "; ".join(
                f"{k} {v['documents']:,} docs ({v['characters']:,} chars)"
                for k, v in report["changed"].items()
            )
        )
    u = report["undecodable"]
    if u["bytes"]:
        lines.append(f"undecodable bytes: {u['bytes']:,} in {u['documents']:,} documents ({u['action']})")
    lines += [f"e.g. {k}: {v}" for k, v in report["examples"].items()]
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The output directory: staging, swap, no-op check


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(out: Path) -> None:
    """Staging and old directories left by runs that died (this machine's dead pids)."""
    for p in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = p.name.rpartition("-")
        if (
            kind.endswith((".tmp", ".old"))
            and pid.isdigit()
            and int(pid) != os.getpid()
            and not _pid_alive(int(pid))
        ):
            shutil.rmtree(p, ignore_errors=True)


def _check_replaceable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory (data.dataset_dir)")
    if out.is_dir():
        foreign = sorted(
            p.name
            for p in out.iterdir()
            if not (p.name in _OWN_FILES or p.suffix == ".bin" or ".tmp-" in p.name)
        )
        if foreign:
            raise DataError(
                f"{out}: holds files that are not part of a prepared dataset ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); refusing to replace it: set another data.dataset_dir"
            )


def _swap_in(staging: Path, out: Path) -> None:
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _up_to_date(out: Path, cfg: DataConfig, inputs: dict[str, Any]) -> bool:
    """True if `out` holds this dataset; False if it holds none; DataError if another one."""
    if not (out / MANIFEST).exists():
        return False
    manifest = load_manifest(out)
    config, saved = output_config(cfg), manifest["config"]
    changed = sorted(k for k in config.keys() | saved.keys() if config.get(k) != saved.get(k))
    if changed:
        raise DataError(
            f"{out}: holds a dataset prepared with a different data config (differs in: {', '.join(changed)}); "
            "run `pretrain data prepare --force` to overwrite it, or set another data.dataset_dir"
        )
    if manifest.get("inputs", {}).get("digest") != inputs["digest"]:
        was = manifest.get("inputs", {})
        raise DataError(
            f"{out}: the corpus {cfg.corpus} changed since it was prepared ({was.get('files')} files of "
            f"{was.get('bytes')} bytes then, {inputs['files']} files of {inputs['bytes']} bytes now); "
            "run `pretrain data prepare --force` to rebuild it"
        )
    listed = [out / s["path"] for split in SPLITS for s in manifest[split]] + [out / TOKENIZER_FILE]
    return all(p.is_file() for p in listed)


def prepare(cfg: DataConfig, force: bool = False, log: Callable[[str], None] | None = None) -> Path:
    """Build the dataset for `cfg` unless its directory already holds it; return the directory.

    With data.blend nothing is built: the listed datasets are checked (present, one tokenizer)
    and the first one's directory is returned."""
    if cfg.blend:
        return open_datasets(cfg)[0].dir
    out = cfg.resolved_dir()
    if not force and _up_to_date(out, cfg, input_fingerprint(cfg, fetch=False)):
        if log:
            log(f"{out}: already prepared from this corpus and config (--force rebuilds it)")
        return out
    inputs = input_fingerprint(cfg)  # fetches a downloaded corpus (once: it is kept in download_dir)
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        workers = _Workers(_worker_count(cfg))
        if log:
            log(
                f"preparing {cfg.corpus} ({inputs['files']:,} files, {inputs['bytes'] / 1e6:,.1f} MB) into {out}: "
                f"{cfg.tokenizer} tokenizer, {workers.n} worker processes"
            )
        setup = _Setup(cfg.clean, cfg.text_field, cfg.seed, cfg.val_fraction)
        tok = _fit_tokenizer(cfg, workers, setup, log)
        setup.tokenizer, setup.dtype = tok, dtype_for_vocab(tok.vocab_size).name
        shards, report = _encode(cfg, tok, workers, setup, staging, log)
        tok.save(staging / TOKENIZER_FILE)
        manifest = {
            "version": MANIFEST_VERSION,
            "tokenizer": {
                "type": tok.kind,
                "vocab_size": tok.vocab_size,
                "fingerprint": tok.fingerprint(),
                "eot_token": tok.eot_token,
                "dtype": dtype_for_vocab(tok.vocab_size).name,
            },
            **{
                split: [
                    {"path": s.path.name, "n_tokens": s.n_tokens, "n_docs": s.n_docs, "sha256": s.sha256}
                    for s in shards[split]
                ]
                for split in SPLITS
            },
            "config": output_config(cfg),
            "inputs": inputs,
            "report": report,
        }
        _write_atomic(staging / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        _swap_in(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# Reading a prepared dataset back


def load_manifest(dataset_dir: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset, checked for shape."""
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{path}: not found; the dataset is missing or incomplete: run `pretrain data prepare` first"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(
            f"{path}: malformed manifest ({e}); rebuild it with `pretrain data prepare --force`"
        ) from e
    problems = _manifest_problems(manifest)
    if problems:
        raise DataError(
            f"{path}: malformed manifest: {'; '.join(problems)}; rebuild it with `pretrain data prepare --force`"
        )
    return manifest


def _manifest_problems(m: Any) -> list[str]:
    if not isinstance(m, dict):
        return ["not a JSON object"]
    if m.get("version") != MANIFEST_VERSION:
        return [f"version {m.get('version')!r}, this code reads version {MANIFEST_VERSION}"]
    problems = []
    tok = m.get("tokenizer")
    if not (isinstance(tok, dict) and {"type", "vocab_size", "fingerprint"} <= tok.keys()):
        problems.append("'tokenizer' needs type, vocab_size and fingerprint")
    for split in SPLITS:
        entries = m.get(split)
        if not (isinstance(entries, list) and entries):
            problems.append(f"'{split}' must be a non-empty list of shards")
            continue
        for i, e in enumerate(entries):
            if not (isinstance(e, dict) and {"path", "n_tokens", "n_docs", "sha256"} <= e.keys()):
                problems.append(f"'{split}'[{i}] needs path, n_tokens, n_docs and sha256")
    if not isinstance(m.get("config"), dict):
        problems.append("'config' must be an object")
    return problems


def shard_paths(dataset_dir: str | Path, split: str) -> list[Path]:
    """The shard files of one split ('train' or 'val') of a prepared dataset, in order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [Path(dataset_dir) / e["path"] for e in load_manifest(dataset_dir)[split]]


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset as a run uses it: its directory, manifest and blend weight."""

    dir: Path
    manifest: dict[str, Any]
    weight: float = 1.0

    def shard_paths(self, split: str) -> list[Path]:
        return [self.dir / e["path"] for e in self.manifest[split]]

    def n_tokens(self, split: str) -> int:
        return sum(int(e["n_tokens"]) for e in self.manifest[split])


def open_datasets(cfg: DataConfig) -> list[Dataset]:
    """The datasets a run trains on (data.blend, or the one prepared from data.corpus), each
    checked against this config's tokenizer and against its own shards' headers."""
    entries = [(Path(b.dataset_dir), b.weight) for b in cfg.blend] or [(cfg.resolved_dir(), 1.0)]
    datasets = [Dataset(d, load_manifest(d), w) for d, w in entries]
    first = datasets[0]
    for ds in datasets:
        where = ds.dir / MANIFEST
        tok = ds.manifest["tokenizer"]
        if tok["type"] != cfg.tokenizer:
            raise DataError(
                f"{where}: prepared with the {tok['type']} tokenizer (vocab {tok['vocab_size']}), "
                f"but data.tokenizer is {cfg.tokenizer}"
            )
        if cfg.tokenizer == "bpe" and tok["vocab_size"] != cfg.bpe_vocab_size:
            raise DataError(
                f"{where}: prepared with a bpe vocab of {tok['vocab_size']}, but data.bpe_vocab_size is "
                f"{cfg.bpe_vocab_size}"
            )
        ref = first.manifest["tokenizer"]
        if (tok["vocab_size"], tok["fingerprint"]) != (ref["vocab_size"], ref["fingerprint"]):
            raise DataError(
                f"{where}: its {tok['type']} tokenizer (vocab {tok['vocab_size']}, fingerprint "
                f"{tok['fingerprint'][:12]}) differs from {first.dir / MANIFEST}'s (vocab {ref['vocab_size']}, "
                f"fingerprint {ref['fingerprint'][:12]}): blended datasets need one tokenizer"
            )
        for split in SPLITS:
            for e in ds.manifest[split]:
                info = read_header(ds.dir / e["path"])
                if (info.n_tokens, info.sha256) != (e["n_tokens"], e["sha256"]):
                    raise DataError(
                        f"{info.path}: header says {info.n_tokens} tokens, sha256 {info.sha256[:12]}; the manifest "
                        f"lists {e['n_tokens']} tokens, sha256 {e['sha256'][:12]}: not this dataset's shard"
                    )
    return datasets


def summary(manifest: dict[str, Any]) -> str:
    """One line about a prepared dataset."""
    counts = ", ".join(
        f"{split} {sum(s['n_tokens'] for s in manifest[split]):,} tokens / "
        f"{sum(s['n_docs'] for s in manifest[split]):,} docs in {len(manifest[split])} shard"
        f"{'s' if len(manifest[split]) != 1 else ''}"
        for split in SPLITS
    )
    tok = manifest["tokenizer"]
    return f"{counts}, vocab {tok['vocab_size']} ({tok['type']}, {tok.get('dtype', '?')})"
