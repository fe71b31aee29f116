"""What dedup compares: each document's exact hash and its MinHash signature, computed in the
encode step (encode.py) from its cleaned text and its shingles.

The stages of tasks.py compare them across the whole corpus, in corpus order (the first occurrence
is kept): exact dedup by sorting the hashes, near dedup by MinHash LSH's bands, as datasketch's
MinHashLSH cuts them, one band at a time. A false exact duplicate needs a 64-bit collision: about
n²/2⁶⁵, 3% at a billion documents.
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
    """A document's 64-bit hash (blake2b), never 0 (a hash of 0 marks exact dedup off)."""
    h = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return h or 1


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
