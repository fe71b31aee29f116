"""The work directory of a prepare as tasks (tasks.py): its files, each whole or absent, and the
hand-offs between its stages in formats that are checked on read, never pickle.

- JSON files (a task's list of units, the setup, a task's stats, a write task's shards) carry a
  header: a format name, a version and the sha256 of their body, verified when they are read.
- Arrays are .npy files, read with allow_pickle=False; raw token and signature files are checked
  against the size their task's table gives them.
- The tokenizer travels as the dataset's own tokenizer file (GPT-2 as its rank file, so no task
  fetches it), and its fingerprint is checked when a task loads it.

A file that fails its check names itself and the fix (a fresh prepare) in one DataError.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shutil
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.config.tree import CleanConfig
from pretrain.data.chunks import Chunk
from pretrain.data.clean import CleanStats
from pretrain.data.encode import Setup
from pretrain.data.shards import ShardInfo
from pretrain.data.sources import InputFile
from pretrain.data.tokenizer import TiktokenTokenizer, Tokenizer, load_tokenizer
from pretrain.errors import DataError
from pretrain.files import short_name

FORMAT = "pretrain-task-file"
FORMAT_VERSION = 1
GPT2_RANKS = "gpt2.tiktoken"
TOKENIZER = "tokenizer.json"


def work_dir(out: Path) -> Path:
    real = Path(os.path.realpath(out))
    return real.with_name(f".{short_name(real.name)}.tasks")


def open_work(work: Path, key: str) -> None:
    """`work` holds the tasks of `key` (kept from an earlier try), or is made afresh."""
    marker = work / "key"
    if marker.is_file() and marker.read_text() == key:
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    atomic_bytes(marker, key.encode())


def task_dir(work: Path, stage: str, rank: int) -> Path:
    return work / stage / f"t{rank:05d}"


def _tmp(path: Path, suffix: str = "") -> Path:
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}{suffix}")


def atomic_bytes(path: Path, data: bytes) -> None:
    tmp = _tmp(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_npy(path: Path, array: np.ndarray) -> None:
    tmp = _tmp(path, ".npy")
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def load_npy(path: Path, *, mmap: bool = False) -> np.ndarray:
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise _damaged(path, f"not a whole .npy array ({e})") from None


def raw_array(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A raw file of `shape` values of `dtype`, read in place once its size is checked."""
    want = int(np.prod(shape)) * dtype.itemsize
    size = path.stat().st_size if path.is_file() else -1
    if size != want:
        raise _damaged(path, f"{size} bytes where its task's table gives {want}")
    if want == 0:
        return np.empty(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


@contextlib.contextmanager
def building(done: Path) -> Iterator[Path | None]:
    """A task's directory built beside `done` and renamed to it when whole; None: done already."""
    if done.is_dir():
        yield None
        return
    tmp = _tmp(done)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            os.rename(tmp, done)
        except OSError:
            if not done.is_dir():
                raise  # else another try of the same task (a requeued job) won: the same bytes
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# JSON with a checked header


def _digest(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def save_json(path: Path, body: Any) -> None:
    head = {"format": FORMAT, "version": FORMAT_VERSION, "sha256": _digest(body), "body": body}
    atomic_bytes(path, json.dumps(head, sort_keys=True).encode())


def load_json(path: Path) -> Any:
    try:
        head = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise _damaged(path, f"not readable JSON ({e})") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("version") != FORMAT_VERSION:
        raise _damaged(path, f"not a {FORMAT} file of version {FORMAT_VERSION}")
    if _digest(head.get("body")) != head.get("sha256"):
        raise _damaged(path, "its body does not match its sha256")
    return head["body"]


def _damaged(path: Path, why: str) -> DataError:
    return DataError(
        f"{path}: {why}; this file of an earlier try of the prepare is damaged: remove the directory "
        f"{path.parent} (or the whole work directory it is in) and run the prepare again"
    )


# ---------------------------------------------------------------------------------------------
# What the files hold: units, setup and tokenizer, stats, shards


@dataclass(frozen=True)
class Unit:
    """A piece of the corpus one task reads: its chunks, or a compressed file it decompresses."""

    chunks: tuple[Chunk, ...] = ()
    file: InputFile | None = None


def _plain(obj: Any) -> dict[str, Any]:
    return {
        f.name: str(v) if isinstance(v, Path) else v
        for f in fields(obj)
        if (v := getattr(obj, f.name)) is not None
    }


def save_units(path: Path, units: list[Unit]) -> None:
    """A task's units; a chunk of the plan holds no bytes or texts (those are read by its task)."""
    body = [
        {"file": _plain(u.file)} if u.file is not None else {"chunks": [_plain(c) for c in u.chunks]}
        for u in units
    ]
    save_json(path, body)


def load_units(path: Path) -> list[Unit]:
    try:
        return [
            Unit(file=InputFile(**{**u["file"], "path": Path(u["file"]["path"])}))
            if "file" in u
            else Unit(chunks=tuple(Chunk(**{**c, "path": Path(c["path"])}) for c in u["chunks"]))
            for u in load_json(path)
        ]
    except (TypeError, KeyError) as e:
        raise _damaged(path, f"not a list of units ({e})") from None


def save_setup(work: Path, setup: Setup) -> None:
    """The setup every encode task reads, its tokenizer beside it."""
    tok = setup.tokenizer
    assert tok is not None
    if isinstance(tok, TiktokenTokenizer) and tok.kind == "gpt2":
        ranks = sorted(tok.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        atomic_bytes(work / GPT2_RANKS, b"".join(base64.b64encode(t) + b" %d\n" % r for t, r in ranks))
    else:
        tok.save(work / TOKENIZER)
    body = {
        "clean": setup.clean.model_dump(mode="json"),
        "text_field": setup.text_field,
        "seed": setup.seed,
        "val_fraction": setup.val_fraction,
        "dtype": setup.dtype,
        "tokenizer": tok.fingerprint(),
    }
    save_json(work / "setup.json", body)


def load_setup(work: Path) -> Setup:
    body = load_json(work / "setup.json")
    tok: Tokenizer = (
        TiktokenTokenizer(work / GPT2_RANKS)
        if (work / GPT2_RANKS).is_file()
        else load_tokenizer(work / TOKENIZER)
    )
    if tok.fingerprint() != body["tokenizer"]:
        raise _damaged(
            work / "setup.json",
            f"its tokenizer is {body['tokenizer']}, the one beside it {tok.fingerprint()}",
        )
    clean = CleanConfig.model_validate(body["clean"])
    return Setup(clean, body["text_field"], body["seed"], body["val_fraction"], tok, body["dtype"])


def save_stats(path: Path, stats: CleanStats, cpu: float) -> None:
    save_json(path, {"stats": asdict(stats), "cpu": cpu})


def load_stats(path: Path) -> tuple[CleanStats, float]:
    body = load_json(path)
    return CleanStats(**body["stats"]), float(body["cpu"])


def save_shards(path: Path, shards: dict[str, list[ShardInfo]]) -> None:
    """A write task's shards, by name (they sit beside this file until moved into the dataset)."""
    body = {
        split: [
            {
                "name": i.path.name,
                "dtype": i.dtype.name,
                "n_tokens": i.n_tokens,
                "n_docs": i.n_docs,
                "sha256": i.sha256,
            }
            for i in infos
        ]
        for split, infos in shards.items()
    }
    save_json(path, body)


def load_shards(path: Path) -> dict[str, list[ShardInfo]]:
    return {
        split: [
            ShardInfo(path.parent / e["name"], np.dtype(e["dtype"]), e["n_tokens"], e["n_docs"], e["sha256"])
            for e in entries
        ]
        for split, entries in load_json(path).items()
    }
