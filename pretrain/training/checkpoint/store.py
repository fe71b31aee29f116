"""Checkpoints you can trust: the format, atomic saves, retention, validation, safe loading. Which one
a run continues from and loading it: resume.py; the universal conversion: universal.py.

A checkpoint is `engine.save_checkpoint` under a temporary tag (`.tmp-step_NNNNNNNN`), on every
rank. Each rank records, fsyncs and hashes the files it wrote; rank 0 then adds a copy of the
tokenizer and `pretrain_meta.json` (the client state without the RNG states, plus a manifest of
every file with its size and BLAKE3 digest), renames the directory to `step_NNNNNNNN`, and only then
rewrites `latest` (write + rename). A save killed at any moment leaves a `.tmp-` directory that is
never picked (and is removed at the next start), or a complete checkpoint newer than `latest`,
which is ignored too: the previous checkpoint stays the one `--resume auto` picks.

Every load goes through `safe_loading()`: DeepSpeed calls `torch.load(weights_only=False)`, which
`TORCH_FORCE_WEIGHTS_ONLY_LOAD` overrides to `weights_only=True`, with the four plain-data classes
that DeepSpeed pickles into its checkpoints allowlisted.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pretrain.config.layout import Layout
from pretrain.config.run_sections import CheckpointConfig
from pretrain.config.tree import RunConfig, analytic_num_params
from pretrain.data.dataset import TOKENIZER_FILE, Dataset, datasets_sha256
from pretrain.data.tokenizer import BPE_RANKS_FILE, HF_TOKENIZER_FILE
from pretrain.errors import CheckpointError
from pretrain.files import format_bytes as _size
from pretrain.files import fsync_dir, write_atomic
from pretrain.training import rundir
from pretrain.training.checkpoint.files import (
    Background,
    Recorder,
    describe,
    describe_all,
    digest_key,
    tensor_bytes,
)
from pretrain.training.distributed import ds_internals
from pretrain.training.distributed.ranks import barrier, control_group, gather, world_of
from pretrain.training.faults import Faults

META = "pretrain_meta.json"
TOKENIZER = TOKENIZER_FILE  # a copy of the dataset's, so that a checkpoint samples on its own
LATEST = "latest"
UNIVERSAL = "universal"  # the universal conversion of step_N lives in step_N/universal/
FORMAT_VERSION = 1
_TAG = re.compile(r"^step_(\d{8})$")
TMP, TRASH = ".tmp-", ".trash-"


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
            if leftover.name.startswith((TMP, TRASH)) and (leftover.is_dir() or leftover.is_symlink()):
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
    recent_losses: list[float] | None = None,
    group: Any,
) -> dict[str, Any]:
    """The client state saved with the checkpoint of `step`: the `run_state` (`constant`), where
    the run is (tokens seen, hours of training over every resume, the loader's position, the
    batches it skips), the val loss evaluated at this step (None if it did not evaluate), the log
    window it is saved in the middle of (its steps, every rank's loss sum), the spike rule's window
    (`recent_losses`: the agreed losses of the last accepted steps, the same on every rank), and
    every rank's generators (a collective)."""
    return {
        **constant,
        "step": step,
        "tokens_seen": tokens_seen,
        "elapsed_hours": elapsed_hours,
        "loader": loader,
        "val_loss": val_loss,
        "skip_batches": sorted(skip_batches),
        "loss_window": dict(zip(("steps", "micro_steps", "loss_sums"), loss_window, strict=True)),
        "recent_losses": list(recent_losses or []),
        "rng": gather_rng(group),
    }


# ---------------------------------------------------------------------------------------------
# Saving


@functools.cache
def recording_engine_class() -> type[Any]:
    """`RecordingEngine`, built on the first save: its base class is DeepSpeed's, and importing
    DeepSpeed takes a second that the commands which only read checkpoints (export, sample) skip."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

    class RecordingEngine(CheckpointEngine):
        """DeepSpeed's checkpoint engine interface (`CheckpointEngine`) with our writing: each file
        goes to the `Recorder` (files.py: no zip CRC, hashed and fsynced beside the writing, failures
        recorded, snapshots for a background save), and loads go to the TorchCheckpointEngine that
        DeepSpeed built from the config, whose `save` also writes each file's bytes.

        Not decoupled: DeepSpeed then calls `commit` at the end of `save_checkpoint` on every rank,
        never from `engine.step`. That `commit` only says this rank's files are handed over; the
        checkpoint's own commit (verify, rename, `latest`, retention) is `_settle`'s, once every
        file of every rank is durable and every rank knows whether all were."""

        def __init__(self, torch_engine: Any) -> None:
            super().__init__()
            self.name = "pretrain.RecordingEngine"
            self.torch_engine = torch_engine
            self.recorder = Recorder(torch_engine.save)

        def create(self, info: CheckpointCommitInfo) -> None:
            pass  # nothing to open: `save` resets the Recorder before `engine.save_checkpoint`

        def makedirs(self, path: str, exist_ok: bool = False) -> None:
            self.recorder.makedirs(path, exist_ok)

        def save(self, state_dict: Any, path: str) -> None:
            self.recorder.save(state_dict, path)

        def load(self, path: str, map_location: Any = None) -> Any:
            return self.torch_engine.load(path, map_location=map_location)

        def commit(self, info: CheckpointCommitInfo) -> bool:
            return True  # this rank's files are handed over; the checkpoint is committed by `_settle`

        def is_data_parallel_writer(self, dp_rank: int) -> bool:
            return bool(self.torch_engine.is_data_parallel_writer(dp_rank))

        def is_decoupled(self) -> bool:
            return False

        def preserves_storage_sharing(self) -> bool:
            # torch.save keeps views of one storage together: DeepSpeed then clones the weights it
            # saves out of its flat buffers, so that a file holds them only (TorchCheckpointEngine's)
            return True

    return RecordingEngine


def recorder(engine: Any) -> Recorder:
    """The Recorder of `engine`'s saves: the first call installs a `RecordingEngine` around the
    TorchCheckpointEngine DeepSpeed built (ds_internals: DeepSpeed takes no engine of ours)."""
    cls = recording_engine_class()
    current = ds_internals.get_checkpoint_engine(engine)
    if not isinstance(current, cls):
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

        if not isinstance(current, TorchCheckpointEngine):
            raise CheckpointError(
                f"DeepSpeed's checkpoint engine is {type(current).__name__}, not its TorchCheckpointEngine: "
                "pretrain writes checkpoints through its own engine around that one; remove the "
                "DeepSpeed config's checkpoint.writer and datastates sections"
            )
        current = cls(current)
        ds_internals.set_checkpoint_engine(engine, current)
    rec: Recorder = current.recorder
    return rec


class Saver:
    """The run's checkpoint saves, one in flight at most. With `asynchronous`, a save's files are
    written, hashed, fsynced and committed on a thread of their own (`Background`), the collectives
    of that thread on a gloo group of their own: the training loop goes on using its group, and two
    threads must never share one. All ranks build it at the same point (the group is a collective)."""

    def __init__(self, group: Any, *, asynchronous: bool) -> None:
        self.background = Background() if asynchronous else None
        self.group = control_group() if asynchronous and group is not None else group
        self.snapshot_bytes = 0  # host memory of the last asynchronous save's snapshot, this rank

    def wait(self) -> None:
        """Return once the save in flight (if any) is committed; raise its CheckpointError."""
        if self.background is not None:
            self.background.wait()

    @property
    def busy(self) -> bool:
        return self.background is not None and self.background.busy


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
    saver: Saver | None = None,
    wait: bool = True,
    report: Any = None,
) -> str:
    """Save on every rank (DeepSpeed needs each rank's shards), commit on rank 0, prune.

    Returns the tag. Raises CheckpointError on every rank if any rank failed to write; the previous
    checkpoint then stays `latest`, and the partial one is removed. With a `saver` and not `wait`,
    this returns once DeepSpeed's state dicts are snapshotted to host memory: the rest happens on
    the saver's thread, whose failure is raised by the next save or `saver.wait()`, and `report`
    (rank 0's, if given) says when the checkpoint is committed. A save first waits for the one in
    flight."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    if saver is not None:
        saver.wait()
    background = saver.background if saver is not None and not wait else None
    rank, _ = world_of(group)
    tag = tag_for(step)
    rec = recorder(engine)
    rec.reset(checksums=policy.checksums, capture=background is not None)
    rec.on_write = faults.kill_in_save_hook(step, rank) if faults else None
    t0 = time.perf_counter()
    # `ds_to_universal` needs this entry to convert the checkpoint for another world size. Under
    # tensor parallelism AutoTP has put its own on the module: how each sharded parameter merges.
    info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) or {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
    }
    state = {**client_state, UNIVERSAL_CHECKPOINT_INFO: info}
    engine.save_checkpoint(str(ckpt_dir), tag=f"{TMP}{tag}", client_state=state, save_latest=False)
    meta = {k: v for k, v in client_state.items() if k != "rng"}

    def finish() -> None:
        written, errors = rec.write_all()
        _settle(ckpt_dir, tag, meta, written, errors, t0=t0, policy=policy, tokenizer_file=tokenizer_file,
                group=saver.group if background is not None and saver is not None else group)  # fmt: skip
        if background is not None and report is not None:
            report(
                f"saved checkpoint {ckpt_dir / tag} (written in the background, {time.perf_counter() - t0:.1f} s)"
            )

    if background is None:
        finish()
    else:
        assert saver is not None
        saver.snapshot_bytes = sum(tensor_bytes(sd) for sd, _ in rec.captured)
        if rec.direct:  # every rank that had to says so
            print(
                f"rank {rank}: {len(rec.direct)} file(s) of {tag} written before the step went on: no host "
                "memory for their copy (the host line of pretrain plan counts it)",
                flush=True,
            )
        background.start(finish, name=f"save-{tag}")
    return tag


def _settle(
    ckpt_dir: Path,
    tag: str,
    meta: dict[str, Any],
    written: dict[str, dict[str, Any]],
    errors: list[str],
    *,
    t0: float,
    policy: CheckpointConfig,
    tokenizer_file: Path | None,
    group: Any,
) -> None:
    """Every rank, its files written: share what each wrote and what failed (one gather over
    `group`), then rank 0 commits, or every rank raises the same CheckpointError."""
    rank, world = world_of(group)
    tmp_dir = ckpt_dir / f"{TMP}{tag}"
    local = {str(Path(p).relative_to(tmp_dir)): d for p, d in written.items()}
    reports = gather((local, errors), group)
    all_errors = [f"rank {r}: {e}" for r, (_, errs) in enumerate(reports) for e in errs]
    if all_errors:
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # free what the partial save took
        barrier(group)
        prev = latest_tag(ckpt_dir)
        kept = f"the previous checkpoint {prev} is intact" if prev else "no checkpoint was kept"
        free = shutil.disk_usage(ckpt_dir).free
        raise CheckpointError(
            f"saving checkpoint {tag} failed ({_size(free)} free in {ckpt_dir}); {kept}:\n  - "
            + "\n  - ".join(all_errors[:8])
        )
    if rank == 0:
        files: dict[str, dict[str, Any]] = {}
        for w, _ in reports:
            files.update(w)
        meta = {
            **meta,
            "format": "deepspeed",
            "format_version": FORMAT_VERSION,
            "tag": tag,
            "world_size": world,
        }
        meta.update(
            saved_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"), save_seconds=round(time.perf_counter() - t0, 3)
        )
        _commit(ckpt_dir, tag, meta, files, policy=policy, tokenizer_file=tokenizer_file)
    barrier(group)


def _commit(
    ckpt_dir: Path,
    tag: str,
    meta: dict[str, Any],
    files: dict[str, dict[str, Any]],
    *,
    policy: CheckpointConfig,
    tokenizer_file: Path | None,
) -> None:
    """Rank 0, once every rank has written its part of `.tmp-<tag>`: add the tokenizer and the meta
    file (every file listed), rename it to `tag`, point `latest` at it, prune."""
    tmp_dir = ckpt_dir / f"{TMP}{tag}"
    if tokenizer_file is not None and tokenizer_file.is_file():
        shutil.copyfile(tokenizer_file, tmp_dir / TOKENIZER)
        for name in (BPE_RANKS_FILE, HF_TOKENIZER_FILE):  # a trained BPE's ranks, an hf tokenizer's file
            if tokenizer_file.with_name(name).is_file():
                shutil.copyfile(tokenizer_file.with_name(name), tmp_dir / name)
    for p in sorted(tmp_dir.rglob("*")):  # anything DeepSpeed wrote around the checkpoint engine
        rel = str(p.relative_to(tmp_dir))
        if p.is_file() and rel not in files:
            files[rel] = describe(p, policy.checksums, fsync=True)
    write_atomic(tmp_dir / META, json.dumps(seal({**meta, "files": files}), indent=1) + "\n")
    final, aside = ckpt_dir / tag, ckpt_dir / f"{TRASH}{tag}-{os.getpid()}"
    if final.exists() or final.is_symlink():  # an earlier save of this step that never became `latest`
        final.rename(aside)
    tmp_dir.rename(final)
    fsync_dir(ckpt_dir)
    write_atomic(ckpt_dir / LATEST, tag + "\n")
    _discard(aside)
    prune(ckpt_dir, policy)


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
            trash = ckpt_dir / f"{TRASH}{t}"
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


def saved_layout(meta: dict[str, Any]) -> Layout:
    """The layout of the run that saved a checkpoint (tensor 1 x pipeline 1 before the parallel
    section; no ZeRO stage or world size: 0 and one data-parallel rank)."""
    par = meta.get("config", {}).get("parallel", {})
    tp, pp = int(par.get("tensor", 1)), int(par.get("pipeline", 1))
    data = max(1, int(meta.get("world_size", tp * pp)) // (tp * pp))
    return Layout(tensor=tp, pipeline=pp, data=data, zero_stage=int(meta.get("zero_stage", 0)))


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
    mine = [(rel, want) for i, (rel, want) in enumerate(sorted(files.items())) if i % world == rank]
    return problems + _file_problems(path, mine, checksums)


def _file_problems(path: Path, listed: list[tuple[str, Any]], checksums: bool) -> list[str]:
    """Each listed file against its manifest entry: its size and (with `checksums`) its digest, the
    files hashed on threads (as many cores as there are threads)."""
    algos = [digest_key(want) if isinstance(want, dict) else None for _, want in listed]
    got_all = describe_all(
        [path / rel for rel, _ in listed], checksums and any(algos), algos=[a or "blake3" for a in algos]
    )
    problems = []
    for (rel, want), algo, got in zip(listed, algos, got_all, strict=True):
        if isinstance(got, OSError):
            problems.append(f"{rel}: {got.strerror or got}")
        elif not isinstance(want, dict) or got["bytes"] != want.get("bytes"):
            expected = want.get("bytes") if isinstance(want, dict) else want
            problems.append(f"{rel}: {got['bytes']} bytes, expected {expected}")
        elif checksums and algo is not None and got.get(algo) != want[algo]:
            problems.append(f"{rel}: {algo} differs from the one recorded at save")
    return problems


def verify_all(path: Path, checksums: bool, group: Any) -> list[str]:
    """`verify` with the files shared out over the ranks; every rank gets every problem."""
    rank, world = world_of(group)
    return [
        p for part in gather(verify(path, checksums=checksums, rank=rank, world=world), group) for p in part
    ]
