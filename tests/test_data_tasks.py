"""`data.tasks`: a prepare as many tasks on the local executor gives one host's token stream and
kept set, dedup across task boundaries included; the same dataset for any number of workers; a task
killed by SIGKILL is run again alone by the same command, which then gives the same dataset."""

from __future__ import annotations

import gzip
import json
import random
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from pretrain.config.tree import DataConfig, validate
from pretrain.data.dataset import load_manifest
from pretrain.data.prepare import prepare
from pretrain.data.shards import open_shard
from pretrain.data.tasks import FAULT_KILL, _buckets, near_removed, work_dir
from pretrain.errors import ConfigError, DataError
from tests.conftest import GPT2_DIR, TINY_SHAKESPEARE, cli

WORDS = [f"w{i}" for i in range(2000)]


def _doc(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(200))


def _near(rng: random.Random, text: str) -> str:
    words = text.split()
    words[rng.randrange(len(words))] = "changed"
    return " ".join(words)


def write_corpus(d: Path, seed: int = 7) -> int:
    """Three JSON Lines files and a gzipped one in `d`. The later files hold near copies (one word
    of 200 changed) and exact copies of documents of the first (another task's); one file, near
    copies of its own too. Returns the number of near copies."""
    rng = random.Random(seed)
    first = [_doc(rng) for _ in range(150)]
    files: list[list[str]] = [first, [_doc(rng) for _ in range(150)], [_doc(rng) for _ in range(150)]]
    planted = 0
    for docs in files[1:]:
        for _ in range(20):
            docs.insert(rng.randrange(len(docs)), _near(rng, rng.choice(first)))
            planted += 1
        for _ in range(5):
            docs.insert(rng.randrange(len(docs)), rng.choice(first))
    for k in range(15):  # within a file
        files[1].insert(rng.randrange(len(files[1])), _near(rng, files[1][k]))
    last = [_doc(rng) for _ in range(100)] + [_near(rng, d) for d in first[:10]]
    for i, docs in enumerate(files):
        (d / f"part{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    with gzip.open(d / "part3.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in last)
    return planted + 15 + 10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    d = tmp_path_factory.mktemp("tasks_corpus")
    return d, write_corpus(d)


def dataset_files(d: Path) -> dict[str, bytes]:
    """Every file of a dataset (shards, manifest, tokenizer), by name."""
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if not p.name.startswith(".")}


def data_config(corpus: Path, out: Path, **over: object) -> dict[str, object]:
    """The data section these tests prepare with: GPT-2's ranks offline, small chunks, near dedup on."""
    return {
        "corpus": str(corpus),
        "tokenizer": "gpt2",
        "tokenizer_path": str(GPT2_DIR),
        "dataset_dir": str(out),
        "chunk_bytes": 8192,
        "clean": {"near_dedup": True},
        "workers": 0,
        **over,
    }


def _cfg(corpus: Path, out: Path, **over: object) -> DataConfig:
    return DataConfig.model_validate(data_config(corpus, out, **over))


def _stream(d: Path) -> dict[str, np.ndarray]:
    m = load_manifest(d)
    return {
        s: np.concatenate([np.asarray(open_shard(d / e["path"])) for e in m[s]]) for s in ("train", "val")
    }


@pytest.fixture(scope="module")
def one_host(corpus: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare(_cfg(corpus[0], tmp_path_factory.mktemp("one_host") / "ds"))


@pytest.fixture(scope="module")
def four_tasks(corpus: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("four") / "ds"
    return prepare(_cfg(corpus[0], out, tasks=4, executor="local", workers=2))


def test_four_tasks_give_one_hosts_token_stream_and_kept_set(corpus, one_host, four_tasks, tmp_path):
    ref, got = load_manifest(one_host), load_manifest(four_tasks)
    removed = ref["report"]["removed"]
    # The near copies go, those of another task's documents too (LSH may miss one: J = 0.95 is
    # found with p = 0.998), and the exact ones.
    assert removed["near_duplicate"]["documents"] >= corpus[1] - 3
    assert removed["exact_duplicate"]["documents"] >= 10
    assert got["report"]["removed"] == removed
    assert got["report"]["documents_out"] == ref["report"]["documents_out"]
    one_task = prepare(_cfg(corpus[0], tmp_path / "one", tasks=1))
    for split, tokens in _stream(one_host).items():
        assert np.array_equal(_stream(four_tasks)[split], tokens), split
        assert np.array_equal(_stream(one_task)[split], tokens), split
    assert {Path(e["path"]).name.split("_")[1] for e in got["train"]} == {
        "t00000",
        "t00001",
        "t00002",
        "t00003",
    }
    assert not work_dir(four_tasks).exists()  # the tasks' own files go once the dataset is in place


def test_the_same_dataset_for_any_number_of_workers(corpus, four_tasks, tmp_path):
    again = prepare(_cfg(corpus[0], tmp_path / "ds", tasks=4, executor="local", workers=0))
    assert dataset_files(again) == dataset_files(four_tasks)


def test_one_document_and_an_empty_split_as_one_host_cuts_them(tmp_path):
    # tinyshakespeare is one document: cut 90/10 by characters. Two documents, val_fraction 0.01:
    # none hashes to val, so the last one goes there.
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "a.txt").write_text("first document " * 50)
    (tmp_path / "two" / "b.txt").write_text("second document " * 50)
    for corpus, over in ((TINY_SHAKESPEARE, {}), (tmp_path / "two", {"val_fraction": 0.01})):
        one = prepare(_cfg(corpus, tmp_path / f"one-{Path(corpus).name}", **over))
        three = prepare(_cfg(corpus, tmp_path / f"three-{Path(corpus).name}", tasks=3, **over))
        for split, tokens in _stream(one).items():
            assert np.array_equal(_stream(three)[split], tokens), (corpus, split)
        assert load_manifest(three)["report"]["notes"] == load_manifest(one)["report"]["notes"]


def test_a_task_killed_mid_way_runs_again_alone_and_gives_the_same_dataset(
    corpus, four_tasks, tmp_path, monkeypatch
):
    """Encode task 2 is killed (SIGKILL), then on the next try write task 1: each time one error names
    the stage and the task, and nothing is under the dataset's name. Each try runs only what had not
    finished, and the last one gives the uninterrupted dataset, byte for byte."""
    out = tmp_path / "ds"
    cfg = _cfg(corpus[0], out, tasks=4, executor="local", workers=2)
    said: list[str] = []
    for fault in ("encode:2", "write:1", None):
        said.clear()
        if fault is None:
            monkeypatch.delenv(FAULT_KILL)
            prepare(cfg, log=said.append)
            break
        monkeypatch.setenv(FAULT_KILL, fault)
        with pytest.raises(DataError) as e:
            prepare(cfg, log=said.append)
        stage, rank = fault.split(":")
        assert f"stage {stage!r}" in str(
            e.value
        ) and f"1 of 4 tasks did not complete: rank {rank} (killed by SIGKILL" in str(e.value)
        assert not out.exists()
        if stage == "write":  # the encode task killed before ran again alone, and nothing else of it
            assert "stage encode: 1 of 4 tasks to run on this host (3 done before)" in said
    assert dataset_files(out) == dataset_files(four_tasks)
    # The last try ran only the write task killed before: every earlier stage was done.
    assert not [line for line in said if re.match(r"stage (encode|exact|bands|clusters): [1-9]\d* of", line)]
    assert "stage write: 1 of 4 tasks to run on this host (3 done before)" in said


def test_near_dedup_across_buckets_keeps_what_one_hosts_lsh_keeps():
    """20,000 documents in clusters and chains of near copies: the buckets' verdict, band by band,
    equals datasketch's MinHashLSH queried and filled with the kept documents in corpus order."""
    from datasketch import LeanMinHash, MinHashLSH

    rng = np.random.default_rng(3)
    perms, n = 128, 20_000
    sigs = rng.integers(0, 2**32, size=(n, perms), dtype=np.uint64).astype(np.uint32)
    for i in range(1, n):  # chains: a copy of the one before with some values changed
        if rng.random() < 0.3:
            sigs[i] = sigs[i - 1]
            sigs[i, rng.choice(perms, size=int(rng.integers(1, 100)), replace=False)] = rng.integers(0, 2**32)
    lsh, expected = MinHashLSH(threshold=0.8, num_perm=perms), []
    for i in range(n):
        m = LeanMinHash(seed=1, hashvalues=sigs[i], scheme="affine32")
        if lsh.query(m):
            expected.append(i)
        else:
            lsh.insert(i, m, check_duplication=False)
    members, sizes = [], []
    for start, end in MinHashLSH(threshold=0.8, num_perm=perms).hashranges:
        m, s = _buckets(sigs[:, start:end], np.arange(n))
        members.append(m)
        sizes.append(s)
    got = near_removed(np.concatenate(members), np.concatenate(sizes))
    assert 1000 < len(expected) < n // 2
    assert got.tolist() == expected


def test_the_executor_fields_are_checked_together():
    with pytest.raises(ConfigError) as e:
        validate({"data": {"executor": "slurm", "slurm": {"time": "soon"}}})
    text = str(e.value)
    assert "set data.tasks" in text and "data.slurm.time 'soon'" in text


def test_a_damaged_hand_off_is_named_in_one_error(corpus, tmp_path, monkeypatch):
    """What a stage leaves for the next is checked on read, never unpickled: an encode task's
    statistics changed after a try that stopped in the write stage are named in one error, with the fix."""
    out = tmp_path / "ds"
    cfg = _cfg(corpus[0], out, tasks=2, executor="local", workers=2)
    monkeypatch.setenv(FAULT_KILL, "write:1")
    with pytest.raises(DataError):
        prepare(cfg)
    monkeypatch.delenv(FAULT_KILL)
    stats = work_dir(out) / "encode" / "t00000" / "stats.json"
    stats.write_text(stats.read_text().replace('"documents_in": ', '"documents_in": 1'))
    with pytest.raises(DataError) as e:
        prepare(cfg)
    assert str(e.value).startswith(f"{stats}: its body does not match its sha256;")
    assert "run the prepare again" in str(e.value)
    assert not out.exists()
    assert not list(work_dir(out).rglob("*.pkl"))


def test_train_reads_a_four_task_dataset_without_the_tasks_flag(corpus, tmp_path):
    # docs/data.md's prepare as tasks, made by `train` itself; then train again as a user would, with the
    # same corpus and tokenizer and none of the prepare-only settings.
    model = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
             "batch.micro_batch_size=2", "schedule.max_steps=2", "schedule.warmup_steps=1",
             "logging.eval_interval=2", "logging.eval_batches=1", "logging.sample_tokens=0"]  # fmt: skip
    data = {
        k: v
        for k, v in data_config(corpus[0], tmp_path / "ds").items()
        if k not in ("chunk_bytes", "workers")
    }
    same = [f"data.{k}={v}" for k, v in data.items() if k != "clean"] + ["data.clean.near_dedup=true"]

    def train(run: str, *extra: str) -> subprocess.CompletedProcess[str]:
        sets = [*model, *same, f"logging.run_dir={tmp_path / run}", *extra]
        return cli("train", *(a for s in sets for a in ("--set", s)), cwd=tmp_path)

    first = train("run1", "data.tasks=4", "data.executor=local", "data.workers=2", "data.chunk_bytes=8192")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # what `data prepare` prints: the counts of what was removed, then the dataset
    assert re.search(r"^removed:  exact_duplicate \d+ docs .*near_duplicate \d+ docs", first.stdout, re.M)
    assert f"dataset ready in {tmp_path / 'ds'}: train " in first.stdout
    second = train("run2")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "was prepared as 4 tasks (data.tasks=4); it is read as it is" in second.stderr
    assert "preparing" not in second.stdout and "step 2" in second.stdout
    other = train("run3", "data.clean.near_dedup=false")
    assert other.returncode == 2 and "Traceback" not in other.stderr
    assert "To read it as it is, repeat its settings: --set data.clean.near_dedup=true; " in other.stderr
