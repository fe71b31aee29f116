"""The hang watchdog (pretrain/training/watchdog.py) on real runs of `pretrain train`: a rank hung after a
step makes every rank write its stacks to <run_dir>/hang/ and the run exit non-zero within the
timeout + 30 s; supervised (`--max-restarts`), the run restarts from its newest checkpoint and ends
on the weights of an uninterrupted run; a rank that holds the GIL is caught by the C fallback."""

from __future__ import annotations

import calendar
import re
import subprocess
import time

import pytest
import torch

from pretrain.config.tree import validate
from pretrain.errors import ConfigError
from pretrain.training.watchdog import EXIT_CODE
from tests.conftest import BIN, CORPUS, ROOT, SUPERVISED, cli, subprocess_env

TIMEOUT_S = 15  # a step of the tests' model takes well under a second, even on a loaded machine
WATCHDOG = [f"watchdog.timeout_s={TIMEOUT_S}", "watchdog.slow_timeout_s=300"]


def test_watchdog_settings_are_validated():
    assert validate({"watchdog": {"timeout_s": 0}}).watchdog.timeout_s == 0  # off
    with pytest.raises(ConfigError, match=r"slow_timeout_s \(60\) is below timeout_s \(120\)"):
        validate({"watchdog": {"timeout_s": 120, "slow_timeout_s": 60}})
    with pytest.raises(ConfigError, match=r"watchdog\.timeout_s"):
        validate({"watchdog": {"timeout_s": -1}})


def _sets(dataset, run, *extra: str) -> list[str]:
    return [
        CORPUS,
        *(f"--set={s}" for s in [*SUPERVISED, *WATCHDOG, *extra, f"data.dataset_dir={dataset}", f"logging.run_dir={run}"]),
    ]  # fmt: skip


def _hang_time(log: str) -> float:
    """When the fault injection says the rank hung (time.time())."""
    found = re.search(r"fault injection: pid \d+ hangs .* from ([0-9.]+) \(hang-", log)
    assert found, log[-4000:]
    return float(found.group(1))


@pytest.mark.distributed
def test_a_hung_rank_dumps_the_stacks_of_every_rank_and_the_run_exits(char_dataset, tmp_path):
    """Rank 1 sleeps for ever after step 2; rank 0 waits for it in step 3's gradient reduction."""
    run = tmp_path / "hung"
    proc = subprocess.Popen(
        [str(BIN / "pretrain"), "train", *_sets(char_dataset, run), "--nproc-per-node", "2"],
        cwd=ROOT,
        env=subprocess_env(PRETRAIN_FAULT_HANG="1:2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = proc.communicate(timeout=600)[0]
    exited = time.time()
    assert proc.returncode != 0, log[-6000:]
    hung = _hang_time(log)
    assert exited - hung <= TIMEOUT_S + 30, (exited - hung, log[-6000:])
    stacks = {r: run / "hang" / "step_00000002" / f"rank{r}.txt" for r in (0, 1)}
    for rank, path in stacks.items():
        text = path.read_text()
        assert (
            text.startswith(f"watchdog: rank {rank} of 2 on ")
            and f"step 3 did not finish within {TIMEOUT_S} s (watchdog.timeout_s)" in text
        ), text
        assert "the last completed step was 2" in text and "Thread 0x" in text, text
        # the one line on stderr: the file, the setting, the exit code
        assert f"stacks in {path}; exiting with code {EXIT_CODE}" in log, log[-6000:]
        written = calendar.timegm(
            time.strptime(text.split("stacks written at ")[1][:20], "%Y-%m-%dT%H:%M:%SZ")
        )
        assert written >= int(hung) + TIMEOUT_S - 1  # not before the deadline
    assert re.search(r'faults\.py", line \d+ in _hang', stacks[1].read_text())  # where it hung
    assert "distributed_c10d.py" in stacks[0].read_text()  # rank 0 waits in a collective
    print(f"hang -> exit {exited - hung:.1f} s (watchdog.timeout_s={TIMEOUT_S})")


@pytest.mark.distributed
def test_a_supervised_run_restarts_past_a_hang_and_ends_on_the_uninterrupted_weights(
    char_dataset, two_ranks, tmp_path
):
    """Rank 0 hangs after step 7 (checkpoints every 3): the watchdog ends the attempt, the next
    resumes from step 6 and ends on the weights and loss of the uninterrupted run."""
    from pretrain.export import consolidated_state_dict

    _, out = two_ranks
    run = tmp_path / "sup"
    done = cli(
        "train",
        *_sets(char_dataset, run),
        "--max-restarts",
        "1",
        "--nproc-per-node",
        "2",
        env={"PRETRAIN_FAULT_HANG": "0:7"},
        timeout=600,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert log.count("restarting every rank from the newest checkpoint") == 1, log[-6000:]
    assert f"resumed from {run}/checkpoints/step_00000006 at step 6" in log
    for rank in (0, 1):
        assert (run / "hang" / "step_00000007" / f"rank{rank}.txt").is_file()
    assert "step 8 did not finish" in (run / "hang" / "step_00000007" / "rank1.txt").read_text()
    # the reference: the same config, uninterrupted (trained by the 2-rank job of conftest.py)
    ref = out / "sup_ref"
    got = consolidated_state_dict(run / "checkpoints" / "step_00000012")
    want = consolidated_state_dict(ref / "checkpoints" / "step_00000012")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    loss = [r.split(",")[1] for r in (run / "metrics.csv").read_text().splitlines() if r.startswith("12,")]
    ref_loss = [
        r.split(",")[1] for r in (ref / "metrics.csv").read_text().splitlines() if r.startswith("12,")
    ]
    assert loss == ref_loss and loss[0]


@pytest.mark.distributed
def test_a_rank_holding_the_gil_is_caught_by_the_c_fallback(char_dataset, tmp_path):
    """One rank stuck in a C call that never releases the GIL: the watchdog's Python thread cannot
    run, and faulthandler's C thread writes the stacks to stderr and exits."""
    run = tmp_path / "gil"
    proc = subprocess.Popen(
        [str(BIN / "pretrain"), "train", *_sets(char_dataset, run)],
        cwd=ROOT,
        env=subprocess_env(PRETRAIN_FAULT_HANG="0:2:gil"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log = proc.communicate(timeout=600)[0]
    exited = time.time()
    assert proc.returncode == 1, log[-6000:]
    assert exited - _hang_time(log) <= TIMEOUT_S + 30, log[-6000:]
    assert "Timeout (0:00:" in log and re.search(r'faults\.py", line \d+ in _hang', log), log[-6000:]
    assert not (run / "hang").exists()  # the Python thread never ran
