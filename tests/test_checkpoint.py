"""Checkpoints: atomic saves, validation and fallback, exact resume, world-size change, export,
sampling and faults (kill -9, NaN, full disk), with real processes and the real DeepSpeed engine.

The multi-rank scenarios run as a few torchrun jobs (tests/ckpt_worker.py), each training several
configs in one process group; the tests below read what they left behind.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain import checkpoint, guards
from pretrain.config import CheckpointConfig
from tests.conftest import ROOT, TINY_SHAKESPEARE, subprocess_env

CORPUS = f"--set=data.corpus={TINY_SHAKESPEARE}"  # what char_dataset was prepared from

BIN = Path(sys.executable).parent


def torchrun(nproc: int, port: int, data: Path, out: Path, jobs: list[dict], timeout: int = 600) -> dict:
    jobs_file = out / f"jobs{nproc}.json"
    jobs_file.write_text(json.dumps(jobs))
    launcher = [
        "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1", "--master_port", str(port),
    ] if nproc > 1 else []  # fmt: skip
    cmd = [
        sys.executable,
        *launcher,
        str(ROOT / "tests" / "ckpt_worker.py"),
        str(data),
        str(out),
        str(jobs_file),
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return dict(json.loads((out / f"jobs{nproc}.results.json").read_text()), _stdout=proc.stdout)


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "pretrain"), *args],
        cwd=ROOT,
        env=subprocess_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Checkpoints at 3, 6 and 8 (the end), all kept.
DROPOUT = ["model.dropout=0.1", "checkpoint.interval=3", "checkpoint.keep_last=5"]


# test_kill_9_with_supervised_restarts: 12 steps at ZeRO-2, checkpoints every 3.
SUPERVISED = ["model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
              "batch.micro_batch_size=2", "optimizer.lr=3e-3", "schedule.max_steps=12",
              "schedule.warmup_steps=2", "logging.log_interval=1", "logging.eval_interval=6",
              "logging.eval_batches=2", "logging.sample_tokens=0", "zero.stage=2",
              "checkpoint.interval=3"]  # fmt: skip


@pytest.fixture(scope="module")
def two_ranks(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One 2-rank job: uninterrupted and interrupted+resumed runs at ZeRO-2 and ZeRO-3 (with dropout,
    so the RNG states matter), the sources of the world-size change, and NaN injection."""
    out = tmp_path_factory.mktemp("ckpt2")
    stop = {"PRETRAIN_FAULT_SIGTERM": "1:4"}  # rank 1 only; the run saves after step 5 and stops
    jobs = [
        {"name": "z0_full", "run": "z0_full", "overrides": ["zero.stage=0", *DROPOUT]},
        {"name": "z2_full", "run": "z2_full", "overrides": ["zero.stage=2", *DROPOUT]},
        {"name": "z2_stop", "run": "z2_res", "overrides": ["zero.stage=2", *DROPOUT], "env": stop},
        {"name": "z2_resume", "run": "z2_res", "overrides": ["zero.stage=2", *DROPOUT], "resume": "auto"},
        {"name": "z3_full", "run": "z3_full", "overrides": ["zero.stage=3", *DROPOUT]},
        {"name": "z3_stop", "run": "z3_res", "overrides": ["zero.stage=3", *DROPOUT], "env": stop},
        {"name": "z3_resume", "run": "z3_res", "overrides": ["zero.stage=3", *DROPOUT], "resume": "auto"},
        {"name": "ws_z2", "run": "ws_z2", "overrides": ["zero.stage=2", "checkpoint.interval=4"]},
        {"name": "ws_z3", "run": "ws_z3", "overrides": ["zero.stage=3", "checkpoint.interval=4"]},
        *(
            {
                "name": f"nan_z{stage}",
                "run": f"nan_z{stage}",
                "overrides": [f"zero.stage={stage}", "checkpoint.interval=2", "checkpoint.max_bad_steps=2"],
                "env": {"PRETRAIN_FAULT_NAN_STEPS": "3" if stage == 0 else "3,6,7"},
            }
            for stage in (0, 2, 3)
        ),
        {"name": "sup_ref", "run": "sup_ref", "overrides": SUPERVISED},  # test_kill_9_...'s reference
    ]
    return torchrun(2, 29541, char_dataset, out, jobs), out


def ckpt(out: Path, run: str, step: int) -> Path:
    return out / run / "checkpoints" / checkpoint.tag_for(step)


# ---------------------------------------------------------------------------------------------
# Exact resume, and saving on a signal


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_bit_exact_at_zero_2_and_3(two_ranks, stage):
    res, _ = two_ranks
    full, stop, resume = res[f"z{stage}_full"], res[f"z{stage}_stop"], res[f"z{stage}_resume"]
    assert stop["stopped_by"] == "SIGTERM" and stop["final_step"] == 5  # asked after step 4 on rank 1
    assert resume["start_step"] == 5  # from the signal's checkpoint, not the interval's (3)
    joined = {**stop["losses"], **resume["losses"]}
    assert sorted(joined, key=int) == [str(s) for s in range(1, 9)]
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
    # ... and continues exactly as the ZeRO-2 run that skipped the update: the rollback restored
    # the weights, the optimizer and the data position of step 2.
    assert [z0["losses"][str(s)] for s in range(1, 5)] == [z2["losses"][str(s)] for s in range(1, 5)]
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
    checkpoint.convert_to_universal(ckpt(out, "ws_z3", 4))  # the same function, in this process
    for run in ("ws_z2", "ws_z3"):
        uni = ckpt(out, run, 4) / "universal"
        assert checkpoint.verify(uni) == [] and checkpoint.read_meta(uni)["format"] == "universal"
        assert not (ckpt(out, run, 4) / "latest_universal").exists()
    return out


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
# Export and sampling


@pytest.fixture(scope="module")
def exported(two_ranks, tmp_path_factory) -> Path:
    _, out = two_ranks
    dest = tmp_path_factory.mktemp("export") / "z3"
    done = cli("export", str(out / "z3_full"), "--out", str(dest))  # a run dir: its newest checkpoint
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 8" in done.stdout
    return dest


@pytest.mark.distributed
def test_export_consolidates_any_zero_stage(two_ranks, exported, tmp_path):
    from safetensors.torch import load_file

    from pretrain.export import consolidated_state_dict, export

    _, out = two_ranks
    z0 = consolidated_state_dict(ckpt(out, "z0_full", 8))
    z2 = consolidated_state_dict(ckpt(out, "z2_full", 8))
    z3 = load_file(str(exported / "model.safetensors"))
    assert set(z3) == set(z0) - {"lm_head.weight"}  # the tied head is stored once
    for k, v in z3.items():
        # every stage's gathering gives stage 0's weights (to rounding: ZeRO averages gradients
        # in another order)
        assert (z2[k] - z0[k]).abs().max() < 1e-5 and (v - z0[k]).abs().max() < 1e-5, k
        assert v.dtype == torch.float32
    export(ckpt(out, "z2_full", 8), tmp_path / "bf16", dtype="bf16", hf=False)
    bf16 = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, z2[k].bfloat16()) for k, v in bf16.items())
    assert not (tmp_path / "bf16" / "hf").exists()
    info = json.loads((exported / "pretrain.json").read_text())
    assert info["step"] == 8 and info["model"]["n_layer"] == 2


@pytest.mark.distributed
def test_hf_gpt2_dir_gives_our_logits(exported):
    transformers = pytest.importorskip("transformers", reason="transformers is a dev extra")
    from pretrain.export import load_model

    ours, _, _ = load_model(exported)
    hf = transformers.GPT2LMHeadModel.from_pretrained(exported / "hf").eval()
    idx = torch.randint(
        0, ours.cfg.vocab_size or 2, (3, ours.cfg.block_size), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        logits, _ = ours(idx, idx)  # with targets: logits at every position
        theirs = hf(idx).logits
    diff = (logits - theirs).abs().max().item()
    print(f"max |logit difference| vs GPT2LMHeadModel: {diff:.1e}")
    assert diff < 1e-5


@pytest.mark.distributed
def test_sample_from_an_export_and_from_a_checkpoint(two_ranks, exported):
    _, out = two_ranks
    args = [
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "40",
        "--temperature",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "7",
    ]
    a = cli("sample", str(exported), *args)
    assert a.returncode == 0, a.stderr[-3000:]
    assert a.stdout.startswith("ROMEO:") and len(a.stdout.strip()) >= 40
    from pretrain.export import generate, load_model, tokenizer_for

    model, cfg, where = load_model(ckpt(out, "z3_full", 8))  # consolidated in memory
    text = generate(model, tokenizer_for(where, cfg), "ROMEO:", 40, 0.9, 20, 7)[0]
    assert a.stdout == text + "\n"
    assert generate(model, tokenizer_for(where, cfg), "ROMEO:", 40, 0.9, 20, 8)[0] != text  # another seed


# ---------------------------------------------------------------------------------------------
# kill -9: a supervised run restarts from the newest checkpoint and ends where an uninterrupted
# run ends; a kill during a save leaves the previous checkpoint in charge.


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
        checkpoint.preflight(readonly / "ck", 1000, 2, None)


def test_preflight_names_an_unwritable_dir(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(checkpoint.CheckpointError, match="is not writable: Not a directory"):
        checkpoint.preflight(tmp_path / "file" / "ck", 1000, 2, None)
    with pytest.raises(checkpoint.CheckpointError, match=r"needs about 1000\.0 TB"):
        checkpoint.preflight(tmp_path / "ck", 10**15, 2, None)
    checkpoint.preflight(tmp_path / "ck", 1000, 2, None)
    assert list((tmp_path / "ck").iterdir()) == []  # the probe file is gone


# ---------------------------------------------------------------------------------------------
# Validation, fallback, retention (on real checkpoints from the 2-rank job, copied)


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
    found = checkpoint.find(ck, "auto", 2, 2, True, None, report=reports.append)
    assert found is not None and found.tag == "step_00000003" and found.step == 3
    text = "\n".join(reports)
    assert "step_00000010: newer than `latest` (step_00000008), its save did not finish; ignored" in text
    assert "step_00000008 is invalid, trying the previous one" in text
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: 1000 bytes, expected" in text
    assert "step_00000006 is invalid, trying the previous one" in text
    assert "mp_rank_00_model_states.pt: sha256 differs from the one recorded at save" in text
    # without checksums a flipped byte goes unseen: step 6 is picked
    assert checkpoint.find(ck, "auto", 2, 2, False, None, report=reports.append).tag == "step_00000006"  # type: ignore[union-attr]
    # on another world size, the same checkpoint needs its universal conversion
    with pytest.raises(checkpoint.CheckpointError, match=r"pretrain convert .*step_00000003"):
        checkpoint.find(ck, "auto", 1, 2, True, None, report=reports.append)


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


# ---------------------------------------------------------------------------------------------
# Loading is weights-only


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loads_are_weights_only(two_ranks, converted, tmp_path):
    _, out = two_ranks
    files = [p for run in ("z2_full", "z3_full", "ws_z3") for p in (out / run / "checkpoints").rglob("*.pt")]
    assert any("universal" in str(p) for p in files) and len(files) > 20
    for p in files:
        checkpoint.load_file(p)  # every file DeepSpeed wrote, universal ones included
    evil = tmp_path / "evil.pt"
    torch.save({"x": _Evil()}, evil)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.load_file(evil)
    with checkpoint.safe_loading(), pytest.raises(pickle.UnpicklingError):
        torch.load(evil, weights_only=False)  # what DeepSpeed calls is overridden too
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ


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
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_faults_parse_and_fire_once(tmp_path):
    f = guards.Faults(tmp_path, 8, env={"PRETRAIN_FAULT_NAN_STEPS": "2, 5", "PRETRAIN_FAULT_KILL": "1:7"})
    assert f.nan(8, 0) and f.nan(32, 0) and not f.nan(8, 1) and not f.nan(16, 0)
    (tmp_path / ".fault-kill-1-7").write_text("fired\n")
    f.after_step(7, 1)  # already fired: no kill
    assert f.kill_in_save_hook(3, 0) is None
