"""Metrics: device peaks for MFU, step-phase timing, per-rank summaries, the CSV log, plots; and an
end-to-end run whose TensorBoard events are read back with tensorboard's own reader."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain.cluster.hardware import (
    cpu_fma_peak_tflops,
    cpu_native_bf16,
    cpu_peak_tflops,
    device_peak_tflops,
    gemm_tflops,
    gpu_peak_tflops,
)
from pretrain.plot import plot_run, run_events
from pretrain.training.metrics import (
    FIELDS,
    MetricsLog,
    PhaseTimer,
    RankInterval,
    gather_interval,
    progress_enabled,
    summarize,
)
from tests.conftest import TINY_SHAKESPEARE, subprocess_env

BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    ("name", "precision", "tf32", "peak"),
    [
        ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
        ("NVIDIA A100-PCIE-40GB", "fp32", False, 19.5),
        ("NVIDIA A100-SXM4-40GB", "fp32", True, 156.0),
        ("NVIDIA H100 80GB HBM3", "bf16", False, 989.0),
        ("NVIDIA H100 PCIe", "fp16", False, 756.0),
        ("NVIDIA H200", "bf16", False, 989.0),
        ("NVIDIA H200", "fp32", False, 67.0),
        ("Tesla V100-SXM2-16GB", "fp16", False, None),
    ],
)
def test_gpu_peaks(name, precision, tf32, peak):
    assert gpu_peak_tflops(name, precision, tf32) == peak


def test_cpu_peak_is_probed_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PRETRAIN_CACHE_DIR", str(tmp_path))
    first = cpu_peak_tflops(probe_s=0.05)
    assert 0 < first < 1000
    cache = json.loads((tmp_path / "cpu_peak_flops.json").read_text())
    assert list(cache.values()) == [first]
    assert f"{torch.get_num_threads()} threads" in next(iter(cache))
    assert cpu_peak_tflops(probe_s=0.05) == first  # from the cache, not a second probe


def test_cpu_peak_probe_leaves_the_global_rng_alone(tmp_path, monkeypatch):
    """The first run on a machine probes; its dropout masks must be those of every later run."""
    monkeypatch.setenv("PRETRAIN_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    cpu_peak_tflops(probe_s=0.01)  # a cache miss: it multiplies random matrices
    assert torch.equal(torch.rand(3), want)


def test_phase_timer_sums_each_phase_on_the_cpu():
    timer = PhaseTimer(torch.device("cpu"))
    a = torch.randn(200, 200)
    for _ in range(3):
        timer.phase("data")
        a = a @ a.T / 200
        timer.phase("fwd_bwd")
        a = a @ a.T / 200
        timer.phase("optimizer")
        timer.stop()
    totals = timer.totals()
    assert set(totals) == {"data", "fwd_bwd", "optimizer"}
    assert totals["data"] > 0 and totals["fwd_bwd"] > 0 and totals["optimizer"] >= 0
    timer.reset()
    assert timer.totals() == {"data": 0.0, "fwd_bwd": 0.0, "optimizer": 0.0}


def test_gather_interval_without_a_process_group():
    timer = PhaseTimer(torch.device("cpu"))
    ranks = gather_interval(torch.tensor(6.0), timer, 2.0, torch.device("cpu"))
    assert len(ranks) == 1 and ranks[0].loss_sum == 6.0 and ranks[0].interval_s == 2.0
    assert ranks[0].peak_mem_bytes > 10e6  # this process's peak RSS


def test_summarize_two_ranks():
    ranks = [
        RankInterval(
            loss_sum=8.0, interval_s=2.0, data_s=0.2, fwd_bwd_s=1.2, optimizer_s=0.4, peak_mem_bytes=1e9
        ),
        RankInterval(
            loss_sum=4.0, interval_s=1.6, data_s=0.6, fwd_bwd_s=1.0, optimizer_s=0.2, peak_mem_bytes=3e9
        ),
    ]
    # 4 steps x 2 micro steps of 3 sequences of 10 tokens per rank; 1000 FLOPs per token, 1 TFLOP/s peak
    row, per_rank = summarize(ranks, 4, 6, 10, 2, flops_per_token=1000, peak_tflops=1e-6)
    assert row["loss"] == pytest.approx(12.0 / (4 * 2 * 2))
    assert row["step_time_s"] == pytest.approx(0.5)  # the slower rank sets the pace
    assert row["samples_per_s"] == pytest.approx(2 * 6 / 0.5)
    assert row["tokens_per_s"] == pytest.approx(240.0) and row["tokens_per_s_per_rank"] == pytest.approx(
        120.0
    )
    assert row["data_s"] == pytest.approx(0.1) and row["optimizer_s"] == pytest.approx(0.075)
    assert row["peak_mem_gb"] == pytest.approx(3.0)
    assert row["mfu"] == pytest.approx(240 * 1000 / (1e6 * 2))
    assert [r["rank"] for r in per_rank] == [0, 1]
    assert per_rank[1]["tokens_per_s"] == pytest.approx(60 / 0.4) and per_rank[1]["peak_mem_gb"] == 3.0


def test_progress_bar_modes():
    assert progress_enabled(True, io.StringIO()) and not progress_enabled(False, io.StringIO())
    assert not progress_enabled("auto", io.StringIO())  # not a terminal


def test_metrics_log_rewrites_an_older_header_and_prints_one_line_per_row(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,loss,lr\n1,4.0,0.001\n")
    out = io.StringIO()
    log = MetricsLog(tmp_path, max_steps=10, out=out)
    log.log(2, loss=3.5, lr=1e-3, tokens_per_s=1000.0, step_time_s=0.1, data_s=0.01, fwd_bwd_s=0.08, mfu=0.5)
    log.log_ranks(2, [{"rank": 0, "tokens_per_s": 1000.0, "peak_mem_gb": 1.5}])
    log.close()
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == FIELDS
    assert [(r["step"], r["loss"]) for r in rows] == [("1", "4.0"), ("2", "3.5")]
    line = out.getvalue().strip()
    assert "loss 3.5000" in line and "mfu 50.0%" in line and "(data/fwd+bwd/opt 10/80/0)" in line
    assert (tmp_path / "ranks.csv").read_text().splitlines()[1].startswith("2,0,1000")


def test_a_small_mfu_is_shown_to_two_digits_not_as_zero():
    """bf16 on a CPU with AMX: its peak is 30x the fp32 one, and a small model's MFU read 0.0%."""
    from pretrain.training.metrics import percent

    assert [percent(x) for x in (0.0823, 0.01, 0.00043, 0.0)] == ["8.2%", "1.0%", "0.043%", "0.0%"]


def test_plot_writes_a_labelled_png(tmp_path):
    log = MetricsLog(tmp_path, max_steps=100, out=io.StringIO())
    for step in range(10, 101, 10):
        log.log(step, loss=4.0 / step**0.3, lr=1e-3 * (1 - step / 200), tokens_per_s=1000.0 + step)
        if step % 50 == 0:
            log.log(step, val_loss=4.2 / step**0.3, val_ppl=2.0)
    log.close()
    out = plot_run(tmp_path)
    assert out == tmp_path / "metrics.png"
    import matplotlib.image

    img = matplotlib.image.imread(out)
    assert img.shape[0] > 600 and img.shape[1] > 600
    with pytest.raises(Exception, match="no such file"):
        plot_run(tmp_path / "nope")


def test_a_plot_of_one_logged_step_shows_its_points_and_no_val_legend(tmp_path):
    """One metrics row drew three empty panels (a line of one point) and a "val" legend without val."""
    log = MetricsLog(tmp_path, max_steps=100, out=io.StringIO())
    log.log(25, loss=3.9, lr=1e-3, tokens_per_s=1000.0)
    log.close()
    import matplotlib.image
    import numpy as np

    img = matplotlib.image.imread(plot_run(tmp_path))[..., :3]

    def pixels(rgb: tuple[int, int, int]) -> int:
        return int((np.abs(img - np.array(rgb) / 255).max(axis=-1) < 0.08).sum())

    # tab:blue (loss), tab:green (LR), tab:purple (tokens/s) points drawn; no tab:orange (val)
    assert min(pixels(c) for c in ((31, 119, 180), (44, 160, 44), (148, 103, 189))) > 20
    assert pixels((255, 127, 14)) == 0


@pytest.mark.distributed
def test_train_writes_tensorboard_csv_and_a_plot(tmp_path):
    """`pretrain train` with TensorBoard and csv_monitor on; the events read back with tensorboard's
    EventAccumulator; `pretrain plot` draws the run; the bar shows when forced on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    cmd = [
        str(BIN / "pretrain"), "train", f"--set=data.corpus={TINY_SHAKESPEARE}",
        f"--set=data.dataset_dir={tmp_path / 'data'}", f"--set=logging.run_dir={run_dir}",
        "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.block_size=32",
        "--set", "batch.micro_batch_size=4", "--set", "schedule.max_steps=8", "--set", "schedule.warmup_steps=1",
        "--set", "logging.log_interval=2", "--set", "logging.eval_interval=4", "--set", "logging.eval_batches=1",
        "--set", "logging.sample_tokens=0", "--set", "checkpoint.interval=100",
        "--set", "logging.csv_monitor=true", "--set", "logging.progress_bar=true",
    ]  # fmt: skip
    env = subprocess_env(PRETRAIN_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "8/8" in out.stderr and "step/s" in out.stderr  # tqdm's bar, forced on
    assert "MFU against a peak of" in out.stdout
    # DeepSpeed's shared-memory inference op is neither built nor loaded (engine.skip_shm_comm_op)
    assert "shm_comm" not in out.stdout + out.stderr

    with (run_dir / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["loss"]]
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    for key in [
        "grad_norm",
        "tokens_per_s",
        "samples_per_s",
        "mfu",
        "data_s",
        "fwd_bwd_s",
        "optimizer_s",
        "peak_mem_gb",
    ]:
        assert all(float(r[key]) > 0 for r in rows), key
    assert rows[0]["loss_scale"] == ""  # fp32: no loss scale
    ranks = list(csv.DictReader((run_dir / "ranks.csv").open()))
    assert [int(r["rank"]) for r in ranks] == [0, 0, 0, 0]

    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ["Train/train_loss", "Train/lr", "Throughput/tokens_per_s", "Throughput/mfu",
                "Time/fwd_bwd_s", "Memory/peak_gb_max_rank", "Eval/val_loss"]:  # fmt: skip
        assert tag in tags, (tag, tags)
    loss = acc.Scalars("Train/train_loss")
    assert [e.step for e in loss] == [int(r["step"]) for r in rows]  # the optimizer step, as metrics.csv
    assert [e.value for e in loss] == pytest.approx([float(r["loss"]) for r in rows], rel=1e-5)
    # At the log steps, from the run's log: DeepSpeed's own per-step write (a flush each step) is off
    lr = acc.Scalars("Train/lr")
    assert [e.step for e in lr] == [int(r["step"]) for r in rows]
    assert [e.value for e in lr] == pytest.approx([float(r["lr"]) for r in rows], rel=1e-5)
    assert (run_dir / "csv_monitor" / "Train_train_loss.csv").is_file()

    plotted = subprocess.run(
        [str(BIN / "pretrain"), "plot", str(run_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert plotted.returncode == 0, plotted.stderr
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_is_dropped_with_a_note_naming_the_extra_when_not_installed(capsys, monkeypatch):
    from pretrain.training.metrics import available_monitors

    monkeypatch.setitem(sys.modules, "wandb", None)  # as on a machine without the wandb extra
    ds = {"wandb": {"enabled": True, "project": "p"}, "tensorboard": {"enabled": True}, "train_batch_size": 1}
    out = available_monitors(ds)
    assert "wandb" not in out and out["tensorboard"] == {"enabled": True} and "wandb" in ds
    assert (
        "logging.wandb is on but `wandb` is not installed (pip install 'pretrain[wandb]')"
        in capsys.readouterr().out
    )


def test_plot_marks_resumes_and_world_size_changes(tmp_path):
    for start, stop, world in ((0, 40, 2), (30, 70, 2), (60, 100, 1)):  # resumed twice, then on 1 rank
        log = MetricsLog(tmp_path, max_steps=100, out=io.StringIO(), start_step=start, world_size=world)
        for step in range(start + 10, stop + 1, 10):
            log.log(step, loss=4.0 / step**0.3, lr=1e-3, tokens_per_s=1000.0 * world)
        log.close()
    assert run_events(tmp_path) == [(30, "resume at step 30"), (60, "resume at step 60, world size 2 → 1")]
    assert plot_run(tmp_path).read_bytes()[:4] == b"\x89PNG"
    assert [r["world_size"] for r in csv.DictReader((tmp_path / "starts.csv").open())] == ["2", "2", "1"]


def _wandb_records(path: Path) -> list:
    """The records of an offline W&B run file: LevelDB log blocks of protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if (pos % 32768) + 7 > 32768:  # the rest of a block is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            r = pb.Record()
            r.ParseFromString(pending)
            records.append(r)
            pending = b""
    return records


@pytest.mark.distributed
def test_wandb_run_has_the_config_and_name_and_a_resume_continues_it(tmp_path):
    """Two `pretrain train` runs, the second resuming, with W&B on in offline mode: one run id,
    named after the run dir, with the resolved config; DeepSpeed's monitor logs into it."""
    run_dir = tmp_path / "myrun"
    cmd = [
        str(BIN / "pretrain"), "train", f"--set=data.corpus={TINY_SHAKESPEARE}",
        f"--set=data.dataset_dir={tmp_path / 'data'}", f"--set=logging.run_dir={run_dir}",
        "--set", "model.n_layer=1", "--set", "model.n_embd=32", "--set", "model.block_size=32",
        "--set", "batch.micro_batch_size=4", "--set", "schedule.warmup_steps=1",
        "--set", "logging.log_interval=2", "--set", "logging.eval_interval=100", "--set", "logging.sample_tokens=0",
        "--set", "checkpoint.interval=4", "--set", "logging.wandb=true", "--set", "logging.wandb_project=proj",
    ]  # fmt: skip
    env = subprocess_env(
        WANDB_MODE="offline", WANDB_SILENT="true", PRETRAIN_CACHE_DIR=str(tmp_path / "cache")
    )
    for extra in (["--set", "schedule.max_steps=4"], ["--set", "schedule.max_steps=8", "--resume"]):
        out = subprocess.run(
            [*cmd, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2  # the first run, and the resume continuing it
    for i, f in enumerate(files):
        records = _wandb_records(f)
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert run.run_id == run_id and run.display_name == "myrun" and run.project == "proj"
        config = {
            item.key: json.loads(item.value_json)
            for r in records
            if r.WhichOneof("record_type") == "config"
            for item in r.config.update
        }
        assert config["model"]["n_embd"] == 32 and config["schedule"]["max_steps"] == 4 * (i + 1)
        assert config["world_size"] == 1
        steps = [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"]
        # DeepSpeed's monitor logs into it, by optimizer step: the resume goes on from step 4
        assert steps and (min(steps) > 4 if i else max(steps) <= 4)
    assert run_events(run_dir) == [(4, "resume at step 4")]
    # DeepSpeed's own wandb.init set up its logs under the run dir too, not in the working directory
    assert not (tmp_path / "wandb").exists()


def test_cpu_fma_peak_from_cpuinfo():
    info = "processor\t: 0\ncpu MHz\t\t: 2500.000\nflags\t\t: fpu sse2 avx avx2 fma\n"
    assert cpu_fma_peak_tflops(1, info) == pytest.approx(2.5e9 * 32 / 1e12)  # 2 FMA units x 8 lanes x 2
    assert cpu_fma_peak_tflops(1, info.replace("fma", "fma avx512f")) == pytest.approx(2.5e9 * 64 / 1e12)
    assert cpu_fma_peak_tflops(1, "flags: avx2 fma\n") is None  # no clock: unknown
    # 16-bit: twice fp32 with AVX-512 BF16 / FP16 dot products, 2048 FLOPs a cycle with AMX,
    # else the fp32 peak (the CPU computes them in fp32)
    zen4 = info.replace("fma", "fma avx512f avx512_bf16")
    assert cpu_fma_peak_tflops(1, zen4, torch.bfloat16) == pytest.approx(2.5e9 * 128 / 1e12)
    assert cpu_fma_peak_tflops(1, zen4, torch.float16) == pytest.approx(2.5e9 * 64 / 1e12)
    amx = zen4.replace("avx512_bf16", "avx512_bf16 amx_tile amx_bf16")
    cores = min(2, os.cpu_count() or 2)  # two threads count as the cores this machine has, at most
    assert cpu_fma_peak_tflops(2, amx, torch.bfloat16) == pytest.approx(cores * 2.5e9 * 2048 / 1e12)
    assert cpu_fma_peak_tflops(1, info, torch.bfloat16) == pytest.approx(2.5e9 * 32 / 1e12)
    assert cpu_native_bf16(zen4) == "avx512_bf16" and cpu_native_bf16(amx) == "amx_bf16"
    assert cpu_native_bf16(info) is None and cpu_native_bf16("") is None


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_cpu_mfu_peak_is_never_below_the_probe(tmp_path, monkeypatch, precision):
    """MFU on the CPU divides by the larger of the probed GEMM rate and the FMA peak: a probe taken
    on a loaded machine (too low, and cached) can no longer make a run log more than 100%, in fp32,
    bf16 or fp16 (which trains on the CPUs whose accelerator has it), each at this CPU's peak."""
    monkeypatch.setenv("PRETRAIN_CACHE_DIR", str(tmp_path))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    # A probe cached from a loaded machine: far below what this CPU does
    cpu_peak_tflops(dtype, probe_s=0.01)
    cache = tmp_path / "cpu_peak_flops.json"
    cache.write_text(json.dumps({k: 1e-4 for k in json.loads(cache.read_text())}))
    peak, source = device_peak_tflops(torch.device("cpu"), precision)
    fma = cpu_fma_peak_tflops(torch.get_num_threads(), dtype=dtype)
    if fma is None:
        pytest.skip("/proc/cpuinfo gives no clock or flags here")
    assert peak == fma and f"CPU {precision} FMA peak" in source
    # and above what a GEMM in this dtype achieves here
    a = torch.randn(256, 256).to(dtype)
    assert peak >= gemm_tflops(a, a, 0.05, windows=2)
