"""DeepSpeed JSONs read into the tree: the record of a rendered one, "auto", DeepSpeed's schedulers
and optimizers, DeepSpeed's own validators, wrong types; and the corpus of tests/ds_json/, JSONs in
the styles users bring (DeepSpeed's tutorials, the Hugging Face integration, Megatron-DeepSpeed,
GPT-NeoX), each loading to the intended tree or refused with its message."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pretrain.cli import main, parser
from pretrain.config.ds_configs import DS_CONFIG_RENDERS
from pretrain.config.ds_keys import auto_paths
from pretrain.config.ds_optimizer import REQUIRED, SCHEDULERS
from pretrain.config.ds_read import tree_from_deepspeed
from pretrain.config.ds_render import check_with_deepspeed, render_deepspeed
from pretrain.config.presets import PRESETS, build, build_checked
from pretrain.errors import ConfigError
from pretrain.training.schedule import lr_at
from tests.conftest import ROOT, subprocess_env

CORPUS = ROOT / "tests" / "ds_json"


def write(tmp_path: Path, ds: dict[str, Any], name: str = "ds.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(ds))
    return path


def problems(tmp_path: Path, ds: dict[str, Any], preset: str | None = "gpt2-124m", **kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        build_checked(write(tmp_path, ds), preset=preset, world_size=kw.pop("world_size", 16), **kw)
    return str(info.value)


def loaded(tmp_path: Path, ds: dict[str, Any], preset: str | None = "gpt2-124m", **kw: Any) -> Any:
    return build_checked(write(tmp_path, ds), preset=preset, world_size=kw.pop("world_size", 16), **kw)


def at(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


# ---------------------------------------------------------------------------------------------
# The record of a rendered JSON


def test_a_rendered_json_records_its_preset_model_and_tokenizer_and_deepspeed_accepts_it():
    cfg = build("gpt2-350m", overrides=["model.n_layer=6"], world_size=4)
    ds = render_deepspeed(cfg)
    assert ds["pretrain"] == {
        "preset": "gpt2-350m",
        "model": cfg.model.model_dump(mode="json"),
        "tokenizer": "gpt2",
    }
    check_with_deepspeed(ds)
    from deepspeed.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig({**ds, "train_batch_size": None}).zero_optimization_stage == 1


def test_reading_a_rendered_json_restores_its_preset_model_and_tokenizer(tmp_path):
    cfg = build("gpt2-350m", overrides=["model.n_layer=6", "zero.stage=2"], world_size=4)
    path = write(tmp_path, render_deepspeed(cfg))
    back = build(ds_file=path, world_size=4)
    assert (back.preset, back.model, back.data.tokenizer) == ("gpt2-350m", cfg.model, "gpt2")
    assert back.schedule == cfg.schedule and back.zero.stage == 2  # the rest of the preset, the JSON's ZeRO
    assert tree_from_deepspeed(json.loads(path.read_text()))["preset"] == "gpt2-350m"


def test_an_explicit_preset_or_config_wins_over_the_recorded_one(tmp_path):
    path = ROOT / "ds_configs" / "zero2_offload.json"  # gpt-6.7b
    tiny = build("tiny", ds_file=path, world_size=16)
    assert tiny.preset == "tiny" and tiny.model.n_layer == 2 and tiny.data.tokenizer == "char"
    assert tiny.zero.offload_optimizer and tiny.batch.micro_batch_size == 4  # the JSON's
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  n_layer: 3\n")
    own = build(config_file=run, ds_file=path, world_size=16)
    assert own.preset == "tiny" and own.model.n_layer == 3 and own.model.n_embd == 128


def test_a_foreign_json_needs_a_preset_or_a_config(tmp_path):
    path = CORPUS / "gpt_neox_125m.json"
    with pytest.raises(ConfigError) as info:
        build(ds_file=path, world_size=16)
    text = str(info.value)
    assert "was not rendered by pretrain" in text and "--config FILE" in text
    assert all(name in text for name in PRESETS)
    run = tmp_path / "run.yaml"
    run.write_text("preset: small\n")
    assert build(config_file=run, ds_file=path, world_size=16).preset == "small"
    assert build("gpt2-124m", ds_file=path, world_size=16).preset == "gpt2-124m"


@pytest.mark.parametrize("name", list(DS_CONFIG_RENDERS))
def test_every_ds_config_read_back_alone_renders_byte_for_byte(name, capsys):
    path = ROOT / "ds_configs" / f"{name}.json"
    world = DS_CONFIG_RENDERS[name][2]
    assert main(["render", "--ds", str(path), "--world-size", str(world)]) == 0
    assert capsys.readouterr().out == path.read_text()


def test_a_malformed_record_is_an_error(tmp_path):
    ds = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    ds["pretrain"] = {"preset": 3, "modle": {}}
    text = problems(tmp_path, ds, preset=None)
    assert "pretrain.preset: expected a preset name" in text
    assert "pretrain.modle: unknown key (did you mean 'model'?)" in text


# ---------------------------------------------------------------------------------------------
# "auto"

HF_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "reduce_bucket_size": "auto",
        "allgather_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": "auto",
    },
}


def test_auto_keeps_the_trees_values_overrides_included(tmp_path):
    cfg = loaded(tmp_path, HF_AUTO, overrides=["batch.micro_batch_size=7", "optimizer.lr=3e-4"])
    base = build("gpt2-124m", world_size=16)
    assert (cfg.batch.micro_batch_size, cfg.batch.gradient_accumulation_steps) == (7, 4)
    assert cfg.batch.train_batch_size == 7 * 4 * 16
    assert cfg.optimizer.lr == 3e-4 and cfg.optimizer.betas == base.optimizer.betas
    assert cfg.optimizer.grad_clip == base.optimizer.grad_clip and cfg.precision == base.precision
    assert (cfg.zero.reduce_bucket_size, cfg.zero.allgather_bucket_size) == (500_000_000, 500_000_000)
    assert cfg.zero.stage == 3


def test_auto_precision_is_the_trees_never_on(tmp_path):
    assert loaded(tmp_path, HF_AUTO, preset="tiny").precision.name == "fp32"
    assert loaded(tmp_path, HF_AUTO, preset="gpt2-124m").precision.name == "bf16"
    fp16 = {**HF_AUTO, "fp16": {"enabled": True}}
    assert loaded(tmp_path, fp16, preset="gpt2-124m").precision.name == "fp16"  # bf16 "auto" beside it: off
    assert loaded(tmp_path, {"fp16": {"enabled": True}}).precision.name == "fp16"  # bf16 left out: off
    assert loaded(tmp_path, {"zero_optimization": {"stage": 1}}).precision.name == "fp32"  # as DeepSpeed


def test_auto_in_unmodeled_zero_knobs_is_sized_from_the_model_when_rendered(tmp_path):
    cfg = loaded(tmp_path, HF_AUTO)
    zero = render_deepspeed(cfg)["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 768 * 768)
    assert zero["stage3_param_persistence_threshold"] == 10 * 768
    assert "stage3_gather_16bit_weights_on_model_save" not in zero  # DeepSpeed's default
    wider = loaded(tmp_path, HF_AUTO, overrides=["model.n_embd=1024", "model.n_head=16"])
    assert render_deepspeed(wider)["zero_optimization"]["stage3_param_persistence_threshold"] == 10_240
    check_with_deepspeed(render_deepspeed(wider))


def test_auto_that_nothing_resolves_is_refused():
    with pytest.raises(ConfigError, match=r"deepspeed_extra.flops_profiler.enabled: 'auto' has nothing"):
        build("tiny", overrides=["deepspeed_extra={flops_profiler: {enabled: auto}}"])


# ---------------------------------------------------------------------------------------------
# DeepSpeed's LR schedulers


def deepspeed_lrs(kind: str, params: dict[str, Any], lr: float, steps: int) -> list[float]:
    """The LR DeepSpeed's engine uses at each optimizer step: the scheduler steps after each one."""
    import torch
    from deepspeed.runtime import lr_schedules

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = getattr(lr_schedules, kind)(opt, **params)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        sched.step()
    return lrs


# Each scheduler type, DeepSpeed's defaults and the parameter sets of the corpus (tests/ds_json).
SCHEDULER_CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 20, "warmup_type": "linear"},
     {"max_steps": 100, "warmup_steps": 20, "warmup_start_ratio": 0.01, "decay": "constant"}),
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 20},
     {"warmup_type": "log", "decay": "constant", "deepspeed_timing": True}),
    ("WarmupLR", {"warmup_num_steps": 1}, {"warmup_steps": 2, "warmup_type": "log"}),  # at least 2, as DeepSpeed
    ("WarmupLR", {}, {"warmup_steps": 1000, "warmup_type": "log"}),  # warmup past the run's end
    ("WarmupDecayLR", {"total_num_steps": 80, "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4, "warmup_num_steps": 10},
     {"max_steps": 80, "decay": "linear", "min_lr_ratio": pytest.approx(1e-5 / 3e-4)}),
    ("WarmupDecayLR", {"total_num_steps": 60, "warmup_num_steps": 20, "warmup_type": "linear"},
     {"max_steps": 60, "decay": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 80, "warmup_min_ratio": 0.1, "warmup_num_steps": 20,
                        "cos_min_ratio": 0.2, "warmup_type": "linear"},
     {"max_steps": 80, "warmup_steps": 20, "warmup_start_ratio": 0.1, "min_lr_ratio": 0.2, "decay": "cosine"}),
    ("WarmupCosineLR", {"total_num_steps": 90, "warmup_num_steps": 15}, {"warmup_type": "log", "min_lr_ratio": 1e-4}),
    ("WarmupCosineLR", {"total_num_steps": 10_000, "warmup_num_steps": 500, "warmup_type": "linear",
                        "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}, {"max_steps": 10_000}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10,
                     "lr_range_test_step_rate": 0.5}, {"max_steps": 100, "warmup_steps": 99, "decay": "constant"}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 200_000,
                     "lr_range_test_step_rate": 1.0}, {"warmup_steps": 99}),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "params", "shape"), SCHEDULER_CASES)
def test_schedulers_give_deepspeeds_curve_at_every_step(tmp_path, capsys, kind, params, shape):
    """The LR of every optimizer step is the one DeepSpeed's engine would use with its own scheduler
    object (applied, then stepped after each optimizer step), to the last bit but rounding."""
    ds = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": kind, "params": params},
    }
    run = tmp_path / "run.yaml"  # below the JSON, so that its total_num_steps wins
    run.write_text("preset: tiny\nschedule:\n  max_steps: 100\n")
    cfg = loaded(tmp_path, ds, preset=None, config_file=run)
    assert {k: getattr(cfg.schedule, k) for k in shape} == shape
    assert f"scheduler {kind} became schedule.max_steps=" in capsys.readouterr().err
    ours = [lr_at(k, cfg.optimizer.lr, cfg.schedule) for k in range(cfg.schedule.max_steps)]
    theirs = deepspeed_lrs(kind, params, 1e-3, cfg.schedule.max_steps)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
@pytest.mark.parametrize("warmup", [1000, None])  # None: DeepSpeed's default, 1000
def test_a_warmup_past_the_schedules_end_is_refused(tmp_path, kind, warmup):
    """DeepSpeed only warns: the run would never reach its peak LR."""
    params = {"total_num_steps": 500} | ({} if warmup is None else {"warmup_num_steps": warmup})
    ds = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": kind, "params": params},
    }
    with pytest.raises(ConfigError) as e:
        loaded(tmp_path, ds)
    said = "1000" if warmup else "1000, DeepSpeed's default: the JSON leaves it out"
    assert e.value.problems == [
        f"scheduler.params.warmup_num_steps ({said}) is not below total_num_steps (500): a {kind} run would "
        "never reach warmup_max_lr. Lower warmup_num_steps, or raise total_num_steps"
    ]


def test_auto_in_scheduler_params_resolves_from_the_tree(tmp_path):
    ds = {"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto", "warmup_type": "linear"}}}  # fmt: skip
    cfg = loaded(tmp_path, ds, overrides=["schedule.warmup_steps=300"])
    base = build("gpt2-124m")
    assert cfg.schedule.warmup_steps == 300 and cfg.optimizer.lr == base.optimizer.lr
    assert cfg.schedule.warmup_start_ratio == base.schedule.warmup_start_ratio
    assert cfg.schedule.decay == "constant" and cfg.schedule.warmup_type == "linear"  # WarmupLR


@pytest.mark.parametrize(
    ("scheduler", "needles"),
    [
        ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
         ["scheduler.params.cycle_second_step_size", "scheduler.params.cycle_momentum"]),
        ({"type": "LRRangeTest", "params": {"lr_range_test_staircase": True}}, ["lr_range_test_staircase"]),
        ({"type": "WarmupCosineLR", "params": {"warmup_num_step": 5, "warmup_type": "linear"}},
         ["warmup_num_step: not a parameter of WarmupCosineLR (did you mean 'warmup_num_steps'?)",
          "scheduler.params.total_num_steps: WarmupCosineLR requires it"]),
        ({"type": "CosineAnnealing"}, ['"CosineAnnealing" is not one of DeepSpeed\'s schedulers']),
        ({"type": "WarmupLR", "params": {"warmup_num_steps": "10", "warmup_type": "linear"}},
         ['warmup_num_steps: expected a whole number, got "10" (a string)']),
    ],
)  # fmt: skip
def test_schedulers_that_cannot_be_expressed_are_refused(tmp_path, scheduler, needles):
    text = problems(tmp_path, {"scheduler": scheduler})
    assert all(n in text for n in needles), text


def test_scheduler_parameters_are_deepspeeds():
    from deepspeed.runtime import lr_schedules

    for kind, params in SCHEDULERS.items():
        signature = inspect.signature(getattr(lr_schedules, kind)).parameters
        theirs = {
            name: REQUIRED if p.default is inspect.Parameter.empty else p.default
            for name, p in signature.items()
            if name != "optimizer"
        }
        assert theirs == params, kind


# ---------------------------------------------------------------------------------------------
# DeepSpeed's optimizers


def test_adam_and_adamw_translate(tmp_path):
    params = {"lr": 2e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05}
    for kind in ("Adam", "AdamW", "adamw"):
        opt = loaded(tmp_path, {"optimizer": {"type": kind, "params": params}}).optimizer
        assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (2e-4, (0.8, 0.99), 1e-6, 0.05)
    adamw = {"type": "AdamW", "params": {"lr": 1e-4, "adam_w_mode": False}}  # AdamW either way, as DeepSpeed
    assert loaded(tmp_path, {"optimizer": adamw}).optimizer.adam_w_mode is True
    l2 = loaded(
        tmp_path, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.01}}}
    )
    assert l2.optimizer.adam_w_mode is False
    rendered = render_deepspeed(l2)["optimizer"]
    assert rendered["type"] == "Adam" and rendered["params"]["adam_w_mode"] is False
    check_with_deepspeed(render_deepspeed(l2))


@pytest.mark.parametrize(
    ("optimizer", "needle"),
    [
        ({"type": "Adam", "params": {"max_grad_norm": 1.0}}, 'write "gradient_clipping": 1.0 at the top level'),
        ({"type": "Lamb", "params": {"lr": 1e-3}}, 'optimizer.type: "Lamb" is not supported'),
        ({"type": "OneBitAdam"}, 'optimizer.type: "OneBitAdam" is not supported'),
        ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, 'optimizer.type: "SGD" is not supported'),
        ({"type": "AdamW", "params": {"weight_decya": 0.1}}, "weight_decya: not supported by pretrain (did you mean 'weight_decay'?)"),
        ({"type": "AdamW", "params": {"betas": [0.9, "0.95"]}}, "optimizer.params.betas: expected a list of numbers"),
        ("AdamW", 'optimizer: expected a mapping (a JSON object), got "AdamW" (a string)'),
    ],
)  # fmt: skip
def test_other_optimizers_are_refused_by_name(tmp_path, optimizer, needle):
    assert needle in problems(tmp_path, {"optimizer": optimizer})


# ---------------------------------------------------------------------------------------------
# DeepSpeed's own validators, every section


def test_every_section_is_checked_by_deepspeeds_validators_all_at_once(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {
            "stage": 3,
            "stage3_max_live_paramters": 1e9,
            "offload_param": {"device": "cpu", "buffer_cnt": 4},
            "sub_group_size": -1,
        },
        "fp16": {"enabled": False, "loss_scale_windw": 100},
        "bf16": {"enabled": True, "immediate_grad_updat": True},
        "tensorboard": {"enabled": False, "outptu_path": "x"},
        "activation_checkpointing": {"partition_activation": True},
        "flops_profiler": {"enabled": True, "profile_stp": 3},
        "comms_logger": {"enabled": True, "verbos": True},
        "prescale_gradients": "false",
        "aio": 4,
    }
    text = problems(tmp_path, ds)
    for needle in [
        "zero_optimization.stage3_max_live_paramters: unknown key (did you mean 'stage3_max_live_parameters'?)",
        "zero_optimization.offload_param.buffer_cnt: unknown key (did you mean 'buffer_count'?)",
        "zero_optimization.sub_group_size: Input should be greater than or equal to 0 (got -1)",
        "fp16.loss_scale_windw: unknown key (did you mean 'loss_scale_window'?)",
        "bf16.immediate_grad_updat: unknown key (did you mean 'immediate_grad_update'?)",
        "tensorboard.outptu_path",
        "activation_checkpointing.partition_activation: unknown key (did you mean 'partition_activations'?)",
        "flops_profiler.profile_stp: unknown key (did you mean 'profile_step'?)",
        "comms_logger.verbos: unknown key (did you mean 'verbose'?)",
        'prescale_gradients: expected true or false, got "false" (a string)',
        "aio: expected a mapping (a JSON object), got 4",
    ]:
        assert needle in text, (needle, text)
    assert text.count("tensorboard.outptu_path") == 1  # read back and DeepSpeed both see it: said once


def test_keys_deepspeed_removed_are_refused_with_its_reason(tmp_path):
    text = problems(tmp_path, {"elasticity": {"enabled": False}, "zero_optimization": {"mics_shard_size": 2}})
    assert "elasticity: Elastic training has been removed" in text
    assert "zero_optimization.mics_shard_size: MiCS ZeRO-3 sharding has been removed" in text


def test_deepspeed_stays_out_of_the_light_commands(tmp_path):
    path = CORPUS / "hf_zero3_auto.json"
    code = (
        "import sys\n"
        "import pretrain.cli\n"
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules\n"
        "from pretrain.cli import main\n"
        f"assert main(['launch-env', '--ds', {str(path)!r}, '--preset', 'gpt2-124m']) == 0\n"
        "assert main(['hostfile', 'hostfiles/a100x16']) == 0\n"
        "assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, 'imported'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------------------------------------
# Wrong types are errors, not defaults


@pytest.mark.parametrize(
    ("ds", "needle"),
    [
        ({"zero_optimization": 2}, "zero_optimization: expected a mapping (a JSON object), got 2"),
        ({"zero_optimization": True}, "zero_optimization: true is DeepSpeed's old boolean form"),
        ({"zero_optimization": {"stage": "2"}}, 'zero_optimization.stage: expected one of 0, 1, 2, 3, got "2" (a string)'),
        ({"zero_optimization": {"overlap_comm": "true"}}, 'zero_optimization.overlap_comm: expected true or false, got "true"'),
        ({"bf16": {"enabled": "false"}}, 'bf16.enabled: expected true or false, got "false" (a string)'),
        ({"fp16": True}, "fp16: expected a mapping (a JSON object), got true"),
        ({"scheduler": []}, "scheduler: expected a mapping (a JSON object), got []"),
        ({"train_micro_batch_size_per_gpu": 0, "train_batch_size": 64},
         "train_micro_batch_size_per_gpu: Input should be greater than or equal to 1 (got 0)"),
        ({"gradient_accumulation_steps": -2}, "gradient_accumulation_steps: Input should be greater than or equal to 1"),
        ({"zero_optimization": {"allgather_bucket_size": 0}}, "zero_optimization.allgather_bucket_size: Input should be greater than or equal to 1"),
        ({"train_batch_size": 2.5}, "train_batch_size: expected a whole number, got 2.5"),
        ({"zero_optimization": {"offload_optimizer": "cpu"}}, 'zero_optimization.offload_optimizer: expected a mapping (a JSON object), got "cpu"'),
        ({"gradient_clipping": "1.0"}, 'gradient_clipping: expected a number, got "1.0" (a string)'),
    ],
)  # fmt: skip
def test_wrong_types_are_errors(tmp_path, ds, needle):
    assert needle in problems(tmp_path, ds)


def test_the_batch_follows_deepspeeds_rule(tmp_path):
    def batch(ds: dict[str, Any], world: int | None = 8) -> tuple[Any, ...]:
        b = loaded(tmp_path, ds, world_size=world).batch
        return b.micro_batch_size, b.gradient_accumulation_steps, b.data_parallel_size

    assert batch({"train_batch_size": 64}) == (8, 1, 8)  # DeepSpeed: accumulation 1
    assert batch({"train_batch_size": 64, "gradient_accumulation_steps": 2}) == (4, 2, 8)
    assert batch({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2}) == (2, 4, 8)
    assert batch(
        {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}
    ) == (2, 4, 8)
    assert batch({"train_micro_batch_size_per_gpu": 2}) == (2, 1, 8)  # DeepSpeed: accumulation 1
    assert batch({"train_batch_size": 64}, world=None)[:2] == (12, 4)  # derived once the world is known
    assert (
        "train_batch_size (64) is not a multiple of gradient_accumulation_steps (1) x the world size (3)"
        in problems(tmp_path, {"train_batch_size": 64}, world_size=3)
    )


def test_a_world_size_mismatch_says_which_set_fixes_it():
    path = ROOT / "ds_configs" / "zero2_offload.json"  # micro 4 x accumulation 8 x 16 ranks
    with pytest.raises(ConfigError) as info:
        build(ds_file=path, world_size=2)
    text = str(info.value)
    assert "data_parallel_size (16) does not match the world size (2)" in text
    assert (
        "--set batch.data_parallel_size=2 (with --set batch.gradient_accumulation_steps=64 to keep 512"
        in text
    )
    fixed = build(
        ds_file=path,
        overrides=["batch.data_parallel_size=2", "batch.gradient_accumulation_steps=64"],
        world_size=2,
    )
    assert fixed.batch.train_batch_size == 512


# ---------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize("flag", ["--ds", "--deepspeed_config", "--deepspeed"])
def test_deepspeeds_flag_names_are_aliases_of_ds(flag):
    ap = parser()
    commands = [
        ["train"], ["prepare"], ["data", "prepare"], ["render"], ["config"], ["plan"],
        ["preflight", "--hostfile", "h"], ["launch-env"],
    ]  # fmt: skip
    for command in commands:
        assert ap.parse_args([*command, flag, "x.json"]).ds == "x.json", command


def test_config_command_with_a_rendered_json_alone(capsys):
    path = ROOT / "ds_configs" / "zero2_offload.json"
    assert main(["config", "--deepspeed_config", str(path), "--world-size", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("preset: gpt-6.7b\n") and "n_layer: 32" in out and "tokenizer: gpt2" in out


# ---------------------------------------------------------------------------------------------
# The corpus: tests/ds_json/, read with --preset gpt2-124m on 16 ranks

GPT2 = "gpt2-124m"  # micro 12 x accumulation 4, bf16, lr 6e-4, warmup 2000 of 600000 steps, ZeRO 1

LOADS: dict[str, dict[str, Any]] = {
    "ds_tutorial_bing_bert_squad_adam": {  # DeepSpeed's defaults for what the JSON leaves out
        "optimizer.bias_correction": False, "optimizer.fused_adam": True, "optimizer.lr": 3e-5,
        "optimizer.betas": (0.9, 0.999), "optimizer.eps": 1e-8, "optimizer.weight_decay": 0.0,
        "schedule.warmup_steps": 0, "schedule.decay": "constant", "precision.name": "fp16",
        "precision.loss_scale": 0.0, "precision.initial_scale_power": 16, "zero.stage": 0,
    },
    "ds_tutorial_cifar_linear_warmup": {
        "batch.micro_batch_size": 16, "batch.gradient_accumulation_steps": 1, "optimizer.lr": 1e-3,
        "optimizer.betas": (0.8, 0.999), "optimizer.weight_decay": 3e-7, "schedule.warmup_steps": 1000,
        "schedule.warmup_start_ratio": 0.0, "schedule.decay": "constant", "precision.name": "fp16",
        "schedule.warmup_type": "linear", "precision.initial_scale_power": 15, "precision.loss_scale_window": 500, "zero.stage": 0,
    },
    "ds_tutorial_lr_range_test_continuous": {
        "schedule.warmup_steps": 599_999, "optimizer.lr": pytest.approx(1e-4 * (1 + 599_999 / 200_000)),
        "schedule.min_lr_ratio": 1.0, "precision.name": "fp32", "batch.micro_batch_size": 32,
    },
    "ds_tutorial_megatron_gpt2_zero_offload": {
        "batch.micro_batch_size": 4, "batch.gradient_accumulation_steps": 2, "zero.stage": 2,
        "zero.offload_optimizer": True, "optimizer.weight_decay": 0.01, "precision.name": "fp16",
        "deepspeed_extra.activation_checkpointing.number_checkpoints": 4,
    },
    "ds_tutorial_warmup_cosine_flops_profiler": {
        "schedule.max_steps": 10_000, "schedule.warmup_steps": 500, "schedule.warmup_start_ratio": 0.0,
        "schedule.min_lr_ratio": 0.1, "optimizer.lr": 3e-4, "batch.gradient_accumulation_steps": 2,
        "deepspeed_extra.flops_profiler.profile_step": 10, "deepspeed_extra.comms_logger.prof_all": True,
    },
    "ds_tutorial_zero3_offload": {
        "zero.stage": 3, "zero.offload_optimizer": True, "zero.offload_param": True,
        "zero.reduce_bucket_size": 10_000_000, "precision.name": "bf16", "batch.micro_batch_size": 8,
        "deepspeed_extra.zero_optimization.stage3_prefetch_bucket_size": 1e7,
    },
    "hf_zero2_auto_linear_warmup": {
        "batch.micro_batch_size": 12, "batch.gradient_accumulation_steps": 4, "optimizer.lr": 6e-4,
        "schedule.warmup_steps": 2000, "schedule.warmup_start_ratio": pytest.approx(1e-6 / 6e-4),
        "schedule.decay": "constant", "precision.name": "bf16", "zero.stage": 2,
        "zero.reduce_bucket_size": 500_000_000, "zero.allgather_bucket_size": 200_000_000,
    },
    "ds_tutorial_cifar": {  # DeepSpeed's log warmup, its default
        "schedule.warmup_type": "log", "schedule.warmup_steps": 1000, "schedule.decay": "constant",
        "schedule.deepspeed_timing": True, "optimizer.lr": 1e-3, "precision.name": "fp16",
    },
    "hf_zero2_auto": {
        "schedule.warmup_type": "log", "schedule.decay": "constant", "optimizer.lr": 6e-4, "zero.stage": 2,
    },
    "hf_zero3_warmup_decay": {  # a linear decay back to the warmup's start
        "schedule.warmup_type": "log", "schedule.decay": "linear", "schedule.min_lr_ratio": 0.01,
        "schedule.max_steps": 600_000, "zero.stage": 3,
    },
    "hf_zero1_adam_l2": {  # Adam with L2 regularization, and no scheduler: a constant LR
        "optimizer.adam_w_mode": False, "schedule.warmup_steps": 0, "schedule.decay": "constant",
    },
    "gpt_neox_static_loss_scale": {
        "precision.loss_scale": 65536.0, "precision.name": "fp16", "optimizer.weight_decay": 0.0,
    },
    "hf_zero2_bf16_no_scheduler": {
        "precision.name": "bf16", "zero.stage": 2, "zero.offload_optimizer": False,
        "deepspeed_extra.fp16.auto_cast": False, "schedule.max_steps": 600_000,
    },
    "hf_zero3_auto": {
        "zero.stage": 3, "schedule.max_steps": 600_000, "schedule.warmup_steps": 2000,
        "schedule.min_lr_ratio": 0.1, "precision.name": "bf16", "batch.train_batch_size": 12 * 4 * 16,
        "deepspeed_extra.zero_optimization.stage3_prefetch_bucket_size": "auto",
    },
    "hf_zero3_offload_no_scheduler": {
        "zero.stage": 3, "zero.offload_optimizer": True, "zero.offload_param": True, "zero.pin_memory": True,
        "zero.overlap_comm": False, "precision.name": "bf16",
        "deepspeed_extra.zero_allow_untested_optimizer": True,
    },
    "megatron_deepspeed_gpt_125m": {
        "batch.micro_batch_size": 4, "batch.gradient_accumulation_steps": 4, "zero.stage": 0,
        "precision.name": "fp16", "precision.initial_scale_power": 11, "optimizer.lr": 6e-4,
    },
    "megatron_deepspeed_bf16_zero1": {
        "batch.micro_batch_size": 8, "batch.gradient_accumulation_steps": 4, "zero.stage": 1,
        "precision.name": "bf16", "precision.grad_accum_dtype": "fp32",
    },
    "gpt_neox_125m": {
        "batch.micro_batch_size": 4, "batch.gradient_accumulation_steps": 1, "optimizer.lr": 6e-4,
        "optimizer.betas": (0.9, 0.95), "optimizer.eps": 1e-8, "zero.stage": 1, "precision.name": "fp16",
        "zero.reduce_bucket_size": 500_000_000, "zero.offload_optimizer": False,
    },
    "gpt_neox_20b": {
        "batch.micro_batch_size": 4, "batch.gradient_accumulation_steps": 32, "optimizer.lr": 0.97e-4,
        "zero.allgather_bucket_size": 1_260_000_000, "precision.initial_scale_power": 12,
        "precision.name": "fp16",
    },
}  # fmt: skip

REFUSED: dict[str, list[str]] = {
    "ds_tutorial_megatron_gpt2_zero2": ['optimizer.params.max_grad_norm: DeepSpeed 0.19 refuses'],
        "ds_tutorial_bing_bert_lamb": ['optimizer.type: "Lamb" is not supported'],
    "ds_tutorial_zero_infinity_nvme": [
        "zero_optimization.offload_optimizer.device: NVMe offload",
        "zero_optimization.offload_param.device: NVMe offload",
    ],
    "ds_tutorial_onecycle": ["scheduler.params.cycle_second_step_size", "scheduler.params.cycle_momentum"],
    "ds_tutorial_lr_range_test": ["scheduler.params.lr_range_test_staircase"],
    "ds_tutorial_zero_optimization_int": ["zero_optimization: expected a mapping (a JSON object), got 2"],
    "ds_tutorial_micro_batch_zero": [
        "train_micro_batch_size_per_gpu: Input should be greater than or equal to 1 (got 0)",
        "gradient_accumulation_steps: Input should be greater than or equal to 1 (got -1)",
        "zero_optimization.reduce_bucket_size: Input should be greater than or equal to 1 (got 0)",
    ],
    "hf_zero2_string_values": [
        'zero_optimization.stage: expected one of 0, 1, 2, 3, got "2" (a string)',
        'zero_optimization.overlap_comm: expected true or false, got "true" (a string)',
        'zero_optimization.contiguous_gradients: expected true or false, got "false" (a string)',
        'zero_optimization.round_robin_gradients: expected true or false, got "true" (a string)',
        'bf16.enabled: expected true or false, got "true" (a string)',
    ],
    "hf_zero3_misspelt_knob": [
        "stage3_prefetch_bucket_sise: unknown key (did you mean 'stage3_prefetch_bucket_size'?)",
        "stage3_max_live_parameter: unknown key (did you mean 'stage3_max_live_parameters'?)",
    ],
    "megatron_deepspeed_curriculum_legacy": ["curriculum_learning: Legacy top-level 'curriculum_learning' has been removed"],
    "megatron_deepspeed_misspelt_sections": [
        "activation_checkpointing.partition_activation: unknown key (did you mean 'partition_activations'?)",
        'flops_profiler.enabled: expected true or false, got "yes" (a string)',
    ],
    "gpt_neox_onebitadam": ['optimizer.type: "OneBitAdam" is not supported'],
}  # fmt: skip


def test_the_corpus_is_covered():
    names = sorted(p.stem for p in CORPUS.glob("*.json"))
    assert names == sorted([*LOADS, *REFUSED])
    assert len(names) >= 20
    assert {n.split("_")[0] for n in names} == {"ds", "hf", "megatron", "gpt"}  # every style


@pytest.mark.parametrize("name", list(LOADS))
def test_corpus_json_loads_to_the_intended_tree(name):
    cfg = build_checked(CORPUS / f"{name}.json", preset=GPT2, world_size=16)
    for dotted, want in LOADS[name].items():
        assert at(cfg, dotted) == want, dotted
    ds = render_deepspeed(cfg)
    assert auto_paths(ds) == []  # no "auto" ever reaches DeepSpeed
    check_with_deepspeed(ds)


@pytest.mark.parametrize("name", list(REFUSED))
def test_corpus_json_is_refused_with_its_message(name):
    with pytest.raises(ConfigError) as info:
        build_checked(CORPUS / f"{name}.json", preset=GPT2, world_size=16)
    assert all(n in str(info.value) for n in REFUSED[name]), str(info.value)
    assert len(info.value.problems) == len(REFUSED[name])  # exactly these, nothing more


# ---------------------------------------------------------------------------------------------
# DeepSpeed's defaults, the keys it ignores, diagnostics


def test_left_out_values_take_deepspeeds_defaults_and_a_line_says_where_each_came_from(tmp_path, capsys):
    ds = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 3e-4}}}
    cfg = loaded(tmp_path, ds)  # gpt2-124m: betas (0.9, 0.95), decay 0.1, bf16, warmup + cosine
    o, s = cfg.optimizer, cfg.schedule
    assert (o.betas, o.eps, o.weight_decay, o.grad_clip) == ((0.9, 0.999), 1e-8, 0.0, 1.0)
    assert {lr_at(k, o.lr, s) for k in (0, 1, s.max_steps // 2, s.max_steps)} == {3e-4}  # no scheduler
    assert cfg.precision.name == "fp32" and cfg.batch.gradient_accumulation_steps == 1
    line = next(x for x in capsys.readouterr().err.splitlines() if "from DeepSpeed's defaults" in x)
    json_part, defaults, preset = line.split(": from the JSON: ")[1].split("; ")
    assert {"batch.micro_batch_size", "optimizer.lr"} <= set(json_part.split(", "))
    defaults = defaults.removeprefix("from DeepSpeed's defaults: ").split(", ")
    assert {"optimizer.betas", "optimizer.weight_decay", "optimizer.grad_clip", "precision.bf16"} <= set(
        defaults
    )
    assert "schedule.max_steps" in preset.removeprefix("from the preset (and any config file or override): ")


def test_keys_deepspeed_ignores_are_warnings_comments_are_silent_near_misses_are_errors(tmp_path, capsys):
    ds = {
        "_comment": "a note",
        "comms_config": {"verbose": False},
        "monitor_config": {"enabled": True},
        "train_micro_batch_size_per_gpu": 4,
    }
    loaded(tmp_path, ds)
    err = capsys.readouterr().err
    assert "warning:" in err and "'comms_config' is not a DeepSpeed config key" in err
    assert "'monitor_config' is not a DeepSpeed config key" in err and "_comment" not in err
    said = problems(tmp_path, {"gradient_cliping": 1.0, "train_micro_batch_size_per_gpu": 4, "bf16x": {}})
    assert "'gradient_cliping' is not a DeepSpeed config key (did you mean 'gradient_clipping'?)" in said
    assert "'bf16x' is not a DeepSpeed config key (did you mean 'bf16'?)" in said  # both at once


def test_diagnostics_keep_their_values_through_the_round_trip(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "wall_clock_breakdown": True,
        "steps_per_print": 10,
        "memory_breakdown": True,
        "flops_profiler": {"enabled": True, "profile_step": 3},
        "comms_logger": {"enabled": True, "verbose": False},
        "tensorboard": {"enabled": True, "output_path": "tb/"},
    }
    cfg = loaded(tmp_path, ds)
    out = render_deepspeed(cfg)
    diagnostics = (
        "wall_clock_breakdown",
        "steps_per_print",
        "memory_breakdown",
        "flops_profiler",
        "comms_logger",
    )
    assert {k: out[k] for k in diagnostics} == {k: ds[k] for k in diagnostics}
    assert cfg.logging.tensorboard and out["tensorboard"]["enabled"] is True
    check_with_deepspeed(out)


def test_every_problem_at_once_without_a_preset(tmp_path):
    path = write(tmp_path, {"train_micro_batch_size_per_gpu": 0, "gradient_cliping": 1.0})
    with pytest.raises(ConfigError) as info:
        build(ds_file=path, world_size=16)
    said = str(info.value)
    assert "pass --preset NAME" in said and "did you mean 'gradient_clipping'" in said
    assert "train_micro_batch_size_per_gpu" in said


def test_adam_without_bias_correction_is_deepspeeds_fused_adam(tmp_path):
    ds = {"optimizer": {"type": "Adam", "params": {"lr": 1e-4, "bias_correction": False}}}
    cfg = loaded(tmp_path, {**ds, "train_micro_batch_size_per_gpu": 4}, preset="tiny")
    assert (cfg.optimizer.bias_correction, cfg.optimizer.fused_adam) == (False, True)
    params = render_deepspeed(cfg)["optimizer"]["params"]
    assert params["bias_correction"] is False and params["torch_adam"] is False
    ds["optimizer"]["params"]["torch_adam"] = True  # torch.optim.AdamW always corrects
    said = problems(tmp_path, {**ds, "train_micro_batch_size_per_gpu": 4})
    assert "optimizer.bias_correction false needs DeepSpeed's FusedAdam or CPUAdam" in said
    assert "set optimizer.fused_adam=true" in said
    offload = ["optimizer.bias_correction=false", "zero.stage=2", "zero.offload_optimizer=true"]
    rendered = render_deepspeed(build("tiny", overrides=offload, world_size=1))
    assert rendered["optimizer"]["params"]["bias_correction"] is False  # DeepSpeedCPUAdam takes it
    with pytest.raises(ConfigError, match="bias_correction false needs"):
        build("tiny", overrides=["optimizer.bias_correction=false"], world_size=1)


def test_what_deepspeeds_zero_2_and_3_assert_at_initialize_is_refused_before(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_predivide_factor": 8, "prescale_gradients": True}
    assert loaded(tmp_path, ds, preset="tiny").zero.stage == 0  # as written: DeepSpeed runs it
    said = problems(tmp_path, {**ds, "zero_optimization": {"stage": 2}}, preset="tiny")
    assert "gradient_predivide_factor (8): DeepSpeed's ZeRO-2 and 3 refuse" in said
    assert "prescale_gradients: DeepSpeed's ZeRO-2 and 3 refuse" in said and "reduce_scatter false" in said
    off = {**ds, "zero_optimization": {"stage": 3, "reduce_scatter": False}}
    assert loaded(tmp_path, off, preset="tiny").zero.stage == 3


def test_a_foreign_monitor_path_is_said_to_be_replaced_by_the_run_dir(tmp_path, capsys):
    ds = {"tensorboard": {"enabled": True, "output_path": "logs/tb", "job_name": "exp1"}}
    cfg = loaded(tmp_path, ds)
    err = capsys.readouterr().err
    for k, v in (("output_path", "logs/tb"), ("job_name", "exp1")):
        assert (
            f'tensorboard.{k} ("{v}"): not used; pretrain writes tensorboard to {cfg.run_dir()}/tensorboard'
            in err
        )
    assert "set logging.run_dir to write it elsewhere" in err
    # a rendered JSON's own paths are the run dir's: nothing to say
    (tmp_path / "again").mkdir()
    loaded(tmp_path / "again", render_deepspeed(cfg))
    assert "not used" not in capsys.readouterr().err


def test_auto_zero3_knobs_are_sized_alike_under_either_name(tmp_path):
    """DeepSpeed reads stage3_prefetch_bucket_size and prefetch_bucket_size (and the persistence
    threshold's two names) as one field: "auto" sizes both from n_embd."""
    by_name = {}
    for prefetch, persist in (
        ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"),
        ("prefetch_bucket_size", "param_persistence_threshold"),
    ):
        zero = {"stage": 3, prefetch: "auto", persist: "auto"}
        (tmp_path / prefetch).mkdir()
        out = render_deepspeed(loaded(tmp_path / prefetch, {"zero_optimization": zero}))["zero_optimization"]
        by_name[prefetch] = (out[prefetch], out[persist])
    (a, b), (c, d) = by_name.values()
    assert (a, b) == (c, d) and a > 0 and b > 0
