"""A launch that checks first: each launch script, before DeepSpeed, mpirun or srun starts, ssh'es to
every host its launcher will (as DeepSpeed's launcher runs ssh) and tries the master port where
rank 0 is this machine; each problem is one line naming the host or the port and the fix, then exit 2.
And the raw `deepspeed` launcher on a taken port ends with one message, not a traceback per rank.

The scripts run for real, with a logging `ssh` on PATH that fails for one host, a fake `mpirun`
that only logs (Open MPI's real one would start ranks), and a port this test holds on loopback.
Host names are documentation addresses (203.0.113.0/24) that this machine does not have: deciding
that they are other machines sends nothing, so no query leaves the machine."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deepspeed.launcher.runner import parse_inclusion_exclusion

from pretrain.cluster.reach import Launch, check, filter_hosts, is_this_machine
from tests.conftest import ROOT, subprocess_env

SCRIPTS = ["pdsh.sh", "no_ssh.sh", "mpirun.sh", "slurm.sbatch"]
# Three documentation addresses this machine does not have (a test machine may have one of them).
HOSTS = [
    a
    for a in (f"{net}.{i}" for net in ("203.0.113", "198.51.100") for i in range(1, 9))
    if not is_this_machine(a)
][:3]
DOWN = HOSTS[1]  # the host the fake ssh cannot reach

# Logs each call (one write, so parallel calls do not interleave), then fails for the hosts in
# $SSH_DOWN as ssh does for a host whose sshd is not running, and answers `hostname` for the others.
FAKE_SSH = """#!/bin/sh
line=$(printf "%s\\037" "$@")
printf "%s\\n" "$line" >> "$SSH_LOG"
skip=0
for a in "$@"; do
    if [ $skip = 1 ]; then skip=0; continue; fi
    case $a in -o|-p|-l|-i|-F) skip=1 ;; -*) ;; *) host=$a; break ;; esac
done
case " $SSH_DOWN " in
    *" $host "*) echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255 ;;
esac
echo "$host"
"""
# Open MPI's `mpirun --version` banner, which mpirun.sh asks for; any other call is a launch, logged.
FAKE_MPIRUN = """#!/bin/sh
if [ "$1" = --version ]; then echo "mpirun (Open MPI) 4.1.4"; exit 0; fi
echo "$@" >> "$MPIRUN_LOG"
"""


@pytest.fixture
def fakes(tmp_path: Path) -> dict[str, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("ssh", FAKE_SSH), ("mpirun", FAKE_MPIRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"bin": bin_dir, "ssh_log": tmp_path / "ssh.log", "mpirun_log": tmp_path / "mpirun.log"}


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port something listens on, on 127.0.0.1, as a leftover run's store would."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


def ssh_calls(log: Path) -> list[list[str]]:
    return [line.split("\x1f")[:-1] for line in log.read_text().splitlines()] if log.exists() else []


def run_script(
    name: str, hostfile: Path, fakes: dict[str, Path], tmp_path: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    """launch/NAME as a person runs it (node rank 0 for no_ssh.sh; slurm.sbatch in a job whose one
    node is this machine, DRY_RUN as the existing Slurm test runs it), with the fakes first on PATH."""
    extra = dict(
        PATH=f"{fakes['bin']}:{os.environ['PATH']}",
        SSH_LOG=str(fakes["ssh_log"]),
        SSH_DOWN=DOWN,
        MPIRUN=str(fakes["bin"] / "mpirun"),
        MPIRUN_LOG=str(fakes["mpirun_log"]),
        PYTHON=sys.executable,
        TMPDIR=str(tmp_path),
    )
    argv = [str(ROOT / "launch" / name), str(hostfile)]
    if name == "no_ssh.sh":
        argv.append(env.pop("NODE_RANK", "0"))
    if name == "slurm.sbatch":
        if shutil.which("scontrol") is None:
            pytest.skip("scontrol not installed (slurm-client, .ci/system-deps)")
        conf = tmp_path / "slurm.conf"
        conf.write_text(
            "ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=ALL\n"
        )
        extra.update(
            SLURM_CONF=str(conf),
            SLURM_JOB_ID="4242",
            SLURM_JOB_NODELIST="localhost",
            SLURM_JOB_NUM_NODES="1",
            SLURM_NTASKS_PER_NODE="1",
            SLURM_SUBMIT_DIR=str(ROOT),
            DRY_RUN="1",
        )
        argv = ["bash", str(ROOT / "launch" / name)]  # the hostfile comes from the allocation
    return subprocess.run(
        argv, cwd=tmp_path, env=subprocess_env(**{**extra, **env}), capture_output=True, text=True, timeout=60
    )


def assert_nothing_started(out: subprocess.CompletedProcess[str], fakes: dict[str, Path]) -> None:
    """No launcher ran: DeepSpeed's runner prints its command and ssh'es without BatchMode (its own
    check, pdsh), mpirun would have logged, srun's dry run would have printed its command."""
    assert "Traceback" not in out.stdout + out.stderr
    assert "deepspeed" not in out.stdout.lower() and "srun" not in out.stdout, out.stdout
    assert not fakes["mpirun_log"].exists()
    assert all("BatchMode=yes" in argv for argv in ssh_calls(fakes["ssh_log"])), ssh_calls(fakes["ssh_log"])


# ---------------------------------------------------------------------------------------------
# (a) a host ssh cannot reach


@pytest.mark.parametrize("name", ["pdsh.sh", "mpirun.sh"])
def test_a_host_ssh_cannot_reach_is_one_line_and_nothing_starts(name, fakes, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    out = run_script(name, hostfile, fakes, tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"launch/{name}: host {DOWN} is not reachable over ssh ")
    assert f"(`ssh -o PasswordAuthentication=no {DOWN} hostname` failed: ssh: connect to host {DOWN} port 22: Connection refused)" in lines[0]  # fmt: skip
    assert f"ssh-copy-id {DOWN}" in lines[0] and f"fix the name in {hostfile}" in lines[0]
    leave_out = (
        f"leave it out with EXCLUDE={DOWN}" if name == "pdsh.sh" else f"remove its line from {hostfile}"
    )
    assert leave_out in lines[0]
    assert_nothing_started(out, fakes)
    # Every host was tried, each once, with DeepSpeed's options and a timeout.
    calls = ssh_calls(fakes["ssh_log"])
    assert sorted(argv[-2] for argv in calls) == sorted(HOSTS)
    options = ["-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o", "ConnectTimeout=10"]
    assert all(argv[:6] == options and argv[-1] == "hostname" for argv in calls), calls


def test_ssh_port_and_exclude_reach_the_check(fakes, tmp_path):
    """pdsh.sh's SSH_PORT is ssh's -p, as deepspeed --ssh_port; EXCLUDE leaves the host out of the
    check (and the next fix extends it); a host EXCLUDE names that the hostfile lacks is refused."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=2\n" for h in HOSTS))
    out = run_script("pdsh.sh", hostfile, fakes, tmp_path, SSH_PORT="2222", EXCLUDE=f"{HOSTS[0]}:0,1")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert f"`ssh -o PasswordAuthentication=no -p 2222 {DOWN} hostname`" in out.stderr
    assert f"EXCLUDE={HOSTS[0]}:0,1@{DOWN}" in out.stderr
    calls = ssh_calls(fakes["ssh_log"])
    assert sorted(argv[-2] for argv in calls) == sorted(HOSTS[1:])  # HOSTS[0] is excluded
    assert all(argv[argv.index("-p") + 1] == "2222" for argv in calls)
    assert_nothing_started(out, fakes)

    fakes["ssh_log"].unlink()
    out = run_script("pdsh.sh", hostfile, fakes, tmp_path, EXCLUDE="node-09")
    assert out.returncode == 2 and "'node-09' is not a host of the hostfile" in out.stderr, out.stderr
    assert not fakes["ssh_log"].exists()


def test_no_ssh_other_nodes_check_the_master_name_not_its_port(fakes, tmp_path, taken_port):
    """Node 1 may start before node 0 opens the port, so it checks only that the master's name
    resolves (this one is refused by the resolver's rules, so no query is sent)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    out = run_script("no_ssh.sh", hostfile, fakes, tmp_path, NODE_RANK="1", MASTER_ADDR="node..01")
    assert out.returncode == 2, out.stdout + out.stderr
    # no host name (an empty label): the script says so before any check
    assert out.stderr == "launch/no_ssh.sh: MASTER_ADDR='node..01' is not a host name or address\n"
    assert_nothing_started(out, fakes)
    hosts = {"localhost": 1, "127.0.0.1": 1}
    # The check itself, given it: the name does not resolve (the resolver refuses it without a query).
    launch = Launch(str(hostfile), hosts, "no-ssh", master_addr="node..01", master_port=29500, node_rank=1)
    problems, _ = check(launch)
    assert len(problems) == 1, problems
    assert problems[0].startswith("the master node..01 (MASTER_ADDR, else the first host")
    assert "does not resolve on this host" in problems[0] and "set MASTER_ADDR" in problems[0]
    # The port rank 0 holds on node 0 is no problem of node 1's.
    launch = Launch(
        str(hostfile), hosts, "no-ssh", master_addr="localhost", master_port=taken_port, node_rank=1
    )
    assert check(launch) == ([], ["node rank 1 is this machine (127.0.0.1)", "the master localhost resolves"])


# A node rank that is not this machine's line: DeepSpeed started the ranks here anyway, and they waited
# on a master that never came, torch printing a `gai error` warning a second, with no word of ours.


def test_no_ssh_on_a_host_that_is_not_its_node_ranks_line_is_one_line(fakes, tmp_path):
    """Node rank 0 run on a machine that is not the hostfile's first host (nor the master): refused
    in seconds, naming the host, this machine, and its own line where it has one."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{HOSTS[0]} slots=8\n{HOSTS[1]} slots=8\n")
    t0 = time.monotonic()
    out = run_script("no_ssh.sh", hostfile, fakes, tmp_path, NODE_RANK="0")
    assert out.returncode == 2 and time.monotonic() - t0 < 30, out.stdout + out.stderr
    me = socket.gethostname()
    assert out.stderr == (
        f"launch/no_ssh.sh: node rank 0 of {hostfile} (0: {HOSTS[0]}, 1: {HOSTS[1]}) is {HOSTS[0]}, not this "
        f"machine ({me}): run it on {HOSTS[0]}; to run here, add this machine to {hostfile} (or fix the name "
        "there) and use its line, from 0\n"
    )
    assert_nothing_started(out, fakes)
    assert not fakes["ssh_log"].exists()

    # This machine on another line: that line is the fix.
    hostfile.write_text(f"{HOSTS[0]} slots=1\nlocalhost slots=1\n")
    out = run_script("no_ssh.sh", hostfile, fakes, tmp_path, NODE_RANK="0")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.endswith("this machine is node rank 1 there (localhost): use that\n"), out.stderr
    assert_nothing_started(out, fakes)


def test_no_ssh_node_0_with_a_master_elsewhere_is_one_line(fakes, tmp_path):
    """Node 0 runs rank 0, whose rendezvous store listens here: a MASTER_ADDR of another machine would
    send every rank to a store that is not there."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    out = run_script("no_ssh.sh", hostfile, fakes, tmp_path, NODE_RANK="0", MASTER_ADDR=HOSTS[2])
    assert out.returncode == 2, out.stdout + out.stderr
    assert (
        out.stderr.startswith(
            f"launch/no_ssh.sh: node 0 runs rank 0, which listens for the rendezvous on this machine "
            f"({socket.gethostname()}), but MASTER_ADDR={HOSTS[2]} is not this machine: set MASTER_ADDR to "
        )
        and len(out.stderr.splitlines()) == 1
    ), out.stderr
    assert_nothing_started(out, fakes)


def test_launch_check_names_the_hosts_of_a_node_rank_beyond_the_hostfile(tmp_path):
    """`launch-check H --launcher no-ssh --node-rank 5` on a one-host hostfile: one line naming the
    hosts and this machine's rank (it passed in silence, exit 0); --node-rank without no-ssh is refused."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [sys.executable, "-m", "pretrain", "launch-check", str(hostfile), "--master-port", "29500"]
    out = subprocess.run(
        [*cmd, "--launcher", "no-ssh", "--node-rank", "5"], cwd=ROOT, env=subprocess_env(), capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr == (
        f"launch-check: node rank 5 is beyond {hostfile}, which has 1 host(s) (0: localhost); this machine "
        "is node rank 0 there (localhost): use that\n"
    )
    out = subprocess.run(
        [*cmd, "--node-rank", "1"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stderr.startswith(
        "launch-check: --node-rank 1 is for --launcher no-ssh"
    )


# ---------------------------------------------------------------------------------------------
# (b) the master port taken, (c) out of range


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_taken_master_port_is_one_line(name, fakes, tmp_path, taken_port):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    out = run_script(name, hostfile, fakes, tmp_path, MASTER_PORT=str(taken_port))
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    m = re.fullmatch(
        rf"launch/{re.escape(name)}: port {taken_port} on localhost \(MASTER_PORT\) is in use \(.+\): rank 0 "
        rf"cannot listen there; pick another, e.g. MASTER_PORT=(\d+) \(free now\), or stop what holds it "
        rf"\(`ss -ltnp 'sport = :{taken_port}'` shows it\)",
        lines[0],
    )
    assert m, lines[0]
    suggested = int(m.group(1))
    assert suggested != taken_port
    with socket.create_server(("127.0.0.1", suggested)):
        pass  # the suggestion is a port rank 0 can listen on
    assert_nothing_started(out, fakes)
    # DeepSpeed's launcher ssh'es even to this machine, and so did the check; mpirun starts this
    # machine's ranks itself, and no_ssh.sh and slurm.sbatch ssh nowhere.
    ssh_to = ["localhost"] if name == "pdsh.sh" else []
    assert [argv[-2] for argv in ssh_calls(fakes["ssh_log"])] == ssh_to


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("port", ["999999", "0"])
def test_a_master_port_out_of_range_is_one_line(name, port, fakes, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    out = run_script(name, hostfile, fakes, tmp_path, MASTER_PORT=port)
    assert out.returncode == 2
    assert out.stderr == f"launch/{name}: MASTER_PORT='{port}' is not a port number (1..65535)\n"
    assert_nothing_started(out, fakes)
    assert not fakes["ssh_log"].exists()


# ---------------------------------------------------------------------------------------------
# The pieces


@pytest.mark.parametrize(
    ("include", "exclude"),
    [("", ""), ("b", ""), ("a@c:1", ""), ("", "b"), ("", "a:0"), ("", "a:0,1@c"), ("", "a@b@c:0")],
)
def test_host_filters_leave_the_hosts_deepspeed_leaves(include, exclude):
    hosts = {"a": 2, "b": 1, "c": 2}
    theirs = list(parse_inclusion_exclusion(hosts, include, exclude))
    assert filter_hosts(hosts, include, exclude) == (theirs, [])


@pytest.mark.parametrize(
    ("include", "exclude", "problem"),
    [
        ("x", "", "INCLUDE=x: 'x' is not a host of the hostfile (a, b)"),
        ("", "a:2", "EXCLUDE=a:2: a has slots 0..1, not '2'"),
        ("a", "b", "INCLUDE and EXCLUDE: give one of them"),
        ("", "a@b", "EXCLUDE=a@b leaves no host of the hostfile"),
    ],
)
def test_host_filters_deepspeed_refuses_are_named(include, exclude, problem):
    assert problem in filter_hosts({"a": 2, "b": 1}, include, exclude)[1][0]


def test_this_machine_without_asking_dns():
    for addr in ("localhost", "127.0.0.1", "127.0.1.1", "::1", socket.gethostname()):
        assert is_this_machine(addr), addr
    for addr in HOSTS:
        assert not is_this_machine(addr) and not is_this_machine(addr, resolve=True), addr


def test_launch_check_names_every_host_down_at_once(fakes, tmp_path):
    """Two hosts down: one line for each, in hostfile order; all up: one note on stderr, exit 0."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    env = subprocess_env(
        PATH=f"{fakes['bin']}:{os.environ['PATH']}",
        SSH_LOG=str(fakes["ssh_log"]),
        SSH_DOWN=f"{HOSTS[2]} {DOWN}",
    )
    cmd = [sys.executable, "-m", "pretrain", "launch-check", str(hostfile), "--master-port", "29500"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert [line.split(" is not")[0] for line in lines] == [
        f"launch-check: host {DOWN}",
        f"launch-check: host {HOSTS[2]}",
    ], out.stderr

    env["SSH_DOWN"] = ""
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "launch-check: checked: 3 host(s) reachable over ssh\n"


# ---------------------------------------------------------------------------------------------
# (d) the raw DeepSpeed launcher on a taken port


@pytest.mark.distributed
def test_raw_deepspeed_launcher_on_a_taken_port_is_one_message(taken_port, tmp_path):
    """`deepspeed --num_gpus 2 pretrain/main.py` (CPU accelerator, tiny preset) with its master port
    taken: rank 0 cannot listen there, says so once with the fix and exits 2; DeepSpeed's launcher
    then stops rank 1, which was waiting for rank 0, so it prints nothing."""
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(taken_port), "pretrain/main.py", "--preset", "tiny",
        f"--set=logging.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    t0 = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "Traceback" not in text and "DistNetworkError" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("error")]
    assert len(errors) == 1, text[-3000:]
    assert errors[0].startswith(
        f"error: rank 0 cannot listen on port {taken_port} for the rendezvous at 127.0.0.1:{taken_port} "
        "(MASTER_ADDR:MASTER_PORT): it is in use."
    ), errors[0]
    free = re.search(r"deepspeed --master_port (\d+) \.\.\., or MASTER_PORT=(\d+) launch/", errors[0])
    assert free and free.group(1) == free.group(2) and int(free.group(1)) != taken_port, errors[0]
    assert f"`ss -ltnp 'sport = :{taken_port}'`" in errors[0]
    assert took < 60, took  # it fails at init, before the data or the model
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs the system package util-linux (unshare)")
def test_a_name_that_does_not_resolve_is_named_not_sshd():
    """A host name with no address is the fix to give, not "start sshd". The lookup runs in a network
    namespace of its own, with no route out, so no query leaves this machine."""
    code = (
        "from pretrain.cluster.reach import passwordless_fix as f; "
        "print(f('node-01.invalid')); print(f('127.0.0.2'))"
    )
    out = subprocess.run(["unshare", "--net", sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=subprocess_env(), timeout=60)  # fmt: skip
    if out.returncode != 0 and "unshare" in out.stderr:
        pytest.skip(f"needs root for a network namespace: {out.stderr.strip()}")
    unresolved, resolved = out.stdout.splitlines()
    assert unresolved.startswith("the name node-01.invalid does not resolve (")
    assert "add it to /etc/hosts" in unresolved and "sshd" not in unresolved
    assert resolved.startswith("start sshd on 127.0.0.2")
