"""A prepared dataset, as runs and tools read it: its file names, its manifest, its shards, and
the one rule for a model's vocabulary size.

A dataset directory (written by prepare.py) holds `manifest.json` (the tokenizer, every shard with
its token count and sha256, the data config and a report), `tokenizer.json`, and the shards
`train_NNNNN.bin` / `val_NNNNN.bin` (shards.py). The manifest is written last: a directory
without one is not a dataset.

Beside the directory (not in it: it is swapped whole) `.NAME.lock` is the dataset's OS lock:
`prepare` holds it exclusively while it rebuilds the dataset, and a run that reads the dataset
holds it shared from `open_datasets` until it exits, so that no prepare swaps the shards under a
running run, and no run opens a half-swapped directory.
"""

from __future__ import annotations

import atexit
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.config.mix import Weight
from pretrain.config.tree import DataConfig, RunConfig
from pretrain.data.shards import ShardInfo, dtype_for_vocab, read_header
from pretrain.data.tokenizer import GPT2_VOCAB_SIZE, HFTokenizer, Tokenizer
from pretrain.errors import ConfigError, DataError
from pretrain.files import FileLock, short_name, write_atomic

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
# The vocabulary of a char-level model before its data is prepared: tiny-shakespeare's 65 characters.
CHAR_VOCAB_GUESS = 65
# The smallest vocabulary a model can learn anything from (ModelConfig.vocab_size's bound).
MIN_VOCAB = 2
PREPARE_LOCK_HOLDER = "pretrain data prepare"


# ---------------------------------------------------------------------------------------------
# The lock


def dataset_lock(dataset_dir: Path) -> FileLock:
    """The dataset's lock: `.NAME.lock` beside its (resolved) directory, which is swapped whole."""
    real = dataset_dir.resolve()
    return FileLock(real.parent / f".{short_name(real.name)}.lock", PREPARE_LOCK_HOLDER)


_READING: dict[Path, FileLock] = {}  # the datasets this process reads, locked shared until it exits


def _lock_for_reading(dataset_dir: Path) -> bool:
    """Lock the dataset shared for this process (True), unless it is already (False)."""
    key = dataset_dir.resolve()
    if key in _READING:
        return False
    lock = dataset_lock(dataset_dir)
    if not lock.acquire(exclusive=False):
        raise DataError(
            f"{dataset_dir}: being rebuilt right now by {lock.holder()}; a run started now would read a "
            "dataset that is being replaced: start it again once that has finished"
        )
    _READING[key] = lock
    return True


def stop_reading(dataset_dir: Path) -> None:
    """Drop this process's reader lock on the dataset (before this process rebuilds it)."""
    lock = _READING.pop(dataset_dir.resolve(), None)
    if lock is not None:
        lock.release()


@atexit.register
def _stop_reading_all() -> None:
    for key in list(_READING):
        _READING.pop(key).release()


def write_manifest(
    dataset_dir: str | Path,
    *,
    tokenizer: Tokenizer,
    shards: dict[str, list[ShardInfo]],
    config: dict[str, Any],
    inputs: dict[str, Any],
    report: dict[str, Any],
) -> None:
    """Write the manifest that `load_manifest` reads: the tokenizer, every split's shards, the
    output config, the inputs' fingerprint and prepare's report. Written last (atomically): its
    presence marks the directory a complete dataset."""
    manifest = {
        "version": MANIFEST_VERSION,
        "tokenizer": {
            "type": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
            "fingerprint": tokenizer.fingerprint(),
            "eot_token": tokenizer.eot_token,
            "dtype": dtype_for_vocab(tokenizer.vocab_size).name,
        },
        **{
            split: [
                {"path": s.path.name, "n_tokens": s.n_tokens, "n_docs": s.n_docs, "sha256": s.sha256}
                for s in shards[split]
            ]
            for split in SPLITS
        },
        "config": config,
        "inputs": inputs,
        "report": report,
    }
    write_atomic(Path(dataset_dir) / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def load_manifest(dataset_dir: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset, checked for shape."""
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{path}: not found; the dataset is missing or incomplete: run `pretrain data prepare` first"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(
            f"{path}: malformed manifest ({e}); rebuild it with `pretrain data prepare --force`"
        ) from e
    problems = _manifest_problems(manifest)
    if problems:
        raise DataError(
            f"{path}: malformed manifest: {'; '.join(problems)}; rebuild it with `pretrain data prepare --force`"
        )
    return manifest


def _manifest_problems(m: Any) -> list[str]:
    if not isinstance(m, dict):
        return ["not a JSON object"]
    if m.get("version") != MANIFEST_VERSION:
        return [f"version {m.get('version')!r}, this code reads version {MANIFEST_VERSION}"]
    problems = []
    tok = m.get("tokenizer")
    if not (isinstance(tok, dict) and {"type", "vocab_size", "fingerprint"} <= tok.keys()):
        problems.append("'tokenizer' needs type, vocab_size and fingerprint")
    for split in SPLITS:
        entries = m.get(split)
        if not (isinstance(entries, list) and entries):
            problems.append(f"'{split}' must be a non-empty list of shards")
            continue
        for i, e in enumerate(entries):
            if not (isinstance(e, dict) and {"path", "n_tokens", "n_docs", "sha256"} <= e.keys()):
                problems.append(f"'{split}'[{i}] needs path, n_tokens, n_docs and sha256")
    if not isinstance(m.get("config"), dict):
        problems.append("'config' must be an object")
    return problems


def shard_paths(dataset_dir: str | Path, split: str) -> list[Path]:
    """The shard files of one split ('train' or 'val') of a prepared dataset, in order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [Path(dataset_dir) / e["path"] for e in load_manifest(dataset_dir)[split]]


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset as a run uses it: its directory, manifest and blend weight (fixed, or a
    schedule of (tokens, weight) points: config/mix.py)."""

    dir: Path
    manifest: dict[str, Any]
    weight: Weight = 1.0

    def shard_paths(self, split: str) -> list[Path]:
        return [self.dir / e["path"] for e in self.manifest[split]]

    def n_tokens(self, split: str) -> int:
        return sum(int(e["n_tokens"]) for e in self.manifest[split])


def dataset_dirs(cfg: DataConfig) -> list[Path]:
    """The prepared datasets a run reads: its blend's, or the one prepared from its corpus."""
    return [Path(b.dataset_dir) for b in cfg.blend] or [cfg.resolved_dir()]


def open_datasets(cfg: DataConfig) -> list[Dataset]:
    """The datasets a run trains on (data.blend, or the one prepared from data.corpus), each
    checked against this config's tokenizer and against its own shards' headers."""
    weights: list[Weight] = [b.weight for b in cfg.blend] or [1.0]
    dirs = dataset_dirs(cfg)
    locked = [d for d in dirs if _lock_for_reading(d)]  # until this process exits: no prepare swaps them
    try:
        datasets = _checked(
            cfg, [Dataset(d, load_manifest(d), w) for d, w in zip(dirs, weights, strict=True)]
        )
    except BaseException:
        for d in locked:
            stop_reading(d)
        raise
    return datasets


def _checked(cfg: DataConfig, datasets: list[Dataset]) -> list[Dataset]:
    """`datasets`, each checked against `cfg`'s tokenizer, the first one's, and its shards' headers."""
    first = datasets[0]
    for ds in datasets:
        where = ds.dir / MANIFEST
        tok = ds.manifest["tokenizer"]
        if int(tok["vocab_size"]) < MIN_VOCAB:
            raise DataError(
                too_small_vocab(
                    f"{ds.dir}: prepared with", tok["type"], int(tok["vocab_size"]), prepared=True
                )
            )
        if tok["type"] != cfg.tokenizer:
            raise DataError(
                f"{where}: prepared with the {tok['type']} tokenizer (vocab {tok['vocab_size']}), "
                f"but data.tokenizer is {cfg.tokenizer}"
            )
        if cfg.tokenizer == "bpe" and tok["vocab_size"] != cfg.bpe_vocab_size:
            raise DataError(
                f"{where}: prepared with a bpe vocab of {tok['vocab_size']}, but data.bpe_vocab_size is "
                f"{cfg.bpe_vocab_size}"
            )
        ref = first.manifest["tokenizer"]
        if (tok["vocab_size"], tok["fingerprint"]) != (ref["vocab_size"], ref["fingerprint"]):
            raise DataError(
                f"{where}: its {tok['type']} tokenizer (vocab {tok['vocab_size']}, fingerprint "
                f"{tok['fingerprint'][:12]}) differs from {first.dir / MANIFEST}'s (vocab {ref['vocab_size']}, "
                f"fingerprint {ref['fingerprint'][:12]}): blended datasets need one tokenizer"
            )
        for split in SPLITS:
            for e in ds.manifest[split]:
                info = read_header(ds.dir / e["path"])
                if (info.n_tokens, info.sha256) != (e["n_tokens"], e["sha256"]):
                    raise DataError(
                        f"{info.path}: header says {info.n_tokens} tokens, sha256 {info.sha256[:12]}; the manifest "
                        f"lists {e['n_tokens']} tokens, sha256 {e['sha256'][:12]}: not this dataset's shard"
                    )
    return datasets


def summary(manifest: dict[str, Any]) -> str:
    """One line about a prepared dataset."""
    counts = ", ".join(
        f"{split} {sum(s['n_tokens'] for s in manifest[split]):,} tokens / "
        f"{sum(s['n_docs'] for s in manifest[split]):,} docs in {len(manifest[split])} shard"
        f"{'s' if len(manifest[split]) != 1 else ''}"
        for split in SPLITS
    )
    tok = manifest["tokenizer"]
    return f"{counts}, vocab {tok['vocab_size']} ({tok['type']}, {tok.get('dtype', '?')})"


def too_small_vocab(
    where: str, kind: str, vocab: int, chars: list[str] | None = None, *, prepared: bool = False
) -> str:
    """The one message for a vocabulary a model cannot learn from (fewer than MIN_VOCAB tokens)."""
    held = f" (the corpus holds only {', '.join(repr(c) for c in chars)})" if chars else ""
    return (
        f"{where} a {kind} tokenizer of {vocab} token{'s' if vocab != 1 else ''}{held}: a model needs a "
        f"vocabulary of at least {MIN_VOCAB} to learn anything (with one token every prediction is right: "
        f"loss 0); use a corpus of at least {MIN_VOCAB} distinct characters, or data.tokenizer=gpt2 or bpe"
        + (", and prepare it again (`pretrain data prepare --force`)" if prepared else "")
    )


def datasets_sha256(datasets: list[Dataset]) -> str:
    """What a run trains on: every dataset's tokenizer, its shards (name, counts, sha256) and its
    blend weight or schedule (a fixed weight hashes as it always has), from the manifest the run opened. Not the manifest's bytes: a dataset rebuilt
    byte for byte (a deleted shard) has other timings in its report, and the same tokens."""
    h = hashlib.sha256()
    for d in datasets:
        m = d.manifest
        tok = {k: m["tokenizer"].get(k) for k in ("type", "vocab_size", "fingerprint", "eot_token")}
        shards = {
            split: [[e["path"], int(e["n_tokens"]), int(e["n_docs"]), e["sha256"]] for e in m[split]]
            for split in SPLITS
        }
        h.update(
            json.dumps({"tokenizer": tok, **shards, "weight": d.weight}, sort_keys=True).encode() + b"\n"
        )
    return h.hexdigest()


def same_data(saved_sha256: str, datasets: list[Dataset]) -> bool:
    """Whether a checkpoint's `datasets_sha256` names these datasets: by their tokens, or (a
    checkpoint saved before that rule) by their manifests' bytes."""
    if saved_sha256 == datasets_sha256(datasets):
        return True
    h = hashlib.sha256()
    try:
        for d in datasets:
            h.update((d.dir / MANIFEST).read_bytes() + f"\n{d.weight!r}\n".encode())
    except OSError:
        return False
    return saved_sha256 == h.hexdigest()


# ---------------------------------------------------------------------------------------------
# The vocabulary size


def vocab_size(cfg: RunConfig) -> tuple[int, str]:
    """model.vocab_size as a run will resolve it, and where it comes from: the config if set; else
    the prepared dataset's tokenizer; else, before the data is prepared, `tokenizer_vocab_size`."""
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size, "model.vocab_size"
    d = cfg.data
    path = dataset_dirs(d)[0] / MANIFEST
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["tokenizer"]["vocab_size"]), str(path)
    except (OSError, ValueError, KeyError, TypeError):
        return tokenizer_vocab_size(d), f"{d.tokenizer} tokenizer default (data not prepared)"


def tokenizer_vocab_size(cfg: DataConfig) -> int:
    """The vocabulary of `cfg`'s tokenizer before any data is prepared: GPT-2's 50257,
    data.bpe_vocab_size, or 65 characters (tiny-shakespeare's) for char."""
    if cfg.tokenizer == "hf" and cfg.tokenizer_path is not None:
        return HFTokenizer.from_path(cfg.tokenizer_path).vocab_size
    return {"gpt2": GPT2_VOCAB_SIZE, "bpe": cfg.bpe_vocab_size, "char": CHAR_VOCAB_GUESS}[cfg.tokenizer]


def resolve_vocab(cfg: RunConfig, tokenizer_vocab: int | None = None) -> RunConfig:
    """`cfg` with model.vocab_size filled: from `tokenizer_vocab` (the tokenizer a run loaded), or
    by `vocab_size`'s rule. A smaller explicit value would index out of range: an error."""
    vocab = cfg.model.vocab_size
    if tokenizer_vocab is None:
        tokenizer_vocab = vocab_size(cfg)[0]
    if tokenizer_vocab < MIN_VOCAB:
        raise DataError(
            too_small_vocab(
                f"{dataset_dirs(cfg.data)[0]}: prepared with",
                cfg.data.tokenizer,
                tokenizer_vocab,
                prepared=True,
            )
        )
    if vocab is None:
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": tokenizer_vocab})})
    if vocab < tokenizer_vocab:
        raise ConfigError([f"model.vocab_size ({vocab}) is smaller than the tokenizer's ({tokenizer_vocab})"])
    return cfg
