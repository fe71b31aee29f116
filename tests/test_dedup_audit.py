"""Dedup can be audited: `dedup_removed.jsonl` in the dataset names each removed exact and near copy
with the kept document it matched and their similarity, cut at DEDUP_LISTED and saying so, and the
report gives examples and how often MinHash LSH misses a near pair at its bands and rows."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pretrain.data import tasks
from pretrain.data.dataset import load_manifest
from pretrain.data.prepare import prepare
from pretrain.data.report import format_report, lsh_misses
from tests.test_data_tasks import _cfg, _doc, _near


def _planted(d: Path) -> tuple[dict[str, str], dict[str, str]]:
    """a_orig.jsonl of 30 documents; b_copies.jsonl of 20 new ones with 3 exact copies and 4 near copies
    (one word of 200 changed) of documents of the first. Returns {copy: original} for each kind, as
    the pipeline names documents (file@byte offset)."""
    rng = random.Random(11)
    originals = [_doc(rng) for _ in range(30)]
    lines = [(_doc(rng), None) for _ in range(20)]
    for k in (2, 9, 17):
        lines.insert(rng.randrange(len(lines)), (originals[k], ("exact", k)))
    for k in (4, 12, 21, 28):
        lines.insert(rng.randrange(len(lines)), (_near(rng, originals[k]), ("near", k)))
    offsets, at = [], 0
    with open(d / "a_orig.jsonl", "w") as f:
        for text in originals:
            offsets.append(at)
            at += f.write(json.dumps({"text": text}) + "\n")
    exact, near, at = {}, {}, 0
    with open(d / "b_copies.jsonl", "w") as f:
        for text, copy in lines:
            if copy is not None:
                (exact if copy[0] == "exact" else near)[f"b_copies.jsonl@{at}"] = (
                    f"a_orig.jsonl@{offsets[copy[1]]}"
                )
            at += f.write(json.dumps({"text": text}) + "\n")
    return exact, near


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict[str, str]]:
    d = tmp_path_factory.mktemp("planted")
    return (d, *_planted(d))


def _listed(ds: Path) -> list[dict]:
    return [json.loads(line) for line in (ds / tasks.DEDUP_REMOVED).read_text().splitlines()]


@pytest.mark.parametrize("over", [{}, {"tasks": 2, "executor": "local"}], ids=["one_host", "two_tasks"])
def test_dedup_removed_names_each_planted_copy_with_its_kept_original(planted, tmp_path, over):
    corpus, exact, near = planted
    ds = prepare(_cfg(corpus, tmp_path / "ds", **over))
    listed = _listed(ds)
    got = {(e["kind"], e["document"]): e for e in listed}
    assert len(listed) == len(exact) + len(near)
    for kind, copies in (("exact", exact), ("near", near)):
        for copy, original in copies.items():
            e = got[(kind, copy)]
            assert (e["source"], e["offset"]) == ("b_copies.jsonl", int(copy.split("@")[1]))
            assert e["kept"] == {
                "document": original,
                "source": "a_orig.jsonl",
                "offset": int(original.split("@")[1]),
            }
            # exact: 1.0; near: the share of equal MinHash values (one word of 200 changed: J ≈ 0.95)
            assert (e["similarity"] == 1.0) if kind == "exact" else (0.8 < e["similarity"] < 1.0)
    report = load_manifest(ds)["report"]
    assert report["dedup_removed"] == {"path": tasks.DEDUP_REMOVED, "written": 7, "total": 7}
    first_exact = min(exact, key=lambda c: int(c.split("@")[1]))
    assert report["examples"]["exact_duplicate"] == f"{first_exact} removed, a copy of {exact[first_exact]}"
    assert report["examples"]["near_duplicate"].startswith(
        f"{min(near, key=lambda c: int(c.split('@')[1]))} removed, near a_orig.jsonl@"
    )
    text = format_report(report)
    assert f"e.g. exact_duplicate: {first_exact} removed, a copy of" in text
    assert "dedup: dedup_removed.jsonl names all 7 removed duplicates" in text
    assert (
        "near dedup: 9 bands x 13 rows: a pair at Jaccard 0.80 is missed with probability 0.60, at 0.90 0.07"
        in text
    )


def test_dedup_removed_is_cut_at_its_bound_and_the_report_says_so(planted, tmp_path, monkeypatch):
    corpus, exact, near = planted
    monkeypatch.setattr(tasks, "DEDUP_LISTED", 3)
    ds = prepare(_cfg(corpus, tmp_path / "ds"))
    listed = _listed(ds)
    copies = sorted({**exact, **near}, key=lambda c: int(c.split("@")[1]))
    assert [e["document"] for e in listed] == copies[:3]  # the first, in corpus order
    report = load_manifest(ds)["report"]
    assert report["dedup_removed"] == {"path": tasks.DEDUP_REMOVED, "written": 3, "total": 7}
    assert "dedup: dedup_removed.jsonl names the first 3 of 7 removed duplicates" in format_report(report)


def test_lsh_miss_probability_is_one_minus_s_to_the_r_to_the_b():
    got = lsh_misses(9, 13, 0.8)
    assert (got["bands"], got["rows"]) == (9, 13)
    assert got["missed"]["0.80"] == pytest.approx((1 - 0.8**13) ** 9, abs=1e-4)
    assert got["missed"]["0.90"] == pytest.approx((1 - 0.9**13) ** 9, abs=1e-4)
    assert round(got["missed"]["0.80"], 2) == 0.60 and round(got["missed"]["0.90"], 2) == 0.07
    assert lsh_misses(16, 8, 0.5)["missed"] == {
        "0.50": round((1 - 0.5**8) ** 16, 4),
        "0.75": round((1 - 0.75**8) ** 16, 4),
    }
