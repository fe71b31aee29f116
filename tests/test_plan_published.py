"""docs/plan.md's table of published runs is what `pretrain plan` prints for them, within 25% of what
each run published, and the efficiency table is the mean of what its runs imply."""

from __future__ import annotations

import contextlib
import io
import json
import re
import statistics
from pathlib import Path

import pytest

from pretrain.cli import main
from pretrain.config.tree import analytic_num_params
from pretrain.plan.evidence import FWD_BWD_EFFICIENCY, PUBLISHED, gpu_class, layout_kind, size_class
from pretrain.plan.published import implied_efficiency, plan_of

DOC = Path(__file__).resolve().parents[1] / "docs" / "plan.md"
RUNS = {r.name: r for r in PUBLISHED}


def doc_rows() -> dict[str, list[str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in RUNS:
            rows[cells[0]] = cells
    return rows


def number(cell: str) -> float:
    return float(re.sub(r"[,\s]", "", cell.split("(")[0]))


def plan_json(args: tuple[str, ...]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *args, "--json"]) == 0
    return json.loads(out.getvalue())


def test_the_doc_lists_every_published_run_and_at_least_five():
    assert set(doc_rows()) == set(RUNS) and len(RUNS) >= 5
    assert sum(not r.fit for r in PUBLISHED) >= 4  # held out: not used for the efficiency table


@pytest.mark.parametrize("name", list(RUNS))
def test_the_docs_figures_are_what_plan_prints_and_within_25_percent(name):
    run, cells = RUNS[name], doc_rows()[name]
    plan = plan_json(run.args)
    stage = next(int(a.split("=")[1]) for a in run.args if a.startswith("zero.stage="))
    row = next(t for t in plan["step_times"] if (t["stage"], t["offload"]) == (stage, "none"))
    mine = row["tokens_per_s"] / plan["world_size"]
    published, planned_cell, ratio = number(cells[1]), number(cells[2]), number(cells[3])
    assert published == round(run.tokens_per_s_per_gpu)
    assert planned_cell == round(mine)  # the doc's figure is what `plan` prints
    assert ratio == round(mine / run.tokens_per_s_per_gpu, 2)
    assert 0.75 <= mine / run.tokens_per_s_per_gpu <= 1.25, (name, mine, run.tokens_per_s_per_gpu)
    assert number(cells[4]) == plan["rates"]["mfu"]
    assert cells[5] == ("fit" if run.fit else "held out")
    memory = next(s for s in plan["stages"] if (s["stage"], s["offload"]) == (stage, "none"))
    assert number(cells[6]) == round(memory["device_total_gb"], 1)


def test_each_efficiency_is_the_mean_its_runs_imply_and_every_fitted_run_is_used_once():
    used = [name for e in FWD_BWD_EFFICIENCY for name in e.runs]
    assert sorted(used) == sorted(r.name for r in PUBLISHED if r.fit)
    for e in FWD_BWD_EFFICIENCY:
        implied = [implied_efficiency(RUNS[name]) for name in e.runs]
        assert None not in implied, e  # a run no efficiency reproduces says nothing of the efficiency
        assert e.value == pytest.approx(statistics.fmean(v for v in implied if v is not None), abs=0.005), e
    for name in used:  # each run sits in the GPU class, the layout kind and the size class it is used for
        run = RUNS[name]
        device = run.args[run.args.index("--gpu") + 1]
        entry = next(e for e in FWD_BWD_EFFICIENCY if name in e.runs)
        cfg, _, _ = plan_of(run)
        assert (gpu_class(device), layout_kind(cfg.parallel.tensor, cfg.parallel.pipeline)) == (
            entry.gpu,
            entry.layout,
        )
        params = analytic_num_params(cfg.model)
        lower = max(
            [
                0.0,
                *(
                    f.max_params
                    for f in FWD_BWD_EFFICIENCY
                    if (f.gpu, f.layout) == (entry.gpu, entry.layout) and f.max_params < entry.max_params
                ),
            ]
        )
        assert lower < params <= entry.max_params, (name, params, size_class(entry))


def test_a_plan_names_the_runs_its_efficiency_comes_from(capsys):
    assert main(["plan", "llama-7b", "--world-size", "16", "--gpu", "A100-80GB"]) == 0
    text = capsys.readouterr().out
    assert (
        "MFU of forward+backward 0.64 (A100, data parallel, over 3B parameters: from MPT 7B, 8 x A100" in text
    )
    assert "see docs/plan.md" in text
    assert main(["plan", "llama-13b", "--world-size", "16", "--gpu", "A100-80GB"]) == 0  # TP2: Megatron-LM's
    text = capsys.readouterr().out
    assert "0.60 (A100, tensor or pipeline parallel, up to 30B parameters: from Megatron-LM GPT 18.4B" in text
