"""`pretrain data prepare` end to end: offline download path, the report, no-op, one-screen errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import BIN, TINY_SHAKESPEARE, cli, subprocess_env


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return cli(*args, cwd=cwd)


def test_data_prepare_tinyshakespeare_from_a_local_source(tmp_path: Path) -> None:
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


# ---------------------------------------------------------------------------------------------
# Progress, warnings and refusals of the real command


def test_data_prepare_progress_line_when_not_on_a_terminal(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"document {i} " + "words " * (i % 50) for i in range(2000)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "c.parquet", row_group_size=200)
    out = run(["data", "prepare", f"--set=data.corpus={tmp_path / 'c.parquet'}", "--workers=2"], tmp_path)
    assert out.returncode == 0, out.stderr
    # the periodic line (every 10 s) and the last one: percentage of the input bytes, rate, ETA
    assert re.search(
        r"^prepare: 100% \([\d.]+ of [\d.]+ MB\), [\d.]+ MB/s, ETA 0s, 2,000 documents kept$",
        out.stdout,
        re.M,
    )
    assert "documents: 2,000 in, 2,000 out" in out.stdout and "warning" not in out.stderr


def test_data_prepare_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    """stderr on a pseudo-terminal: tqdm's bar over the input bytes, with percentage, rate, ETA."""
    import fcntl
    import pty
    import struct
    import termios

    (tmp_path / "c.txt").write_text("to be or not to be\n" * 20000)
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen(
        [str(BIN / "pretrain"), "data", "prepare", f"--set=data.corpus={tmp_path / 'c.txt'}"],
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=sub,
        text=True,
    )
    os.close(sub)
    stdout, _ = proc.communicate(timeout=300)
    chunks = []
    while True:
        try:
            block = os.read(main, 65536)
        except OSError:  # the other end closed
            break
        if not block:
            break
        chunks.append(block)
    os.close(main)
    bar = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, bar
    assert re.search(r"prepare: 100%\|.*\| 380k/380k \[[\d:]+<00:00, .*B/s", bar), bar
    assert "prepare: 100% (" not in stdout  # the line is for logs, the bar for terminals


def test_data_prepare_warns_when_val_is_far_from_val_fraction(tmp_path: Path) -> None:
    """One huge document that hashes to val: one warning line naming it, and the fix."""
    from pretrain.data.encode import is_val_document

    lines = [json.dumps({"text": f"small document number {i}"}) + "\n" for i in range(30)]
    huge = json.dumps({"text": "x y z " * 20000}) + "\n"
    for k in range(31):
        offset = sum(len(x) for x in lines[:k])
        if is_val_document(f"c.jsonl@{offset}", 1337, 0.1):
            break
    (tmp_path / "c.jsonl").write_text("".join([*lines[:k], huge, *lines[k:]]))
    out = run(["data", "prepare", f"--set=data.corpus={tmp_path / 'c.jsonl'}"], tmp_path)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "Traceback" not in out.stderr
    assert re.match(
        rf"warning: val holds 9\d\.\d% of the tokens, but data.val_fraction is 0.1: .*\(the largest, c.jsonl@{offset}, "
        r"has 120,000 tokens, 9\d% of all, in val\); use more, smaller documents",
        warnings[0],
    ), warnings[0]


def test_data_prepare_refuses_a_binary_file_and_a_symlink_loop(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("a fine document\n")
    (tmp_path / "c" / "model.txt").write_bytes(bytes(range(256)) * 64)
    out = run(["data", "prepare", f"--set=data.corpus={tmp_path / 'c'}"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith(
        f"error: {tmp_path / 'c' / 'model.txt'}: read as text, but it looks like binary data"
    )
    (tmp_path / "c" / "model.txt").unlink()
    (tmp_path / "c" / "loop").symlink_to(tmp_path / "c")
    out = run(["data", "prepare", f"--set=data.corpus={tmp_path / 'c'}"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1
    assert "c/loop: a symbolic link loop" in out.stderr


def test_missing_optional_package_names_its_extra(tmp_path: Path) -> None:
    """pyarrow, zstandard, datasketch and ray blocked from import, as on a machine without the extras."""
    (tmp_path / "c.parquet").write_bytes(b"PAR1")
    (tmp_path / "c.jsonl.zst").write_bytes(b"")
    (tmp_path / "c.txt").write_text("a document\n")
    code = (
        "import sys; sys.modules['pyarrow'] = sys.modules['zstandard'] = sys.modules['datasketch'] = sys.modules['ray'] = None; "
        "from pretrain.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    for args, extra in (
        ([f"--set=data.corpus={tmp_path / 'c.parquet'}"], "parquet"),
        ([f"--set=data.corpus={tmp_path / 'c.jsonl.zst'}"], "zstd"),
        ([f"--set=data.corpus={tmp_path / 'c.txt'}", "--set=data.clean.near_dedup=true"], "near-dedup"),
        ([f"--set=data.corpus={tmp_path / 'c.txt'}", "--set=data.tasks=2", "--set=data.executor=ray"], "ray"),
    ):
        out = subprocess.run(
            [sys.executable, "-c", code, "data", "prepare", *args],
            cwd=tmp_path,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"pip install 'pretrain[{extra}]'" in out.stderr and len(out.stderr.splitlines()) == 1


def test_a_corpus_that_is_no_regular_file_or_is_empty_is_named_as_such(tmp_path: Path) -> None:
    """/dev/null, a FIFO or a link to nothing is named for what it is (it was "no such file"); an
    empty file as empty. One line each, with the fix, and no dataset directory made."""
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "empty.txt").write_bytes(b"")
    for corpus, what in (
        ("/dev/null", "/dev/null: a character device, not a regular file"),
        (str(tmp_path / "fifo"), "fifo: a named pipe (FIFO), not a regular file"),
        (str(tmp_path / "gone"), f"gone: a link to {tmp_path / 'nowhere'} (No such file or directory)"),
        (str(tmp_path / "empty.txt"), "empty.txt: empty, 0 bytes"),
    ):
        out = run(["data", "prepare", f"--set=data.corpus={corpus}", "--set=data.dataset_dir=ds"], tmp_path)
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert what in out.stderr and "point data.corpus at" in out.stderr, out.stderr
    assert not (tmp_path / "ds").exists()
