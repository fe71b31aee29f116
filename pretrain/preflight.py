"""`pretrain preflight`: check every host of a hostfile before a multi-node run spends GPU-hours.

Preflight runs `pretrain/cluster/probe.py` on every host at once (`ssh HOST 'cd REPO && PYTHON - ...'`),
compares what comes back, then times an all-reduce across all ranks. It reaches each host the way
DeepSpeed's launcher will (`launch_ssh_hosts`): over ssh, with DeepSpeed's options, to every host
the launch ssh'es to, localhost included; without ssh where the launch needs none (`--no_ssh`, or a
hostfile of this machine alone, which preflight takes as the one-machine launch and for which it
still tries DeepSpeed's ssh check, as a warning).
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.cluster import probe
from pretrain.cluster.launch import launch_environment
from pretrain.cluster.ops import needed_ops
from pretrain.cluster.reach import (
    LOCAL_HOSTS,
    deepspeed_ssh_check,
    last_line,
    launch_ssh_hosts,
    passwordless_fix,
    run,
    ssh_argv,
)
from pretrain.config.ds_render import render_deepspeed
from pretrain.config.run_sections import LaunchConfig
from pretrain.config.tree import RunConfig
from pretrain.data.dataset import MANIFEST, SPLITS, dataset_dirs, resolve_vocab
from pretrain.data.shards import HEADER_SIZE
from pretrain.errors import CheckpointError
from pretrain.files import format_bytes, write_atomic

VERSION_KEYS = ("python", "torch", "deepspeed", "cuda", "nccl")
# What each op is for. Both are built into DeepSpeed together, as setup.sh does: a reinstall of
# DeepSpeed keeps only the ops it was told to build.
OP_USES = {
    "fused_adam": "FusedAdam, for optimizer.fused_adam",
    "cpu_adam": "DeepSpeedCPUAdam, for optimizer offload",
}
OP_BUILD = "DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1"


@dataclass
class Problem:
    host: str
    check: str
    what: str
    fix: str


@dataclass
class Options:
    hostfile: str
    hosts: dict[str, int]
    python: str = sys.executable
    cwd: str = str(Path.cwd())
    master_addr: str | None = None
    master_port: int = 29500
    ssh_port: int | None = None
    no_ssh: bool = False  # as deepspeed --no_ssh (launch/no_ssh.sh): every host starts its own ranks
    no_ssh_check: bool = False  # as deepspeed --no_ssh_check: no ssh check of the first host
    checksums: bool = True
    allreduce: bool = True
    allreduce_mb: float | None = None  # None: 256 MiB on GPUs, 8 MiB on CPUs
    timeout_s: float = 120.0
    resume: str | None = None  # train's --resume: "auto" or a path


@dataclass
class Report:
    rows: dict[str, dict[str, str]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)  # reported; the launch works regardless
    allreduce: dict[str, Any] | None = None


def one_machine(opts: Options) -> bool:
    """A hostfile of this machine alone (`localhost slots=N`): preflight takes it as the one-machine
    launch, without ssh (`deepspeed --num_gpus N` without a hostfile, or launch/no_ssh.sh H 0)."""
    return len(opts.hosts) == 1 and next(iter(opts.hosts)) in LOCAL_HOSTS


def over_ssh(host: str, opts: Options) -> bool:
    """Whether preflight reaches `host` over ssh: every host the launch ssh'es to, localhost included;
    this machine otherwise not; any other host always, since preflight has no other way there."""
    if one_machine(opts):
        return False
    if host in launch_ssh_hosts(list(opts.hosts), opts.no_ssh, opts.no_ssh_check):
        return True
    return host not in LOCAL_HOSTS and host != socket.gethostname()


def run_probe(
    host: str, mode: str, args: dict[str, Any], opts: Options, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run probe.py on one host: its source on stdin, under the launch's interpreter and directory."""
    prefix = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []
    argv = [*prefix, opts.python, "-", mode, json.dumps(args)]
    if over_ssh(host, opts):
        remote = f"cd {shlex.quote(opts.cwd)} && exec {shlex.join(argv)}"
        cmd, cwd = ssh_argv(host, opts.ssh_port, remote), None
    else:
        cmd, cwd = argv, opts.cwd
    return run(cmd, opts.timeout_s, cwd, Path(probe.__file__).read_text())


def inspect_hosts(cfg: RunConfig, opts: Options, report: Report) -> dict[str, dict[str, Any]]:
    """Probe every host in parallel; record unreachable ones. Returns the probes that answered."""
    from pretrain.training.checkpoint.store import estimate_bytes  # torch, for the model's parameter count

    first = next(iter(opts.hosts))
    common = {
        "ops": needed_ops(render_deepspeed(cfg)),
        "data_dirs": [str(d) for d in dataset_dirs(cfg.data)],
        "manifest": MANIFEST,
        "splits": list(SPLITS),
        "header_size": HEADER_SIZE,
        "checksums": opts.checksums,
        "ckpt_dir": str(cfg.run_dir() / cfg.checkpoint.dir),
        # Without a local manifest the probes report the data, and the estimate uses the tokenizer's size.
        "ckpt_bytes": estimate_bytes(resolve_vocab(cfg)),
    }
    env = launch_environment(cfg.launch)  # the ranks' environment: where ops build, which ninja and compiler
    # One machine: probed without ssh, but `deepspeed --hostfile` still runs its ssh check first, and
    # stops there if it fails: so does preflight (unless --no-ssh or --no-ssh-check, as DeepSpeed's).
    check_anyway = one_machine(opts) and bool(launch_ssh_hosts([first], opts.no_ssh, opts.no_ssh_check))

    def one(
        host: str,
    ) -> tuple[str, subprocess.CompletedProcess[str], subprocess.CompletedProcess[str] | None]:
        args = {**common, "port": opts.master_port if host == first else None}
        check = run(ssh_argv(host, opts.ssh_port, "hostname"), opts.timeout_s) if check_anyway else None
        return host, run_probe(host, "inspect", args, opts, env), check

    answers: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(opts.hosts))) as pool:
        for host, res, check in pool.map(one, opts.hosts):
            row = report.rows[host] = {"host": host, "slots": str(opts.hosts[host])}
            if check is not None and check.returncode != 0:
                row["ssh"] = "FAIL"
                report.problems.append(_local_ssh_problem(host, opts, check))
            if res.returncode == 255 and over_ssh(host, opts):
                row["ssh"] = "FAIL"
                report.problems.append(_ssh_problem(host, opts, res))
                continue
            row.setdefault("ssh", "ok" if over_ssh(host, opts) else "local")
            try:
                answers[host] = json.loads(res.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                row["python"] = "FAIL"
                report.problems.append(
                    Problem(
                        host,
                        "probe",
                        f"`cd {opts.cwd} && {opts.python}` failed: {last_line(res.stderr)}",
                        f"put the repository at {opts.cwd} and its venv at {opts.python} on every host "
                        "(a shared filesystem, or the same paths), then rerun preflight",
                    )
                )
    return answers


def _ssh_problem(host: str, opts: Options, res: subprocess.CompletedProcess[str]) -> Problem:
    hosts = list(opts.hosts)
    if host not in launch_ssh_hosts(hosts, opts.no_ssh, opts.no_ssh_check):
        return Problem(
            host,
            "ssh",
            f"not reachable over ssh without a password ({last_line(res.stderr)}): the launch does not "
            "ssh there, but preflight does",
            f"{passwordless_fix(host)}; or run preflight on {host} itself",
        )
    if host == hosts[0] and not opts.no_ssh_check:
        how = f"its launcher first runs `{deepspeed_ssh_check(host, opts.ssh_port)}`, and stops if that fails"
    else:
        how = "pdsh starts the ranks there over ssh"
    return Problem(
        host,
        "ssh",
        f"not reachable over ssh without a password ({last_line(res.stderr)}); "
        f"`deepspeed --hostfile` (launch/pdsh.sh) ssh'es to every host here: {how}",
        f"{passwordless_fix(host)}; or launch without ssh, launch/no_ssh.sh {opts.hostfile} NODE_RANK on every "
        "host (deepspeed --no_ssh), and check that launch with preflight --no-ssh",
    )


def _local_ssh_problem(host: str, opts: Options, check: subprocess.CompletedProcess[str]) -> Problem:
    return Problem(
        host,
        "ssh",
        f"`deepspeed --hostfile {opts.hostfile}` (launch/pdsh.sh) stops at its ssh check, even for this "
        f"machine: `{deepspeed_ssh_check(host, opts.ssh_port)}` fails ({last_line(check.stderr)})",
        f"{passwordless_fix(host)}; or launch without ssh: launch/no_ssh.sh {opts.hostfile} 0 (deepspeed "
        "--no_ssh), or deepspeed without --hostfile, and check that launch with `pretrain preflight --no-ssh`",
    )


def compare(cfg: RunConfig, opts: Options, answers: dict[str, dict[str, Any]], report: Report) -> None:
    """Versions against the first host that answered; every other check against its own threshold."""
    if not answers:
        return
    ref_host = next(h for h in opts.hosts if h in answers)
    ref = answers[ref_host]
    first = next(iter(opts.hosts))
    for host, a in answers.items():
        row, v = report.rows[host], a["versions"]
        for key in VERSION_KEYS:
            row[key] = v[key]
        for key in VERSION_KEYS:
            if v[key] != ref["versions"][key]:
                row[key] = f"{v[key]} FAIL"
                report.problems.append(
                    Problem(
                        host,
                        "versions",
                        f"{key} {v[key]} ({v['executable']}), but {ref['versions'][key]} on {ref_host}",
                        f"install the same environment on every host, with the venv at {opts.python} "
                        f"(e.g. run ./setup.sh on {host})",
                    )
                )
            elif key in ("torch", "deepspeed") and v[key] == "not installed":
                row[key] = "FAIL"
                report.problems.append(
                    Problem(
                        host, "versions", f"{key} is not installed for {v['executable']}", "run ./setup.sh"
                    )
                )
        kind = "CUDA GPUs" if v["accelerator"] == "cuda" else "CPU cores"
        row["accel"] = f"{v['accelerators']} {v['accelerator']}"
        if v["accelerators"] < opts.hosts[host]:
            row["accel"] += " FAIL"
            report.problems.append(
                Problem(
                    host,
                    "accelerators",
                    f"{opts.hosts[host]} slots in {opts.hostfile} but {v['accelerators']} {kind}",
                    f"set '{host} slots={v['accelerators']}' in {opts.hostfile}, or bring the missing "
                    "devices back (nvidia-smi on the host)",
                )
            )
        _check_ops(host, a.get("ops") or {}, v, opts, report)
        _check_data(host, a.get("data"), ref.get("data"), ref_host, cfg, report)
        _check_ckpt(host, a.get("ckpt"), cfg, report)
        if host == first and "port" in a:
            row["port"] = "free" if a["port"]["free"] else "FAIL"
            if not a["port"]["free"]:
                report.problems.append(
                    Problem(
                        host,
                        "master port",
                        f"port {opts.master_port} is in use ({a['port'].get('error')})",
                        f"pick a free port (MASTER_PORT=<port> launch/..., or --master-port), or stop "
                        f"what listens there: ss -ltnp 'sport = :{opts.master_port}' on {host}",
                    )
                )


def _check_ops(
    host: str, ops: dict[str, dict[str, str]], v: dict[str, Any], opts: Options, report: Report
) -> None:
    """Each DeepSpeed op the config loads: built (into DeepSpeed, or by an earlier JIT build), only
    buildable (a warning: every host compiles it on first use), or neither (a problem)."""
    row = report.rows[host]
    row["ops"] = ",".join(f"{name}:{o['state']}" for name, o in ops.items()) or "-"
    install = (
        f"DS_ACCELERATOR={v['accelerator']} {OP_BUILD} {opts.python} -m pip install --no-build-isolation "
        f"--no-cache-dir --force-reinstall --no-deps deepspeed=={v['deepspeed']}"
    )
    if v["cuda"] != "-":  # setup.sh builds the ops with a CUDA torch, and with a CPU one if asked to
        install = f"./setup.sh on {host} (PRETRAIN_BUILD_OPS=0 would skip the build), or {install}"
    else:
        install = f"PRETRAIN_BUILD_OPS=1 ./setup.sh on {host}, or {install}"
    if any(o["state"] == "missing" for o in ops.values()):
        row["ops"] += " FAIL"
    for name, o in ops.items():
        if o["state"] == "missing":
            report.problems.append(
                Problem(
                    host,
                    "ops",
                    f"DeepSpeed's {name} op ({OP_USES[name]}) is not built, and cannot be built here: {o['why']}",
                    f"give {host} what the build lacks, then build the op into DeepSpeed once: {install}",
                )
            )
        elif o["state"] == "buildable":
            report.warnings.append(
                Problem(
                    host,
                    "ops",
                    f"DeepSpeed's {name} op ({OP_USES[name]}) is not built: it will JIT-compile on first use, "
                    f"~1 min per host (into {o['path']})",
                    f"build it into DeepSpeed once: {install}",
                )
            )


def _check_data(
    host: str,
    d: dict[str, Any] | None,
    ref: dict[str, Any] | None,
    ref_host: str,
    cfg: RunConfig,
    report: Report,
) -> None:
    if d is None:
        return
    row, dirs = report.rows[host], dataset_dirs(cfg.data)
    if all((where / MANIFEST).is_file() for where in dirs):
        copies = "; ".join(f"rsync -a {w.resolve()}/ {host}:{w.resolve()}/" for w in dirs)
        fix = f"copy the dataset to {host} at the same path ({copies}), or keep it on a filesystem every host mounts"
    else:
        fix = (
            "prepare it first, on a filesystem every host mounts (or on each host): "
            "pretrain data prepare [the same config args]"
        )
    if not d["ok"]:
        row["data"] = "FAIL"
        report.problems.append(Problem(host, "data", d["problem"], fix))
    elif ref and ref.get("ok") and d["manifest_sha256"] != ref["manifest_sha256"]:
        row["data"] = "FAIL"
        report.problems.append(
            Problem(host, "data", f"the dataset's {MANIFEST} differs from {ref_host}'s: other data", fix)
        )
    else:
        row["data"] = f"ok ({d['shards']} shards)"


def _check_ckpt(host: str, c: dict[str, Any] | None, cfg: RunConfig, report: Report) -> None:
    if c is None:
        return
    row = report.rows[host]
    row["checkpoint"] = f"{format_bytes(c['free'])} free"
    if not c["writable"]:
        row["checkpoint"] = "FAIL"
        report.problems.append(
            Problem(
                host,
                "checkpoint",
                f"{c['path']} is not writable ({c.get('error')})",
                "make it writable for this user, or point logging.run_dir / checkpoint.dir elsewhere",
            )
        )
    elif c["free"] < c["need"]:
        row["checkpoint"] += " FAIL"
        report.problems.append(
            Problem(
                host,
                "checkpoint",
                f"{c['path']}: {format_bytes(c['free'])} free, one checkpoint needs about {format_bytes(c['need'])}",
                "free space there, or point logging.run_dir / checkpoint.dir at a larger filesystem",
            )
        )


def time_allreduce(
    opts: Options, answers: dict[str, dict[str, Any]], report: Report, *, launch: LaunchConfig
) -> None:
    """One process per slot on every host, one job-wide group, a timed all-reduce."""
    hosts = list(opts.hosts)
    cuda = all(answers[h]["versions"]["accelerator"] == "cuda" for h in hosts)
    mb = opts.allreduce_mb or (256 if cuda else 8)
    world = sum(opts.hosts.values())
    base, rank_base = 0, {}
    for h in hosts:
        rank_base[h], base = base, base + opts.hosts[h]
    common = {
        "world": world,
        "master_addr": opts.master_addr or hosts[0],
        "master_port": opts.master_port,
        "bytes": int(mb * 2**20) // 4 * 4,
        "iters": 10 if cuda else 5,
        "timeout": max(10, int(opts.timeout_s) - 10),
    }
    env = launch_environment(launch)

    def one(host: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        args = {**common, "rank_base": rank_base[host], "slots": opts.hosts[host]}
        return host, run_probe(host, "allreduce", args, opts, env)

    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        results = dict(pool.map(one, hosts))
    failed = [h for h, r in results.items() if r.returncode != 0]
    try:
        report.allreduce = json.loads(results[hosts[0]].stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        report.allreduce = None
    if failed or report.allreduce is None or not report.allreduce.get("correct"):
        for h in failed or hosts[:1]:
            report.rows[h]["all-reduce"] = "FAIL"
            report.problems.append(
                Problem(
                    h,
                    "all-reduce",
                    f"{world}-rank all-reduce failed: {last_line(results[h].stderr)}",
                    f"every host must reach {common['master_addr']}:{opts.master_port} and each other over "
                    "TCP; set launch.socket_ifname to the interface that connects them (NCCL_SOCKET_IFNAME, "
                    "GLOO_SOCKET_IFNAME), check firewalls, and rerun with --set launch.nccl_debug=INFO",
                )
            )
    else:
        for h in hosts:
            report.rows[h]["all-reduce"] = "ok"


COLUMNS = ("host", "slots", "ssh", *VERSION_KEYS, "accel", "ops", "data", "checkpoint", "port", "all-reduce")
OPTIONAL = {"ops"}  # shown only when some host has something in it: a config that needs no op has no column


def format_report(report: Report) -> str:
    rows = report.rows.values()
    cols = [c for c in COLUMNS if any(r.get(c, "-") != "-" if c in OPTIONAL else c in r for r in rows)]
    table = [list(cols)] + [[r.get(c, "-") for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in table
    ]
    if report.allreduce:
        a = report.allreduce
        lines.append(
            f"all-reduce: {a['world']} ranks ({a['backend']}), {a['bytes'] / 2**20:.0f} MiB in "
            f"{a['seconds'] * 1e3:.1f} ms: bus bandwidth {a['busbw'] / 1e9:.2f} GB/s "
            f"(algorithm {a['algbw'] / 1e9:.2f} GB/s)"
        )
    for kind, found in (("WARN", report.warnings), ("FAIL", report.problems)):
        for p in found:
            lines += [f"{kind} {p.host}: {p.check}: {p.what}", f"     fix: {p.fix}"]
    n_hosts = len({p.host for p in report.problems})
    warned = f", {len(report.warnings)} warning(s)" if report.warnings else ""
    lines.append(
        f"preflight: {len(report.problems)} problem(s) on {n_hosts} host(s){warned}"
        if report.problems
        else f"preflight: all {len(report.rows)} host(s) ready{warned}"
    )
    return "\n".join(lines)


def check_run_dir(cfg: RunConfig, opts: Options, report: Report) -> None:
    """On this machine: no other run holds the run dir, and the checkpoint `--resume` would load
    verifies, through the reader training uses (each one it would skip is a warning)."""
    from pretrain.training import rundir
    from pretrain.training.checkpoint import resume  # torch
    from pretrain.training.checkpoint import store as checkpoint

    host = next(iter(opts.hosts))
    run_dir = cfg.run_dir()
    holder = rundir.holder(run_dir)
    if holder:
        report.problems.append(
            Problem(
                host,
                "run dir",
                f"{run_dir} is in use by another run ({holder})",
                "wait for it, stop it, or set logging.run_dir elsewhere",
            )
        )
    if opts.resume is None:
        return
    ckpt_dir = run_dir / cfg.checkpoint.dir
    skipped: list[str] = []

    def check(p: Path) -> list[str]:
        return checkpoint.verify(p, checksums=opts.checksums)

    try:
        found = resume.resume_path(ckpt_dir, opts.resume, check, skipped.append)
    except CheckpointError as e:
        report.problems.append(Problem(host, "resume", str(e), "pass a valid checkpoint, or its run dir"))
        return
    for note in skipped:
        report.warnings.append(
            Problem(host, "resume", note, "nothing to do: the run resumes from the one before")
        )
    if found is not None:
        report.rows[host]["checkpoint"] = report.rows[host].get("checkpoint", "-") + f", resumes {found.name}"


def preflight(cfg: RunConfig, opts: Options) -> Report:
    report = Report()
    answers = inspect_hosts(cfg, opts, report)
    compare(cfg, opts, answers, report)
    if report.rows:
        check_run_dir(cfg, opts, report)
    if opts.allreduce and not report.problems:
        time_allreduce(opts, answers, report, launch=cfg.launch)
    return report


def save_allreduce(report: Report, run_dir: Path, hostfile: str) -> None:
    """The all-reduce preflight timed, kept in the run dir for `pretrain plan`'s communication time
    (nothing where it timed none)."""
    if not report.allreduce:
        return
    from pretrain.plan.rates import PREFLIGHT_FILE  # torch, which preflight has loaded already

    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"hostfile": hostfile, "allreduce": report.allreduce}, indent=1) + "\n"
    write_atomic(run_dir / PREFLIGHT_FILE, text)
