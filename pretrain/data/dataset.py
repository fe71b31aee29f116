"""A prepared dataset, as runs and tools read it: its file names, its manifest, its shards, and
the one rule for a model's vocabulary size.

A dataset directory (written by prepare.py) holds `manifest.json` (the tokenizer, every shard with
its token count and sha256, the data config and a report), `tokenizer.json`, and the shards
`train_NNNNN.bin` / `val_NNNNN.bin` (shards.py). The manifest is written last: a directory
without one is not a dataset.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.config.tree import DataConfig, RunConfig
from pretrain.data.shards import ShardInfo, dtype_for_vocab, read_header
from pretrain.data.tokenizer import GPT2_VOCAB_SIZE, Tokenizer
from pretrain.errors import ConfigError, DataError
from pretrain.files import write_atomic

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
# The vocabulary of a char-level model before its data is prepared: tiny-shakespeare's 65 characters.
CHAR_VOCAB_GUESS = 65


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
    """A prepared dataset as a run uses it: its directory, manifest and blend weight."""

    dir: Path
    manifest: dict[str, Any]
    weight: float = 1.0

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
    weights = [b.weight for b in cfg.blend] or [1.0]
    datasets = [Dataset(d, load_manifest(d), w) for d, w in zip(dataset_dirs(cfg), weights, strict=True)]
    first = datasets[0]
    for ds in datasets:
        where = ds.dir / MANIFEST
        tok = ds.manifest["tokenizer"]
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


def datasets_sha256(datasets: list[Dataset]) -> str:
    """What a run trains on: every dataset's manifest (shards with their sha256) and blend weight."""
    h = hashlib.sha256()
    for d in datasets:
        h.update((d.dir / MANIFEST).read_bytes() + f"\n{d.weight!r}\n".encode())
    return h.hexdigest()


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
    return {"gpt2": GPT2_VOCAB_SIZE, "bpe": cfg.bpe_vocab_size, "char": CHAR_VOCAB_GUESS}[cfg.tokenizer]


def resolve_vocab(cfg: RunConfig, tokenizer_vocab: int | None = None) -> RunConfig:
    """`cfg` with model.vocab_size filled: from `tokenizer_vocab` (the tokenizer a run loaded), or
    by `vocab_size`'s rule. A smaller explicit value would index out of range: an error."""
    vocab = cfg.model.vocab_size
    if tokenizer_vocab is None:
        tokenizer_vocab = vocab_size(cfg)[0]
    if vocab is None:
        return cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": tokenizer_vocab})})
    if vocab < tokenizer_vocab:
        raise ConfigError([f"model.vocab_size ({vocab}) is smaller than the tokenizer's ({tokenizer_vocab})"])
    return cfg
