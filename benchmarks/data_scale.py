"""Prepare at scale: throughput against data.tasks and data.workers, peak memory against corpus
size, and what global dedup holds per document. Every prepare runs in a process of its own, so
its peak RSS (and its task processes' peak, RUSAGE_CHILDREN) is its own.

    .venv/bin/python benchmarks/data_scale.py [--mb 100] [--sizes 100 300 1000] [--skip-sizes]

1. Throughput: the same corpus (--mb) prepared as one host does it (data.tasks unset, data.workers
   2), and as data.tasks 1, 4 and 16 on the local executor with data.workers 1 and 2: wall
   seconds, MB/s of document text, CPU seconds per MB (the prepare's process and its tasks'), and
   the peak RSS of the prepare's process and of its largest worker or task process (sampled). Exact and near dedup on.
2. Memory against corpus size (--sizes, MB): data.tasks grows with the corpus (one task per 25 MB),
   as a real prepare's does; the peak RSS of the prepare's process and of its largest task process
   must stay flat.
3. Dedup per document: the stages of a data.tasks 8 prepare of the --mb corpus run one task at a
   time in this process under tracemalloc (numpy's buffers included): the peak of one exact-dedup
   part, one band part and the clusters task, each per document it covers, and how many documents
   reach the clusters task (those in a bucket of two or more); one host's MinHashLSH index fed the
   same signatures; and the clusters task at size, on 2 million synthetic documents.

The corpus: JSON Lines of documents of about 4 KB (420 words) (words drawn from tinyshakespeare's vocabulary,
grown with suffixes), 2% of them exact copies and 3% near copies (one word in fifty changed) of an
earlier document anywhere before them, seeded; built once per size under --work. GPT-2's ranks
come from tests/data/tokenizers. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing.forkserver
import os
import random
import resource
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GPT2 = ROOT / "tests" / "data" / "tokenizers"
SUFFIXES = ("", "s", "ed", "ing", "ly", "er", "est", "eth", "ness")


def build_corpus(path: Path, megabytes: int, seed: int = 0) -> Path:
    if path.is_file():
        return path
    text = (ROOT / "tests" / "data" / "tinyshakespeare.txt").read_text()
    base = sorted(set(text.lower().split()))
    vocab = [w + s for w in base for s in SUFFIXES]
    rng = random.Random(seed)
    kept: list[str] = []  # a sample of earlier documents, to copy from
    tmp = path.with_suffix(".tmp")
    written = 0
    with open(tmp, "w") as f:
        while written < megabytes * 1_000_000:
            r = rng.random()
            if r < 0.02 and kept:
                doc = rng.choice(kept)
            elif r < 0.05 and kept:
                words = rng.choice(kept).split(" ")
                for _ in range(len(words) // 50):
                    words[rng.randrange(len(words))] = rng.choice(vocab)
                doc = " ".join(words)
            else:
                doc = " ".join(rng.choices(vocab, k=420))
            if len(kept) < 20_000:
                kept.append(doc)
            elif rng.random() < 0.01:
                kept[rng.randrange(len(kept))] = doc
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            written += len(line)
    tmp.rename(path)
    return path


class TaskPeak:
    """The largest RSS of any worker or task process under this one, sampled every 0.1 s from /proc
    (their own ru_maxrss would count what the fork server held when it was forked from here, which
    Linux keeps across exec). The fork server and multiprocessing's resource tracker are left out."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        page, me = os.sysconf("SC_PAGE_SIZE"), os.getpid()
        while not self._stop.wait(0.1):
            parents: dict[int, int] = {}
            for d in Path("/proc").glob("[0-9]*"):
                with contextlib.suppress(OSError, ValueError, IndexError):
                    parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            mine = {me}
            for _ in range(4):  # children, grandchildren, ...
                mine |= {p for p, pp in parents.items() if pp in mine}
            for pid in mine - {me}:
                with contextlib.suppress(OSError, ValueError, IndexError):
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    # The server itself (a child of this process): those it forks share its command line.
                    if parents[pid] == me and (
                        b"forkserver import main" in cmd or b"resource_tracker" in cmd
                    ):
                        continue
                    rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
                    self.peak = max(self.peak, rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def one_prepare(spec: dict[str, Any]) -> dict[str, Any]:
    """One prepare in this process (the --one mode): its seconds and peak memory."""
    from pretrain.config.tree import DataConfig
    from pretrain.data.dataset import load_manifest
    from pretrain.data.prepare import prepare

    cfg = DataConfig.model_validate(spec)
    t0, c0, tasks = time.perf_counter(), os.times(), TaskPeak()
    out = prepare(cfg, force=True)
    seconds, task_peak = time.perf_counter() - t0, tasks.stop()
    # The worker and task processes are the fork server's children: it reaps them, and once it is
    # stopped and reaped here, their CPU time counts in this process's RUSAGE_CHILDREN.
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None):
        server._stop()
    c1 = os.times()
    m = load_manifest(out)
    cpu = (c1.user - c0.user) + (c1.system - c0.system) + (c1.children_user - c0.children_user)
    cpu += c1.children_system - c0.children_system
    return {
        "seconds": seconds,
        "cpu": cpu,
        "bytes_in": m["report"]["bytes_in"],
        "documents_in": m["report"]["documents_in"],
        "removed": {k: v["documents"] for k, v in m["report"]["removed"].items()},
        "rss_main_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_task_mb": task_peak / 2**20,
    }


def run_one(corpus: Path, out: Path, **over: Any) -> dict[str, Any]:
    spec = {
        "corpus": str(corpus),
        "tokenizer": "gpt2",
        "tokenizer_path": str(GPT2),
        "dataset_dir": str(out),
        "clean": {"near_dedup": True},
        **over,
    }
    res = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        raise SystemExit(f"prepare failed: {res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def row(name: str, r: dict[str, Any]) -> str:
    mb = r["bytes_in"] / 1e6
    return (
        f"| {name} | {r['seconds']:.1f} | {mb / r['seconds']:.2f} | {r['cpu'] / mb:.3f} | "
        f"{r['rss_main_mb']:.0f} | {r['rss_task_mb']:.0f} | {r['removed']} |"
    )


HEAD = "| prepare | s | MB/s | CPU s/MB | peak RSS main MB | peak RSS task MB | removed |\n| --- | --- | --- | --- | --- | --- | --- |"


def throughput(corpus: Path, work: Path) -> None:
    print(f"\n## 1. Throughput, {corpus.stat().st_size / 1e6:.0f} MB\n\n{HEAD}")
    runs = [("one host, workers 2", {"workers": 2})]
    for tasks, workers in ((1, 1), (4, 1), (4, 2), (16, 2)):
        runs.append((f"tasks {tasks}, workers {workers}", {"tasks": tasks, "workers": workers}))
    for name, over in runs:
        print(row(name, run_one(corpus, work / "ds", **over)), flush=True)


def sizes(work: Path, mbs: list[int]) -> None:
    print(f"\n## 2. Memory against corpus size (one task per 25 MB, workers 2)\n\n{HEAD}")
    for mb in mbs:
        corpus = build_corpus(work / f"corpus-{mb}.jsonl", mb)
        tasks = max(1, mb // 25)
        print(
            row(f"{mb} MB, tasks {tasks}", run_one(corpus, work / "ds", tasks=tasks, workers=2)), flush=True
        )


def _peak(fn: Any) -> float:
    tracemalloc.start()
    tracemalloc.reset_peak()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def dedup_memory(corpus: Path, work: Path) -> None:
    """The stages one task at a time in this process; the dedup tasks' peaks per document."""
    import numpy as np

    from pretrain.config.tree import DataConfig
    from pretrain.data import tasks as T
    from pretrain.data.encode import Setup
    from pretrain.data.tokenizer import TiktokenTokenizer

    n_tasks = 8
    cfg = DataConfig.model_validate(
        {
            "corpus": str(corpus),
            "tokenizer": "gpt2",
            "tokenizer_path": str(GPT2),
            "dataset_dir": str(work / "dedup-ds"),
            "clean": {"near_dedup": True},
            "tasks": n_tasks,
        }
    )
    root = work / "dedup-work"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    tok = TiktokenTokenizer(str(GPT2))
    setup = Setup(cfg.clean, cfg.text_field, cfg.seed, cfg.val_fraction, tok, "uint16")
    T.plan(cfg, root, corpus.stat().st_size)
    job = T.make_job(cfg, root, setup)
    for t in range(n_tasks):
        T.Encode(job)(t, n_tasks)
    offsets = T.write_offsets(job)
    n = int(offsets[-1])
    for p in range(n_tasks):
        T.Exact(job)(p, n_tasks)
    T.gather_removed(job, "exact", n_tasks, "exact_removed")
    for j in range(n_tasks):
        T.Bands(job)(j, n_tasks)
    T.Clusters(job)(0, 1)
    T.gather_removed(job, "clusters", 1, "near_removed")
    found = [np.load(T._task_dir(root, "bands", j) / "members.npy") for j in range(n_tasks)]
    members, candidates = sum(len(m) for m in found), len(np.unique(np.concatenate(found)))
    # Each stage's first task again, measured (its directory removed first).
    figures = {}
    for stage, step, rank, world, docs in (
        ("exact (1 of 8 parts)", T.Exact(job), 0, n_tasks, n / n_tasks),
        (
            f"bands (one band's part, 1 of {len(job.hashranges) * job.parts})",
            T.Bands(job),
            0,
            -1,
            n / job.parts,
        ),
        ("clusters (all)", T.Clusters(job), 0, 1, candidates),
    ):
        if world == -1:  # one band part alone (a task runs its parts one after the other)
            figures[stage] = (_peak(lambda s=step: s.band_part(0)), docs)
        else:
            shutil.rmtree(T._task_dir(root, stage.split()[0], rank))
            figures[stage] = (_peak(lambda s=step, r=rank, w=world: s(r, w)), docs)
    print(
        f"\n## 3. Dedup memory, {n:,} documents, {n_tasks} runs, {len(job.hashranges)} bands x {job.parts} parts\n"
    )
    print(
        "| task | peak (tracemalloc) | documents it covers | bytes per document |\n| --- | --- | --- | --- |"
    )
    for stage, (peak, docs) in figures.items():
        print(f"| {stage} | {peak / 1e6:.1f} MB | {docs:,.0f} | {peak / max(docs, 1):.0f} |")
    # datasketch's MinHashLSH over the kept documents, filled in corpus order with the same signatures:
    # the in-memory index a one-host near dedup would hold, for comparison.
    from datasketch import LeanMinHash, MinHashLSH

    from pretrain.data.dedup import MINHASH_SEED

    lsh = MinHashLSH(threshold=cfg.clean.near_dedup_threshold, num_perm=cfg.clean.minhash_perms)
    use = [np.flatnonzero(np.asarray(job.docs(t, "has_shingles"))) for t in range(n_tasks)]
    sigs = np.concatenate([np.asarray(job.signatures(t))[u] for t, u in enumerate(use)])
    kept: list[int] = []

    def fill() -> None:
        for i in range(len(sigs)):
            m = LeanMinHash(seed=MINHASH_SEED, hashvalues=sigs[i], scheme="affine32")
            if not lsh.query(m):
                lsh.insert(i, m, check_duplication=False)
                kept.append(i)

    t0 = time.perf_counter()
    peak = _peak(fill)
    per = (time.perf_counter() - t0) / len(sigs)
    print(
        f"| datasketch's MinHashLSH over the kept documents, for comparison | {peak / 1e6:.1f} MB | "
        f"{len(kept):,} kept | {peak / max(len(kept), 1):.0f} (and {per * 1e6:.0f} us of one core per document) |"
    )
    # The clusters task at size: 2 million documents, in each band 60% of them in buckets of two.
    rng = np.random.default_rng(0)
    big, groups = 2_000_000, []
    for _ in job.hashranges:
        docs = rng.permutation(big)[: int(big * 0.6)]
        groups.append(np.sort(docs[: len(docs) // 2 * 2].reshape(-1, 2), axis=1).ravel())
    memberships = np.concatenate(groups).astype(np.int64)
    t0 = time.perf_counter()
    peak = _peak(lambda: T.near_removed(memberships, np.full(len(memberships) // 2, 2, dtype=np.int64)))
    seconds = time.perf_counter() - t0
    print(
        f"| clusters at size: {big:,} documents, {len(memberships):,} bucket memberships | {peak / 1e6:.0f} MB | "
        f"{big:,} | {peak / big:.0f} (and {seconds / big * 1e6:.1f} us of one core per document) |"
    )
    print(
        f"\n{candidates:,} documents ({candidates / n:.1%}) are in a bucket of two or more; "
        f"{members:,} bucket memberships in all; near duplicates removed: {len(job.removed('near_removed')):,}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--sizes", type=int, nargs="*", default=[100, 300, 1000])
    p.add_argument("--skip-sizes", action="store_true")
    p.add_argument("--only", choices=["throughput", "sizes", "dedup"])
    p.add_argument("--work", type=Path, default=Path("/tmp/pretrain-data-scale"))
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_prepare(json.loads(args.one))))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(args.work / f"corpus-{args.mb}.jsonl", args.mb)
    print(f"cores: {len(os.sched_getaffinity(0))}, corpus: {corpus} ({corpus.stat().st_size / 1e6:.0f} MB)")
    if args.only in (None, "throughput"):
        throughput(corpus, args.work)
    if args.only in (None, "sizes") and not args.skip_sizes:
        sizes(args.work, args.sizes)
    if args.only in (None, "dedup"):
        dedup_memory(corpus, args.work)


if __name__ == "__main__":
    main()
