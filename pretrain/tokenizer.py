"""Tokenizers: text → token ids.

Two kinds: a character vocabulary fit on the corpus (nanoGPT's shakespeare_char), and GPT-2's
BPE through tiktoken, read from a local rank file (offline) or fetched by tiktoken (online).
Each has a `fingerprint()`, a sha256 of its vocabulary, that a prepared dataset records so a
run can refuse tokens produced by another vocabulary.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str

from pretrain.corpus import DataError

ENDOFTEXT = "<|endoftext|>"
GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _read_json(path: str | Path) -> dict[str, Any]:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise DataError(f"{path}: tokenizer file not found") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable tokenizer JSON ({e})") from e
    if not isinstance(obj, dict) or obj.get("type") not in ("char", "gpt2"):
        raise DataError(f"{path}: not a tokenizer file (expected a JSON object with type 'char' or 'gpt2')")
    return obj


class CharTokenizer:
    """One token per character; the vocabulary is the sorted set of the corpus's characters."""

    kind = "char"
    eot_token: int | None = None  # documents are simply concatenated, as in nanoGPT

    def __init__(self, chars: Sequence[str]) -> None:
        if not chars or any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError("chars must be a non-empty sequence of distinct single characters")
        self.chars = sorted(chars)
        # Code points in vocabulary order, for a vectorized lookup in encode_array.
        self._codepoints = np.array([ord(c) for c in self.chars], dtype=np.uint32)

    @classmethod
    def fit(cls, texts: Iterable[str]) -> CharTokenizer:
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        if not seen:
            raise DataError("cannot fit a character vocabulary on empty text")
        return cls(sorted(seen))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids as an int64 array (the fast path used by prepare)."""
        cps = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
        ids = np.searchsorted(self._codepoints, cps)
        ok = self._codepoints[np.minimum(ids, len(self.chars) - 1)] == cps
        if not ok.all():
            bad = chr(int(cps[np.argmin(ok)]))
            raise DataError(
                f"character {bad!r} (U+{ord(bad):04X}) is not in the tokenizer's vocabulary of "
                f"{self.vocab_size} characters"
            )
        return ids.astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.encode_array(text)]

    def decode(self, ids: Iterable[int]) -> str:
        try:
            return "".join(self.chars[i] for i in ids)
        except IndexError as e:
            raise DataError(f"token id out of range for a vocabulary of {self.vocab_size} characters") from e

    def fingerprint(self) -> str:
        return hashlib.sha256("".join(self.chars).encode("utf-8", errors="surrogatepass")).hexdigest()

    def save(self, path: str | Path) -> None:
        _write_json(Path(path), {"type": "char", "chars": self.chars})

    @classmethod
    def load(cls, path: str | Path) -> CharTokenizer:
        obj = _read_json(path)
        chars = obj.get("chars")
        if obj["type"] != "char" or not isinstance(chars, list) or not all(isinstance(c, str) for c in chars):
            raise DataError(f"{path}: not a char tokenizer file (expected type 'char' and a list 'chars')")
        try:
            return cls(chars)
        except ValueError as e:
            raise DataError(f"{path}: {e}") from e


class TiktokenTokenizer:
    """GPT-2's byte-level BPE (50257 tokens, <|endoftext|> = 50256).

    With `rank_path` the ranks come from a local `gpt2.tiktoken` file and nothing is fetched;
    without it `tiktoken.get_encoding("gpt2")` downloads them on first use.
    """

    kind = "gpt2"
    eot_token: int | None = GPT2_EOT

    def __init__(self, rank_path: str | Path | None = None) -> None:
        self.rank_path = Path(rank_path) if rank_path is not None else None
        self._fingerprint: str | None = None
        if self.rank_path is None:
            try:
                self.enc = tiktoken.get_encoding("gpt2")
            except Exception as e:
                raise DataError(
                    f"cannot load tiktoken's 'gpt2' encoding ({type(e).__name__}: {e}); offline, set "
                    "data.tokenizer_path to a local gpt2.tiktoken rank file"
                ) from e
        else:
            try:
                data = self.rank_path.read_bytes()
            except OSError as e:
                raise DataError(
                    f"{self.rank_path}: cannot read the GPT-2 rank file: {e.strerror or e}"
                ) from e
            # expected_hash keeps tiktoken's path-keyed file cache from serving a stale copy.
            sha = hashlib.sha256(data).hexdigest()
            try:
                ranks = load_tiktoken_bpe(str(self.rank_path), expected_hash=sha)
            except ValueError as e:
                raise DataError(f"{self.rank_path}: not a tiktoken rank file ({e})") from e
            try:
                self.enc = tiktoken.Encoding(
                    name="gpt2",
                    pat_str=r50k_pat_str,
                    mergeable_ranks=ranks,
                    special_tokens={ENDOFTEXT: GPT2_EOT},
                )
            except ValueError as e:
                raise DataError(f"{self.rank_path}: not GPT-2's ranks ({e})") from e
        if self.enc.n_vocab != GPT2_VOCAB_SIZE:
            where = self.rank_path or "tiktoken's gpt2"
            raise DataError(f"{where}: expected {GPT2_VOCAB_SIZE} tokens, the ranks give {self.enc.n_vocab}")

    @property
    def vocab_size(self) -> int:
        return GPT2_VOCAB_SIZE

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: text that happens to contain "<|endoftext|>" is plain text here.
        return self.enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(list(ids))

    def fingerprint(self) -> str:
        """sha256 of the ranks in tiktoken's file format (base64 token, rank; by rank).

        Equal to the sha256 of gpt2.tiktoken itself, the hash tiktoken pins, whichever way the
        ranks were loaded.
        """
        if self._fingerprint is None:
            ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
            h = hashlib.sha256()
            for token, rank in ranks:
                h.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def save(self, path: str | Path) -> None:
        _write_json(Path(path), {"type": "gpt2", "ranks_sha256": self.fingerprint()})


Tokenizer: TypeAlias = CharTokenizer | TiktokenTokenizer


def load_tokenizer(path: str | Path, tokenizer_path: str | Path | None = None) -> Tokenizer:
    """Read a tokenizer saved by `save`. A gpt2 tokenizer is rebuilt from `tokenizer_path`
    (or online without it) and must have the ranks it was saved with."""
    obj = _read_json(path)
    if obj["type"] == "char":
        return CharTokenizer.load(path)
    tok = TiktokenTokenizer(tokenizer_path)
    saved = obj.get("ranks_sha256")
    if saved != tok.fingerprint():
        raise DataError(
            f"{path}: saved with GPT-2 ranks of sha256 {saved}, but {tokenizer_path or 'tiktoken gpt2'} "
            f"has {tok.fingerprint()}"
        )
    return tok
