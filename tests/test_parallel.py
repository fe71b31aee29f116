"""Tensor and pipeline parallelism for real: gloo ranks on the CPU, DeepSpeed's AutoTP and its
pipeline engine, the real loop.

Every layout trains the same small GPT (2 blocks, 2 heads, so a tensor rank holds one head and a
pipeline stage one block) on the same global batch of 4 sequences a step: micro 2 x accumulation 2
on one data-parallel rank, micro 2 x accumulation 1 on two. The data order depends only on the
samples consumed, so every layout sees the same batches, and must give the losses of one rank.

Tolerance: 1e-5 on a loss of about 4. The layouts do the same fp32 arithmetic in another order
(AutoTP's row-parallel all-reduce sums partial products one matmul sums in a single pass; the
pipeline all-reduces the tied embedding's two gradients; two data-parallel ranks average their
gradients), which moves the last bits (1e-7 relative) of a step; 20 Adam steps carry that to
at most 5e-7 here (measured: TP2, PP2, TP2xDP2, PP2xDP2 and the universal resume). A wrong shard, head or batch moves a loss by 1e-2 at
the first step.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.training.checkpoint import store as checkpoint
from tests.conftest import CORPUS, ckpt, cli, torchrun

pytestmark = pytest.mark.distributed

STEPS = 20
TOL = 1e-5
COMMON = [
    f"schedule.max_steps={STEPS}",
    "batch.micro_batch_size=2",
    "zero.stage=1",
    "checkpoint.interval=10",
    "logging.eval_interval=10",
]
ONE_DP = [*COMMON, "batch.gradient_accumulation_steps=2"]  # one data-parallel rank
TWO_DP = [*COMMON, "batch.gradient_accumulation_steps=1"]  # two
TP2, PP2 = "parallel.tensor=2", "parallel.pipeline=2"
# Llama blocks with grouped-query attention (4 query heads, 2 key/value heads: a tensor rank holds
# 2 and 1) and an untied head (a pipeline's last stage holds its own lm_head).
LLAMA = ["model.arch=llama", "model.n_head=4", "model.n_kv_head=2", "model.tie_embeddings=false"]
# NaN losses on the batches of steps 3 and 4: the first step is skipped (ZeRO-1 finds the gradients
# non-finite and does not update), the second, the max_bad_steps-th in a row, rolls back.
NAN = {"PRETRAIN_FAULT_NAN_STEPS": "3,4"}
STOP = {"PRETRAIN_FAULT_SIGTERM": "1:4"}  # rank 1 asks after step 4; every rank saves step 5 and stops
# Dropout, so the generators' states matter to an exact resume; 8 steps, a checkpoint every 3.
NAN_RUN = ["schedule.max_steps=6", "checkpoint.interval=2", "checkpoint.max_bad_steps=2"]
DROPOUT = ["model.dropout=0.1", "schedule.max_steps=8", "checkpoint.interval=3", "checkpoint.keep_last=5"]


def resumed(name: str, run: str, overrides: list[str]) -> list[dict]:
    """An uninterrupted run, and the same run stopped by SIGTERM and resumed."""
    return [
        {"name": f"{name}_full", "run": f"{run}_full", "overrides": overrides},
        {"name": f"{name}_stop", "run": f"{run}_res", "overrides": overrides, "env": STOP},
        {"name": f"{name}_resume", "run": f"{run}_res", "overrides": overrides, "resume": "auto"},
    ]


@pytest.fixture(scope="module")
def one_rank(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("par1")
    jobs = [
        {"name": "single", "run": "single", "overrides": ONE_DP},
        {"name": "single_llama", "run": "single_llama", "overrides": [*ONE_DP, *LLAMA]},
    ]
    return torchrun(1, 0, char_dataset, out, jobs), out


@pytest.fixture(scope="module")
def two_ranks(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("par2")
    jobs = [
        {"name": "tp2", "run": "tp2", "overrides": [*ONE_DP, TP2]},
        {
            "name": "tp2_z0",
            "run": "tp2_z0",
            "overrides": [*ONE_DP, TP2, "zero.stage=0", "schedule.max_steps=4"],
        },
        {"name": "pp2", "run": "pp2", "overrides": [*ONE_DP, PP2]},
        # each stage recomputes its layers' activations in backward (PipelineModule's checkpointing)
        {
            "name": "pp2_ckpt",
            "run": "pp2_ckpt",
            "overrides": [*ONE_DP, PP2, "model.activation_checkpointing=true"],
        },
        {"name": "tp2_llama", "run": "tp2_llama", "overrides": [*ONE_DP, *LLAMA, TP2]},
        {"name": "pp2_llama", "run": "pp2_llama", "overrides": [*ONE_DP, *LLAMA, PP2]},
        *(
            {"name": f"{name}_nan", "run": f"{name}_nan", "env": NAN, "overrides": [*ONE_DP, flag, *NAN_RUN]}
            for name, flag in (("tp2", TP2), ("pp2", PP2))
        ),
        *resumed("tp2d", "tp2d", [*ONE_DP, TP2, *DROPOUT]),
        *resumed("pp2d", "pp2d", [*ONE_DP, PP2, *DROPOUT]),
    ]
    return torchrun(2, 29561, char_dataset, out, jobs, timeout=1200), out


@pytest.fixture(scope="module")
def four_ranks(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("par4")
    jobs = [
        # ZeRO-2 across the two data-parallel ranks: each tensor rank's gradient shards reduce-scattered
        *resumed("tp2dp2", "tp2dp2", [*TWO_DP, TP2, "zero.stage=2"]),
        *resumed("pp2dp2", "pp2dp2", [*TWO_DP, PP2]),
    ]
    return torchrun(4, 29563, char_dataset, out, jobs, timeout=1800), out


def losses(result: dict, first: int = 1) -> list[float]:
    by_step = result["losses"]
    return [by_step[str(s)] for s in range(first, int(max(by_step, key=int)) + 1)]


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert worst < TOL, (worst, got, want)


@pytest.mark.parametrize("name", ["tp2", "pp2", "pp2_ckpt", "tp2_llama", "pp2_llama"])
def test_two_rank_layouts_match_one_rank(one_rank, two_ranks, name):
    single = "single_llama" if name.endswith("llama") else "single"
    assert_close(losses(two_ranks[0][name]), losses(one_rank[0][single]))


def test_tensor_parallel_at_zero_0_logs_the_gradient_norm_of_one_rank(one_rank, two_ranks):
    """DeepSpeed reports no gradient norm at stage 0: the loop takes it, summing the squares of the
    split gradients over the tensor group (TP2's log lines had no gnorm)."""

    def norms(root: Path, run: str) -> list[float]:
        with open(root / run / "metrics.csv") as f:
            return [float(r["grad_norm"]) for r in csv.DictReader(f) if r["grad_norm"]][:4]

    got, want = norms(two_ranks[1], "tp2_z0"), norms(one_rank[1], "single")
    assert len(got) == 4 and got == pytest.approx(want, rel=1e-4), (got, want)


def test_no_gradient_goes_through_a_broadcast(two_ranks):
    """DeepSpeed ties a pipeline's embedding across stages by broadcasting its weight in place; built
    (and loaded from a checkpoint) with autograd on, every backward of the last stage warned that it
    would backprop through c10d::broadcast_. The stages are built and loaded without autograd: the
    broadcast is no part of any graph (the losses above show the tied gradient is the one-rank one)."""
    assert "autograd kernel was not registered" not in two_ranks[0]["_stderr"]


def test_tokens_are_counted_once_per_data_parallel_group(one_rank, two_ranks):
    """Two tensor ranks, or two stages, work on one batch: the samples and tokens of a step are
    its global batch's, not twice it."""
    import csv

    for res, run in ((one_rank, "single"), (two_ranks, "tp2"), (two_ranks, "pp2")):
        with (res[1] / run / "metrics.csv").open() as f:
            rows = [r for r in csv.DictReader(f) if r.get("loss")]
        assert int(float(rows[-1]["tokens_seen"])) == STEPS * 4 * 32, run
        ratio = float(rows[-1]["tokens_per_s"]) / float(rows[-1]["samples_per_s"])
        assert ratio == pytest.approx(32, rel=1e-4), run  # tokens/s and samples/s on one count


def test_nan_losses_are_skipped_then_rolled_back(two_ranks):
    res = two_ranks[0]
    for name in ("tp2_nan", "pp2_nan"):
        got = res[name]
        assert got["skipped_steps"] == [3] and got["rollbacks"] == [2] and got["final_step"] == 6, got
    assert_close(losses(res["tp2_nan"]), losses(res["pp2_nan"]))  # the same batches skipped


@pytest.mark.parametrize("name", ["tp2dp2", "pp2dp2"])
def test_four_rank_layouts_match_one_rank(one_rank, four_ranks, name):
    assert_close(losses(four_ranks[0][f"{name}_full"]), losses(one_rank[0]["single"]))


def check_resume(res: dict, name: str, steps: int) -> None:
    full, stop, resume = res[f"{name}_full"], res[f"{name}_stop"], res[f"{name}_resume"]
    assert stop["stopped_by"] == "SIGTERM" and stop["final_step"] == 5
    assert resume["start_step"] == 5
    joined = {**stop["losses"], **resume["losses"]}
    assert sorted(joined, key=int) == [str(s) for s in range(1, steps + 1)]
    assert joined == full["losses"], (joined, full["losses"])  # bit for bit


@pytest.mark.parametrize("name", ["tp2d", "pp2d"])
def test_resume_is_bit_exact_with_dropout(two_ranks, name):
    check_resume(two_ranks[0], name, 8)


@pytest.mark.parametrize("name", ["tp2dp2", "pp2dp2"])
def test_resume_is_bit_exact_on_four_ranks(four_ranks, name):
    check_resume(four_ranks[0], name, STEPS)


def test_checkpoints_record_the_layout(two_ranks, four_ranks):
    meta = checkpoint.read_meta(ckpt(two_ranks[1], "pp2", 20))
    assert checkpoint.saved_layout(meta).shape == (1, 2)
    files = meta["files"]
    assert "layer_02-model_00-model_states.pt" in files  # a pipeline saves each layer's weights
    meta = checkpoint.read_meta(ckpt(four_ranks[1], "tp2dp2_full", 20))
    assert checkpoint.saved_layout(meta).shape == (2, 1) and meta["world_size"] == 4
    assert {"mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(meta["files"])


@pytest.mark.parametrize("name", ["tp2", "pp2", "tp2_llama", "pp2_llama"])
def test_export_equals_the_single_rank_model(one_rank, two_ranks, tmp_path, name):
    """The exported model of a layout (its shards merged, its stages named back) computes the
    logits of the one-rank run's export: they trained on the same batches to within 1e-6."""
    from pretrain.export import load_model

    def logits(run_dir: Path, dest: Path) -> torch.Tensor:
        done = cli("export", str(run_dir), "--out", str(dest))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert (dest / "hf" / "model.safetensors").is_file()  # the Hugging Face export, from any layout
        model, _, _ = load_model(dest)
        model.eval()
        x = torch.randint(0, 60, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            return model(x, x)[0]

    single = "single_llama" if name.endswith("llama") else "single"
    want = logits(one_rank[1] / single, tmp_path / "single")
    got = logits(two_ranks[1] / name, tmp_path / name)
    assert (got - want).abs().max().item() < TOL


def test_universal_checkpoint_carries_tensor_parallel_to_data_parallel(char_dataset, two_ranks, tmp_path):
    """TP2 (one data-parallel rank) -> DP2 (no tensor parallelism), through DeepSpeed's universal
    format: the shards merge as AutoTP split them, and the run continues with the same losses."""
    res, out = two_ranks
    run = tmp_path / "tp2"
    shutil.copytree(out / "tp2", run)
    ckpt_dir = run / "checkpoints"
    shutil.rmtree(ckpt_dir / checkpoint.tag_for(20))
    (ckpt_dir / "latest").write_text(checkpoint.tag_for(10) + "\n")
    done = cli("convert", str(ckpt_dir / checkpoint.tag_for(10)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    jobs = [
        {"name": "dp2", "run": "tp2", "overrides": [*ONE_DP, "batch.micro_batch_size=1"], "resume": "auto"}
    ]
    after = torchrun(2, 29565, char_dataset, tmp_path, jobs)
    assert after["dp2"]["start_step"] == 10
    assert "universal checkpoint" in after["_stdout"]
    assert_close(losses(after["dp2"], 11), losses(res["tp2"], 11))


def test_a_pipeline_checkpoint_is_refused_without_a_pipeline(char_dataset, two_ranks, tmp_path):
    _, out = two_ranks
    run = tmp_path / "pp2"
    shutil.copytree(out / "pp2", run)
    jobs = [{"name": "flat", "run": "pp2", "overrides": ONE_DP, "resume": "auto", "expect_error": True}]
    after = torchrun(2, 29567, char_dataset, tmp_path, jobs)
    err = after["flat"]["error"]
    assert "parallel.pipeline=2" in err and "pretrain export" in err, err
    # convert's universal checkpoint changes the world size, not the pipeline: it says so
    done = cli("convert", str(run / "checkpoints" / checkpoint.tag_for(10)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "now continues it on any world size with parallel.pipeline=2" in done.stdout


def test_a_deepspeed_json_with_autotp_size_trains(char_dataset, tmp_path):
    """The JSON a Megatron/AutoTP user brings: `tensor_parallel.autotp_size` is parallel.tensor."""
    ds = tmp_path / "autotp.json"
    ds.write_text(
        '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,'
        ' "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}'
    )
    shown = cli("config", "--ds", str(ds), "--preset", "tiny")
    assert shown.returncode == 0 and "tensor: 2" in shown.stdout, shown.stderr
    done = cli(
        "train", "--ds", str(ds), "--preset", "tiny", "--nproc-per-node", "2", CORPUS,
        f"--set=data.dataset_dir={char_dataset}", f"--set=logging.run_dir={tmp_path / 'run'}",
        "--set=model.n_layer=1", "--set=model.n_embd=32", "--set=model.n_head=2", "--set=model.block_size=32",
        "--set=schedule.max_steps=3", "--set=schedule.warmup_steps=1", "--set=logging.log_interval=1",
        "--set=logging.eval_interval=3", "--set=logging.eval_batches=1", "--set=logging.sample_tokens=8",
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tensor 2 x pipeline 1 x data 1" in done.stdout
    assert (tmp_path / "run" / "checkpoints" / checkpoint.tag_for(3)).is_dir()
