"""Supervised runs (`pretrain train --nproc-per-node K --max-restarts N`): kill -9 restarts every
rank from the newest checkpoint and ends where an uninterrupted run ends; a kill during a save
leaves the previous checkpoint in charge; SIGTERM reaches the ranks, which save and stop."""

from __future__ import annotations

import signal
import subprocess

import pytest
import torch

from pretrain.cluster.supervise import rank_arguments, restart_count
from pretrain.training import checkpoint
from tests.conftest import BIN, CORPUS, ROOT, SUPERVISED, cli, subprocess_env


@pytest.mark.distributed
def test_kill_9_with_supervised_restarts(char_dataset, two_ranks, tmp_path):
    """rank 1 is killed after step 5, then rank 0 while it saves step 9: two restarts."""
    from pretrain.export import consolidated_state_dict

    _, out = two_ranks
    run = tmp_path / "sup"
    sets = [
        CORPUS,
        *(f"--set={s}" for s in [*SUPERVISED, f"data.dataset_dir={char_dataset}", f"logging.run_dir={run}"]),
    ]
    faults = {"PRETRAIN_FAULT_KILL": "1:5", "PRETRAIN_FAULT_KILL_IN_SAVE": "9"}
    done = cli("train", *sets, "--max-restarts", "3", "--nproc-per-node", "2", env=faults, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    assert "SIGKILL" in log and "(kill-1-5)" in log and "(kill-in-save-9)" in log
    assert log.count("restarting every rank from the newest checkpoint") == 2
    assert "resumed from" in log and f"{run}/checkpoints/step_00000003 at step 3" in log
    # killed while saving step 9: the next start used step 6, and the partial save is gone
    assert f"{run}/checkpoints/step_00000006 at step 6" in log
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(("step", ".", "latest"))) == [
        "latest", "step_00000009", "step_00000012",
    ]  # fmt: skip
    # the reference: the same config, uninterrupted (trained by the 2-rank job)
    ref = out / "sup_ref"
    got = consolidated_state_dict(run / "checkpoints" / "step_00000012")
    want = consolidated_state_dict(ref / "checkpoints" / "step_00000012")
    assert all(torch.equal(got[k], want[k]) for k in want)
    last = (run / "metrics.csv").read_text().splitlines()
    ref_last = (ref / "metrics.csv").read_text().splitlines()
    loss = [line.split(",")[1] for line in last if line.startswith("12,") and line.split(",")[1]]
    ref_loss = [line.split(",")[1] for line in ref_last if line.startswith("12,") and line.split(",")[1]]
    assert loss == ref_loss and loss


@pytest.mark.distributed
def test_sigterm_to_a_supervised_run_saves_and_stops(char_dataset, tmp_path):
    """Preemption: SIGTERM to `pretrain train --nproc-per-node` reaches the ranks, which save."""
    import time

    run = tmp_path / "run"
    endless = ["schedule.max_steps=1000000", "checkpoint.interval=1000000", "logging.eval_interval=1000000"]
    sets = [
        f"--set={s}"
        for s in [*SUPERVISED, *endless, f"data.dataset_dir={char_dataset}", f"logging.run_dir={run}"]
    ]
    proc = subprocess.Popen(
        [str(BIN / "pretrain"), "train", CORPUS, *sets, "--nproc-per-node", "1"],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run / "metrics.csv"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) > 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=180)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    tags, _ = checkpoint.committed_tags(run / "checkpoints")
    assert len(tags) == 1 and f"stopped by SIGTERM at step {checkpoint.step_of(tags[0])};" in out
    assert checkpoint.verify(run / "checkpoints" / tags[0]) == []


def test_the_ranks_get_trains_arguments_but_the_supervisors():
    """`train`'s arguments pass on to the ranks in order, with or without '=', without the two the
    supervisor reads (abbreviated as argparse allows, as the command line took them)."""
    given = [
        "--set", "a=1", "--max-restarts", "3", "--resume", "--nproc-per-node=2", "--ds", "x.json",
        "--set=b=-1", "--max-r=1", "--set", "c=--nproc-per-node",
    ]  # fmt: skip
    assert rank_arguments(given) == [
        "--set", "a=1", "--resume", "--ds", "x.json", "--set=b=-1", "--set", "c=--nproc-per-node",
    ]  # fmt: skip


def test_restart_count_reads_the_supervisors_torchruns_and_slurms():
    import os

    names = ("PRETRAIN_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    try:
        assert restart_count() == 0
        os.environ["SLURM_RESTART_COUNT"] = "2"
        assert restart_count() == 2
        os.environ["PRETRAIN_RESTART_COUNT"] = "x"  # not a count: the next variable's
        assert restart_count() == 2
    finally:
        for k in names:
            os.environ.pop(k, None)
        os.environ.update(saved)


def descendants(pid: int) -> set[int]:
    """Every process under `pid`, from /proc (no psutil)."""
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.distributed
def test_kill_9_of_the_supervisor_takes_torchrun_and_the_ranks_with_it(char_dataset, tmp_path):
    """The supervisor's children run in a session of their own: without a death signal, `kill -9`
    of the supervisor left torchrun and its ranks training, orphaned, holding the run dir's lock."""
    import time

    from pretrain.training import rundir

    run = tmp_path / "run"
    endless = ["schedule.max_steps=1000000", "checkpoint.interval=1000000", "logging.eval_interval=1000000"]
    sets = [
        f"--set={s}"
        for s in [*SUPERVISED, *endless, f"data.dataset_dir={char_dataset}", f"logging.run_dir={run}"]
    ]
    proc = subprocess.Popen(
        [str(BIN / "pretrain"), "train", CORPUS, *sets, "--nproc-per-node", "2", "--max-restarts", "2"],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = run / "metrics.csv"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) > 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    under = descendants(proc.pid)
    assert len(under) >= 3  # torchrun and its two ranks
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 120
    while any(alive(p) for p in under):
        assert time.monotonic() < deadline, [p for p in under if alive(p)]
        time.sleep(0.5)
    assert rundir.holder(run) is None  # the lock went with them
    # the ranks were told to stop (SIGTERM through torchrun) and saved on the way out
    tags, _ = checkpoint.committed_tags(run / "checkpoints")
    assert tags, sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.mark.distributed
def test_a_rank_killed_is_named_by_the_rank_that_lost_it(char_dataset, tmp_path):
    """Two ranks, no restarts, rank 1 killed after step 2: rank 0's collective fails in gloo
    ("Connection closed by peer"), and it says so in one line naming rank 1 and its pid, and the fix;
    torchrun says which rank failed first; no traceback, no warning."""
    run = tmp_path / "run"
    sets = [f"--set={s}" for s in [*SUPERVISED, f"data.dataset_dir={char_dataset}", f"logging.run_dir={run}"]]
    done = cli(
        "train", CORPUS, *sets, "--nproc-per-node", "2", env={"PRETRAIN_FAULT_KILL": "1:2"}, timeout=300
    )
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    pid = log.split("fault injection: SIGKILL to pid ")[1].split()[0]
    said = [line for line in log.splitlines() if "lost another rank" in line]
    assert len(said) == 1, log[-4000:]
    assert said[0].startswith("error: rank 0 lost another rank in the middle of a collective (")
    assert f"rank 1 (pid {pid}) on this host has exited" in said[0] and "--resume auto" in said[0]
    assert "[rank0]:" not in log and "Traceback" not in log and "FutureWarning" not in log, log[-4000:]
    # torchrun's own summary, one line a rank, the first failure first
    assert f"torchrun: rank 1 (pid {pid}) was killed by SIGKILL\n" in log, log[-4000:]
    assert "torchrun: rank 0 (pid " in log and "after rank 1 (torchrun stops the others)" in log
