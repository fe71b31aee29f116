"""The corpus BPE's trainer (Hugging Face `tokenizers`) against the previous pure-Python one.

    .venv/bin/python benchmarks/bpe_train.py [--mb 10 100] [--vocab 8000 32000] [--old-skip 100x32000 ...]
    .venv/bin/python benchmarks/bpe_train.py --encode

1. Training, for each text size and vocabulary: wall time, CPU time (all threads) and peak RSS of
   `train_bpe` (word counts in, tiktoken ranks out), of the previous pure-Python trainer kept below
   for comparison, and of `tokenizers` fed the text itself (`train_from_iterator` over it,
   GPT-2's pattern run in Rust) instead of the word counts; then each one's tokens per byte on
   held-out text, and the ratios.
   Each trainer runs in a process of its own, so its peak RSS is its own: the peak while training
   (the high-water mark reset after the word counts are read), next to what the process held
   before. Counting the words (`count_words`, one process; prepare spreads it over its workers) is
   timed once per size, apart.
2. With --encode: `encode_batch`'s hand-off, tiktoken's `encode_ordinary_batch(num_threads=1)`
   against a plain `encode_ordinary` loop over the same documents (GPT-2's ranks from
   tests/data/tokenizers), with documents of 128, 1K and 16K characters.

The text: the first 90% of tests/data/tinyshakespeare.txt, then copies of it in which one word in
ten (seeded per copy) takes a suffix (s, ed, ing, ly, er, est, eth, ness) and one in thirty has a
letter changed, so the vocabulary of words grows with the text as a real corpus's does (72,786
distinct words in 10 MB, 276,722 in 100 MB); built once under --work. Held out: the last 10%
of tinyshakespeare.txt, never in the training text.
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import os
import random
import re
import statistics
import string
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeAlias

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiktoken_ext.openai_public import r50k_pat_str  # noqa: E402

from pretrain.data.tokenizer import (  # noqa: E402
    BPETokenizer,
    TiktokenTokenizer,
    _byte_ranks,
    _bytes_to_unicode,
    _ranks_sha256,
    count_words,
    train_bpe,
)
from pretrain.errors import DataError  # noqa: E402

TINY = ROOT / "tests" / "data" / "tinyshakespeare.txt"
SUFFIXES = ["s", "ed", "ing", "ly", "er", "est", "eth", "ness"]


# ---------------------------------------------------------------------------------------------
# The previous implementation of `train_bpe` (pure Python), kept here only as the baseline.

_PairHeap: TypeAlias = list[tuple[int, bytes, bytes, int, int]]


def previous_train_bpe(word_counts: dict[bytes, int], vocab_size: int) -> dict[bytes, int]:
    """Byte-level BPE: repeatedly merge the most frequent adjacent pair of tokens in the words
    (ties broken by the pair's bytes, so the result is deterministic) until the ranks plus
    <|endoftext|> make vocab_size. Returns tiktoken mergeable ranks."""
    n_merges = vocab_size - 257
    if n_merges < 1:
        raise ValueError(
            f"vocab_size must be at least 258 (256 bytes, a merge, end-of-text), got {vocab_size}"
        )
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    words: list[list[int]] = [list(w) for w in word_counts]
    freqs: list[int] = list(word_counts.values())
    pair_count, where = _count_pairs(words, freqs)
    # Max-heap by (count, then the smallest bytes), with stale entries skipped when popped.
    heap = [(-c, vocab[a], vocab[b], a, b) for (a, b), c in pair_count.items()]
    heapq.heapify(heap)
    for _ in range(n_merges):
        best = _pop_best_pair(heap, pair_count)
        if best is None:
            raise DataError(
                f"the BPE training text is too small for a vocabulary of {vocab_size}: every word became "
                f"one token after {len(vocab) - 256} merges"
            )
        a, b = best
        new = len(vocab)
        vocab.append(vocab[a] + vocab[b])
        changed = _merge_everywhere(words, freqs, where, best, new)
        for pair, delta in changed.items():
            if delta:
                c = pair_count[pair] + delta
                pair_count[pair] = c
                if c > 0:
                    heapq.heappush(heap, (-c, vocab[pair[0]], vocab[pair[1]], pair[0], pair[1]))
        pair_count.pop((a, b), None)
    return {tok: rank for rank, tok in enumerate(vocab)}


def _count_pairs(
    words: list[list[int]], freqs: list[int]
) -> tuple[Counter[tuple[int, int]], dict[tuple[int, int], set[int]]]:
    pair_count: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for wi, (word, freq) in enumerate(zip(words, freqs, strict=True)):
        for pair in pairwise(word):
            pair_count[pair] += freq
            where.setdefault(pair, set()).add(wi)
    return pair_count, where


def _pop_best_pair(heap: _PairHeap, pair_count: Counter[tuple[int, int]]) -> tuple[int, int] | None:
    while heap:
        neg, _, _, a, b = heap[0]
        if pair_count.get((a, b), 0) == -neg and neg < 0:
            heapq.heappop(heap)
            return a, b
        heapq.heappop(heap)
    return None


def _merge_pair(word: list[int], a: int, b: int, new: int) -> list[int]:
    merged: list[int] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            merged.append(new)
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return merged


def _merge_everywhere(
    words: list[list[int]],
    freqs: list[int],
    where: dict[tuple[int, int], set[int]],
    pair: tuple[int, int],
    new: int,
) -> Counter[tuple[int, int]]:
    a, b = pair
    changed: Counter[tuple[int, int]] = Counter()
    for wi in where.pop(pair, set()):
        word, freq = words[wi], freqs[wi]
        merged = _merge_pair(word, a, b, new)
        for p in pairwise(word):
            changed[p] -= freq
        for p in pairwise(merged):
            changed[p] += freq
            where.setdefault(p, set()).add(wi)
        words[wi] = merged
    return changed


# ---------------------------------------------------------------------------------------------
# The text, the word counts, and the held-out text


def split_tiny() -> tuple[str, str]:
    text = TINY.read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    return text[:cut], text[cut:]


def build_text(work: Path, mb: int) -> Path:
    """mb MB of training text (see the module's docstring), built once."""
    path = work / f"train-{mb}mb.txt"
    if path.is_file():
        return path
    work.mkdir(parents=True, exist_ok=True)
    base, _ = split_tiny()
    tmp = path.with_suffix(".tmp")
    size, copy = 0, 0
    with open(tmp, "w", encoding="utf-8") as out:
        while size < mb * 1_000_000:
            vary = _Vary(random.Random(copy))
            text = (base if copy == 0 else re.sub(r"[A-Za-z]+", vary, base))[: mb * 1_000_000 - size]
            out.write(text)
            size += len(text.encode("utf-8"))
            copy += 1
    os.replace(tmp, path)
    return path


class _Vary:
    """A word, one time in ten with a suffix, one in thirty with a letter changed (a long tail of
    rare words, as names and misspellings make in a real corpus)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def __call__(self, m: re.Match[str]) -> str:
        word, r = m.group(), self.rng.random()
        if r < 0.1:
            return word + self.rng.choice(SUFFIXES)
        if r < 0.1 + 1 / 30:
            i = self.rng.randrange(len(word))
            return word[:i] + self.rng.choice(string.ascii_lowercase) + word[i + 1 :]
        return word


def write_counts(path: Path, counts: Counter[bytes]) -> None:
    with open(path, "wb") as f:
        for word, n in counts.items():
            f.write(base64.b64encode(word) + b" %d\n" % n)


def read_counts(path: Path) -> Counter[bytes]:
    counts: Counter[bytes] = Counter()
    with open(path, "rb") as f:
        for line in f:
            word, n = line.split()
            counts[base64.b64decode(word)] = int(n)
    return counts


def text_pieces(path: Path, chars: int = 1 << 20) -> Iterator[str]:
    """The file in pieces of about `chars` characters, cut after a newline."""
    rest = ""
    with open(path, encoding="utf-8") as f:
        while block := f.read(chars):
            block = rest + block
            cut = block.rfind("\n") + 1 or len(block)
            rest = block[cut:]
            yield block[:cut]
    if rest:
        yield rest


# ---------------------------------------------------------------------------------------------
# One measurement, in a process of its own


def _proc_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status: this benchmark needs Linux")


def train_from_text(path: Path, vocab_size: int) -> dict[bytes, int]:
    """`tokenizers` fed the text: GPT-2's pattern (tiktoken's) splits it, then bytes to GPT-2's alphabet."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    to_str = _bytes_to_unicode()
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r50k_pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, show_progress=False, initial_alphabet=list(to_str.values())
    )
    hf.train_from_iterator(text_pieces(path), trainer)
    return _byte_ranks(hf.get_vocab(), to_str)


def cell(trainer: str, text: Path, counts_file: Path, vocab_size: int) -> dict[str, Any]:
    counts = read_counts(counts_file) if trainer != "text" else None
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM: the peak from here on
    held = _proc_kb("VmRSS")
    t0, cpu0 = time.perf_counter(), time.process_time()
    if trainer == "text":
        ranks = train_from_text(text, vocab_size)
    else:
        assert counts is not None
        ranks = (previous_train_bpe if trainer == "old" else train_bpe)(counts, vocab_size)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    peak = _proc_kb("VmHWM")
    _, held_out = split_tiny()
    tok = BPETokenizer(ranks)
    ids = tok.encode(held_out)
    assert tok.decode(ids) == held_out
    return {
        "seconds": seconds,
        "cpu": cpu,
        "held_mb": held / 1024,
        "peak_mb": peak / 1024,
        "tokens_per_byte": len(ids) / len(held_out.encode("utf-8")),
        "sha": _ranks_sha256(ranks)[:12],
    }


# ---------------------------------------------------------------------------------------------
# The hand-off of encode_batch


def bench_encode(rounds: int = 5) -> None:
    enc = TiktokenTokenizer(ROOT / "tests" / "data" / "tokenizers" / "gpt2.tiktoken").enc
    text = TINY.read_text(encoding="utf-8")
    for size in (128, 1024, 16384):
        docs = [text[i : i + size] for i in range(0, len(text), size)] * (2 if size > 128 else 1)
        mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
        batch, loop = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            a = enc.encode_ordinary_batch(docs, num_threads=1)
            batch.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            b = [enc.encode_ordinary(d) for d in docs]
            loop.append(time.perf_counter() - t0)
            assert a == b
        tb, tl = statistics.median(batch), statistics.median(loop)
        print(
            f"documents of {size:>5} chars ({len(docs):>5}, {mb:.1f} MB): encode_ordinary_batch(num_threads=1) "
            f"{mb / tb:5.2f} MB/s, encode_ordinary loop {mb / tl:5.2f} MB/s: loop {tb / tl:.2f}x the speed"
        )


# ---------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--mb", type=int, nargs="+", default=[10, 100], help="Training text sizes in MB.")
    ap.add_argument("--vocab", type=int, nargs="+", default=[8000, 32000], help="Vocabulary sizes.")
    ap.add_argument(
        "--old-skip",
        nargs="*",
        default=[],
        help="MBxVOCAB cells the previous trainer skips, as 100x32000 (default: none, it ran in a minute here).",
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/pretrain-bpe-bench"), help="Text and counts dir.")
    ap.add_argument("--encode", action="store_true", help="Measure encode_batch's hand-off instead.")
    ap.add_argument("--cell", nargs=4, metavar=("TRAINER", "TEXT", "COUNTS", "VOCAB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        trainer, text, counts_file, vocab = args.cell
        print(json.dumps(cell(trainer, Path(text), Path(counts_file), int(vocab))))
        return
    if args.encode:
        bench_encode()
        return
    print(
        f"{'MB':>4} {'vocab':>6} {'trainer':<22} {'wall s':>7} {'CPU s':>7} {'held MB':>8} {'peak MB':>8} {'tokens/byte':>11}  ranks"
    )
    for mb in args.mb:
        text = build_text(args.work, mb)
        t0 = time.perf_counter()
        counts: Counter[bytes] = Counter()
        for piece in text_pieces(text):
            count_words(piece, counts)
        count_s = time.perf_counter() - t0
        counts_file = args.work / f"counts-{mb}mb.txt"
        write_counts(counts_file, counts)
        print(f"{mb:>4} MB: count_words {count_s:.1f} s, {len(counts):,} distinct words")
        for vocab in args.vocab:
            rows = {}
            for trainer in ("old", "tokenizers", "text"):
                if trainer == "old" and f"{mb}x{vocab}" in args.old_skip:
                    print(f"{mb:>4} {vocab:>6} {'previous (pure Python)':<22} skipped (--old-skip)")
                    continue
                cmd = [sys.executable, __file__, "--cell", trainer, str(text), str(counts_file), str(vocab)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                r = rows[trainer] = json.loads(out.strip().splitlines()[-1])
                name = {
                    "old": "previous (pure Python)",
                    "tokenizers": "train_bpe (tokenizers)",
                    "text": "tokenizers on the text",
                }
                print(
                    f"{mb:>4} {vocab:>6} {name[trainer]:<22} {r['seconds']:7.1f} {r['cpu']:7.1f} {r['held_mb']:8.0f} "
                    f"{r['peak_mb']:8.0f} {r['tokens_per_byte']:11.4f}  {r['sha']}"
                )
            new = rows["tokenizers"]
            if "old" in rows:
                old = rows["old"]
                print(
                    f"{'':>12}previous / train_bpe: wall {old['seconds'] / new['seconds']:.1f}x, CPU "
                    f"{old['cpu'] / new['cpu']:.1f}x, peak RSS "
                    f"{old['peak_mb'] / new['peak_mb']:.2f}x, tokens/byte train_bpe / previous "
                    f"{new['tokens_per_byte'] / old['tokens_per_byte']:.4f}"
                )
            print(
                f"{'':>12}fed the text / fed the counts: wall {rows['text']['seconds'] / new['seconds']:.2f}x, "
                f"peak RSS {rows['text']['peak_mb'] / new['peak_mb']:.2f}x "
                f"(plus count_words), same ranks: {rows['text']['sha'] == new['sha']}"
            )


if __name__ == "__main__":
    main()
