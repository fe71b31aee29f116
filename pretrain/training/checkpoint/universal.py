"""DeepSpeed's universal checkpoint of one of ours (`pretrain convert`, and a resume on another world
size, ZeRO stage or layout): written beside the checkpoint it converts, atomically, and verified
like any other."""

from __future__ import annotations

import json
import os
import shutil
from argparse import Namespace
from pathlib import Path
from typing import Any

from pretrain.errors import CheckpointError
from pretrain.files import replace_dir, write_atomic
from pretrain.training.checkpoint.resume import locate
from pretrain.training.checkpoint.store import (
    META,
    TMP,
    TRASH,
    UNIVERSAL,
    describe,
    read_meta,
    safe_loading,
    saved_layout,
    seal,
    verify,
)


def convert_to_universal(src: Path, workers: int = 1, checksums: bool = True) -> tuple[Path, bool]:
    """Write DeepSpeed's universal checkpoint of `src` into `src/universal`, atomically; (its path,
    False) when a sound one of ours is there already. Anything else at that path that this project
    did not write is refused and kept; an unsound one of ours is replaced."""
    src = locate(src, checksums=checksums)
    meta = read_meta(src)
    if meta.get("format") == "universal":
        raise CheckpointError(f"{src} is a universal checkpoint already; `train --resume {src}` loads it")
    if int(meta.get("zero_stage", 0)) == 0 and saved_layout(meta).shape != (1, 1):
        tp, pp = saved_layout(meta).shape
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
    out, tmp = src / UNIVERSAL, src / f"{TMP}{UNIVERSAL}"
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
        old = src.parent / f"{TRASH}{src.name}-{UNIVERSAL}-{os.getpid()}"
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
        str(p.relative_to(tmp)): describe(p, checksums, fsync=True)
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    }
    umeta = {**meta, "format": "universal", "tag": f"{src.name}/{UNIVERSAL}", "files": files}
    write_atomic(tmp / META, json.dumps(seal(umeta), indent=1) + "\n")
    replace_dir(tmp, out)


def convert_and_say(src: Path, *, workers: int, checksums: bool) -> str:
    """`pretrain convert`: the conversion, and what it wrote and how a run continues it."""
    out, wrote = convert_to_universal(src, workers=workers, checksums=checksums)
    pipeline = saved_layout(read_meta(out)).pipeline
    # A pipeline's parameters are named by stage layer, the GPT's by module: it resumes as a pipeline only.
    where = "on any world size" if pipeline == 1 else f"on any world size with parallel.pipeline={pipeline}"
    return (
        f"{'wrote the universal checkpoint' if wrote else 'already converted, and sound:'} {out}\n"
        f"`pretrain train --resume auto` (same run dir) now continues it {where}; or pass --resume {out}"
    )
