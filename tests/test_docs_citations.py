"""Every test the docs cite as evidence (`test_x.py::test_name`, parameters aside) exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITED = re.compile(r"`(test_[a-z0-9_]+\.py)::([A-Za-z0-9_]+)")


def test_every_cited_test_exists():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for file, name in CITED.findall(doc.read_text()):
            path = ROOT / "tests" / file
            if not path.is_file() or not re.search(rf"^(async )?def {name}\(", path.read_text(), re.M):
                missing.append(f"{doc.relative_to(ROOT)}: {file}::{name}")
    assert missing == []
