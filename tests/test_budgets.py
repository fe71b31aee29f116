"""Training budgets (schedule.max_tokens, schedule.max_hours) and a global batch from which the
accumulation is derived: the config's rules, and real runs on 1, 2 and 4 CPU ranks with the real
DeepSpeed engine (one torchrun job per world size, several runs in each)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from pretrain.config.presets import build
from pretrain.config.tree import to_yaml, validate
from pretrain.errors import ConfigError
from pretrain.plan.report import render_budget
from pretrain.plan.stages import plan_budget
from pretrain.training.checkpoint import store as checkpoint
from pretrain.training.schedule import lr_at
from tests.ckpt_worker import BASE
from tests.conftest import ckpt, torchrun

# ---------------------------------------------------------------------------------------------
# The config


def problems(overrides: list[str], world: int | None = 2, preset: str = "tiny") -> list[str]:
    with pytest.raises(ConfigError) as e:
        build(preset, overrides=overrides, world_size=world)
    return e.value.problems


def test_a_global_batch_derives_the_accumulation_for_the_world_size():
    for world, acc in ((1, 8), (2, 4), (4, 2), (8, 1)):
        b = build(
            "tiny",
            overrides=["batch.global_batch_sequences=64", "batch.micro_batch_size=8"],
            world_size=world,
        ).batch
        assert (b.gradient_accumulation_steps, b.data_parallel_size, b.train_batch_size) == (acc, world, 64)
    # in tokens: 16 sequences of model.block_size 256; the accumulation a preset gives is replaced
    cfg = build("gpt2-124m", overrides=["batch.global_batch_tokens=491520"], world_size=8)
    assert cfg.batch.gradient_accumulation_steps == 5 and cfg.tokens_per_step == 491520
    # the rendered DeepSpeed JSON carries the derived values
    from pretrain.config.ds_render import render_deepspeed

    ds = render_deepspeed(cfg)
    assert (
        ds["train_batch_size"],
        ds["train_micro_batch_size_per_gpu"],
        ds["gradient_accumulation_steps"],
    ) == (
        480,
        12,
        5,
    )


def test_a_global_batch_that_does_not_divide_names_the_nearest_that_do():
    (p,) = problems(["batch.global_batch_sequences=100", "batch.micro_batch_size=8"], world=2)
    assert (
        "global_batch_sequences (100) is not a multiple of micro_batch_size (8) x data_parallel_size (2) = 16"
        in p
    )
    assert "96 and 112 (accumulation 6 and 7)" in p and "keep 100 with micro_batch_size 5 or 10" in p
    (p,) = problems(["batch.global_batch_sequences=100", "batch.micro_batch_size=8"], world=3)
    assert (
        "96 and 120" in p
        and "no micro batch size keeps 100: it is not a multiple of data_parallel_size (3)" in p
    )
    (p,) = problems(["batch.global_batch_tokens=16000", "batch.micro_batch_size=8"], world=2)
    assert "x model.block_size (256) = 4096" in p and "12288 and 16384 (accumulation 3 and 4)" in p
    (p,) = problems(["batch.global_batch_sequences=4", "batch.micro_batch_size=8"], world=2)
    assert "16 (accumulation 1)" in p and "micro_batch_size 2" in p


def test_a_world_mismatch_with_a_global_batch_does_not_advise_an_accumulation():
    """The global batch derives the accumulation: the fix names the data parallel size alone."""
    (p,) = problems(
        ["batch.global_batch_sequences=64", "batch.micro_batch_size=8", "batch.data_parallel_size=2"], 4
    )
    assert (
        "data_parallel_size (2) does not match the world size (4): pass --set batch.data_parallel_size=4" in p
    )
    assert "gradient_accumulation_steps" not in p and "the global batch derives the accumulation" in p
    (p,) = problems(
        ["batch.micro_batch_size=8", "batch.gradient_accumulation_steps=4", "batch.data_parallel_size=2"], 4
    )
    assert "with --set batch.gradient_accumulation_steps=2 to keep 64 sequences per step" in p


def test_conflicting_batch_settings_are_errors_naming_both():
    (p,) = problems(
        ["batch.global_batch_sequences=64", "batch.micro_batch_size=8", "batch.gradient_accumulation_steps=2"]
    )
    assert "global_batch_sequences (64) and gradient_accumulation_steps (2) disagree" in p
    assert "is accumulation 4" in p
    (p,) = problems(["batch.global_batch_sequences=64", "batch.global_batch_tokens=16384"])
    assert "global_batch_sequences (64) and global_batch_tokens (16384) both given: give one" in p
    # agreeing values are fine
    cfg = build(
        "tiny",
        overrides=[
            "batch.global_batch_sequences=64",
            "batch.micro_batch_size=8",
            "batch.gradient_accumulation_steps=4",
        ],
        world_size=2,
    )
    assert cfg.batch.sequences == 64
    # every problem at once, the batch's and the schedule's
    found = problems(
        ["batch.global_batch_sequences=100", "batch.micro_batch_size=8", "schedule.warmup_steps=5000"]
    )
    assert len(found) == 2 and any("warmup_steps (5000)" in p for p in found)


def test_without_a_world_size_a_global_batch_no_world_gives_is_refused():
    """`pretrain config` has no world size, and accepted what `render` and `train` then refused."""
    (p,) = problems(["batch.global_batch_tokens=1000"], None)
    assert "global_batch_tokens (1000) is not a whole number of sequences of model.block_size (256)" in p
    assert "the nearest that are, 768 or 1024" in p
    (p,) = problems(
        [
            "batch.global_batch_sequences=64",
            "batch.micro_batch_size=16",
            "batch.gradient_accumulation_steps=3",
        ],
        None,
    )
    assert (
        "global_batch_sequences (64) and gradient_accumulation_steps (3) disagree whatever the world size"
        in p
    )
    (p,) = problems(["batch.global_batch_sequences=50", "batch.micro_batch_size=16"], None)
    assert "not a multiple of micro_batch_size (16): no world size gives it" in p
    # what some world size gives stays unresolved until there is one
    for ok in (
        ["batch.global_batch_sequences=64", "batch.micro_batch_size=16"],
        ["batch.global_batch_tokens=16384"],
    ):
        assert build("tiny", overrides=ok).batch.train_batch_size is None


def test_a_presets_warmup_is_fitted_to_a_short_run_and_a_given_one_is_not(tmp_path: Path, capsys):
    """`--set schedule.max_steps=3` alone was refused on the preset's 100 warmup steps."""
    from pretrain.config import presets

    presets._NOTED.clear()
    for _ in range(2):  # a command that builds its config twice says it once
        assert build("tiny", overrides=["schedule.max_steps=3"]).schedule.warmup_steps == 0
    err = capsys.readouterr().err
    assert err.count("note: schedule.warmup_steps: the preset's 100 do not fit schedule.max_steps 3: 0") == 1
    assert build("tiny", overrides=["schedule.max_steps=60"]).schedule.warmup_steps == 4  # 100 of 1500
    assert build("tiny", overrides=["schedule.max_steps=200"]).schedule.warmup_steps == 100  # it fits
    (p,) = problems(["schedule.max_steps=3", "schedule.warmup_steps=100"], None)
    assert "warmup_steps (100) must be below max_steps (3)" in p
    run = tmp_path / "run.yaml"
    run.write_text("schedule:\n  warmup_steps: 50\n  max_steps: 10\n")
    with pytest.raises(ConfigError, match="warmup_steps \\(50\\) must be below max_steps \\(10\\)"):
        build("tiny", config_file=run)


def test_a_higher_layer_states_the_batch_one_way(tmp_path: Path):
    """A config file's global batch replaces the preset's accumulation; an override's accumulation
    replaces the file's global batch."""
    run = tmp_path / "run.yaml"
    run.write_text("batch:\n  global_batch_sequences: 64\n  micro_batch_size: 4\n")
    cfg = build("gpt2-124m", config_file=run, world_size=2)  # the preset's accumulation (4) dropped
    assert cfg.batch.gradient_accumulation_steps == 8
    cfg = build("gpt2-124m", config_file=run, overrides=["batch.gradient_accumulation_steps=3"], world_size=2)
    assert cfg.batch.global_batch_sequences is None and cfg.batch.sequences == 24


def test_a_config_printed_without_a_world_size_derives_again_with_one():
    text = to_yaml(build("tiny", overrides=["batch.global_batch_sequences=64", "batch.micro_batch_size=8"]))
    import yaml

    data = yaml.safe_load(text)
    assert "gradient_accumulation_steps" not in data["batch"]
    assert validate(data, world_size=4).batch.gradient_accumulation_steps == 2


def test_max_tokens_sets_the_steps_and_the_schedule_spans_them():
    cfg = build("tiny", overrides=["batch.micro_batch_size=8", "schedule.max_tokens=1000000"], world_size=2)
    assert (
        cfg.tokens_per_step == 4096 and cfg.total_steps == 245
    )  # ceil(1e6 / 4096): the step that reaches it
    assert cfg.schedule.binding(cfg.tokens_per_step) == "max_tokens"
    floor = cfg.schedule.min_lr_ratio * cfg.optimizer.lr
    assert lr_at(245, cfg.optimizer.lr, cfg.schedule, cfg.total_steps) == pytest.approx(floor)
    assert lr_at(245, cfg.optimizer.lr, cfg.schedule) > 2 * floor  # over max_steps it is far from its end
    # max_steps still binds when it comes first
    cfg = build("tiny", overrides=[f"schedule.max_tokens={10**12}"], world_size=1)
    assert (
        cfg.total_steps == cfg.schedule.max_steps and cfg.schedule.binding(cfg.tokens_per_step) == "max_steps"
    )
    (p,) = problems(["batch.micro_batch_size=8", "schedule.max_tokens=100000"])
    assert (
        p
        == "schedule.warmup_steps (100) must be below the 25 steps that schedule.max_tokens (100,000) makes at 4,096 tokens a step"
    )
    assert any("max_hours" in p for p in problems(["schedule.max_hours=0"]))


def test_plan_says_which_budget_binds():
    cfg = build("tiny", overrides=["batch.micro_batch_size=8", "schedule.max_tokens=1000000"], world_size=2)
    b = plan_budget(cfg, step_s=0.5)
    assert (b.binds, b.steps, b.tokens, b.hours) == (
        "max_tokens",
        245,
        245 * 4096,
        pytest.approx(245 * 0.5 / 3600),
    )
    hours = build("tiny", overrides=["schedule.max_hours=0.1"], world_size=2)
    b = plan_budget(hours, step_s=0.5)
    assert (b.binds, b.steps, b.schedule_steps) == ("max_hours", 720, 1500)  # 360 s / 0.5 s a step
    assert "schedule.max_hours binds at the 0.5 s a step estimated below" in render_budget(b)
    b = plan_budget(hours, step_s=None)  # no estimate: max_hours cannot be compared
    assert b.binds == "max_steps" and "max_hours not compared" in render_budget(b)


# ---------------------------------------------------------------------------------------------
# Real runs: 8 steps of a small GPT (tests/ckpt_worker.py's BASE) at a global batch of 8 sequences


GLOBAL = ["batch.global_batch_sequences=8"]  # micro batch 2: accumulation 4, 2 and 1 on 1, 2 and 4 ranks
HOURS = [*GLOBAL, "schedule.max_hours=1e-9"]  # spent as soon as the first step starts
TOKENS = [*GLOBAL, "schedule.max_tokens=1000"]


@pytest.fixture(scope="module")
def budget_runs(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("budgets")
    one = torchrun(
        1,
        0,
        char_dataset,
        out,
        [
            {"name": "w1", "run": "w1", "overrides": GLOBAL},
            # 1000 tokens at 8 x 32 = 256 a step: the 4th step reaches them
            {"name": "tokens", "run": "tokens", "overrides": TOKENS},
            # the same, stopped by SIGTERM after step 2 (it saves after step 3), then resumed
            {
                "name": "tokens_stop",
                "run": "tokens_res",
                "overrides": TOKENS,
                "env": {"PRETRAIN_FAULT_SIGTERM": "0:2"},
            },
            {"name": "tokens_resume", "run": "tokens_res", "overrides": TOKENS, "resume": "auto"},
            # resumed again with both budgets spent: nothing to train, said so
            {"name": "tokens_spent", "run": "tokens_res", "overrides": TOKENS, "resume": "auto"},
            {
                "name": "steps_spent",
                "run": "tokens_res",
                "overrides": [*TOKENS, "schedule.max_tokens=null", "schedule.max_steps=3"],
                "resume": "auto",
            },
        ],
    )
    two = torchrun(
        2,
        29592,
        char_dataset,
        out,
        [
            {"name": "w2", "run": "w2", "overrides": GLOBAL},
            {"name": "hours_stop", "run": "hours", "overrides": HOURS},
            {"name": "hours_spent", "run": "hours", "overrides": HOURS, "resume": "auto"},
            {
                "name": "hours_resume",
                "run": "hours",
                "overrides": [*GLOBAL, "schedule.max_hours=1"],
                "resume": "auto",
            },
        ],
    )
    four = torchrun(4, 29593, char_dataset, out, [{"name": "w4", "run": "w4", "overrides": GLOBAL}])
    return {**one, **two, **four, "_stdout": one["_stdout"]}, out


@pytest.mark.distributed
def test_derived_accumulation_gives_the_same_run_on_1_2_and_4_ranks(budget_runs):
    res, out = budget_runs
    w1 = res["w1"]["losses"]
    assert sorted(w1, key=int) == [str(s) for s in range(1, 9)]
    for name, acc in (("w2", 2), ("w4", 1)):
        # the same samples in every step (the loader's order is a function of the samples consumed),
        # summed in another order: equal to float rounding
        assert res[name]["losses"] == pytest.approx(w1, abs=2e-6, rel=0), name
        saved = json.loads((out / name / "ds_config.json").read_text())
        assert (saved["train_batch_size"], saved["gradient_accumulation_steps"]) == (8, acc)
    assert json.loads((out / "w1" / "ds_config.json").read_text())["gradient_accumulation_steps"] == 4


@pytest.mark.distributed
def test_max_tokens_ends_the_run_at_the_step_that_reaches_it_resumed_or_not(budget_runs):
    res, out = budget_runs
    r = res["tokens"]
    assert r["final_step"] == 4 and r["ended_by"] == "max_tokens" and r["stopped_by"] is None
    meta = checkpoint.read_meta(ckpt(out, "tokens", 4))  # the end's checkpoint
    assert meta["tokens_seen"] == 4 * 256
    # the LR schedule is laid out over those 4 steps: the cosine reaches its floor at the end
    rows = list(csv.DictReader((out / "tokens" / "metrics.csv").open()))
    lrs = {int(row["step"]): float(row["lr"]) for row in rows if row.get("lr")}
    cfg = build("tiny", overrides=[*BASE, *GLOBAL, "schedule.max_tokens=1000"], world_size=1)
    assert lrs == pytest.approx({s: lr_at(s - 1, 3e-3, cfg.schedule, 4) for s in range(1, 5)})
    assert r["losses"]["1"] == res["w1"]["losses"]["1"]  # the same first step as the 8-step run
    # stopped by a signal and resumed: the resume ends at the same step, on the same losses
    stop, resume = res["tokens_stop"], res["tokens_resume"]
    assert stop["stopped_by"] == "SIGTERM" and stop["final_step"] == 3
    assert resume["start_step"] == 3 and resume["final_step"] == 4 and resume["ended_by"] == "max_tokens"
    assert {**stop["losses"], **resume["losses"]} == r["losses"]


@pytest.mark.distributed
def test_a_resume_with_its_budget_spent_says_there_is_nothing_to_train(budget_runs):
    """It printed "resumed ... at step N" and exited 0, with no word that nothing was trained."""
    res, _ = budget_runs
    for name in ("tokens_spent", "steps_spent"):
        assert res[name]["start_step"] == res[name]["final_step"] == 4 and res[name]["losses"] == {}
    out = res["_stdout"]
    assert (
        "nothing to train: the run resumed at step 4, which reaches schedule.max_tokens (1,000): 1,024 tokens "
        "seen; raise schedule.max_tokens to train on"
    ) in out
    assert (
        "nothing to train: the run resumed at step 4, which reaches schedule.max_steps (3); raise "
        "schedule.max_steps to train on"
    ) in out


@pytest.mark.distributed
def test_max_hours_stops_with_a_checkpoint_and_a_resume_ends_as_the_uninterrupted_run(budget_runs):
    res, out = budget_runs
    stop, spent, resume = res["hours_stop"], res["hours_spent"], res["hours_resume"]
    k = stop["final_step"]
    assert stop["ended_by"] == "max_hours" and stop["stopped_by"] is None and 1 <= k < 8
    meta = checkpoint.read_meta(ckpt(out, "hours", k))
    assert meta["elapsed_hours"] >= 1e-9  # what the next start counts from
    # resumed with the same budget: it is spent, so no step is trained (no fresh budget)
    assert spent["start_step"] == spent["final_step"] == k and spent["ended_by"] == "max_hours"
    assert spent["losses"] == {}
    # with a larger one: on to the end, bit for bit the uninterrupted run
    assert resume["start_step"] == k and resume["final_step"] == 8 and resume["ended_by"] == "max_steps"
    joined = {**stop["losses"], **resume["losses"]}
    assert joined == res["w2"]["losses"]
    end = checkpoint.read_meta(ckpt(out, "hours", 8))
    assert end["elapsed_hours"] > meta["elapsed_hours"]  # accounted across the resume
