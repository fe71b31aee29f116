"""`pretrain preflight`: check every host of a hostfile before a multi-node run spends GPU-hours.

DeepSpeed's launcher checks ssh to the first host only. Preflight runs `pretrain/probe.py` on every
host at once over the same ssh the launch will use (`ssh HOST 'cd REPO && PYTHON - ...'`), compares
what comes back, then times an all-reduce across all ranks. A host named `localhost` or
`127.0.0.1` is probed without ssh.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain import probe
from pretrain.config import RunConfig
from pretrain.dataset import MANIFEST, SPLITS, dataset_dirs, resolve_vocab
from pretrain.files import format_bytes
from pretrain.launch import launch_environment
from pretrain.shards import HEADER_SIZE

LOCAL_HOSTS = {"localhost", "127.0.0.1"}
VERSION_KEYS = ("python", "torch", "deepspeed", "cuda", "nccl")


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
    checksums: bool = True
    allreduce: bool = True
    allreduce_mb: float | None = None  # None: 256 MiB on GPUs, 8 MiB on CPUs
    timeout_s: float = 120.0


@dataclass
class Report:
    rows: dict[str, dict[str, str]] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    allreduce: dict[str, Any] | None = None


def run_probe(
    host: str, mode: str, args: dict[str, Any], opts: Options, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run probe.py on one host: its source on stdin, under the launch's interpreter and directory."""
    prefix = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []
    argv = [*prefix, opts.python, "-", mode, json.dumps(args)]
    if host in LOCAL_HOSTS:
        cmd, cwd = argv, opts.cwd
    else:
        remote = f"cd {shlex.quote(opts.cwd)} && exec {shlex.join(argv)}"
        port = ["-p", str(opts.ssh_port)] if opts.ssh_port else []
        cmd, cwd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *port, host, remote], None
    try:
        return subprocess.run(
            cmd,
            input=Path(probe.__file__).read_text(),
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=opts.timeout_s,
        )
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, 124, "", f"no answer in {opts.timeout_s:.0f} s ({e.cmd[0]})")
    except OSError as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def inspect_hosts(cfg: RunConfig, opts: Options, report: Report) -> dict[str, dict[str, Any]]:
    """Probe every host in parallel; record unreachable ones. Returns the probes that answered."""
    from pretrain.checkpoint import estimate_bytes  # torch, for the model's parameter count

    first = next(iter(opts.hosts))
    common = {
        "data_dirs": [str(d) for d in dataset_dirs(cfg.data)],
        "manifest": MANIFEST,
        "splits": list(SPLITS),
        "header_size": HEADER_SIZE,
        "checksums": opts.checksums,
        "ckpt_dir": str(cfg.run_dir() / cfg.checkpoint.dir),
        # Without a local manifest the probes report the data, and the estimate uses the tokenizer's size.
        "ckpt_bytes": estimate_bytes(resolve_vocab(cfg)),
    }

    def one(host: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        args = {**common, "port": opts.master_port if host == first else None}
        return host, run_probe(host, "inspect", args, opts)

    answers: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=min(32, len(opts.hosts))) as pool:
        for host, res in pool.map(one, opts.hosts):
            row = report.rows[host] = {"host": host, "slots": str(opts.hosts[host])}
            if res.returncode == 255 and host not in LOCAL_HOSTS:
                row["ssh"] = "FAIL"
                report.problems.append(
                    Problem(
                        host,
                        "ssh",
                        f"not reachable over ssh without a password ({_last_line(res.stderr)})",
                        f"start sshd on {host} and make `ssh -o BatchMode=yes {host} true` work from this "
                        f"node: the name must resolve, and the key be authorized (ssh-copy-id {host})",
                    )
                )
                continue
            row["ssh"] = "local" if host in LOCAL_HOSTS else "ok"
            try:
                answers[host] = json.loads(res.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                row["python"] = "FAIL"
                report.problems.append(
                    Problem(
                        host,
                        "probe",
                        f"`cd {opts.cwd} && {opts.python}` failed: {_last_line(res.stderr)}",
                        f"put the repository at {opts.cwd} and its venv at {opts.python} on every host "
                        "(a shared filesystem, or the same paths), then rerun preflight",
                    )
                )
    return answers


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


def time_allreduce(cfg: RunConfig, opts: Options, answers: dict[str, dict[str, Any]], report: Report) -> None:
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
    env = launch_environment(cfg.launch)

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
                    f"{world}-rank all-reduce failed: {_last_line(results[h].stderr)}",
                    f"every host must reach {common['master_addr']}:{opts.master_port} and each other over "
                    "TCP; set launch.socket_ifname to the interface that connects them (NCCL_SOCKET_IFNAME, "
                    "GLOO_SOCKET_IFNAME), check firewalls, and rerun with --set launch.nccl_debug=INFO",
                )
            )
    else:
        for h in hosts:
            report.rows[h]["all-reduce"] = "ok"


COLUMNS = ("host", "slots", "ssh", *VERSION_KEYS, "accel", "data", "checkpoint", "port", "all-reduce")


def format_report(report: Report) -> str:
    cols = [c for c in COLUMNS if any(c in r for r in report.rows.values())]
    table = [list(cols)] + [[r.get(c, "-") for c in cols] for r in report.rows.values()]
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
    for p in report.problems:
        lines += [f"FAIL {p.host}: {p.check}: {p.what}", f"     fix: {p.fix}"]
    n_hosts = len({p.host for p in report.problems})
    lines.append(
        f"preflight: {len(report.problems)} problem(s) on {n_hosts} host(s)"
        if report.problems
        else f"preflight: all {len(report.rows)} host(s) ready"
    )
    return "\n".join(lines)


def preflight(cfg: RunConfig, opts: Options) -> Report:
    report = Report()
    answers = inspect_hosts(cfg, opts, report)
    compare(cfg, opts, answers, report)
    if opts.allreduce and not report.problems:
        time_allreduce(cfg, opts, answers, report)
    return report
