"""Faults in the data pipeline, on the real commands and files: two prepares of one dataset dir, a
rebuild under a run that reads it, --force over another dataset, SIGINT/SIGTERM/kill -9 mid-prepare,
a dataset's own validation split, a one-character corpus, a deleted shard rebuilt under a resume,
a 250-character dataset dir name, a dataset dir that is a link.
Each ends in one message naming the problem and the fix, never a traceback, with nothing lost."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest

from pretrain.config.tree import DataConfig
from pretrain.data.dataset import (
    datasets_sha256,
    load_manifest,
    open_datasets,
    same_data,
    stop_reading,
    write_manifest,
)
from pretrain.data.fingerprint import input_fingerprint, output_config
from pretrain.data.prepare import prepare
from pretrain.data.shards import open_shard, write_shard
from pretrain.data.tokenizer import CharTokenizer, load_tokenizer
from tests.conftest import BIN, GPT2_DIR, cli, subprocess_env

GPT2 = ["--set=data.tokenizer=gpt2", f"--set=data.tokenizer_path={GPT2_DIR}"]
TINY_MODEL = [
    "--set=model.n_layer=1", "--set=model.n_embd=32", "--set=model.n_head=2", "--set=model.block_size=32",
    "--set=batch.micro_batch_size=4", "--set=schedule.warmup_steps=1", "--set=logging.eval_interval=2",
    "--set=logging.eval_batches=1", "--set=logging.sample_tokens=0", "--set=checkpoint.interval=2",
]  # fmt: skip


def pretrain(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return cli(*args, cwd=cwd, timeout=timeout)


def start(args: list[str], cwd: Path, stderr: Path | None = None) -> subprocess.Popen[str]:
    """A `pretrain` command in its own process group (a terminal's Ctrl-C goes to the group)."""
    return subprocess.Popen(
        [str(BIN / "pretrain"), *args],
        cwd=cwd,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if stderr is None else stderr.open("w"),
        text=True,
        start_new_session=True,
        # Ctrl-C as at a terminal, even where this test runs with SIGINT ignored (a background job)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while not ok():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.01)


def read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def write_corpus(path: Path, n_docs: int, words: int = 80, seed: int = 0) -> Path:
    """JSON Lines of distinct random-word documents (no duplicates: dedup keeps them all)."""
    ids = np.random.default_rng(seed).integers(0, 5000, size=(n_docs, words))
    lines = (
        json.dumps({"text": f"{i} " + " ".join(f"w{w}" for w in row)}) for i, row in enumerate(ids.tolist())
    )
    path.write_text("\n".join(lines) + "\n")
    return path


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def alive(procs: list[psutil.Process]) -> list[int]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


# ---------------------------------------------------------------------------------------------
# 1. One dataset dir, one prepare at a time; runs wait for it, and keep it from being rebuilt


def test_a_second_prepare_is_refused_naming_the_first_and_train_waits_for_it(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", 3000)
    ds = tmp_path / "ds"
    args = [
        "data",
        "prepare",
        f"--set=data.corpus={corpus}",
        f"--set=data.dataset_dir={ds}",
        "--workers=2",
    ]
    first = start(args, tmp_path)
    lock = tmp_path / ".ds.lock"
    wait_for("the first prepare's lock", lambda: f"pid {first.pid}," in read(lock))
    os.kill(first.pid, signal.SIGSTOP)  # holds the lock, mid-build, as long as the test needs
    try:
        for extra in ([], ["--force", "--set=data.seed=7"]):
            second = pretrain([*args, *extra], tmp_path)
            assert second.returncode == 2 and "Traceback" not in second.stderr
            assert len(second.stderr.splitlines()) == 1, second.stderr
            assert second.stderr.startswith(
                f"error: {ds}: another prepare is building this dataset right now (pretrain data prepare, "
                f"host {os.uname().nodename}, pid {first.pid}, since "
            ), second.stderr
            assert "wait for it to finish" in second.stderr and "data.dataset_dir" in second.stderr
        # a run that would read it now is refused; `train` (its rank 0 prepares) waits for it
        reader = subprocess.run(
            [sys.executable, "-c", f"from pretrain.data.dataset import open_datasets; from pretrain.config.tree "
             f"import DataConfig; open_datasets(DataConfig(dataset_dir={str(ds)!r}))"],
            env=subprocess_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert (
            reader.returncode == 1
            and f"DataError: {ds}: being rebuilt right now by pretrain data prepare" in (reader.stderr)
        )
        train_err = tmp_path / "train.err"
        train = start(
            ["train", f"--set=data.corpus={corpus}", f"--set=data.dataset_dir={ds}", *TINY_MODEL,
             "--set=schedule.max_steps=2", f"--set=logging.run_dir={tmp_path / 'run'}"],
            tmp_path, stderr=train_err,
        )  # fmt: skip
        wait_for("train to wait", lambda: "waiting for" in read(train_err) or train.poll() is not None)
        assert (
            f"waiting for {ds}: pretrain data prepare, host {os.uname().nodename}, pid {first.pid}"
            in read(train_err)
        )
        assert train.poll() is None
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert f"dataset ready in {ds}" in out
    train_out, _ = train.communicate(timeout=300)
    assert train.returncode == 0, read(train_err)
    assert "done: step 2" in train_out
    again = pretrain(args, tmp_path)
    assert again.returncode == 0 and "already prepared" in again.stdout, again.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "ds", "run", "train.err"]  # no lock left


def test_a_dataset_a_run_reads_is_never_rebuilt_under_it(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", 200)
    ds = tmp_path / "ds"
    args = ["data", "prepare", f"--set=data.corpus={corpus}", f"--set=data.dataset_dir={ds}"]
    assert pretrain(args, tmp_path).returncode == 0
    before = files(ds)
    code = (
        "import sys; from pretrain.config.tree import DataConfig; from pretrain.data.dataset import open_datasets; "
        f"open_datasets(DataConfig(corpus={str(corpus)!r}, dataset_dir={str(ds)!r})); print('reading', flush=True); "
        "sys.stdin.read()"
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert reader.stdout is not None and reader.stdout.readline() == "reading\n"
        forced = pretrain([*args, "--force"], tmp_path)
        assert forced.returncode == 2 and len(forced.stderr.splitlines()) == 1, forced.stderr
        assert forced.stderr.startswith(
            f"error: {ds}: in use by a run that reads it (pid {reader.pid} on this host ("
        ), forced.stderr
        assert "wait for it to end, or prepare into another data.dataset_dir" in forced.stderr
        assert files(ds) == before
        plain = pretrain(args, tmp_path)  # a check needs no exclusive lock: a no-op beside a reader
        assert plain.returncode == 0 and "already prepared" in plain.stdout, plain.stderr
    finally:
        reader.communicate("", timeout=60)
    forced = pretrain([*args, "--force"], tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert "rebuilding" in forced.stdout and "rebuilt byte for byte" in forced.stdout


# ---------------------------------------------------------------------------------------------
# 2. Datasets made with other settings: both choices named; --force says what it replaces


def test_a_dataset_with_other_settings_names_both_choices_and_force_says_what_it_replaces(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "plays.jsonl"
    write_corpus(corpus, 120)
    base = ["data", "prepare", f"--set=data.corpus={corpus}", *GPT2]
    near = pretrain([*base, "--set=data.clean.near_dedup=true"], tmp_path)  # docs/data.md's example
    assert near.returncode == 0, near.stderr
    default = tmp_path / "data" / "plays-gpt2"  # the default dir, as before: older datasets are found there
    kept = files(default)
    plain = pretrain(base, tmp_path)
    assert plain.returncode == 2 and len(plain.stderr.splitlines()) == 1 and "Traceback" not in plain.stderr
    m = re.fullmatch(
        r"error: data/plays-gpt2: holds a dataset prepared with other settings \(data\.clean\.near_dedup: true "
        r"there, false now\)\. To read it as it is, repeat its settings: --set data\.clean\.near_dedup=true; "
        r"to keep it, give this one a directory of its own: --set "
        r"data\.dataset_dir=(data/plays-gpt2-[0-9a-f]{8}) \(in `pretrain train` too\); to replace it, run "
        r"`pretrain data prepare --force` \(runs trained on it then no longer resume on their data\)\n",
        plain.stderr,
    )
    assert m, plain.stderr
    own = pretrain([*base, f"--set=data.dataset_dir={m[1]}"], tmp_path)
    assert own.returncode == 0 and f"dataset ready in {m[1]}" in own.stdout, own.stderr
    assert files(default) == kept  # the other one is untouched
    assert "already prepared" in pretrain([*base, "--set=data.clean.near_dedup=true"], tmp_path).stdout
    forced = pretrain([*base, "--force"], tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert (
        "replacing the dataset in data/plays-gpt2 (--force); it was prepared with data.clean.near_dedup: true "
        "there, false now\n" in forced.stdout
    )
    assert load_manifest(default)["config"]["clean"]["near_dedup"] is False
    assert load_manifest(tmp_path / m[1])["config"]["clean"]["near_dedup"] is False


# ---------------------------------------------------------------------------------------------
# 3. SIGINT (a terminal's Ctrl-C, to the process group), SIGTERM, kill -9 mid-prepare


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_signal_mid_prepare_ends_every_child_and_keeps_the_previous_dataset(
    tmp_path: Path, sig: signal.Signals
) -> None:
    ds = tmp_path / "ds"
    small = write_corpus(tmp_path / "small.jsonl", 100)
    previous = prepare(DataConfig(corpus=str(small), dataset_dir=str(ds), workers=0))
    before = files(previous)
    big = write_corpus(tmp_path / "big.jsonl", 15000)
    args = ["data", "prepare", f"--set=data.corpus={big}", f"--set=data.dataset_dir={ds}", *GPT2]
    run = start([*args, "--workers=2", "--set=data.chunk_bytes=65536", "--force"], tmp_path)
    main = psutil.Process(run.pid)
    # the fork server, the resource tracker and two workers
    wait_for("the workers", lambda: len(main.children(recursive=True)) >= 4 or run.poll() is not None)
    children = main.children(recursive=True)
    time.sleep(0.2)
    assert run.poll() is None, "prepare finished before the signal: make the corpus larger"
    if sig == signal.SIGINT:
        os.killpg(run.pid, sig)  # as a terminal sends Ctrl-C: to every process of the group
    else:
        os.kill(run.pid, sig)
    _, err = run.communicate(timeout=120)
    wait_for("every child to end", lambda: not alive(children), timeout=30)
    assert files(ds) == before
    if sig == signal.SIGKILL:
        assert run.returncode == -signal.SIGKILL
        # No stale lock holds up the next prepare, which sweeps the dead run's staging directory.
        after = pretrain(
            ["data", "prepare", f"--set=data.corpus={small}", f"--set=data.dataset_dir={ds}", "--force"],
            tmp_path,
        )
        assert after.returncode == 0 and "another prepare" not in after.stderr, after.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl", "ds", "small.jsonl"]
        return
    assert run.returncode == 128 + sig, err
    what = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert err == (
        f"interrupted ({what}): data prepare stopped; {ds} still holds the dataset it held before, and nothing "
        "of this run is left\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "big.jsonl",
        "ds",
        "small.jsonl",
    ]  # no staging, no lock


# ---------------------------------------------------------------------------------------------
# 4. A Hugging Face dataset's own validation split


def test_a_datasets_own_validation_split_is_val_given_as_a_path_or_as_hf_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    train = [f"train document {i}: " + "to be or not to be " * (1 + i % 5) for i in range(60)]
    val = [f"held-out document {i}, quite unlike" for i in range(8)]
    dd = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": train}),
            "validation": datasets.Dataset.from_dict({"text": val}),
        }
    ).save_to_disk(str(dd))
    logs: list[str] = []
    a = prepare(DataConfig(corpus=str(dd), dataset_dir=str(tmp_path / "a")), log=logs.append)
    m = load_manifest(a)
    assert (sum(s["n_docs"] for s in m["train"]), sum(s["n_docs"] for s in m["val"])) == (60, 8)
    tok = load_tokenizer(a / "tokenizer.json")
    assert tok.decode(open_shard(a / "val_00000.bin").tolist()) == "".join(val)
    assert "val: the dataset's own 'validation' split (1 file); train: all of 'train'" in "\n".join(logs)
    assert (
        m["report"]["notes"][0] == "val is the dataset's own 'validation' split (data.val_fraction not used)"
    )
    # the same dataset as hf:PATH: the same shards (and for a saved Dataset, split by name, too)
    b = prepare(DataConfig(corpus=f"hf:{dd}", dataset_dir=str(tmp_path / "b")))
    assert {k: v for k, v in files(a).items() if k != "manifest.json"} == {
        k: v for k, v in files(b).items() if k != "manifest.json"
    }
    datasets.Dataset.from_dict({"text": train}).save_to_disk(str(tmp_path / "one"))
    c = prepare(DataConfig(corpus=str(tmp_path / "one"), dataset_dir=str(tmp_path / "c")))
    d = prepare(DataConfig(corpus=f"hf:{tmp_path / 'one'}", dataset_dir=str(tmp_path / "d")))
    assert open_shard(c / "val_00000.bin").tobytes() == open_shard(d / "val_00000.bin").tobytes()
    # one prepared from hf:PATH before both were named alike is still this dataset (a no-op)
    then = input_fingerprint(DataConfig(corpus=f"hf:{tmp_path / 'one'}"))
    assert then["legacy_digest"] != then["digest"]
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["inputs"]["digest"] = then["legacy_digest"]
    (d / "manifest.json").write_text(json.dumps(manifest))
    before = files(d)
    assert (
        prepare(DataConfig(corpus=f"hf:{tmp_path / 'one'}", dataset_dir=str(d))) == d and files(d) == before
    )
    # `load_dataset` of a directory with train and validation files: its validation split, streamed or not
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, texts in (("train", train), ("validation", val)):
        (repo / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    e = prepare(DataConfig(corpus=f"hf:{repo}", dataset_dir=str(tmp_path / "e")))
    f = prepare(DataConfig(corpus=f"hf:{repo}", hf_streaming=True, dataset_dir=str(tmp_path / "f")))
    assert tok.decode(open_shard(e / "val_00000.bin").tolist()) == "".join(val)
    assert {k: v for k, v in files(e).items() if k != "manifest.json"} == {
        k: v for k, v in files(f).items() if k != "manifest.json"
    }
    # a dataset prepared before this rule (no "val" in its inputs) is still found, and says so
    manifest = json.loads((a / "manifest.json").read_text())
    del manifest["inputs"]["val"]
    (a / "manifest.json").write_text(json.dumps(manifest))
    logs.clear()
    assert prepare(DataConfig(corpus=str(dd), dataset_dir=str(tmp_path / "a")), log=logs.append) == a
    assert logs[0].startswith(f"note: {a} was prepared before a dataset's own validation split was used")
    assert "already prepared" in logs[1]


# ---------------------------------------------------------------------------------------------
# 5. A vocabulary of one token


def test_a_one_character_corpus_is_refused_at_prepare_and_an_old_one_at_train(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("a" * 5000)
    out = pretrain(["data", "prepare", f"--set=data.corpus={tmp_path / 'a.txt'}"], tmp_path)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stderr == (
        f"error: {tmp_path / 'a.txt'}: would make a char tokenizer of 1 token (the corpus holds only 'a'): a "
        "model needs a vocabulary of at least 2 to learn anything (with one token every prediction is right: "
        "loss 0); use a corpus of at least 2 distinct characters, or data.tokenizer=gpt2 or bpe\n"
    )
    assert not (tmp_path / "data").exists()
    # A dataset of vocab 1 prepared before this check: `train` refuses it before any step.
    ds = tmp_path / "old"
    ds.mkdir()
    cfg = DataConfig(corpus=str(tmp_path / "a.txt"), dataset_dir=str(ds))
    tok = CharTokenizer(["a"])
    shards = {
        split: [write_shard(ds / f"{split}_00000.bin", np.zeros(n, dtype=np.uint16), n_docs=1)]
        for split, n in (("train", 4500), ("val", 500))
    }
    tok.save(ds / "tokenizer.json")
    write_manifest(
        ds, tokenizer=tok, shards=shards, config=output_config(cfg), inputs=input_fingerprint(cfg), report={}
    )
    train = pretrain(
        ["train", f"--set=data.corpus={tmp_path / 'a.txt'}", f"--set=data.dataset_dir={ds}", *TINY_MODEL,
         "--set=schedule.max_steps=2", f"--set=logging.run_dir={tmp_path / 'run'}"],
        tmp_path,
    )  # fmt: skip
    assert train.returncode == 2 and "Traceback" not in train.stderr, train.stderr
    assert train.stderr.strip().splitlines()[-1] == (
        f"error: {ds}: prepared with a char tokenizer of 1 token: a model needs a vocabulary of at least 2 to "
        "learn anything (with one token every prediction is right: loss 0); use a corpus of at least 2 distinct "
        "characters, or data.tokenizer=gpt2 or bpe, and prepare it again (`pretrain data prepare --force`)"
    )
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# 6. A deleted shard: rebuilt, said so, and the resumed run continues its data order


def test_a_deleted_val_shard_is_rebuilt_said_so_and_resume_continues(tmp_path: Path) -> None:
    ds, run_dir = tmp_path / "ds", tmp_path / "run"
    corpus = write_corpus(tmp_path / "c.jsonl", 300)
    common = [f"--set=data.corpus={corpus}", f"--set=data.dataset_dir={ds}", *TINY_MODEL,
              f"--set=logging.run_dir={run_dir}"]  # fmt: skip
    first = pretrain(["train", *common, "--set=schedule.max_steps=2"], tmp_path)
    assert first.returncode == 0, first.stderr
    val = (ds / "val_00000.bin").read_bytes()
    (ds / "val_00000.bin").unlink()
    second = pretrain(["train", *common, "--set=schedule.max_steps=2", "--resume"], tmp_path)
    assert second.returncode == 0, second.stderr
    assert (
        f"warning: {ds}: val_00000.bin listed in its manifest but missing; rebuilding the dataset from its "
        "corpus, with the same settings\n" in second.stderr
    )
    assert (
        f"{ds}: rebuilt byte for byte: every shard is the one listed before (a resumed run continues its data "
        "order)\n" in second.stderr
    )
    assert "trained on another prepared dataset" not in second.stdout + second.stderr
    assert (ds / "val_00000.bin").read_bytes() == val


def test_what_a_run_trains_on_is_its_tokens_not_the_manifests_timings(tmp_path: Path) -> None:
    """The sum a checkpoint keeps of its data (checked on resume): a rebuild with the same tokens keeps
    it, whatever the report's timings; a checkpoint's older sum (the manifest's bytes) still matches."""
    cfg = DataConfig(corpus=str(write_corpus(tmp_path / "c.jsonl", 100)), dataset_dir=str(tmp_path / "ds"))
    prepare(cfg)
    one = open_datasets(cfg)[0]
    older = hashlib.sha256((one.dir / "manifest.json").read_bytes() + b"\n1.0\n").hexdigest()
    assert same_data(older, [one])
    sha = datasets_sha256([one])
    prepare(cfg, force=True)  # this process's own reader lock does not keep out its own rebuild
    two = open_datasets(cfg)[0]
    assert datasets_sha256([two]) == sha and same_data(sha, [two]) and not same_data("0" * 64, [two])
    prepare(cfg.model_copy(update={"seed": 5}), force=True)
    assert datasets_sha256(open_datasets(cfg.model_copy(update={"seed": 5}))) != sha


# ---------------------------------------------------------------------------------------------
# 7. The dataset directory's name and links


def test_a_250_character_dataset_dir_name_is_prepared_locked_and_rebuilt(tmp_path: Path) -> None:
    """The staging directory, the lock and the old copy beside it had the name plus a prefix and a
    suffix, past the 255 bytes a name may have: the prepare failed, and the lock was silently none."""
    corpus = write_corpus(tmp_path / "c.jsonl", 20)
    ds = tmp_path / ("d" * 250)
    args = ["data", "prepare", f"--set=data.corpus={corpus}", f"--set=data.dataset_dir={ds}"]
    done = pretrain(args, tmp_path)
    assert done.returncode == 0 and f"dataset ready in {ds}" in done.stdout, done.stderr
    cfg = DataConfig(corpus=str(corpus), dataset_dir=str(ds))
    open_datasets(cfg)  # this process reads it: its lock is held, so a rebuild is refused
    try:
        forced = pretrain([*args, "--force"], tmp_path)
        assert forced.returncode == 2 and f"in use by a run that reads it (pid {os.getpid()}" in forced.stderr
    finally:
        stop_reading(ds)
    forced = pretrain([*args, "--force"], tmp_path)
    assert forced.returncode == 0 and "rebuilt byte for byte" in forced.stdout, forced.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", ds.name]  # nothing left beside


def test_a_linked_dataset_dir_is_written_through_the_link_which_is_kept(tmp_path: Path) -> None:
    """`--force` replaced the link with a directory beside it (and left the link as `.ds.old-PID`):
    the dataset now goes to the directory the link points to, on its disk, and the link stays."""
    corpus = write_corpus(tmp_path / "c.jsonl", 20)
    (tmp_path / "big").mkdir()
    (tmp_path / "ds").symlink_to(tmp_path / "big" / "ds")  # to a directory not made yet
    args = ["data", "prepare", f"--set=data.corpus={corpus}", f"--set=data.dataset_dir={tmp_path / 'ds'}"]
    for extra in ([], ["--force"]):
        done = pretrain(args + extra, tmp_path)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "ds").is_symlink() and (tmp_path / "big" / "ds" / "manifest.json").is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "c.jsonl", "ds"]
        assert [p.name for p in (tmp_path / "big").iterdir()] == ["ds"]
    (tmp_path / "gone").symlink_to(tmp_path / "unmounted" / "ds")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for link, why in (
        ("gone", f"whose directory {tmp_path / 'unmounted'} does not exist"),
        ("loop", "cannot be resolved"),
    ):
        done = pretrain([*args, f"--set=data.dataset_dir={tmp_path / link}"], tmp_path)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and why in done.stderr, done.stderr


def test_the_lock_file_goes_with_the_last_reader_and_a_killed_readers_with_the_next(tmp_path):
    from pretrain.data.dataset import dataset_lock

    ds = tmp_path / "ds"
    ds.mkdir()
    lock_file = dataset_lock(ds).path
    hold = (
        "import sys, time; from pathlib import Path; from pretrain.data.dataset import dataset_lock; "
        "dataset_lock(Path(sys.argv[1])).acquire(exclusive=False); print('held', flush=True); time.sleep(60)"
    )
    other = subprocess.Popen([sys.executable, "-c", hold, str(ds)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdout.readline() == "held\n"
        mine = dataset_lock(ds)
        assert mine.acquire(exclusive=False)
        mine.release()  # another reader holds it: the file stays for it
        assert lock_file.is_file()
    finally:
        other.kill()  # kill -9: the kernel drops its lock, the file is left
        other.wait()
    assert lock_file.is_file() and lock_file.read_text() == ""
    later = dataset_lock(ds)
    assert later.acquire(exclusive=True)  # a killed reader's file holds nothing up
    later.release()
    assert not lock_file.exists()  # and the next one to drop the lock removes it
