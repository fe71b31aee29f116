"""Which checkpoint a run continues from, whether it may, and loading it: `find` picks one (the
newest sound one, or the one named, converted to universal where the world size, ZeRO stage or
layout changed), `check_compatible` refuses a resume into another model or dataset and says what a
changed batch, seed, schedule or precision does, `load` hands it to DeepSpeed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pretrain.config.engine_sections import PrecisionConfig
from pretrain.config.layout import Layout
from pretrain.config.tree import RunConfig, swiglu_if_recorded_gelu
from pretrain.data.dataset import Dataset, datasets_sha256
from pretrain.errors import CheckpointError, DataError
from pretrain.files import fsync_dir
from pretrain.training.checkpoint.store import (
    META,
    UNIVERSAL,
    committed_tags,
    read_meta,
    safe_loading,
    saved_layout,
    step_of,
    verify,
    verify_all,
)
from pretrain.training.distributed.ds_internals import load_universal_next
from pretrain.training.distributed.ranks import barrier, world_of


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


def needs_universal(meta: dict[str, Any], layout: Layout) -> bool:
    """A ZeRO checkpoint loads natively only with the partitioning it was saved with, and a tensor-
    or pipeline-parallel one only with its tensor x pipeline shape."""
    if saved_layout(meta).shape != layout.shape:
        return True
    world_size, zero_stage = layout.world, layout.zero_stage
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
    defaults to every file against the manifest in this process (sizes, and BLAKE3 digests with
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
    layout: Layout,
    checksums: bool,
    group: Any,
    report: Any = print,
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
    world_size, zero_stage = layout.world, layout.zero_stage
    (tp, pp), (saved_tp, saved_pp) = layout.shape, saved_layout(chosen.meta).shape
    if (pp > 1) != (saved_pp > 1):
        raise CheckpointError(
            f"{chosen.path} was saved {'by' if saved_pp > 1 else 'without'} a pipeline "
            f"(parallel.pipeline={saved_pp}); this run has parallel.pipeline={pp}. A pipeline's checkpoint "
            "names its parameters by stage layer, the GPT's by module, and DeepSpeed's universal format "
            "cannot map one onto the other: resume with "
            + (f"--set parallel.pipeline={saved_pp}" if saved_pp > 1 else "--set parallel.pipeline=1")
            + f", or carry the weights across with `pretrain export {chosen.path}` (without the optimizer state)"
        )
    if chosen.universal or not needs_universal(chosen.meta, layout):
        return chosen
    uni = chosen.path / UNIVERSAL
    saved = f"{_ranks(int(chosen.meta.get('world_size', 0)))} at ZeRO-{chosen.meta.get('zero_stage')}"
    if (saved_tp, saved_pp) != (1, 1) or layout.shape != (1, 1):
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
        if key == "activation":
            saved = swiglu_if_recorded_gelu(saved_model.get("arch"), saved)
        # init_from only starts a run: a resume takes the checkpoint's weights, wherever they came from
        # document_eot (loader.document_mask) changes what attends to what, not one weight: a run may
        # turn document masks on (or off) at a resume, and is told so below
        if saved != value and key not in ("dropout", "activation_checkpointing", "init_from", "document_eot"):
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
            *document_mask_change(saved_model.get("document_eot"), cfg.model.document_eot),
            *schedule_changes(ckpt, cfg),
            *batch_and_seed_changes(ckpt, cfg),
            *accumulation_change(ckpt, precision=cfg.precision),
        ]:
            print(f"warning: {note}", flush=True)
    saved_data = ckpt.meta.get("data_manifest_sha256")
    if warn and saved_data and saved_data != datasets_sha256(datasets):
        print(
            f"warning: {ckpt.path} was trained on another prepared dataset (its manifest differs); the data "
            "order will not continue exactly",
            flush=True,
        )


def document_mask_change(saved: int | None, now: int | None) -> list[str]:
    """A resume that turns document masks on or off (loader.document_mask): said, not refused."""
    if saved == now:
        return []
    if now is None:
        return [
            "loader.document_mask is off at this resume: from here sequences attend across documents again"
        ]
    was = "on" if saved is not None else "off"
    return [f"loader.document_mask is on at this resume (it was {was}, end-of-text {saved} -> {now}): from here "
            "tokens attend only within their document, their positions counted from its start"]  # fmt: skip


def accumulation_change(ckpt: Checkpoint, *, precision: PrecisionConfig) -> list[str]:
    """A bf16 resume that sums gradients in another dtype than the checkpoint's run (DeepSpeed loads
    one's optimizer state into the other). A checkpoint from before precision.grad_accum_dtype summed
    them in bf16, DeepSpeed's default."""
    if not precision.bf16:
        return []
    was = ckpt.meta.get("config", {}).get("precision", {}).get("grad_accum_dtype", "bf16")
    now = precision.grad_accum_dtype
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
    load_universal_next(engine, ckpt.universal)
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
