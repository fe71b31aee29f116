"""Prepare a dataset: corpus → clean → dedup → tokenize → train/val shards + manifest.

    documents (corpus.py) ─ workers: read, clean, hash, MinHash, tokenize ─┐
                                                                          ├─ main: dedup in corpus
    train_00000.bin ... val_00000.bin ◀─ ShardWriter ◀─ split by name ◀────┘  order, write shards

Worker processes (one per core, started by a fork server) take chunks of input in order and send
back tokens and hashes; the main process keeps the first of each duplicate, so the output does not depend on the
number of workers. Memory stays constant apart from the dedup indexes (see dedup.py). Like any
multiprocessing child, a worker imports the calling program's main module again: keep heavy
imports out of a script's top level.

The dataset is built in a staging directory next to `cfg.resolved_dir()` (next to the directory
it points to, where it is a link: the link is kept, and written through) and swapped in whole
at the end, manifest written last: a failed or interrupted run leaves the previous dataset as it
was, and no file under the final name that looks complete but isn't. A second run with the same
config and input is a no-op; a different one is refused unless `force`. The dataset's OS lock
(dataset.py) is held exclusively while it is built, so two prepares never build one directory at
once, nor one under a run that reads it. SIGINT and SIGTERM stop a prepare at once, workers
included, and leave the previous dataset as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import forkserver
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pretrain.config.tree import CleanConfig, DataConfig
from pretrain.data.chunks import Chunk, Document, plan_tasks, read_chunk
from pretrain.data.clean import Cleaner, CleanStats
from pretrain.data.dataset import (
    MANIFEST,
    MIN_VOCAB,
    SPLITS,
    TOKENIZER_FILE,
    dataset_lock,
    load_manifest,
    open_datasets,
    stop_reading,
    too_small_vocab,
    write_manifest,
)
from pretrain.data.dedup import NEAR_DEDUP, ExactDedup, MinHasher, NearDedup, exact_hash, shingle_hashes
from pretrain.data.shards import ShardInfo, ShardWriter, dtype_for_vocab
from pretrain.data.sources import (
    DOWNLOADS,
    HF_PREFIX,
    HFOptions,
    format_of,
    is_saved_dataset,
    iter_input_files,
)
from pretrain.data.tokenizer import (
    BPE_RANKS_FILE,
    BPETokenizer,
    CharTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    count_words,
)
from pretrain.errors import DataError, require
from pretrain.files import FileLock, check_output_dir, format_bytes, replace_dir, short_name, staging_dir

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
        "hf_streaming",
    }
)
# Output fields that older manifests lack: left out of the comparison while at their defaults.
_NEW_OUTPUT_DEFAULTS: dict[str, Any] = {"hf_config": None, "hf_split": "train"}
_OWN_FILES = (MANIFEST, TOKENIZER_FILE, BPE_RANKS_FILE)


def output_config(cfg: DataConfig) -> dict[str, Any]:
    return {
        k: v
        for k, v in cfg.model_dump(mode="json").items()
        if k not in NOT_OUTPUT_FIELDS and not (k in _NEW_OUTPUT_DEFAULTS and v == _NEW_OUTPUT_DEFAULTS[k])
    }


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


def _init_pool_worker(setup: _Setup, main_alive: multiprocessing.connection.Connection) -> None:
    """A worker process: Ctrl-C at a terminal (sent to the whole process group) is the main
    process's to handle, and the worker ends when the main process is gone, even by kill -9."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_main, args=(main_alive,), daemon=True).start()
    _init_worker(setup)


def _exit_with_main(main_alive: multiprocessing.connection.Connection) -> None:
    """Only the main process holds the pipe's other end: end of file means it is gone."""
    with contextlib.suppress(EOFError, OSError):
        main_alive.recv_bytes()
    os._exit(1)


def _documents(task: list[Chunk], stats: CleanStats) -> Iterator[tuple[Chunk, Document]]:
    setup: _Setup = _worker["setup"]
    for chunk in task:
        for doc in read_chunk(chunk, setup.text_field, _worker["cleaner"], stats):
            yield chunk, doc


def _chars_task(task: list[Chunk]) -> tuple[set[str], CleanStats]:
    stats = CleanStats()
    chars: set[str] = set()
    for _, doc in _documents(task, stats):
        chars.update(doc.text)
    return chars, stats


def _words_task(
    task: list[Chunk], max_docs: int | None = None
) -> tuple[Counter[bytes], list[int], CleanStats]:
    """Pre-tokenized word counts of the task's (first max_docs) documents, and their lengths."""
    stats = CleanStats()
    counts: Counter[bytes] = Counter()
    lengths: list[int] = []
    for _, doc in itertools.islice(_documents(task, stats), max_docs):
        count_words(doc.text, counts)
        lengths.append(len(doc.text))
    return counts, lengths, stats


def _encode_task(task: list[Chunk]) -> _Encoded:
    cpu0 = time.process_time()
    setup: _Setup = _worker["setup"]
    tok = setup.tokenizer
    assert tok is not None
    stats = CleanStats()
    found = list(_documents(task, stats))
    docs = [d for _, d in found]
    # A dataset's own validation split goes to val, the rest of it to train; else by name.
    is_val = [
        c.split == "val" if c.split else is_val_document(d.name, setup.seed, setup.val_fraction)
        for c, d in found
    ]
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
        is_val=np.array(is_val, dtype=bool),
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


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a prepare. Raised in the main thread (held back while worker
    processes start or stop, or the dataset is swapped in), so that every `finally` runs: the
    workers are stopped, the staging directory removed, the lock released. Its message says what
    is left; `signum` gives the exit status (128 + signum)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        super().__init__(f"interrupted ({self.what}): data prepare stopped")


class _Signals:
    depth = 0  # inside `_uninterrupted`: a signal is held until it ends
    held: int | None = None


def _on_signal(signum: int, frame: Any) -> None:
    if _Signals.depth:
        _Signals.held = _Signals.held or signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while worker processes start or stop (a process left half started
    would outlive this one) or the dataset is swapped in; raise Interrupted once it is done."""
    _Signals.depth += 1
    try:
        yield
    finally:
        _Signals.depth -= 1
        if _Signals.depth == 0 and _Signals.held is not None:
            signum, _Signals.held = _Signals.held, None
            raise Interrupted(signum)


@contextlib.contextmanager
def _stopping_on_signals() -> Iterator[None]:
    """While prepare runs: SIGINT and SIGTERM raise Interrupted (instead of a traceback, or of a
    death that leaves the workers behind), where this process (its main thread) has no handler of
    its own for them; `train` installs its own only after prepare."""
    installed: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                installed[sig] = signal.signal(sig, _on_signal)
    try:
        yield
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)
        if installed:
            _Signals.held = None


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
        # The workers watch the read end: end of file when this process is gone, even by kill -9.
        main_alive, keep_alive = multiprocessing.Pipe(duplex=False)
        executor: ProcessPoolExecutor | None = None
        pending: deque[tuple[list[Chunk], Future[T]]] = deque()
        finished = False
        try:
            with _uninterrupted():
                executor = ProcessPoolExecutor(
                    self.n,
                    mp_context=_mp_context(),
                    initializer=_init_pool_worker,
                    initargs=(setup, main_alive),
                )
            # A bounded window of tasks in flight: memory stays constant however large the corpus.
            for task in tasks:
                with _uninterrupted():  # a submit may start a worker process
                    pending.append((task, executor.submit(fn, task)))
                if len(pending) > 2 * self.n:
                    t, fut = pending.popleft()
                    yield t, fut.result()
            while pending:
                t, fut = pending.popleft()
                yield t, fut.result()
            finished = True
        finally:
            with _uninterrupted():
                # No future is cancelled here: the pool, broken by the workers' end, fails each one it
                # still holds, and in Python 3.11 it raises on one found cancelled.
                if executor is not None:
                    if finished:
                        executor.shutdown(wait=True)
                    else:  # an error, a signal, or the caller is done: stop them at once
                        _terminate(executor)
                        _shutdown_within(executor, SHUTDOWN_S)
                main_alive.close()
                keep_alive.close()


SHUTDOWN_S = 10.0  # how long a stopped pool gets to wind down before this process goes on without it


STUCK_POOL: list[bool] = []  # a pool whose shutdown did not finish: the exit must not wait for it


def _shutdown_within(executor: ProcessPoolExecutor, seconds: float) -> None:
    """Shut down a pool whose workers were just terminated, waiting at most `seconds`: a worker
    terminated while this process's queue feeder writes a task to it can leave the pool's manager
    thread waiting forever (CPython gh-94777). The workers themselves are gone either way; a pool
    left stuck is noted in STUCK_POOL, for the command to exit without joining it."""
    done = threading.Thread(target=executor.shutdown, kwargs={"wait": True}, daemon=True)
    done.start()
    done.join(seconds)
    if done.is_alive():
        STUCK_POOL.append(True)
    for p in list((getattr(executor, "_processes", None) or {}).values()):
        with contextlib.suppress(OSError, ValueError, AssertionError):
            p.join(max(0.0, seconds - 1))
            if p.is_alive():
                p.kill()


def _terminate(executor: ProcessPoolExecutor) -> None:
    """Stop the pool's workers now, not after their current task (shutdown then reaps them)."""
    stop = getattr(executor, "terminate_workers", None)  # Python 3.14
    if stop is not None:
        stop()
        return
    # The queue's feeder thread may be writing a task to a worker about to die: the pool's shutdown
    # must not wait for it (its join_thread), or it waits forever (CPython gh-94777).
    call_queue = getattr(executor, "_call_queue", None)
    if call_queue is not None:
        call_queue.cancel_join_thread()
    workers = list((getattr(executor, "_processes", None) or {}).values())
    for p in workers:
        with contextlib.suppress(OSError, ValueError):
            p.terminate()
    for p in workers:
        with contextlib.suppress(OSError, ValueError, AssertionError):
            p.join(SHUTDOWN_S)
    # A worker terminated while sending its result leaves part of a message in the result pipe, and the
    # pool's manager thread reading it waits for the rest forever. With every worker gone, closing this
    # process's own write end gives that read an end of file: the pool sees itself broken and winds down.
    result_queue = getattr(executor, "_result_queue", None)
    with contextlib.suppress(AttributeError, OSError):
        result_queue._writer.close()  # type: ignore[union-attr]


def _mp_context() -> multiprocessing.context.BaseContext:
    """Not fork: the caller may hold threads (a process group, a prefetching loader). A fork
    server that has imported this module once starts each worker in milliseconds, for every
    prepare of this process; spawn where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    if threading.current_thread() is threading.main_thread():
        # Started with SIGINT ignored, the fork server and every worker it forks inherit that from
        # birth: a Ctrl-C to the process group while a worker is still starting prints nothing.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, previous)
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


def _inputs(cfg: DataConfig, *, with_val: bool = True) -> Iterator[Any]:
    """The input files; a Hugging Face dataset's own validation split too (`with_val`), last."""
    hf = HFOptions(cfg.hf_config, cfg.hf_split, cfg.hf_streaming, with_val=with_val)
    return iter_input_files(
        cfg.corpus, fmt=cfg.format, download_dir=cfg.download_dir, source=cfg.source, hf=hf
    )


def _tasks(cfg: DataConfig) -> Iterator[list[Chunk]]:
    return plan_tasks(
        _inputs(cfg),
        chunk_bytes=cfg.chunk_bytes,
        text_split_bytes=cfg.text_split_bytes,
        text_field=cfg.text_field,
    )


def input_fingerprint(cfg: DataConfig, fetch: bool = True) -> dict[str, Any]:
    """Files, bytes, and a digest of every input file's name and identity (size and mtime, or
    the sha256 of a download), walked without reading them; a dataset's own validation split
    apart, under "val" (None: it has none). With fetch=False a downloadable corpus is not fetched:
    its digest is known from its sha256 alone (its bytes are then None), and a stream's splits are
    not looked up ("val" left out)."""
    h = hashlib.sha256()
    if not fetch and cfg.corpus in DOWNLOADS:
        d = DOWNLOADS[cfg.corpus]
        h.update(f"{d.filename}\0sha256:{d.sha256}\0{format_of(Path(d.filename), cfg.format)}\n".encode())
        return {"files": 1, "bytes": None, "digest": h.hexdigest()}
    legacy, val = hashlib.sha256(), hashlib.sha256()
    n, total, has_legacy, val_name, n_val, val_bytes = 0, 0, False, "", 0, 0
    looks_up_val = fetch or not (cfg.hf_streaming and cfg.corpus.startswith(HF_PREFIX))
    for f in _inputs(cfg, with_val=looks_up_val):
        line = f"{f.name}\0{f.identity}\0{f.format}\n"
        if f.split == "val":
            val.update(line.encode())
            val_name, n_val, val_bytes = val_name or f.name, n_val + 1, val_bytes + f.size
            continue
        h.update(line.encode())
        legacy.update(f"{f.legacy_name or f.name}\0{f.identity}\0{f.format}\n".encode())
        has_legacy |= f.legacy_name is not None
        n += 1
        total += f.size
    out: dict[str, Any] = {"files": n, "bytes": total, "digest": h.hexdigest()}
    if has_legacy:
        out["legacy_digest"] = legacy.hexdigest()  # as named before: a dataset prepared then matches
    if looks_up_val and _is_hf(cfg.corpus):
        split = val_name[val_name.rfind("[") + 1 : -1] if val_name.endswith("]") else val_name
        out["val"] = (
            {"split": split, "files": n_val, "bytes": val_bytes, "digest": val.hexdigest()} if n_val else None
        )
    return out


def _is_hf(corpus: str) -> bool:
    """A Hugging Face dataset: hf:NAME, or a save_to_disk directory."""
    if corpus.startswith(HF_PREFIX):
        return True
    path = Path(os.path.expanduser(corpus))
    return path.is_dir() and is_saved_dataset(path)


@dataclass
class _Held:
    """The last kept document, written only once the next one comes: at the end it may have to
    fill an empty split, or be the one document cut 90/10."""

    split: str
    tokens: np.ndarray
    name: str
    task: list[Chunk]


class Progress:
    """Input bytes read of the total, with the rate and an ETA: a tqdm bar on a terminal, else a
    line through `log` every `every_s` seconds and one at the end. Nothing without a log."""

    def __init__(
        self,
        what: str,
        total: int | None,
        log: Callable[[str], None] | None,
        *,
        terminal: bool | None = None,
        every_s: float = 10.0,
    ) -> None:
        self.what, self.total, self.log, self.every_s = what, total or None, log, every_s
        self.done, self.kept = 0, 0
        self.t0 = self.last = time.perf_counter()
        self.bar: Any = None
        if log is not None and (sys.stderr.isatty() if terminal is None else terminal):
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                desc=what,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def update(self, n_bytes: int, kept: int | None = None) -> None:
        self.done += n_bytes
        if kept is not None:
            self.kept = kept
        if self.bar is not None:
            self.bar.update(n_bytes)
            if kept is not None:
                self.bar.set_postfix(docs=f"{kept:,}", refresh=False)
        elif self.log is not None and time.perf_counter() - self.last >= self.every_s:
            self.last = time.perf_counter()
            self.log(self.line())

    def line(self) -> str:
        """'prepare: 45% (68.0 of 150.0 MB), 12.3 MB/s, ETA 7s, 12,345 documents kept'."""
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.done / seconds
        parts = [f"{self.what}: "]
        if self.total:
            parts.append(f"{min(100.0, 100 * self.done / self.total):.0f}% ")
            parts.append(f"({self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB), ")
        else:
            parts.append(f"{self.done / 1e6:,.1f} MB, ")
        parts.append(f"{rate / 1e6:,.1f} MB/s")
        if self.total:
            left = max(self.total - self.done, 0) / rate if rate > 0 else float("inf")
            parts.append(f", ETA {_eta(left)}")
        if self.kept:
            parts.append(f", {self.kept:,} documents kept")
        return "".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.log is not None:
            self.log(self.line())


def _eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _task_bytes(task: list[Chunk]) -> int:
    return sum(c.input_bytes for c in task)


def _fit_tokenizer(
    cfg: DataConfig,
    workers: _Workers,
    setup: _Setup,
    *,
    log: Callable[[str], None] | None,
    total: int | None = None,
) -> Tokenizer:
    if cfg.tokenizer == "gpt2":
        return TiktokenTokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "char":
        chars: set[str] = set()
        progress = Progress("vocabulary", total, log)
        for task, (task_chars, _) in workers.map(_chars_task, setup, _tasks(cfg)):
            chars |= task_chars
            progress.update(_task_bytes(task))
        progress.close()
        if not chars:
            raise _no_document(cfg.corpus, total, "; nothing to fit a vocabulary on")
        if len(chars) < MIN_VOCAB:
            raise DataError(too_small_vocab(f"{cfg.corpus}: would make", "char", len(chars), sorted(chars)))
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
        raise _no_document(cfg.corpus, total, "; nothing to train a BPE on")
    if log:
        log(
            f"training a {cfg.bpe_vocab_size}-token BPE on {n_chars:,} characters ({len(counts):,} distinct words)"
        )
    return BPETokenizer.train(counts, cfg.bpe_vocab_size)


def _no_document(corpus: str, total: int | None, why: str) -> DataError:
    """No document to tokenize: the corpus is empty (0 bytes), or cleaning and filtering left none."""
    if total == 0:
        return DataError(f"{corpus}: empty, 0 bytes; point data.corpus at files with text in them")
    return DataError(f"{corpus}: no document left after cleaning and filtering{why}")


def _encode(
    cfg: DataConfig,
    tok: Tokenizer,
    workers: _Workers,
    setup: _Setup,
    staging: Path,
    *,
    log: Callable[[str], None] | None,
    total: int | None = None,
    own_val: str | None = None,
) -> tuple[dict[str, list[ShardInfo]], dict[str, Any]]:
    """Tokenize every task in the workers; here, in corpus order: dedup, split, write the shards.
    `own_val`: the name of the dataset's own validation split, which is val (no split by hash)."""
    clean = cfg.clean
    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: ShardWriter(staging, s, dtype, shard_tokens=cfg.shard_tokens) for s in SPLITS}
    exact = ExactDedup() if clean.exact_dedup else None
    near = NearDedup(clean.near_dedup_threshold, clean.minhash_perms) if clean.near_dedup else None
    stats = CleanStats()
    t0, cpu0, worker_cpu = time.perf_counter(), time.process_time(), 0.0
    progress = Progress("prepare", total, log)
    largest = (0, "", "")  # tokens, name, split of the largest kept document
    held: _Held | None = None
    kept, bytes_out, doc_index = 0, 0, 0
    results = workers.map(_encode_task, setup, _tasks(cfg))
    try:
        for task, r in results:
            stats.add(r.stats)
            worker_cpu += r.cpu_s
            idx = np.flatnonzero(_dedup(r, exact, near, doc_index=doc_index, stats=stats))
            doc_index += len(r.names)
            if idx.size:
                kept += idx.size
                bytes_out += int(r.sizes[idx].sum())
                held = _write_kept(writers, r, idx, held, task)
                i = int(idx[np.argmax(r.lengths[idx])])
                if r.lengths[i] > largest[0]:
                    largest = (int(r.lengths[i]), r.names[i], "val" if r.is_val[i] else "train")
            progress.update(_task_bytes(task), kept)
        if held is None:
            raise _no_document(cfg.corpus, total, f" ({_one_line(stats)})")
        notes = _write_last(cfg, tok, writers, held, kept=kept)
        if own_val:
            notes.insert(0, f"val is the dataset's own {own_val!r} split (data.val_fraction not used)")
        shards = {s: writers[s].close() for s in SPLITS}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        results.close()  # stops the workers at once on an error
        progress.close()
    report = _report(
        stats,
        clean,
        kept=kept,
        bytes_out=bytes_out,
        notes=notes,
        shards=shards,
        seconds=time.perf_counter() - t0,
    )
    report["warnings"] = (
        [] if own_val else _split_warnings(cfg, tokens=report["tokens"], kept=kept, largest=largest)
    )
    # CPU seconds: tasks (in the workers, or here with none) and this process's own share.
    main_cpu = time.process_time() - cpu0 - (worker_cpu if workers.n == 0 else 0.0)
    report["cpu_seconds"] = {"tasks": round(worker_cpu, 3), "main": round(main_cpu, 3)}
    report["workers"] = workers.n
    report["dedup_index_bytes"] = exact.nbytes if exact else 0
    return shards, report


def _dedup(
    r: _Encoded, exact: ExactDedup | None, near: NearDedup | None, *, doc_index: int, stats: CleanStats
) -> np.ndarray:
    """Which of a task's documents to keep: in corpus order, the first of each duplicate."""
    keep = np.ones(len(r.names), dtype=bool)
    for i in range(len(r.names)):
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
    return keep


def _write_kept(
    writers: dict[str, ShardWriter], r: _Encoded, idx: np.ndarray, held: _Held | None, task: list[Chunk]
) -> _Held:
    """Write the documents `idx` of a task to their splits, all but the last, which is held back
    (the previously held one is written first); returns the one now held."""
    ends = np.cumsum(r.lengths)
    starts = ends - r.lengths
    if held is not None:
        writers[held.split].write(held.tokens, [held.tokens.size])
    last = int(idx[-1])
    rest = idx[:-1]
    for split in SPLITS:
        sel = rest[r.is_val[rest] == (split == "val")]
        if sel.size and sel[-1] - sel[0] + 1 == sel.size:  # a run of documents: a view, no copy
            writers[split].write(r.tokens[starts[sel[0]] : ends[sel[-1]]], r.lengths[sel])
        elif sel.size:
            writers[split].write(np.concatenate([r.tokens[starts[i] : ends[i]] for i in sel]), r.lengths[sel])
    return _Held(
        "val" if r.is_val[last] else "train", r.tokens[starts[last] : ends[last]], r.names[last], task
    )


def _write_last(
    cfg: DataConfig, tok: Tokenizer, writers: dict[str, ShardWriter], held: _Held, *, kept: int
) -> list[str]:
    """Write the held last document where it fills a gap; returns notes for the report."""
    if kept == 1:
        # One document can't be split by document: cut it at (1 - val_fraction) of its
        # characters instead, nanoGPT's recipe for tiny-shakespeare (first 90% train, last 10% val).
        docs = (
            doc for c in held.task for doc in read_chunk(c, cfg.text_field, Cleaner(cfg.clean), CleanStats())
        )
        text = next(d.text for d in docs if d.name == held.name)
        cut = int(len(text) * (1 - cfg.val_fraction))
        if not 0 < cut < len(text):
            raise DataError(
                f"{cfg.corpus}: its one document ({len(text)} characters) is too short to split into train and val"
            )
        eot = [] if tok.eot_token is None else [tok.eot_token]
        dtype = dtype_for_vocab(tok.vocab_size)
        for split, part in (("train", text[:cut]), ("val", text[cut:])):
            ids = np.concatenate([tok.encode_array(part), np.array(eot, dtype=np.int64)]).astype(dtype)
            writers[split].write(ids, [ids.size])
        return ["one document: cut at characters into train and val"]
    notes, split = [], held.split
    other = "val" if split == "train" else "train"
    if writers[other].n_docs == 0:
        notes.append(f"no document hashed to {other}; the last one ({held.name}) went there")
        split = other
    writers[split].write(held.tokens, [held.tokens.size])
    return notes


def _split_warnings(
    cfg: DataConfig, *, tokens: dict[str, int], kept: int, largest: tuple[int, str, str]
) -> list[str]:
    """A warning when val's share of the tokens is far from data.val_fraction: over twice it
    (training data lost), or under a fifth. Documents go to a split whole, so a few large ones
    skew it; a few dozen documents of a few percent each stay within these bounds."""
    total = sum(tokens.values())
    if kept <= 1 or total == 0:
        return []  # one document is cut at val_fraction exactly
    share, vf = tokens["val"] / total, cfg.val_fraction
    if vf / 5 <= share <= 2 * vf:
        return []
    n, name, split = largest
    return [
        f"val holds {share:.1%} of the tokens, but data.val_fraction is {vf:g}: documents go to a split "
        f"whole, by name, and {kept:,} documents are few or uneven (the largest, {name}, has {n:,} tokens, "
        f"{n / total:.0%} of all, in {split}); use more, smaller documents (a large text file is cut at "
        "data.text_split_bytes), or another data.seed"
    ]


def _report(
    stats: CleanStats,
    clean: CleanConfig,
    *,
    kept: int,
    bytes_out: int,
    notes: list[str],
    shards: dict[str, list[ShardInfo]],
    seconds: float,
) -> dict[str, Any]:
    """The manifest's report: what cleaning and dedup did, and what was written."""
    return {
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
    }


def _one_line(stats: CleanStats) -> str:
    removed = ", ".join(f"{k}: {d:,}" for k, (d, _) in sorted(stats.removed.items()))
    return f"{stats.documents_in:,} documents read" + (f"; removed {removed}" if removed else "")


def format_report(report: dict[str, Any]) -> str:
    """The cleaning summary, a few lines for a terminal."""
    lines = [
        f"documents: {report['documents_in']:,} in, {report['documents_out']:,} out; "
        f"{format_bytes(report['bytes_in'])} in, {format_bytes(report['bytes_out'])} out "
        f"({report['seconds']:.1f} s, {report['workers']} workers)"
    ]
    for kind, show in (
        ("removed", lambda v: format_bytes(v["bytes"])),
        ("changed", lambda v: f"{v['characters']:,} chars"),
    ):
        if report[kind]:
            each = (f"{k} {v['documents']:,} docs ({show(v)})" for k, v in report[kind].items())
            lines.append(f"{kind}:  " + "; ".join(each))
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
    """Staging and old directories left by runs that died (this machine's dead pids), beside the
    directory `out` is (what a link there points to; a link set aside by an older version, too)."""
    real = Path(os.path.realpath(out))
    stem = f".{short_name(real.name)}."
    for p in real.parent.iterdir() if real.parent.is_dir() else ():
        kind, _, pid = p.name.removeprefix(stem).rpartition("-")
        if (
            p.name.startswith(stem)
            and kind in ("tmp", "old")
            and pid.isdigit()
            and int(pid) != os.getpid()
            and not _pid_alive(int(pid))
        ):
            if p.is_symlink():
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"clean": {"near_dedup": True}} -> {"clean.near_dedup": True}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _corpus_key(corpus: Any) -> Any:
    """A saved dataset is the same corpus given as PATH or as hf:PATH."""
    if isinstance(corpus, str) and corpus.startswith(HF_PREFIX):
        path = Path(os.path.expanduser(corpus.removeprefix(HF_PREFIX)))
        if path.is_dir() and is_saved_dataset(path):
            return corpus.removeprefix(HF_PREFIX)
    return corpus


def _config_changes(cfg: DataConfig, saved: dict[str, Any]) -> list[str]:
    """What differs between the settings that made the dataset there and this config's."""
    now, then = _flat(output_config(cfg)), _flat(saved)
    now["corpus"], then["corpus"] = _corpus_key(now.get("corpus")), _corpus_key(then.get("corpus"))
    keys = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
    return [f"data.{k}: {json.dumps(then.get(k))} there, {json.dumps(now.get(k))} now" for k in keys]


def _listed(changes: list[str]) -> str:
    return "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")


def own_dir(cfg: DataConfig) -> Path:
    """A directory of its own for a dataset of these settings, beside the default one: its name
    ends in a short hash of the settings that make the tokens (`output_config`)."""
    out = cfg.resolved_dir()
    config = output_config(cfg)
    config["corpus"] = _corpus_key(config["corpus"])
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    return out.with_name(f"{out.name}-{digest}")


def _input_change(cfg: DataConfig, was: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How the corpus changed since the dataset was prepared from it, or None."""
    if was.get("digest") not in (now["digest"], now.get("legacy_digest")):
        return (
            f"the corpus {cfg.corpus} changed since it was prepared ({was.get('files')} files of "
            f"{was.get('bytes')} bytes then, {now['files']} files of {now['bytes']} bytes now)"
        )
    if "val" in now and "val" in was and (was["val"] or {}).get("digest") != (now["val"] or {}).get("digest"):
        split = (now["val"] or was["val"] or {}).get("split")
        return f"the validation split {split!r} of {cfg.corpus} changed since the dataset was prepared"
    return None


@dataclass
class _There:
    """What `out` holds: a dataset (its manifest) or none, whether it is this one, complete, and
    otherwise why not (with `force`; without it a different dataset is an error)."""

    manifest: dict[str, Any] | None = None
    ready: bool = False
    missing: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)


def _there(
    out: Path, cfg: DataConfig, inputs: dict[str, Any], *, force: bool, say: Callable[[str], None]
) -> _There:
    """What `out` holds, checked against this config and input. Without `force`, a dataset made
    with other settings, or from a changed corpus, is a DataError naming the choices."""
    if not (out / MANIFEST).exists():
        return _There()
    try:
        manifest = load_manifest(out)
    except DataError:
        if force:
            return _There(changes=["its manifest is unreadable"])
        raise
    changes = _config_changes(cfg, manifest["config"])
    if changes and not force:
        raise DataError(
            f"{out}: holds a dataset prepared with other settings ({_listed(changes)}). To keep it, give "
            f"this one a directory of its own: --set data.dataset_dir={own_dir(cfg)} (in `pretrain train` "
            "too); to replace it, run `pretrain data prepare --force` (runs trained on it then no longer "
            "resume on their data)"
        )
    was = manifest.get("inputs", {})
    changed = None if changes else _input_change(cfg, was, inputs)
    if changed and not force:
        raise DataError(
            f"{out}: {changed}; run `pretrain data prepare --force` to rebuild it, or set another "
            "data.dataset_dir to keep it"
        )
    if changed:
        changes = [changed]
    if not changes and "val" in inputs and "val" not in was and inputs["val"]:
        say(
            f"note: {out} was prepared before a dataset's own validation split was used: its val is "
            f"documents of {cfg.hf_split!r} split off by data.val_fraction; `pretrain data prepare --force` "
            f"rebuilds it with the {inputs['val']['split']!r} split as val"
        )
    listed = [e["path"] for split in SPLITS for e in manifest[split]] + [TOKENIZER_FILE]
    missing = [p for p in listed if not (out / p).is_file()]
    return _There(manifest, not changes and not missing, missing, changes)


def _files(n: int) -> str:
    return f"{n:,} file{'s' if n != 1 else ''}"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _take(lock: FileLock, out: Path, *, exclusive: bool, wait: bool, say: Callable[[str], None]) -> None:
    """Take the dataset's lock: shared to check it, exclusive to build it. Held by another prepare:
    wait for it (`wait`), or a DataError naming it; held by runs reading it (exclusive wanted): a
    DataError naming them, never a wait (a run takes days)."""
    told, readers_seen = False, 0
    while True:
        if lock.acquire(exclusive=exclusive):
            return
        if exclusive and lock.acquire(exclusive=False):  # shared is free: readers hold it
            holder = lock.holder()
            lock.release(remove=False)
            readers_seen += 1
            if readers_seen < 2:
                continue  # or a prepare that has just ended: once more
            raise DataError(
                f"{out}: in use by a run that reads it ({holder}); rebuilding it now would change the data "
                "under that run and what it resumes on: wait for it to end, or prepare into another "
                "data.dataset_dir"
            )
        holder = lock.holder()
        if not wait:
            raise DataError(
                f"{out}: another prepare is building this dataset right now ({holder}); two at once would "
                "replace each other's: wait for it to finish (then this is a no-op if its settings are "
                "these), or set another data.dataset_dir"
            )
        if not told:
            say(f"waiting for {out}: {holder} is building it")
            told = True
        lock.acquire(exclusive=False, wait=True)  # until that prepare ends
        if not exclusive:
            return


def prepare(
    cfg: DataConfig, force: bool = False, log: Callable[[str], None] | None = None, *, wait: bool = True
) -> Path:
    """Build the dataset for `cfg` unless its directory already holds it; return the directory.

    With data.blend nothing is built: the listed datasets are checked (present, one tokenizer)
    and the first one's directory is returned. Another prepare building the same directory is
    waited for (`wait`, as `train` does), or refused at once (`data prepare`). SIGINT and SIGTERM
    raise `Interrupted`, whose message says what the directory holds."""
    if cfg.blend:
        return open_datasets(cfg)[0].dir
    out = cfg.resolved_dir()
    try:
        out.resolve()
    except (RuntimeError, OSError) as e:  # a link loop: RuntimeError before Python 3.13
        raise DataError(f"data.dataset_dir {out}: cannot be resolved ({e}); point it at a directory") from e
    if cfg.clean.near_dedup:
        require("datasketch", NEAR_DEDUP, "near-dedup")  # before any pass over the corpus
    had = (out / MANIFEST).is_file()
    swapped: list[bool] = []
    with _stopping_on_signals():
        try:
            return _prepare(cfg, out, force=force, log=log, wait=wait, swapped=swapped)
        except Interrupted as e:
            left = (
                f"{out} holds the new dataset, complete"
                if swapped
                else f"{out} still holds the dataset it held before, and nothing of this run is left"
                if had
                else f"{out} was not written, and nothing of this run is left"
            )
            e.args = (f"interrupted ({e.what}): data prepare stopped; {left}",)
            raise


def _prepare(
    cfg: DataConfig,
    out: Path,
    *,
    force: bool,
    log: Callable[[str], None] | None,
    wait: bool,
    swapped: list[bool],
) -> Path:
    say = log or _stderr
    lock = dataset_lock(out)
    stop_reading(out)  # this process read it before: that lock would keep out its own rebuild
    made: list[Path] = []  # directories made for the dataset: removed again if it is not made
    try:
        if not force:
            if out.parent.is_dir():  # else there is no dataset, and nothing is made just to check
                _take(lock, out, exclusive=False, wait=wait, say=say)
            if _there(out, cfg, input_fingerprint(cfg, fetch=False), force=False, say=say).ready:
                if log:
                    log(f"{out}: already prepared from this corpus and config (--force rebuilds it)")
                return out
        inputs = input_fingerprint(cfg)  # fetches a downloaded corpus (once: it is kept in download_dir)
        check_output_dir(
            out,
            None,
            "prepared dataset",
            "data.dataset_dir",
            is_own_entry=lambda p: p.name in _OWN_FILES or p.suffix == ".bin" or ".tmp-" in p.name,
            error=DataError,
        )
        made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
        out.parent.mkdir(parents=True, exist_ok=True)
        _take(lock, out, exclusive=True, wait=wait, say=say)
        there = _there(out, cfg, inputs, force=force, say=say)  # now, under the lock
        if there.ready and not force:
            if log:
                log(f"{out}: prepared meanwhile by another prepare, from this corpus and config")
            return out
        if force and there.changes:
            say(f"replacing the dataset in {out} (--force); it was prepared with {_listed(there.changes)}")
        elif force and there.manifest is not None:
            say(f"rebuilding {out} (--force), with the settings and corpus it was prepared from")
        elif there.missing:
            _stderr(
                f"warning: {out}: {', '.join(there.missing[:3])}{' ...' if len(there.missing) > 3 else ''} "
                "listed in its manifest but missing; rebuilding the dataset from its corpus, with the same settings"
            )
        _build(cfg, out, inputs, log=log, swapped=swapped)
        if there.manifest is not None and not there.changes:
            _say_if_rebuilt_alike(out, there.manifest, say)
    finally:
        lock.release()
        if not out.exists():
            for p in made:  # deepest first; only while empty
                with contextlib.suppress(OSError):
                    p.rmdir()
    return out


def _shard_sums(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e["path"], e["sha256"]) for split in SPLITS for e in manifest[split]]


def _say_if_rebuilt_alike(out: Path, before: dict[str, Any], say: Callable[[str], None]) -> None:
    """After a rebuild with the same settings and corpus: whether the shards came out the same."""
    after = load_manifest(out)
    if _shard_sums(after) == _shard_sums(before) and after["tokenizer"] == before["tokenizer"]:
        say(
            f"{out}: rebuilt byte for byte: every shard is the one listed before (a resumed run continues its data order)"
        )
    else:
        _stderr(
            f"warning: {out}: rebuilt, but its shards differ from those listed before (this code, or the "
            "corpus's contents, changed): a run resumed on it will not continue its data order exactly"
        )


def _build(
    cfg: DataConfig,
    out: Path,
    inputs: dict[str, Any],
    *,
    log: Callable[[str], None] | None,
    swapped: list[bool],
) -> None:
    """Build the dataset in a staging directory beside `out`, then swap it in whole."""
    _remove_stale(out)
    staging = staging_dir(out)  # beside what a link at `out` points to: the dataset goes there
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        workers = _Workers(_worker_count(cfg))
        own_val = (inputs.get("val") or {}).get("split")
        if log:
            log(
                f"preparing {cfg.corpus} ({inputs['files']:,} files, {inputs['bytes'] / 1e6:,.1f} MB) into {out}: "
                f"{cfg.tokenizer} tokenizer, {workers.n} worker processes"
            )
            if own_val:
                log(
                    f"val: the dataset's own {own_val!r} split ({_files(inputs['val']['files'])}); train: all of "
                    f"{cfg.hf_split!r} (data.val_fraction does not apply)"
                )
        setup = _Setup(cfg.clean, cfg.text_field, cfg.seed, cfg.val_fraction)
        tok = _fit_tokenizer(cfg, workers, setup, log=log, total=inputs["bytes"])
        setup.tokenizer, setup.dtype = tok, dtype_for_vocab(tok.vocab_size).name
        shards, report = _encode(
            cfg, tok, workers, setup, staging, log=log, total=inputs["bytes"], own_val=own_val
        )
        for warning in report["warnings"]:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        tok.save(staging / TOKENIZER_FILE)
        recorded = {k: v for k, v in inputs.items() if k != "legacy_digest"}
        write_manifest(
            staging, tokenizer=tok, shards=shards, config=output_config(cfg), inputs=recorded, report=report
        )
        with _uninterrupted():  # the swap is two renames: never stopped between them
            replace_dir(staging, out)
            swapped.append(True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
