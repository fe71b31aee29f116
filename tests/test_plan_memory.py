"""`pretrain plan`'s memory beyond the ZeRO paper: the buffer DeepSpeed sums gradients in
(precision.grad_accum_dtype), the host memory a node's ranks take from the start, with what would fit
when it does not, and the device peak under precision.tf32.

Run as a script under torchrun, this file is the worker of `test_the_fp32_buffers_are_what_deepspeed_allocates`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.cli import main
from pretrain.config.layout import Layout
from pretrain.config.presets import build
from pretrain.plan.layout import stage_shares
from pretrain.plan.memory import (
    GB,
    PROCESS_HOST_GB,
    after_backward_bytes,
    largest_layer_params,
    model_states,
    rank_states,
    snapshot_bytes,
)
from pretrain.plan.rates import resolve_rates
from pretrain.plan.stages import plan_stages
from pretrain.plan.timing import predict_step

ROOT = Path(__file__).resolve().parents[1]
A100X16 = ROOT / "hostfiles" / "a100x16"  # 2 nodes x 8 A100-80GB, hosts of 1024 GB


def plan(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def host_line(text: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith("host")]  # one line, fitting or not
    return line


def test_fp32_accumulation_changes_the_states_by_what_deepspeed_allocates():
    """(params, grads, optimizer, host) bytes, gradients summed in fp32 (accum 4) against bf16 (accum 2),
    as DeepSpeed 0.19.8's optimizers allocate them (memory.py's docstring; the distributed test below
    reads the buffers themselves)."""
    psi, n = 1_000_000, 4

    def states(stage: int, accum: int, off: bool = False, **kw: bool) -> tuple[float, ...]:
        got = model_states(
            psi, stage=stage, world=n, precision="bf16", offload_optimizer=off, offload_param=False,
            accum=accum, **kw,
        )  # fmt: skip
        return tuple(x / psi for x in got)

    # stage 1: BF16_Optimizer keeps a whole fp32 buffer beside the bf16 gradients, and steps on its
    # partition in place; summed in bf16, the ZeRO optimizer converts the partition to fp32 at the step
    assert states(1, 4) == (2, 2 + 4, 12 / n, 0)
    assert states(1, 2) == (2, 2, 12 / n + 4 / n, 0)
    assert states(1, 4, frees_16bit_grads=True) == (2, 4, 12 / n, 0)  # bf16.immediate_grad_update
    # stage 1 offloaded: fp32 grad_accum on every parameter and the partition it is reduced into
    assert states(1, 4, off=True) == (2, 4 + 4 / n, 0, 16 / n)
    assert states(1, 2, off=True) == (2, 2, 0, 16 / n)
    # stage 2: the compact fp32 partition replaces the bf16 one and its conversion; under offload it
    # stays on the device and the host keeps no bf16 partition
    assert states(2, 4) == (2, 4 / n, 12 / n, 0)
    assert states(2, 2) == (2, 2 / n, 16 / n, 0)
    assert states(2, 4, off=True) == (2, 4 / n, 0, 16 / n)
    assert states(2, 2, off=True) == (2, 0, 0, 18 / n)
    # stage 3: grad_partitions_flat_buffer in fp32, on the host under offload
    assert states(3, 4) == (2 / n, 4 / n, 12 / n + 4 / n, 0)
    assert states(3, 2) == (2 / n, 2 / n, 12 / n + 4 / n, 0)
    assert states(3, 4, off=True) == (2 / n, 0, 0, 20 / n)
    assert states(3, 2, off=True) == (2 / n, 0, 0, 18 / n)
    # stage 0 in a pipeline: BF16_Optimizer with a bf16 buffer, its fp32 state partitioned
    assert states(0, 2, pipeline=True) == (2, 2 + 2, 12 / n + 4 / n, 0)


def test_the_configured_accumulation_reaches_the_plan():
    """precision.grad_accum_dtype moves the row by the buffer's bytes; BF16_Optimizer's all-reduce after
    backward copies its fp32 buffer only to cast it to a bf16 communication dtype, and that copy is
    counted against the activations it outlives."""
    fp32 = build("llama-13b", overrides=["model.vocab_size=32000"], world_size=16)
    bf16 = build(
        "llama-13b", overrides=["model.vocab_size=32000", "precision.grad_accum_dtype=bf16"], world_size=16
    )
    bf16_comm = build(  # fp32 sums, all-reduced in bf16 (DeepSpeed's own default communication dtype)
        "llama-13b",
        overrides=["model.vocab_size=32000", "deepspeed_extra={communication_data_type: bf16}"],
        world_size=16,
    )
    rows = {
        name: {(p.stage, p.offload): p for p in plan_stages(c, 16, device_gb=80.0, gpus_per_node=8)}
        for name, c in (("fp32", fp32), ("bf16", bf16), ("bf16_comm", bf16_comm))
    }
    (share,) = stage_shares(fp32, Layout(2, 1, 8))  # TP2: half of each block's matrices
    psi = share.params
    one_fp32, one_bf16 = rows["fp32"][(1, "none")], rows["bf16"][(1, "none")]
    assert (one_fp32.model_states_gb - one_bf16.model_states_gb) * 1e9 == pytest.approx(4 * psi - 4 * psi / 8)
    # over 5e8 elements the fp32 buffer is all-reduced alone, as a view: in fp32 (the rendered
    # communication_data_type) with no copy at all, in bf16 through a bf16 copy of it (2Ψ)
    assert psi > 5e8
    assert after_backward_bytes(fp32, psi, stage=1, offload_optimizer=False) == 0.0
    assert one_fp32.device_total_gb == pytest.approx(one_fp32.model_states_gb + one_fp32.activations_gb)
    assert after_backward_bytes(bf16_comm, psi, stage=1, offload_optimizer=False) == 2 * psi
    one_cast = rows["bf16_comm"][(1, "none")]
    assert one_cast.model_states_gb == one_fp32.model_states_gb
    assert 2 * psi / 1e9 > one_cast.activations_gb  # so the copy, not the activations, sets the peak
    assert one_cast.device_total_gb == pytest.approx(one_cast.model_states_gb + 2 * psi / 1e9)
    # the gradients' dtype on the wire: 4 bytes summed in fp32, 2 summed in bf16 or cast to bf16
    assert one_fp32.comm_gb_per_step * 1e9 == pytest.approx(psi * 4 + psi * 2)
    assert one_bf16.comm_gb_per_step == one_cast.comm_gb_per_step == pytest.approx(psi * 4 / 1e9)
    two_fp32, two_bf16 = rows["fp32"][(2, "none")], rows["bf16"][(2, "none")]
    assert (two_fp32.model_states_gb - two_bf16.model_states_gb) * 1e9 == pytest.approx(-2 * psi / 8)
    # the stage 0 row sums in bf16, the one way DeepSpeed's stage 0 can
    assert rows["fp32"][(0, "none")].model_states_gb == rows["bf16"][(0, "none")].model_states_gb


def test_llama_13b_on_two_a100_nodes_counts_the_host_from_the_start(capsys):
    text = plan(capsys, "--preset", "llama-13b", "--hostfile", str(A100X16), "--host-gb", "256")
    line = host_line(text)
    assert line.startswith("host: a node's 8 ranks take 24.0 GB of host memory from the start, and ")
    assert "GB more while a checkpoint is written in the background (checkpoint.async_save: " in line
    assert "its process 3.000, assumed for torch, DeepSpeed and a CUDA context" in line
    assert "the model 0, built on the GPU; offloaded states 0.000" in line
    out = json.loads(
        plan(capsys, "--preset", "llama-13b", "--hostfile", str(A100X16), "--host-gb", "256", "--json")
    )
    assert out["process_host_gb"] == PROCESS_HOST_GB["cuda"] and out["host_fixes"] == []
    rows = {(s["stage"], s["offload"]): s for s in out["stages"]}
    assert (
        rows[(1, "none")]["host_rank_gb"] == pytest.approx(3.0) and rows[(1, "none")]["host_node_gb"] == 24.0
    )
    # offloaded, each rank's fp32 state and gradient partition join its process in host memory
    # an asynchronous save's snapshot: the weights (bf16) and the first rank's fp32 master and moments,
    # and the 7 other ranks' partitions of the 16 data-parallel ranks
    snap = rows[(1, "none")]
    dp = int(snap["layout"].rsplit("DP", 1)[1])
    first, other = snapshot_bytes("bf16", snap["rank_params"], stage=1, world=dp)
    assert snap["host_snapshot_gb"] == pytest.approx(first / GB)
    assert snap["host_snapshot_node_gb"] == pytest.approx((first + 7 * other) / GB)
    assert first == pytest.approx(2 * snap["rank_params"] + 12 * snap["rank_params"] / dp)
    off = rows[(1, "optimizer")]
    assert off["host_rank_gb"] == pytest.approx(3.0 + off["host_gb"])
    assert off["host_node_gb"] == pytest.approx(8 * off["host_rank_gb"]) and off["host_fits"] is True


def test_a_host_too_small_is_named_with_a_fix_that_fits(tmp_path, capsys):
    # 8 GPU ranks' processes alone take 24 GB: at most 4 ranks a 16 GB host, the tensor pairs kept whole
    line = host_line(plan(capsys, "--preset", "llama-13b", "--hostfile", str(A100X16), "--host-gb", "16"))
    assert line.startswith(
        "host does not fit: a node's 8 ranks take 24.0 GB of host memory from the start, and "
    )
    assert "written in the background" in line and "more than its 16.0 GB" in line
    assert line.endswith("Fix: 4 ranks a host (slots=4 in the hostfile: 4 hosts for the 16 ranks).")
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "# pretrain: device=A100-80GB host-gb=16\n" + "".join(f"node-{i} slots=4\n" for i in range(4))
    )
    assert host_line(plan(capsys, "--preset", "llama-13b", "--hostfile", str(hosts))).startswith(
        "host: a node's 4 ranks take 12.0 GB"
    )
    # offloading the optimizer puts 8 ranks' fp32 state on a host of 100 GB: not offloading fits
    sets = ["--preset", "llama-13b", "--hostfile", str(A100X16), "--host-gb", "100"]
    line = host_line(plan(capsys, *sets, "--set", "zero.offload_optimizer=true"))
    assert line.startswith("host does not fit: a node's 8 ranks take 130.8 GB")
    fix = "--set zero.offload_optimizer=false (ZeRO-1 none: 75.3 GB a device, 3.000 GB of host memory a rank)"
    assert f"Fix: {fix}; or 4 ranks a host (slots=4 in the hostfile: 4 hosts for the 16 ranks)." in line
    assert host_line(
        plan(capsys, *sets, "--set", "zero.offload_optimizer=true", "--set", "zero.offload_optimizer=false")
    ).startswith("host: ")
    # on 16 GB hosts neither alone fits: both together do; on 2 GB hosts not even one rank
    small = ["--preset", "llama-13b", "--hostfile", str(A100X16), "--set", "zero.offload_optimizer=true"]
    line = host_line(plan(capsys, *small, "--host-gb", "16"))
    assert line.endswith(
        f"Fix: {fix} with 4 ranks a host (slots=4 in the hostfile: 4 hosts for the 16 ranks)."
    )
    line = host_line(plan(capsys, *small, "--host-gb", "2"))
    assert line.endswith(f"Fix: hosts of 3.000 GB a rank or more, with {fix}.")


def test_cpu_ranks_hold_their_model_in_host_memory():
    cfg = build(
        "small",
        overrides=["model.vocab_size=65", "zero.stage=2", "zero.offload_optimizer=true"],
        world_size=2,
    )
    gpu = {(p.stage, p.offload): p for p in plan_stages(cfg, 2, device_gb=8.0, host_gb=64.0)}
    cpu = {(p.stage, p.offload): p for p in plan_stages(cfg, 2, device_gb=8.0, host_gb=64.0, cpu_ranks=True)}
    for key, p in cpu.items():
        g = gpu[key]
        assert g.host_model_gb == 0 and g.host_rank_gb == pytest.approx(PROCESS_HOST_GB["cuda"] + g.host_gb)
        # the host is the device: the rank's states, activations and buffers (more than its fp32 build)
        assert p.host_model_gb == pytest.approx(p.device_total_gb)
        assert p.host_rank_gb == pytest.approx(PROCESS_HOST_GB["cpu"] + p.device_total_gb + p.host_gb)
        assert p.host_node_gb == pytest.approx(2 * p.host_rank_gb)
    # a plan for this CPU machine says so
    assert "the host being the CPU ranks' device" in host_line(
        plan_text_of(["small", "--world-size", "2", "--gpu", "cpu", "--host-gb", "64"])
    )


def plan_text_of(args: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", *args]) == 0
    return out.getvalue()


def test_tf32_sets_the_fp32_peak_of_an_a100():
    """fp32 matmuls run on an A100's TF32 tensor cores (156 TFLOP/s) with precision.tf32, else on its
    fp32 units (19.5): the step's compute takes 8 times longer without."""
    times = {}
    for tf32 in (True, False):
        cfg = build(
            "gpt2-124m",
            overrides=["model.vocab_size=50304", "precision.bf16=false", f"precision.tf32={tf32}"],
            world_size=8,
        )
        rates = resolve_rates(cfg, 8, 8, device="A100-80GB")
        assert rates.peak_tflops == (156.0 if tf32 else 19.5)
        assert rates.sources["peak"] == "A100-80GB datasheet, " + (
            "TF32 (precision.tf32)" if tf32 else "fp32 without TF32 (precision.tf32=false)"
        )
        times[tf32] = predict_step(cfg, 8, stage=1, offload_optimizer=False, offload_param=False, rates=rates)
    assert times[False].compute_s == pytest.approx(8 * times[True].compute_s)
    assert times[False].step_s > 7 * times[True].step_s
    # 16-bit training has no TF32 to switch
    bf16 = build("gpt2-124m", overrides=["model.vocab_size=50304", "precision.tf32=false"], world_size=8)
    assert resolve_rates(bf16, 8, 8, device="A100-80GB").peak_tflops == 312.0


# ---------------------------------------------------------------------------------------------
# DeepSpeed's own buffers, read from its optimizers on 2 gloo ranks


@pytest.mark.distributed
def test_the_fp32_buffers_are_what_deepspeed_allocates(tmp_path):
    from tests.conftest import subprocess_env

    out = tmp_path / "buffers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", "29647", str(Path(__file__)), str(out)],
        cwd=ROOT, env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = json.loads(out.read_text())
    for key, got in found.items():
        if key in ("1 bf16", "2 bf16"):
            continue  # ZeRO-1 and 2 sum bf16 in the gradients themselves (tests/test_plan_target.py)
        stage, accum = int(key[0]), key[2:]
        cfg = build(
            "tiny",
            overrides=[*WORKER_SETS, f"zero.stage={stage}", f"precision.grad_accum_dtype={accum}"],
            world_size=2,
        )
        _, grads, _, _ = rank_states(
            cfg, got["params"], stage=stage, world=2, offload_optimizer=False, offload_param=False
        )
        gathered = 2 * largest_layer_params(cfg) if stage == 3 else 0
        bf16_grads = 2 * got["params"] if got["optimizer"] == "BF16_Optimizer" else 0
        # the buffer the plan counts, against DeepSpeed's (aligned to a few elements a group)
        assert grads - gathered - bf16_grads == pytest.approx(got["buffer_bytes"], rel=1e-3), key
    assert (
        found["1 fp32"]["optimizer"] == "BF16_Optimizer"
        and found["1 bf16"]["optimizer"] == "DeepSpeedZeroOptimizer"
    )
    # summed in fp32, every buffer is fp32 (stage 2 keeps no bf16 partition beside its fp32 one)
    assert all(got["dtypes"] == ["float32"] for key, got in found.items() if key.endswith("fp32"))
    assert found["3 bf16"]["dtypes"] == ["bfloat16"] and found["2 bf16"]["buffer_bytes"] == 0


# A small GPT that every stage partitions (no parameter under stage 3's persistence threshold is
# left whole), 2 micro batches a step.
WORKER_SETS = [
    "model.vocab_size=65", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=32",
    "precision.bf16=true", "batch.micro_batch_size=2", "batch.gradient_accumulation_steps=2",
    "deepspeed_extra={zero_optimization: {stage3_param_persistence_threshold: 0}}",
]  # fmt: skip


def worker(out: Path) -> None:
    """Each stage's gradient buffer after the last micro batch's backward, before the step: its bytes
    and dtypes, and the optimizer DeepSpeed built."""
    import torch
    import torch.distributed as tdist

    from pretrain.config.ds_render import render_deepspeed
    from pretrain.config.tree import analytic_num_params
    from pretrain.training.distributed import engine, ranks

    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    found = {}
    for stage, accum in ((1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")):
        cfg = build(
            "tiny",
            overrides=[*WORKER_SETS, f"zero.stage={stage}", f"precision.grad_accum_dtype={accum}"],
            world_size=2,
        )
        ds = render_deepspeed(cfg)
        eng = engine.initialize(cfg, engine.build_model(cfg, ds), ds)
        for _ in range(cfg.batch.gradient_accumulation_steps):
            idx = torch.randint(0, 65, (2, 32))
            _, loss = eng(idx, idx)
            eng.backward(loss)
        opt = eng.optimizer
        name = type(opt).__name__
        if name == "BF16_Optimizer":
            buffers = list(opt.fp32_groups_gradients_flat)
        elif stage == 3:
            buffers = [opt.grad_partitions_flat_buffer]
        else:  # stage 1 or 2: the compact fp32 partition, if any
            groups = [g for g in opt.averaged_gradients.values() if g is not None]
            buffers = [g.flat_partition for g in groups if hasattr(g, "flat_partition")]
        found[f"{stage} {accum}"] = {
            "optimizer": name,
            "params": analytic_num_params(cfg.model),
            "buffer_bytes": sum(t.numel() * t.element_size() for t in buffers),
            "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in buffers}),
        }
        eng.step()
        eng.destroy()
    if dist.is_main:
        out.write_text(json.dumps(found, indent=1))
    tdist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
