"""Tokenizers: text → token ids.

Three kinds:
- `char`: one token per character, the vocabulary fit on the corpus (nanoGPT's shakespeare_char);
- `gpt2`: GPT-2's BPE through tiktoken, its ranks read from a local file or directory (offline)
  or fetched by tiktoken (online);
- `bpe`: a byte-level BPE trained on the corpus's word counts by Hugging Face `tokenizers`
  (`train_bpe`) and run through `tiktoken.Encoding`;
- `hf`: any Hugging Face `tokenizer.json` (a Llama's, a Pythia's, a Qwen's), run by `tokenizers`.

Each has a `fingerprint()`, a sha256 of its vocabulary or ranks, that a prepared dataset records
so that a run can refuse tokens produced by another vocabulary.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
import regex
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks, load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str

from pretrain.errors import DataError
from pretrain.files import write_atomic

ENDOFTEXT = "<|endoftext|>"
GPT2_EOT = 50256
GPT2_VOCAB_SIZE = 50257
BPE_RANKS_FILE = "tokenizer.tiktoken"
HF_TOKENIZER_FILE = "hf_tokenizer.json"  # an hf tokenizer's tokenizer.json, its bytes unchanged
HF_FILE = "tokenizer.json"  # the name a Hugging Face directory gives it
# End-of-text tokens by the names Hugging Face tokenizers give them, looked for in this order.
HF_EOS_NAMES = ("</s>", ENDOFTEXT, "<|end_of_text|>", "<eos>")
# Where tiktoken fetches GPT-2's ranks (tiktoken_ext.openai_public): its cache names files by their sha1.
_OPENAI = "https://openaipublic.blob.core.windows.net/"
GPT2_URLS = {
    "gpt2.tiktoken": _OPENAI + "encodings/r50k_base.tiktoken",
    "vocab.bpe": _OPENAI + "gpt-2/encodings/main/vocab.bpe",
    "encoder.json": _OPENAI + "gpt-2/encodings/main/encoder.json",
}
_PRETOKENIZE = regex.compile(r50k_pat_str)


def _write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")


def _read_json(path: str | Path) -> dict[str, Any]:
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise DataError(f"{path}: tokenizer file not found") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable tokenizer JSON ({e})") from e
    if not isinstance(obj, dict) or obj.get("type") not in ("char", "gpt2", "bpe", "hf"):
        raise DataError(
            f"{path}: not a tokenizer file (expected a JSON object with type 'char', 'gpt2', 'bpe' or 'hf')"
        )
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

    def encode_batch(self, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
        return [self.encode_array(t).astype(dtype) for t in texts]

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


# ---------------------------------------------------------------------------------------------
# tiktoken-based: GPT-2 and the corpus-trained BPE


@contextlib.contextmanager
def _tiktoken_cache_dir(value: str) -> Iterator[None]:
    """tiktoken's loaders read TIKTOKEN_CACHE_DIR on each call; '' turns its cache off, so that
    local files are read in place, not copied into it."""
    old = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = old


def _ranks_sha256(ranks: dict[bytes, int]) -> str:
    """sha256 of the ranks in tiktoken's file format (base64 token, rank; by rank): for GPT-2 the
    sha256 of gpt2.tiktoken itself, the hash tiktoken pins, whichever way the ranks were loaded."""
    h = hashlib.sha256()
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
    return h.hexdigest()


def _load_ranks_file(path: Path) -> dict[bytes, int]:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read the rank file: {e.strerror or e}") from e
    try:
        with _tiktoken_cache_dir(""):
            return load_tiktoken_bpe(str(path), expected_hash=hashlib.sha256(data).hexdigest())
    except (ValueError, IndexError) as e:
        raise DataError(f"{path}: not a tiktoken rank file ({e})") from e


def _gpt2_ranks(path: Path | None) -> dict[bytes, int]:
    """GPT-2's ranks from a gpt2.tiktoken file; a directory holding gpt2.tiktoken, or vocab.bpe +
    encoder.json, or tiktoken's own cache of them; or (None) tiktoken's download."""
    if path is None:
        try:
            return tiktoken.get_encoding("gpt2")._mergeable_ranks
        except Exception as e:
            raise DataError(
                f"cannot load tiktoken's 'gpt2' encoding ({type(e).__name__}: {e}); offline, set "
                "data.tokenizer_path to a local gpt2.tiktoken file or a directory holding it"
            ) from e
    if path.is_file():
        return _load_ranks_file(path)
    if not path.is_dir():
        raise DataError(f"{path}: no such GPT-2 rank file or directory (data.tokenizer_path)")
    if (path / "gpt2.tiktoken").is_file():
        return _load_ranks_file(path / "gpt2.tiktoken")
    if (path / "vocab.bpe").is_file() and (path / "encoder.json").is_file():
        try:
            with _tiktoken_cache_dir(""):
                return data_gym_to_mergeable_bpe_ranks(str(path / "vocab.bpe"), str(path / "encoder.json"))
        except (ValueError, KeyError, OSError) as e:
            raise DataError(f"{path}: vocab.bpe + encoder.json are not GPT-2's ({e})") from e
    # tiktoken's cache: each file named by the sha1 of the URL it was downloaded from.
    cached = {name: path / hashlib.sha1(url.encode()).hexdigest() for name, url in GPT2_URLS.items()}
    if cached["gpt2.tiktoken"].is_file():
        return _load_ranks_file(cached["gpt2.tiktoken"])
    if cached["vocab.bpe"].is_file() and cached["encoder.json"].is_file():
        try:
            with _tiktoken_cache_dir(""):
                return data_gym_to_mergeable_bpe_ranks(str(cached["vocab.bpe"]), str(cached["encoder.json"]))
        except (ValueError, KeyError, OSError) as e:
            raise DataError(
                f"{path}: tiktoken's cached vocab.bpe + encoder.json are not GPT-2's ({e})"
            ) from e
    raise DataError(
        f"{path}: holds no gpt2.tiktoken, no vocab.bpe + encoder.json, and no tiktoken cache of them "
        "(data.tokenizer_path)"
    )


class TiktokenTokenizer:
    """GPT-2's byte-level BPE (50257 tokens, <|endoftext|> = 50256), encoded by tiktoken.

    With `rank_path` (a file or a directory, see `_gpt2_ranks`) nothing is fetched; without it
    `tiktoken.get_encoding("gpt2")` downloads the ranks on first use.
    """

    kind = "gpt2"

    def __init__(self, rank_path: str | Path | None = None) -> None:
        self.rank_path = Path(os.path.expanduser(rank_path)) if rank_path is not None else None
        ranks = _gpt2_ranks(self.rank_path)
        where = self.rank_path or "tiktoken's gpt2"
        if len(ranks) + 1 != GPT2_VOCAB_SIZE:
            raise DataError(f"{where}: expected {GPT2_VOCAB_SIZE} tokens, the ranks give {len(ranks) + 1}")
        self._init(ranks, "gpt2")

    def _init(self, ranks: dict[bytes, int], name: str) -> None:
        eot = len(ranks)
        try:
            # A fresh Encoding, not tiktoken's registered one: it pickles whole into worker processes.
            self.enc = tiktoken.Encoding(
                name=name, pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens={ENDOFTEXT: eot}
            )
        except ValueError as e:
            raise DataError(f"{name}: ranks rejected by tiktoken ({e})") from e
        self.eot_token: int | None = eot
        self._fingerprint: str | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.enc.n_vocab)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.int64)

    def encode_batch(self, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
        # A plain loop, one thread (prepare runs one process per core): encode_ordinary_batch with
        # num_threads=1 hands each text to a thread pool, which made it 2.3x slower on 128-character
        # documents and 1.15x on 16K ones (benchmarks/bpe_train.py --encode).
        return [np.array(self.enc.encode_ordinary(t), dtype=dtype) for t in texts]

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: text that happens to contain "<|endoftext|>" is plain text here.
        return self.enc.encode_ordinary(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.enc.decode(list(ids))

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = _ranks_sha256(self.enc._mergeable_ranks)
        return self._fingerprint

    def save(self, path: str | Path) -> None:
        _write_json(Path(path), {"type": "gpt2", "ranks_sha256": self.fingerprint()})


class BPETokenizer(TiktokenTokenizer):
    """A byte-level BPE trained on the corpus (`train_bpe`): 256 byte tokens, the merges in order,
    then <|endoftext|>. Pre-tokenized with GPT-2's pattern and encoded by tiktoken."""

    kind = "bpe"

    def __init__(self, ranks: dict[bytes, int]) -> None:  # not the GPT-2 loader of the base class
        self.rank_path = None
        if sorted(ranks.values()) != list(range(len(ranks))) or any(
            bytes([b]) not in ranks for b in range(256)
        ):
            raise DataError("BPE ranks must be 0..n-1 and include all 256 single bytes")
        self._init(ranks, f"bpe{len(ranks) + 1}")

    @classmethod
    def train(cls, word_counts: dict[bytes, int], vocab_size: int) -> BPETokenizer:
        return cls(train_bpe(word_counts, vocab_size))

    def save(self, path: str | Path) -> None:
        """tokenizer.json, and the ranks in tiktoken's format next to it."""
        path = Path(path)
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        lines = b"".join(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n" for tok, rank in ranks)
        write_atomic(path.with_name(BPE_RANKS_FILE), lines)
        _write_json(
            path,
            {
                "type": "bpe",
                "vocab_size": self.vocab_size,
                "ranks_file": BPE_RANKS_FILE,
                "ranks_sha256": self.fingerprint(),
            },
        )

    @classmethod
    def load(cls, path: str | Path) -> BPETokenizer:
        path = Path(path)
        obj = _read_json(path)
        ranks_file = obj.get("ranks_file")
        if obj["type"] != "bpe" or not isinstance(ranks_file, str):
            raise DataError(f"{path}: not a bpe tokenizer file (expected type 'bpe' and 'ranks_file')")
        tok = cls(_load_ranks_file(path.with_name(ranks_file)))
        if tok.fingerprint() != obj.get("ranks_sha256") or tok.vocab_size != obj.get("vocab_size"):
            raise DataError(
                f"{path.with_name(ranks_file)}: ranks of sha256 {tok.fingerprint()} and vocab {tok.vocab_size}, "
                f"but {path.name} says {obj.get('ranks_sha256')} and {obj.get('vocab_size')}"
            )
        return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters, in which byte-level BPE vocabularies
    are written (printable ASCII and Latin-1 map to themselves, the rest to U+0100 onwards)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def count_words(text: str, counts: Counter[bytes]) -> None:
    """Add the text's pre-tokenized words (GPT-2's pattern, as UTF-8 bytes) to counts."""
    counts.update(w.encode("utf-8", errors="surrogatepass") for w in _PRETOKENIZE.findall(text))


def train_bpe(word_counts: dict[bytes, int], vocab_size: int) -> dict[bytes, int]:
    """Byte-level BPE trained by Hugging Face `tokenizers` on pre-tokenized word counts.

    It merges the most frequent adjacent pair (ties to the pair of lower token ids, so the result
    is deterministic) until the ranks plus <|endoftext|> make vocab_size. Returns tiktoken
    mergeable ranks: the 256 single bytes in byte order, then the merged tokens in merge order.
    """
    if vocab_size < 258:
        raise ValueError(
            f"vocab_size must be at least 258 (256 bytes, a merge, end-of-text), got {vocab_size}"
        )
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    to_str = _bytes_to_unicode()
    hf = HFTok(models.BPE())
    # The words come pre-tokenized, spelt in GPT-2's byte alphabet, which has no space: a space
    # separates them and is never part of one. (CharDelimiterSplit: 0.8 of Split's CPU time.)
    hf.pre_tokenizer = pre_tokenizers.CharDelimiterSplit(" ")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # <|endoftext|> is added after training, as the last id
        show_progress=False,
        initial_alphabet=list(to_str.values()),  # all 256 bytes, even those the text lacks
    )
    hf.train_from_iterator(_word_feed(word_counts, to_str), trainer)
    vocab: dict[str, int] = hf.get_vocab()
    if len(vocab) < vocab_size - 1:
        # The trainer stops without an error once no pair is left.
        raise DataError(
            f"the BPE training text is too small for a vocabulary of {vocab_size}: every word became "
            f"one token after {len(vocab) - 256} merges"
        )
    return _byte_ranks(vocab, to_str)


_FEED_CHARS = 1 << 16


def _word_feed(word_counts: dict[bytes, int], to_str: dict[int, str]) -> Iterator[str]:
    """Each word as many times as it was counted, in GPT-2's byte alphabet, space-separated, in
    pieces of about 64K characters: the trainer counts them again in parallel, a few pieces at a
    time, so the text never exists whole and memory stays about that of the word counts."""
    table = [to_str[b] for b in range(256)]  # str.translate of latin-1 text: a byte's char by its value
    parts: list[str] = []
    size = 0
    for word, count in word_counts.items():
        spelt = word.decode("latin-1").translate(table) + " "
        while count > 0:
            k = min(count, max(1, _FEED_CHARS // len(spelt)))
            parts.append(spelt * k)
            size += len(spelt) * k
            count -= k
            if size >= _FEED_CHARS:
                yield "".join(parts)
                parts.clear()
                size = 0
    if parts:
        yield "".join(parts)


def _byte_ranks(vocab: dict[str, int], to_str: dict[int, str]) -> dict[bytes, int]:
    """tiktoken ranks from a vocabulary trained in GPT-2's byte alphabet: the 256 single bytes in
    byte order (the trainer numbers them by character), then the merged tokens in id order, which
    is the order the trainer made them, each spelt back in raw bytes."""
    to_byte = {c: b for b, c in to_str.items()}
    ranks = {bytes([b]): b for b in range(256)}
    for spelt in sorted((t for t in vocab if len(t) > 1), key=vocab.__getitem__):
        ranks[bytes(to_byte[c] for c in spelt)] = len(ranks)
    # tiktoken reaches a token only by merging two tokens of lower rank: the order above gives each
    # one such a split unless a tokenizers release numbers its vocabulary otherwise.
    for token, rank in ranks.items():
        if len(token) > 1 and not any(
            ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
            for i in range(1, len(token))
        ):
            raise RuntimeError(
                f"trained BPE token {token!r} (rank {rank}) is not two tokens of lower rank: the installed "
                "tokenizers numbers its trained vocabulary otherwise, install 0.23, the release this was checked on"
            )
    return ranks


# ---------------------------------------------------------------------------------------------
# Any Hugging Face tokenizer.json


def _hf_eos(path: Path, hf: Any) -> str | None:
    """The end-of-text token: tokenizer_config.json's eos_token beside `path` where it names one of
    the added tokens, else the first of `HF_EOS_NAMES` among them; None where there is none."""
    added = {t.content for t in hf.get_added_tokens_decoder().values()}
    conf = path.with_name("tokenizer_config.json")
    with contextlib.suppress(OSError, ValueError, AttributeError):
        eos = json.loads(conf.read_text(encoding="utf-8")).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos  # an AddedToken's dump
        if isinstance(eos, str) and hf.token_to_id(eos) is not None:
            return eos
    return next((name for name in HF_EOS_NAMES if name in added), None)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` run by `tokenizers`: documents are encoded without the
    special tokens it would add (no <s>), special tokens in the text are text, and its end-of-text
    token (`_hf_eos`) ends each one.

    The fingerprint is the sha256 of the file's bytes, which `save` keeps unchanged.
    """

    kind = "hf"

    def __init__(self, data: bytes, where: str | Path, eos: str | None) -> None:
        from tokenizers import Tokenizer as Tok

        try:
            self.hf = Tok.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception on a file it cannot parse
            raise DataError(
                f"{where}: not a readable Hugging Face tokenizer.json ({str(e)[:200]}), point "
                "data.tokenizer_path at a valid one"
            ) from e
        # A literal "</s>" or "<|endoftext|>" in a document is plain text, as tiktoken's
        # encode_ordinary has it here and the export's split_special_tokens has it in transformers.
        self.hf.encode_special_tokens = True
        self.data = data
        self.eos = eos
        self.eot_token: int | None = self.hf.token_to_id(eos) if eos is not None else None
        self._fingerprint = hashlib.sha256(data).hexdigest()

    def __reduce__(self) -> tuple[Any, ...]:
        # Into prepare's workers as the file's bytes: a pickled tokenizers.Tokenizer loses
        # encode_special_tokens.
        return (type(self), (self.data, "tokenizer.json", self.eos))

    @classmethod
    def from_path(cls, path: str | Path) -> HFTokenizer:
        """From a tokenizer.json, or a directory holding one (data.tokenizer_path)."""
        path = Path(os.path.expanduser(path))
        file = path / HF_FILE if path.is_dir() else path
        if not file.is_file():
            sp = file.with_name("tokenizer.model")
            if sp.is_file():
                raise DataError(
                    f"{sp}: a SentencePiece model without a tokenizer.json, convert it with transformers "
                    "(AutoTokenizer.from_pretrained(dir).save_pretrained(dir)) and point data.tokenizer_path "
                    "at the directory"
                )
            raise DataError(
                f"{file}: no such Hugging Face tokenizer.json, point data.tokenizer_path at one or at a "
                "directory holding one"
            )
        try:
            data = file.read_bytes()
        except OSError as e:
            raise DataError(f"{file}: cannot read it ({e.strerror or e}), fix data.tokenizer_path") from e
        tok = cls(data, file, None)
        tok.eos = _hf_eos(file, tok.hf)
        tok.eot_token = tok.hf.token_to_id(tok.eos) if tok.eos is not None else None
        return tok

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch(self, texts: list[str], dtype: np.dtype) -> list[np.ndarray]:
        # tokenizers' batch encode (no offsets): 0.9x a loop's CPU time on 3,700 short documents, 0.75x on 100 KB ones.
        encs = self.hf.encode_batch_fast(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype=dtype) for e in encs]

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=False))

    def fingerprint(self) -> str:
        return self._fingerprint

    def save(self, path: str | Path) -> None:
        """tokenizer.json (our record), and the Hugging Face file, unchanged, next to it."""
        path = Path(path)
        write_atomic(path.with_name(HF_TOKENIZER_FILE), self.data)
        _write_json(
            path,
            {
                "type": "hf",
                "vocab_size": self.vocab_size,
                "hf_file": HF_TOKENIZER_FILE,
                "sha256": self.fingerprint(),
                "eos_token": self.eos,
            },
        )

    @classmethod
    def load(cls, path: str | Path) -> HFTokenizer:
        path = Path(path)
        obj = _read_json(path)
        hf_file, eos = obj.get("hf_file"), obj.get("eos_token")
        if obj["type"] != "hf" or not isinstance(hf_file, str) or not isinstance(eos, str | None):
            raise DataError(f"{path}: not an hf tokenizer file (expected type 'hf' and 'hf_file')")
        file = path.with_name(hf_file)
        try:
            data = file.read_bytes()
        except OSError as e:
            raise DataError(f"{file}: cannot read it ({e.strerror or e}), prepare the dataset again") from e
        tok = cls(data, file, eos)
        if tok.fingerprint() != obj.get("sha256"):
            raise DataError(
                f"{file}: sha256 {tok.fingerprint()[:12]}, but {path.name} says {str(obj.get('sha256'))[:12]}, "
                "prepare the dataset again"
            )
        return tok


Tokenizer: TypeAlias = CharTokenizer | TiktokenTokenizer | HFTokenizer


def load_tokenizer(path: str | Path, tokenizer_path: str | Path | None = None) -> Tokenizer:
    """Read a tokenizer saved by `save`. A gpt2 tokenizer is rebuilt from `tokenizer_path`
    (or online without it) and must have the ranks it was saved with."""
    obj = _read_json(path)
    if obj["type"] == "char":
        return CharTokenizer.load(path)
    if obj["type"] == "bpe":
        return BPETokenizer.load(path)
    if obj["type"] == "hf":
        return HFTokenizer.load(path)
    tok = TiktokenTokenizer(tokenizer_path)
    saved = obj.get("ranks_sha256")
    if saved != tok.fingerprint():
        raise DataError(
            f"{path}: saved with GPT-2 ranks of sha256 {saved}, but {tokenizer_path or 'tiktoken gpt2'} "
            f"has {tok.fingerprint()}"
        )
    return tok


# ---------------------------------------------------------------------------------------------
# Hugging Face `tokenizers` equivalents, for the export's hf/ directory


UNK = "<unk>"  # the char tokenizer's Hugging Face stand-in for a character not in its vocabulary


def hf_added_tokens(tok: Tokenizer) -> list[str]:
    """The tokens the Hugging Face tokenizer of `tok` has beyond `tok`'s own vocabulary, in id order
    from `tok.vocab_size`: the char tokenizer's end-of-text (bos, eos and pad; ours has none, its
    documents are concatenated) and `<unk>` (ours raises on a character it does not know). A
    byte-level BPE needs neither: its <|endoftext|> is its own, and every text has its bytes."""
    return [ENDOFTEXT, UNK] if isinstance(tok, CharTokenizer) else []


def hf_vocab_size(tok: Tokenizer) -> int:
    """How many ids the Hugging Face tokenizer of `tok` gives: `tok`'s, and `hf_added_tokens`."""
    return tok.vocab_size + len(hf_added_tokens(tok))


def hf_eot_token(tok: Tokenizer) -> int:
    """The id of <|endoftext|> in the Hugging Face tokenizer of `tok` (bos, eos and pad)."""
    return tok.eot_token if tok.eot_token is not None else tok.vocab_size


def hf_tokenizer(tok: Tokenizer) -> Any:
    """A `tokenizers.Tokenizer` that encodes and decodes as `tok` does (built offline).

    char: each character its own token (a BPE without merges), decoded by concatenation; then
    <|endoftext|> and <unk> (`hf_added_tokens`): a character ours would refuse is <unk>, one token
    each, never dropped.
    gpt2/bpe: byte-level BPE with GPT-2's pre-tokenizer. To reproduce tiktoken exactly, a word
    that is itself a token is that token (`ignore_merges`), and every split of a token into two
    tokens is a merge, ranked by the token: tiktoken merges any adjacent pair whose concatenation
    has the lowest rank, not only the pair that first made it. <|endoftext|> is a special token.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTok

    if isinstance(tok, HFTokenizer):
        return HFTok.from_str(tok.data.decode("utf-8"))  # the file it was read from
    if isinstance(tok, CharTokenizer):
        vocab = {c: i for i, c in enumerate(tok.chars)}
        vocab.update({t: tok.vocab_size + i for i, t in enumerate(hf_added_tokens(tok))})
        hf = HFTok(models.BPE(vocab=vocab, merges=[], unk_token=UNK, fuse_unk=False))
        hf.decoder = decoders.Fuse()
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in hf_added_tokens(tok)])
        return hf
    ranks: dict[bytes, int] = tok.enc._mergeable_ranks
    to_str = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(to_str[x] for x in b)

    vocab = {s(t): r for t, r in ranks.items()}
    merges = sorted(
        (rank, s(token[:i]), s(token[i:]))
        for token, rank in ranks.items()
        for i in range(1, len(token))
        if token[:i] in ranks and token[i:] in ranks
    )
    vocab[ENDOFTEXT] = hf_eot_token(tok)
    hf = HFTok(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
    return hf
