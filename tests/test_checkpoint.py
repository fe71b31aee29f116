"""Checkpoints: atomic saves, validation and fallback, exact resume, world-size change and faults
(NaN, full disk), with real processes and the real DeepSpeed engine.

Most tests read what the shared 2-rank job (`two_ranks`, tests/conftest.py) left behind.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import pickle
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from pretrain.config.layout import Layout
from pretrain.config.run_sections import CheckpointConfig
from pretrain.training import faults, guards
from pretrain.training.checkpoint import resume, universal
from pretrain.training.checkpoint import store as checkpoint
from tests.conftest import BIN, CORPUS, ROOT, ckpt, cli, subprocess_env, torchrun

# ---------------------------------------------------------------------------------------------
# Exact resume, and saving on a signal


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_bit_exact_at_zero_2_and_3(two_ranks, stage):
    """ZeRO-2 logs every step; ZeRO-3 every 3, so its stop after step 5 falls inside the window of step
    6: the resumed run's first logged loss is still the mean over steps 4 to 6, not over step 6 alone."""
    res, _ = two_ranks
    full, stop, resume = res[f"z{stage}_full"], res[f"z{stage}_stop"], res[f"z{stage}_resume"]
    assert stop["stopped_by"] == "SIGTERM" and stop["final_step"] == 5  # asked after step 4 on rank 1
    assert resume["start_step"] == 5  # from the signal's checkpoint, not the interval's (3)
    joined = {**stop["losses"], **resume["losses"]}
    assert sorted(joined, key=int) == [str(s) for s in (range(1, 9) if stage == 2 else (3, 6, 8))]
    assert joined == full["losses"], (joined, full["losses"])  # bit for bit, dropout included
    assert "RNG restored" in res["_stdout"]


@pytest.mark.distributed
def test_a_signal_saves_on_every_rank(two_ranks):
    _, out = two_ranks
    path = ckpt(out, "z2_res", 5)
    meta = checkpoint.read_meta(path)
    assert meta["step"] == 5 and meta["world_size"] == 2
    assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(
        meta["files"]
    )
    assert checkpoint.verify(path) == []
    for key in (
        "loader",
        "config",
        "versions",
        "tokens_seen",
        "data_manifest_sha256",
        "tokenizer_fingerprint",
    ):
        assert meta[key], key
    assert meta["versions"]["packages"]["deepspeed"] and "commit" in meta["versions"]["code"]
    assert meta["loader"]["consumed_samples"] == 5 * 4
    state = checkpoint.load_file(path / "mp_rank_00_model_states.pt")  # weights only
    assert len(state["rng"]) == 2 and set(state["rng"][1]) >= {"torch", "python", "numpy"}  # one per rank


# ---------------------------------------------------------------------------------------------
# NaN / inf


@pytest.mark.distributed
def test_nan_steps_are_skipped_then_rolled_back(two_ranks):
    res, out = two_ranks
    for stage in (2, 3):
        r = res[f"nan_z{stage}"]
        # batch 3: skipped (step 3 retried with batch 4); batches 6 and 7: two in a row, so back
        # to the checkpoint of step 4, and both batches skipped on the way forward again.
        assert r["skipped_steps"] == [3, 5] and r["rollbacks"] == [4], r
        assert r["final_step"] == 8 and all(v == v and abs(v) < 10 for v in r["losses"].values())
        assert checkpoint.read_meta(ckpt(out, f"nan_z{stage}", 8))["skip_batches"] == [20, 24]
    # Stage 0 in fp32 applies even a NaN update, so the run rolls back at once (to step 2) ...
    z0, z2 = res["nan_z0"], res["nan_z2"]
    assert z0["rollbacks"] == [2] and z0["skipped_steps"] == []
    # ... and continues as the ZeRO-2 run that skipped the update: the rollback restored the weights,
    # the optimizer and the data position of step 2. (To the last bits: stage 0 all-reduces the
    # gradients where ZeRO-2 reduce-scatters them, the same sums in another order.)
    z0_losses = [z0["losses"][str(s)] for s in range(1, 5)]
    assert z0_losses == pytest.approx([z2["losses"][str(s)] for s in range(1, 5)], abs=1e-6, rel=0)
    stdout = res["_stdout"]
    assert "step 3: non-finite loss, update skipped (1 in a row, rollback at 2)" in stdout
    assert "rolling back to" in stdout and "skipped the batch at sample 24" in stdout


# ---------------------------------------------------------------------------------------------
# World-size change through the universal checkpoint


@pytest.fixture(scope="module")
def converted(two_ranks) -> Path:
    _, out = two_ranks
    done = cli("convert", str(ckpt(out, "ws_z2", 4)))  # the command, end to end
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "wrote the universal checkpoint" in done.stdout
    universal.convert_to_universal(ckpt(out, "ws_z3", 4))  # the same function, in this process
    for run in ("ws_z2", "ws_z3"):
        uni = ckpt(out, run, 4) / "universal"
        assert checkpoint.verify(uni) == [] and checkpoint.read_meta(uni)["format"] == "universal"
        assert not (ckpt(out, run, 4) / "latest_universal").exists()
    return out


@pytest.mark.distributed
def test_convert_again_and_over_a_file_it_did_not_write(converted, tmp_path):
    """A second convert says it is done (no DeepSpeed traceback); a person's file or directory at
    step_N/universal is refused and kept; a damaged universal checkpoint of ours is converted anew."""
    done = cli("convert", str(ckpt(converted, "ws_z2", 4)))
    assert done.returncode == 0 and "already converted, and sound:" in done.stdout, done.stderr[-3000:]
    src = tmp_path / "step_00000004"
    shutil.copytree(ckpt(converted, "ws_z2", 4), src, ignore=shutil.ignore_patterns("universal"))
    for mine in ("file", "dir"):
        target = src / "universal"
        if mine == "file":
            target.write_text("my notes\n")
        else:
            target.mkdir()
            (target / "notes.txt").write_text("my notes\n")
        out = cli("convert", str(src))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert (
            "is in the way: it is not a universal checkpoint this project wrote, and it is kept" in out.stderr
        )
        assert (target.read_text() if mine == "file" else (target / "notes.txt").read_text()) == "my notes\n"
        shutil.rmtree(target) if mine == "dir" else target.unlink()
    shutil.copytree(ckpt(converted, "ws_z2", 4) / "universal", src / "universal")
    damaged = next(p for p in sorted((src / "universal").rglob("*.pt")))
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"x")
    out = cli("convert", str(src))
    assert out.returncode == 0 and "wrote the universal checkpoint" in out.stdout, out.stderr[-3000:]
    assert checkpoint.verify(src / "universal") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]  # nothing set aside is left


def world_size_jobs(out: Path, ranks: int) -> list[dict]:
    # The global batch stays 4 sequences: 1 rank x 2 micro x 2 accumulation, or 4 ranks x 1.
    layout = ["batch.gradient_accumulation_steps=2"] if ranks == 1 else ["batch.micro_batch_size=1"]
    return [
        {
            "name": f"ws{ranks}_z{stage}",
            "run": f"ws{ranks}_z{stage}",
            "overrides": [f"zero.stage={stage}", "checkpoint.interval=4", *layout],
            "resume": str(ckpt(out, f"ws_z{stage}", 4)),
        }
        for stage in (2, 3)
    ]


@pytest.mark.distributed
@pytest.mark.parametrize("ranks", [1, 4])
def test_world_size_change_through_universal_checkpoint(char_dataset, two_ranks, converted, ranks):
    res2, out = two_ranks
    jobs = world_size_jobs(out, ranks)
    if ranks == 1:
        jobs += [
            # no universal conversion of step 8: refused, with the command to run
            {"name": "unconverted", "run": "x1", "overrides": ["zero.stage=2"], "resume": str(ckpt(out, "ws_z3", 8)),
             "expect_error": True},
            # another architecture: refused
            {"name": "other_arch", "run": "x2", "overrides": ["zero.stage=2", "model.n_layer=3",
             "batch.gradient_accumulation_steps=2"], "resume": str(ckpt(out, "ws_z2", 4)), "expect_error": True},
        ]  # fmt: skip
    res = torchrun(ranks, 29542 + ranks, char_dataset, converted, jobs)
    for stage in (2, 3):
        ref, got = res2[f"ws_z{stage}"], res[f"ws{ranks}_z{stage}"]
        assert got["start_step"] == 4 and sorted(got["losses"], key=int) == ["5", "6", "7", "8"]
        diff = max(abs(ref["losses"][s] - v) for s, v in got["losses"].items())
        print(f"ZeRO-{stage} 2 -> {ranks} ranks: max |loss - uninterrupted| over steps 5-8 = {diff:.1e}")
        assert diff < 1e-5, (ref["losses"], got["losses"])
        # the data continued exactly: the same global samples consumed, the same loader state
        layout = ("world_size", "grad_accum", "micro_batch_size")
        a = checkpoint.read_meta(ckpt(out, f"ws_z{stage}", 8))["loader"]
        b = checkpoint.read_meta(ckpt(out, f"ws{ranks}_z{stage}", 8))["loader"]
        assert a["consumed_samples"] == 32 and b["world_size"] == ranks
        assert {k: v for k, v in a.items() if k not in layout} == {
            k: v for k, v in b.items() if k not in layout
        }
    assert f"universal checkpoint, RNG reseeded (saved by 2 ranks, running on {ranks})" in res["_stdout"]
    if ranks == 1:
        assert (
            "pretrain convert" in res["unconverted"]["error"]
            and "saved on 2 ranks" in res["unconverted"]["error"]
        )
        assert "model.n_layer: checkpoint has 2, this run has 3" in res["other_arch"]["error"]


# ---------------------------------------------------------------------------------------------
# Full disk, unwritable directory


def _mount_tmpfs(path: Path, size: str, options: str = "") -> None:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here to fill a disk ({done.stderr.strip()}); needs root")


@pytest.fixture
def small_disk(tmp_path):
    mounts: list[Path] = []

    def make(size: str, options: str = "") -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        _mount_tmpfs(path, size, options)
        mounts.append(path)
        return path

    yield make
    for m in mounts:
        subprocess.run(["umount", str(m)], check=False)


TINY_RUN = ["--set=batch.micro_batch_size=2", "--set=logging.log_interval=1", "--set=logging.sample_tokens=0",
            "--set=schedule.warmup_steps=1", "--set=logging.eval_interval=100", "--set=checkpoint.interval=2",
            "--set=checkpoint.keep_last=1", "--set=schedule.max_steps=4"]  # fmt: skip


@pytest.mark.distributed
def test_disk_filling_up_mid_run_keeps_the_previous_checkpoint(char_dataset, tmp_path, small_disk):
    # the `tiny` model: a checkpoint is about 5 MB at stage 0 (weights + AdamW moments); 9 MB
    # pass the start-up check but not two checkpoints side by side.
    disk = small_disk("9m")
    done = cli("train", CORPUS, f"--set=data.dataset_dir={char_dataset}", f"--set=logging.run_dir={tmp_path / 'run'}",
               f"--set=checkpoint.dir={disk / 'ck'}", *TINY_RUN)  # fmt: skip
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.startswith(
        "error: saving checkpoint step_00000004 failed"
    )
    assert "the previous checkpoint step_00000002 is intact" in done.stderr
    assert "may run out of space" in done.stdout  # the start-up warning
    assert sorted(p.name for p in (disk / "ck").iterdir()) == ["latest", "step_00000002"]
    assert (disk / "ck" / "latest").read_text().strip() == "step_00000002"
    assert checkpoint.verify(disk / "ck" / "step_00000002") == []


@pytest.mark.distributed
def test_a_run_dir_that_fills_between_saves_is_one_line_naming_the_file(char_dataset, tmp_path, small_disk):
    """The disk of the run dir fills while the run logs (TensorBoard on, as by default): TensorBoard's
    writer thread printed a traceback, and metrics.csv's write `No space left on device` naming no
    path. Now: one line each, naming the file, and the checkpoints (elsewhere) intact."""
    import time

    disk = small_disk("4m")
    run = disk / "run"
    proc = subprocess.Popen(
        [str(BIN / "pretrain"), "train", CORPUS, f"--set=data.dataset_dir={char_dataset}",
         f"--set=logging.run_dir={run}", f"--set=checkpoint.dir={tmp_path / 'ck'}", *TINY_RUN,
         "--set=schedule.max_steps=1000000", "--set=checkpoint.interval=1000000"],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not ((run / "metrics.csv").is_file() and len((run / "metrics.csv").read_text().splitlines()) > 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    with (disk / "filler").open("wb") as f, contextlib.suppress(OSError):  # fills: whatever fits, then ENOSPC
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 2, out[-2000:] + err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"{run}" in err and "cannot write (No space left on device" in err, err[-3000:]
    assert "then continue with --resume auto" in err


@pytest.mark.distributed
def test_full_or_unwritable_checkpoint_dir_is_a_start_up_error(char_dataset, tmp_path, small_disk):
    full = small_disk("1m")
    common = [
        CORPUS,
        f"--set=data.dataset_dir={char_dataset}",
        f"--set=logging.run_dir={tmp_path / 'run'}",
        *TINY_RUN,
    ]
    done = cli("train", *common, f"--set=checkpoint.dir={full / 'ck'}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "one checkpoint needs about" in done.stderr and "free" in done.stderr
    assert "step " not in done.stdout  # refused before training
    assert not any((full / "ck").iterdir())
    readonly = small_disk("1m", "ro")
    with pytest.raises(checkpoint.CheckpointError, match="is not writable: Read-only file system"):
        checkpoint.preflight(readonly / "ck", need_bytes=1000, keep=2, group=None)


def test_preflight_names_an_unwritable_dir(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(checkpoint.CheckpointError, match="is not writable: Not a directory"):
        checkpoint.preflight(tmp_path / "file" / "ck", need_bytes=1000, keep=2, group=None)
    with pytest.raises(checkpoint.CheckpointError, match=r"needs about 1000\.0 TB"):
        checkpoint.preflight(tmp_path / "ck", need_bytes=10**15, keep=2, group=None)
    checkpoint.preflight(tmp_path / "ck", need_bytes=1000, keep=2, group=None)
    assert list((tmp_path / "ck").iterdir()) == []  # the probe file is gone


# ---------------------------------------------------------------------------------------------
# Validation, fallback, retention (on real checkpoints from the 2-rank job, copied)


@pytest.mark.distributed
def test_resume_auto_falls_back_past_invalid_checkpoints(two_ranks, tmp_path):
    _, out = two_ranks
    ck = tmp_path / "checkpoints"
    shutil.copytree(out / "z2_full" / "checkpoints", ck)
    assert checkpoint.committed_tags(ck)[0] == ["step_00000003", "step_00000006", "step_00000008"]
    # step 8: one optimizer shard truncated; step 6: one byte flipped (same size, new sha256)
    shard = ck / "step_00000008" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:1000])
    model = ck / "step_00000006" / "mp_rank_00_model_states.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    # a save killed after its rename but before `latest` moved on: newer, complete, not committed
    shutil.copytree(ck / "step_00000003", ck / "step_00000010")
    meta = json.loads((ck / "step_00000010" / checkpoint.META).read_text())
    (ck / "step_00000010" / checkpoint.META).write_text(json.dumps({**meta, "step": 10}))
    reports: list[str] = []
    found = resume.find(
        ck, "auto", layout=Layout(data=2, zero_stage=2), checksums=True, group=None, report=reports.append
    )
    assert found is not None and found.tag == "step_00000003" and found.step == 3
    text = "\n".join(reports)
    assert "step_00000010: newer than `latest` (step_00000008), its save did not finish; ignored" in text
    assert "step_00000008 is invalid, skipped; trying the previous one" in text
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: 1000 bytes, expected" in text
    assert "step_00000006 is invalid, skipped; trying the previous one" in text
    assert "mp_rank_00_model_states.pt: blake3 differs from the one recorded at save" in text
    # without checksums a flipped byte goes unseen: step 6 is picked
    assert (
        resume.find(
            ck,
            "auto",
            layout=Layout(data=2, zero_stage=2),
            checksums=False,
            group=None,
            report=reports.append,
        ).tag
        == "step_00000006"
    )  # type: ignore[union-attr]
    # on another world size, the same checkpoint needs its universal conversion
    with pytest.raises(checkpoint.CheckpointError, match=r"pretrain convert .*step_00000003"):
        resume.find(
            ck, "auto", layout=Layout(data=1, zero_stage=2), checksums=True, group=None, report=reports.append
        )


def test_retention_keeps_last_k_milestones_and_best(tmp_path):
    ck = tmp_path / "ck"
    losses = {2: 3.0, 4: 1.0, 6: 2.0, 8: 2.5, 10: 2.6, 12: 2.7}
    for step, val in losses.items():
        d = ck / checkpoint.tag_for(step)
        d.mkdir(parents=True)
        (d / checkpoint.META).write_text(json.dumps({"step": step, "val_loss": val}))
    (ck / "latest").write_text("step_00000012\n")
    policy = CheckpointConfig(keep_last=2, milestone_interval=6, keep_best=True)
    removed = checkpoint.prune(ck, policy)
    assert removed == ["step_00000002", "step_00000008"]
    assert checkpoint.committed_tags(ck)[0] == [
        "step_00000004",
        "step_00000006",
        "step_00000010",
        "step_00000012",
    ]
    assert not [p for p in ck.iterdir() if p.name.startswith(".")]


def test_retention_of_a_linked_checkpoint_removes_the_link_and_leaves_nothing_behind(tmp_path):
    """A checkpoint kept elsewhere and linked in was renamed to `.trash-step_N`, which rmtree
    refuses (a link): the link stayed, and the next start's sweep left it too. Now the link goes;
    the directory it points to (another run's, a shared copy) is not this run's to delete."""
    ck, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    for step in (2, 4, 6):
        d = (elsewhere if step == 2 else ck) / checkpoint.tag_for(step)
        d.mkdir(parents=True)
        (d / checkpoint.META).write_text(json.dumps({"step": step}))
    (ck / "step_00000002").symlink_to(elsewhere / "step_00000002")
    (ck / ".trash-step_00000000").symlink_to(elsewhere)  # left by the retention before this fix
    (ck / "latest").write_text("step_00000006\n")
    assert checkpoint.prune(ck, CheckpointConfig(keep_last=1)) == ["step_00000002", "step_00000004"]
    checkpoint.preflight(ck, need_bytes=1, keep=1, group=None)  # a start's sweep of leftovers
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000006"]
    assert (elsewhere / "step_00000002" / checkpoint.META).is_file()


# ---------------------------------------------------------------------------------------------
# Loading is weights-only


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.distributed
def test_loads_are_weights_only(two_ranks, converted, tmp_path):
    _, out = two_ranks
    files = [p for run in ("z2_full", "z3_full", "ws_z3") for p in (out / run / "checkpoints").rglob("*.pt")]
    assert any("universal" in str(p) for p in files) and len(files) > 20
    for p in files:
        checkpoint.load_file(p)  # every file DeepSpeed wrote, universal ones included
    evil = tmp_path / "evil.pt"
    torch.save({"x": _Evil()}, evil)
    with pytest.raises(checkpoint.CheckpointError, match=r"refused to load .*Weights only load failed") as e:
        checkpoint.load_file(evil)
    assert isinstance(e.value.__cause__, pickle.UnpicklingError)
    with checkpoint.safe_loading(), pytest.raises(pickle.UnpicklingError):
        torch.load(evil, weights_only=False)  # what DeepSpeed calls is overridden too
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


@pytest.mark.distributed
def test_every_generator_is_seeded_from_the_seed(two_ranks):
    """Two runs of one seed, one after the other in the same processes (z2_full, then z2_stop): at
    step 3 each rank's torch, Python and numpy generators are in the same states, and two ranks'
    differ (dropout must differ between data-parallel ranks)."""
    _, out = two_ranks
    a, b = (
        checkpoint.load_file(ckpt(out, run, 3) / "mp_rank_00_model_states.pt")["rng"]
        for run in ("z2_full", "z2_res")
    )
    for rank in (0, 1):
        assert torch.equal(a[rank]["torch"], b[rank]["torch"])
        assert a[rank]["python"] == b[rank]["python"]
        assert torch.equal(a[rank]["numpy"]["keys"], b[rank]["numpy"]["keys"])
        assert a[rank]["numpy"]["pos"] == b[rank]["numpy"]["pos"]
    assert a[0]["python"] != a[1]["python"] and not torch.equal(a[0]["numpy"]["keys"], a[1]["numpy"]["keys"])


@pytest.mark.distributed
def test_elapsed_seconds_count_on_across_a_resume(two_ranks):
    """metrics.csv's elapsed_s restarted at 0 at each resume; it counts the training time, as
    schedule.max_hours does, so a resumed run's rows go on from the checkpoint's."""
    _, out = two_ranks
    with open(out / "z2_res" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["loss"]]
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps) and max(steps) == 8 and 5 in steps  # stopped after 5, resumed to 8
    elapsed = [float(r["elapsed_s"]) for r in rows]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0, elapsed


def test_rng_states_survive_a_weights_only_round_trip(tmp_path):
    import random

    import numpy as np

    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    want = (torch.rand(3), random.random(), np.random.rand())
    checkpoint.set_rng_state(checkpoint.load_file(tmp_path / "rng.pt"))
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]


def test_stop_on_signal_ignores_repeats_but_not_a_second_ctrl_c():
    before = signal.getsignal(signal.SIGTERM)
    stop = guards.StopOnSignal().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a launcher passing it on again
        assert stop.signum == signal.SIGTERM
        stop.signum = None
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # within a second: a launcher passing it on, the same request
        assert stop.signum == signal.SIGINT
        time.sleep(stop.SAME_REQUEST_S + 0.2)
        with pytest.raises(KeyboardInterrupt):  # a person's second Ctrl-C, later: at once
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(50):  # the handler runs between bytecodes of this thread
                time.sleep(0.01)
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_faults_parse_and_fire_once(tmp_path):
    f = faults.Faults(tmp_path, 8, env={"PRETRAIN_FAULT_NAN_STEPS": "2, 5", "PRETRAIN_FAULT_KILL": "1:7"})
    assert f.nan(8, 0) and f.nan(32, 0) and not f.nan(8, 1) and not f.nan(16, 0)
    (tmp_path / ".fault-kill-1-7").write_text("fired\n")
    f.after_step(7, 1)  # already fired: no kill
    assert f.kill_in_save_hook(3, 0) is None
    f = faults.Faults(tmp_path, 8, env={"PRETRAIN_FAULT_HANG": "1:4:gil"})
    assert f.hang == (1, 4) and f.hang_holds_gil
    (tmp_path / ".fault-hang-1-4").write_text("fired\n")
    f.after_step(4, 1)  # already fired: no hang


def test_resume_refuses_another_arch_and_reads_model_fields_it_lacks_as_their_defaults(
    char_dataset, tmp_path
):
    from pretrain.config.tree import RunConfig
    from pretrain.data.dataset import Dataset, load_manifest
    from pretrain.errors import DataError

    ds = Dataset(char_dataset, load_manifest(char_dataset))
    cfg = RunConfig.model_validate({"model": {"vocab_size": 65}})
    newer = ("arch", "n_kv_head", "intermediate_size", "tie_embeddings")
    older = {k: v for k, v in cfg.model.model_dump(mode="json").items() if k not in newer}
    meta = {"config": {"model": older}, "tokenizer_fingerprint": ds.manifest["tokenizer"]["fingerprint"]}
    old = resume.Checkpoint(tmp_path, "step_00000002", meta)
    resume.check_compatible(old, cfg, [ds], warn=False)  # a gpt2 checkpoint from before `arch`
    llama = RunConfig.model_validate({"model": {"vocab_size": 65, "arch": "llama"}})
    with pytest.raises(DataError) as e:
        resume.check_compatible(old, llama, [ds], warn=False)
    assert "model.arch: checkpoint has 'gpt2', this run has 'llama'" in str(e.value)
    assert "model.bias: checkpoint has True, this run has False" in str(e.value)
    untied = RunConfig.model_validate({"model": {"vocab_size": 65, "tie_embeddings": False}})
    with pytest.raises(DataError, match=r"model\.tie_embeddings: checkpoint has True, this run has False"):
        resume.check_compatible(old, untied, [ds], warn=False)
    # A llama checkpoint written while its activation was recorded as "gelu" (it meant SwiGLU) resumes.
    recorded = {**llama.model.model_dump(mode="json"), "activation": "gelu"}
    meta_llama = {**meta, "config": {"model": recorded}}
    resume.check_compatible(resume.Checkpoint(tmp_path, "step_00000002", meta_llama), llama, [ds], warn=False)
