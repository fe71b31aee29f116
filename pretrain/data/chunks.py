"""Chunks: the pieces of the input files that worker processes read on their own, and reading
one into documents.

Nothing here holds the corpus in memory. Files are cut into chunks (`read_chunk` reads one):
pieces of about `chunk_bytes` of a JSON Lines file cut at line breaks, runs of small files,
parquet row groups, row ranges of a dataset's Arrow files; a text file larger than
`text_split_bytes` becomes one document per piece of that size. A compressed file cannot be
entered in the middle: the main process decompresses it as a stream and hands out its pieces'
bytes (a streamed dataset's rows likewise). Bytes are decoded as UTF-8 by a `Utf8Decoder`, which
counts what is not; each document then goes through the `Cleaner` (`clean.py`).
"""

from __future__ import annotations

import gzip
import itertools
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from pretrain.data.clean import Cleaner, CleanStats, utf8_bytes
from pretrain.data.sources import (
    HF_PREFIX,
    InputFile,
    arrow_table,
    hf_datasets,
    hf_stream_spec,
    sniff_binary,
    sniff_bytes,
)
from pretrain.errors import DataError, require

_BOM = b"\xef\xbb\xbf"


# ---------------------------------------------------------------------------------------------
# Cutting files into chunks


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
    split: str = ""  # its file's (InputFile.split): "val", "train", or "" (split by name)


_SCAN = 1 << 16


def _cut_after_newline(f: BinaryIO, target: int, size: int, *, must_find: bool, window: int) -> int:
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
    file: InputFile, *, chunk_bytes: int, text_split_bytes: int, text_field: str = "text"
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
                        f,
                        target,
                        file.size,
                        must_find=file.format == "jsonl",
                        window=min(piece_bytes, 1 << 20),
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
                cut = (
                    None
                    if len(buf) <= piece_bytes
                    else _cut_in(buf, piece_bytes, must_find=must_find, window=window)
                )
                while cut is None and not eof and len(buf) > piece_bytes:  # a line longer than the buffer
                    block = stream.read(1 << 20)
                    eof = not block
                    buf += block
                    cut = _cut_in(buf, piece_bytes, must_find=must_find, window=window)
                if cut is None:
                    cut = len(buf)
                last = eof and cut == len(buf)
                if start == 0 and piece == 0 and (what := sniff_bytes(bytes(buf[:8192]))) is not None:
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


def _cut_in(buf: bytearray, target: int, *, must_find: bool, window: int) -> int | None:
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
    datasets = hf_datasets()
    spec, hf = hf_stream_spec(file)
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


def plan_tasks(
    files: Iterator[InputFile], *, chunk_bytes: int, text_split_bytes: int, text_field: str = "text"
) -> Iterator[list[Chunk]]:
    """Group chunks into worker tasks of about chunk_bytes: one chunk of a large file, or a run
    of small files."""
    task: list[Chunk] = []
    size = 0
    for file in files:
        for piece in file_chunks(
            file, chunk_bytes=chunk_bytes, text_split_bytes=text_split_bytes, text_field=text_field
        ):
            chunk = replace(piece, split=file.split) if file.split else piece
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
# Reading a chunk: decoding (counting what is not UTF-8), then cleaning


class Utf8Decoder:
    """Decodes UTF-8 by data.clean.on_decode_error, counting the bytes that are not UTF-8 (and
    the documents holding them) in itself."""

    def __init__(self, on_error: str) -> None:
        self.on_error = on_error  # "replace", "drop_bytes" or "skip_document"
        self.bad_bytes = 0
        self.bad_documents = 0

    def decode(self, raw: bytes) -> tuple[str | None, int]:
        """(text, undecodable byte count). The text is None when on_error is 'skip_document' and
        there were bad bytes."""
        try:
            return raw.decode("utf-8"), 0
        except UnicodeDecodeError:
            pass
        # "ignore" drops exactly the bytes that "replace" replaces (the codec picks the same bad
        # spans whatever the handler), and what it keeps encodes back to the bytes it came from.
        dropped = raw.decode("utf-8", errors="ignore")
        bad = len(raw) - len(dropped.encode("utf-8"))
        self.bad_bytes += bad
        self.bad_documents += 1
        if self.on_error == "skip_document":
            return None, bad
        return (raw.decode("utf-8", errors="replace") if self.on_error == "replace" else dropped), bad


@dataclass
class Document:
    name: str
    text: str
    last: bool  # ends its input file (an end-of-text token follows it)


def _decode_counted(decoder: Utf8Decoder, raw: bytes, stats: CleanStats) -> tuple[str | None, int]:
    """`decoder.decode`, counting undecodable bytes and documents in the report."""
    text, bad = decoder.decode(raw)
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
    raw = _chunk_bytes(chunk)
    stats.bytes_in += len(raw)
    decoder = Utf8Decoder(cleaner.cfg.on_decode_error)
    if chunk.format == "text":
        yield from _text_document(chunk, raw, decoder, cleaner, stats)
    else:
        yield from _jsonl_documents(chunk, raw, text_field, decoder, cleaner, stats)


def _chunk_bytes(chunk: Chunk) -> bytes:
    """A text or JSON Lines chunk's bytes: handed over (decompressed), or read from its file."""
    if chunk.data is not None:
        return chunk.data
    try:
        with open(chunk.path, "rb") as f:
            f.seek(chunk.start)
            raw = f.read(chunk.end - chunk.start)
    except OSError as e:
        raise DataError(f"{chunk.path}: cannot read: {e.strerror or e}") from e
    if len(raw) != chunk.end - chunk.start:
        raise DataError(f"{chunk.path}: changed while being read (expected {chunk.end} bytes)")
    return raw


def _text_document(
    chunk: Chunk, raw: bytes, decoder: Utf8Decoder, cleaner: Cleaner, stats: CleanStats
) -> Iterator[Document]:
    """A text chunk is one document (the file's, or one piece of a large file)."""
    stats.documents_in += 1
    if chunk.start == 0 and raw.startswith(_BOM):
        raw = raw[len(_BOM) :]
    name = chunk.name if chunk.piece == 0 and chunk.last else f"{chunk.name}#{chunk.piece}"
    text, bad = _decode_counted(decoder, raw, stats)
    if text is None:
        stats.remove("undecodable", len(raw), f"{chunk.path}: {bad} undecodable bytes in {name}")
        return
    cleaned = cleaner(text, stats)
    if cleaned is not None:
        yield Document(name, cleaned, chunk.last)


def _jsonl_documents(
    chunk: Chunk, raw: bytes, text_field: str, decoder: Utf8Decoder, cleaner: Cleaner, stats: CleanStats
) -> Iterator[Document]:
    """One document per non-blank line, named by the line's byte offset."""
    offset = chunk.start
    for line in raw.split(b"\n"):
        at = offset
        offset += len(line) + 1
        if not line.strip():
            continue
        stats.documents_in += 1
        text, bad = _decode_counted(decoder, line, stats)
        if text is None:
            stats.remove("undecodable", len(line), f"{chunk.path} at byte {at}: {bad} undecodable bytes")
            continue
        value = _json_text(text, text_field)
        if not isinstance(value, str):
            stats.remove("bad_json", len(line), f"{chunk.path} at byte {at}: {value.problem}")
            continue
        cleaned = cleaner(value, stats)
        if cleaned is not None:
            yield Document(f"{chunk.name}@{at}", cleaned, True)


@dataclass(frozen=True)
class _NotText:
    problem: str


def _json_text(line: str, text_field: str) -> str | _NotText:
    """The text field of one JSON line, or what is wrong with the line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return _NotText(f"not JSON ({e.msg})")
    value = obj.get(text_field) if isinstance(obj, dict) else None
    if isinstance(value, str):
        return value
    problem = (
        f"no string field {text_field!r}"
        if isinstance(obj, dict)
        else f"a {type(obj).__name__}, not an object"
    )
    return _NotText(f"{problem} (data.text_field)")


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
        stats.bytes_in += utf8_bytes(value)
        cleaned = cleaner(value, stats)
        if cleaned is not None:
            yield Document(f"{chunk.name}@{at}", cleaned, True)
