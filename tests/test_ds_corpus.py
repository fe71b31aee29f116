"""The public corpus: DeepSpeed configs copied verbatim from public repositories (tests/ds_json/public,
each named in its SOURCES.md). Every one DeepSpeed 0.19 can run loads, and its rendered JSON, read by
DeepSpeed's own DeepSpeedConfig, trains what the original read the same way trains: batch sizes,
accumulation, clipping, optimizer, ZeRO and precision, field by field, and the LR at every step of
the curve DeepSpeed's scheduler object gives. The rest are refused, each problem with its fix."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from pretrain.config.ds_keys import ADAM_DEFAULTS, AUTO, auto_paths
from pretrain.config.ds_render import render_deepspeed
from pretrain.config.presets import build_checked
from pretrain.errors import ConfigError
from pretrain.training.schedule import lr_at
from tests.conftest import ROOT

PUBLIC = ROOT / "tests" / "ds_json" / "public"
FILES = sorted(p.name for p in PUBLIC.iterdir() if p.suffix in (".json", ".conf"))
PRESET = "gpt2-124m"
WORLD = 16
# The world a config was written for where 16 GPUs cannot run its batch.
WORLDS = {"ds_examples__pipeline_parallelism_ds_config.json": 8}

# Refused, each with what the message must say (and exactly that many problems).
REFUSED = {
    # what needs a package or an op this project does not take
    "ds_examples__bing_bert_bsz64k_lamb_seq128.json": ['optimizer.type: "Lamb" is not supported'],
    "ds_examples__bing_bert_onebitlamb_nccl_seq128.json": ['optimizer.type: "OneBitLamb" is not supported'],
    "ds_examples__bingbertsquad_onebitadam_nccl_bsz96.json": ['optimizer.type: "OnebitAdam" is not supported'],
    # OneCycle also cycles Adam's momentum, which pretrain's schedule does not model
    "ds_examples__qanet_bsz512_1cycle.json": [
        "scheduler.params.cycle_second_step_size: OneCycle", "scheduler.params.cycle_momentum: OneCycle",
    ],
    # what DeepSpeed 0.19 itself refuses as written
    "ds_examples__bert_structural_pruning_TEMPLATE.json": ["not valid JSON", "placeholder"],
    "ds_examples__gpt2_medium_1clmetric_TEMPLATE.json": ["not valid JSON", "placeholder"],
    "bigscience_mds__tests_ds_config_cl.json": [
        "curriculum_learning: Legacy top-level 'curriculum_learning' has been removed. Use "
        "'data_efficiency.data_sampling.curriculum_learning' instead",
    ],
    "ds_examples__megatron_zero3_infinity_nvme.json": [
        "zero_optimization.offload_optimizer.device: NVMe offload",
        "zero_optimization.offload_param.device: NVMe offload",
        "stage3_param_persitence_threshold: unknown key (did you mean 'stage3_param_persistence_threshold'?)",
        "aio.thread_count: unknown key; DeepSpeed 0.19 takes block_size, intra_op_parallelism",
    ],
    # a near miss of a batch key: DeepSpeed would silently train without it
    "fastchat__deepspeed_config_s3.json": [
        "'micro_batch_size_per_gpu' is not a DeepSpeed config key (did you mean 'train_micro_batch_size_per_gpu'?)",
    ],
}  # fmt: skip
LOADS = [name for name in FILES if name not in REFUSED]


def test_the_corpus_is_large_sourced_and_covered():
    assert len(FILES) >= 40
    assert set(REFUSED) <= set(FILES)
    sources = (PUBLIC / "SOURCES.md").read_text()
    rows = [line.split("|")[1].strip() for line in sources.splitlines() if line.startswith("| ")]
    rows = [row for row in rows if row.endswith((".json", ".conf"))]
    assert sorted(rows) == FILES  # each file named once, with its repository and path
    assert len({name.split("__")[0] for name in FILES}) >= 8  # sources


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_public_config_deepspeed_cannot_run_is_refused_with_its_fix(name):
    with pytest.raises(ConfigError) as info:
        build_checked(PUBLIC / name, preset=PRESET, world_size=WORLDS.get(name, WORLD))
    assert all(n in str(info.value) for n in REFUSED[name]), str(info.value)
    if "placeholder" not in REFUSED[name]:
        assert len(info.value.problems) == len(REFUSED[name]), str(info.value)


class _DataParallel:
    """The engine's mpu as DeepSpeedConfig asks it: only the data-parallel world size."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    """A real single-rank gloo group on loopback, so that DeepSpeedConfig finds its rank as the engine
    does; the mpu gives the data-parallel size of the launch the config is checked for."""
    import deepspeed
    import torch.distributed as tdist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    deepspeed.init_distributed(
        dist_backend="gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, verbose=False
    )
    yield
    tdist.destroy_process_group()


def deepspeed_reads(ds: dict[str, Any], world: int) -> Any:
    """DeepSpeedConfig(ds) on `world` data-parallel ranks, as the engine builds it."""
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(json.loads(json.dumps(ds)), mpu=_DataParallel(world))


def filled(original: Any, rendered: Any) -> Any:
    """`original` with each "auto" given the rendered JSON's value at the same place (what the
    Hugging Face integration does with the trainer's values), or left out where it has none."""
    if not isinstance(original, dict):
        return original
    out = {}
    for k, v in original.items():
        there = rendered.get("bf16" if k == "bfloat16" else k) if isinstance(rendered, dict) else None
        if v == AUTO:
            if there is not None:
                out[k] = there
        else:
            out[k] = filled(v, there if isinstance(there, dict) else {})
    return out


def optimizer(c: Any) -> dict[str, Any] | None:
    """What DeepSpeed builds from a config's optimizer section: Adam's update rule and its values."""
    if c.optimizer_name is None:
        return None  # the training script's optimizer
    params = {**ADAM_DEFAULTS, **c.optimizer_params}
    decoupled = c.optimizer_name == "adamw" or params.get("adam_w_mode", True)
    return {
        "kind": c.optimizer_name if c.optimizer_name not in ("adam", "adamw") else "adam",
        "decoupled": decoupled,
        "lr": params["lr"],
        "betas": list(params["betas"]),
        "eps": params["eps"],
        "weight_decay": params["weight_decay"],
        "bias_correction": params.get("bias_correction", True),
    }


FP16_FIELDS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")


def trained(c: Any) -> dict[str, Any]:
    """The fields of a DeepSpeedConfig that decide what is trained."""
    z = c.zero_config
    return {
        "train_batch_size": c.train_batch_size,
        "micro_batch": c.train_micro_batch_size_per_gpu,
        "accumulation": c.gradient_accumulation_steps,
        "clipping": c.gradient_clipping,
        "optimizer": optimizer(c),
        "zero.stage": c.zero_optimization_stage,
        "zero.overlap_comm": z.overlap_comm,
        "zero.contiguous_gradients": z.contiguous_gradients,
        "zero.reduce_bucket_size": z.reduce_bucket_size,
        "zero.allgather_bucket_size": z.allgather_bucket_size,
        "zero.offload_optimizer": z.offload_optimizer.device if z.offload_optimizer else "none",
        "zero.offload_param": z.offload_param.device if z.offload_param else "none",
        "fp16": c.float16_config.enabled,
        "bf16": c.bfloat16_config.enabled,
        # fp16's loss scale (DeepSpeed reads these whether fp16 is on or not)
        **{k: getattr(c.float16_config, k) for k in FP16_FIELDS},
    }


@pytest.mark.parametrize("name", LOADS)
def test_a_public_config_trains_what_deepspeed_would_train(name, one_rank, capsys):
    world = WORLDS.get(name, WORLD)
    cfg = build_checked(PUBLIC / name, preset=PRESET, world_size=world)
    assert "from DeepSpeed's defaults:" in capsys.readouterr().err  # the provenance line
    rendered = render_deepspeed(cfg)
    assert auto_paths(rendered) == []
    raw = json.loads((PUBLIC / name).read_text())
    original = filled(raw, rendered)
    theirs = trained(deepspeed_reads(original, world))
    ours = trained(deepspeed_reads(rendered, world))
    if theirs["optimizer"] is None:  # the JSON leaves the optimizer to the training script: pretrain's
        ours["optimizer"] = None
    assert ours == theirs
    if "scheduler" in original:
        assert_same_curve(raw["scheduler"], cfg)
    elif theirs["optimizer"] is not None:  # DeepSpeed's optimizer alone: its lr, constant
        assert {lr_at(s, cfg.optimizer.lr, cfg.schedule) for s in (0, 1, cfg.schedule.max_steps)} == {
            theirs["optimizer"]["lr"]
        }


def assert_same_curve(scheduler: dict[str, Any], cfg: Any) -> None:
    """lr_at at each step against DeepSpeed's own scheduler object, stepped as the engine steps it
    (after each optimizer step), its "auto" parameters resolved from the tree."""
    import torch
    from deepspeed.runtime import lr_schedules

    s, peak = cfg.schedule, cfg.optimizer.lr
    resolved = {
        "warmup_min_lr": s.warmup_start_ratio * peak,
        "warmup_max_lr": peak,
        "warmup_num_steps": s.warmup_steps,
        "total_num_steps": s.max_steps,
    }
    params = {k: resolved[k] if v == AUTO else v for k, v in scheduler.get("params", {}).items()}
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = getattr(lr_schedules, scheduler["type"])(opt, **params)
    steps = sorted({*range(min(s.max_steps, 3 * s.warmup_steps + 10)), *range(0, s.max_steps + 5, 997)})
    theirs = [opt.param_groups[0]["lr"]]  # step 0: the scheduler as built
    for step in steps[1:]:
        sched.step(step - 1)  # optimizer step `step` runs after the scheduler's iteration step - 1
        theirs.append(opt.param_groups[0]["lr"])
    ours = [lr_at(step, peak, s) for step in steps]
    assert max(math.fabs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours, theirs, strict=True) if b) < 1e-12
    assert [a == 0 for a in ours] == [b == 0 for b in theirs]


def test_a_template_gets_its_placeholders_named(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": GB_SIZE, "train_micro_batch_size_per_gpu": 4}')
    with pytest.raises(ConfigError, match="GB_SIZE"):
        build_checked(path, preset=PRESET, world_size=WORLD)
