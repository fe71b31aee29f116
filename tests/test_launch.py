"""The launch path without a cluster: hostfiles against DeepSpeed's parser, the rendered launch
environment, rank discovery, the launch scripts' guards, the Slurm hostfile derivation, setup.sh's
DeepSpeed op builds, and preflight on this one host: where it ssh'es (as DeepSpeed's launcher does)
and the DeepSpeed ops a config needs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from deepspeed.launcher.runner import _parse_hostfile, fetch_hostfile

from pretrain.cluster.launch import (
    env_file_text,
    launch_environment,
    launcher_world_size,
    parse_hostfile,
    read_hostfile,
)
from pretrain.config.presets import build
from pretrain.errors import ConfigError, HostfileError
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
    from pretrain.training.distributed import ranks

    for k in [k for k in os.environ if k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "SLURM", "MASTER"))]:
        monkeypatch.delenv(k)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        # launch_env sets them: gone again after this test (delenv of an unset name records nothing
        # to undo, so set it first)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "10")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2),2")
    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        ranks.launch_env()
    monkeypatch.setenv("MASTER_ADDR", "node-01")
    dist = ranks.launch_env()
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
    written = (tmp_path / "pretrain-slurm-4242.hostfile").read_text().split("\n")[:-1]
    assert written == ["# launch/slurm.sbatch: the nodes of Slurm job 4242", *lines[: len(hosts)]]
    assert lines[len(hosts)] == f"MASTER_ADDR={hosts[0]} MASTER_PORT=29500"
    assert lines[-1].startswith(f"srun --nodes={len(hosts)} --ntasks-per-node=8 --kill-on-bad-exit=1 ")
    assert "--signal=TERM@" in (ROOT / "launch" / "slurm.sbatch").read_text()


def test_slurm_sbatch_never_overwrites_a_hostfile_it_did_not_write(tmp_path):
    """HOSTFILE pointing at a person's file (or a directory): refused, the file as it was, nothing
    started; a path of its own is written and rewritten."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not installed (slurm-client, .ci/system-deps)")
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=ALL\n"
    )
    mine = tmp_path / "my_hosts"
    mine.write_text("gpu-01 slots=8\ngpu-02 slots=8\n")
    env = dict(
        SLURM_CONF=str(conf), SLURM_JOB_ID="7", SLURM_JOB_NODELIST="node[1-2]", SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS_PER_NODE="2", SLURM_SUBMIT_DIR=str(ROOT), PYTHON=sys.executable, DRY_RUN="1",
    )  # fmt: skip

    def sbatch(hostfile: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(ROOT / "launch" / "slurm.sbatch")],
            env=subprocess_env(**env, HOSTFILE=str(hostfile)),
            capture_output=True,
            text=True,
            timeout=60,
        )

    for target in (mine, tmp_path):
        out = sbatch(target)
        assert out.returncode == 2 and "srun" not in out.stdout, out
        assert out.stderr.count("\n") == 1 and "this script did not write it: it is kept" in out.stderr
        assert "Traceback" not in out.stderr
    assert mine.read_text() == "gpu-01 slots=8\ngpu-02 slots=8\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_hosts", "slurm.conf"]  # no temporary left
    fresh = tmp_path / "job.hosts"
    for _ in range(2):  # its own file, written again by a requeued job
        out = sbatch(fresh)
        assert out.returncode == 0, out.stderr
        assert fresh.read_text().splitlines()[1:] == ["node1 slots=2", "node2 slots=2"]


# ---------------------------------------------------------------------------------------------
# preflight on this host (a `localhost` hostfile needs no ssh)


@pytest.mark.distributed
def test_preflight_on_localhost(char_dataset, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [
        sys.executable, "-m", "pretrain", "preflight", "--hostfile", str(hostfile), "--no-ssh", "--master-port", "29581",
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


# ---------------------------------------------------------------------------------------------
# preflight reaches hosts as DeepSpeed's launcher does, and checks the DeepSpeed ops the config needs

# One write per call (a line built first, then appended at once): preflight runs its ssh calls in
# parallel, and two calls' pieces must not interleave in the log.
SSH_SHIM = '#!/bin/sh\nline=$(printf "%s\\037" "$@")\nprintf "%s\\n" "$line" >> "$SSH_LOG"\n'


def _ssh_targets(log: Path) -> list[tuple[str, list[str]]]:
    """(host, argv) of each ssh call the shim logged: the first argument that is no option."""
    calls = []
    for line in log.read_text().splitlines() if log.exists() else []:
        argv = line.split("\x1f")[:-1]
        i = 0
        while argv[i].startswith("-"):
            i += 2 if argv[i] in ("-o", "-p", "-l", "-i", "-F") else 1
        calls.append((argv[i], argv))
    return calls


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("hosts", "flags"),
    [
        (["localhost"], []),
        (["localhost"], ["--no_ssh_check"]),
        (["localhost", "127.0.0.1"], []),
        (["localhost", "127.0.0.1"], ["--no_ssh_check"]),
        (["localhost", "127.0.0.1"], ["--no_ssh", "--node_rank", "0"]),
    ],
)
def test_preflight_sshes_where_deepspeeds_launcher_does(hosts, flags, tmp_path, monkeypatch):
    """DeepSpeed's real launcher (its ssh check, then pdsh, or a local start) with an `ssh` on PATH
    that logs and succeeds: the hosts it ssh'es to, with PasswordAuthentication=no and the port, are
    `launch_ssh_hosts`, and the hosts preflight ssh'es to with the same flags."""
    from pretrain.preflight import Options, launch_ssh_hosts, preflight

    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ssh").write_text(SSH_SHIM)
    (shim / "ssh").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in hosts))
    no_ssh, no_ssh_check = "--no_ssh" in flags, "--no_ssh_check" in flags
    expected = launch_ssh_hosts(hosts, no_ssh, no_ssh_check)

    ds_log = tmp_path / "deepspeed.log"
    env = subprocess_env(PATH=f"{shim}:{os.environ['PATH']}", SSH_LOG=str(ds_log), DS_ENV_FILE=os.devnull)
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), *flags,
        "--ssh_port", "2222", "--master_addr", "127.0.0.1", "--master_port", "29583",
        "--no_python", "--no_local_rank", "true",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    calls = _ssh_targets(ds_log)
    assert sorted({h for h, _ in calls}) == sorted(expected), calls
    if calls and not no_ssh_check:  # its check of the first host
        assert calls[0] == (hosts[0], ["-o", "PasswordAuthentication=no", "-p", "2222", hosts[0], "hostname"])
    assert all(argv[argv.index("-p") + 1] == "2222" for _, argv in calls)

    pf_log = tmp_path / "preflight.log"
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    monkeypatch.setenv("SSH_LOG", str(pf_log))
    cfg = build(overrides=[f"logging.run_dir={tmp_path / 'run'}"], world_size=len(hosts))
    opts = Options(
        hostfile=str(hostfile), hosts=dict.fromkeys(hosts, 1), cwd=str(ROOT), master_port=29582,
        ssh_port=2222, no_ssh=no_ssh, no_ssh_check=no_ssh_check, allreduce=False, timeout_s=60,
    )  # fmt: skip
    report = preflight(cfg, opts)
    calls = _ssh_targets(pf_log)
    assert sorted({h for h, _ in calls}) == sorted(expected), calls
    for _, argv in calls:
        assert "PasswordAuthentication=no" in argv and "BatchMode=yes" in argv
        assert argv[argv.index("-p") + 1] == "2222"
    assert all(report.rows[h]["ssh"] == "local" for h in hosts if h not in expected)


def test_preflight_refuses_a_hostfile_deepspeed_would_ssh_to(char_dataset, tmp_path):
    """Real ssh, to a port nothing listens on: a hostfile that DeepSpeed reaches over pdsh fails on
    every host with the fix; so does a hostfile of this machine alone, as DeepSpeed's ssh check of it
    fails, unless preflight is told the launch uses no ssh (--no-ssh, as deepspeed --no_ssh)."""
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client (openssh-client, .ci/system-deps)")
    port = str(_free_port())
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    cmd = [
        sys.executable, "-m", "pretrain", "preflight", "--hostfile", str(hostfile), "--master-port", "29584",
        "--ssh-port", port, "--no-allreduce", f"--set=data.corpus={TINY_SHAKESPEARE}",
        f"--set=data.dataset_dir={char_dataset}", f"--set=logging.run_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[:3] for line in lines[1:3]] == [
        ["localhost", "1", "FAIL"],
        ["127.0.0.1", "1", "FAIL"],
    ]
    fails = [line for line in lines if line.startswith("FAIL ")]
    assert [f.split(":")[0] for f in fails] == ["FAIL localhost", "FAIL 127.0.0.1"], out.stdout
    assert all(": ssh: not reachable over ssh without a password" in f for f in fails)
    assert f"`ssh -o PasswordAuthentication=no -p {port} localhost hostname`" in fails[0]
    assert "pdsh starts the ranks there over ssh" in fails[1]
    fixes = [line for line in lines if line.strip().startswith("fix:")]
    for fix in fixes:
        assert "ssh-keygen" in fix and "authorized_keys" in fix and "launch/no_ssh.sh" in fix, fix
    assert lines[-1] == "preflight: 2 problem(s) on 2 host(s)"

    hostfile.write_text("localhost slots=1\n")
    out = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert out.stdout.splitlines()[1].split()[:3] == ["localhost", "1", "FAIL"]
    fail = next(line for line in out.stdout.splitlines() if line.startswith("FAIL localhost: ssh:"))
    assert f"`ssh -o PasswordAuthentication=no -p {port} localhost hostname` fails" in fail
    assert "ssh-keygen" in out.stdout and f"launch/no_ssh.sh {hostfile} 0" in out.stdout
    assert out.stdout.splitlines()[-1] == "preflight: 1 problem(s) on 1 host(s)"
    out = subprocess.run(
        [*cmd, "--no-ssh"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[1].split()[:3] == ["localhost", "1", "local"]


@pytest.mark.parametrize(
    ("overrides", "ops"),
    [
        ([], []),
        (["optimizer.fused_adam=true"], ["fused_adam"]),
        (["zero.stage=2", "zero.offload_optimizer=true"], ["cpu_adam"]),
        (["zero.stage=3", "zero.offload_optimizer=true", "optimizer.fused_adam=true"], ["cpu_adam"]),
        (["zero.stage=3", "zero.offload_param=true"], []),
    ],
)
def test_the_ops_a_config_needs(overrides, ops):
    from pretrain.config.ds_render import render_deepspeed
    from pretrain.preflight import needed_ops

    assert needed_ops(render_deepspeed(build(overrides=overrides, world_size=2))) == ops


def test_the_ops_the_shipped_deepspeed_configs_need():
    from pretrain.preflight import needed_ops

    for name in ("zero2_offload", "zero3_offload"):
        assert needed_ops(json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())) == ["cpu_adam"]


def test_preflight_reports_the_deepspeed_ops_a_config_needs(char_dataset, tmp_path):
    """The real DeepSpeed on this machine: CPUAdam for an offload config is cached (an earlier JIT
    build) or buildable (ninja and gcc are here); with an empty extension cache it is buildable, a
    warning; without a compiler it is neither, a failure with DeepSpeed's build switch as the fix."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    cmd = [
        sys.executable, "-m", "pretrain", "preflight", "--hostfile", str(hostfile), "--no-ssh", "--master-port", "29585",
        "--no-allreduce", f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={char_dataset}",
        f"--set=logging.run_dir={tmp_path / 'run'}", "--set=zero.stage=2", "--set=zero.offload_optimizer=true",
    ]  # fmt: skip

    def run(*extra: str) -> tuple[subprocess.CompletedProcess[str], str]:
        out = subprocess.run(
            cmd + list(extra), cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=180
        )
        header, row = out.stdout.splitlines()[:2]
        assert "ops" in header.split() and "Traceback" not in out.stdout + out.stderr, out.stdout
        return out, row[header.index(" ops ") + 1 :].split()[0]  # cells are aligned under their header

    out, ops = run()
    assert out.returncode == 0 and ops in ("cpu_adam:cached", "cpu_adam:buildable"), out.stdout

    empty = tmp_path / "extensions"
    empty.mkdir()
    out, ops = run(f"--set=launch.env.TORCH_EXTENSIONS_DIR={empty}")
    assert out.returncode == 0 and ops == "cpu_adam:buildable", out.stdout
    assert f"WARN localhost: ops: DeepSpeed's cpu_adam op (DeepSpeedCPUAdam, for optimizer offload) is not built: it will JIT-compile on first use, ~1 min per host (into {empty})" in out.stdout  # fmt: skip
    assert not list(empty.iterdir())  # asked, not built

    out, ops = run(f"--set=launch.env.TORCH_EXTENSIONS_DIR={empty}", "--set=launch.env.CXX=/nonexistent/c++")
    assert out.returncode == 1 and ops == "cpu_adam:missing", out.stdout
    fail = next(line for line in out.stdout.splitlines() if line.startswith("FAIL localhost: ops:"))
    assert "cannot be built here: no C++ compiler (/nonexistent/c++ is not on PATH)" in fail
    assert "DS_BUILD_CPU_ADAM=1" in out.stdout and "--no-build-isolation" in out.stdout


def test_preflight_of_a_config_needing_no_op_reports_none(tmp_path):
    from pretrain.preflight import Options, format_report, preflight

    cfg = build(overrides=[f"logging.run_dir={tmp_path / 'run'}"], world_size=1)
    opts = Options(
        hostfile="h", hosts={"localhost": 1}, cwd=str(ROOT), master_port=29586, no_ssh=True, allreduce=False
    )
    report = preflight(cfg, opts)
    assert report.rows["localhost"]["ops"] == "-"
    assert "ops" not in format_report(report).splitlines()[0].split()  # no column for nothing


def test_a_master_addr_in_the_environment_does_not_skip_the_hostfile_check(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-01 slots=1\nnode;touch${IFS}pwned slots=1\n")
    env = subprocess_env(PYTHON=sys.executable, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    out = subprocess.run(
        [str(ROOT / "launch" / "pdsh.sh"), str(hostfile)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "not a host name" in out.stdout + out.stderr, out.stdout + out.stderr
    assert "deepspeed" not in out.stdout.lower()


def test_launcher_world_size_reads_the_variables_launch_env_uses():
    """What `pretrain train` checks the config against before torch loads: the same world size
    `ranks.launch_env` will take, or None where only mpi4py (or a supervisor) knows it."""
    assert launcher_world_size({}) == 1  # no launcher: one rank
    assert launcher_world_size({"RANK": "3", "WORLD_SIZE": "16"}) == 16
    assert launcher_world_size({"RANK": "0"}) is None  # RANK without WORLD_SIZE: let launch_env say
    assert launcher_world_size({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "8"}) == 8
    assert launcher_world_size({"SLURM_PROCID": "1", "SLURM_NTASKS": "8"}) == 1  # not a job step
    assert launcher_world_size({"OMPI_COMM_WORLD_SIZE": "4"}) == 4
    assert launcher_world_size({"PMI_SIZE": "2", "PMI_RANK": "0"}) == 2
    assert launcher_world_size({"PMIX_RANK": "0"}) is None  # PMIx alone: mpi4py tells
    assert launcher_world_size({"RANK": "0", "WORLD_SIZE": "0"}) is None


def test_a_host_listed_twice_in_another_case_is_refused():
    """`node1` and `NODE1` are one machine: DeepSpeed would start its ranks twice there."""
    from pretrain.errors import HostfileError

    with pytest.raises(HostfileError, match="NODE1 is node1 again \\(host names ignore case\\)"):
        parse_hostfile("node1 slots=2\nNODE1 slots=2\n")


def test_a_master_address_with_shell_characters_is_refused(capsys):
    """preflight took `--master-addr 'a;b'` and reported the all-reduce it broke as a firewall problem
    (launch-check gets its address from the launch scripts, which check it themselves)."""
    from pretrain.cli import main

    with pytest.raises(SystemExit) as e:
        main(["preflight", "--hostfile", str(ROOT / "hostfiles" / "localhost"), "--master-addr", "a;b"])
    assert e.value.code == 2
    assert "'a;b' is not a host name or address" in capsys.readouterr().err
