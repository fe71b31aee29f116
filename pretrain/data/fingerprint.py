"""Whether a dataset directory holds the dataset a config asks for, from these same input files.

A dataset is made by the settings that change its tokens (`output_config`) from input files known
by name and identity (`input_fingerprint`, walked without reading them); the manifest records both,
and `what_is_there` checks a directory's against this config's: the same dataset, complete; or
another one, named by what differs (`own_dir` gives it a directory of its own).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.config.tree import DataConfig
from pretrain.data.dataset import MANIFEST, SPLITS, TOKENIZER_FILE, load_manifest
from pretrain.data.sources import (
    DOWNLOADS,
    HF_PREFIX,
    HFOptions,
    format_of,
    is_saved_dataset,
    iter_input_files,
)
from pretrain.errors import DataError

# DataConfig fields that do not change what prepare writes (where inputs come from, how many
# workers; the loader's fields are a section of their own): a change in them keeps a prepared dataset valid.
NOT_OUTPUT_FIELDS = frozenset(
    {
        "source",
        "download_dir",
        "tokenizer_path",
        "workers",
        "chunk_bytes",
        "blend",  # the mix and its schedules: the run's (datasets_sha256 and the loader state record them)
        "dataset_dir",
        "hf_streaming",
        "executor",  # where the tasks run: the same dataset on every executor
        "slurm",
        "ray",
    }
)


# Recorded settings that cut a dataset into shards without changing its documents or tokens (with
# data.tasks, each task's run ends a shard; data.chunk_bytes cuts the runs): a finished dataset is
# read whatever they were. They stay in the manifest (and key a prepare's tasks, `work_key`), and are
# left out of what makes a dataset this one.
LAYOUT_FIELDS = ("tasks", "chunk_bytes")

# Output fields that older manifests lack: left out of the comparison while at their defaults.
_NEW_OUTPUT_DEFAULTS: dict[str, Any] = {"hf_config": None, "hf_split": "train", "tasks": None}


def output_config(cfg: DataConfig) -> dict[str, Any]:
    return {
        k: v
        for k, v in cfg.model_dump(mode="json").items()
        # An hf tokenizer's path is the tokenizer: another one gives other tokens. With data.tasks, the
        # chunks are the tasks' boundaries, and so the shards'.
        if (
            k not in NOT_OUTPUT_FIELDS
            or (k == "tokenizer_path" and cfg.tokenizer == "hf")
            or (k == "chunk_bytes" and cfg.tasks is not None)
        )
        and not (k in _NEW_OUTPUT_DEFAULTS and v == _NEW_OUTPUT_DEFAULTS[k])
    }


def input_files(cfg: DataConfig, *, with_val: bool = True) -> Iterator[Any]:
    """The input files; a Hugging Face dataset's own validation split too (`with_val`), last."""
    hf = HFOptions(cfg.hf_config, cfg.hf_split, cfg.hf_streaming, with_val=with_val)
    return iter_input_files(
        cfg.corpus, fmt=cfg.format, download_dir=cfg.download_dir, source=cfg.source, hf=hf
    )


def input_fingerprint(cfg: DataConfig, fetch: bool = True) -> dict[str, Any]:
    """Files, bytes, and a digest of every input file's name and identity (size and mtime, or
    the sha256 of a download), walked without reading them; a dataset's own validation split
    apart, under "val" (None: it has none). With fetch=False a downloadable corpus is not fetched:
    its digest is known from its sha256 alone (its bytes are then None), and a stream's splits are
    not looked up ("val" left out)."""
    h = hashlib.sha256()
    if not fetch and cfg.corpus in DOWNLOADS:
        d = DOWNLOADS[cfg.corpus]
        h.update(f"{d.filename}\0sha256:{d.sha256}\0{format_of(Path(d.filename), cfg.format)}\n".encode())
        return {"files": 1, "bytes": None, "digest": h.hexdigest()}
    legacy, val = hashlib.sha256(), hashlib.sha256()
    n, total, has_legacy, val_name, n_val, val_bytes = 0, 0, False, "", 0, 0
    looks_up_val = fetch or not (cfg.hf_streaming and cfg.corpus.startswith(HF_PREFIX))
    for f in input_files(cfg, with_val=looks_up_val):
        line = f"{f.name}\0{f.identity}\0{f.format}\n"
        if f.split == "val":
            val.update(line.encode())
            val_name, n_val, val_bytes = val_name or f.name, n_val + 1, val_bytes + f.size
            continue
        h.update(line.encode())
        legacy.update(f"{f.legacy_name or f.name}\0{f.identity}\0{f.format}\n".encode())
        has_legacy |= f.legacy_name is not None
        n += 1
        total += f.size
    out: dict[str, Any] = {"files": n, "bytes": total, "digest": h.hexdigest()}
    if has_legacy:
        out["legacy_digest"] = legacy.hexdigest()  # as named before: a dataset prepared then matches
    if looks_up_val and _is_hf(cfg.corpus):
        split = val_name[val_name.rfind("[") + 1 : -1] if val_name.endswith("]") else val_name
        out["val"] = (
            {"split": split, "files": n_val, "bytes": val_bytes, "digest": val.hexdigest()} if n_val else None
        )
    return out


def _is_hf(corpus: str) -> bool:
    """A Hugging Face dataset: hf:NAME, or a save_to_disk directory."""
    if corpus.startswith(HF_PREFIX):
        return True
    path = Path(os.path.expanduser(corpus))
    return path.is_dir() and is_saved_dataset(path)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"clean": {"near_dedup": True}} -> {"clean.near_dedup": True}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _corpus_key(corpus: Any) -> Any:
    """A saved dataset is the same corpus given as PATH or as hf:PATH."""
    if isinstance(corpus, str) and corpus.startswith(HF_PREFIX):
        path = Path(os.path.expanduser(corpus.removeprefix(HF_PREFIX)))
        if path.is_dir() and is_saved_dataset(path):
            return corpus.removeprefix(HF_PREFIX)
    return corpus


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """A recorded output config without its layout (`LAYOUT_FIELDS`): what makes a dataset this one."""
    return {k: v for k, v in config.items() if k not in LAYOUT_FIELDS}


def layout(config: dict[str, Any]) -> str:
    """How a recorded output config cut its shards, in words."""
    tasks = config.get("tasks")
    return "one host's stages (data.tasks unset)" if tasks is None else f"{tasks} tasks (data.tasks={tasks})"


def _config_changes(cfg: DataConfig, saved: dict[str, Any]) -> list[str]:
    """What differs between the settings that made the dataset there and this config's."""
    now, then, keys = _differing(cfg, saved)
    return [f"data.{k}: {json.dumps(then.get(k))} there, {json.dumps(now.get(k))} now" for k in keys]


def _differing(cfg: DataConfig, saved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """This config's identity and the recorded one, flat, and the keys where they differ."""
    now, then = _flat(identity(output_config(cfg))), _flat(identity(saved))
    now["corpus"], then["corpus"] = _corpus_key(now.get("corpus")), _corpus_key(then.get("corpus"))
    return now, then, sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))


def _repeat_flags(cfg: DataConfig, saved: dict[str, Any]) -> str:
    """The --set flags that give this config the recorded settings where they differ, or "" where one
    cannot be given (a corpus of other files, or a setting the recording lacks)."""
    _, then, keys = _differing(cfg, saved)
    flags = []
    for k in keys:
        if k == "corpus" or k not in then:
            return ""
        v = then[k]
        flags.append(f"--set data.{k}={v if isinstance(v, str) else json.dumps(v)}")
    return " ".join(flags)


def listed_changes(changes: list[str]) -> str:
    return "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")


def own_dir(cfg: DataConfig) -> Path:
    """A directory of its own for a dataset of these settings, beside the default one: its name
    ends in a short hash of the settings that make the tokens (`output_config`)."""
    out = cfg.resolved_dir()
    config = identity(output_config(cfg))
    config["corpus"] = _corpus_key(config["corpus"])
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:8]
    return out.with_name(f"{out.name}-{digest}")


def _input_change(cfg: DataConfig, was: dict[str, Any], now: dict[str, Any]) -> str | None:
    """How the corpus changed since the dataset was prepared from it, or None."""
    if was.get("digest") not in (now["digest"], now.get("legacy_digest")):
        return (
            f"the corpus {cfg.corpus} changed since it was prepared ({was.get('files')} files of "
            f"{was.get('bytes')} bytes then, {now['files']} files of {now['bytes']} bytes now)"
        )
    if "val" in now and "val" in was and (was["val"] or {}).get("digest") != (now["val"] or {}).get("digest"):
        split = (now["val"] or was["val"] or {}).get("split")
        return f"the validation split {split!r} of {cfg.corpus} changed since the dataset was prepared"
    return None


@dataclass
class There:
    """What `out` holds: a dataset (its manifest) or none, whether it is this one, complete, and
    otherwise why not (with `force`; without it a different dataset is an error)."""

    manifest: dict[str, Any] | None = None
    ready: bool = False
    missing: list[str] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)


def what_is_there(
    out: Path, cfg: DataConfig, inputs: dict[str, Any], *, force: bool, say: Callable[[str], None]
) -> There:
    """What `out` holds, checked against this config and input. Without `force`, a dataset made
    with other settings, or from a changed corpus, is a DataError naming the choices."""
    if not (out / MANIFEST).exists():
        return There()
    try:
        manifest = load_manifest(out)
    except DataError:
        if force:
            return There(changes=["its manifest is unreadable"])
        raise
    changes = _changes(out, cfg, manifest, inputs, force=force)
    was = manifest.get("inputs", {})
    if not changes and "val" in inputs and "val" not in was and inputs["val"]:
        say(
            f"note: {out} was prepared before a dataset's own validation split was used: its val is "
            f"documents of {cfg.hf_split!r} split off by data.val_fraction; `pretrain data prepare --force` "
            f"rebuilds it with the {inputs['val']['split']!r} split as val"
        )
    listed = [e["path"] for split in SPLITS for e in manifest[split]] + [TOKENIZER_FILE]
    missing = [p for p in listed if not (out / p).is_file()]
    then, now = layout(manifest["config"]), layout(output_config(cfg))
    if not changes and not missing and then != now:
        say(
            f"note: {out} was prepared as {then}; it is read as it is: how its shards were cut is not part "
            f"of what makes it this dataset (`pretrain data prepare --force` rebuilds it as {now})"
        )
    return There(manifest, not changes and not missing, missing, changes)


def _changes(
    out: Path, cfg: DataConfig, manifest: dict[str, Any], inputs: dict[str, Any], *, force: bool
) -> list[str]:
    """What makes the dataset in `out` another than this config's from these inputs: its settings,
    else its corpus. Without `force`, a DataError naming the choices."""
    changes = _config_changes(cfg, manifest["config"])
    if changes and not force:
        repeat = _repeat_flags(cfg, manifest["config"])
        use = f"To read it as it is, repeat its settings: {repeat}; to keep it" if repeat else "To keep it"
        raise DataError(
            f"{out}: holds a dataset prepared with other settings ({listed_changes(changes)}). {use}, give "
            f"this one a directory of its own: --set data.dataset_dir={own_dir(cfg)} (in `pretrain train` "
            "too); to replace it, run `pretrain data prepare --force` (runs trained on it then no longer "
            "resume on their data)"
        )
    was = manifest.get("inputs", {})
    changed = None if changes else _input_change(cfg, was, inputs)
    if changed and not force:
        raise DataError(
            f"{out}: {changed}; run `pretrain data prepare --force` to rebuild it, or set another "
            "data.dataset_dir to keep it"
        )
    return [changed] if changed else changes
