"""The loss-spike rule (stability.spike_factor): a spike's update is skipped as a NaN step's is,
M spikes in a row roll back, the rule's window survives a resume bit for bit, the rule off changes
nothing, and on it adds no host read to a step.

The runs are the real loop and the real DeepSpeed engine (ZeRO-2, fp32) on one rank in this
process, in a gloo group of one (about 0.2 s a run after the first), each against the same run with
NaN steps where it has spikes; one scenario of the shared 2-rank job (tests/conftest.py
`two_ranks`) shows a spike on one rank skipping both ranks' update.
"""

from __future__ import annotations

import collections
import contextlib
import io
import os
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from pretrain.config.presets import build
from pretrain.config.tree import RunConfig
from pretrain.errors import ConfigError
from pretrain.training.checkpoint import store as checkpoint
from pretrain.training.distributed import ranks
from pretrain.training.faults import Faults
from pretrain.training.guards import SpikeRule, mean_loss, start_agreement
from pretrain.training.loop import TrainResult, train
from tests.conftest import ckpt

READ_COUNTS: dict[str, collections.Counter[tuple[str, str]]] = {}

# tests/ckpt_worker.py's small GPT, 10 steps of 2 micro-batches (the spike is judged after the last
# forward), a checkpoint every 3 steps; no watchdog, so that faulthandler in this process stays
# pytest's.
BASE = [
    "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
    "batch.micro_batch_size=2", "batch.gradient_accumulation_steps=2", "optimizer.lr=3e-3",
    "schedule.max_steps=10", "schedule.warmup_steps=2", "zero.stage=2",
    "logging.log_interval=1", "logging.eval_interval=10", "logging.eval_batches=1",
    "logging.sample_tokens=0", "logging.tensorboard=false", "logging.progress_bar=false",
    "checkpoint.interval=3", "checkpoint.keep_last=5", "watchdog.timeout_s=0",
]  # fmt: skip
RULE = ["stability.spike_factor=3", "stability.spike_window=3"]  # applies from step 4
ROLL = ["stability.max_bad_steps=2"]
# name: (overrides, fault environment, resume). The hooks name the batches of an uninterrupted run's
# steps: after step 5 is skipped, step 8's batch is trained on at step 7.
JOBS: dict[str, tuple[list[str], dict[str, str], str | None]] = {
    "nan": ([], {"PRETRAIN_FAULT_NAN_STEPS": "5,8"}, None),
    "spike": (RULE, {"PRETRAIN_FAULT_SPIKE_STEPS": "5,8"}, None),
    # from the spike run's checkpoint of step 6, between its two spikes, in a run dir of its own
    "resumed": (RULE, {"PRETRAIN_FAULT_SPIKE_STEPS": "5,8"}, "spike/checkpoints/step_00000006"),
    "off": ([], {"PRETRAIN_FAULT_SPIKE_STEPS": "5"}, None),
    "nan_roll": (ROLL, {"PRETRAIN_FAULT_NAN_STEPS": "5,6"}, None),
    "spike_roll": ([*RULE, *ROLL], {"PRETRAIN_FAULT_SPIKE_STEPS": "5,6"}, None),
    # stage 0 in fp32, where DeepSpeed applies even a NaN update: the spike is skipped all the same
    "spike_z0": ([*RULE, "zero.stage=0"], {"PRETRAIN_FAULT_SPIKE_STEPS": "5,8"}, None),
}
# The host reads of runs that log, evaluate and save only at their end, with the rule judging from
# step 3 and without: the reads of 3 more steps, from 5 to 8, are those of 3 unlogged steps.
QUIET = ["logging.log_interval=100", "logging.eval_interval=100", "checkpoint.interval=100"]
COUNTED = {
    f"count_{rule}_{steps}": [*QUIET, f"schedule.max_steps={steps}", *(RULE_2 if rule == "on" else [])]
    for rule in ("on", "off")
    for steps in (5, 8)
    for RULE_2 in [["stability.spike_factor=3", "stability.spike_window=2"]]
}
READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy"}


class HostReads(TorchFunctionMode):
    """Every call that reads a tensor's value to the host (the syncs of a GPU), counted by the
    function outside torch that made it: (file name, function name)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS:
            frame = sys._getframe(1)
            while frame.f_back is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            self.calls[(Path(frame.f_code.co_filename).name, frame.f_code.co_name)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def one_rank() -> Iterator[ranks.Dist]:
    """This process as rank 0 of 1 in a gloo group; on the way out the group, the launcher's
    variables (and any DeepSpeed sets), the thread count and the generators are as they were, for the
    tests after these."""
    launcher = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    launcher |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ranks.free_port()), "OMP_NUM_THREADS": "1"}
    saved_env = dict(os.environ)
    threads = torch.get_num_threads()
    generators = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    os.environ.update(launcher)
    torch.set_num_threads(1)
    try:
        dist = ranks.launch_env()
        ranks.init_distributed(dist)
        yield dist
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for k in set(os.environ) - set(saved_env):
            del os.environ[k]
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        random.setstate(generators[0])
        np.random.set_state(generators[1])
        torch.random.set_rng_state(generators[2])


@pytest.fixture(scope="module")
def runs(
    char_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, TrainResult], str, Path]:
    """Every job's result, what rank 0 logged, and where the run dirs are; the host reads of the
    counted runs, in `READ_COUNTS`."""
    out = tmp_path_factory.mktemp("spikes")
    results: dict[str, TrainResult] = {}
    log = io.StringIO()
    jobs = {**JOBS, **{name: (sets, {}, None) for name, sets in COUNTED.items()}}
    with one_rank() as dist, contextlib.redirect_stdout(log):
        for name, (overrides, env, resume) in jobs.items():
            sets = [*BASE, *overrides, f"data.dataset_dir={char_dataset}", f"logging.run_dir={out / name}"]
            os.environ.update(env)
            try:
                cfg = build("tiny", overrides=sets, world_size=1)
                with HostReads() if name in COUNTED else contextlib.nullcontext() as reads:
                    results[name] = train(cfg, dist, resume=resume and str(out / resume))
                if reads is not None:
                    READ_COUNTS[name] = reads.calls
            finally:
                for k in env:
                    os.environ.pop(k, None)
    return results, log.getvalue(), out


def test_a_spike_is_skipped_as_a_nan_step_is(runs):
    """The update is not applied: the run goes on with the losses of the run whose NaN steps DeepSpeed
    skipped, to the last bit, and the log says why in one line."""
    res, log, out = runs
    nan, spike = res["nan"], res["spike"]
    assert spike.skipped_steps == nan.skipped_steps == [5, 7] and spike.rollbacks == []
    assert spike.losses == nan.losses and len(spike.losses) == 10
    line = r"step 5: loss [\d.]+ is a spike \([\d.]+ x the median of the last 3 steps\), update skipped \(1 in a row, rollback at 3\)"
    assert re.search(line, log), log
    # the window a checkpoint keeps: the mean losses of the last 3 accepted steps (8, 9 and 10)
    kept = checkpoint.read_meta(ckpt(out, "spike", 10))["recent_losses"]
    assert kept == pytest.approx([spike.losses[s] for s in (8, 9, 10)], abs=1e-6)


def test_a_spike_is_skipped_at_stage_0_in_fp32_too(runs):
    """Where DeepSpeed applies even a NaN update (the NaN rule rolls back there), the rule's own skip
    leaves the weights and Adam's state as they were: no rollback, and the run of ZeRO-2's spikes,
    step for step."""
    res, _, _ = runs
    z0, z2 = res["spike_z0"], res["spike"]
    assert z0.skipped_steps == [5, 7] and z0.rollbacks == []
    assert z0.losses == pytest.approx(z2.losses, abs=1e-6, rel=0)


@pytest.mark.usefixtures("runs")  # the counted runs are among its jobs
def test_the_rule_adds_no_host_read_to_an_unlogged_step():
    """The reads of the 3 unlogged steps between a run of 5 steps and one of 8: the same with the rule
    on (judging every one of them) as off, the non-finite rule's one read a step, which carries the
    spike verdict; none from the rule's own code (the window, the median, the mean over the ranks)."""
    per_step = {}
    for rule in ("on", "off"):
        more = READ_COUNTS[f"count_{rule}_8"].copy()
        more.subtract(READ_COUNTS[f"count_{rule}_5"])
        per_step[rule] = {k: n for k, n in more.items() if n}
    assert per_step["on"] == per_step["off"], per_step
    assert per_step["on"][("guards.py", "start_agreement")] == 3  # one a step
    rule_code = {"judge", "_median", "mean_loss", "accept", "why", "recent", "_maybe_step"}
    on_total = READ_COUNTS["count_on_8"]
    assert not {k for k in on_total if k[0] == "guards.py" and k[1] in rule_code} - {("guards.py", "recent")}
    assert on_total[("guards.py", "recent")] <= 1  # the window saved with the run's one checkpoint


def test_a_record_of_the_old_keys_reads_as_the_new(runs):
    """A checkpoint saved before the move records checkpoint.spike_factor and the rest: its config
    reads back (as export and the planner read it) with the same stability section."""
    _, _, out = runs
    saved = checkpoint.read_meta(ckpt(out, "spike", 6))["config"]
    old = {k: v for k, v in saved.items() if k != "stability"}
    old["checkpoint"] = {**saved["checkpoint"], **saved["stability"]}
    assert RunConfig.model_validate(old) == RunConfig.model_validate(saved)
    assert RunConfig.model_validate(old).stability.spike_window == 3


def test_spikes_in_a_row_roll_back_as_nan_steps_do(runs):
    res, log, out = runs
    roll, nan_roll = res["spike_roll"], res["nan_roll"]
    assert roll.rollbacks == nan_roll.rollbacks == [3] and roll.skipped_steps == [5]
    assert roll.losses == nan_roll.losses and roll.final_step == 10
    assert checkpoint.read_meta(ckpt(out, "spike_roll", 10))["skip_batches"] == [16, 20]
    assert re.search(
        r"step 5: loss [\d.]+ is a spike \(.*\) \(2 in a row\): rolling back to \S+step_00000003", log
    )


def test_a_resume_across_a_spike_is_bit_exact(runs):
    """Resumed between the two spikes, the run catches the second as the uninterrupted one did: the
    window came with the checkpoint (rebuilt from nothing, it would not be full again until step 9)."""
    res, _, out = runs
    full, resumed = res["spike"], res["resumed"]
    assert resumed.start_step == 6 and resumed.skipped_steps == [7]
    assert resumed.losses == {s: full.losses[s] for s in range(7, 11)}
    assert len(checkpoint.read_meta(ckpt(out, "spike", 6))["recent_losses"]) == 3


def test_the_rule_off_changes_nothing(runs):
    """Off, a spike trains (the hook works, and nothing stops it); on, the steps before any spike have
    the losses of a run without the rule, and the rule keeps no window when off."""
    res, _, out = runs
    off, nan, spike = res["off"], res["nan"], res["spike"]
    assert off.skipped_steps == [] and off.losses[5] > 1000 and off.losses[6] != nan.losses[6]
    assert [off.losses[s] for s in range(1, 5)] == [spike.losses[s] for s in range(1, 5)]
    assert checkpoint.read_meta(ckpt(out, "off", 6))["recent_losses"] == []


@pytest.mark.distributed
def test_a_spike_on_one_rank_skips_every_ranks_update(two_ranks):
    """Rank 0's loss alone spikes; the ranks agree on their mean, both skip the update (two in a row
    roll back), and the run is the one whose rank 0 had NaNs there instead, to the last bit."""
    res, out = two_ranks
    spike, nan = res["spike_z2"], res["nan_z2"]
    assert spike["skipped_steps"] == [3, 5] and spike["rollbacks"] == [4] and spike["losses"] == nan["losses"]
    assert checkpoint.read_meta(ckpt(out, "spike_z2", 8))["skip_batches"] == [20, 24]
    line = r"step 3: loss [\d.]+ is a spike \([\d.]+ x the median of the last 2 steps\), update skipped"
    assert re.search(line, res["_stdout"])


# ---------------------------------------------------------------------------------------------
# The rule, the agreement and the hook as functions


def _loss(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def test_the_rule_judges_against_the_median_of_a_full_window():
    rule = SpikeRule(3.0, 3)
    for loss in (4.0, 4.0):
        rule.accept(_loss(loss))
    assert not rule.judge(_loss(100.0))  # two steps in: the rule does not apply yet
    rule.accept(_loss(11.0))  # a high step, under any factor then: the median ignores it, a mean would not
    assert rule.judge(_loss(12.1)) and not rule.judge(_loss(12.0))
    assert rule.why(_loss(12.1)) == "loss 12.1000 is a spike (3.02 x the median of the last 3 steps)"
    assert not rule.judge(_loss(float("inf")))  # non-finite: the other fault, not a spike
    rule.accept(_loss(5.0))
    assert rule.recent == [4.0, 11.0, 5.0]  # the newest 3, oldest first (the ring has wrapped)
    rule.restore([1.0, 2.0, 3.0, 4.0, 5.0])  # a larger window saved: its newest 3
    assert rule.recent == [3.0, 4.0, 5.0]
    even = SpikeRule(3.0, 2, [2.0, 4.0])  # an even window: the mean of the middle two, 3
    assert even.judge(_loss(9.5)) and not even.judge(_loss(9.0))
    off = SpikeRule(None, 3, [1.0, 2.0, 3.0])
    off.accept(_loss(1.0))
    assert not off.on and off.recent == [] and not off.judge(_loss(1e9))


def test_the_agreed_loss_is_the_mean_per_micro_batch_and_a_nan_is_no_spike():
    rule = SpikeRule(2.0, 1, [1.0])
    agreed = mean_loss(torch.tensor(6.0), 2)
    assert agreed.dtype == torch.float64 and float(agreed) == 3.0
    verdict = start_agreement(torch.tensor(6.0), None, None, loss=agreed, rule=rule)
    assert verdict.spiked and verdict.wait() == (False, 0, False)
    assert verdict.spike == "loss 3.0000 is a spike (3.00 x the median of the last 1 steps)"
    nan = torch.tensor(float("nan"))
    verdict = start_agreement(nan, 15, None, True, loss=mean_loss(nan, 2), rule=rule)
    assert not verdict.spiked and verdict.wait() == (True, 15, True) and verdict.spike is None
    off = start_agreement(torch.tensor(6.0), None, None)  # the rule off: no loss agreed
    assert off.loss is None and not off.spiked


def test_the_spike_hook_multiplies_rank_0s_loss(tmp_path):
    f = Faults(tmp_path, 8, env={"PRETRAIN_FAULT_SPIKE_STEPS": "2", "PRETRAIN_FAULT_NAN_STEPS": "3"})
    assert f.spike(8, 0) and not f.spike(8, 1) and not f.spike(16, 0)
    assert f.loss_factor(8, 0) == Faults.SPIKE and f.loss_factor(8, 1) is None and f.loss_factor(0, 0) is None
    factor = f.loss_factor(16, 0)
    assert factor is not None and factor != factor  # NaN


def test_spike_settings_are_checked_all_at_once():
    with pytest.raises(ConfigError) as info:
        build("tiny", overrides=["stability.spike_factor=1", "stability.spike_window=0"], world_size=1)
    text = str(info.value)
    assert "stability.spike_factor" in text and "stability.spike_window" in text
    for bad in ("inf", "nan", "true", "0.5"):
        with pytest.raises(ConfigError, match="spike_factor"):
            build("tiny", overrides=[f"stability.spike_factor={bad}"], world_size=1)
    cfg = build("tiny", overrides=RULE, world_size=1)
    assert SpikeRule.of(cfg.stability).on and build("tiny", world_size=1).stability.spike_factor is None


def test_the_old_checkpoint_keys_read_as_stability_said_once(capsys):
    """checkpoint.spike_factor and the other three moved to stability: the old place still reads,
    from --set as from a file or a run's recorded config, with one note per key; both places set to
    two values is one error."""
    old = ["checkpoint.spike_factor=2.5", "checkpoint.spike_window=7", "checkpoint.max_bad_steps=4"]
    old.append("checkpoint.max_rollbacks=1")
    for _ in range(2):
        cfg = build("tiny", overrides=old, world_size=1)
    s = cfg.stability
    assert (s.spike_factor, s.spike_window, s.max_bad_steps, s.max_rollbacks) == (2.5, 7, 4, 1)
    notes = capsys.readouterr().err
    for name in ("spike_factor", "spike_window", "max_bad_steps", "max_rollbacks"):
        assert notes.count(f"note: checkpoint.{name} is now stability.{name}\n") <= 1
    same = build(
        "tiny", overrides=["checkpoint.spike_factor=2.5", "stability.spike_factor=2.5"], world_size=1
    )
    assert same.stability.spike_factor == 2.5
    with pytest.raises(
        ConfigError,
        match=re.escape("checkpoint.spike_factor is now stability.spike_factor, and both are set"),
    ):
        build("tiny", overrides=["checkpoint.spike_factor=2.5", "stability.spike_factor=3"], world_size=1)
