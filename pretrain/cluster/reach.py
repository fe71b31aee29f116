"""Before a launch: does every host the launcher will ssh to answer, can rank 0 listen on the master
port, and, launched host by host without ssh, is this machine the node it is told it is?
`pretrain launch-check` (which launch/*.sh run before DeepSpeed, mpirun or srun start) asks it here,
and `pretrain preflight` reaches its hosts with the same ssh. Standard library only: the scripts
call it before every launch, and it must answer at once.

ssh is DeepSpeed's (deepspeed/launcher/runner.py): `ssh -o PasswordAuthentication=no [-p PORT] HOST
hostname`, with BatchMode and a connect timeout added so that no prompt or dead host can hang it.
"""

from __future__ import annotations

import ipaddress
import shlex
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from pretrain.cluster.probe import check_port

LOCAL_HOSTS = {"localhost", "127.0.0.1"}
# DeepSpeed's ssh check passes PasswordAuthentication=no; BatchMode also refuses every other prompt
# (an unknown host key, a key's passphrase), which pdsh could not answer either.
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "PasswordAuthentication=no", "-o", "ConnectTimeout=10")
SSH_TIMEOUT_S = 30.0  # past ConnectTimeout: a host that answers TCP but never finishes the handshake

# Who starts the ranks: `deepspeed --hostfile` (pdsh over ssh, launch/pdsh.sh), Open MPI's mpirun
# (ssh to every other host, launch/mpirun.sh), `deepspeed --no_ssh` on every host (launch/no_ssh.sh),
# or srun (launch/slurm.sbatch).
Launcher = Literal["deepspeed", "mpirun", "no-ssh", "srun"]
LAUNCHERS: tuple[Launcher, ...] = ("deepspeed", "mpirun", "no-ssh", "srun")


def launch_ssh_hosts(hosts: list[str], no_ssh: bool = False, no_ssh_check: bool = False) -> list[str]:
    """The hosts DeepSpeed's launcher reaches over ssh for `deepspeed --hostfile H` (pdsh), as
    deepspeed/launcher/runner.py main() does: first `ssh -o PasswordAuthentication=no [-p PORT]
    FIRST hostname` (not with --no_ssh_check); then, with more than one host, pdsh starts every host's
    ranks over ssh, localhost included. One host's ranks it starts here, and --no_ssh uses no ssh."""
    if no_ssh:
        return []
    if len(hosts) > 1:
        return list(hosts)
    return [] if no_ssh_check else list(hosts[:1])


def ssh_argv(host: str, ssh_port: int | None, *remote: str) -> list[str]:
    return ["ssh", *SSH_OPTIONS, *_port(ssh_port), host, *remote]


def deepspeed_ssh_check(host: str, ssh_port: int | None) -> str:
    """DeepSpeed's ssh check as its launcher runs it, for the messages (it prints none of ssh's)."""
    return shlex.join(["ssh", "-o", "PasswordAuthentication=no", *_port(ssh_port), host, "hostname"])


def _port(ssh_port: int | None) -> list[str]:
    return ["-p", str(ssh_port)] if ssh_port is not None else []


def run(
    cmd: list[str], timeout_s: float, cwd: str | None = None, stdin: str = ""
) -> subprocess.CompletedProcess[str]:
    """`cmd` to completion; no answer in `timeout_s` is exit status 124, no such program 127."""
    try:
        return subprocess.run(cmd, input=stdin, capture_output=True, text=True, cwd=cwd, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, 124, "", f"no answer in {timeout_s:.0f} s ({e.cmd[0]})")
    except OSError as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def resolve_error(host: str) -> str | None:
    """Why `host` gives no address (the resolver's words), or None where it resolves."""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        return str(e.args[-1] if e.args else e)
    return None


def passwordless_fix(host: str) -> str:
    """The fix for an ssh check that failed: the name first where it does not resolve (sshd is not the
    problem then), else passwordless ssh to a running sshd."""
    unresolved = None if host in LOCAL_HOSTS else resolve_error(host)
    if unresolved:
        return (
            f"the name {host} does not resolve ({unresolved}: no address from DNS or /etc/hosts): give the "
            f"host's resolvable name or address, or add it to /etc/hosts"
        )
    if host in LOCAL_HOSTS:
        return (
            "set up passwordless ssh to this machine: ssh-keygen -t ed25519 -N '' -f ~/.ssh/id_ed25519 "
            "(if you have no key), cat ~/.ssh/id_ed25519.pub >> ~/.ssh/authorized_keys, and run sshd"
        )
    return (
        f"start sshd on {host} and make `ssh -o BatchMode=yes {host} true` work from this node: the name "
        f"must resolve, and the key be authorized (ssh-copy-id {host})"
    )


def filter_hosts(hosts: dict[str, int], include: str = "", exclude: str = "") -> tuple[list[str], list[str]]:
    """The hosts `deepspeed --include/--exclude` leaves, in hostfile order, and the problems with the
    filters, as runner.parse_resource_filter reads them: NAME[:SLOT[,SLOT...]][@NAME...]; a name
    alone is every slot of that host, and a host whose every slot is excluded is left out."""
    if include and exclude:
        return list(hosts), ["INCLUDE and EXCLUDE: give one of them (deepspeed takes one)"]
    which, spec = ("INCLUDE", include) if include else ("EXCLUDE", exclude)
    if not spec:
        return list(hosts), []
    slots: dict[str, set[int]] = {}
    problems = []
    for part in spec.split("@"):
        name, _, listed = part.partition(":")
        if name not in hosts:
            problems.append(f"{which}={spec}: {name!r} is not a host of the hostfile ({', '.join(hosts)})")
            continue
        chosen = slots.setdefault(name, set())
        for s in listed.split(",") if listed else [str(i) for i in range(hosts[name])]:
            if not (s.isascii() and s.isdigit()) or int(s) >= hosts[name]:
                problems.append(f"{which}={spec}: {name} has slots 0..{hosts[name] - 1}, not {s!r}")
            else:
                chosen.add(int(s))
    if include:
        active = [h for h in hosts if slots.get(h)]
    else:
        active = [h for h in hosts if len(slots.get(h, ())) < hosts[h]]
    if not active and not problems:
        problems.append(f"{which}={spec} leaves no host of the hostfile")
    return active, problems


def is_this_machine(addr: str, resolve: bool = False) -> bool:
    """Whether `addr` names this machine: localhost, a loopback address, an address of this machine's
    (only those can be bound), this host's name (short or qualified), or a name /etc/hosts gives such
    an address; with `resolve`, also a name the resolver (DNS) gives such an address. Without it no
    query leaves the machine, and a name only DNS knows counts as another machine."""
    me = socket.gethostname()
    if addr in LOCAL_HOSTS or addr == me or me.startswith(addr + ".") or addr.startswith(me + "."):
        return True
    if _is_ip(addr):
        return _bindable(addr)
    if any(_bindable(a) for a in _etc_hosts().get(addr.lower(), [])):
        return True
    if not resolve:
        return False
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return False
    return any(_bindable(a) for a in found)


def _is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return False
    return True


def _bindable(ip: str) -> bool:
    """A loopback address, or one a socket here can bind: an address of one of this machine's
    interfaces (any other fails with EADDRNOTAVAIL, and nothing is sent)."""
    try:
        parsed = ipaddress.ip_address(ip)
    except ValueError:
        return False
    if parsed.is_loopback:
        return True
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
    except OSError:
        return False
    return True


def _etc_hosts(path: str = "/etc/hosts") -> dict[str, list[str]]:
    """Each name of /etc/hosts (lowercase) and its addresses, as the resolver reads the file."""
    names: dict[str, list[str]] = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return names
    for line in lines:
        addr, *aliases = line.partition("#")[0].split() or [""]
        for name in aliases:
            names.setdefault(name.lower(), []).append(addr)
    return names


def free_port() -> int:
    """A port nothing listens on now, on any address (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def who_holds(port: int | str) -> str:
    return f"`ss -ltnp 'sport = :{port}'` shows it"


@dataclass
class Launch:
    """What `pretrain launch-check` checks: a launch of `hostfile` by `launcher` from this machine."""

    hostfile: str
    hosts: dict[str, int]
    launcher: Launcher = "deepspeed"
    master_addr: str | None = None  # None: the first host the launch uses
    master_port: int = 29500
    ssh_port: int | None = None
    include: str = ""
    exclude: str = ""
    node_rank: int = 0  # launcher no-ssh: this host's line in the hostfile, from 0


def ssh_targets(launch: Launch, active: list[str]) -> list[str]:
    """The hosts the launcher ssh'es to from here: DeepSpeed's (its ssh check, then pdsh to every
    host, localhost included); Open MPI's mpirun, every host but this machine; none for the others."""
    if launch.launcher == "deepspeed":
        return launch_ssh_hosts(active)
    if launch.launcher == "mpirun":
        # Open MPI starts the ranks of this machine itself, whatever name the hostfile gives it.
        return [h for h in active if not is_this_machine(h, resolve=True)]
    return []


def check(launch: Launch) -> tuple[list[str], list[str]]:
    """(problems, notes): one line per problem, each naming the host or the port and the fix; and
    what was checked and found ready."""
    active, problems = filter_hosts(launch.hosts, launch.include, launch.exclude)
    if problems:
        return problems, []
    notes = []
    targets = ssh_targets(launch, active)

    def ssh(host: str) -> subprocess.CompletedProcess[str]:
        return run(ssh_argv(host, launch.ssh_port, "hostname"), SSH_TIMEOUT_S)

    with ThreadPoolExecutor(max_workers=max(1, min(64, len(targets)))) as pool:
        answers = list(pool.map(ssh, targets))  # all at once: a dead host costs ConnectTimeout once
    for host, res in zip(targets, answers, strict=True):
        if res.returncode != 0:
            problems.append(_unreachable(launch, active, host, res))
    if targets and not problems:
        notes.append(f"{len(targets)} host(s) reachable over ssh")

    if launch.launcher == "no-ssh":
        problems += _no_ssh_node(launch)
        if problems:
            return problems, notes
        notes.append(f"node rank {launch.node_rank} is this machine ({list(launch.hosts)[launch.node_rank]})")
    master = launch.master_addr or active[0]
    port = launch.master_port
    if launch.launcher == "no-ssh" and launch.node_rank > 0:
        # The master's port opens when node 0 starts, maybe after this one: only its name is checked.
        try:
            socket.getaddrinfo(master, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            problems.append(
                f"the master {master} (MASTER_ADDR, else the first host of {launch.hostfile}) does not resolve "
                f"on this host ({e}): fix the name in {launch.hostfile}, or set MASTER_ADDR to the address "
                "this host reaches node 0 at"
            )
        else:
            notes.append(f"the master {master} resolves")
    elif is_this_machine(master):
        taken = check_port(port)
        if not taken["free"]:
            problems.append(
                f"port {port} on {master} (MASTER_PORT) is in use ({taken.get('error')}): rank 0 cannot listen "
                f"there; pick another, e.g. MASTER_PORT={free_port()} (free now), or stop what holds it "
                f"({who_holds(port)})"
            )
        else:
            notes.append(f"port {port} free on {master}")
    return problems, notes


def _no_ssh_node(launch: Launch) -> list[str]:
    """`deepspeed --no_ssh --node_rank K` here: K is a line of the hostfile, that line names this
    machine, and on node 0, which runs rank 0 and its rendezvous store, so does the master address.
    Otherwise the ranks start and wait on a rendezvous that never forms (torch's `gai error`s or a
    silent hang)."""
    hosts, rank, hostfile, me = list(launch.hosts), launch.node_rank, launch.hostfile, socket.gethostname()
    listed = ", ".join(f"{i}: {h}" for i, h in enumerate(hosts[:8])) + (", ..." if len(hosts) > 8 else "")

    def here() -> str:
        # This machine's own line, if any, from the names alone (no query leaves the machine).
        mine = [i for i, h in enumerate(hosts) if i != rank and is_this_machine(h)]
        if mine:
            return f"this machine is node rank {mine[0]} there ({hosts[mine[0]]}): use that"
        return f"to run here, add this machine to {hostfile} (or fix the name there) and use its line, from 0"

    if rank >= len(hosts):
        return [f"node rank {rank} is beyond {hostfile}, which has {len(hosts)} host(s) ({listed}); {here()}"]
    host = hosts[rank]
    if not is_this_machine(host, resolve=True):
        return [
            f"node rank {rank} of {hostfile} ({listed}) is {host}, not this machine ({me}): run it on {host}; "
            f"{here()}"
        ]
    if rank == 0 and launch.master_addr and not is_this_machine(launch.master_addr, resolve=True):
        return [
            f"node 0 runs rank 0, which listens for the rendezvous on this machine ({me}), but MASTER_ADDR="
            f"{launch.master_addr} is not this machine: set MASTER_ADDR to this machine's address as the "
            f"other hosts reach it (unset, it is {host}), or run node 0 on {launch.master_addr}"
        ]
    return []


def _unreachable(launch: Launch, active: list[str], host: str, res: subprocess.CompletedProcess[str]) -> str:
    why = last_line(res.stderr) if res.stderr.strip() else f"exit status {res.returncode}"
    if launch.launcher == "mpirun":
        leave_out = f"or remove its line from {launch.hostfile}"
    elif len(launch.hosts) == 1:
        leave_out = f"or launch without ssh: launch/no_ssh.sh {launch.hostfile} 0"
    elif len(active) == 1:
        leave_out = f"or launch without ssh: launch/no_ssh.sh with a hostfile of {host} alone, node rank 0"
    elif launch.include:
        leave_out = f"or leave it out of INCLUDE={launch.include}"
    else:
        leave_out = f"or leave it out with EXCLUDE={launch.exclude + '@' if launch.exclude else ''}{host}"
    return (
        f"host {host} is not reachable over ssh (`{deepspeed_ssh_check(host, launch.ssh_port)}` failed: "
        f"{why}): {passwordless_fix(host)}; or fix the name in {launch.hostfile}; {leave_out}"
    )
