"""The launch path without a cluster: hostfiles against DeepSpeed's parser, the rendered launch
environment, rank discovery, the launch scripts' guards, the Slurm hostfile derivation, and
preflight on this one host."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from deepspeed.launcher.runner import _parse_hostfile, fetch_hostfile

from pretrain.errors import ConfigError, HostfileError
from pretrain.launch import env_file_text, launch_environment, parse_hostfile, read_hostfile
from pretrain.presets import build
from tests.conftest import ROOT, TINY_SHAKESPEARE, subprocess_env

SCRIPTS = ["pdsh.sh", "no_ssh.sh", "mpirun.sh", "slurm.sbatch"]

# Hostfiles DeepSpeed accepts: ours must give the same hosts, slots and order.
ACCEPTED = [
    "node-01 slots=8\nnode-02 slots=8\n",
    "# comment\n\n  worker-0 slots=4  \n\tworker-1\tslots=2\n",
    "a slots=1 # inline comment\nb.example.com slots=16\n10.0.0.3 slots=2\n",
    "gpu_07 slots=8 max_slots=8\n",
]
# Hostfiles DeepSpeed rejects: ours must reject them too, naming the problem.
REJECTED = {
    "": "no hosts",
    "# only a comment\n\n": "no hosts",
    "node-01\n": "expected '<host> slots=<N>'",
    "node-01 slots=eight\n": "expected '<host> slots=<N>'",
    "slots=8\n": "expected '<host> slots=<N>'",
    "node-01 slots=4\nnode-01 slots=4\n": "listed twice",
}
# Hostfiles DeepSpeed accepts but we refuse, on purpose: each would fail later and worse.
STRICTER = {
    "node-01 slots=0\n": "zero slots",
    "node;rm slots=1\n": "not a host name",
    "$(reboot) slots=1\n": "not a host name",
    "-oProxyCommand=x slots=1\n": "not a host name",
    "node-01 slots=8x\n": "whole number",
}


@pytest.mark.parametrize("text", ACCEPTED)
def test_hostfile_parses_as_deepspeed_does(text, tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(text)
    ours = read_hostfile(path)
    theirs = fetch_hostfile(str(path))
    assert list(ours.items()) == list(theirs.items())


@pytest.mark.parametrize("text", list(REJECTED))
def test_hostfile_rejected_like_deepspeed_with_a_clear_message(text):
    with pytest.raises(ValueError):
        _parse_hostfile(text.splitlines())
    with pytest.raises(HostfileError) as e:
        parse_hostfile(text, "h")
    assert REJECTED[text] in str(e.value)


@pytest.mark.parametrize("text", list(STRICTER))
def test_hostfile_stricter_than_deepspeed(text):
    _parse_hostfile(text.splitlines())  # DeepSpeed takes it ...
    with pytest.raises(HostfileError) as e:  # ... we name the line and the problem
        parse_hostfile(text, "h")
    assert STRICTER[text] in str(e.value) and "line 1" in str(e.value)


def test_hostfile_reports_every_bad_line_at_once():
    with pytest.raises(HostfileError) as e:
        parse_hostfile("a slots=2\nb;c slots=1\na slots=1\nd slots=0\ne\n", "h")
    assert [p.split(" ", 2)[1] for p in e.value.problems] == ["2", "3", "4", "5"]


def test_shipped_hostfiles():
    assert read_hostfile(ROOT / "hostfiles" / "a100x16") == {"a100-node-01": 8, "a100-node-02": 8}
    h64 = read_hostfile(ROOT / "hostfiles" / "a100x64")
    assert len(h64) == 8 and set(h64.values()) == {8}
    assert read_hostfile(ROOT / "hostfiles" / "localhost") == {"localhost": 2}


def test_launch_environment_rendered_from_the_config():
    cfg = build(
        overrides=[
            "launch.socket_ifname=ib0",
            "launch.ib_hca=mlx5_0,mlx5_1",
            "launch.nccl_debug=INFO",
            "launch.nccl_ib_timeout=22",
            "launch.env.NCCL_NET_GDR_LEVEL=PHB",
            "launch.env.OMP_NUM_THREADS=4",
        ]
    )
    env = launch_environment(cfg.launch)
    assert env == {
        "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": "ib0",
        "NCCL_IB_HCA": "mlx5_0,mlx5_1",
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_TIMEOUT": "22",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "NCCL_NET_GDR_LEVEL": "PHB",
        "OMP_NUM_THREADS": "4",
    }
    text = env_file_text(env)
    assert text.splitlines()[0] == "NCCL_SOCKET_IFNAME=ib0" and text.endswith("\n")


def test_launch_environment_refuses_what_a_shell_would_expand():
    with pytest.raises(ConfigError) as e:
        build(
            overrides=[
                "launch.env.A=$(reboot)",
                "launch.env.B=two words",
                "launch.env.NCCL_DEBUG=INFO",
                "launch.env.1X=y",
                "launch.socket_ifname=eth0;ls",
            ]
        )
    text = str(e.value)
    for needle in [
        "A='$(reboot)'",
        "B='two words'",
        "NCCL_DEBUG has its own launch field",
        "'1X'",
        "socket_ifname",
    ]:
        assert needle in text, text


def test_slurm_step_discovery(monkeypatch):
    from pretrain import engine

    for k in [k for k in os.environ if k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "SLURM", "MASTER"))]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "10")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2),2")
    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        engine.launch_env()
    monkeypatch.setenv("MASTER_ADDR", "node-01")
    dist = engine.launch_env()
    assert (dist.rank, dist.world_size, dist.local_rank, dist.local_world_size) == (9, 10, 1, 2)
    assert os.environ["MASTER_PORT"] == "29500"


# ---------------------------------------------------------------------------------------------
# The scripts


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_are_strict_and_documented(name):
    text = (ROOT / "launch" / name).read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert lines[1].startswith("# ") and len(lines) < 80
    assert "set -euo pipefail" in text
    assert os.access(ROOT / "launch" / name, os.X_OK)
    # Quoting of every expansion is shellcheck's job (SC2086), below.


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (.ci/system-deps)")
def test_shellcheck():
    out = subprocess.run(
        ["shellcheck", *(str(ROOT / "launch" / n) for n in SCRIPTS)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout


@pytest.mark.parametrize("name", ["pdsh.sh", "no_ssh.sh", "mpirun.sh"])
def test_scripts_refuse_a_bad_host_name_before_launching(name, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-01 slots=1\nnode;touch${IFS}pwned slots=1\n")
    args = [str(ROOT / "launch" / name), str(hostfile), *(["0"] if name == "no_ssh.sh" else [])]
    env = subprocess_env(PYTHON=sys.executable, MPIRUN=shutil.which("mpirun.openmpi") or "/bin/false")
    out = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "not a host name" in text or "not Open MPI" in text, text
    assert not list(tmp_path.glob("pwned*")) and "deepspeed" not in out.stdout.lower()


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("gpu-a[7,9-10],login", ["gpu-a7", "gpu-a9", "gpu-a10", "login"]),
        ("dgx-[001-002],a[1-2]", ["dgx-001", "dgx-002", "a1", "a2"]),
    ],
)
def test_slurm_sbatch_derives_the_hostfile_from_the_allocation(nodelist, hosts, tmp_path):
    """The real `scontrol show hostnames` expands real SLURM_JOB_NODELIST expressions (it needs a
    slurm.conf, not a controller); the script's DRY_RUN prints what it would start."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not installed (slurm-client, .ci/system-deps)")
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=ALL\n"
    )
    env = subprocess_env(
        SLURM_CONF=str(conf),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=nodelist,
        SLURM_JOB_NUM_NODES=str(len(hosts)),
        SLURM_NTASKS_PER_NODE="8",
        SLURM_SUBMIT_DIR=str(ROOT),
        PYTHON=sys.executable,
        TMPDIR=str(tmp_path),
        DRY_RUN="1",
    )
    out = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm.sbatch"), "--set", "launch.socket_ifname=ib0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[: len(hosts)] == [f"{h} slots=8" for h in hosts]
    assert (tmp_path / "pretrain-slurm-4242.hostfile").read_text().split("\n")[:-1] == lines[: len(hosts)]
    assert lines[len(hosts)] == f"MASTER_ADDR={hosts[0]} MASTER_PORT=29500"
    assert lines[-1].startswith(f"srun --nodes={len(hosts)} --ntasks-per-node=8 --kill-on-bad-exit=1 ")
    assert "--signal=TERM@" in (ROOT / "launch" / "slurm.sbatch").read_text()


# ---------------------------------------------------------------------------------------------
# preflight on this host (a `localhost` hostfile needs no ssh)


@pytest.mark.distributed
def test_preflight_on_localhost(char_dataset, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [
        sys.executable, "-m", "pretrain", "preflight", "--hostfile", str(hostfile), "--master-port", "29581",
        f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={char_dataset}",
        f"--set=logging.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert header.split() == [
        "host", "slots", "ssh", "python", "torch", "deepspeed", "cuda", "nccl", "accel", "data",
        "checkpoint", "port", "all-reduce",
    ]  # fmt: skip
    assert row.split()[:3] == ["localhost", "2", "local"]
    assert "all-reduce: 2 ranks (gloo)" in out.stdout and "bus bandwidth" in out.stdout

    # The same host with more slots than cores, and the dataset gone: both named, with their fixes.
    hostfile.write_text(f"localhost slots={len(os.sched_getaffinity(0)) + 1}\n")
    cmd[cmd.index(f"--set=data.dataset_dir={char_dataset}")] = (
        f"--set=data.dataset_dir={tmp_path / 'nothing'}"
    )
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "FAIL localhost: accelerators:" in out.stdout and "FAIL localhost: data:" in out.stdout
    assert "prepare it first" in out.stdout and "all-reduce:" not in out.stdout


def test_preflight_bad_hostfile_is_a_one_screen_error(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("a slots=1\na slots=2\n")
    out = subprocess.run(
        [sys.executable, "-m", "pretrain", "preflight", "--hostfile", str(hostfile)],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: invalid hostfile")
    assert "a is listed twice" in out.stderr and "Traceback" not in out.stderr
