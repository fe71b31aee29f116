"""A real two-host cluster on this machine: Linux network namespaces joined by a veth pair.

Each host is a network namespace with its own address (10.77.0.1, 10.77.0.2) on an interface named
the same on both (`ptnet0`, so one GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME fits every host), its own
host name (a UTS namespace per process started in it) resolved through /etc/netns/<ns>/hosts, and
a real `sshd` with a throwaway host key and client key kept in the test's temporary directory
(never in ~/.ssh). Processes started "on" a host get an `ssh` on PATH that uses that key, so pdsh,
mpirun, DeepSpeed's ssh check and preflight all reach the other host without a password.

Traffic goes only to loopback and to the two addresses created here. Teardown kills, by PID, every
process left in the namespaces (sshd, and whatever ssh started), then deletes the namespaces.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

SUBNET = "10.77.0"
IFNAME = "ptnet0"
TOOLS = ("ip", "unshare", "mount", "ssh", "ssh-keygen", "pdsh", "mpirun.openmpi")
SLURM_TOOLS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "sinfo", "nsenter")


def unavailable() -> str | None:
    """Why a namespace cluster cannot be built here, or None if it can."""
    if sys.platform != "linux":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (network namespaces, a veth pair, sshd); CI runs as root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if not Path("/usr/sbin/sshd").is_file():
        missing.append("sshd")
    if missing:
        return f"missing {', '.join(missing)}: run .ci/system-deps (openssh, pdsh, openmpi, iproute2)"
    probe = f"ptprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if res.returncode != 0:
        return f"cannot create a network namespace here: {res.stderr.strip()}"
    return None


def slurm_unavailable() -> str | None:
    """Why a two-node Slurm (slurmctld + one slurmd per host, munge) cannot run here, or None."""
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install slurmctld slurmd munge (.ci/system-deps)"
    if not any(Path("/sys/fs/cgroup").iterdir()):
        return "slurmd needs a cgroup filesystem at /sys/fs/cgroup"
    return None


def remove_stale_namespaces() -> None:
    """Namespaces of an earlier test run that was killed before its teardown (named pt<pid>-<n>,
    with that pid gone): their processes, by PID, then the namespaces."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    for name in (line.split()[0] for line in listed if line.strip()):
        m = re.fullmatch(r"pt(\d+)-\d", name)
        if not m or Path(f"/proc/{m.group(1)}").exists():
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


class Host:
    def __init__(self, cluster: Cluster, index: int) -> None:
        self.name = f"node{index + 1}"
        self.addr = f"{SUBNET}.{index + 1}"
        self.ns = f"pt{os.getpid()}-{index + 1}"
        self.cluster = cluster
        self.sshd: subprocess.Popen[bytes] | None = None

    def argv(self, argv: Sequence[str], binds: Sequence[tuple[Path, Path]] = ()) -> list[str]:
        """argv run on this host: its namespace, its host name, and (optionally) bind mounts seen
        only by this process and its children."""
        mounts = "".join(f'mount --bind "{src}" "{dst}" && ' for src, dst in binds)
        script = f'hostname "$0" && {mounts}exec "$@"'
        # `ip netns exec` already gives a private mount namespace (and /etc/netns/<ns>/hosts as
        # /etc/hosts); --mount makes one per process, so a bind for one sshd stays its own.
        return [
            "ip",
            "netns",
            "exec",
            self.ns,
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
            script,
            self.name,
            *argv,
        ]

    def argv_with_sys(self, argv: Sequence[str]) -> list[str]:
        """As argv(), but keeping this machine's /sys (and so its cgroups, which slurmd needs):
        `nsenter` joins the network namespace without `ip netns exec`'s fresh sysfs."""
        etc = Path("/etc/netns") / self.ns
        script = (
            'mount --bind "$1/hosts" /etc/hosts && mount --bind "$1/resolv.conf" /etc/resolv.conf'
            ' && hostname "$0" && shift && exec "$@"'
        )
        return [
            "nsenter", f"--net=/run/netns/{self.ns}", "unshare", "--uts", "--mount",
            "sh", "-c", script, self.name, str(etc), *argv,
        ]  # fmt: skip

    def start_sshd(self, binds: Sequence[tuple[Path, Path]] = ()) -> None:
        self.stop_sshd()
        cfg = self.cluster.dir / f"sshd_{self.name}.conf"
        log = open(self.cluster.dir / f"sshd_{self.name}.log", "ab")  # noqa: SIM115 - owned by the Popen
        self.sshd = subprocess.Popen(
            self.argv(["/usr/sbin/sshd", "-D", "-e", "-f", str(cfg)], binds), stdout=log, stderr=log
        )
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            res = self.cluster.run(0, ["ssh", self.name, "true"], timeout=10)
            if res.returncode == 0:
                return
            if self.sshd.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(
            f"sshd on {self.name} did not come up: {self.cluster.dir / f'sshd_{self.name}.log'}"
        )

    def stop_sshd(self) -> None:
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.terminate()
            try:
                self.sshd.wait(5)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait()
        self.sshd = None


class Cluster:
    """Two hosts, `node1` and `node2`; use as a context manager so teardown always runs."""

    def __init__(self, workdir: Path, n_hosts: int = 2) -> None:
        self.dir = workdir
        self.hosts = [Host(self, i) for i in range(n_hosts)]
        self.bin = workdir / "bin"
        # The test process's PATH on every host, so that DeepSpeed's op builds find the same `ninja`
        # as the rest of the suite (pip's and Debian's invalidate each other's cache), after the ssh shim.
        self.path = f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        self.daemons: list[subprocess.Popen[bytes]] = []  # munged, slurmctld, slurmd

    def __enter__(self) -> Cluster:
        self.dir.mkdir(parents=True, exist_ok=True)
        remove_stale_namespaces()
        try:
            self._network()
            self._ssh()
            for h in self.hosts:
                h.start_sshd()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _sh(self, *argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, text=True)

    def _network(self) -> None:
        a, b = self.hosts
        va, vb = f"pta{os.getpid()}", f"ptb{os.getpid()}"  # temporary names, at most 15 characters
        for h in self.hosts:
            self._sh("ip", "netns", "add", h.ns)
            etc = Path("/etc/netns") / h.ns
            etc.mkdir(parents=True, exist_ok=True)
            names = "".join(f"{x.addr} {x.name}\n" for x in self.hosts)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
            # No name server: a lookup that /etc/hosts cannot answer fails at once, sending nothing.
            (etc / "resolv.conf").write_text("options timeout:1 attempts:1\n")
        self._sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        for h, v in ((a, va), (b, vb)):
            self._sh("ip", "link", "set", v, "netns", h.ns)
            self._sh("ip", "-n", h.ns, "link", "set", v, "name", IFNAME)
            self._sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", IFNAME)
            self._sh("ip", "-n", h.ns, "link", "set", IFNAME, "up")
            self._sh("ip", "-n", h.ns, "link", "set", "lo", "up")

    def _ssh(self) -> None:
        d = self.dir
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        for key in ("host_key", "id_ed25519"):
            for f in (d / key, d / f"{key}.pub"):
                f.unlink(missing_ok=True)
            self._sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "pretrain-test", "-f", str(d / key))
        shutil.copy(d / "id_ed25519.pub", d / "authorized_keys")
        host_pub = (d / "host_key.pub").read_text().split()[:2]
        (d / "known_hosts").write_text(
            "".join(f"{h.name},{h.addr} {' '.join(host_pub)}\n" for h in self.hosts)
        )
        (d / "ssh_config").write_text(
            f"Host *\n  User root\n  IdentityFile {d / 'id_ed25519'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {d / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n  ConnectTimeout 5\n  LogLevel ERROR\n"
        )
        for h in self.hosts:
            (d / f"sshd_{h.name}.conf").write_text(
                f"ListenAddress {h.addr}\nPort 22\nHostKey {d / 'host_key'}\n"
                f"AuthorizedKeysFile {d / 'authorized_keys'}\nPidFile none\nUsePAM no\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nStrictModes no\nPrintMotd no\n"
            )
        self.bin.mkdir(exist_ok=True)
        shim = self.bin / "ssh"
        shim.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F "{d / "ssh_config"}" "$@"\n')
        shim.chmod(0o755)

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "MASTER_", "DS_ENV"))}
        env.update(PATH=self.path, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
        return env

    def run(
        self,
        host: int,
        argv: Sequence[str],
        timeout: float,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """argv on hosts[host], to completion; on timeout its process group is killed."""
        proc = subprocess.Popen(
            self.hosts[host].argv(argv),
            cwd=cwd,
            env=env or self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"\n[killed after {timeout} s]"
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def start(self, host: int, argv: Sequence[str], cwd: Path | None = None) -> subprocess.Popen[str]:
        """argv on hosts[host] in the background; the caller waits for it (teardown kills it)."""
        return subprocess.Popen(
            self.hosts[host].argv(argv),
            cwd=cwd,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def hostfile(self, slots: Sequence[int] = (1, 1)) -> Path:
        path = self.dir / ("hostfile-" + "-".join(map(str, slots)))
        path.write_text("".join(f"{h.name} slots={s}\n" for h, s in zip(self.hosts, slots, strict=True)))
        return path

    def start_slurm(self) -> Path:
        """A real two-node Slurm: munged (on this machine, its socket in the test directory),
        slurmctld on node1 and a slurmd on each host. Returns the slurm.conf to point SLURM_CONF at."""
        d = self.dir / "slurm"
        for sub in ("state", "spool-node1", "spool-node2"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        self._sh("mungekey", "--create", "--force", "--keyfile", str(d / "munge.key"))
        sock = d / "munge.socket"
        conf = d / "slurm.conf"
        nodes = "".join(
            f"NodeName={h.name} NodeAddr={h.addr} CPUs={os.cpu_count()} State=UNKNOWN\n" for h in self.hosts
        )
        conf.write_text(
            f"ClusterName=pretrain\nSlurmctldHost={self.hosts[0].name}({self.hosts[0].addr})\n"
            f"SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nCredType=cred/munge\n"
            f"AuthInfo=socket={sock}\nStateSaveLocation={d / 'state'}\nSlurmdSpoolDir={d}/spool-%n\n"
            f"SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd-%n.pid\n"
            f"SlurmctldLogFile={d}/slurmctld.log\nSlurmdLogFile={d}/slurmd-%n.log\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nMpiDefault=none\nReturnToService=2\n"
            # Jobs start as soon as they are submitted (batch_sched_delay defaults to 3 s).
            "SchedulerParameters=batch_sched_delay=0\n"
            f"{nodes}PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        )
        env = self.env(SLURM_CONF=str(conf))
        log = open(d / "daemons.log", "ab")  # noqa: SIM115 - owned by the Popens
        munge = [
            "munged", "--foreground", "--force", f"--socket={sock}", f"--key-file={d / 'munge.key'}",
            f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}", f"--log-file={d / 'munged.log'}",
        ]  # fmt: skip
        self.daemons.append(subprocess.Popen(munge, stdout=log, stderr=log))
        self.daemons.append(
            subprocess.Popen(
                self.hosts[0].argv(["slurmctld", "-D", "-f", str(conf)]), env=env, stdout=log, stderr=log
            )
        )
        for h in self.hosts:
            cmd = h.argv_with_sys(["slurmd", "-D", "-f", str(conf), "-N", h.name])
            self.daemons.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            res = self.run(0, ["sinfo", "-h", "-o", "%T"], timeout=10, env=env)
            if res.returncode == 0 and res.stdout.split() == ["idle"]:
                return conf
            time.sleep(0.5)
        raise RuntimeError(f"Slurm did not come up: {d / 'slurmctld.log'}, {d / 'daemons.log'}")

    def teardown(self) -> None:
        """Every process in the namespaces, by PID; then the namespaces, the veth pair with them."""
        for h in self.hosts:
            h.stop_sshd()
        for p in reversed(self.daemons):  # slurmd, slurmctld, then munged, which runs outside them
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for _ in range(3):
            pids: list[int] = []
            for h in self.hosts:
                res = subprocess.run(["ip", "netns", "pids", h.ns], capture_output=True, text=True)
                pids += [int(p) for p in res.stdout.split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        for h in self.hosts:
            subprocess.run(["ip", "netns", "del", h.ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / h.ns, ignore_errors=True)
