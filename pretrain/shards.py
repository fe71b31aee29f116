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

Shards are written atomically (temp file, fsync, rename), so a shard that exists is whole;
a reader still checks the size and, unless told not to, the checksum.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrain.corpus import DataError

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
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload.data.cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return ShardInfo(path, _DTYPES[code], int(payload.size), n_docs, digest.hex())


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


def open_shard(path: str | Path, verify: bool = True) -> np.memmap:
    """Memory-map a shard's tokens read-only, after checking its header, size and (if verify)
    the payload's sha256."""
    info = read_header(path)
    if info.n_tokens == 0:
        raise DataError(f"{info.path}: shard holds no tokens")
    if verify:
        h = hashlib.sha256()
        with open(info.path, "rb") as f:
            f.seek(HEADER_SIZE)
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if h.hexdigest() != info.sha256:
            raise DataError(
                f"{info.path}: checksum mismatch: payload sha256 is {h.hexdigest()}, header says {info.sha256}"
            )
    return np.memmap(info.path, dtype=info.dtype, mode="r", offset=HEADER_SIZE, shape=(info.n_tokens,))
