"""Where log lines go: DeepSpeed's to stderr, so that a command's stdout is its own output alone
(`render`, `config` and `plan --json` print exactly JSON or YAML). Imports neither torch nor DeepSpeed."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


class _Stderr:
    """Whatever sys.stderr is when a line is written (a caller may have redirected it since)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _to_stderr(handler: logging.Handler) -> None:
    if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
        handler.setStream(_Stderr())


class _StderrLogger(logging.Logger):
    """A logger whose handlers on stdout write to stderr instead."""

    def addHandler(self, hdlr: logging.Handler) -> None:
        _to_stderr(hdlr)
        super().addHandler(hdlr)


def deepspeed_logs_to_stderr() -> None:
    """DeepSpeed's log lines ("Setting accelerator to CPU", its warnings) go to stderr: stdout is the
    commands' own output, which for `render`, `config` and `plan --json` is exactly JSON or YAML.

    DeepSpeed gives its logger a handler on sys.stdout when it is first imported; the logger is made
    here first, before any command imports DeepSpeed (this imports neither torch nor DeepSpeed), of
    a class that turns such a handler to stderr. Where DeepSpeed is loaded already, its handlers are
    turned now."""
    made = logging.getLoggerClass()
    logging.setLoggerClass(_StderrLogger)
    try:
        log = logging.getLogger("DeepSpeed")  # deepspeed/utils/logging.py's name
    finally:
        logging.setLoggerClass(made)
    for h in log.handlers:
        _to_stderr(h)
    if not any(isinstance(f, _NoCpuFallbackWarning) for f in log.filters):
        log.addFilter(_NoCpuFallbackWarning())


class _NoCpuFallbackWarning(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU. If you have GPU ... we were unable to detect
    it" on a machine with no GPU device to detect, where every command would print it for nothing. Where
    the machine has one (a CPU-only torch on a GPU host), the warning says something and stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Setting accelerator to CPU"):
            return True
        return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()  # NVIDIA, ROCm
