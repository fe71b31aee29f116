"""`pretrain data prepare` end to end: offline download path, the report, no-op, one-screen errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import TINY_SHAKESPEARE, require_shared_data, subprocess_env

BIN = Path(sys.executable).parent


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "pretrain"), *args],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_data_prepare_tinyshakespeare_from_a_local_source(tmp_path: Path) -> None:
    require_shared_data()
    args = ["data", "prepare", "--set", "data.corpus=tinyshakespeare", "--source", str(TINY_SHAKESPEARE)]
    first = run(args, tmp_path)
    assert first.returncode == 0, first.stderr
    assert "documents: 1 in, 1 out" in first.stdout
    assert "dataset ready in data/tinyshakespeare-char: train 1,003,854 tokens" in first.stdout
    assert "vocab 65 (char, uint16)" in first.stdout
    assert not (tmp_path / "data" / "downloads").exists()  # the network path was never taken
    again = run(
        ["prepare", "--set", "data.corpus=tinyshakespeare"], tmp_path
    )  # no --source: nothing to fetch
    assert again.returncode == 0, again.stderr
    assert "already prepared" in again.stdout


def test_data_prepare_errors_are_one_screen(tmp_path: Path) -> None:
    (tmp_path / "blank.txt").write_text("\n\n")
    out = run(["data", "prepare", f"--set=data.corpus={tmp_path / 'blank.txt'}"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"error: {tmp_path / 'blank.txt'}: no document left after cleaning")
    out = run(
        ["data", "prepare", "--set", "data.corpus=tinyshakespeare", "--source", str(tmp_path / "blank.txt")],
        tmp_path,
    )
    assert out.returncode == 2 and "not a copy of it" in out.stderr and len(out.stderr.splitlines()) < 5
