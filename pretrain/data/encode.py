"""A prepare worker's job: one task (a list of chunks) in, its documents' tokens and hashes out.

Each document of a task is read and cleaned (chunks.py, clean.py), put in a split (the dataset's
own, else by `is_val_document`), hashed for exact dedup, MinHashed for near dedup, and tokenized;
the vocabulary passes before that count its characters (char) or words (BPE). These run in the
worker processes of workers.py once `init_worker` has set them up, or in the main process.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pretrain.config.tree import CleanConfig
from pretrain.data.chunks import Chunk, Document, read_chunk
from pretrain.data.clean import Cleaner, CleanStats
from pretrain.data.dedup import MinHasher, exact_hash, shingle_hashes
from pretrain.data.tokenizer import Tokenizer, count_words


def is_val_document(name: str, seed: int, val_fraction: float) -> bool:
    """A document's split: sha256 of (seed, name) read as a uniform number in [0, 1)."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


@dataclass
class Setup:
    clean: CleanConfig
    text_field: str
    seed: int
    val_fraction: float
    tokenizer: Tokenizer | None = None  # None in the vocabulary passes
    dtype: str = "uint16"


@dataclass
class Encoded:
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


def init_worker(setup: Setup) -> None:
    _worker.clear()
    _worker["setup"] = setup
    _worker["cleaner"] = Cleaner(setup.clean)
    if setup.clean.near_dedup and setup.tokenizer is not None:
        _worker["minhash"] = MinHasher(setup.clean.minhash_perms)


def _documents(task: list[Chunk], stats: CleanStats) -> Iterator[tuple[Chunk, Document]]:
    setup: Setup = _worker["setup"]
    for chunk in task:
        for doc in read_chunk(chunk, setup.text_field, _worker["cleaner"], stats):
            yield chunk, doc


def chars_task(task: list[Chunk]) -> tuple[set[str], CleanStats]:
    stats = CleanStats()
    chars: set[str] = set()
    for _, doc in _documents(task, stats):
        chars.update(doc.text)
    return chars, stats


def words_task(
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


def encode_task(task: list[Chunk]) -> Encoded:
    cpu0 = time.process_time()
    setup: Setup = _worker["setup"]
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
    signatures, has_shingles = (
        _signatures(docs, setup.clean) if "minhash" in _worker else (None, np.zeros(n, dtype=bool))
    )
    tokens, lengths = _tokens(docs, tok, np.dtype(setup.dtype))
    return Encoded(
        names=[d.name for d in docs],
        is_val=np.array(is_val, dtype=bool),
        hashes=hashes,
        sizes=np.array([len(b) for b in data], dtype=np.int64),
        lengths=lengths,
        tokens=tokens,
        signatures=signatures,
        has_shingles=has_shingles,
        stats=stats,
        cpu_s=time.process_time() - cpu0,
    )


def _signatures(docs: list[Document], clean: CleanConfig) -> tuple[np.ndarray, np.ndarray]:
    """Each document's MinHash signature (n, perms), and whether it has one: one without words has
    no shingles, and is not near-deduped."""
    signatures = np.zeros((len(docs), clean.minhash_perms), dtype=np.uint32)
    has_shingles = np.zeros(len(docs), dtype=bool)
    for i, d in enumerate(docs):
        shingles = shingle_hashes(d.text, clean.shingle_words)
        if shingles.size:
            signatures[i] = _worker["minhash"](shingles)
            has_shingles[i] = True
    return signatures, has_shingles


def _tokens(docs: list[Document], tok: Tokenizer, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The documents' tokens, concatenated, each followed by end-of-text where it ends its input
    file; and each one's count of them."""
    eot = None if tok.eot_token is None else np.array([tok.eot_token], dtype=dtype)
    parts: list[np.ndarray] = []
    lengths = np.zeros(len(docs), dtype=np.int64)
    for i, (doc, ids) in enumerate(zip(docs, tok.encode_batch([d.text for d in docs], dtype), strict=True)):
        parts.append(ids)
        lengths[i] = ids.size
        if eot is not None and doc.last:
            parts.append(eot)
            lengths[i] += 1
    return (np.concatenate(parts) if parts else np.empty(0, dtype=dtype)), lengths
