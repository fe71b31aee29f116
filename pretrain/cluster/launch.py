"""Launching on many hosts: the hostfile, and the environment every rank gets (`.deepspeed_env`).

A hostfile says which hosts a multi-node launch uses and how many ranks (slots) each runs. The
format is DeepSpeed's (`deepspeed.launcher.runner._parse_hostfile`), one host a line:

    # comment
    node-01 slots=8
    node-02 slots=8

Every hostfile DeepSpeed accepts with positive slots and plain host names parses here to the same
ordered mapping, and every one it rejects is rejected here too, with a message that names the
line and the fix. On top of DeepSpeed's rules this parser refuses zero slots, text glued to the
slot count (`slots=8x`), and host names with anything but letters, digits, '.', '-' and '_', so
that no shell metacharacter from a hostfile ever reaches a pdsh, ssh or mpirun command line.

A comment line DeepSpeed ignores can say what the hosts are, for `pretrain plan`
(`hostfile_target`):

    # pretrain: device=A100-80GB host-gb=1024
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pretrain.config.run_sections import LaunchConfig
from pretrain.errors import HostfileError, OutputError
from pretrain.files import not_ours, read_bytes, write_atomic

# DeepSpeed's own pattern, applied with re.search to the stripped line.
_DS_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")
# Host names and IPv4 addresses: RFC 1123 labels, plus '_' which some clusters use.
_HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


def valid_host(name: str) -> bool:
    """True for a host name safe to put on a command line unquoted (no shell metacharacters)."""
    return bool(_HOST.match(name)) and ".." not in name


MAX_HOSTFILE_BYTES = 16_000_000
MAX_SLOTS = 1024  # accelerators one host can have; a larger count is a typo


def parse_hostfile(text: str, source: str = "<text>") -> dict[str, int]:
    """Hosts in file order mapped to their slots; raises HostfileError listing every bad line."""
    hosts: dict[str, int] = {}
    problems: list[str] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _DS_LINE.search(line)
        where = f"line {n} {line[:80]!r}{'...' if len(line) > 80 else ''}"
        if not m:
            problems.append(f"{where}: expected '<host> slots=<N>', e.g. 'node-01 slots=8'")
            continue
        host, digits = m.group(1), m.group(2).lstrip("0") or "0"
        slots = int(digits) if len(digits) <= 6 else MAX_SLOTS + 1
        problem = _line_problem(m, line[m.end() :], hosts, slots=slots)
        if problem:
            problems.append(f"{where}: {problem}")
        else:
            hosts[host] = slots
    if not hosts and not problems:
        problems.append("no hosts: the file is empty or only comments; add lines like 'node-01 slots=8'")
    if problems:
        raise HostfileError(problems, source)
    return hosts


def _line_problem(m: re.Match[str], rest: str, hosts: dict[str, int], *, slots: int) -> str | None:
    """What is wrong with a hostfile line that matched DeepSpeed's pattern (`m`, `rest` the text after
    it), given the hosts of the lines before; None: nothing."""
    host = m.group(1)
    if rest and not rest[0].isspace():
        return "slots must be a whole number followed by a space or the end"
    if re.search(r"(^|\s)slots=", rest):
        return "slots given twice; give one 'slots=<N>' per line"
    if slots > MAX_SLOTS:
        return (
            f"{m.group(2)[:12]}{'...' if len(m.group(2)) > 12 else ''} slots; slots is the number "
            f"of accelerators (GPUs) on the host, at most {MAX_SLOTS}"
        )
    if not valid_host(host):
        return f"{host!r} is not a host name (letters, digits, '.', '-' and '_' only)"
    if slots == 0:
        return "zero slots; remove the line or give the number of accelerators"
    if host in hosts:
        return f"{host} is listed twice; give each host one line with all its slots"
    if (same := next((h for h in hosts if h.lower() == host.lower()), None)) is not None:
        return (
            f"{host} is {same} again (host names ignore case), which would start its ranks twice on "
            "one machine; give each host one line with all its slots"
        )
    return None


def read_hostfile(path: str | Path) -> dict[str, int]:
    p = Path(path)
    if not p.is_file():
        what = "not a regular file" if p.exists() else "no such file"
        raise HostfileError([f"{p}: {what}"], str(p))
    try:
        if (size := p.stat().st_size) > MAX_HOSTFILE_BYTES:
            raise HostfileError(
                [f"{size:,} bytes; a hostfile is one short line per host: is it the right file?"], str(p)
            )
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise HostfileError(
            [f"not UTF-8 text ({e.reason} at byte {e.start}); is it the right file?"], str(p)
        ) from None
    except OSError as e:
        raise HostfileError([f"unreadable ({e.strerror or e})"], str(p)) from None
    return parse_hostfile(text, str(p))


# `# pretrain: key=value ...`: what the hostfile's hosts are (all alike), for `pretrain plan`.
_TARGET_LINE = re.compile(r"^#\s*pretrain\s*:(.*)$")
TARGET_KEYS = {
    "device": "the accelerator of every host, as `plan --gpu` takes it (A100-80GB, H100, cpu)",
    "device-gb": "one accelerator's memory in GB (default: from the device's name)",
    "host-gb": "one host's memory in GB, for the offloaded states",
}


def hostfile_target(path: str | Path) -> tuple[dict[str, str | float], str]:
    """The hostfile's `# pretrain: device=... host-gb=...` line as {key: value}, and where it is
    ('{path} line N'); ({}, '') when it has none. Every bad key or value is named at once."""
    p = Path(path)
    read_hostfile(p)  # the file's own checks first
    found: dict[str, str | float] = {}
    problems: list[str] = []
    where = ""
    for n, raw in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        m = _TARGET_LINE.match(raw.strip())
        if not m:
            continue
        if where:
            problems.append(f"line {n}: a second '# pretrain:' line ({where} is the first); keep one")
            continue
        where = f"{p} line {n}"
        for item in m.group(1).split():
            key, eq, value = item.partition("=")
            if key not in TARGET_KEYS or not eq or not value:
                problems.append(
                    f"line {n}: {item!r}: expected key=value with a key of "
                    + ", ".join(f"{k} ({v})" for k, v in TARGET_KEYS.items())
                )
            elif key == "device":
                if not re.fullmatch(r"[A-Za-z0-9._-]+", value):
                    problems.append(f"line {n}: device={value!r}: a device name, e.g. A100-80GB")
                found[key] = value
            else:
                try:
                    number = float(value)
                except ValueError:
                    number = -1.0
                if not 0 < number < 1e7:
                    problems.append(f"line {n}: {key}={value!r}: a positive number of GB, e.g. {key}=80")
                found[key] = number
    if problems:
        raise HostfileError(problems, str(p))
    return found, where


def format_hostfile(hosts: dict[str, int]) -> str:
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts.items())


# Set by mpirun/mpiexec of Open MPI, MPICH/Hydra (PMI) and PMIx-based launchers.
MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def launcher(env: Mapping[str, str] | None = None) -> Literal["env", "slurm", "mpi", "none"]:
    """What started this process, in the order its variables are trusted: "env" when RANK is set
    (deepspeed's launcher, torchrun), "slurm" in a Slurm job step (srun), "mpi" under an MPI
    launcher (mpirun, mpiexec), "none" for a plain command. The one detection `ranks.launch_env`
    and `launcher_world_size` share."""
    e = os.environ if env is None else env
    if "RANK" in e:
        return "env"
    if "SLURM_STEP_NUM_TASKS" in e and "SLURM_PROCID" in e:
        return "slurm"
    if any(v in e for v in MPI_LAUNCHER_VARS):
        return "mpi"
    return "none"


def launcher_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """The world size as the launcher's variables give it, read without torch: RANK's WORLD_SIZE,
    a Slurm step's task count, the size an MPI launcher exports (the one launch_env holds mpi4py
    to), 1 without a launcher; None where only mpi4py knows."""
    e = os.environ if env is None else env
    kind = launcher(e)
    if kind == "none":
        return 1
    size = {
        "env": e.get("WORLD_SIZE", ""),
        "slurm": e.get("SLURM_STEP_NUM_TASKS", ""),
        "mpi": e.get("OMPI_COMM_WORLD_SIZE") or e.get("PMI_SIZE") or "",
    }[kind]
    return int(size) if size.isdigit() and int(size) > 0 else None


def world_size(hosts: dict[str, int]) -> int:
    return sum(hosts.values())


def launch_environment(cfg: LaunchConfig) -> dict[str, str]:
    """The variables every rank on every host gets, from the config's `launch` section."""
    env: dict[str, str] = {}
    if cfg.socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = cfg.socket_ifname
        env["GLOO_SOCKET_IFNAME"] = cfg.socket_ifname
    if cfg.ib_hca:
        env["NCCL_IB_HCA"] = cfg.ib_hca
    if cfg.nccl_debug:
        env["NCCL_DEBUG"] = cfg.nccl_debug
    if cfg.nccl_ib_timeout is not None:
        env["NCCL_IB_TIMEOUT"] = str(cfg.nccl_ib_timeout)
    # A rank whose peer died raises after the process-group timeout instead of hanging on NCCL.
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    env.update({k: str(v) for k, v in cfg.env.items()})
    return env


def env_file_text(env: dict[str, str]) -> str:
    """`.deepspeed_env` format: KEY=VALUE lines, read by DeepSpeed's multi-node runners and launch/*.sh."""
    return "".join(f"{k}={v}\n" for k, v in env.items())


def write_env_file(out: Path, env: dict[str, str]) -> None:
    """`launch-env --output`: the environment file written, atomically, where `out` holds no more than
    this command writes (another setting in it is kept: refused, with the lines to add by hand)."""
    text = env_file_text(env)
    ours = set(env)

    def lost(data: bytes) -> list[str]:
        theirs = {line.split("=", 1)[0].strip() for line in data.decode(errors="replace").splitlines()}
        return sorted(k for k in theirs - ours if k)

    if not_ours([out], lambda data: not lost(data)):
        old = read_bytes(out)
        what = f"settings this command does not write ({', '.join(lost(old)[:4])})" if old else "no env file"
        raise OutputError(
            f"--output {out}: holds {what}; refusing to overwrite it: choose another file, or add these "
            f"lines to it yourself:\n{text}"
        )
    write_atomic(out, text)
