"""Checkpoints you can trust: atomic saves, retention, validation, safe loading, universal conversion.

A checkpoint is `engine.save_checkpoint` under a temporary tag (`.tmp-step_NNNNNNNN`), on every
rank. Each rank records, fsyncs and hashes the files it wrote; rank 0 then adds a copy of the
tokenizer and `pretrain_meta.json` (the client state without the RNG states, plus a manifest of
every file with its size and sha256), renames the directory to `step_NNNNNNNN`, and only then
rewrites `latest` (write + rename). A save killed at any moment leaves a `.tmp-` directory that is
never picked (and is removed at the next start), or a complete checkpoint newer than `latest`,
which is ignored too: the previous checkpoint stays the one `--resume auto` picks.

Every load goes through `safe_loading()`: DeepSpeed calls `torch.load(weights_only=False)`, which
`TORCH_FORCE_WEIGHTS_ONLY_LOAD` overrides to `weights_only=True`, with the four plain-data classes
that DeepSpeed pickles into its checkpoints allowlisted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
import time
from argparse import Namespace
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.config.tree import CheckpointConfig, RunConfig, analytic_num_params
from pretrain.data.dataset import TOKENIZER_FILE, Dataset, datasets_sha256
from pretrain.data.tokenizer import BPE_RANKS_FILE
from pretrain.errors import CheckpointError, DataError
from pretrain.files import format_bytes as _size
from pretrain.files import fsync_dir, replace_dir, write_atomic
from pretrain.training import rundir
from pretrain.training.guards import Faults, barrier, gather, world_of

META = "pretrain_meta.json"
TOKENIZER = TOKENIZER_FILE  # a copy of the dataset's, so that a checkpoint samples on its own
LATEST = "latest"
UNIVERSAL = "universal"  # the universal conversion of step_N lives in step_N/universal/
FORMAT_VERSION = 1
_TAG = re.compile(r"^step_(\d{8})$")
_TMP, _TRASH = ".tmp-", ".trash-"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def step_of(tag: str) -> int | None:
    m = _TAG.match(tag)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# Safe loading


def _safe_globals() -> list[Any]:
    """Plain-data classes that DeepSpeed pickles into its checkpoints: a loss scaler (two numbers),
    the ZeRO stage enum, and (offset, size) fragment addresses."""
    # DeepSpeed, here and below, only when a checkpoint is read or written: importing it takes seconds.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def safe_loading() -> Iterator[None]:
    """Make every `torch.load` in this block `weights_only=True`, DeepSpeed's included."""
    old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            yield
    except pickle.UnpicklingError as e:
        # Anything but tensors and plain data: a file from elsewhere, or crafted. Never executed.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            "refused to load a checkpoint file that holds more than tensors and plain data (loading it "
            f"could run code): {first[:300]}. Use checkpoints written by pretrain, from a source you trust",
            collective=False,
        ) from e
    finally:
        if old is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old


def load_file(path: Path) -> Any:
    """torch.load of one checkpoint file, weights only, on the CPU."""
    with safe_loading():
        return torch.load(path, map_location="cpu", weights_only=True)


# ---------------------------------------------------------------------------------------------
# Start-up checks


def estimate_bytes(cfg: RunConfig) -> int:
    """One checkpoint, all ranks together: the weights in their training dtype, plus the fp32 master
    copy and Adam's two moments (12 bytes a parameter). An upper bound at stage 0 in fp32 (12)."""
    weights = 2 if cfg.precision.bf16 or cfg.precision.fp16 else 4
    return analytic_num_params(cfg.model) * (weights + 12) + 64_000


def preflight(ckpt_dir: Path, *, need_bytes: int, keep: int, group: Any) -> None:
    """Every rank: the checkpoint dir exists, is writable, and has room for a checkpoint. All ranks
    raise the same CheckpointError if any rank finds a problem. Rank 0 then removes leftovers of
    interrupted saves (`.tmp-*`) and prunes (`.trash-*`)."""
    rank, _ = world_of(group)
    problems: list[str] = []
    notes: list[str] = []
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        probe = ckpt_dir / f".probe-{rank}-{os.getpid()}"
        with probe.open("wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        problems.append(
            f"checkpoint directory {ckpt_dir} is not writable: {e.strerror or e}; make it writable or "
            "point checkpoint.dir / logging.run_dir elsewhere"
        )
    else:
        free = shutil.disk_usage(ckpt_dir).free
        if free < need_bytes:
            problems.append(
                f"{ckpt_dir}: {_size(free)} free, but one checkpoint needs about {_size(need_bytes)}; "
                "free space there or point checkpoint.dir / logging.run_dir at a larger filesystem"
            )
        elif free < need_bytes * (keep + 1):
            notes.append(
                f"warning: {ckpt_dir} has {_size(free)} free; keeping {keep} checkpoints of about "
                f"{_size(need_bytes)} (plus the one being written) may run out of space"
            )
    reports = gather((problems, notes), group)
    all_problems = list(dict.fromkeys(p for probs, _ in reports for p in probs))
    if all_problems:
        raise CheckpointError("cannot save checkpoints:\n  - " + "\n  - ".join(all_problems))
    if rank == 0:
        for note in dict.fromkeys(n for _, ns in reports for n in ns):
            print(note, flush=True)
        for leftover in ckpt_dir.iterdir():
            if leftover.name.startswith((_TMP, _TRASH)) and (leftover.is_dir() or leftover.is_symlink()):
                _discard(leftover)
    barrier(group)


# ---------------------------------------------------------------------------------------------
# RNG states, one per rank


def rng_state() -> dict[str, Any]:
    """This rank's generators, in types `torch.load(weights_only=True)` reads back."""
    version, mt, gauss = random.getstate()
    np_state: Any = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(mt), gauss],
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    n = state["numpy"]
    np.random.set_state(
        ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def restore_rng(
    states: list[dict[str, Any]] | None, *, rank: int, world_size: int, seed: int, step: int
) -> str:
    """Each rank takes back its own generators; on another world size they are reseeded from
    (seed, step, rank), as they cannot continue. Returns what was done, for the log."""
    if states and len(states) == world_size:
        set_rng_state(states[rank])
        return "restored"
    seed_generators((seed * 1_000_003 + step * 101 + rank) % 2**63)
    saved = len(states) if states else 0
    return f"reseeded (saved by {saved} ranks, running on {world_size})"


def seed_generators(seed: int) -> None:
    """Seed torch's, Python's and numpy's generators (what a checkpoint saves and restores)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def gather_rng(group: Any) -> list[dict[str, Any]]:
    """Every rank's generators, in rank order (all ranks get the list; rank 0's copy is saved)."""
    return gather(rng_state(), group)


# ---------------------------------------------------------------------------------------------
# The client state: what a checkpoint holds besides DeepSpeed's own state


def run_state(cfg: RunConfig, datasets: list[Dataset], is_main: bool) -> dict[str, Any]:
    """The part of every checkpoint's client state that does not change during the run: the config,
    the data it trains on, and (from rank 0, whose copy is saved) the code and package versions."""
    return {
        "config": cfg.model_dump(mode="json"),
        "tokenizer_fingerprint": datasets[0].manifest["tokenizer"]["fingerprint"],
        "data_manifest_sha256": datasets_sha256(datasets),
        "versions": {"packages": rundir.package_versions(), "code": rundir.code_version()} if is_main else {},
        "zero_stage": cfg.zero.stage,
        "precision": cfg.precision.name,
    }


def client_state(
    constant: dict[str, Any],
    *,
    step: int,
    tokens_seen: int,
    elapsed_hours: float,
    loader: dict[str, Any],
    val_loss: float | None,
    skip_batches: set[int],
    loss_window: tuple[int, int, list[float]] = (0, 1, []),
    group: Any,
) -> dict[str, Any]:
    """The client state saved with the checkpoint of `step`: the `run_state` (`constant`), where
    the run is (tokens seen, hours of training over every resume, the loader's position, the
    batches it skips), the val loss evaluated at this step (None if it did not evaluate), the log
    window it is saved in the middle of (its steps, every rank's loss sum), and every rank's
    generators (a collective)."""
    return {
        **constant,
        "step": step,
        "tokens_seen": tokens_seen,
        "elapsed_hours": elapsed_hours,
        "loader": loader,
        "val_loss": val_loss,
        "skip_batches": sorted(skip_batches),
        "loss_window": dict(zip(("steps", "micro_steps", "loss_sums"), loss_window, strict=True)),
        "rng": gather_rng(group),
    }


# ---------------------------------------------------------------------------------------------
# Saving


class _RecordingEngine:
    """Wraps DeepSpeed's checkpoint engine. Each file this rank writes is fsynced, hashed and
    recorded; a failed write (full disk) is recorded instead of raised, so that every rank still
    reaches DeepSpeed's own barriers and all can fail together."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.checksums = True
        self.written: dict[str, dict[str, Any]] = {}
        self.errors: list[str] = []
        self.on_write: Any = None  # test hook, called after each file

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def save(self, state_dict: Any, path: str) -> None:
        if self.errors:
            return  # one failure is enough; don't fill the disk further
        try:
            self.inner.save(state_dict, path)
            self.written[path] = _describe(Path(path), self.checksums, fsync=True)
        except (OSError, RuntimeError) as e:  # torch's zip writer reports ENOSPC as a RuntimeError
            self.errors.append(f"{path}: {e}")
            return
        if self.on_write is not None:
            self.on_write(path)


def _describe(path: Path, checksum: bool, fsync: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"bytes": path.stat().st_size}
    if checksum or fsync:
        h = hashlib.sha256()
        with path.open("rb") as f:
            if checksum:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            if fsync:
                os.fsync(f.fileno())
        if checksum:
            out["sha256"] = h.hexdigest()
    return out


def recorder(engine: Any) -> _RecordingEngine:
    if not isinstance(engine.checkpoint_engine, _RecordingEngine):
        engine.checkpoint_engine = _RecordingEngine(engine.checkpoint_engine)
    rec: _RecordingEngine = engine.checkpoint_engine
    return rec


def save(
    engine: Any,
    ckpt_dir: Path,
    client_state: dict[str, Any],
    *,
    step: int,
    policy: CheckpointConfig,
    group: Any,
    tokenizer_file: Path | None = None,
    faults: Faults | None = None,
) -> str:
    """Save on every rank (DeepSpeed needs each rank's shards), commit on rank 0, prune.

    Returns the tag. Raises CheckpointError on every rank if any rank failed to write; the
    previous checkpoint then stays `latest`, and the partial one is removed."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    rank, world = world_of(group)
    tag = tag_for(step)
    tmp_tag = f"{_TMP}{tag}"
    rec = recorder(engine)
    rec.checksums, rec.written, rec.errors = policy.checksums, {}, []
    rec.on_write = faults.kill_in_save_hook(step, rank) if faults else None
    t0 = time.perf_counter()
    # `ds_to_universal` needs this entry to convert the checkpoint for another world size. Under
    # tensor parallelism AutoTP has put its own on the module: how each sharded parameter merges.
    info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) or {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
    }
    state = {**client_state, UNIVERSAL_CHECKPOINT_INFO: info}
    engine.save_checkpoint(str(ckpt_dir), tag=tmp_tag, client_state=state, save_latest=False)
    written = {str(Path(p).relative_to(ckpt_dir / tmp_tag)): d for p, d in rec.written.items()}
    reports = gather((written, rec.errors), group)
    errors = [f"rank {r}: {e}" for r, (_, errs) in enumerate(reports) for e in errs]
    tmp_dir = ckpt_dir / tmp_tag
    if errors:
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # free what the partial save took
        barrier(group)
        prev = latest_tag(ckpt_dir)
        kept = f"the previous checkpoint {prev} is intact" if prev else "no checkpoint was kept"
        free = shutil.disk_usage(ckpt_dir).free
        raise CheckpointError(
            f"saving checkpoint {tag} failed ({_size(free)} free in {ckpt_dir}); {kept}:\n  - "
            + "\n  - ".join(errors[:8])
        )
    if rank == 0:
        files: dict[str, dict[str, Any]] = {}
        for _, (w, _) in enumerate(reports):
            files.update(w)
        if tokenizer_file is not None and tokenizer_file.is_file():
            shutil.copyfile(tokenizer_file, tmp_dir / TOKENIZER)
            ranks = tokenizer_file.with_name(BPE_RANKS_FILE)  # a trained BPE's ranks, which it names
            if ranks.is_file():
                shutil.copyfile(ranks, tmp_dir / BPE_RANKS_FILE)
        for p in sorted(tmp_dir.rglob("*")):  # anything DeepSpeed wrote around the checkpoint engine
            rel = str(p.relative_to(tmp_dir))
            if p.is_file() and rel not in files:
                files[rel] = _describe(p, policy.checksums, fsync=True)
        meta = {k: v for k, v in client_state.items() if k != "rng"}
        meta.update(
            format="deepspeed",
            format_version=FORMAT_VERSION,
            tag=tag,
            world_size=world,
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            save_seconds=round(time.perf_counter() - t0, 3),
            files=files,
        )
        write_atomic(tmp_dir / META, json.dumps(seal(meta), indent=1) + "\n")
        final, aside = ckpt_dir / tag, ckpt_dir / f"{_TRASH}{tag}-{os.getpid()}"
        if final.exists() or final.is_symlink():  # an earlier save of this step that never became `latest`
            final.rename(aside)
        tmp_dir.rename(final)
        fsync_dir(ckpt_dir)
        write_atomic(ckpt_dir / LATEST, tag + "\n")
        _discard(aside)
        prune(ckpt_dir, policy)
    barrier(group)
    return tag


def prune(ckpt_dir: Path, policy: CheckpointConfig) -> list[str]:
    """Rank 0: delete committed checkpoints that no rule keeps; returns their tags.

    Kept: the newest `keep_last`, every multiple of `milestone_interval`, the lowest val loss
    (with `keep_best`) and whatever `latest` names. Deletion renames first, so a half-deleted
    checkpoint never looks like a checkpoint."""
    tags = committed_tags(ckpt_dir)[0]
    keep = set(tags[-policy.keep_last :])
    if policy.milestone_interval:
        keep |= {t for t in tags if (step_of(t) or 0) % policy.milestone_interval == 0}
    if policy.keep_best:
        scored = []
        for t in tags:
            with contextlib.suppress(OSError, ValueError):
                v = read_meta(ckpt_dir / t).get("val_loss")
                if isinstance(v, int | float):
                    scored.append((float(v), t))
        if scored:
            keep.add(min(scored)[1])
    latest = latest_tag(ckpt_dir)
    if latest:
        keep.add(latest)
    removed = []
    for t in tags:
        if t not in keep:
            trash = ckpt_dir / f"{_TRASH}{t}"
            (ckpt_dir / t).rename(trash)
            _discard(trash)
            removed.append(t)
    return removed


def _discard(path: Path) -> None:
    """Delete a checkpoint set aside for deletion. A link (a checkpoint kept elsewhere and linked
    in) is removed, not what it points to: that directory may be another run's or a shared copy,
    and rmtree refuses a link, which stayed behind as `.trash-step_N`."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Finding and validating checkpoints


def latest_tag(ckpt_dir: Path) -> str | None:
    """The tag `latest` names, if it names a step tag (a damaged `latest` names none)."""
    try:
        with (ckpt_dir / LATEST).open("rb") as f:
            tag = f.read(256).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return tag if step_of(tag) is not None else None


def committed_tags(ckpt_dir: Path) -> tuple[list[str], list[str]]:
    """Checkpoints whose save completed, oldest first, and notes on directories passed over.

    Committed: a `step_N` directory with its meta file, no newer than what `latest` names (a
    newer one was renamed into place but its save was interrupted before `latest` moved on)."""
    if not ckpt_dir.is_dir():
        return [], []
    notes = []
    tags = sorted(p.name for p in ckpt_dir.iterdir() if step_of(p.name) is not None and p.is_dir())
    latest = latest_tag(ckpt_dir)
    if (ckpt_dir / LATEST).exists() and (latest is None or latest not in tags):
        notes.append(f"{ckpt_dir / LATEST} names no checkpoint here; considering every checkpoint")
        latest = None
    out = []
    for t in tags:
        if latest is not None and t > latest:
            notes.append(f"{t}: newer than `latest` ({latest}), its save did not finish; ignored")
        elif not (ckpt_dir / t / META).is_file():
            notes.append(f"{t}: no {META}; ignored")
        else:
            out.append(t)
    return out, notes


def read_meta(path: Path) -> dict[str, Any]:
    """The meta file of a checkpoint directory (step_N or step_N/universal)."""
    meta_path = path / META
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no {META}; not a complete pretrain checkpoint") from e
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"{meta_path}: unreadable ({e})") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: not a JSON object")
    return meta


def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with the sha256 of its own content (`meta_sha256`), which `verify` checks: the meta
    file is read as much as any other, so an edit of it after save (a step, a config) is caught."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    digest = hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()
    return {**rest, "meta_sha256": digest}


def meta_problems(path: Path, meta: dict[str, Any]) -> list[str]:
    """What is wrong with a checkpoint's meta itself: its seal (where it has one: checkpoints of
    older versions have none), and the types of the fields the readers use."""
    problems = []
    if "meta_sha256" in meta and seal(meta)["meta_sha256"] != meta["meta_sha256"]:
        problems.append(f"{META}: its content differs from the one written at save (meta_sha256)")

    def whole(key: str, value: Any) -> None:
        if key in meta and not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            problems.append(f"{META}: '{key}' is {value!r}, not a whole number")

    for key in ("step", "tokens_seen", "world_size", "zero_stage"):
        whole(key, meta.get(key))
    hours = meta.get("elapsed_hours", 0.0)  # older checkpoints have none
    if not (isinstance(hours, int | float) and not isinstance(hours, bool) and 0 <= hours < float("inf")):
        problems.append(f"{META}: 'elapsed_hours' is {hours!r}, not a number of hours")
    for key in ("loader", "config"):
        if key in meta and not isinstance(meta[key], dict):
            problems.append(f"{META}: '{key}' is not a JSON object")
    model = meta.get("config", {}).get("model") if isinstance(meta.get("config"), dict) else None
    if model is not None:
        from pydantic import ValidationError

        from pretrain.config.tree import ModelConfig

        try:
            ModelConfig.model_validate(model)
        except (ValidationError, TypeError, ValueError) as e:
            first = e.errors()[0] if isinstance(e, ValidationError) else {"loc": (), "msg": str(e)}
            where = ".".join(str(x) for x in first["loc"])
            problems.append(f"{META}: config.model{'.' + where if where else ''}: {first['msg']}")
    tag = meta.get("tag")
    if step_of(path.name) is not None and tag is not None and tag != path.name:
        problems.append(f"{META}: its tag {tag!r} is not its directory's name {path.name!r}")
    return problems


def verify(path: Path, *, checksums: bool = True, rank: int = 0, world: int = 1) -> list[str]:
    """Problems with a checkpoint directory: its meta, and every file its manifest lists (this
    rank's share of them: file i is checked by rank i % world). Empty if it is sound."""
    try:
        meta = read_meta(path)
    except CheckpointError as e:
        return [str(e)]
    files = meta.get("files")
    problems = []
    for key in ("step", "loader", "config", "tokens_seen"):
        if key not in meta:
            problems.append(f"{META} lacks '{key}'")
    problems += meta_problems(path, meta)
    if not isinstance(files, dict) or not files:
        return [*problems, f"{META} lists no files"]
    for i, (rel, want) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        f = path / rel
        try:
            got = _describe(f, checksums and "sha256" in want)
        except OSError as e:
            problems.append(f"{rel}: {e.strerror or e}")
            continue
        if got["bytes"] != want.get("bytes"):
            problems.append(f"{rel}: {got['bytes']} bytes, expected {want.get('bytes')}")
        elif "sha256" in got and got["sha256"] != want["sha256"]:
            problems.append(f"{rel}: sha256 differs from the one recorded at save")
    return problems


def verify_all(path: Path, checksums: bool, group: Any) -> list[str]:
    """`verify` with the files shared out over the ranks; every rank gets every problem."""
    rank, world = world_of(group)
    return [
        p for part in gather(verify(path, checksums=checksums, rank=rank, world=world), group) for p in part
    ]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint to load: DeepSpeed's (root, tag) and what its meta file says."""

    root: Path  # the checkpoints directory
    tag: str  # "step_N", or "step_N/universal"
    meta: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.root / self.tag

    @property
    def universal(self) -> bool:
        return self.meta.get("format") == "universal"

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def saved_layout(meta: dict[str, Any]) -> tuple[int, int]:
    """(tensor, pipeline) of the run that saved a checkpoint ((1, 1) before the parallel section)."""
    par = meta.get("config", {}).get("parallel", {})
    return int(par.get("tensor", 1)), int(par.get("pipeline", 1))


def needs_universal(
    meta: dict[str, Any], world_size: int, zero_stage: int, layout: tuple[int, int] = (1, 1)
) -> bool:
    """A ZeRO checkpoint loads natively only with the partitioning it was saved with, and a tensor-
    or pipeline-parallel one only with its layout (tensor, pipeline)."""
    if saved_layout(meta) != layout:
        return True
    saved_world, saved_stage = (
        int(meta.get("world_size", world_size)),
        int(meta.get("zero_stage", zero_stage)),
    )
    if saved_stage == 0 and zero_stage == 0:
        return False  # stage 0 saves the whole optimizer state on rank 0: any world size loads it
    same_layout = saved_stage == zero_stage or {saved_stage, zero_stage} == {1, 2}
    return saved_world != world_size or not same_layout


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _newest_valid(
    ckpt_dir: Path, check: Callable[[Path], list[str]], report: Callable[[str], None]
) -> Path | None:
    """The newest committed checkpoint in `ckpt_dir` that `check` finds no problem with. Every
    directory passed over is reported, with why: never skipped in silence."""
    tags, notes = committed_tags(ckpt_dir)
    for note in notes:
        report(f"checkpoint: {note}")
    for tag in reversed(tags):
        problems = check(ckpt_dir / tag)
        if not problems:
            return ckpt_dir / tag
        report(
            f"checkpoint {ckpt_dir / tag} is invalid, skipped; trying the previous one:\n  - "
            + "\n  - ".join(problems[:8])
        )
    return None


def locate(
    src: Path,
    *,
    check: Callable[[Path], list[str]] | None = None,
    checksums: bool = True,
    report: Callable[[str], None] = _stderr,
) -> Path:
    """The one way every reader (resume, convert, export, sample, preflight) turns what a person
    names into a checkpoint directory it may read: a checkpoint (`step_N`, `step_N/universal`) whose
    files `check` finds sound, or the newest sound one of a checkpoints or run directory. `check`
    defaults to every file against the manifest in this process (sizes, and sha256 with
    `checksums`)."""
    if check is None:
        check = partial(verify, checksums=checksums)
    hint = "give a checkpoint (RUN_DIR/checkpoints/step_N), a checkpoints dir or a run dir"
    if not src.exists():
        raise CheckpointError(f"{src}: no such file or directory; {hint}")
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a directory; {hint}")
    if (src / META).is_file():
        problems = check(src)
        if problems:
            raise CheckpointError(
                f"{src}: invalid checkpoint (its files are not the ones written at save); pass its run "
                "dir to use the newest valid checkpoint:\n  - " + "\n  - ".join(problems[:8])
            )
        return src
    for ckpt_dir in (src, src / "checkpoints"):
        if committed_tags(ckpt_dir) != ([], []):
            found = _newest_valid(ckpt_dir, check, report)
            if found is None:
                raise CheckpointError(
                    f"{src}: no valid checkpoint in {ckpt_dir} (each is listed above, with why)"
                )
            return found
    raise CheckpointError(f"{src}: no checkpoint here; {hint}")


def resume_path(
    ckpt_dir: Path, spec: str, check: Callable[[Path], list[str]], report: Callable[[str], None]
) -> Path | None:
    """What a resume `spec` names: "auto", the newest valid checkpoint of `ckpt_dir` (None for a
    run that has none yet); anything else, the checkpoint `locate` finds there. `find` and
    preflight both ask here."""
    if spec == "auto":
        return _newest_valid(ckpt_dir, check, report)
    return locate(Path(spec), check=check, report=report)


INVALID = ".invalid"  # an invalid checkpoint set aside: `step_N.invalid`, no step tag any more


def place_resume(ckpt_dir: Path, chosen: Checkpoint, spec: str, *, group: Any, report: Any = print) -> None:
    """Where a resume from `chosen` may write: refuse what would lose or mix checkpoints, on every
    rank alike.

    - A checkpoint of another checkpoint dir, into one that holds checkpoints already: the two runs'
      checkpoints, `latest` and metrics would be stitched together.
    - A checkpoint named directly while newer ones sit beside it: the run's saves would replace them
      step by step (and retention delete them).
    - Resumed past newer ones that are invalid (`--resume auto` fell back): those are set aside as
      `step_N.invalid`, kept, so that neither retention nor a new save of the same step touches them."""
    here = committed_tags(ckpt_dir)[0]
    same = chosen.root.resolve() == ckpt_dir.resolve()
    if not same and here:
        raise CheckpointError(
            f"--resume {spec}: that checkpoint is another run's ({chosen.root}), and this run's checkpoint dir "
            f"{ckpt_dir} holds checkpoints of its own (newest {here[-1]}); resuming here would stitch the two runs "
            f"together. Continue that run in its own run dir (set logging.run_dir to {chosen.root.parent}), or "
            "branch from it into a new one (set logging.run_dir to a new directory)"
        )
    newer = [t for t in here if (step_of(t) or 0) > chosen.step] if same else []
    if not newer:
        return
    if (Path(spec) / META).is_file():
        raise CheckpointError(
            f"--resume {spec}: {ckpt_dir} holds newer checkpoints ({', '.join(newer)}), and this run's saves "
            "would replace them as it reaches their steps. To go back to step "
            f"{chosen.step}, move {'them' if len(newer) > 1 else 'it'} out of {ckpt_dir} first (nothing is "
            "deleted for you); to branch from it, set logging.run_dir to a new directory; to continue the "
            "newest, --resume auto"
        )
    if world_of(group)[0] == 0:
        for tag in newer:
            aside = ckpt_dir / f"{tag}{INVALID}"
            n = 1
            while aside.exists():
                aside, n = ckpt_dir / f"{tag}{INVALID}-{n}", n + 1
            (ckpt_dir / tag).rename(aside)
            report(
                f"checkpoint: {ckpt_dir / tag} is invalid: kept aside as {aside.name}, so that neither retention "
                "nor this run's own save of that step touches it; delete it when you no longer need it"
            )
        fsync_dir(ckpt_dir)
    barrier(group)


def find(
    ckpt_dir: Path,
    spec: str,
    *,
    world_size: int,
    zero_stage: int,
    checksums: bool,
    group: Any,
    report: Any = print,
    layout: tuple[int, int] = (1, 1),
) -> Checkpoint | None:
    """The checkpoint to resume from. `spec` is "auto" (the newest valid one in `ckpt_dir`; each
    invalid one is reported and the previous one tried) or what a person named (`locate`); the
    files are verified with the work shared out over the ranks.

    A checkpoint saved on another world size (or ZeRO layout) is used through its universal
    conversion (`pretrain convert`), and refused with the command to run if it has none."""

    def check(p: Path) -> list[str]:
        return verify_all(p, checksums, group)

    chosen: Checkpoint | None = None
    path = resume_path(ckpt_dir, spec, check, report)
    if path is not None:
        meta = read_meta(path)
        root = path.parent.parent if meta.get("format") == "universal" else path.parent
        chosen = Checkpoint(root, str(path.relative_to(root)), meta)
    if chosen is None:
        return None
    (tp, pp), (saved_tp, saved_pp) = layout, saved_layout(chosen.meta)
    if (pp > 1) != (saved_pp > 1):
        raise CheckpointError(
            f"{chosen.path} was saved {'by' if saved_pp > 1 else 'without'} a pipeline "
            f"(parallel.pipeline={saved_pp}); this run has parallel.pipeline={pp}. A pipeline's checkpoint "
            "names its parameters by stage layer, the GPT's by module, and DeepSpeed's universal format "
            "cannot map one onto the other: resume with "
            + (f"--set parallel.pipeline={saved_pp}" if saved_pp > 1 else "--set parallel.pipeline=1")
            + f", or carry the weights across with `pretrain export {chosen.path}` (without the optimizer state)"
        )
    if chosen.universal or not needs_universal(chosen.meta, world_size, zero_stage, layout):
        return chosen
    uni = chosen.path / UNIVERSAL
    saved = f"{_ranks(int(chosen.meta.get('world_size', 0)))} at ZeRO-{chosen.meta.get('zero_stage')}"
    if (saved_tp, saved_pp) != (1, 1) or layout != (1, 1):
        saved += f", tensor {saved_tp} x pipeline {saved_pp}"
        world_size_s = f"{_ranks(world_size)} at ZeRO-{zero_stage}, tensor {tp} x pipeline {pp}"
    else:
        world_size_s = f"{_ranks(world_size)} at ZeRO-{zero_stage}"
    if int(chosen.meta.get("zero_stage", 0)) == 0:  # DeepSpeed's converter takes ZeRO 1-3 only
        raise CheckpointError(
            f"{chosen.path} was saved on {saved}; this run has {world_size_s}. A ZeRO-0 checkpoint holds the "
            "whole optimizer state and loads on any world size, but only at ZeRO-0 (DeepSpeed's universal "
            f"converter takes ZeRO 1-3): resume with --set zero.stage=0, or carry the weights across with "
            f"`pretrain export {chosen.path}` (without the optimizer state)"
        )
    if not (uni / META).is_file():
        raise CheckpointError(
            f"{chosen.path} was saved on {saved}; this run has {world_size_s}. "
            f"Convert it to DeepSpeed's universal format first:\n  pretrain convert {chosen.path}"
        )
    problems = verify_all(uni, checksums, group)
    if problems:
        raise CheckpointError(
            f"{uni}: invalid universal checkpoint; convert again with `pretrain convert {chosen.path}`:\n  - "
            + "\n  - ".join(problems[:8])
        )
    return Checkpoint(chosen.root, f"{chosen.tag}/{UNIVERSAL}", read_meta(uni))


def check_compatible(ckpt: Checkpoint, cfg: RunConfig, datasets: list[Dataset], *, warn: bool = True) -> None:
    """Refuse to continue a checkpoint with another architecture or tokenizer; warn on other data."""
    problems = []
    saved_model = ckpt.meta.get("config", {}).get("model", {})
    for key, value in cfg.model.model_dump(mode="json").items():
        # a field newer than the checkpoint had its default then (every such default is the old model)
        saved = saved_model.get(key, type(cfg.model).model_fields[key].default)
        # init_from only starts a run: a resume takes the checkpoint's weights, wherever they came from
        if saved != value and key not in ("dropout", "activation_checkpointing", "init_from"):
            problems.append(f"model.{key}: checkpoint has {saved!r}, this run has {value!r}")
    if ckpt.meta.get("tokenizer_fingerprint") != datasets[0].manifest["tokenizer"]["fingerprint"]:
        problems.append("the tokenizer differs from the one the checkpoint was trained with")
    saved_precision = ckpt.meta.get("precision", "fp32")
    if saved_precision != cfg.precision.name:
        # DeepSpeed's optimizer state differs in kind (fp16 keeps a loss scaler, bf16 and fp16 fp32
        # master weights): loading one into the other fails inside DeepSpeed.
        flags = {"fp32": "precision.bf16=false precision.fp16=false", "bf16": "precision.bf16=true",
                 "fp16": "precision.fp16=true"}.get(str(saved_precision), "the checkpoint's precision")  # fmt: skip
        problems.append(
            f"precision: the checkpoint was trained in {saved_precision}, this run is {cfg.precision.name}; "
            f"DeepSpeed cannot load one's optimizer state into the other. Resume with --set {flags}, or "
            f"carry the weights across with `pretrain export {ckpt.path}` (without the optimizer state)"
        )
    if problems:
        raise DataError(f"{ckpt.path}: cannot resume:\n  - " + "\n  - ".join(problems))
    if warn:
        for note in [
            *schedule_changes(ckpt, cfg),
            *batch_and_seed_changes(ckpt, cfg),
            *accumulation_change(ckpt, cfg),
        ]:
            print(f"warning: {note}", flush=True)
    saved_data = ckpt.meta.get("data_manifest_sha256")
    if warn and saved_data and saved_data != datasets_sha256(datasets):
        print(
            f"warning: {ckpt.path} was trained on another prepared dataset (its manifest differs); the data "
            "order will not continue exactly",
            flush=True,
        )


def accumulation_change(ckpt: Checkpoint, cfg: RunConfig) -> list[str]:
    """A bf16 resume that sums gradients in another dtype than the checkpoint's run (DeepSpeed loads
    one's optimizer state into the other). A checkpoint from before precision.grad_accum_dtype summed
    them in bf16, DeepSpeed's default."""
    if not cfg.precision.bf16:
        return []
    was = ckpt.meta.get("config", {}).get("precision", {}).get("grad_accum_dtype", "bf16")
    now = cfg.precision.grad_accum_dtype
    if was == now:
        return []
    return [
        f"this resume changes precision.grad_accum_dtype from {was} to {now}: the gradients are summed in {now} from here on"
    ]


def batch_and_seed_changes(ckpt: Checkpoint, cfg: RunConfig) -> list[str]:
    """What a resume changes in the global batch and the seed, said at start."""
    saved = ckpt.meta.get("config", {})
    notes = []
    batch = saved.get("batch", {})
    parts = [batch.get(k) for k in ("micro_batch_size", "gradient_accumulation_steps", "data_parallel_size")]
    if all(isinstance(x, int) for x in parts):
        was = parts[0] * parts[1] * parts[2]
        now = cfg.batch.sequences
        if was != now:
            b = cfg.batch
            notes.append(
                f"this resume changes the global batch from {was} to {now} sequences a step (micro x accumulation x "
                f"data-parallel: {parts[0]} x {parts[1]} x {parts[2]} -> {b.micro_batch_size} x "
                f"{b.gradient_accumulation_steps} x {b.data_parallel_size}): each step now takes {now / was:.3g} times "
                "the tokens, while the LR schedule still counts steps. To keep the batch, set "
                "batch.gradient_accumulation_steps for this world size"
            )
    if isinstance(saved.get("seed"), int) and saved["seed"] != cfg.seed:
        notes.append(
            f"seed: the checkpoint was trained with {saved['seed']}, this run has {cfg.seed}; the checkpoint's "
            "random generators are restored, so the new seed only seeds what they do not cover"
        )
    return notes


def schedule_changes(ckpt: Checkpoint, cfg: RunConfig) -> list[str]:
    """What a resume changes in the LR schedule (schedule.*, optimizer.lr), with the LR jump it
    makes at the step it continues from: the cosine re-stretched, or a new peak."""
    from pretrain.config.tree import ScheduleConfig
    from pretrain.training.schedule import lr_at

    saved = ckpt.meta.get("config", {})
    now_sched, now_lr = cfg.schedule.model_dump(mode="json"), cfg.optimizer.lr
    try:
        was_sched = ScheduleConfig.model_validate({**now_sched, **saved.get("schedule", {})})
        was_lr = float(saved.get("optimizer", {}).get("lr", now_lr))
    except (ValueError, TypeError):
        return []
    changed = [
        f"schedule.{k}: {v!r} -> {now_sched[k]!r}"
        for k, v in was_sched.model_dump(mode="json").items()
        if now_sched.get(k) != v and k != "max_hours"  # a stop by the clock: the curve is the same
    ]
    if was_lr != now_lr:
        changed.append(f"optimizer.lr: {was_lr!r} -> {now_lr!r}")
    if not changed:
        return []
    step, tokens = int(ckpt.meta.get("step", 0)), cfg.tokens_per_step
    before = lr_at(step, was_lr, was_sched, was_sched.total_steps(tokens))
    after = lr_at(step, now_lr, cfg.schedule, cfg.total_steps)
    return [
        f"this resume changes the learning-rate schedule ({'; '.join(changed)}): at step {step} the LR "
        f"{'jumps' if abs(after - before) > 1e-3 * max(before, after, 1e-12) else 'stays'} from {before:.3g} "
        f"to {after:.3g}. To continue the schedule the checkpoint was trained with, resume with its "
        "settings (its config.yaml)"
    ]


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def load(engine: Any, ckpt: Checkpoint) -> dict[str, Any]:
    """Load model, optimizer and DeepSpeed state, weights only; returns the client state."""
    # DeepSpeed reads this flag only while loading; setting it per load lets one engine load a
    # universal checkpoint at start and its own native ones (a rollback) later.
    engine._config.load_universal_checkpoint = ckpt.universal
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    # No autograd while loading: a pipeline's load broadcasts its tied embedding in place, which with
    # autograd on leaves a c10d::broadcast_ record that every later backward warns about.
    with safe_loading(), torch.no_grad():
        path, client_state = engine.load_checkpoint(str(ckpt.root), tag=ckpt.tag)
    if path is None:
        raise CheckpointError(f"{ckpt.path}: DeepSpeed could not load this checkpoint")
    if ckpt.universal:
        # Two workarounds for DeepSpeed 0.19's ZeRO-3 universal load, without which the run drifts
        # from the one it continues: it copies the first group's hyperparameters onto every group
        # (weight decay included: embeddings, norms and biases would be decayed), and it gives every
        # group the same `step` tensor, which AdamW then increments once per group and step.
        for g, before in zip(engine.optimizer.param_groups, groups, strict=True):
            g.update(before)
        base = getattr(engine.optimizer, "optimizer", engine.optimizer)
        for state in base.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
    return dict(client_state or {})


# ---------------------------------------------------------------------------------------------
# Universal checkpoints (another world size or ZeRO stage)


def convert_to_universal(src: Path, workers: int = 1, checksums: bool = True) -> tuple[Path, bool]:
    """Write DeepSpeed's universal checkpoint of `src` into `src/universal`, atomically; (its path,
    False) when a sound one of ours is there already. Anything else at that path that this project
    did not write is refused and kept; an unsound one of ours is replaced."""
    src = locate(src, checksums=checksums)
    meta = read_meta(src)
    if meta.get("format") == "universal":
        raise CheckpointError(f"{src} is a universal checkpoint already; `train --resume {src}` loads it")
    if int(meta.get("zero_stage", 0)) == 0 and saved_layout(meta) != (1, 1):
        tp, pp = saved_layout(meta)
        raise CheckpointError(
            f"{src} is a ZeRO stage 0 checkpoint of tensor {tp} x pipeline {pp}: DeepSpeed converts ZeRO "
            "checkpoints (stage 1 and up) only. It resumes on its own layout; to change layouts later, "
            "train with --set zero.stage=1"
        )
    if int(meta.get("zero_stage", 0)) == 0:
        raise CheckpointError(
            f"{src} is a ZeRO stage 0 checkpoint: it holds the whole optimizer state and resumes on "
            "any world size as it is; there is nothing to convert"
        )
    out, tmp = src / UNIVERSAL, src / f"{_TMP}{UNIVERSAL}"
    old = None
    if out.exists() or out.is_symlink():
        ours = out.is_dir() and not out.is_symlink() and (out / META).is_file()
        if not ours or read_meta(out).get("format") != "universal":
            raise CheckpointError(
                f"{out} is in the way: it is not a universal checkpoint this project wrote, and it is kept as "
                f"it is. Move it elsewhere, then run `pretrain convert {src}` again"
            )
        if not verify(out, checksums=checksums):
            return out, False
        # Ours but unsound: set aside (outside src, which DeepSpeed's converter reads) until the new
        # one is in place, and put back should the conversion fail.
        old = src.parent / f"{_TRASH}{src.name}-{UNIVERSAL}-{os.getpid()}"
        out.rename(old)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(src, tmp, out, meta, workers, checksums)
    except BaseException:
        if old is not None and not out.exists():
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out, True


def _convert(src: Path, tmp: Path, out: Path, meta: dict[str, Any], workers: int, checksums: bool) -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(
        input_folder=str(src),
        output_folder=str(tmp),
        num_extract_workers=workers,
        num_merge_workers=workers,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    with safe_loading():
        ds_to_universal.main(args)
    (src / "latest_universal").unlink(missing_ok=True)  # written next to the output; we use our own meta
    files = {
        str(p.relative_to(tmp)): _describe(p, checksums, fsync=True)
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    umeta = {**meta, "format": "universal", "tag": f"{src.name}/{UNIVERSAL}", "files": files}
    write_atomic(tmp / META, json.dumps(seal(umeta), indent=1) + "\n")
    replace_dir(tmp, out)
