"""The files of `ds_configs/`: each rendered from its preset, overrides and world size, written only
into a directory of renders, and checked for being out of date (`pretrain render --all`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pretrain.config.ds_keys import RECORD
from pretrain.config.ds_render import check_with_deepspeed, render_deepspeed
from pretrain.config.presets import build
from pretrain.config.tree import RunConfig
from pretrain.errors import ConfigError, OutputError
from pretrain.files import make_dir, read_bytes, write_atomic

# Files in ds_configs/: name -> (preset, overrides, world size). A test keeps them in sync.
DS_CONFIG_RENDERS: dict[str, tuple[str, list[str], int]] = {
    "zero1": ("gpt2-124m", ["zero.stage=1"], 16),
    "zero2": ("gpt2-124m", ["zero.stage=2"], 16),
    "zero3": ("gpt2-124m", ["zero.stage=3"], 16),
    "zero2_offload": ("gpt-6.7b", [], 16),
    "zero3_offload": ("gpt-6.7b", ["zero.stage=3", "zero.offload_param=true"], 16),
    "cpu_zero2": ("tiny", ["zero.stage=2"], 2),
    # The Llama 2 presets on A100-80GB nodes of 8 (hostfiles/a100x16: 2 nodes, a100x64: 8), each at
    # 1024 sequences a step: on 8 nodes the accumulation shrinks as the data-parallel size grows.
    "llama7b_2x8": ("llama-7b", [], 16),
    "llama7b_8x8": ("llama-7b", ["batch.gradient_accumulation_steps=4"], 64),
    "llama13b_2x8": ("llama-13b", [], 16),
    "llama13b_8x8": ("llama-13b", ["batch.gradient_accumulation_steps=8"], 64),
    "llama70b_8x8": ("llama-70b", [], 64),
}

# `render`'s flags that only `--all` takes, in the order its messages name them.
ALL_ONLY_FLAGS = ("--check", "--out-dir")


def render_json(cfg: RunConfig) -> str:
    """The DeepSpeed JSON of `cfg`, checked by DeepSpeed's own parser."""
    ds = render_deepspeed(cfg)
    check_with_deepspeed(ds)
    return json.dumps(ds, indent=2) + "\n"


def render_file(preset: str, overrides: list[str], world_size: int) -> str:
    """One file of ds_configs/ (DS_CONFIG_RENDERS), as `render --all` writes it."""
    return render_json(build(preset, overrides=overrides, world_size=world_size))


def check_render_flags(*, all_files: bool, given: list[str]) -> None:
    """Refuse the flags of `render` that the other way of rendering would ignore: --check and
    --out-dir without --all, or a config argument (`given`: the flags given, in the order
    --check, --out-dir, then the config arguments) with it."""
    if not all_files:
        only_all = [flag for flag in given if flag in ALL_ONLY_FLAGS]
        if only_all:
            raise ConfigError(
                [
                    f"{' and '.join(only_all)} {'apply' if len(only_all) > 1 else 'applies'} only with --all "
                    "(which renders every file of ds_configs/): add --all, or drop "
                    f"{'them' if len(only_all) > 1 else 'it'} to print this config's JSON"
                ],
                "render",
            )
        return
    config_args = [flag for flag in given if flag not in ALL_ONLY_FLAGS]
    if config_args:
        raise ConfigError(
            [
                f"--all renders each file of ds_configs/ from its own preset, overrides and world size, so "
                f"{', '.join(config_args)} would be ignored: drop {'them' if len(config_args) > 1 else 'it'}, "
                "or drop --all to print the JSON of this config"
            ],
            "render",
        )


@dataclass(frozen=True)
class RenderReport:
    """What `render --all` did: the files it found out of date, and the line it says."""

    out_dir: Path
    stale: list[str]
    checked: bool

    @property
    def exit_code(self) -> int:
        """1 where --check found a file out of date, else 0."""
        return 1 if self.checked and self.stale else 0

    @property
    def message(self) -> str:
        """The line to print: on stderr where exit_code is 1, else on stdout."""
        if self.exit_code:
            return "out of date (run `pretrain render --all`): " + ", ".join(self.stale)
        return (
            f"{'checked' if self.checked else 'wrote'} {len(DS_CONFIG_RENDERS)} files in {self.out_dir}"
            + (f" ({len(self.stale)} changed)" if self.stale and not self.checked else "")
        )


def render_all(out_dir: Path, *, check: bool) -> RenderReport:
    """Render every file of DS_CONFIG_RENDERS into `out_dir`, writing those that changed; with
    `check`, write nothing and report which are out of date."""
    stale, texts = [], {}
    for name, (preset, overrides, world) in DS_CONFIG_RENDERS.items():
        text = render_file(preset, overrides, world)
        path = out_dir / f"{name}.json"
        if read_bytes(path) == text.encode():
            continue
        stale.append(str(path))
        texts[path] = text
    if not check:
        # Only into a directory of this command's files: a DeepSpeed JSON of another project kept under
        # one of these names, or any other file (`--out-dir /`, a home directory), is refused, never
        # lost or mixed with ours.
        foreign = _not_rendered(out_dir)
        if foreign:
            listed = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
            raise OutputError(
                f"--out-dir {out_dir}: {listed} not written by `pretrain render`; refusing to write there: "
                "move them away or choose another --out-dir (a new directory, or one of render's)"
            )
        make_dir(out_dir, "--out-dir", OutputError)
        for path, text in texts.items():
            write_atomic(path, text)
    return RenderReport(out_dir, stale, check)


def _not_rendered(out_dir: Path) -> list[str]:
    """What the directory `out_dir` holds that `render --all` did not write: anything but its JSONs
    (by content, not by name) and the temporary file of a write that was killed."""
    if not out_dir.is_dir():
        return []  # none yet; or a file, which make_dir names
    foreign = []
    for entry in sorted(out_dir.iterdir()):
        if re.fullmatch(r".+\.json\.tmp-\d+", entry.name) and entry.is_file():
            continue
        data = read_bytes(entry) if entry.name.endswith(".json") else None
        if data is None or not _is_render(data):
            foreign.append(str(entry))
    return foreign


def _is_render(data: bytes) -> bool:
    """A DeepSpeed JSON `pretrain render` wrote: it carries our record of the run config."""
    try:
        ds = json.loads(data)
    except ValueError:
        return False
    return isinstance(ds, dict) and isinstance(ds.get(RECORD), dict)
