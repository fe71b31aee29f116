"""Who this process is and how it talks to the others: the launcher's environment (DeepSpeed's
launcher, torchrun, Slurm, MPI), joining and leaving the process group, the host-side collectives
over a small gloo group, the one way "rank 0 acts, every rank learns the outcome" is done, and
what to say when a collective loses a rank.

The ground floor of training/: it imports nothing of training/ but DeepSpeed's private hooks.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as tdist

from pretrain.cluster.launch import launcher
from pretrain.cluster.reach import free_port, who_holds
from pretrain.errors import LaunchError, PretrainError, require
from pretrain.files import pid_gone
from pretrain.training.distributed.ds_internals import skip_shm_comm_op

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        """Print on rank 0 only: every rank runs the same code, the terminal gets one copy."""
        if self.is_main:
            print(msg, flush=True)


def launch_env() -> Dist:
    """Rank and world size, as whatever started this process says, exported for torch.distributed.

    In order:
    - `RANK` already set: deepspeed's launcher (pdsh, `--no_ssh`), torchrun;
    - a Slurm job step (`srun`, as launch/slurm.sbatch starts the ranks): SLURM_PROCID and friends,
      with MASTER_ADDR/MASTER_PORT from the batch script;
    - an MPI launcher (`mpirun`, launch/mpirun.sh): rank, size and the ranks sharing this host from
      mpi4py, rank 0's host name as master unless MASTER_ADDR is set;
    - nothing: a plain `pretrain train`, rank 0 of 1 on loopback.
    Setting the variables here also keeps DeepSpeed from its own MPI discovery, which would take
    the master address from the first address of `hostname -I`.
    """
    kind = launcher()
    if kind != "env":
        if kind == "slurm":
            _env_from_slurm()
        elif kind == "mpi":
            _env_from_mpi()
        else:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
    world = int(os.environ["WORLD_SIZE"])
    return Dist(
        rank=int(os.environ["RANK"]),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", str(world)))),
    )


def _env_from_slurm() -> None:
    e = os.environ
    if "MASTER_ADDR" not in e:
        raise RuntimeError(
            "started by srun without MASTER_ADDR: submit with launch/slurm.sbatch, which sets it to the "
            "first host of the allocation, or export MASTER_ADDR (and MASTER_PORT) before srun"
        )
    # Tasks per node of this step, e.g. "8(x2)" or "2,1": take this node's entry.
    per_node = [
        int(n)
        for part in e.get("SLURM_STEP_TASKS_PER_NODE", e["SLURM_STEP_NUM_TASKS"]).split(",")
        for n, _, times in [part.partition("(x")]
        for _ in range(int(times.rstrip(")") or 1))
    ]
    local_world = str(per_node[min(int(e.get("SLURM_NODEID", "0")), len(per_node) - 1)])
    e.update(
        RANK=e["SLURM_PROCID"],
        WORLD_SIZE=e["SLURM_STEP_NUM_TASKS"],
        LOCAL_RANK=e.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=local_world,
    )
    e.setdefault("MASTER_PORT", "29500")


def _env_from_mpi() -> None:
    # Only under an MPI launcher: importing it initialises MPI.
    MPI = require("mpi4py.MPI", "an MPI launcher (mpirun, srun --mpi)", "mpi")

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    expected = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    if expected is not None and int(expected) != size:
        raise RuntimeError(
            f"the launcher started {expected} ranks but mpi4py sees a world of {size}: mpi4py loaded "
            f"another MPI than the launcher's ({MPI.Get_library_version().splitlines()[0]}). Under Open "
            "MPI's mpirun set MPI4PY_MPIABI=openmpi (launch/mpirun.sh does), under MPICH's mpirun unset it"
        )
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)  # the ranks on this host
    master = comm.bcast(
        (os.environ.get("MASTER_ADDR") or socket.gethostname(), os.environ.get("MASTER_PORT") or "29500"),
        root=0,
    )
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(node.Get_rank()),
        LOCAL_WORLD_SIZE=str(node.Get_size()),
        MASTER_ADDR=master[0],
        MASTER_PORT=master[1],
    )
    node.Free()


def init_distributed(dist: Dist, timeout_s: float = 1800) -> None:
    """Join the process group: NCCL on CUDA, gloo on the CPU (DeepSpeed picks by accelerator).

    Each rank drives the accelerator LOCAL_RANK of its host. A collective that waits on a dead or
    stuck rank for `timeout_s` (config `launch.collective_timeout_s`) fails instead of hanging.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    # DeepSpeed picks its accelerator when first imported: here and below, only after this line.
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu":
        # Ranks on one host share its cores; oversubscribed BLAS threads slow everything down.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.local_world_size))
        skip_shm_comm_op()
    else:
        accel.set_device(dist.local_rank)
    try:
        deepspeed.init_distributed(
            dist_backend=accel.communication_backend_name(),
            auto_mpi_discovery=False,  # launch_env() has set RANK, WORLD_SIZE and MASTER_* already
            verbose=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except (torch.distributed.DistNetworkError, torch.distributed.DistStoreError) as e:
        raise rendezvous_error(dist, e) from None


def leave_distributed() -> None:
    """Tear the process group down before the interpreter exits: one left to the exit can abort in
    gloo's destructor ("terminate called without an active exception", SIGABRT) even after every
    line of the script has run. Call it after a script's work is done, not on its error path: where
    another rank is still inside a collective, the teardown can wait on it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rendezvous_error(dist: Dist, e: Exception) -> LaunchError:
    """The rendezvous failed: rank 0 could not listen on MASTER_PORT (torch's TCPStore server binds it
    on every address), or another rank could not reach rank 0 there. Under DeepSpeed's launcher the
    other ranks of the host are killed when rank 0 exits; this is the one message left."""
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    where = f"{addr}:{port} (MASTER_ADDR:MASTER_PORT)"
    said = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
    if dist.rank == 0 and ("EADDRINUSE" in said or "address already in use" in said.lower()):
        free = free_port()
        return LaunchError(
            f"rank 0 cannot listen on port {port} for the rendezvous at {where}: it is in use. Pick a free "
            f"port, e.g. {free} (free now): deepspeed --master_port {free} ..., or MASTER_PORT={free} "
            f"launch/...; or stop what holds it ({who_holds(port)})"
        )
    if dist.rank == 0:
        return LaunchError(f"rank 0 cannot start the rendezvous at {where}: {said}")
    return LaunchError(
        f"cannot join the rendezvous at {where}: {said}. Rank 0 must be running and listening there, "
        "and reachable from this host (the name, a firewall, launch.socket_ifname)"
    )


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator  # after init_distributed, see there

    return torch.device(get_accelerator().current_device_name())


# ---------------------------------------------------------------------------------------------
# Collectives over a small gloo group (flags and file lists stay off the GPU); no-ops alone.


def control_group() -> Any:
    """A gloo group of all ranks for host-side agreement (stop, bad step, save errors)."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return None
    return tdist.new_group(backend="gloo")


def world_group() -> Any:
    """The default group of every rank, None alone (before or without a process group)."""
    if not (tdist.is_available() and tdist.is_initialized()):
        return None
    return tdist.group.WORLD


def world_of(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return tdist.get_rank(group), tdist.get_world_size(group)


def gather(obj: Any, group: Any) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * tdist.get_world_size(group)
    tdist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any) -> None:
    if group is not None:
        tdist.barrier(group=group)


def rank_0_acts(act: Callable[[], T], group: Any) -> T | None:
    """Rank 0 does `act`; every rank learns how it went, and a refusal (a `PretrainError`) is raised
    on every rank alike, of the same class with the same message. Rank 0 gets `act`'s result, the
    others None. The one way the run does what only one rank may (claim the run dir, write its
    record, prepare the dataset) without leaving the others waiting on a rank that has failed."""
    rank, _ = world_of(group)
    result, refused = None, None
    if rank == 0:
        try:
            result = act()
        except PretrainError as e:
            refused = (type(e), e.args, dict(vars(e)))
    said = gather(refused, group)[0]
    if said is not None:
        kind, args, state = said
        error = kind.__new__(kind)  # as rank 0's, whatever its constructor takes (ConfigError: a list)
        error.args = args
        vars(error).update(state)
        raise error
    return result


# ---------------------------------------------------------------------------------------------
# A rank that is gone

_ROSTER: list[tuple[str, int]] = []  # every rank's (host, pid), gathered at the start of training
# What gloo and NCCL say when the other end of a collective is gone (not a timeout: the watchdog's).
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "NCCL communicator was aborted",
)


def set_roster(roster: list[tuple[str, int]]) -> None:
    """Every rank's (host, pid), in rank order: who to look for when a collective loses a peer."""
    _ROSTER[:] = roster


def lost_rank(e: BaseException, rank: int, wait_s: float = 3.0) -> str | None:
    """If `e` is a collective that failed because another rank is gone: one message saying so,
    naming the ranks on this host that have exited (looked for up to `wait_s`: a crashing rank may
    still be on its way out) or where else to look, and the fix. None for any other error."""
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(m in text for m in _PEER_GONE):
        return None
    first = (text.strip().splitlines() or [""])[0]
    first = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\]\s*", "", first)  # gloo's source location
    first = first.split(" This is typically", 1)[0].rstrip(". ")
    here = socket.gethostname()
    local = [(r, pid) for r, (host, pid) in enumerate(_ROSTER) if r != rank and host == here]
    others = sorted({host for r, (host, _) in enumerate(_ROSTER) if host != here})
    deadline = time.monotonic() + wait_s
    while not (gone := [(r, pid) for r, pid in local if pid_gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    if gone:
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
        who = (
            f"{names} on this host {'has' if len(gone) == 1 else 'have'} exited, killed or crashed: "
            "its own output, or the kernel log (`dmesg`: the out-of-memory killer), says why"
        )
    elif others:
        who = (
            f"no rank on this host has exited, so the one lost ran on {', '.join(others[:4])}"
            f"{' ...' if len(others) > 4 else ''}: its output there says why"
        )
    else:
        who = "which one could not be told from here"
    return (
        f"rank {rank} lost another rank in the middle of a collective ({first}): {who}. This rank stopped "
        "without saving: continue from the newest checkpoint with --resume auto (under --max-restarts N "
        "the ranks restart by themselves)"
    )
