"""torchrun as the supervisor starts it (`python -m pretrain.cluster.torchrun ARGS`): torch's own
launcher (torch.distributed.run) with the same arguments, except that

- when ranks fail it says which in one line each, first failure first, instead of torchrun's
  traceback of its own launcher;
- a SIGTERM or SIGINT stops it without one: torchrun passes the signal on to the ranks, which save,
  stop and say so, and it exits 128 + the signal. Its own handler raised `SignalException` through
  `run` afterwards, and raised it again inside its wait for the ranks when the signal came twice
  (a traceback each); here a repeat goes to the ranks, whose handler tells a launcher's repeat from a
  person's second Ctrl-C, and torchrun's wait goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

STOP = (signal.SIGTERM, signal.SIGINT)
# torchrun's log lines that only narrate what the lines of the ranks and of `main` already say
_NARRATION = (
    "Received %s death signal, shutting down workers",
    "Sending process %s closing signal %s",
    "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
)


class _Narration(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in _NARRATION


def _children() -> list[int]:
    """This process's children: the ranks (from /proc; none where there is no /proc)."""
    me, found = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == me:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _pass_on(signum: int, frame: Any) -> None:
    """A repeat, while torchrun waits for the ranks to stop: to each rank's process group, as
    torchrun sends its own (each rank leads a session of its own)."""
    for pid in _children():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum)


def _stop(signum: int, frame: Any) -> None:
    """The first SIGTERM or SIGINT: what torchrun's own handler does (its agent catches this, passes
    the signal on to the ranks and waits for them), with every later one passed on instead."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    for s in STOP:
        signal.signal(s, _pass_on)
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    # torchrun installs its handler for the signals it is told to (--signals-to-handle) when it starts
    # the ranks: not for SIGTERM and SIGINT, which are ours (installed now, before it starts anything)
    named = [s.strip() for s in args.signals_to_handle.split(",")]
    args.signals_to_handle = ",".join(s for s in named if s not in {s.name for s in STOP}) or "SIGHUP"
    for s in STOP:
        signal.signal(s, _stop)
    for module in ("agent.server.api", "multiprocessing.api"):
        logging.getLogger(f"torch.distributed.elastic.{module}").addFilter(_Narration())
    try:
        run(args)
    except SignalException as e:
        return 128 + int(e.sigval)  # the ranks said what they did (saved, stopped at once)
    except ChildFailedError as e:
        first, _ = e.get_first_failure()
        for rank in sorted(e.failures, key=lambda r: (r != first, r)):
            f = e.failures[rank]
            how = f"was killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with status {f.exitcode}"
            after = "" if rank == first else f", after rank {first} (torchrun stops the others)"
            print(f"torchrun: rank {rank} (pid {f.pid}) {how}{after}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
