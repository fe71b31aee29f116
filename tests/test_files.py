"""files.py's rule for single files: written over none or a previous output, never over another."""

from __future__ import annotations

from pathlib import Path

from pretrain.files import not_ours, read_bytes


def test_not_ours_names_what_a_command_must_not_overwrite(tmp_path: Path) -> None:
    mine, theirs, absent, folder = (tmp_path / n for n in ("mine", "theirs", "absent", "folder"))
    mine.write_bytes(b"ours: 1\n")
    theirs.write_bytes(b"a person's notes\n")
    folder.mkdir()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    paths = [mine, theirs, absent, folder, dangling]
    assert not_ours(paths, lambda data: data.startswith(b"ours:")) == [theirs, folder, dangling]
    assert read_bytes(mine) == b"ours: 1\n" and read_bytes(absent) is None and read_bytes(folder) is None
