"""A corpus as one stream of cleaned documents, read in this process: the input files
(`sources.py`) cut into chunks and read (`chunks.py`), each document cleaned (`clean.py`).
`prepare` runs the same stages in worker processes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pretrain.config.tree import CleanConfig
from pretrain.data.chunks import Document, plan_tasks, read_chunk
from pretrain.data.clean import Cleaner, CleanStats
from pretrain.data.sources import HFOptions, iter_input_files


def iter_documents(
    corpus: str,
    *,
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
        iter_input_files(corpus, fmt=fmt, download_dir=download_dir, source=source, hf=hf),
        chunk_bytes=chunk_bytes,
        text_split_bytes=text_split_bytes,
        text_field=text_field,
    ):
        for chunk in task:
            yield from read_chunk(chunk, text_field, cleaner, stats)
