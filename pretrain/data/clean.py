"""Cleaning one document: newlines, control characters, Unicode normalization, length filters,
and the report of what reading and cleaning did (`CleanStats`). Dedup needs the whole stream in
order and lives in `dedup.py`.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from pretrain.config.tree import CleanConfig


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
            stats.remove("empty", utf8_bytes(text))
            return None
        if len(text) < c.min_chars:
            stats.remove("too_short", utf8_bytes(text))
            return None
        if c.max_chars is not None and len(text) > c.max_chars:
            stats.remove("too_long", utf8_bytes(text))
            return None
        return text


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))
