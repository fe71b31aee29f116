"""The supervisor of `pretrain train --nproc-per-node K --max-restarts N`: K ranks under torchrun
on this machine and, when any rank dies (torchrun then stops the others), all of them started again
from the newest checkpoint, up to N times.

Each attempt is a fresh torchrun: torchrun's own --max-restarts reuses its rendezvous store, whose
stale keys from the failed attempt can break the gloo groups of the next. A SIGTERM or SIGINT is
passed on to the ranks (which save and stop) and ends the supervision. Each attempt's ranks learn
its number from PRETRAIN_RESTART_COUNT (`restart_count`), and from the second on resume.

Imports neither torch nor the training code: the supervisor only starts processes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Where a rank that stops with one of pretrain's own errors leaves it, for the supervisor to print
# (`refuse`, `supervise`): printed by a rank, it was lost whenever torchrun stopped that rank first.
REFUSED_FILE = "PRETRAIN_REFUSED_FILE"

# Where a rank learns that it was restarted: by this supervisor, torchrun, a requeued Slurm job.
RESTART_COUNTS = ("PRETRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_count() -> int:
    """How many times this run was restarted after a failure (0: its first start)."""
    return int(next((os.environ[v] for v in RESTART_COUNTS if os.environ.get(v, "").isdigit()), "0"))


def refuse(path: str, *, rank: int, message: str, collective: bool) -> bool:
    """For a rank under the supervisor: leave the error it stops with in `path` (one JSON line,
    appended in one write), for the supervisor to print once every rank has stopped. False if it
    could not be written: then the rank prints it itself."""
    line = json.dumps({"rank": rank, "message": message, "collective": collective}) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def refusals(path: Path) -> list[str]:
    """The errors the ranks left in `path`, each once, as a rank prints them: `error: ...` for one
    every rank raised alike (collective) or rank 0's own, `error (rank R): ...` for rank R's own."""
    try:
        text = path.read_text()
    except OSError:
        return []
    said: list[str] = []
    for line in text.splitlines():
        try:
            r = json.loads(line)
            rank, message, collective = int(r["rank"]), str(r["message"]), bool(r["collective"])
        except (ValueError, KeyError, TypeError):
            continue  # cut short: its rank was killed while it wrote
        error = f"error: {message}" if collective or rank == 0 else f"error (rank {rank}): {message}"
        if error not in said:
            said.append(error)
    return said


def _own_flags() -> argparse.ArgumentParser:
    """The supervisor's flags among `train`'s: the ones the ranks must not see."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-restarts")
    p.add_argument("--nproc-per-node")
    return p


def rank_arguments(train_args: list[str]) -> list[str]:
    """`train`'s arguments for the ranks: all of them, in order, but the supervisor's own."""
    return _own_flags().parse_known_args(train_args)[1]


def _die_with(parent: int) -> Any:
    """For the child (torchrun), before it runs: a SIGTERM when the supervisor dies, `kill -9`
    included (Linux's PR_SET_PDEATHSIG), which torchrun passes on to the ranks, which save and stop.
    Without it a session of its own (`start_new_session`) leaves torchrun and every rank running,
    orphaned, holding the run dir's lock. Elsewhere: nothing (None)."""
    if not sys.platform.startswith("linux"):
        return None

    def set_death_signal() -> None:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
        if os.getppid() != parent:  # the supervisor died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return set_death_signal


def rank_threads(nproc_per_node: int) -> dict[str, str]:
    """OMP_NUM_THREADS for the ranks where it is not set: this host's usable cores shared out among
    them, said once. torchrun would set 1 with a four-line warning on every run of several ranks."""
    if "OMP_NUM_THREADS" in os.environ or nproc_per_node < 2:
        return {}
    threads = max(1, len(os.sched_getaffinity(0)) // nproc_per_node)
    print(
        f"supervisor: OMP_NUM_THREADS={threads} for each of the {nproc_per_node} ranks (this host's cores "
        "shared out; set OMP_NUM_THREADS to choose)",
        flush=True,
    )
    return {"OMP_NUM_THREADS": str(threads)}


def supervise(train_args: list[str], *, script: Path, nproc_per_node: int, max_restarts: int) -> int:
    """Run `script` (the train entry point) with `train_args` on `nproc_per_node` ranks under
    torchrun, up to `max_restarts` more times after a failure. Returns the exit code: 0, the last
    attempt's, or 128 + the signal that stopped the run."""
    argv = [
        sys.executable, "-m", "pretrain.cluster.torchrun", "--standalone",  # torchrun, failures in one line
        "--nproc-per-node", str(nproc_per_node),
        str(script), *rank_arguments(train_args),
    ]  # fmt: skip
    stop: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: Any) -> None:
        stop.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    rc = 1
    threads = rank_threads(nproc_per_node)
    fd, name = tempfile.mkstemp(prefix="pretrain-refused-")
    os.close(fd)
    refused = Path(name)
    for attempt in range(max_restarts + 1):
        print(f"supervisor: attempt {attempt + 1} of {max_restarts + 1}: {' '.join(argv[1:])}", flush=True)
        refused.unlink(missing_ok=True)
        # A session of its own, so that a terminal's Ctrl-C reaches the ranks once, through us.
        env = {**os.environ, **threads, "PRETRAIN_RESTART_COUNT": str(attempt), REFUSED_FILE: str(refused)}
        child = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_die_with(os.getpid()))
        rc = child.wait()
        # What the ranks refused, printed here once every rank has stopped (a rank's own print could
        # be cut off by torchrun stopping it when another refused first)
        for error in refusals(refused):
            print(error, file=sys.stderr, flush=True)
        was_refused = refused.exists()
        refused.unlink(missing_ok=True)
        if stop:
            return 128 + stop[0]  # the ranks saved and stopped, as asked
        if rc == 0:
            return 0
        if was_refused:
            # A rank stopped with one of pretrain's own errors (a config, a run dir, a checkpoint, the
            # data): the next attempt would meet it again, or resume what it was refused to touch.
            print(
                f"supervisor: attempt {attempt + 1} was refused (the error above); not restarting, since every "
                "restart would meet it again",
                flush=True,
            )
            return 2
        more = attempt < max_restarts
        print(
            f"supervisor: attempt {attempt + 1} failed (exit {rc}); "
            + ("restarting every rank from the newest checkpoint" if more else "no restarts left"),
            flush=True,
        )
    return rc
