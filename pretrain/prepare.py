"""Prepare a dataset: corpus → tokenizer → train/val shards + manifest, in `cfg.resolved_dir()`.

The directory holds train.bin, val.bin, tokenizer.json and manifest.json. The manifest is
written last and atomically, so a directory without one is incomplete and gets rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.config import DataConfig
from pretrain.corpus import DataError, iter_documents
from pretrain.shards import ShardInfo, dtype_for_vocab, write_shard
from pretrain.tokenizer import CharTokenizer, TiktokenTokenizer, Tokenizer

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")


def is_val_document(name: str, seed: int, val_fraction: float) -> bool:
    """A document's split: sha256 of (seed, name) read as a uniform number in [0, 1)."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < val_fraction


def split_documents(names: list[str], seed: int, val_fraction: float) -> set[str]:
    """The names of the validation documents (of two or more), with each split non-empty."""
    val = {n for n in names if is_val_document(n, seed, val_fraction)}
    last = max(names)
    if not val:
        val.add(last)
    elif len(val) == len(names):
        val.discard(last)
    return val


def prepare(cfg: DataConfig, force: bool = False) -> Path:
    """Build the dataset for `cfg` unless the directory already holds it; return its path."""
    out = cfg.resolved_dir()
    config = cfg.model_dump(mode="json")
    if (out / MANIFEST).exists() and not force:
        manifest = load_manifest(out)
        if manifest["config"] != config:
            changed = sorted(
                k
                for k in config.keys() | manifest["config"].keys()
                if config.get(k) != manifest["config"].get(k)
            )
            raise DataError(
                f"{out}: holds a dataset prepared with a different data config (differs in: {', '.join(changed)}); "
                "run `pretrain prepare --force` to overwrite it, or set another data.dataset_dir"
            )
        listed = [out / s["path"] for split in SPLITS for s in manifest[split]] + [out / TOKENIZER_FILE]
        if all(p.is_file() for p in listed):
            return out

    # Pass 1: document names (for the split) and, for the char tokenizer, the vocabulary.
    names: list[str] = []
    chars: set[str] = set()
    for name, text in iter_documents(cfg.corpus):
        names.append(name)
        if cfg.tokenizer == "char":
            chars.update(text)
    tok: Tokenizer = (
        CharTokenizer(sorted(chars)) if cfg.tokenizer == "char" else TiktokenTokenizer(cfg.tokenizer_path)
    )
    dtype = dtype_for_vocab(tok.vocab_size)
    eot = np.array([] if tok.eot_token is None else [tok.eot_token], dtype=dtype)

    # From here the directory is incomplete until the new manifest lands.
    (out / MANIFEST).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)

    # Pass 2: encode. The end-of-text token (gpt2) follows every document.
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    n_docs = {"train": 0, "val": 0}

    def add(split: str, text: str) -> None:
        parts[split] += [tok.encode_array(text).astype(dtype), eot]
        n_docs[split] += 1

    if len(names) == 1:
        # One document can't be split by document: cut it at (1 - val_fraction) of its
        # characters instead, nanoGPT's recipe for tiny-shakespeare (first 90% train, last 10% val).
        ((_, text),) = iter_documents(cfg.corpus)
        cut = int(len(text) * (1 - cfg.val_fraction))
        if not 0 < cut < len(text):
            raise DataError(
                f"{cfg.corpus}: its one document ({len(text)} characters) is too short to split into train and val"
            )
        add("train", text[:cut])
        add("val", text[cut:])
    else:
        val_names = split_documents(names, cfg.seed, cfg.val_fraction)
        for name, text in iter_documents(cfg.corpus):
            add("val" if name in val_names else "train", text)

    shards: dict[str, ShardInfo] = {}
    for split in SPLITS:
        shards[split] = write_shard(out / f"{split}.bin", np.concatenate(parts[split]), n_docs[split])
        parts[split].clear()
    tok.save(out / TOKENIZER_FILE)
    manifest = {
        "version": MANIFEST_VERSION,
        "tokenizer": {"type": tok.kind, "vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint()},
        **{
            split: [
                {"path": s.path.name, "n_tokens": s.n_tokens, "n_docs": s.n_docs, "sha256": s.sha256}
                for s in [shards[split]]
            ]
            for split in SPLITS
        },
        "config": config,
    }
    _write_atomic(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_manifest(dataset_dir: str | Path) -> dict[str, Any]:
    """The manifest of a prepared dataset, checked for shape."""
    path = Path(dataset_dir) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{path}: not found; the dataset is missing or incomplete: run `pretrain prepare` first"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(
            f"{path}: malformed manifest ({e}); rebuild it with `pretrain prepare --force`"
        ) from e
    problems = _manifest_problems(manifest)
    if problems:
        raise DataError(
            f"{path}: malformed manifest: {'; '.join(problems)}; rebuild it with `pretrain prepare --force`"
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
