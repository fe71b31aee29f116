"""The commands of README.md and docs/*.md that name the quick start's run (runs/tiny, and the
exports/tiny made from it) run as written after the quick start.

The quick start (`pretrain train`: the tiny preset) leaves the checkpoints its retention keeps;
every checkpoint the docs name must be one of them. The commands then run, literally, in a
directory whose runs/tiny is a scale model of the quick start's: the tiny preset trained for a few
steps with its checkpoint interval scaled as its steps are (the same checkpoints, renamed by that
scale), on tiny-shakespeare. A `train` command gets the same scaled-down settings appended, so that
it trains the model's few steps and not the preset's 1,500. A command that two docs hold runs once."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from pretrain.config.presets import PRESETS
from pretrain.training.checkpoint.store import tag_for
from tests.conftest import ROOT, TINY_SHAKESPEARE, cli
from tests.test_fuzz_commands import main

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# runs/tiny and exports/tiny, not runs/tiny-zero2 or exports/tiny-bf16
NAMES_THE_RUN = re.compile(r"\b(?:runs|exports)/tiny(?![-\w])")
STEP = re.compile(r"step_(\d{8})")

TINY = PRESETS["tiny"]
STEPS = TINY["schedule"]["max_steps"]
INTERVAL = TINY["checkpoint"]["interval"]
SCALE = 250  # the model's steps: the quick start's 1,500 / 250 = 6, a checkpoint every 500 / 250 = 2
SCALED = [
    f"schedule.max_steps={STEPS // SCALE}", f"checkpoint.interval={INTERVAL // SCALE}",
    "schedule.warmup_steps=1", "logging.log_interval=1", "logging.eval_interval=2",
    "logging.eval_batches=1", "logging.sample_tokens=0", f"data.corpus={TINY_SHAKESPEARE}",
]  # fmt: skip


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for each command of a bash block that names the quick start's run or its
    export, continuation lines joined, in the docs' order; and the `printf ... > FILE` lines of
    those blocks, which make the files they read."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                named = NAMES_THE_RUN.search(line) or line.startswith("printf ")
                if named and not line.startswith("#"):
                    found.append((doc.relative_to(ROOT).as_posix(), line))
    return found


def kept_steps(steps: int, interval: int, keep_last: int) -> list[int]:
    """The steps whose checkpoints a run of `steps` keeps: one every `interval` and at the end, the
    newest `keep_last` of them."""
    saved = sorted({*range(interval, steps + 1, interval), steps})
    return saved[-keep_last:]


def test_the_docs_name_only_checkpoints_the_quick_start_keeps():
    """The docs have such commands, and every step_N of runs/tiny they name is one the quick start
    leaves (the tiny preset keeps its newest checkpoint.keep_last)."""
    commands = doc_commands()
    assert {doc for doc, _ in commands} >= {"README.md", "docs/checkpoints.md"}
    kept = kept_steps(STEPS, INTERVAL, TINY["checkpoint"]["keep_last"])
    assert STEPS % SCALE == 0 and INTERVAL % SCALE == 0
    for doc, command in commands:
        for step in STEP.findall(command):
            assert int(step) in kept, f"{doc}: {command}: the quick start keeps only {kept}"


@pytest.fixture(scope="module")
def after_quick_start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory as the quick start leaves the repository, to scale: runs/tiny (and data/)
    made by `pretrain train` (the tiny preset) in STEPS / SCALE steps."""
    where = tmp_path_factory.mktemp("quick-start")
    done = cli("train", *(f"--set={s}" for s in SCALED), cwd=where, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return where


def argv(command: str) -> list[str]:
    """The words bash makes of `command` (its quoting, $'...' included; a comment dropped)."""
    words = "words() { printf '%s\\0' \"$@\"; }; words " + command
    done = subprocess.run(["bash", "-c", words], capture_output=True, text=True, check=True, timeout=30)
    return done.stdout.split("\0")[:-1]


def test_the_docs_commands_run_after_the_quick_start(after_quick_start: Path, monkeypatch):
    """Each distinct command, in the docs' order, exits 0: a `printf` in bash, a `train` as a
    process (with the scaled-down settings), the others in this process (torch loads once)."""
    monkeypatch.chdir(after_quick_start)
    once: dict[str, str] = {}  # README.md's are docs/checkpoints.md's too
    for doc, command in doc_commands():
        once.setdefault(command, doc)
    for command, doc in once.items():
        command = STEP.sub(lambda m: tag_for(int(m.group(1)) // SCALE), command)  # the model's checkpoints
        if command.startswith("printf "):
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
        elif argv(command)[:2] == [".venv/bin/pretrain", "train"]:
            sets = [a for s in SCALED for a in ("--set", s)]
            done = cli(*argv(command)[1:], *sets, cwd=after_quick_start, timeout=600)
        else:
            assert argv(command)[0] == ".venv/bin/pretrain", f"{doc}: {command}"
            done = main(*argv(command)[1:])
        assert done.returncode == 0 and "Traceback" not in done.stderr, (
            f"{doc}: {command}\n{done.stderr[-3000:]}"
        )
