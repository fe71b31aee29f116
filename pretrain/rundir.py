"""What a run records about itself at start: resolved config, DeepSpeed JSON, versions, code."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from pretrain.config import RunConfig, to_yaml

PACKAGES = ["pretrain", "torch", "deepspeed", "numpy", "pydantic", "tiktoken", "mpi4py"]


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    try:
        import torch  # loaded already where a run records its versions

        out["cuda"] = str(torch.version.cuda)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return out


def code_version() -> dict[str, Any]:
    """The git commit of this source tree, and whether it had uncommitted changes."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return res.stdout.strip() if res.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def record(run_dir: Path, cfg: RunConfig, ds_config: dict[str, Any]) -> None:
    """Write the run's identity next to its logs and checkpoints (rank 0 only)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    (run_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
    info = {"versions": package_versions(), "code": code_version(), "argv": sys.argv}
    (run_dir / "versions.json").write_text(json.dumps(info, indent=2) + "\n")
