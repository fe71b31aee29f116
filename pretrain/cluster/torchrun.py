"""torchrun as the supervisor starts it (`python -m pretrain.cluster.torchrun ARGS`): torch's own
launcher (torch.distributed.run) with the same arguments, except that when ranks fail it says which
in one line each, first failure first, instead of torchrun's traceback of its own launcher."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
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
