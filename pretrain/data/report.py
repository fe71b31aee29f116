"""What a prepare tells: its progress as it reads, and the manifest's report of what it wrote.

`Progress` shows input bytes read (a tqdm bar on a terminal, else a line now and then);
`manifest_report` is what cleaning and dedup did and what was written (`lsh_misses`: how often
near dedup misses a pair), `format_report` its few lines for a terminal, and `split_warnings` a warning where val's share of the tokens is far from
data.val_fraction.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from pretrain.config.tree import CleanConfig, DataConfig
from pretrain.data.clean import CleanStats
from pretrain.data.dataset import SPLITS
from pretrain.data.shards import ShardInfo
from pretrain.errors import DataError
from pretrain.files import format_bytes


class Progress:
    """Input bytes read of the total, with the rate and an ETA: a tqdm bar on a terminal, else a
    line through `log` every `every_s` seconds and one at the end. Nothing without a log."""

    def __init__(
        self,
        what: str,
        total: int | None,
        log: Callable[[str], None] | None,
        *,
        terminal: bool | None = None,
        every_s: float = 10.0,
    ) -> None:
        self.what, self.total, self.log, self.every_s = what, total or None, log, every_s
        self.done, self.kept = 0, 0
        self.t0 = self.last = time.perf_counter()
        self.bar: Any = None
        if log is not None and (sys.stderr.isatty() if terminal is None else terminal):
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                desc=what,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    def update(self, n_bytes: int, kept: int | None = None) -> None:
        self.done += n_bytes
        if kept is not None:
            self.kept = kept
        if self.bar is not None:
            self.bar.update(n_bytes)
            if kept is not None:
                self.bar.set_postfix(docs=f"{kept:,}", refresh=False)
        elif self.log is not None and time.perf_counter() - self.last >= self.every_s:
            self.last = time.perf_counter()
            self.log(self.line())

    def line(self) -> str:
        """'prepare: 45% (68.0 of 150.0 MB), 12.3 MB/s, ETA 7s, 12,345 documents kept'."""
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        rate = self.done / seconds
        parts = [f"{self.what}: "]
        if self.total:
            parts.append(f"{min(100.0, 100 * self.done / self.total):.0f}% ")
            parts.append(f"({self.done / 1e6:,.1f} of {self.total / 1e6:,.1f} MB), ")
        else:
            parts.append(f"{self.done / 1e6:,.1f} MB, ")
        parts.append(f"{rate / 1e6:,.1f} MB/s")
        if self.total:
            left = max(self.total - self.done, 0) / rate if rate > 0 else float("inf")
            parts.append(f", ETA {_eta(left)}")
        if self.kept:
            parts.append(f", {self.kept:,} documents kept")
        return "".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.log is not None:
            self.log(self.line())


def _eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def no_document(corpus: str, total: int | None, why: str) -> DataError:
    """No document to tokenize: the corpus is empty (0 bytes), or cleaning and filtering left none."""
    if total == 0:
        return DataError(f"{corpus}: empty, 0 bytes; point data.corpus at files with text in them")
    return DataError(f"{corpus}: no document left after cleaning and filtering{why}")


def split_warnings(
    cfg: DataConfig, *, tokens: dict[str, int], kept: int, largest: tuple[int, str, str]
) -> list[str]:
    """A warning when val's share of the tokens is far from data.val_fraction: over twice it
    (training data lost), or under a fifth. Documents go to a split whole, so a few large ones
    skew it; a few dozen documents of a few percent each stay within these bounds."""
    total = sum(tokens.values())
    if kept <= 1 or total == 0:
        return []  # one document is cut at val_fraction exactly
    share, vf = tokens["val"] / total, cfg.val_fraction
    if vf / 5 <= share <= 2 * vf:
        return []
    n, name, split = largest
    return [
        f"val holds {share:.1%} of the tokens, but data.val_fraction is {vf:g}: documents go to a split "
        f"whole, by name, and {kept:,} documents are few or uneven (the largest, {name}, has {n:,} tokens, "
        f"{n / total:.0%} of all, in {split}); use more, smaller documents (a large text file is cut at "
        "data.text_split_bytes), or another data.seed"
    ]


def manifest_report(
    stats: CleanStats,
    clean: CleanConfig,
    *,
    kept: int,
    bytes_out: int,
    notes: list[str],
    shards: dict[str, list[ShardInfo]],
    seconds: float,
) -> dict[str, Any]:
    """The manifest's report: what cleaning and dedup did, and what was written."""
    return {
        "documents_in": stats.documents_in,
        "documents_out": kept,
        "bytes_in": stats.bytes_in,
        "bytes_out": bytes_out,
        "removed": {k: {"documents": d, "bytes": b} for k, (d, b) in sorted(stats.removed.items())},
        "changed": {k: {"documents": d, "characters": c} for k, (d, c) in sorted(stats.changed.items())},
        "undecodable": {
            "bytes": stats.undecodable_bytes,
            "documents": stats.undecodable_documents,
            "action": clean.on_decode_error,
        },
        "examples": dict(sorted(stats.first_problem.items())),
        "notes": notes,
        "tokens": {s: sum(x.n_tokens for x in shards[s]) for s in SPLITS},
        "seconds": round(seconds, 3),
    }


def lsh_misses(bands: int, rows: int, threshold: float) -> dict[str, Any]:
    """How often MinHash LSH misses a near pair: with b bands of r rows, a pair of Jaccard s shares
    no band with probability (1 - s^r)^b; at the threshold and halfway from it to 1."""
    at = (threshold, (1 + threshold) / 2)
    return {
        "bands": bands,
        "rows": rows,
        "missed": {f"{s:.2f}": round((1 - s**rows) ** bands, 4) for s in at},
    }


def stats_line(stats: CleanStats) -> str:
    removed = ", ".join(f"{k}: {d:,}" for k, (d, _) in sorted(stats.removed.items()))
    return f"{stats.documents_in:,} documents read" + (f"; removed {removed}" if removed else "")


def format_report(report: dict[str, Any]) -> str:
    """The cleaning summary, a few lines for a terminal."""
    lines = [
        f"documents: {report['documents_in']:,} in, {report['documents_out']:,} out; "
        f"{format_bytes(report['bytes_in'])} in, {format_bytes(report['bytes_out'])} out "
        + (
            f"({report['seconds']:.1f} s, {report['workers']} workers)"
            if "seconds" in report
            else f"({report['tasks']} tasks)"
        )
    ]
    for kind, show in (
        ("removed", lambda v: format_bytes(v["bytes"])),
        ("changed", lambda v: f"{v['characters']:,} chars"),
    ):
        if report[kind]:
            each = (f"{k} {v['documents']:,} docs ({show(v)})" for k, v in report[kind].items())
            lines.append(f"{kind}:  " + "; ".join(each))
    u = report["undecodable"]
    if u["bytes"]:
        lines.append(f"undecodable bytes: {u['bytes']:,} in {u['documents']:,} documents ({u['action']})")
    lines += [f"e.g. {k}: {v}" for k, v in report["examples"].items()]
    if "dedup_removed" in report:
        d = report["dedup_removed"]
        some = (
            f"the first {d['written']:,} of {d['total']:,}"
            if d["written"] < d["total"]
            else f"all {d['total']:,}"
        )
        lines.append(f"dedup: {d['path']} names {some} removed duplicates, each with the kept one it matched")
    if "near_dedup_lsh" in report:
        n = report["near_dedup_lsh"]
        (s0, p0), *rest = n["missed"].items()
        more = "".join(f", at {s} {p:.2f}" for s, p in rest)
        lines.append(
            f"near dedup: {n['bands']} bands x {n['rows']} rows: a pair at Jaccard {s0} is missed "
            f"with probability {p0:.2f}{more}"
        )
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)
