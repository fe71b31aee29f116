"""Every error meant for a person, in one place. Standard library only: the command line catches
these without importing torch.

`pretrain` prints a `PretrainError` as one message, with no traceback, and exits 2. Anything else
that escapes is a bug.
"""

from __future__ import annotations

import difflib
import importlib
from types import ModuleType


class PretrainError(Exception):
    """A problem a person can fix: the message names it and the fix.

    `collective` errors are raised on every rank alike, so only rank 0 prints them."""

    collective = True


def _listing(head: str, problems: list[str]) -> str:
    return "\n".join([head, *(f"  - {p}" for p in problems)])


class ConfigError(PretrainError, ValueError):
    """A config problem: the message lists every problem, one per line."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        super().__init__(
            _listing(
                f"invalid {source} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):", problems
            )
        )


class HostfileError(PretrainError, ValueError):
    """A hostfile problem: every bad line, one per line of the message."""

    def __init__(self, problems: list[str], source: str = "hostfile") -> None:
        self.problems = problems
        self.source = source
        super().__init__(_listing(f"invalid hostfile {source}:", problems))


class DataError(PretrainError):
    """A data problem: the message names the file and the problem."""


class MissingExtraError(PretrainError, ImportError):
    """An optional feature whose package is not installed: the message names the extra to install."""


def require(module: str, feature: str, extra: str) -> ModuleType:
    """Import `module` for `feature`, or raise MissingExtraError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{feature} needs `{module.partition('.')[0]}`, which is not installed ({e}): "
            f"pip install 'pretrain[{extra}]' (in a checkout: .venv/bin/pip install -e '.[{extra}]')"
        ) from e


class CheckpointError(PretrainError, RuntimeError):
    """A checkpoint problem (unwritable dir, full disk, nothing valid to load). Pass
    `collective=False` when only this rank saw it, so that it prints it itself."""

    def __init__(self, message: str, collective: bool = True) -> None:
        super().__init__(message)
        self.collective = collective


class LaunchError(PretrainError):
    """A launch problem one rank ran into (the rendezvous port taken, rank 0 out of reach): that rank
    prints it, the others may never get that far."""

    collective = False


class RankLostError(PretrainError):
    """Another rank is gone mid-run (killed, crashed, its host down): each rank that saw its
    collective fail says so itself, naming the rank it lost where it can tell."""

    collective = False


class OutputError(PretrainError):
    """An output path that would overwrite or delete what the command did not write, or a run dir
    another run is using."""


def did_you_mean(name: str, choices: list[str] | set[str]) -> str:
    """' (did you mean 'x'?)' for the closest of `choices`, or '' if none is close."""
    close = difflib.get_close_matches(name, sorted(choices), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
