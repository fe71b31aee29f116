"""torch.compile through DeepSpeed's engine (`compile.enabled`): two gloo ranks, the real engine,
ZeRO 0-3, TorchInductor. Compiled and eager runs agree, and checkpoints cross between them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pretrain.config.ds_read import tree_from_deepspeed
from pretrain.config.tree import validate
from pretrain.errors import ConfigError
from tests.conftest import ckpt, cli, torchrun

STEPS = 20
SHAPE = [
    f"schedule.max_steps={STEPS}",
    "logging.eval_interval=10",
    "checkpoint.interval=10",
    "checkpoint.keep_last=5",
]
STAGES = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def compiled(char_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """Each stage eager and compiled, 20 steps; then the second half of the ZeRO-2 run resumed
    across: eager from the compiled run's step-10 checkpoint, and compiled from the eager one's."""
    out = tmp_path_factory.mktemp("compile")
    jobs: list[dict] = []
    for stage in STAGES:
        for mode in ("eager", "compiled"):
            on = mode == "compiled"
            jobs.append(
                {
                    "name": f"{mode}_z{stage}",
                    "run": f"{mode}_z{stage}",
                    "overrides": [*SHAPE, f"zero.stage={stage}", f"compile.enabled={on}"],
                }
            )
    for mode, source in (("eager", "compiled_z2"), ("compiled", "eager_z2")):
        jobs.append(
            {
                "name": f"{mode}_from_{source}",
                "run": f"{mode}_from_{source}",
                "overrides": [*SHAPE, "zero.stage=2", f"compile.enabled={mode == 'compiled'}"],
                "resume": str(ckpt(out, source, 10)),
            }
        )
    return torchrun(2, 29591, char_dataset, out, jobs, timeout=1500), out


def _losses(res: dict, name: str, steps: range) -> list[float]:
    return [res[name]["losses"][str(s)] for s in steps]


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_compiled_matches_eager_over_20_steps(compiled, stage):
    res, _ = compiled
    eager, comp = (_losses(res, f"{m}_z{stage}", range(1, STEPS + 1)) for m in ("eager", "compiled"))
    diff = max(abs(a - b) for a, b in zip(eager, comp, strict=True))
    print(f"ZeRO-{stage}: max |compiled - eager| loss over {STEPS} steps = {diff:.2e}")
    assert diff < 1e-4, (eager, comp)
    assert comp[-1] < comp[0] - 0.3  # and it trains
    assert res[f"compiled_z{stage}"]["val_loss"] == pytest.approx(
        res[f"eager_z{stage}"]["val_loss"], abs=1e-4
    )


@pytest.mark.distributed
@pytest.mark.parametrize(("mode", "source"), [("eager", "compiled_z2"), ("compiled", "eager_z2")])
def test_resume_across_compiled_and_eager(compiled, mode, source):
    res, _ = compiled
    resumed = res[f"{mode}_from_{source}"]
    assert resumed["start_step"] == 10 and resumed["final_step"] == STEPS
    got = _losses(res, f"{mode}_from_{source}", range(11, STEPS + 1))
    ref = _losses(res, source, range(11, STEPS + 1))
    diff = max(abs(a - b) for a, b in zip(ref, got, strict=True))
    assert diff < 1e-4, (ref, got)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", STAGES)
def test_compiled_checkpoints_carry_plain_names(compiled, stage):
    """The module weights DeepSpeed saves are the eager model's names: no `_orig_mod.` prefix."""
    _, out = compiled
    for mode in ("compiled", "eager"):
        path = ckpt(out, f"{mode}_z{stage}", STEPS)
        files = sorted(path.glob("*model_states.pt"))
        assert files, path
        for f in files:
            sd = torch.load(f, map_location="cpu", weights_only=False)["module"]
            names = sorted(sd)
            assert names and not [n for n in names if "_orig_mod" in n], names[:5]
            assert "wte.weight" in names


@pytest.mark.distributed
def test_export_of_a_compiled_run(compiled, tmp_path):
    _, out = compiled
    dest = tmp_path / "hf"
    done = cli("export", str(out / "compiled_z2"), "--out", str(dest))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    from safetensors.torch import load_file

    weights = load_file(str(next(dest.rglob("*.safetensors"))))
    assert weights and not [k for k in weights if "_orig_mod" in k]


def test_compile_section_defaults_and_rules():
    cfg = validate({}, world_size=1)
    assert cfg.compile.enabled is False and cfg.compile.backend == "inductor"
    with pytest.raises(ConfigError, match=r"compile\.mode"):
        validate({"compile": {"mode": "fast"}}, world_size=1)
    with pytest.raises(ConfigError, match="needs backend 'inductor'"):
        validate({"compile": {"mode": "max-autotune", "backend": "aot_eager"}}, world_size=1)
    with pytest.raises(ConfigError, match="modeled by the tree"):
        validate({"deepspeed_extra": {"compile": {"deepcompile": False}}}, world_size=1)


def test_deepspeed_compile_section_is_read_not_passed_through():
    assert "deepspeed_extra" not in tree_from_deepspeed({"compile": {"deepcompile": False}})
    with pytest.raises(ConfigError, match="DeepCompile is not modeled"):
        tree_from_deepspeed({"compile": {"deepcompile": True}})


@pytest.mark.distributed
def test_gpu_benchmark_runs_end_to_end_on_the_cpu():
    """benchmarks/gpu_gpt2.py --cpu-smoke: our path and the plain loop, compiled, then our path
    on 2 CPU ranks: every line of the GPU benchmark runs, nothing is timed."""
    import subprocess
    import sys

    from tests.conftest import ROOT, subprocess_env

    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_gpt2.py"), "--cpu-smoke"],
        cwd=ROOT,
        env=subprocess_env(PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert "ours (DeepSpeed)" in out and "plain PyTorch loop" in out and "ours / plain:" in out
    assert "ours, 2 ranks:" in out and "tokens/s" in out and "MFU" in out
