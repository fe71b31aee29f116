"""The environment DeepSpeed and torch read, and the DeepSpeed installed, checked before either is
imported. An empty or malformed value is one line naming the variable and the fix, and a DeepSpeed
outside the range the suite passes on (pyproject.toml, docs/dependencies.md) is one line naming the
range, instead of DeepSpeed's traceback from deep inside an
import (`DS_ACCELERATOR=`, as `export DS_ACCELERATOR=$X` leaves it with X unset, is a ValueError from
`get_accelerator()`; `MASTER_PORT=abc` a ValueError from the rendezvous).

Standard library only: the commands that import DeepSpeed call `check()` first (cli.py).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping

from pretrain.errors import PretrainError

# deepspeed.accelerator.real_accelerator.SUPPORTED_ACCELERATOR_LIST (0.19.8; tests/test_environment.py
# holds the two equal).
ACCELERATORS = ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu")

_GPU_ID = re.compile(r"(\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-zA-Z/-]+)")


class EnvironmentVariableError(PretrainError):
    """Variables DeepSpeed or torch read hold values they cannot use: one line for each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def _unset_or(name: str, fix: str) -> str:
    return f"unset it (unset {name}) or {fix}"


def _accelerator(value: str) -> str | None:
    if value in ACCELERATORS:
        return None
    want = (
        ", ".join(ACCELERATORS[:2])
        + " or another DeepSpeed accelerator ("
        + ", ".join(ACCELERATORS[2:])
        + ")"
    )
    return f"{'is set but empty' if not value else f'is {value!r}, not an accelerator DeepSpeed has'}: " + (
        _unset_or("DS_ACCELERATOR", f"set it to {want}; unset, DeepSpeed picks this machine's")
    )


def _port(value: str) -> str | None:
    if value.isdigit() and 1 <= int(value) <= 65535:
        return None
    what = "is set but empty" if not value else f"is {value!r}, not a port number"
    return f"{what}: set it to a free port from 1 to 65535 (e.g. 29500), or unset it"


def _addr(value: str) -> str | None:
    if value.strip() and not any(c.isspace() for c in value):
        return None
    what = "is set but empty" if not value.strip() else f"is {value!r}, with white space in it"
    return f"{what}: set it to rank 0's host name or address (e.g. 127.0.0.1 on one machine), or unset it"


def _whole(meaning: str, least: int = 0) -> Callable[[str], str | None]:
    """A launcher's rank variable: a whole number of at least `least`."""

    def check(value: str) -> str | None:
        if value.isdigit() and int(value) >= least:
            return None
        what = "is set but empty" if not value else f"is {value!r}, not a whole number from {least}"
        return f"{what}: the launcher sets it to {meaning}; unset it to run one rank"

    return check


def _visible(value: str, accelerator: str | None) -> str | None:
    if not value.strip():
        if accelerator == "cpu":
            return None  # every GPU hidden, on purpose: the run is on the CPU
        return "is set but empty, which hides every GPU: " + _unset_or(
            "CUDA_VISIBLE_DEVICES", "name the GPUs (e.g. 0,1); on the CPU also set DS_ACCELERATOR=cpu"
        )
    bad = [v for v in value.split(",") if not _GPU_ID.fullmatch(v.strip())]
    if not bad:
        return None
    return (
        f"is {value!r}: {bad[0].strip()!r} is not a GPU index or UUID: set it to indices (e.g. 0,1) or "
        "GPU-/MIG- UUIDs, comma-separated, or unset it"
    )


def _build_switch(value: str) -> str | None:
    if value in ("0", "1"):
        return None
    what = "is set but empty" if not value else f"is {value!r}"
    return f"{what}: DeepSpeed's build switches take 0 or 1 (1 builds the op at install), or unset it"


UNTESTED_OK = "PRETRAIN_UNTESTED_DEEPSPEED"  # =1: run on a DeepSpeed outside the tested range


def deepspeed_range() -> tuple[str | None, str | None]:
    """The installed DeepSpeed's version and the range pretrain requires of it (its own metadata,
    from pyproject.toml), each None where it is not to be had (an uninstalled checkout)."""
    from importlib.metadata import PackageNotFoundError, requires, version

    try:
        installed: str | None = version("deepspeed")
    except PackageNotFoundError:
        installed = None
    try:
        reqs = requires("pretrain") or []
    except PackageNotFoundError:
        reqs = []
    spec = next((r[len("deepspeed") :].strip() for r in reqs if re.match(r"deepspeed\s*[<>=!~]", r)), None)
    if spec:  # the lower bound first, as pyproject.toml says it (the metadata sorts them)
        spec = ",".join(sorted((p.strip() for p in spec.split(",")), key=lambda p: not p.startswith(">")))
    return installed, spec


def deepspeed_problem(installed: str | None, spec: str | None) -> str | None:
    """Why `installed` is not a DeepSpeed the suite passes on, with the fix; None where it is (or
    either is unknown)."""
    if installed is None or not spec:
        return None
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        if Version(installed) in SpecifierSet(spec, prereleases=True):
            return None
    except InvalidVersion:
        pass
    return (
        f"DeepSpeed {installed} is installed, and pretrain is tested on deepspeed{spec} (docs/dependencies.md): "
        f"pip install 'deepspeed{spec}', or set {UNTESTED_OK}=1 to run on {installed} anyway"
    )


def problems(env: Mapping[str, str] | None = None) -> list[str]:
    """Every variable that is set to a value DeepSpeed or torch cannot use, one line each, in a fixed
    order; an unset variable is never a problem."""
    env = os.environ if env is None else env
    found: list[str] = []
    accel = env.get("DS_ACCELERATOR")
    checks = [
        ("DS_ACCELERATOR", _accelerator),
        ("MASTER_ADDR", _addr),
        ("MASTER_PORT", _port),
        ("LOCAL_RANK", _whole("the rank's index on its host (0, 1, ...)")),
        ("RANK", _whole("the rank's index in the world (0, 1, ...)")),
        ("WORLD_SIZE", _whole("the number of ranks", least=1)),
    ]
    for name, check in checks:
        if name in env:
            why = check(env[name])
            if why:
                found.append(f"{name} {why}")
    if "CUDA_VISIBLE_DEVICES" in env:
        why = _visible(env["CUDA_VISIBLE_DEVICES"], accel)
        if why:
            found.append(f"CUDA_VISIBLE_DEVICES {why}")
    for name in sorted(k for k in env if k.startswith("DS_BUILD_")):
        why = _build_switch(env[name])
        if why:
            found.append(f"{name} {why}")
    found = [f"environment: {p}" for p in found]
    untested = deepspeed_problem(*deepspeed_range())
    if untested and env.get(UNTESTED_OK) != "1":
        found.append(untested)
    return found


def check(env: Mapping[str, str] | None = None) -> None:
    """Raise one error listing every variable DeepSpeed or torch would fail on, and a DeepSpeed outside
    the tested range (a note instead where PRETRAIN_UNTESTED_DEEPSPEED=1 lets it run)."""
    env = os.environ if env is None else env
    found = problems(env)
    untested = deepspeed_problem(*deepspeed_range())
    if untested and env.get(UNTESTED_OK) == "1" and env.get("RANK", "0") == "0":
        print(
            f"note: {untested.split(': pip install')[0]}; running on it, as {UNTESTED_OK}=1 asks",
            file=sys.stderr,
        )
    if found:
        raise EnvironmentVariableError(found)
