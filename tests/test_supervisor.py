"""Supervised runs (`pretrain train --nproc-per-node K --max-restarts N`): kill -9 restarts every
rank from the newest checkpoint and ends where an uninterrupted run ends; a kill during a save
leaves the previous checkpoint in charge; SIGTERM reaches the ranks, which save and stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
import torch

from pretrain.cluster.supervise import rank_arguments, restart_count
from pretrain.training.checkpoint import store as checkpoint
from tests.conftest import BIN, CORPUS, ROOT, SUPERVISED, cli, subprocess_env


@pytest.mark.distributed
def test_kill_9_with_supervised_restarts(char_dataset, two_ranks, tmp_path):
    """rank 1 is killed after step 5, then rank 0 while it saves step 9 in the background (the kill
    comes from the thread that writes the files, after the first): two restarts."""
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
    assert log.index(f"saving checkpoint {run}/checkpoints/step_00000009 in the background") < log.index(
        "(kill-in-save-9)"
    )
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
    # OMP_NUM_THREADS unset, as on a person's shell: the supervisor sets it, said once, where torchrun
    # would warn in four lines
    env = {k: v for k, v in subprocess_env(PRETRAIN_FAULT_KILL="1:2").items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [str(BIN / "pretrain"), "train", CORPUS, *sets, "--nproc-per-node", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    assert "Setting OMP_NUM_THREADS" not in log, log[-4000:]
    assert len(re.findall(r"supervisor: OMP_NUM_THREADS=\d+ for each of the 2 ranks", log)) == 1, log[-4000:]
    pid = log.split("fault injection: SIGKILL to pid ")[1].split()[0]
    said = [line for line in log.splitlines() if "lost another rank" in line]
    assert len(said) == 1, log[-4000:]
    assert said[0].startswith("error: rank 0 lost another rank in the middle of a collective (")
    assert f"rank 1 (pid {pid}) on this host has exited" in said[0] and "--resume auto" in said[0]
    assert "[rank0]:" not in log and "Traceback" not in log and "FutureWarning" not in log, log[-4000:]
    # torchrun's own summary, one line a rank, the first failure first
    assert f"torchrun: rank 1 (pid {pid}) was killed by SIGKILL\n" in log, log[-4000:]
    assert "torchrun: rank 0 (pid " in log and "after rank 1 (torchrun stops the others)" in log


@pytest.mark.distributed
@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_to_a_supervised_pipeline_run_ends_on_one_line(char_dataset, tmp_path, signals):
    """Preemption of `train --nproc-per-node 2` (PP2, a save every step): the ranks save and say so,
    that line ends the output, exit 143, and no rank outlives the supervisor. torchrun's
    `SignalException` traceback came after it, and a second SIGTERM (Slurm's, a person's) while the
    ranks saved printed two."""
    import time

    run, log = tmp_path / "run", tmp_path / "out.txt"
    endless = ["schedule.max_steps=1000000", "logging.eval_interval=1000000"]
    pp2 = ["parallel.pipeline=2", "zero.stage=1", "checkpoint.interval=1", "checkpoint.keep_last=2"]
    sets = [
        f"--set={s}"
        for s in [*SUPERVISED, *endless, *pp2, f"data.dataset_dir={char_dataset}", f"logging.run_dir={run}"]
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(BIN / "pretrain"), "train", CORPUS, *sets, "--nproc-per-node", "2"],
            cwd=ROOT, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        metrics = run / "metrics.csv"
        deadline = time.monotonic() + 180
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) > 3):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks = [_rank_pid(proc.pid, r) for r in (0, 1)]
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.2)
        proc.wait(timeout=180)
        assert not [pid for pid in ranks if alive(pid)], "a rank outlived the supervisor"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = log.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, said[-4000:]
    tags, _ = checkpoint.committed_tags(run / "checkpoints")
    stopped = f"stopped by SIGTERM at step {checkpoint.step_of(tags[-1])}; resume with --resume auto"
    assert said.rstrip().splitlines()[-1] == stopped, said[-4000:]
    assert not [w for w in ("Traceback", "SignalException", "death signal") if w in said], said[-4000:]


@pytest.mark.distributed
def test_a_refused_start_says_why_before_any_rank_starts(char_dataset, tmp_path):
    """`train --nproc-per-node 2 --set parallel.pipeline=3`: every rank refused the config, but only
    rank 0 printed it, and when rank 1 exited first torchrun killed rank 0 before it did; the
    supervisor then said "refused (the error above)" under nothing. The config is checked first."""
    run = tmp_path / "run"
    sets = [f"--set={s}" for s in [*SUPERVISED, f"data.dataset_dir={char_dataset}", f"logging.run_dir={run}"]]
    done = cli("train", CORPUS, *sets, "--set=parallel.pipeline=3", "--nproc-per-node", "2", timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert out.count("parallel.pipeline (3) exceeds model.n_layer (2)") == 1, out[-3000:]
    assert "supervisor: attempt" not in out and "torchrun" not in out and not run.exists(), out[-3000:]


def _rank_pid(parent: int, rank: int, timeout: float = 60) -> int:
    """The pid of rank `rank` under `parent`, as soon as it has started (its RANK variable)."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(parent):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:  # an entry of its own: not LOCAL_RANK's
                return pid
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} did not start within {timeout} s")


def _pending(pid: int) -> int:
    """The signals pending for process `pid` (its shared pending mask, from /proc)."""
    from pathlib import Path

    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:")), 16)


@pytest.mark.distributed
def test_a_refusal_is_printed_when_the_rank_that_would_print_it_is_killed_first(char_dataset, tmp_path):
    """A refusal the ranks meet (a DeepSpeed JSON DeepSpeed's validators reject) with rank 0 held
    stopped from its start, so rank 1 refuses first and torchrun kills rank 0 before it could print:
    the supervisor prints the refusal, once, from what the rank that refused left it."""
    import json
    import time

    ds = json.loads((ROOT / "ds_configs" / "cpu_zero2.json").read_text())
    ds["gradient_clippping"] = 1.0
    bad = tmp_path / "bad_ds.json"
    bad.write_text(json.dumps(ds))
    run = tmp_path / "run"
    sets = [f"--set={s}" for s in [*SUPERVISED, f"data.dataset_dir={char_dataset}", f"logging.run_dir={run}"]]
    proc = subprocess.Popen(
        [str(BIN / "pretrain"), "train", "--ds", str(bad), CORPUS, *sets, "--nproc-per-node", "2"],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        rank0 = _rank_pid(proc.pid, 0)
        os.kill(rank0, signal.SIGSTOP)  # held before it imports anything
        # rank 1 refuses and exits; torchrun's SIGTERM to rank 0 waits, pending, until it runs on
        deadline = time.monotonic() + 120
        while not _pending(rank0) & (1 << (signal.SIGTERM - 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "torchrun did not stop rank 0"
            time.sleep(0.05)
        os.kill(rank0, signal.SIGCONT)  # and it dies of it, as when torchrun's SIGTERM beat its print
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2, out[-3000:]
    said = "'gradient_clippping' is not a DeepSpeed config key"
    assert out.count(said) == 1 and "error: invalid" in out, out[-3000:]
    assert out.index(said) < out.index("supervisor: attempt 1 was refused"), out[-3000:]
    assert "attempt 2" not in out and "Traceback" not in out, out[-3000:]
