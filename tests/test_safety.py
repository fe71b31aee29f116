"""Nothing lost, no traceback: output dirs that are never someone else's, verified checkpoint reads,
one run per run dir, and one clear message for each bad input, on the real commands."""

from __future__ import annotations

import csv
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.config.layout import Layout
from pretrain.errors import CheckpointError, DataError
from pretrain.training.checkpoint import resume
from pretrain.training.checkpoint import store as checkpoint
from tests.conftest import BIN, ROOT, TINY_SHAKESPEARE, cli, subprocess_env, torchrun

TINY = [
    "--preset", "tiny", "--set", "model.block_size=32", "--set", "batch.micro_batch_size=2",
    "--set", "schedule.warmup_steps=1", "--set", "logging.sample_tokens=0", "--set", "logging.eval_batches=1",
    "--set", "checkpoint.interval=2", "--set", "checkpoint.keep_last=5",
]  # fmt: skip


def train_args(data: Path, run_dir: Path, steps: int) -> list[str]:
    return [
        "train", *TINY, f"--set=data.corpus={TINY_SHAKESPEARE}", f"--set=data.dataset_dir={data}",
        f"--set=logging.run_dir={run_dir}", f"--set=schedule.max_steps={steps}",
    ]  # fmt: skip


def one_error(done: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The command failed with exit 2 and one message (no traceback) holding every needle."""
    err = done.stderr
    assert done.returncode == 2, done.stdout[-2000:] + err[-3000:]
    assert "Traceback" not in err and "error: " in err, err[-3000:]
    for needle in needles:
        assert needle in err, err[-3000:]
    return err


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def small_run(char_dataset, tmp_path_factory) -> Path:
    """One single-process run of the tiny model: checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("safety") / "run"
    done = cli(*train_args(char_dataset, run_dir, 4))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------------------------
# Output directories


def test_export_never_replaces_what_it_did_not_write(small_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    before = tree(run)
    newest = run / "checkpoints" / "step_00000004"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me too")
    for out, needle in [
        (run, "is the export's source"),
        (tmp_path, "holds the export's source"),
        (newest / "x", "is inside"),
        (mine, "holds files that are not a previous export (notes.txt)"),
        (a_file, "exists and is not a directory"),
    ]:
        one_error(cli("export", str(run), "--out", str(out)), needle)
    assert tree(run) == before
    assert (mine / "notes.txt").read_text() == "keep me" and a_file.read_text() == "keep me too"

    # New, then a previous export: replaced whole; an empty directory is taken too.
    out = tmp_path / "export"
    for _ in range(2):
        done = cli("export", str(run), "--out", str(out))
        assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("export", str(run), "--out", str(empty)).returncode == 0
    assert tree(run) == before


def test_render_launch_env_and_plot_keep_foreign_files(small_run, tmp_path):
    foreign = tmp_path / "zero2.json"
    foreign.write_text('{"train_batch_size": 8}\n')
    one_error(
        cli("render", "--all", "--out-dir", str(tmp_path)), "zero2.json not written by `pretrain render`"
    )
    assert foreign.read_text() == '{"train_batch_size": 8}\n'
    fresh = tmp_path / "fresh"
    assert cli("render", "--all", "--out-dir", str(fresh)).returncode == 0
    assert cli("render", "--all", "--out-dir", str(fresh)).returncode == 0  # its own files: rewritten

    env = tmp_path / ".deepspeed_env"
    env.write_text("WANDB_API_KEY=secret\n")
    one_error(cli("launch-env", "--output", str(env)), "WANDB_API_KEY")
    assert env.read_text() == "WANDB_API_KEY=secret\n"
    mine = tmp_path / "mine.env"
    assert cli("launch-env", "--output", str(mine)).returncode == 0
    assert cli("launch-env", "--output", str(mine)).returncode == 0  # a previous output: rewritten

    cfg = tmp_path / "config.yaml"
    cfg.write_text("model: {}\n")
    one_error(cli("plot", str(small_run), "--out", str(cfg)), "exists and is not a PNG")
    assert cfg.read_text() == "model: {}\n"


# ---------------------------------------------------------------------------------------------
# Reading checkpoints


def test_every_reader_verifies_and_says_what_it_skips(small_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    newest = run / "checkpoints" / "step_00000004"
    corrupt(newest / "mp_rank_00_model_states.pt")

    # Given the run dir: the damaged newest checkpoint is skipped, and said so.
    out = tmp_path / "export"
    done = cli("export", str(run), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"checkpoint {newest} is invalid, skipped" in done.stderr and "blake3 differs" in done.stderr
    assert "(step 2," in done.stdout
    sample = cli("sample", str(run), "--max-new-tokens", "4")
    assert sample.returncode == 0 and f"checkpoint {newest} is invalid, skipped" in sample.stderr

    # Named directly: refused, never garbage weights.
    for argv in (["export", str(newest), "--out", str(tmp_path / "x")], ["sample", str(newest)]):
        one_error(cli(*argv), "invalid checkpoint", "blake3 differs")
    assert not (tmp_path / "x").exists()

    # A `latest` of binary bytes, a path that is not there, a file.
    (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00garbage")
    done = cli("sample", str(run), "--max-new-tokens", "2")
    assert done.returncode == 0 and "names no checkpoint here" in done.stderr, done.stderr[-2000:]
    one_error(cli("sample", str(tmp_path / "nowhere")), "no such file or directory")
    one_error(cli("export", str(run / "config.yaml"), "--out", str(out)), "not a directory")
    one_error(cli("sample", str(tmp_path)), "no checkpoint here")


def test_resume_reports_the_skipped_checkpoint(small_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    corrupt(run / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt")
    ckpt_dir = run / "checkpoints"
    notes: list[str] = []
    found = resume.find(ckpt_dir, "auto", layout=Layout(), checksums=True, group=None, report=notes.append)
    assert found is not None and found.step == 2
    assert any("step_00000004 is invalid, skipped" in n for n in notes)
    # --resume naming a run dir takes its newest valid checkpoint, as the other readers do.
    found = resume.find(ckpt_dir, str(run), layout=Layout(), checksums=True, group=None, report=notes.append)
    assert found is not None and found.step == 2


def test_a_crafted_pickle_is_refused_with_one_message(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    path = tmp_path / "mp_rank_00_model_states.pt"
    with path.open("wb") as f:
        pickle.dump({"module": Evil()}, f, protocol=2)
    with pytest.raises(CheckpointError, match="refused to load a checkpoint file"):
        checkpoint.load_file(path)
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------------------------------------
# One run per run dir


def test_a_second_run_in_a_run_dir_is_refused_and_kill_9_leaves_no_stale_lock(char_dataset, tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(
        [str(BIN / "pretrain"), *train_args(char_dataset, run_dir, 100000)],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.csv").is_file():  # the first run holds the lock by now
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.5)
        second = cli(*train_args(char_dataset, run_dir, 4))
        one_error(
            second, f"run dir {run_dir} is in use by another run", f"pid {first.pid}", "logging.run_dir"
        )
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # The lock died with its holder: a new run (resuming what the first one saved, if anything) runs.
    third = cli(*train_args(char_dataset, run_dir, 4), "--resume")
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-3000:]


def test_a_foreign_run_dir_is_never_overwritten(char_dataset, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my own notes\n")
    one_error(cli(*train_args(char_dataset, mine, 2)), "holds config.yaml but no run's record")
    assert (mine / "config.yaml").read_text() == "my own notes\n"
    (tmp_path / "a_file").write_text("x")
    one_error(
        cli(*train_args(char_dataset, tmp_path / "a_file" / "run", 2)),
        f"{tmp_path / 'a_file'} is a file, not a directory",
    )


# ---------------------------------------------------------------------------------------------
# Warnings and clean errors on the way in


def test_resume_with_another_schedule_says_the_lr_jumps(small_run, tmp_path, char_dataset):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    done = cli(*train_args(char_dataset, run, 8), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "this resume changes the learning-rate schedule (schedule.max_steps: 4 -> 8)" in done.stdout
    assert "at step 4 the LR jumps from" in done.stdout


# Dynamic loss scaling from 2**4, doubled after each clean step: a scaler that did not resume shows.
FP16 = ["precision.fp16=true", "precision.initial_scale_power=4", "precision.loss_scale_window=1",
        "schedule.max_steps=4", "checkpoint.interval=2"]  # fmt: skip


def fp16_supported() -> bool:
    """What DeepSpeed's accelerator says of fp16 in a fresh process with this environment (oneDNN
    reads its ISA cap once, at its first use)."""
    ask = "from deepspeed.accelerator import get_accelerator as g; print(bool(g().is_fp16_supported()))"
    done = subprocess.run(
        [sys.executable, "-c", ask], env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1] == "True"  # DeepSpeed's own log lines come first


# "": the CPU as it is. AVX512_CORE_BF16: oneDNN capped below its fp16 kernels (AVX512_CORE_FP16), so
# that DeepSpeed's CPU accelerator, which asks oneDNN, reports no fp16 on an x86 CPU that has it.
@pytest.mark.parametrize("isa", ["", "AVX512_CORE_BF16"], ids=["as-is", "onednn-below-fp16"])
def test_fp16_on_the_cpu_follows_the_accelerator(char_dataset, tmp_path, monkeypatch, isa):
    """fp16 on the CPU is what DeepSpeed's CPU accelerator says: where it has fp16 (AVX-512 FP16, AMX-FP16),
    fp16 trains with dynamic loss scaling and resumes bit for bit; where not, one line refuses it.
    The test asserted the refusal on every CPU, and failed on a Sapphire Rapids, where fp16 trains."""
    if isa:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)  # the runs below inherit it (subprocess_env)
    if not fp16_supported():
        done = cli(*train_args(char_dataset, tmp_path / "run", 2), "--set=precision.fp16=true")
        one_error(
            done,
            "precision.fp16: DeepSpeed's cpu accelerator on this machine does not support fp16; "
            "use bf16 or fp32 here (e.g. --set precision.fp16=false)",
        )
        return
    jobs = [
        {"name": "full", "run": "full", "overrides": FP16},
        # saves after step 3 and stops; the resume trains step 4
        {"name": "stop", "run": "res", "overrides": FP16, "env": {"PRETRAIN_FAULT_SIGTERM": "0:2"}},
        {"name": "resume", "run": "res", "overrides": FP16, "resume": "auto"},
    ]
    res = torchrun(1, 0, char_dataset, tmp_path, jobs)
    full, stop, resume = res["full"], res["stop"], res["resume"]
    assert stop["final_step"] == 3 and resume["start_step"] == 3 and full["final_step"] == 4
    assert {**stop["losses"], **resume["losses"]} == full["losses"], (stop, resume, full)  # bit for bit

    def scales(run: str) -> dict[str, str]:
        rows = csv.DictReader((tmp_path / run / "metrics.csv").open())
        return {row["step"]: row["loss_scale"] for row in rows if row["loss"]}  # train rows, not eval's

    assert scales("full") == scales("res") == {"1": "16", "2": "32", "3": "64", "4": "128"}


def test_sample_device_that_is_not_there(small_run):
    one_error(cli("sample", str(small_run), "--device", "nonsense"), "--device 'nonsense': not usable here")
    if not torch.cuda.is_available():
        one_error(cli("sample", str(small_run), "--device", "cuda"), "try --device cpu")


def test_token_ids_beyond_the_vocabulary_are_a_data_error(tmp_path):
    from pretrain.data.loader import ShardedLoader
    from pretrain.data.shards import ShardWriter

    w = ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=1 << 20)
    w.write(np.arange(200, dtype=np.uint16) % 70, [200])  # ids up to 69, "vocab" 65
    w.close()
    paths = sorted(tmp_path.glob("*.bin"))

    def unverified(vocab_size: int) -> ShardedLoader:
        return ShardedLoader(
            paths, block_size=16, micro_batch_size=2, grad_accum=1, rank=0, world_size=1, seed=0,
            verify=False, vocab_size=vocab_size,
        )  # fmt: skip

    loader = unverified(65)
    with pytest.raises(DataError, match="at or beyond the vocabulary"):
        for _ in range(20):
            loader.next_batch()
    ok = unverified(70)
    for _ in range(20):
        ok.next_batch()


def test_hostfile_slot_typos(tmp_path):
    for text, needle in [
        ("localhost slots=1 slots=2\n", "slots given twice"),
        ("localhost slots=" + "9" * 5000 + "\n", "at most 1024"),
    ]:
        (tmp_path / "h").write_text(text)
        err = one_error(cli("hostfile", str(tmp_path / "h")), needle)
        assert len(err) < 1000


def test_a_valid_hostfile_gets_a_verdict_and_stdout_stays_a_hostfile(tmp_path):
    (tmp_path / "h").write_text("node-01 slots=8  # the first\nnode-02 slots=8\n")
    done = cli("hostfile", str(tmp_path / "h"))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "node-01 slots=8\nnode-02 slots=8\n"
    assert done.stderr.strip() == f"{tmp_path / 'h'}: 2 hosts, 16 slots, valid"


def test_run_record_is_json(small_run):
    assert json.loads((small_run / "versions.json").read_text())["argv"]
    assert (small_run / ".lock").read_text().startswith("host ")


def test_preflight_checks_the_resume_checkpoint_and_the_run_dir_lock(small_run, tmp_path, char_dataset):
    from pretrain.training import rundir

    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    corrupt(run / "checkpoints" / "step_00000004" / "mp_rank_00_model_states.pt")
    (tmp_path / "hosts").write_text("localhost slots=1\n")
    args = ["preflight", "--hostfile", str(tmp_path / "hosts"), "--no-ssh", "--no-allreduce"]
    args += train_args(char_dataset, run, 4)[1:]
    done = cli(*args, "--resume")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "resumes step_00000002" in done.stdout and "step_00000004 is invalid, skipped" in done.stdout

    lock = rundir.claim(run, run / "checkpoints")  # this process holds the run dir now
    try:
        done = cli(*args)
        assert done.returncode == 1 and f"is in use by another run (host {os.uname().nodename}" in done.stdout
    finally:
        lock.release()


def test_a_new_run_never_mixes_with_an_earlier_runs_checkpoints(small_run, tmp_path, char_dataset):
    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    before = tree(run / "checkpoints")
    one_error(cli(*train_args(char_dataset, run, 4)), "holds the checkpoints of an earlier run", "--resume")
    assert tree(run / "checkpoints") == before


# ---------------------------------------------------------------------------------------------
# Resumes and checkpoint dirs that used to lose or mix checkpoints: two runs sharing one
# `checkpoint.dir`, a resume from an older checkpoint beside newer ones, `--resume auto` past a
# corrupt newest one (which retention then favoured over the valid one), and a resume of another
# run's checkpoint into a run dir with checkpoints of its own.

STEP_2, STEP_4 = "step_00000002", "step_00000004"


def copy_run(small_run: Path, to: Path) -> Path:
    shutil.copytree(small_run, to)
    (to / ".lock").unlink(missing_ok=True)
    return to


def test_two_runs_with_one_checkpoint_dir_are_refused(char_dataset, tmp_path):
    shared = tmp_path / "shared_checkpoints"
    first = subprocess.Popen(
        [
            str(BIN / "pretrain"),
            *train_args(char_dataset, tmp_path / "a", 100000),
            f"--set=checkpoint.dir={shared}",
        ],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "a" / "metrics.csv").is_file():  # the first run holds its locks by now
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not start"
            time.sleep(0.5)
        second = cli(*train_args(char_dataset, tmp_path / "b", 4), f"--set=checkpoint.dir={shared}")
        one_error(second, f"checkpoint dir {shared} is in use by another run", "set checkpoint.dir")
        assert not (tmp_path / "b" / "metrics.csv").exists()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    assert not any(p.name.startswith(".lock") for p in shared.iterdir())  # the lock added no file


def test_resuming_an_older_checkpoint_beside_newer_ones_is_refused(small_run, char_dataset, tmp_path):
    run = copy_run(small_run, tmp_path / "run")
    before = tree(run / "checkpoints")
    done = cli(*train_args(char_dataset, run, 8), "--resume", str(run / "checkpoints" / STEP_2))
    one_error(
        done, f"holds newer checkpoints ({STEP_4})", "move it out of", "logging.run_dir to a new directory"
    )
    assert tree(run / "checkpoints") == before


def test_resume_auto_past_a_corrupt_newest_keeps_it_aside(small_run, char_dataset, tmp_path):
    run = copy_run(small_run, tmp_path / "run")
    ck = run / "checkpoints"
    corrupt(ck / STEP_4 / "mp_rank_00_model_states.pt")
    damaged = tree(ck / STEP_4)
    done = cli(*train_args(char_dataset, run, 6), "--set=checkpoint.keep_last=1", "--resume")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert f"{ck / STEP_4} is invalid: kept aside as {STEP_4}.invalid" in out
    assert tree(ck / f"{STEP_4}.invalid") == damaged  # kept as it was, past retention and the new save
    assert checkpoint.committed_tags(ck)[0] == ["step_00000006"]  # keep_last 1: the newest valid one
    assert checkpoint.verify(ck / "step_00000006") == []


def test_resuming_another_runs_checkpoint_into_a_run_with_its_own_is_refused(
    small_run, char_dataset, tmp_path
):
    mine = copy_run(small_run, tmp_path / "mine")
    other = copy_run(small_run, tmp_path / "other")
    before = tree(mine)
    done = cli(*train_args(char_dataset, mine, 8), "--resume", str(other / "checkpoints" / STEP_4))
    one_error(done, "that checkpoint is another run's", f"set logging.run_dir to {other}")
    after = tree(mine)
    assert after.pop(".lock").startswith(b"host ")  # the lock file names its last holder
    assert after == before  # the record, the metrics and the checkpoints as they were
    # into a new run dir it is a branch, and runs
    branch = cli(
        *train_args(char_dataset, tmp_path / "branch", 6), "--resume", str(other / "checkpoints" / STEP_4)
    )
    assert branch.returncode == 0, branch.stdout[-2000:] + branch.stderr[-3000:]
    assert checkpoint.committed_tags(tmp_path / "branch" / "checkpoints")[0] == ["step_00000006"]


@pytest.mark.parametrize("name", [STEP_2])
def test_resuming_the_newest_checkpoint_by_name_still_runs(small_run, char_dataset, tmp_path, name):
    run = copy_run(small_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / STEP_4)
    (run / "checkpoints" / "latest").write_text(f"{name}\n")
    done = cli(*train_args(char_dataset, run, 4), "--resume", str(run / "checkpoints" / name))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def test_a_checkpoints_meta_is_validated_and_sealed(small_run, char_dataset, tmp_path):
    """`"step": "abc"` in the newest checkpoint's meta crashed `--resume auto` (no fallback), and a bad
    config.model crashed export and sample: the meta is sealed at save (meta_sha256) and its fields
    are checked on read, so it is one more invalid checkpoint, passed over or refused with why."""
    import json

    run = copy_run(small_run, tmp_path / "run")
    meta_file = run / "checkpoints" / STEP_4 / checkpoint.META
    meta = json.loads(meta_file.read_text())
    assert len(meta["meta_sha256"]) == 64  # sealed at save
    meta_file.write_text(json.dumps({**meta, "step": "abc"}))
    problems = checkpoint.verify(run / "checkpoints" / STEP_4)
    assert "'step' is 'abc', not a whole number" in "\n".join(problems)
    assert "its content differs from the one written at save" in "\n".join(problems)
    # an older checkpoint has no seal: the fields are still checked
    unsealed = {k: v for k, v in meta.items() if k != "meta_sha256"}
    meta_file.write_text(json.dumps({**unsealed, "config": {**meta["config"], "model": {"n_layer": "many"}}}))
    assert any("config.model.n_layer" in p for p in checkpoint.verify(run / "checkpoints" / STEP_4))
    for command in (["export", str(run / "checkpoints" / STEP_4), "--out", str(tmp_path / "out")],
                    ["sample", str(run / "checkpoints" / STEP_4), "--max-new-tokens", "2"]):  # fmt: skip
        one_error(
            cli(*command), f"{run / 'checkpoints' / STEP_4}: invalid checkpoint", "config.model.n_layer"
        )
    resumed = cli(*train_args(char_dataset, run, 5), "--resume")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"{run / 'checkpoints' / STEP_4} is invalid, skipped" in resumed.stdout + resumed.stderr
    assert "Traceback" not in resumed.stderr


def test_resume_in_another_precision_or_from_zero_0_at_zero_2_is_refused_with_the_fix(
    small_run, char_dataset, tmp_path
):
    """An fp32 checkpoint resumed in bf16 died with `KeyError: 'dynamic_loss_scale'` inside DeepSpeed;
    a ZeRO-0 one at ZeRO-2 was told to convert, and convert said there was nothing to convert."""
    run = copy_run(small_run, tmp_path / "run")
    one_error(
        cli(
            *train_args(char_dataset, run, 6),
            "--resume",
            "--set=precision.bf16=true",
            "--set=precision.grad_accum_dtype=bf16",  # at zero.stage 0, DeepSpeed's only bf16 sums
        ),
        "precision: the checkpoint was trained in fp32, this run is bf16",
        "--set precision.bf16=false precision.fp16=false",
    )
    one_error(
        cli(*train_args(char_dataset, run, 6), "--resume", "--set=zero.stage=2"),
        "only at ZeRO-0",
        "resume with --set zero.stage=0",
    )


def test_a_second_ctrl_c_in_train_is_one_line_not_a_traceback(char_dataset, tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        # steps of several seconds: the second Ctrl-C, a person's (more than a second after the first,
        # StopOnSignal.SAME_REQUEST_S), comes before the step the first one stops after has ended
        [
            str(BIN / "pretrain"),
            *train_args(char_dataset, run_dir, 100000),
            "--set=model.n_embd=256",
            "--set=model.n_layer=4",
            "--set=model.block_size=128",
            "--set=batch.micro_batch_size=8",
            "--set=batch.gradient_accumulation_steps=16",
        ],
        cwd=ROOT,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (run_dir / "metrics.csv").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)  # the first asks for a save and a stop ...
    time.sleep(1.5)  # (within a second it would be the same request, as a launcher's repeat is)
    proc.send_signal(signal.SIGINT)  # ... the second stops at once
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, out[-2000:] + err[-3000:]
    assert "interrupted (Ctrl-C): stopped at once, without saving" in err and "Traceback" not in err, (
        out[-3000:] + err[-3000:]
    )


def test_a_signal_repeated_within_a_second_is_the_same_request():
    """The real handler, real signals to this process: a Ctrl-C, then within a second the SIGINT a
    launcher passes on and the SIGTERM DeepSpeed's launcher sends, ask for one save and stop; a
    second Ctrl-C later than that (a person's) interrupts at once."""
    from pretrain.training.guards import StopOnSignal

    def steps(seconds: float) -> None:  # a loop's short steps: the main thread meets its handlers
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.02)

    stop = StopOnSignal().install()
    try:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C, handled ...
            steps(0.05)
            assert stop.signum == signal.SIGINT
            os.kill(os.getpid(), signal.SIGINT)  # ... before the launchers' repeats come
            os.kill(os.getpid(), signal.SIGTERM)
            steps(StopOnSignal.SAME_REQUEST_S + 0.5)  # an interrupt coming would have come
        except KeyboardInterrupt:
            pytest.fail("a signal repeated within a second interrupted at once")
        assert stop.signum == signal.SIGINT  # the first's
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            steps(5)
    finally:
        stop.uninstall()


@pytest.mark.distributed
def test_ctrl_c_on_the_deepspeed_launcher_saves_though_the_signal_comes_again(char_dataset, tmp_path):
    """Ctrl-C on the README's `deepspeed --num_gpus 2 pretrain/main.py` (2 CPU ranks, gloo): the
    terminal's SIGINT reaches the launchers and every rank, DeepSpeed's launch.py then sends each
    rank SIGTERM (psutil's terminate, rank by rank), and a launcher that passes the Ctrl-C on sends a
    second SIGINT moments later (here the test, 50 ms later). One request: every rank saves the step
    it stops at. The repeat had stopped the ranks at once, without saving."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = tmp_path / "run"
    endless = ["schedule.max_steps=1000000", "checkpoint.interval=1000000", "logging.eval_interval=1000000"]
    proc = subprocess.Popen(
        [
            str(BIN / "deepspeed"), "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(ROOT / "pretrain" / "main.py"), "--ds", str(ROOT / "ds_configs" / "cpu_zero2.json"), *TINY,
            *(f"--set={s}" for s in endless), f"--set=data.corpus={TINY_SHAKESPEARE}",
            f"--set=data.dataset_dir={char_dataset}", f"--set=logging.run_dir={run}",
        ],
        cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # a terminal's job: the Ctrl-C goes to its process group
    )  # fmt: skip
    try:
        metrics = run / "metrics.csv"
        deadline = time.monotonic() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) > 3):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # the same Ctrl-C, passed on
        out = proc.communicate(timeout=180)[0]  # to the end of the output: the ranks outlive the runner
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tags, _ = checkpoint.committed_tags(run / "checkpoints")
    assert tags and "stopped at once" not in out, out[-4000:]
    said = f"stopped by SIGINT at step {checkpoint.step_of(tags[-1])}; resume with --resume auto"
    assert said in out, out[-4000:]
    assert checkpoint.verify(run / "checkpoints" / tags[-1]) == []


def test_max_restarts_does_not_retry_a_refused_run(small_run, char_dataset, tmp_path):
    """`train --max-restarts` on a finished run: the first attempt was refused (an earlier run's
    checkpoints), and the restart then resumed that run as if it had failed."""
    run = copy_run(small_run, tmp_path / "run")
    before = tree(run / "checkpoints")
    done = cli(*train_args(char_dataset, run, 4), "--nproc-per-node", "1", "--max-restarts", "2")
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert "holds the checkpoints of an earlier run" in out and "not restarting" in out, out[-3000:]
    assert "attempt 2 of 3" not in out
    assert tree(run / "checkpoints") == before


def test_a_resume_says_when_the_global_batch_or_the_seed_changes(small_run, char_dataset, tmp_path):
    run = copy_run(small_run, tmp_path / "run")
    done = cli(
        *train_args(char_dataset, run, 5), "--resume", "--set=batch.micro_batch_size=4", "--set=seed=7"
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "changes the global batch from 2 to 4 sequences a step" in out
    assert "seed: the checkpoint was trained with 1337, this run has 7" in out


def test_the_bf16_advice_is_given_only_where_it_was_measured_to_pay(char_dataset, tmp_path):
    """At n_embd 128 bf16 ran slower than fp32 on a CPU with bf16 matmuls (94 s against 71): the
    advice that it trains faster is for widths where it was measured to (n_embd 384 and up)."""
    from pretrain.cluster.hardware import cpu_native_bf16

    small = cli(*train_args(char_dataset, tmp_path / "small", 2), "--set=model.n_embd=128")
    wide = cli(
        *train_args(char_dataset, tmp_path / "wide", 2), "--set=model.n_embd=384", "--set=model.n_head=6"
    )
    assert small.returncode == 0 and wide.returncode == 0, small.stderr[-2000:] + wide.stderr[-2000:]
    assert "multiplies bf16 natively" not in small.stdout + small.stderr
    assert ("multiplies bf16 natively" in wide.stdout + wide.stderr) == (cpu_native_bf16() is not None)


def test_a_resume_sets_aside_the_rows_an_abandoned_attempt_logged(small_run, char_dataset, tmp_path):
    """Killed after step 4 with its newest checkpoint at step 2, a run's metrics.csv kept steps 3 and
    4 twice once resumed: the dead attempt's rows are moved to metrics.abandoned.csv."""
    run = copy_run(small_run, tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / STEP_4)
    (run / "checkpoints" / "latest").write_text(f"{STEP_2}\n")
    dead = [r for r in csv.DictReader((run / "metrics.csv").open()) if int(r["step"]) > 2]
    assert dead
    done = cli(*train_args(char_dataset, run, 4), "--resume")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "after step 2, of an attempt that stopped before its next checkpoint, moved to" in done.stdout
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert len([r for r in rows if int(r["step"]) > 2]) == len(dead)  # the resumed run's own, once
    aside = list(csv.DictReader((run / "metrics.abandoned.csv").open()))
    assert [r["step"] for r in aside] == [r["step"] for r in dead] and aside[0]["loss"] == dead[0]["loss"]


def test_a_stale_op_build_lock_is_one_line_and_a_live_build_a_named_wait(char_dataset, tmp_path):
    """torch's JIT build of DeepSpeed's cpu_adam (optimizer offload) waits, silently and forever, on the
    `lock` file a build killed mid-way leaves behind. A real offload start, against an extensions
    directory of the test's own: a lock no process holds is one error naming it and the fix, in
    seconds; a lock a live process holds is a wait that names it; when that process dies leaving the
    lock, with a compiler of its build still running there, the error names that compiler too."""
    ext = tmp_path / "extensions"
    build = ext / "cpu_adam"
    build.mkdir(parents=True)
    lock = build / "lock"
    lock.touch()
    offload = ["--set=zero.stage=2", "--set=zero.offload_optimizer=true"]
    env = {"TORCH_EXTENSIONS_DIR": str(ext)}
    t0 = time.monotonic()
    done = cli(*train_args(char_dataset, tmp_path / "run", 2), *offload, env=env, timeout=180)
    err = one_error(
        done, f"{lock} is a stale lock of DeepSpeed's cpu_adam op build", f"(rm -r {build}) and start again"
    )
    assert [line for line in err.splitlines() if line.strip()] == [err.strip()], err
    assert time.monotonic() - t0 < 90
    assert [p.name for p in build.iterdir()] == ["lock"]  # the lock is the person's to remove; nothing built

    lock.unlink()  # a live build: a process holds the lock open, as torch's FileBaton does while it builds
    take = "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); time.sleep(600)"
    holder = subprocess.Popen([sys.executable, "-c", take, str(lock)], stdout=subprocess.PIPE, text=True)
    compiler = subprocess.Popen(["sleep", "600"], cwd=build)  # what ninja started: its own process group
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        run = subprocess.Popen(
            [str(BIN / "pretrain"), *train_args(char_dataset, tmp_path / "run2", 2), *offload],
            cwd=ROOT, env=subprocess_env(**env), stdout=out, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        deadline = time.monotonic() + 120
        while "waiting for DeepSpeed's cpu_adam op" not in log.read_text():
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.5)
        waiting = log.read_text()
        assert f"pid {holder.pid} (" in waiting and f"holds {lock}" in waiting, waiting
        time.sleep(2)
        assert run.poll() is None  # still waiting on the build
        holder.kill()
        holder.wait()
        _, err = run.communicate(timeout=60)
        assert run.returncode == 2 and "Traceback" not in err, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and f"{lock} is a stale lock" in errors[0], err[-3000:]
        assert f"pid {compiler.pid} (sleep)" in errors[0] and f"kill {compiler.pid}), then" in errors[0]
    finally:
        for p in (run, holder, compiler):
            if p.poll() is None:
                p.kill()
                p.wait()
