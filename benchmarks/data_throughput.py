"""Data path throughput, each side by side with its bare baseline, in one process.

    .venv/bin/python benchmarks/data_throughput.py [--mb 64] [--workers 2]
    .venv/bin/python benchmarks/data_throughput.py --formats [--mb 64] [--workers 2]

1. prepare (read JSON Lines, clean, exact dedup, tokenize with GPT-2 in worker processes, shard)
   in MB/s of document text, against tiktoken's raw `encode_ordinary_batch` over the same
   documents, already in memory, with as many threads as prepare has workers. Goal: >= 0.8x.
2. ShardedLoader samples/s (the order, shard lookup, int64 x/y), against a bare np.memmap
   slicing loop over the same shards making the same copies, with a permutation drawn beforehand
   (and, for reference, nanoGPT's get_batch). Goal: >= 0.9x. Then the loader with prefetching next to a simulated step: the share of the
   step spent waiting for data.
3. With --formats, instead: prepare of the same documents from JSON Lines, parquet (row groups of
   1,024 rows; and one row group, pyarrow's default for under a million rows), .jsonl.zst and
   .jsonl.gz, alternately, in MB/s of document text. Goal: parquet >= 0.8x JSON Lines.

The corpus (>= 50 MB) is built once under --work from texts installed on this machine: the
`shakespeare` package, and the .md/.rst/.txt/.py files of Python's own library and /usr/share/doc,
cut into documents of about 16 KB. Nothing is downloaded. GPT-2's ranks come from
tests/data/tokenizers (or --tokenizer-path; without either, tiktoken downloads them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

# prepare's worker processes import this file again (multiprocessing runs the parent's main module
# in each child), so torch, which the loader needs, is imported only where it is used.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pretrain.config.tree import DataConfig  # noqa: E402
from pretrain.data.dataset import load_manifest  # noqa: E402
from pretrain.data.prepare import prepare  # noqa: E402
from pretrain.data.shards import HEADER_SIZE, read_header  # noqa: E402
from pretrain.data.sources import shakespeare_files  # noqa: E402
from pretrain.data.tokenizer import TiktokenTokenizer  # noqa: E402
from pretrain.errors import DataError  # noqa: E402

DOC_BYTES = 16 << 10


def source_files() -> list[Path]:
    """Installed texts, prose first: Shakespeare, docs, then Python sources."""
    files: list[Path] = []
    with contextlib.suppress(DataError):  # the shakespeare package is optional here
        files += shakespeare_files()
    roots = [Path("/usr/share/doc"), Path(sysconfig.get_paths()["stdlib"])]
    for suffixes in ((".md", ".rst", ".txt"), (".py",)):
        for root in roots:
            files += sorted(
                p for p in root.rglob("*") if p.suffix in suffixes and p.is_file() and not p.is_symlink()
            )
    return files


def build_corpus(path: Path, megabytes: int) -> Path:
    """JSON Lines of ~16 KB documents from installed texts, each text used once."""
    if path.is_file() and path.stat().st_size >= megabytes * 1e6:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    total = 0
    seen: set[int] = set()
    with open(tmp, "w", encoding="utf-8") as out:
        for f in source_files():
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if hash(text) in seen or not text.strip():
                continue
            seen.add(hash(text))
            start = 0
            while start < len(text):
                end = text.find("\n", start + DOC_BYTES)
                end = len(text) if end < 0 else end + 1
                out.write(json.dumps({"text": text[start:end]}) + "\n")
                total += len(text[start:end].encode())
                start = end
            if total >= megabytes * 1e6:
                break
    if total < megabytes * 1e6:
        raise SystemExit(f"only {total / 1e6:.1f} MB of installed texts found; pass --mb {int(total / 1e6)}")
    os.replace(tmp, path)
    return path


def read_docs(path: Path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def bench_prepare(
    corpus: Path, work: Path, workers: int, tokenizer_path: str | None, rounds: int
) -> tuple[list[float], list[float], Path]:
    """MB/s of raw tiktoken and of prepare, measured alternately `rounds` times: on a shared
    machine the load changes from one moment to the next, and each ratio compares neighbours."""
    docs = read_docs(corpus)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    tok = TiktokenTokenizer(tokenizer_path)
    cfg = DataConfig(
        corpus=str(corpus),
        tokenizer="gpt2",
        tokenizer_path=tokenizer_path,
        dataset_dir=str(work / "dataset"),
        workers=workers,
    )
    print(f"corpus {corpus}: {mb:.1f} MB of document text in {len(docs):,} documents")
    raws, ours, cpu_ratios = [], [], []
    for r in range(rounds):
        t, cpu = time.perf_counter(), time.process_time()
        tok.enc.encode_ordinary_batch(docs, num_threads=workers)
        raws.append(mb / (time.perf_counter() - t))
        raw_cpu = time.process_time() - cpu
        t = time.perf_counter()
        out = prepare(cfg, force=True)
        ours.append(mb / (time.perf_counter() - t))
        used = load_manifest(out)["report"]["cpu_seconds"]
        cpu_ratios.append(raw_cpu / (used["tasks"] + used["main"]))
        print(
            f"  round {r + 1}: raw encode_ordinary_batch ({workers} threads) {raws[-1]:6.2f} MB/s, "
            f"pretrain data prepare ({workers} workers) {ours[-1]:6.2f} MB/s: {ours[-1] / raws[-1]:.2f}x; "
            f"CPU s/MB {raw_cpu / mb:.3f} raw, {(used['tasks'] + used['main']) / mb:.3f} prepare "
            f"({used['main'] / mb:.3f} of it in the main process)"
        )
    cpu_ratios.sort()
    print(
        f"  CPU time per MB, raw / prepare: {cpu_ratios[len(cpu_ratios) // 2]:.2f}x median "
        "(the load of other processes changes MB/s, much less the CPU time each one costs)"
    )
    return raws, ours, out


def bench_formats(corpus: Path, work: Path, workers: int, tokenizer_path: str | None, rounds: int) -> None:
    """prepare's MB/s on the same documents in each input format, measured alternately."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = read_docs(corpus)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    d = work / "formats"
    d.mkdir(parents=True, exist_ok=True)
    raw = corpus.read_bytes()
    inputs = {"jsonl": corpus}
    table = pa.table({"text": docs})
    for name, rows in (("parquet", 1024), ("parquet-1-group", 1 << 20)):
        inputs[name] = d / f"{name}.parquet"
        if not inputs[name].is_file():
            pq.write_table(table, inputs[name], row_group_size=rows)
    inputs["jsonl.zst"] = d / "corpus.jsonl.zst"
    inputs["jsonl.gz"] = d / "corpus.jsonl.gz"
    if not inputs["jsonl.zst"].is_file():
        inputs["jsonl.zst"].write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))
    if not inputs["jsonl.gz"].is_file():
        inputs["jsonl.gz"].write_bytes(gzip.compress(raw, compresslevel=6))
    print(f"formats: {mb:.1f} MB of document text in {len(docs):,} documents, {workers} workers, gpt2")
    for name, path in inputs.items():
        print(f"  {name:16s} {path.stat().st_size / 1e6:8.1f} MB on disk")
    rates: dict[str, list[float]] = {k: [] for k in inputs}
    cpu: dict[str, list[float]] = {k: [] for k in inputs}  # CPU s per MB: the load of others changes it less
    for r in range(rounds):
        for name, path in inputs.items():
            cfg = DataConfig(
                corpus=str(path),
                tokenizer="gpt2",
                tokenizer_path=tokenizer_path,
                dataset_dir=str(d / f"out-{name}"),
                workers=workers,
            )
            t = time.perf_counter()
            out = prepare(cfg, force=True)
            rates[name].append(mb / (time.perf_counter() - t))
            report = load_manifest(out)["report"]
            assert report["documents_out"] > 0
            cpu[name].append((report["cpu_seconds"]["tasks"] + report["cpu_seconds"]["main"]) / mb)
        print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} MB/s" for k, v in rates.items()))
    for name in inputs:
        if name == "jsonl":
            continue
        ratios = sorted(a / b for a, b in zip(rates[name], rates["jsonl"], strict=True))
        goal = " (goal >= 0.8)" if name.startswith("parquet") else ""
        cpu_ratio = sorted(b / a for a, b in zip(cpu[name], cpu["jsonl"], strict=True))[len(ratios) // 2]
        print(
            f"{name} / jsonl: {ratios[len(ratios) // 2]:.2f}x median of {len(ratios)} rounds "
            f"({', '.join(f'{x:.2f}' for x in ratios)}){goal}; by CPU time per MB: {cpu_ratio:.2f}x"
        )


def train_shards(dataset: Path) -> list[Path]:
    return [dataset / e["path"] for e in load_manifest(dataset)["train"]]


def one_rank_loader(paths: list[Path], block: int, micro: int, prefetch: int = 0) -> Any:
    """The loader as one rank of one trains from it, shards read unverified (the benchmark times reads)."""
    from pretrain.data.loader import ShardedLoader  # torch

    return ShardedLoader(
        paths, block_size=block, micro_batch_size=micro, grad_accum=1, rank=0, world_size=1, seed=0,
        verify=False, prefetch=prefetch,
    )  # fmt: skip


def bench_loader(dataset: Path, block: int, micro: int, batches: int) -> tuple[float, float]:
    import torch

    paths = train_shards(dataset)
    loader = one_rank_loader(paths, block, micro)
    # The bare loops: every window of the shards, in a random order drawn beforehand.
    mms = [
        np.memmap(
            p, dtype=read_header(p).dtype, mode="r", offset=HEADER_SIZE, shape=(read_header(p).n_tokens,)
        )
        for p in paths
    ]
    windows = [(mm, i * block) for mm in mms for i in range((len(mm) - 1) // block)]
    order = np.random.default_rng(0).permutation(len(windows))
    buf = np.empty((micro, block + 1), dtype=mms[0].dtype)

    def bare(n: int) -> None:
        """Slice each window into one buffer, then int64 x and y: the loader's copies, nothing else."""
        for b in range(n):
            for row, j in enumerate(order[(b * micro) % len(order) :][:micro].tolist()):
                mm, i = windows[j]
                buf[row] = mm[i : i + block + 1]
            x = torch.from_numpy(buf[:, :-1].astype(np.int64))
            y = torch.from_numpy(buf[:, 1:].astype(np.int64))
            assert x.shape == y.shape

    def nanogpt(n: int) -> None:
        """nanoGPT's get_batch: a tensor per window, stacked."""
        for b in range(n):
            picks = [windows[j] for j in order[(b * micro) % len(order) :][:micro]]
            x = torch.stack([torch.from_numpy(mm[i : i + block].astype(np.int64)) for mm, i in picks])
            y = torch.stack([torch.from_numpy(mm[i + 1 : i + 1 + block].astype(np.int64)) for mm, i in picks])
            assert x.shape == y.shape

    def ours(n: int) -> None:
        for _ in range(n):
            loader.next_batch()

    for fn in (bare, nanogpt, ours):
        fn(20)  # warm the page cache and the loader's permutation blocks
    rates: dict[str, float] = {}
    for _ in range(3):  # alternate, keep each one's best: the machine's load varies
        for name, fn in (("bare", bare), ("nanogpt", nanogpt), ("loader", ours)):
            t = time.perf_counter()
            fn(batches)
            rates[name] = max(rates.get(name, 0.0), batches * micro / (time.perf_counter() - t))
    print(
        f"loader, block {block}, micro batch {micro} ({loader.n_samples:,} samples in {len(paths)} shards):"
    )
    print(f"  bare np.memmap slicing loop: {rates['bare']:10,.0f} samples/s")
    print(f"  nanoGPT-style get_batch:     {rates['nanogpt']:10,.0f} samples/s")
    print(f"  ShardedLoader:               {rates['loader']:10,.0f} samples/s")
    return rates["bare"], rates["loader"]


def bench_prefetch(dataset: Path, block: int, micro: int, step_ms: float, steps: int) -> float:
    """The share of a simulated step spent waiting in next_batch, with prefetching."""
    import torch

    loader = one_rank_loader(train_shards(dataset), block, micro, prefetch=2)
    # The step's compute on one thread, as each rank is set up on a CPU (OMP_NUM_THREADS=1); on a GPU
    # the host thread mostly waits on the device. The prefetching thread uses what is left.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    n_mm = 1
    t = time.perf_counter()
    while time.perf_counter() - t < 0.05:
        a @ a
        n_mm += 1
    per_ms = n_mm / 50.0
    waits = []
    loader.next_batch()
    t0 = time.perf_counter()
    for _ in range(steps):
        for _ in range(max(1, int(per_ms * step_ms))):
            a @ a  # the step: compute that releases the GIL, as a real forward/backward does
        t = time.perf_counter()
        loader.next_batch()
        waits.append(time.perf_counter() - t)
    total = time.perf_counter() - t0
    loader.close()
    torch.set_num_threads(threads)
    share = sum(waits) / total
    print(
        f"  with prefetch=2 next to a {1e3 * total / steps:.0f} ms step: {1e3 * sum(waits) / steps:.3f} ms waiting "
        f"per step (median {1e3 * float(np.median(waits)):.3f} ms), {100 * share:.2f}% of step time"
    )
    return share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--mb", type=int, default=64, help="Corpus size in MB (default 64).")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare workers = raw threads.")
    ap.add_argument(
        "--work", type=Path, default=Path("/tmp/pretrain-data-bench"), help="Corpus and output dir."
    )
    ap.add_argument("--tokenizer-path", default=None, help="GPT-2 ranks (default tests/data/tokenizers).")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3, help="Alternating raw/prepare measurements.")
    ap.add_argument("--formats", action="store_true", help="Compare prepare across input formats instead.")
    args = ap.parse_args()
    tokenizer_path = args.tokenizer_path
    shared = ROOT / "tests" / "data" / "tokenizers" / "gpt2.tiktoken"
    if tokenizer_path is None and shared.is_file():
        tokenizer_path = str(shared)
    corpus = build_corpus(args.work / f"corpus-{args.mb}mb.jsonl", args.mb)
    if args.formats:
        bench_formats(corpus, args.work, args.workers, tokenizer_path, args.rounds)
        return
    shutil.rmtree(args.work / "dataset", ignore_errors=True)
    raws, ours, dataset = bench_prepare(corpus, args.work, args.workers, tokenizer_path, args.rounds)
    bare, loader = bench_loader(dataset, args.block, args.micro, args.batches)
    share = bench_prefetch(dataset, args.block, args.micro, step_ms=50.0, steps=40)
    ratios = sorted(o / r for o, r in zip(ours, raws, strict=True))
    print(
        f"prepare / raw tiktoken: {ratios[len(ratios) // 2]:.2f}x median of {len(ratios)} rounds "
        f"({', '.join(f'{x:.2f}' for x in ratios)}) (goal >= 0.8)"
    )
    print(f"loader / bare memmap:   {loader / bare:.2f}x (goal >= 0.9)")
    print(f"loader wait with prefetch: {100 * share:.2f}% of step time (goal < 1%)")


if __name__ == "__main__":
    main()
