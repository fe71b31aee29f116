"""Dedup across the whole stream of documents, in corpus order (the first occurrence is kept).

The workers compute each document's exact hash and MinHash signature; the main process asks
these indexes, in document order, whether it has seen the document already. So the result
does not depend on the number of workers.

Memory is the one thing that grows with the corpus here:
- exact: an open-addressing table of 64-bit hashes at most half full, 8-16 bytes per kept
  document (a false duplicate needs a 64-bit collision: about n²/2⁶⁵, 3% at a billion documents);
- near: datasketch's MinHashLSH keeps every band of every kept document, about 1 KB per document
  with the default 128 permutations. It is off by default.
"""

from __future__ import annotations

import hashlib
import re
import zlib

import numpy as np

from pretrain.errors import require

NEAR_DEDUP = "near-duplicate removal (data.clean.near_dedup)"

MINHASH_SEED = 1


def exact_hash(data: bytes) -> int:
    """A document's 64-bit hash (blake2b), never 0 (the table's empty marker)."""
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return h or 1


class ExactDedup:
    """A set of nonzero 64-bit hashes: linear probing in one uint64 array, grown at half full."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self._table = np.zeros(max(16, 1 << (capacity - 1).bit_length()), dtype=np.uint64)
        self._mask = len(self._table) - 1
        self.size = 0

    def seen(self, h: int) -> bool:
        """Whether h was added before; adds it if not."""
        table, mask = self._table, self._mask
        i = h & mask
        while True:
            slot = int(table[i])
            if slot == 0:
                break
            if slot == h:
                return True
            i = (i + 1) & mask
        table[i] = h
        self.size += 1
        if 2 * self.size > len(table):
            self._grow()
        return False

    def _grow(self) -> None:
        old = self._table[self._table != 0]
        self._table = np.zeros(2 * len(self._table), dtype=np.uint64)
        self._mask = len(self._table) - 1
        self.size = 0
        for h in old.tolist():
            self.seen(h)

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)


class MinHasher:
    """A document's MinHash signature from its shingle hashes (datasketch, 'affine32' scheme)."""

    def __init__(self, num_perm: int) -> None:
        # datasketch, with scipy: only when near dedup is on (the near-dedup extra)
        MinHash = require("datasketch", NEAR_DEDUP, "near-dedup").MinHash

        # hashfunc=int: the shingles come already hashed to 32 bits (corpus.shingle_hashes).
        self._m = MinHash(num_perm=num_perm, seed=MINHASH_SEED, hashfunc=int)

    def __call__(self, shingles: np.ndarray) -> np.ndarray:
        self._m.clear()
        self._m.update_batch(shingles.tolist())
        return np.asarray(self._m.hashvalues, dtype=np.uint32).copy()


class NearDedup:
    """MinHash LSH over the kept documents: a document whose signature shares a band with an
    earlier kept one (estimated Jaccard similarity about `threshold` or more) is a near duplicate."""

    def __init__(self, threshold: float, num_perm: int) -> None:
        datasketch = require("datasketch", NEAR_DEDUP, "near-dedup")
        self._lean = datasketch.LeanMinHash
        self._lsh = datasketch.MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.size = 0

    def seen(self, key: int, signature: np.ndarray) -> bool:
        """Whether a near duplicate was kept before; indexes this document if not."""
        m = self._lean(seed=MINHASH_SEED, hashvalues=signature, scheme="affine32")
        if self._lsh.query(m):
            return True
        self._lsh.insert(key, m, check_duplication=False)
        self.size += 1
        return False


# ---------------------------------------------------------------------------------------------
# Near-duplicate signatures (computed in the workers, from each document's shingles)

_WORDS = re.compile(r"\w+")


def shingle_hashes(text: str, n: int) -> np.ndarray:
    """32-bit hashes of the document's n-word shingles (lowercased \\w+ words), stable across
    processes and machines (crc32 per word, combined polynomially)."""
    words = _WORDS.findall(text.lower())
    if not words:
        return np.empty(0, dtype=np.uint32)
    wh = np.fromiter((zlib.crc32(w.encode()) for w in words), dtype=np.uint64, count=len(words))
    n = min(n, len(wh))
    h = np.zeros(len(wh) - n + 1, dtype=np.uint64)
    for k in range(n):
        h = h * np.uint64(1_000_003) + wh[k : k + len(h)]  # wraps mod 2**64, as intended
    return (h ^ (h >> np.uint64(32))).astype(np.uint32)
