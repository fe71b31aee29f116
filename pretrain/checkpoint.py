"""Checkpoints through `engine.save_checkpoint`, one tag per step, keeping the newest K."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as tdist

META = "pretrain_meta.json"
_TAG = re.compile(r"^step_(\d{8})$")


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def list_tags(ckpt_dir: Path) -> list[str]:
    """Complete checkpoint tags, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p.name for p in ckpt_dir.iterdir() if _TAG.match(p.name) and (p / META).is_file())


def save(engine: Any, ckpt_dir: Path, step: int, client_state: dict[str, Any], keep_last: int) -> str:
    """Save on every rank (DeepSpeed needs each rank's shards), then prune on rank 0."""
    tag = tag_for(step)
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state)
    tdist.barrier()
    if tdist.get_rank() == 0:
        # A small plain-JSON copy of the client state, readable before (and without) loading.
        (ckpt_dir / tag / META).write_text(json.dumps(client_state, indent=1) + "\n")
        for old in list_tags(ckpt_dir)[:-keep_last]:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    tdist.barrier()
    return tag


def latest_tag(ckpt_dir: Path) -> str | None:
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if (ckpt_dir / tag / META).is_file():
            return tag
    tags = list_tags(ckpt_dir)
    return tags[-1] if tags else None


def read_meta(ckpt_dir: Path, tag: str) -> dict[str, Any]:
    path = ckpt_dir / tag / META
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; not a complete pretrain checkpoint")
    return dict(json.loads(path.read_text()))


def load(engine: Any, ckpt_dir: Path, tag: str) -> dict[str, Any]:
    """Load model, optimizer and scheduler state; returns the client state saved with it."""
    path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=tag)
    if path is None:
        raise RuntimeError(f"{ckpt_dir / tag}: DeepSpeed could not load this checkpoint")
    return dict(client_state or {})
