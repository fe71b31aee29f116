"""The values the command line's options take, checked as argparse parses them: bounded numbers,
host names, seeds, stop strings, and options given once. A bad value is argparse's one-line error
(exit 2) naming the flag; nothing here imports torch."""

from __future__ import annotations

import argparse
from typing import Any

from pretrain.cluster.launch import valid_host


def number(
    kind: type[int] | type[float],
    low: float,
    *,
    above: bool = False,
    high: float | None = None,
    finite: bool = False,
) -> Any:
    """An argparse type: a `kind` number at least `low` (above it with `above`), at most `high`,
    and not infinite with `finite`. A bad value is argparse's one-line error (exit 2), naming the
    flag and the range."""
    bound = f"{'above' if above else 'at least'} {low:g}" + (
        f" and at most {high:g}" if kind is float and high is not None
        else f" and at most {int(high)}" if high is not None else ""
    )  # fmt: skip
    noun = "a whole number" if kind is int else "a finite number" if finite else "a number"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        out = value < low or (above and value == low) or (high is not None and value > high)
        if value != value or out or (finite and abs(value) == float("inf")):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {noun} {bound}")
        return value

    return parse


COUNT = number(int, 1)  # ranks, workers, samples, tokens
NON_NEGATIVE = number(int, 0)  # restarts, seeds, top-k (0: all)
PORT = number(int, 1, high=65535)
POSITIVE = number(float, 0, above=True)  # sizes, seconds, rates, temperature
FRACTION = number(float, 0, above=True, high=1)
WORKERS = number(int, 0, high=1024)  # processes on one machine
# The ranks of one job, for plans and renders: 2**20, well past the largest clusters built.
WORLD = number(int, 1, high=2**20)
MEASURE = number(float, 0, above=True, finite=True)  # a plan's sizes, peaks and bandwidths


def HOST(text: str) -> str:
    """A host name or IPv4 address, as a hostfile takes them (no shell metacharacters)."""
    if not valid_host(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a host name or address (letters, digits, '.', '-' and '_' only)"
        )
    return text


class Once(argparse.Action):
    """An option that takes one value: given twice, it is an error naming both, not the last one
    silently (`--config a.yaml --config b.yaml` would drop a.yaml)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            parser.error(
                f"{option_string} given twice ({given!r}, then {values!r}): give it once; "
                + ("layer files with --set KEY=VALUE or one --config that holds both" if self.dest != "preset"
                   else "a run starts from one preset; change its fields with --set KEY=VALUE")
            )  # fmt: skip
        setattr(namespace, self.dest, values)


def seed(text: str) -> int:
    """--seed: a whole number torch's generators take, 0 to 2**64 - 1."""
    value = int(NON_NEGATIVE(text))
    if value > 2**64 - 1:
        raise argparse.ArgumentTypeError(
            f"{text} is out of range: a whole number from 0 to 2**64 - 1 ({2**64 - 1})"
        )
    return value


def stop(text: str) -> str:
    """--stop's argparse type: a string that can end a sample (an empty one would end each at once)."""
    if not text:
        raise argparse.ArgumentTypeError(
            "an empty stop string would end every sample before its first token: give the text that "
            "ends a sample, e.g. --stop $'\\n\\n'"
        )
    return text
