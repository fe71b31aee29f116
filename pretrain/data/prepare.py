"""Prepare a dataset: corpus → clean → dedup → tokenize → train/val shards + manifest.

    vocabulary (here, workers) ─ tasks.py: encode (workers) ─ exact ─ bands ─ clusters ─ write ─┐
    train_00000.bin ... val_00000.bin, manifest last ◀── staging dir, swapped in whole ◀────────┘

The tokenizer is fitted here (a char vocabulary or a BPE from the corpus, in the worker processes
of workers.py), then the stages of tasks.py build the shards: with data.tasks unset as one task
each, in this process, the encode step's chunks spread over `data.workers` processes; with
data.tasks as that many tasks on data.executor. Dedup keeps the first of each duplicate in corpus
order, so the output depends on neither the number of workers nor the executor. Like any
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
import itertools
import os
import shutil
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.config.tree import DataConfig
from pretrain.data.chunks import Chunk, plan_tasks
from pretrain.data.dataset import (
    MANIFEST,
    MIN_VOCAB,
    SPLITS,
    TOKENIZER_FILE,
    dataset_lock,
    load_manifest,
    open_datasets,
    stop_reading,
    summary,
    too_small_vocab,
    write_manifest,
)
from pretrain.data.dedup import NEAR_DEDUP
from pretrain.data.encode import Setup, chars_task, init_worker, words_task
from pretrain.data.fingerprint import (
    There,
    input_files,
    input_fingerprint,
    listed_changes,
    output_config,
    what_is_there,
)
from pretrain.data.report import Progress, format_report, no_document
from pretrain.data.shards import dtype_for_vocab
from pretrain.data.tasks import DEDUP_REMOVED, build, work_dir
from pretrain.data.tokenizer import (
    BPE_RANKS_FILE,
    HF_TOKENIZER_FILE,
    BPETokenizer,
    CharTokenizer,
    HFTokenizer,
    TiktokenTokenizer,
    Tokenizer,
)
from pretrain.data.workers import STUCK_POOL, Interrupted, Workers, stopping_on_signals, uninterrupted
from pretrain.errors import DataError, require
from pretrain.files import FileLock, check_output_dir, pid_gone, replace_dir, short_name, staging_dir

_OWN_FILES = (MANIFEST, TOKENIZER_FILE, BPE_RANKS_FILE, HF_TOKENIZER_FILE, DEDUP_REMOVED)


def _worker_count(cfg: DataConfig) -> int:
    """data.workers (default: the usable cores), no more than there are tasks, and none (this
    process) for a single task."""
    if cfg.workers is not None:
        wanted = cfg.workers
    else:
        wanted = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    n_tasks = sum(1 for _ in itertools.islice(_tasks(cfg), wanted + 1))
    return 0 if n_tasks <= 1 else min(wanted, n_tasks)


def _tasks(cfg: DataConfig) -> Iterator[list[Chunk]]:
    return plan_tasks(
        input_files(cfg),
        chunk_bytes=cfg.chunk_bytes,
        text_split_bytes=cfg.text_split_bytes,
        text_field=cfg.text_field,
    )


def _task_bytes(task: list[Chunk]) -> int:
    return sum(c.input_bytes for c in task)


def _fit_tokenizer(
    cfg: DataConfig,
    workers: Workers,
    setup: Setup,
    *,
    log: Callable[[str], None] | None,
    total: int | None = None,
) -> Tokenizer:
    if cfg.tokenizer == "gpt2":
        return TiktokenTokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "hf":
        assert cfg.tokenizer_path is not None  # DataConfig's rule
        return HFTokenizer.from_path(cfg.tokenizer_path)
    if cfg.tokenizer == "char":
        chars: set[str] = set()
        progress = Progress("vocabulary", total, log)
        for task, (task_chars, _) in workers.map(chars_task, setup, _tasks(cfg)):
            chars |= task_chars
            progress.update(_task_bytes(task))
        progress.close()
        if not chars:
            raise no_document(cfg.corpus, total, "; nothing to fit a vocabulary on")
        if len(chars) < MIN_VOCAB:
            raise DataError(too_small_vocab(f"{cfg.corpus}: would make", "char", len(chars), sorted(chars)))
        return CharTokenizer(sorted(chars))
    counts: Counter[bytes] = Counter()
    n_chars = 0
    words = workers.map(words_task, setup, _tasks(cfg))
    try:
        # The sample: whole documents in corpus order until bpe_train_chars, however they are chunked.
        for task, (task_counts, lengths, _) in words:
            ends = n_chars + np.cumsum(lengths, dtype=np.int64)
            if not len(ends) or ends[-1] < cfg.bpe_train_chars:
                counts.update(task_counts)
                n_chars = int(ends[-1]) if len(ends) else n_chars
                continue
            k = int(np.searchsorted(ends, cfg.bpe_train_chars)) + 1  # the documents that reach it
            init_worker(setup)  # count them again here
            counts.update(words_task(task, max_docs=k)[0])
            n_chars = int(ends[k - 1])
            break
    finally:
        words.close()  # stops the workers still busy past the training sample
    if not counts:
        raise no_document(cfg.corpus, total, "; nothing to train a BPE on")
    if log:
        log(
            f"training a {cfg.bpe_vocab_size}-token BPE on {n_chars:,} characters ({len(counts):,} distinct words)"
        )
    return BPETokenizer.train(counts, cfg.bpe_vocab_size)


# ---------------------------------------------------------------------------------------------
# The output directory: staging, swap, no-op check


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
            and pid_gone(int(pid))
        ):
            if p.is_symlink():
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)


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
    if cfg.tasks is not None and cfg.executor == "ray":
        require("ray", "a prepare's tasks on Ray (data.executor 'ray')", "ray")
    had = (out / MANIFEST).is_file()
    swapped: list[bool] = []
    with stopping_on_signals():
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
        if not force and _prepared_already(cfg, out, lock, wait=wait, say=say, log=log):
            return out
        inputs = input_fingerprint(cfg)  # fetches a downloaded corpus (once: it is kept in download_dir)
        _check_dir(out)
        made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
        out.parent.mkdir(parents=True, exist_ok=True)
        _take(lock, out, exclusive=True, wait=wait, say=say)
        there = what_is_there(out, cfg, inputs, force=force, say=say)  # now, under the lock
        if there.ready and not force:
            if log:
                log(f"{out}: prepared meanwhile by another prepare, from this corpus and config")
            return out
        _say_what_is_rebuilt(out, there, force=force, say=say)
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


def _prepared_already(
    cfg: DataConfig,
    out: Path,
    lock: FileLock,
    *,
    wait: bool,
    say: Callable[[str], None],
    log: Callable[[str], None] | None,
) -> bool:
    """Whether `out` holds this dataset already, checked under the shared lock (taken and kept) and
    without fetching a downloaded corpus."""
    if out.parent.is_dir():  # else there is no dataset, and nothing is made just to check
        _take(lock, out, exclusive=False, wait=wait, say=say)
    if what_is_there(out, cfg, input_fingerprint(cfg, fetch=False), force=False, say=say).ready:
        if log:
            log(f"{out}: already prepared from this corpus and config (--force rebuilds it)")
        return True
    return False


def _check_dir(out: Path) -> None:
    """`out` is new, empty, or holds only what a prepare writes there."""
    check_output_dir(
        out,
        None,
        "prepared dataset",
        "data.dataset_dir",
        is_own_entry=lambda p: p.name in _OWN_FILES or p.suffix == ".bin" or ".tmp-" in p.name,
        error=DataError,
    )


def _say_what_is_rebuilt(out: Path, there: There, *, force: bool, say: Callable[[str], None]) -> None:
    """What a build replaces in `out`: another dataset (--force), this one (--force), or an incomplete one."""
    if force and there.changes:
        say(f"replacing the dataset in {out} (--force); it was prepared with {listed_changes(there.changes)}")
    elif force and there.manifest is not None:
        say(f"rebuilding {out} (--force), with the settings and corpus it was prepared from")
    elif there.missing:
        _stderr(
            f"warning: {out}: {', '.join(there.missing[:3])}{' ...' if len(there.missing) > 3 else ''} "
            "listed in its manifest but missing; rebuilding the dataset from its corpus, with the same settings"
        )


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
        workers = Workers(_worker_count(cfg))
        own_val = (inputs.get("val") or {}).get("split")
        if log:
            log(
                f"preparing {cfg.corpus} ({inputs['files']:,} files, {inputs['bytes'] / 1e6:,.1f} MB) into {out}: "
                f"{cfg.tokenizer} tokenizer, "
                + (
                    f"{workers.n} worker processes"
                    if cfg.tasks is None
                    else f"as {cfg.tasks} task{'s' if cfg.tasks != 1 else ''} on the {cfg.executor} executor"
                )
            )
            if own_val:
                log(
                    f"val: the dataset's own {own_val!r} split ({_files(inputs['val']['files'])}); train: all of "
                    f"{cfg.hf_split!r} (data.val_fraction does not apply)"
                )
        setup = Setup(cfg.clean, cfg.text_field, cfg.seed, cfg.val_fraction)
        tok = _fit_tokenizer(cfg, workers, setup, log=log, total=inputs["bytes"])
        setup.tokenizer, setup.dtype = tok, dtype_for_vocab(tok.vocab_size).name
        shards, report, work = build(
            cfg, tok, setup, out=out, staging=staging, inputs=inputs, workers=workers.n, log=log
        )
        for warning in report["warnings"]:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        tok.save(staging / TOKENIZER_FILE)
        recorded = {k: v for k, v in inputs.items() if k != "legacy_digest"}
        write_manifest(
            staging, tokenizer=tok, shards=shards, config=output_config(cfg), inputs=recorded, report=report
        )
        with uninterrupted():  # the swap is two renames: never stopped between them
            replace_dir(staging, out)
            swapped.append(True)
        shutil.rmtree(work, ignore_errors=True)  # the tasks' own files, kept until the dataset was in place
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if cfg.tasks is None:  # one host's tasks are not run again alone: nothing of a failed try is kept
            shutil.rmtree(work_dir(out), ignore_errors=True)


def prepare_and_report(data: DataConfig, *, source: str | None, workers: int | None, force: bool) -> int:
    """`pretrain data prepare`: `prepare` with --source and --workers applied, its report printed;
    the exit code (128 + the signal for a stop asked by SIGINT or SIGTERM: workers stopped, staging
    removed, lock released, one line said)."""
    if source is not None or workers is not None:
        update = {"source": source or data.source, "workers": data.workers if workers is None else workers}
        data = type(data).model_validate({**data.model_dump(), **update})

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        # Another prepare of this directory: refused at once here (`train` waits for it).
        out = prepare(data, force=force, log=log, wait=False)
    except Interrupted as e:
        print(e, file=sys.stderr, flush=True)
        if STUCK_POOL:  # the exit's join of a pool stopped mid-task would wait forever (CPython gh-94777)
            sys.stdout.flush()
            os._exit(128 + e.signum)
        return 128 + e.signum
    m = load_manifest(out)
    if not data.blend:
        print(format_report(m["report"]))
    print(f"dataset ready in {out}: {summary(m)}")
    return 0
