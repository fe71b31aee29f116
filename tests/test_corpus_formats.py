"""Corpus formats beyond plain text and JSON Lines: parquet, gzip/zstd, Hugging Face datasets (saved,
loaded by `load_dataset` and streamed), all built here offline with the real libraries; and the
binary-file and symlink-loop guards."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from pretrain.config.tree import DataConfig
from pretrain.data.corpus import iter_documents
from pretrain.data.dataset import load_manifest
from pretrain.data.prepare import prepare
from pretrain.data.sources import HFOptions, iter_input_files
from pretrain.errors import DataError


def texts(n: int = 300) -> list[str]:
    return [f"Document {i}: {'to be or not to be ' * (1 + i % 17)}\nline two é {i}\n" for i in range(n)]


def write_jsonl(path: Path, docs: list[str]) -> bytes:
    data = "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs)).encode()
    path.write_bytes(data)
    return data


def write_parquet(path: Path, docs: list[str], row_group_size: int = 64) -> None:
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, path, row_group_size=row_group_size)


def all_shards(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.bin"))}


def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# ---------------------------------------------------------------------------------------------
# parquet


def test_parquet_rows_are_documents_by_row_group(tmp_path: Path) -> None:
    docs = texts()
    write_parquet(tmp_path / "a.parquet", docs)
    got = list(iter_documents(str(tmp_path / "a.parquet")))
    assert [d.text for d in got] == docs
    assert got[0].name == "a.parquet@0" and got[65].name == "a.parquet@65"
    assert [f.format for f in iter_input_files(str(tmp_path))] == ["parquet"]  # found in a directory walk


def test_parquet_without_the_text_column_names_the_columns(tmp_path: Path) -> None:
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(it has body\): set data.text_field"):
        list(iter_documents(str(tmp_path / "a.parquet")))
    assert [d.text for d in iter_documents(str(tmp_path / "a.parquet"), text_field="body")] == ["x"]


def test_parquet_prepare_is_the_same_for_any_worker_count(tmp_path: Path) -> None:
    write_parquet(tmp_path / "a.parquet", texts(), row_group_size=16)
    common = {"corpus": str(tmp_path / "a.parquet"), "chunk_bytes": 4096}
    a = prepare(DataConfig(**common, workers=0, dataset_dir=str(tmp_path / "a")))  # type: ignore[arg-type]
    b = prepare(DataConfig(**common, workers=2, dataset_dir=str(tmp_path / "b")))  # type: ignore[arg-type]
    assert load_manifest(b)["report"]["workers"] == 2
    assert all_shards(a) == all_shards(b)
    assert load_manifest(a)["report"]["documents_out"] == 300
    # one large row group (pyarrow's default under a million rows): read by the main process and
    # shared out in runs of rows; the same documents under the same names, so the same shards
    (tmp_path / "one").mkdir()
    write_parquet(tmp_path / "one" / "a.parquet", texts(), row_group_size=1 << 20)
    assert pq.ParquetFile(tmp_path / "one" / "a.parquet").metadata.num_row_groups == 1
    one = {**common, "corpus": str(tmp_path / "one" / "a.parquet")}
    c = prepare(DataConfig(**one, workers=2, dataset_dir=str(tmp_path / "c")))  # type: ignore[arg-type]
    assert load_manifest(c)["report"]["workers"] == 2 and all_shards(c) == all_shards(a)


# ---------------------------------------------------------------------------------------------
# compressed text and JSON Lines


def test_gzip_and_zstd_read_as_the_uncompressed_file(tmp_path: Path) -> None:
    docs = texts()
    data = write_jsonl(tmp_path / "plain.jsonl", docs)
    # two gzip members and two zstd frames: both read across them, as gunzip and zstd -d do
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(data[:1000]) + gzip.compress(data[1000:]))
    z = zstandard.ZstdCompressor()
    (tmp_path / "c.jsonl.zst").write_bytes(z.compress(data[:777]) + z.compress(data[777:]))
    want = [(d.name.split("@")[1], d.text) for d in iter_documents(str(tmp_path / "plain.jsonl"))]
    for name in ("c.jsonl.gz", "c.jsonl.zst"):
        for chunk_bytes in (4096, 1 << 20):  # many pieces, or one
            got = iter_documents(str(tmp_path / name), chunk_bytes=chunk_bytes)
            assert [(d.name.split("@")[1], d.text) for d in got] == want
    text = "".join(docs)
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(text.encode()))
    pieces = list(iter_documents(str(tmp_path / "t.txt.gz"), text_split_bytes=4096))
    assert len(pieces) > 3 and "".join(d.text for d in pieces) == text
    assert [d.name for d in pieces[:2]] == ["t.txt.gz#0", "t.txt.gz#1"] and pieces[-1].last
    files = list(iter_input_files(str(tmp_path)))
    assert [(f.name, f.format, f.compression) for f in files] == [
        ("c.jsonl.gz", "jsonl", "gzip"),
        ("c.jsonl.zst", "jsonl", "zstd"),
        ("plain.jsonl", "jsonl", ""),
        ("t.txt.gz", "text", "gzip"),
    ]


def test_compressed_prepare_is_the_same_for_any_worker_count(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "x.jsonl", texts())
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    common = {"corpus": str(tmp_path / "c"), "chunk_bytes": 4096}
    a = prepare(DataConfig(**common, workers=0, dataset_dir=str(tmp_path / "a")))  # type: ignore[arg-type]
    b = prepare(DataConfig(**common, workers=2, dataset_dir=str(tmp_path / "b")))  # type: ignore[arg-type]
    assert load_manifest(b)["report"]["workers"] == 2 and all_shards(a) == all_shards(b)


def test_corrupt_compressed_file_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:-20])
    with pytest.raises(DataError, match=r"bad.jsonl.gz: cannot decompress \(gzip\)"):
        list(iter_documents(str(tmp_path / "bad.jsonl.gz")))
    (tmp_path / "bad.txt.zst").write_bytes(b"\x28\xb5\x2f\xfd" + b"junk" * 10)
    with pytest.raises(DataError, match=r"bad.txt.zst: cannot decompress \(zstd\)"):
        list(iter_documents(str(tmp_path / "bad.txt.zst")))


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets


def test_hf_saved_dataset_and_dataset_dict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    offline(monkeypatch)
    docs = texts()
    ds = datasets.Dataset.from_dict({"text": docs, "n": list(range(len(docs)))})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)  # three Arrow files
    got = list(iter_documents(str(tmp_path / "saved"), chunk_bytes=4096))
    assert [d.text for d in got] == docs and got[150].name == f"{tmp_path / 'saved'}@150"
    assert [d.text for d in iter_documents(f"hf:{tmp_path / 'saved'}")] == docs
    # a shuffled selection saves its rows in their new order
    ds.shuffle(seed=1).select(range(50)).save_to_disk(str(tmp_path / "sel"))
    assert [d.text for d in iter_documents(str(tmp_path / "sel"))] == ds.shuffle(seed=1)["text"][:50]
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(5))}).save_to_disk(str(tmp_path / "dd"))
    val = list(iter_documents(str(tmp_path / "dd"), hf=HFOptions(split="validation")))
    assert [d.text for d in val] == docs[:5] and val[0].name == f"{tmp_path / 'dd'}[validation]@0"
    with pytest.raises(DataError, match=r"no split 'test' \(it has train, validation\): set data.hf_split"):
        list(iter_documents(str(tmp_path / "dd"), hf=HFOptions(split="test")))


def test_hf_load_dataset_streamed_or_not_gives_the_same_dataset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`hf:NAME` goes through datasets.load_dataset, the Hub's path; here NAME is a local
    directory of parquet files (offline), read downloaded-and-prepared or streamed."""
    offline(monkeypatch)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    docs = texts(400)
    write_parquet(repo / "train-00000-of-00002.parquet", docs[:250])
    write_parquet(repo / "train-00001-of-00002.parquet", docs[250:])
    corpus = f"hf:{tmp_path / 'repo'}"
    common = {"corpus": corpus, "chunk_bytes": 4096, "workers": 2}
    a = prepare(DataConfig(**common, dataset_dir=str(tmp_path / "a")))  # type: ignore[arg-type]
    b = prepare(DataConfig(**common, hf_streaming=True, dataset_dir=str(tmp_path / "b")))  # type: ignore[arg-type]
    assert all_shards(a) == all_shards(b)
    ma = load_manifest(a)
    assert ma["report"]["documents_out"] == 400 and ma["config"]["corpus"] == corpus
    assert "hf_streaming" not in ma["config"]  # streamed or not, the same output
    streamed = list(iter_documents(corpus, chunk_bytes=4096, hf=HFOptions(streaming=True)))
    assert [d.text for d in streamed] == docs and streamed[7].name == f"{corpus}[train]@7"
    with pytest.raises(DataError, match="no column 'body'"):
        prepare(DataConfig(**common, text_field="body", dataset_dir=str(tmp_path / "c")))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Guards: binary files, symlink loops


def test_binary_file_is_refused_naming_what_it_looks_like(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("fine text, with one stray \x00 control character " * 3)
    assert len(list(iter_documents(str(tmp_path / "ok.txt")))) == 1
    (tmp_path / "data.jsonl").write_bytes(gzip.compress(b'{"text": "x"}\n'))  # compressed, no .gz
    with pytest.raises(
        DataError, match=r"data.jsonl: read as JSON Lines, but it looks like gzip data: .* \.gz/\.zst"
    ):
        list(iter_documents(str(tmp_path / "data.jsonl")))
    (tmp_path / "weights.txt").write_bytes(os.urandom(4096))
    with pytest.raises(DataError, match=r"weights.txt: read as text, but it looks like binary data"):
        list(iter_documents(str(tmp_path / "weights.txt")))


def test_symlink_loop_in_a_corpus_directory_is_a_data_error(tmp_path: Path) -> None:
    (tmp_path / "c" / "sub").mkdir(parents=True)
    (tmp_path / "c" / "a.txt").write_text("a document")
    (tmp_path / "c" / "sub" / "up").symlink_to(tmp_path / "c")
    with pytest.raises(DataError, match=r"sub/up: a symbolic link loop .* remove the link"):
        list(iter_input_files(str(tmp_path / "c")))
    # a link to a directory elsewhere (no loop) is followed
    (tmp_path / "c" / "sub" / "up").unlink()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "b.txt").write_text("b document")
    (tmp_path / "c" / "sub" / "other").symlink_to(tmp_path / "other")
    assert [f.name for f in iter_input_files(str(tmp_path / "c"))] == ["a.txt", "sub/other/b.txt"]
