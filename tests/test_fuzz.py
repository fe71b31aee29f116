"""Every command, fed random and hostile arguments and files: one clear message or a normal result,
never a traceback, a hang, a shell command run, or a write outside the directories it was given.

The cases come from the argument parser itself (every option of every command), with values from
pools of numbers, strings and paths a careless or hostile user could pass: binary, empty, huge
(sparse), deeply nested, alias-bombed and duplicate-keyed files, directories, a FIFO, a symlink loop,
paths under a file, and our own precious files. The count is printed (`-s` shows it)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

SEED = 20261203
CASES_PER_COMMAND = 60
HANG_S = 60  # a case still running after this is a hang

# Commands fuzzed with random arguments. `train`, `preflight` and `launch-check` start ranks or reach
# hosts; they get the cases that must fail before either (bad config, bad hostfile), listed further down.
RANDOM_COMMANDS = [
    "config", "render", "presets", "hostfile", "launch-env", "plan", "plot",
    "export", "convert", "sample", "data prepare",
]  # fmt: skip

NUMBERS = [
    "0",
    "-1",
    "1",
    "2",
    "3.5",
    "-0.0",
    "1e999",
    "nan",
    "inf",
    "-inf",
    "0x10",
    "1_000",
    "",
    " ",
    "9" * 400,
]
STRINGS = [
    "", "\x01", "é", "..", "-", "--", "a" * 5000, "%s%n%x", "$(touch PWNED)", "; touch PWNED #",
    "`touch PWNED`", "{preset}", "{0}", "cpu", "cuda:7", "A100", "fp32", "bf16",
]  # fmt: skip
SETS = [
    "model.n_layer=-1", "model.n_layer=1e999", "model=3", "=", "model.n_layer", "a.b.c.d=1", "x=1",
    "model.n_embd=7", "batch.micro_batch_size=0", "optimizer.lr=nan", "zero.stage=5", "precision.bf16=maybe",
    "data.corpus=/dev/zero", "logging.run_dir=/proc/self", "schedule.max_steps=0", "model.n_layer=2",
    "checkpoint.keep_last=-3", "data.tokenizer=bpe-9", "launch.env={'A': 1}", "model.dropout=2",
]  # fmt: skip


def _files(root: Path) -> dict[str, Path]:
    """Hostile inputs, made once."""
    f = {}

    def put(name: str, data: bytes) -> None:
        f[name] = root / name
        f[name].write_bytes(data)

    put("binary", bytes(range(256)) * 64)
    put("text.txt", b"To be, or not to be, that is the question.\n" * 40)
    put("yaml-dup.yaml", b"model:\n  n_layer: 3\n  n_layer: 4\n")
    put("yaml-list.yaml", b"- 1\n- 2\n")
    put("yaml-types.yaml", b"model: {n_layer: [1, 2], n_embd: {a: 1}}\nbatch: 7\n")
    put("deep.json", b"[" * 50000)
    put("json-dup.json", b'{"train_batch_size": 8, "train_batch_size": 16}')
    put("ds-foreign.json", b'{"train_batch_size": "auto", "zero_optimization": 2, "fp16": true, "x": [1]}')
    bomb = "a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10)
    )
    put("bomb.yaml", bomb.encode())
    put("empty", b"")
    put("hostfile-garbage", b"node-1 slots=8\nnode 2 slots=x\n\x00\x01\nlocalhost slots=0\n")
    put("hostfile-huge-slots", b"localhost slots=" + b"9" * 5000 + b"\n")
    put("latin1.yaml", "model:\n  n_layer: 3 # d\xe9j\xe0\n".encode("latin-1"))
    f["huge"] = root / "huge"
    with f["huge"].open("wb") as h:
        h.truncate(3 << 30)  # 3 GB, sparse
    f["dir"] = root / "a_dir"
    f["dir"].mkdir()
    f["loop"] = root / "loop"
    (f["loop"]).mkdir()
    (f["loop"] / "self").symlink_to(f["loop"])
    (f["loop"] / "a").symlink_to(f["loop"] / "b")
    (f["loop"] / "b").symlink_to(f["loop"] / "a")
    f["fifo"] = root / "fifo"
    os.mkfifo(f["fifo"])
    f["bad-run"] = root / "bad-run"  # a run dir whose metrics are damaged
    f["bad-run"].mkdir()
    (f["bad-run"] / "metrics.csv").write_bytes(
        b"step,loss,lr\n1,2.5,0.1\n2,abc\n\xff\x00\xfe\n" + b"9," * 99 + b"\n"
    )
    (f["bad-run"] / "starts.csv").write_bytes(b"step,world_size\nnan,1\n\x00\n")
    f["under-a-file"] = f["binary"] / "x"
    f["missing"] = root / "missing"
    f["dev-null"] = Path("/dev/null")
    return f


def _precious(root: Path) -> dict[str, Path]:
    """Files and directories of a person's that no command may change."""
    d = root / "precious"
    (d / "run" / "checkpoints").mkdir(parents=True)
    (d / "notes.txt").write_text("my notes\n")
    (d / "run" / "config.yaml").write_text("model: {}\n")
    (d / "run" / "checkpoints" / "latest").write_text("step_00000002\n")
    (d / "zero2.json").write_text('{"train_batch_size": 8}\n')
    (d / ".deepspeed_env").write_text("WANDB_API_KEY=secret\n")
    return {"precious-dir": d, "precious-run": d / "run", "precious-file": d / "notes.txt"}


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _options(p: argparse.ArgumentParser) -> tuple[list[argparse.Action], list[argparse.Action]]:
    opts = [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    pos = [a for a in p._actions if not a.option_strings]
    return opts, pos


def _subparser(root: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    p = root
    for word in command.split():
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[word]
    return p


def _value(rng: random.Random, action: argparse.Action, paths: list[str]) -> str:
    if action.choices:
        return rng.choice([*map(str, action.choices), *rng.sample(STRINGS, 2)])
    if action.dest == "overrides":
        return rng.choice(SETS)
    if action.type is not None and action.type is not str:
        return rng.choice(NUMBERS + rng.sample(STRINGS, 2))
    return rng.choice(paths + rng.sample(STRINGS, 3))


def _random_case(
    rng: random.Random, root: argparse.ArgumentParser, command: str, paths: list[str], corpus: Path
) -> list[str]:
    p = _subparser(root, command)
    opts, pos = _options(p)
    argv = command.split()
    argv += [rng.choice(paths + STRINGS[:6]) for _ in pos]
    for action in rng.sample(opts, k=rng.randint(0, min(5, len(opts)))):
        flag = rng.choice(action.option_strings)
        if action.nargs == 0 or (action.nargs == "?" and rng.random() < 0.3):
            argv.append(flag)
        else:
            argv += [flag, _value(rng, action, paths)]
    if command == "sample":
        argv += ["--max-new-tokens", "2"]  # a sound source must not turn the case into a long job
    if command == "data prepare" and not any("data.corpus" in a for a in argv):
        argv.append(f"--set=data.corpus={corpus}")  # not the default corpus each time
    return argv


def _fixed_cases(f: dict[str, Path], precious: dict[str, Path]) -> list[list[str]]:
    """Hostile cases for `train`, `preflight` and `launch-check` that must stop before any rank or
    host starts, and the writes that would destroy precious things."""
    bad_cfgs = [
        "yaml-dup.yaml",
        "yaml-list.yaml",
        "yaml-types.yaml",
        "bomb.yaml",
        "binary",
        "huge",
        "latin1.yaml",
    ]
    stop = "--set=schedule.max_steps=0"  # invalid: whatever else a case holds, no run starts
    cases = [["train", "--config", str(f[c])] for c in bad_cfgs]
    cases += [["train", "--ds", str(f[c])] for c in ("deep.json", "json-dup.json", "binary", "fifo", "dir")]
    cases += [["train", "--set", s, stop] for s in SETS]
    cases += [
        ["train", "--max-restarts", "-1"],
        ["train", "--nproc-per-node", "0"],
        ["train", "--resume", stop],
    ]
    for h in ("binary", "hostfile-garbage", "hostfile-huge-slots", "empty", "missing", "dir", "fifo", "huge"):
        cases.append(["preflight", "--hostfile", str(f[h])])
        cases.append(["launch-env", "--hostfile", str(f[h])])
        cases.append(["plan", "--hostfile", str(f[h])])
        cases.append(["launch-check", str(f[h])])
    cases += [
        ["export", str(precious["precious-run"]), "--out", str(precious["precious-dir"])],
        ["export", str(f["missing"]), "--out", str(precious["precious-dir"])],
        ["render", "--all", "--out-dir", str(precious["precious-dir"])],
        ["launch-env", "--output", str(precious["precious-dir"] / ".deepspeed_env")],
        ["launch-env", "--output", str(precious["precious-file"])],
        ["plot", str(precious["precious-run"]), "--out", str(precious["precious-file"])],
        ["plot", str(f["bad-run"])],
        ["plot", str(f["bad-run"]), "--out", str(f["bad-run"])],
        ["plot", str(f["bad-run"]), "--out", str(precious["precious-file"]) + ".pdf"],
        ["render", "--out-dir", str(precious["precious-dir"])],
        ["render", "--all", "--check", "--out-dir", str(precious["precious-dir"])],
        ["render", "--all", "--out-dir", str(precious["precious-run"])],
        [
            "data",
            "prepare",
            f"--set=data.corpus={f['loop']}",
            f"--set=data.dataset_dir={precious['precious-dir']}",
        ],
        [
            "data",
            "prepare",
            f"--set=data.corpus={f['text.txt']}",
            f"--set=data.dataset_dir={precious['precious-run']}",
        ],
        ["data", "prepare", f"--set=data.corpus={f['fifo']}"],
        ["data", "prepare", f"--set=data.corpus={f['binary']}", "--set=data.tokenizer=char"],
        ["data", "prepare", f"--set=data.corpus={f['under-a-file']}"],
        ["sample", str(precious["precious-run"]), "--temperature", "-1"],
        ["sample", str(f["binary"])],
        ["sample", str(precious["precious-run"]), "--seed", "9" * 30, "--num-samples", "9" * 12],
        ["convert", str(precious["precious-run"])],
    ]
    return cases


class _Hang(Exception):
    pass


def _run(argv: list[str]) -> tuple[int, str, BaseException | None]:
    from pretrain.cli import main

    out, err = io.StringIO(), io.StringIO()

    def alarm(signum: int, frame: Any) -> None:
        raise _Hang(f"no answer in {HANG_S} s")

    old = signal.signal(signal.SIGALRM, alarm)
    env = dict(os.environ)  # `train` sets MASTER_ADDR/PORT as a launcher would: not for the next case
    signal.alarm(HANG_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse's own errors: exit 2 with a usage line
                rc = e.code if isinstance(e.code, int) else 2
        return rc, err.getvalue(), None
    except BaseException as e:  # anything else is the bug this test looks for
        return -1, err.getvalue(), e
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.distributed  # `train` cases import DeepSpeed; a few write datasets
def test_fuzz_every_command(tmp_path, monkeypatch):
    from pretrain.cli import parser

    (tmp_path / "inputs").mkdir()
    files = _files(tmp_path / "inputs")
    precious = _precious(tmp_path)
    before = _snapshot(precious["precious-dir"])
    git_before = subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    work = tmp_path / "cwd"  # where default outputs (data/, runs/) of the commands go
    work.mkdir()
    monkeypatch.chdir(work)
    paths = [str(p) for p in files.values()] + [str(p) for p in precious.values()]

    rng = random.Random(SEED)
    root = parser()
    cases = _fixed_cases(files, precious)
    for command in RANDOM_COMMANDS:
        cases += [
            _random_case(rng, root, command, paths, files["text.txt"]) for _ in range(CASES_PER_COMMAND)
        ]

    failures = []
    codes: dict[int, int] = {}
    for argv in cases:
        rc, err, exc = _run(argv)
        codes[rc] = codes.get(rc, 0) + 1
        if exc is not None or rc not in (0, 1, 2) or "Traceback" in err:
            failures.append(
                f"{argv!r}: rc {rc}, {type(exc).__name__ if exc else ''} {str(exc)[:300]}\n{err[-600:]}"
            )
    print(
        f"\nfuzz: {len(cases)} cases over {len(RANDOM_COMMANDS) + 3} commands; exit codes {sorted(codes.items())}"
    )
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures[:15])
    after = _snapshot(precious["precious-dir"])
    changed = [name for name, data in before.items() if after.get(name) != data]
    assert not changed, f"a command changed or removed a person's files: {changed}"
    assert not list(tmp_path.rglob("PWNED")) and not list(ROOT.glob("PWNED")), "a shell command ran"
    git_after = subprocess.run(
        ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert git_after == git_before, "a command wrote into the source tree"


# ---------------------------------------------------------------------------------------------
# The launch scripts' environment

# Hostile values of the variables each script reads; every one must be refused before a launcher
# starts (none of them is valid, so a case that gets past the checks starts a real DeepSpeed launch:
# the group of its processes is killed at HANG_S and the case fails).
LAUNCH_ENV = {
    "MASTER_PORT": ["-1", "0", "65536", "999999", "1e3", "0x10", " 29500", "\u0663\u0663", "29500;touch PWNED",
                    "$(touch PWNED)"],
    "MASTER_ADDR": ["a;b", "$(touch PWNED)", "-oProxyCommand=touch_PWNED", "-oProxyCommand", "-", " ",
                    "host name", "a..b", "\u00e9t\u00e9", "`touch PWNED`"],
    "PYTHON": ["/nonexistent/python", "/dev/null", "."],
}  # fmt: skip
LAUNCH_ENV_OF = {
    "pdsh.sh": {"SSH_PORT": ["abc", "70000", "-1", "22;touch PWNED"], "INCLUDE": ["nohost", ";touch PWNED"],
                "EXCLUDE": ["a@@b", "localhost:9"]},
    "no_ssh.sh": {"NODE_RANK": ["x", "-1", "99", "1;touch PWNED", "1e3"]},
    "slurm.sbatch": {"SLURM_NTASKS_PER_NODE": ["0", "x", "-2"]},
}  # fmt: skip


@pytest.mark.parametrize("script", ["pdsh.sh", "no_ssh.sh", "mpirun.sh", "slurm.sbatch"])
def test_fuzz_the_launch_scripts_environment(script, tmp_path):
    """Each launch script with each hostile value of the variables it reads: exit 2 with one message
    naming the problem, no traceback, no shell command run, nothing started."""
    from tests.test_launch_check import FAKE_MPIRUN, FAKE_SSH, HOSTS, assert_nothing_started, run_script

    cases = [
        (var, v) for var, values in {**LAUNCH_ENV, **LAUNCH_ENV_OF.get(script, {})}.items() for v in values
    ]
    if script == "no_ssh.sh":  # a well-formed master that is not this machine, where node 0 runs rank 0
        cases.append(("MASTER_ADDR", HOSTS[0]))
    for i, (var, value) in enumerate(cases):
        case = tmp_path / str(i)
        (case / "bin").mkdir(parents=True)
        for name, text in (("ssh", FAKE_SSH), ("mpirun", FAKE_MPIRUN)):
            (case / "bin" / name).write_text(text)
            (case / "bin" / name).chmod(0o755)
        fakes = {"bin": case / "bin", "ssh_log": case / "ssh.log", "mpirun_log": case / "mpirun.log"}
        hostfile = case / "hostfile"
        hostfile.write_text("localhost slots=1\n")
        out = run_script(script, hostfile, fakes, case, **{var: value})
        said = f"{script} {var}={value!r}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        assert out.returncode == 2, said
        lines = out.stderr.strip().splitlines()
        # the script's own line, or pretrain's error (a hostfile or INCLUDE problem lists each one)
        assert lines and lines[0].startswith((f"launch/{script}: ", "error: ")), said
        assert len(lines) == 1 or (lines[0].startswith("error: ") and len(lines) <= 4), said
        assert_nothing_started(out, fakes)
        assert not (case / "PWNED").exists() and not (ROOT / "PWNED").exists(), said
