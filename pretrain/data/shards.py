"""Token shards: a flat array of token ids behind a 64-byte header, verified on read.

Layout (little-endian):

    offset  size  field
         0     8  magic b"PRTSHARD"
         8     4  version (u32, = 1)
        12     4  dtype code (u32): 2 = uint16, 4 = uint32 (the item size)
        16     8  token count (u64)
        24     8  document count (u64)
        32    32  sha256 of the payload
        64     …  payload: token count × item size bytes

Shards are written atomically (temp file, header last, fsync, rename), so a shard that exists
is whole; a reader still checks the size and, unless told not to, the checksum. `ShardWriter`
streams a split into numbered shards of a set size.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrain.errors import DataError
from pretrain.files import AtomicFile

MAGIC = b"PRTSHARD"
VERSION = 1
HEADER_SIZE = 64
_HEADER = struct.Struct("<8sIIQQ32s")  # 64 bytes; any remainder of HEADER_SIZE would be zeros
_DTYPES: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
_CHUNK = 16 << 20  # bytes hashed at a time when verifying


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    dtype: np.dtype
    n_tokens: int
    n_docs: int
    sha256: str  # hex digest of the payload


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest shard dtype that holds every token id of the vocabulary."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def write_shard(path: str | Path, tokens: np.ndarray, n_docs: int) -> ShardInfo:
    """Write a 1-D uint16/uint32 token array as a shard, atomically."""
    path = Path(path)
    if tokens.ndim != 1 or tokens.dtype.kind != "u" or tokens.dtype.itemsize not in _DTYPES:
        raise ValueError(
            f"tokens must be a 1-D uint16 or uint32 array, got {tokens.dtype} of shape {tokens.shape}"
        )
    if tokens.size == 0:
        raise DataError(f"{path}: refusing to write an empty shard (no tokens)")
    code = tokens.dtype.itemsize
    payload = np.ascontiguousarray(tokens, dtype=_DTYPES[code])
    digest = hashlib.sha256(payload.data.cast("B")).digest()
    header = _HEADER.pack(MAGIC, VERSION, code, payload.size, n_docs, digest).ljust(HEADER_SIZE, b"\0")
    with AtomicFile(path) as f:
        f.write(header)
        f.write(payload.data.cast("B"))
    return ShardInfo(path, _DTYPES[code], int(payload.size), n_docs, digest.hex())


class _OpenShard:
    """A shard being written: under a temporary name, header zeroed until it is finished."""

    def __init__(self, path: Path, code: int) -> None:
        self.path = path
        self.file = AtomicFile(path)
        self.f = self.file.f
        self.code = code
        self.f.write(b"\0" * HEADER_SIZE)
        self.sha = hashlib.sha256()
        self.n_tokens = 0
        self.n_docs = 0

    def write(self, payload: np.ndarray, n_docs: int) -> None:
        data = payload.data.cast("B")
        self.f.write(data)
        self.sha.update(data)
        self.n_tokens += payload.size
        self.n_docs += n_docs

    def finish(self) -> ShardInfo:
        """Header, fsync, rename: only now does a file of the shard's name exist."""
        digest = self.sha.digest()
        self.f.seek(0)
        self.f.write(_HEADER.pack(MAGIC, VERSION, self.code, self.n_tokens, self.n_docs, digest))
        self.file.commit()
        return ShardInfo(self.path, _DTYPES[self.code], self.n_tokens, self.n_docs, digest.hex())

    def payload(self) -> np.ndarray:
        self.f.flush()
        return np.fromfile(self.file.tmp, dtype=_DTYPES[self.code], offset=HEADER_SIZE)

    def discard(self) -> None:
        self.file.discard()


class ShardWriter:
    """One split's token stream, written as `{prefix}_00000.bin`, `{prefix}_00001.bin`, ... of
    `shard_tokens` tokens each, in constant memory.

    The last shard would often be a sliver too short for a block of context, so a full shard
    stays open until the next one is full too: at `close` a rest under half a shard is appended to
    it (shards hold half to 1.5 times shard_tokens, unless the split is smaller). A document's
    count goes to the shard where it ends; documents may span shards. A shard appears under its
    final name only once it is complete; `abort` removes all of them."""

    def __init__(self, directory: str | Path, prefix: str, dtype: np.dtype, *, shard_tokens: int) -> None:
        if np.dtype(dtype).itemsize not in _DTYPES:
            raise ValueError(f"dtype must be uint16 or uint32, got {dtype}")
        self.directory = Path(directory)
        self.prefix = prefix
        self.code = np.dtype(dtype).itemsize
        self.shard_tokens = shard_tokens
        self.shards: list[ShardInfo] = []
        self.n_tokens = 0
        self.n_docs = 0
        self._previous: _OpenShard | None = None
        self._current: _OpenShard | None = None
        self._index = 0

    def _open(self) -> _OpenShard:
        shard = _OpenShard(self.directory / f"{self.prefix}_{self._index:05d}.bin", self.code)
        self._index += 1
        return shard

    def write(self, tokens: np.ndarray, doc_lengths: np.ndarray | list[int]) -> None:
        """Append documents: their tokens concatenated, and each one's token count."""
        payload = np.ascontiguousarray(tokens, dtype=_DTYPES[self.code])
        ends = np.cumsum(doc_lengths)
        if len(ends) and ends[-1] != payload.size:
            raise ValueError(f"doc_lengths sum to {ends[-1]}, tokens hold {payload.size}")
        done = 0
        while done < payload.size:
            if self._current is None or self._current.n_tokens >= self.shard_tokens:
                if self._previous is not None:
                    self.shards.append(self._previous.finish())
                self._previous, self._current = self._current, self._open()
            take = min(self.shard_tokens - self._current.n_tokens, payload.size - done)
            n_docs = int(
                np.searchsorted(ends, done + take, side="right") - np.searchsorted(ends, done, side="right")
            )
            self._current.write(payload[done : done + take], n_docs)
            done += take
        self.n_tokens += payload.size
        self.n_docs += len(ends)

    def close(self) -> list[ShardInfo]:
        cur, prev = self._current, self._previous
        if cur is not None and prev is not None and cur.n_tokens < self.shard_tokens // 2:
            prev.write(cur.payload(), cur.n_docs)
            cur.discard()
            cur = None
        for shard in (prev, cur):
            if shard is not None:
                self.shards.append(shard.finish())
        self._current = self._previous = None
        return self.shards

    def abort(self) -> None:
        """Remove everything this writer wrote, finished shards included."""
        for shard in (self._previous, self._current):
            if shard is not None:
                shard.discard()
        for info in self.shards:
            info.path.unlink(missing_ok=True)
        self._current = self._previous = None
        self.shards = []


def read_header(path: str | Path) -> ShardInfo:
    """Parse and check a shard's header against the file's size (the payload is not read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError as e:
        raise DataError(f"{path}: shard not found") from e
    except OSError as e:
        raise DataError(f"{path}: cannot read shard: {e.strerror or e}") from e
    if raw[: len(MAGIC)] != MAGIC:
        raise DataError(f"{path}: not a token shard (magic {raw[: len(MAGIC)]!r}, expected {MAGIC!r})")
    if len(raw) < HEADER_SIZE:
        raise DataError(f"{path}: truncated: {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
    _, version, code, n_tokens, n_docs, digest = _HEADER.unpack_from(raw)
    if version != VERSION:
        raise DataError(f"{path}: shard format version {version}, this code reads version {VERSION}")
    if code not in _DTYPES:
        raise DataError(f"{path}: unknown dtype code {code} (expected 2 = uint16 or 4 = uint32)")
    held = (size - HEADER_SIZE) // code
    if size < HEADER_SIZE + n_tokens * code:
        raise DataError(f"{path}: truncated: header says {n_tokens} tokens, file holds {held}")
    if size > HEADER_SIZE + n_tokens * code:
        raise DataError(f"{path}: trailing bytes: header says {n_tokens} tokens, file holds {held}")
    return ShardInfo(path, _DTYPES[code], n_tokens, n_docs, digest.hex())


def payload_sha256(path: Path) -> str:
    """The hex sha256 of a shard file's payload (all after the header), read a chunk at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(HEADER_SIZE)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def open_shard(path: str | Path, verify: bool = True) -> np.memmap:
    """Memory-map a shard's tokens read-only, after checking its header, size and (if verify)
    the payload's sha256."""
    info = read_header(path)
    if info.n_tokens == 0:
        raise DataError(f"{info.path}: shard holds no tokens")
    if verify:
        digest = payload_sha256(info.path)
        if digest != info.sha256:
            raise DataError(
                f"{info.path}: checksum mismatch: payload sha256 is {digest}, header says {info.sha256}"
            )
    return np.memmap(info.path, dtype=info.dtype, mode="r", offset=HEADER_SIZE, shape=(info.n_tokens,))
