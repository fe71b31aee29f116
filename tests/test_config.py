"""The settings tree: validation, DeepSpeed rendering and read-back, ds_configs/ in sync."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

from pretrain.config.ds_configs import DS_CONFIG_RENDERS, render_file
from pretrain.config.ds_keys import DEEPSPEED_PASSTHROUGH_KEYS
from pretrain.config.ds_read import tree_from_deepspeed
from pretrain.config.ds_render import check_with_deepspeed, render_deepspeed
from pretrain.config.loading import deep_merge
from pretrain.config.presets import PRESETS, build
from pretrain.config.tree import InitFromConfig, RunConfig, validate
from pretrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def problems_of(data: dict, world_size: int | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate(data, world_size)
    return info.value.problems


def test_defaults_are_valid_and_resolve_the_batch():
    cfg = validate({}, world_size=2)
    assert cfg.batch.data_parallel_size == 2
    assert (
        cfg.batch.train_batch_size == cfg.batch.micro_batch_size * cfg.batch.gradient_accumulation_steps * 2
    )
    assert (
        cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.eps == 1e-8 and cfg.optimizer.weight_decay == 0.1
    )
    assert cfg.optimizer.grad_clip == 1.0


def test_the_batch_reads_as_an_int_once_resolved():
    resolved = validate({"batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 3}}, world_size=2)
    assert resolved.batch.sequences == 4 * 3 * 2
    assert resolved.batch.model_dump()["train_batch_size"] == 24  # derived in the tree, as rendered
    unresolved = validate({})
    assert unresolved.batch.data_parallel_size is None and unresolved.batch.train_batch_size is None
    with pytest.raises(ConfigError, match="unresolved: pass a world size"):
        _ = unresolved.batch.sequences
    given = validate({"batch": {"micro_batch_size": 4, "data_parallel_size": 2}})  # no world size needed
    assert given.batch.sequences == 8


def test_every_field_has_a_description():
    def walk(model: type) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(f"{model.__name__}.{name}")
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                missing += walk(ann)
        return missing

    assert walk(RunConfig) == []


def test_field_errors_name_every_bad_field_at_once():
    problems = problems_of(
        {
            "model": {"n_layer": 0, "n_headz": 2},
            "optimizer": {"lr": -1, "betas": [0.9, 1.5]},
            "zero": {"stage": 5},
            "batch": {"micro_batch_size": "many"},
        }
    )
    text = "\n".join(problems)
    for where in [
        "model.n_layer",
        "model.n_headz",
        "optimizer.lr",
        "optimizer.betas.1",
        "zero.stage",
        "batch.micro_batch_size",
    ]:
        assert where in text, (where, text)
    assert "did you mean 'n_head'" in text


def test_cross_field_rules_are_all_reported_together():
    problems = problems_of(
        {
            "model": {"n_embd": 100, "n_head": 3},
            "zero": {"stage": 2, "offload_param": True},
            "precision": {"bf16": True, "fp16": True},
            "batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "data_parallel_size": 4},
        },
        world_size=2,
    )
    text = "\n".join(problems)
    assert "n_embd (100) must be divisible by n_head (3)" in text
    assert "offload_param needs stage 3" in text
    assert "bf16 and fp16 cannot both be on" in text
    assert "data_parallel_size (4) does not match the world size (2)" in text
    assert len(problems) == 4


def test_train_batch_size_mismatch_is_an_error():
    problems = problems_of(
        {"batch": {"micro_batch_size": 4, "gradient_accumulation_steps": 2, "train_batch_size": 10}},
        world_size=2,
    )
    assert any("train_batch_size (10)" in p and "= 16" in p for p in problems)


def test_overrides_and_config_file(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("preset: small\nmodel:\n  n_layer: 3\nschedule:\n  max_steps: 50\n  warmup_steps: 5\n")
    cfg = build(config_file=run, overrides=["model.n_head=2", "optimizer.betas=[0.8, 0.9]", "zero.stage=2"])
    assert cfg.preset == "small" and cfg.model.n_embd == 256
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.optimizer.betas, cfg.zero.stage) == (3, 2, (0.8, 0.9), 2)
    with pytest.raises(ConfigError, match="expected key=value"):
        build(overrides=["model.n_layer"])
    with pytest.raises(ConfigError, match=r"model\.n_layer"):
        build(overrides=["model.n_layer=-3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        build(config_file=bad)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_validate(name):
    # 16 ranks (hostfiles/a100x16), or the fewest its tensor x pipeline layout divides into
    par = build(name).parallel
    cfg = build(name, world_size=math.lcm(16, par.tensor * par.pipeline))
    assert cfg.batch.data_parallel_size == math.lcm(16, par.model_parallel) // par.model_parallel


@pytest.mark.parametrize(
    "overrides",
    [
        ["zero.stage=0"],
        ["zero.stage=0", "optimizer.torch_fused=false"],
        ["zero.stage=1", "precision.bf16=true", "optimizer.fused_adam=true"],
        [
            "zero.stage=2",
            "zero.offload_optimizer=true",
            "precision.fp16=true",
            "batch.gradient_accumulation_steps=4",
        ],
        ["zero.stage=3", "zero.offload_param=true", "zero.offload_optimizer=true"],
        ["logging.tensorboard=false"],
        ["logging.csv_monitor=true", "logging.wandb=true", "logging.wandb_group=ablations"],
        ["deepspeed_extra={comet: {enabled: false}}"],
    ],
)
def test_render_then_read_back_is_the_same_tree(overrides):
    cfg = build("tiny", overrides=overrides, world_size=2)
    ds = render_deepspeed(cfg)
    check_with_deepspeed(ds)
    back = validate(
        deep_merge(
            cfg.model_dump(exclude={"batch", "optimizer", "precision", "zero", "deepspeed_extra"}),
            tree_from_deepspeed(ds),
        ),
        world_size=2,
    )
    assert back == cfg
    assert render_deepspeed(back) == ds


def test_ds_read_back_passes_known_keys_through_and_names_unknown_ones():
    ds = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"]["stage3_prefetch_bucket_size"] = 5e7
    ds["flops_profiler"] = {"enabled": False}
    tree = tree_from_deepspeed(ds)
    assert tree["deepspeed_extra"] == {
        "zero_optimization": {"stage3_prefetch_bucket_size": 5e7},
        "flops_profiler": {"enabled": False},
    }
    cfg = validate(tree, world_size=16)
    out = render_deepspeed(cfg)
    assert out["zero_optimization"]["stage3_prefetch_bucket_size"] == 5e7
    assert out["flops_profiler"] == {"enabled": False}
    check_with_deepspeed(out)

    ds["gradient_clippping"] = 1.0
    ds["optimizer"]["params"]["amsgrad"] = True
    with pytest.raises(ConfigError) as info:
        tree_from_deepspeed(ds)
    text = str(info.value)
    assert "'gradient_clippping' is not a DeepSpeed config key (did you mean 'gradient_clipping'?)" in text
    assert "optimizer.params.amsgrad" in text


def test_ds_parser_rejects_unknown_zero_key():
    cfg = build("tiny", overrides=["deepspeed_extra={zero_optimization: {stage3_bogus: 1}}"], world_size=1)
    with pytest.raises(ConfigError, match="stage3_bogus"):
        check_with_deepspeed(render_deepspeed(cfg))


def test_passthrough_keys_are_real_deepspeed_keys():
    """Every key we pass through is a string literal somewhere in DeepSpeed's config code."""
    import deepspeed

    root = Path(deepspeed.__file__).parent
    literals: set[str] = set()
    for path in [
        *root.glob("runtime/**/*.py"),
        *root.glob("monitor/*.py"),
        *root.glob("profiling/**/*.py"),
        *root.glob("elasticity/*.py"),
        *root.glob("autotuning/*.py"),
        *root.glob("compression/*.py"),
        *root.glob("comm/*.py"),
        *root.glob("nebula/*.py"),
        *root.glob("inference/**/*.py"),
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.add(node.value)
    assert sorted(DEEPSPEED_PASSTHROUGH_KEYS - literals) == []


@pytest.mark.parametrize("name", list(DS_CONFIG_RENDERS))
def test_ds_configs_are_in_sync_and_accepted_by_deepspeed(name):
    preset, overrides, world = DS_CONFIG_RENDERS[name]
    path = ROOT / "ds_configs" / f"{name}.json"
    assert path.read_text() == render_file(preset, overrides, world), (
        f"{path} is out of date: run `pretrain render --all`"
    )
    for required in [
        "zero1",
        "zero2",
        "zero2_offload",
        "zero3",
        "zero3_offload",
        "llama7b_2x8",
        "llama70b_8x8",
    ]:
        assert required in DS_CONFIG_RENDERS


def test_every_file_in_ds_configs_is_a_render_the_tests_keep_in_sync():
    assert sorted(p.stem for p in (ROOT / "ds_configs").glob("*.json")) == sorted(DS_CONFIG_RENDERS)


def test_zero2_offload_is_the_a100x16_6p7b_config():
    ds = json.loads((ROOT / "ds_configs" / "zero2_offload.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["bf16"]["enabled"] is True
    cfg = build("gpt-6.7b", ds_file=ROOT / "ds_configs" / "zero2_offload.json", world_size=16)
    assert cfg.batch.data_parallel_size == 16
    with pytest.raises(ConfigError, match="does not match the world size"):
        build("gpt-6.7b", ds_file=ROOT / "ds_configs" / "zero2_offload.json", world_size=2)


def test_monitors_render_under_the_run_dir_and_read_back():
    cfg = build(
        "tiny",
        overrides=["logging.run_dir=/tmp/r1", "logging.csv_monitor=true", "logging.wandb=true"],
        world_size=1,
    )
    ds = render_deepspeed(cfg)
    assert ds["tensorboard"] == {"enabled": True, "output_path": "/tmp/r1", "job_name": "tensorboard"}
    assert ds["csv_monitor"] == {"enabled": True, "output_path": "/tmp/r1", "job_name": "csv_monitor"}
    assert ds["wandb"] == {"enabled": True, "project": "pretrain"}
    check_with_deepspeed(ds)
    # DeepSpeed's own monitor config parser sees them enabled
    from deepspeed.monitor.config import get_monitor_config

    assert get_monitor_config(ds).enabled
    off = render_deepspeed(build("tiny", overrides=["logging.tensorboard=false"], world_size=1))
    assert not {"tensorboard", "csv_monitor", "wandb"} & set(off)


def test_foreign_monitor_sections_read_back_into_logging():
    tree = tree_from_deepspeed(
        {"train_micro_batch_size_per_gpu": 2, "wandb": {"enabled": True, "project": "p", "team": "t"}}
    )
    assert tree["logging"] == {
        "wandb": True,
        "wandb_project": "p",
        "wandb_team": "t",
        "tensorboard": False,  # absent from a DeepSpeed JSON means off
        "csv_monitor": False,
    }
    assert "deepspeed_extra" not in tree
    with pytest.raises(ConfigError) as info:
        tree_from_deepspeed({"tensorboard": {"enabled": True, "outptu_path": "x"}, "csv_monitor": {"foo": 1}})
    assert "tensorboard.outptu_path" in str(info.value) and "csv_monitor.foo" in str(info.value)
    with pytest.raises(ConfigError, match="modeled by the tree"):
        validate({"deepspeed_extra": {"tensorboard": {"enabled": True}}})


# ---------------------------------------------------------------------------------------------
# Tensor and pipeline parallelism


def test_the_data_parallel_size_is_what_tensor_and_pipeline_leave():
    cfg = build("tiny", overrides=["parallel.tensor=2", "parallel.pipeline=2", "zero.stage=1"], world_size=8)
    assert cfg.batch.data_parallel_size == 2
    assert (
        cfg.batch.train_batch_size == cfg.batch.micro_batch_size * cfg.batch.gradient_accumulation_steps * 2
    )
    with pytest.raises(ConfigError) as e:  # a given data-parallel size must be what the layout leaves
        build("tiny", overrides=["parallel.tensor=2", "batch.data_parallel_size=4"], world_size=4)
    assert "data_parallel_size (4) does not match world size / (tensor x pipeline) (4 / 2 = 2)" in str(
        e.value
    )
    assert "--set batch.data_parallel_size=2" in str(e.value)


def test_every_impossible_layout_is_named_at_once():
    overrides = [
        "model.n_head=4", "model.n_embd=64", "model.n_layer=2", "model.intermediate_size=100",
        "parallel.tensor=3", "parallel.pipeline=3", "zero.stage=2", "zero.offload_optimizer=true",
        "compile.enabled=true",
    ]  # fmt: skip
    with pytest.raises(ConfigError) as e:
        build("tiny", overrides=overrides, world_size=8)
    text = str(e.value)
    for needle in (
        "parallel.tensor (3) must divide model.n_head (4)",
        "parallel.tensor (3) must divide the MLP width (100",
        "parallel.pipeline (3) exceeds model.n_layer (2)",
        "zero.stage 2: DeepSpeed's pipeline engine combines with ZeRO stage 0 or 1 only",
        "zero.offload_optimizer: not supported here",
        "compile.enabled",
        "tensor (3) x pipeline (3) = 9 does not divide the world size (8)",
    ):
        assert needle in text, (needle, text)
    with pytest.raises(ConfigError) as e:  # grouped-query attention: the key/value heads split too
        build(
            "tiny", overrides=["model.arch=llama", "model.n_head=4", "model.n_kv_head=1", "parallel.tensor=2"]
        )
    assert "must divide model.n_kv_head (1)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build("tiny", overrides=["parallel.tensor=2", "zero.stage=3"])
    assert "zero.stage 3" in str(e.value)
    with pytest.raises(ConfigError) as e:  # DeepSpeed's stage-0 clipping under a pipeline is wrong
        build("tiny", overrides=["parallel.pipeline=2", "zero.stage=0"])
    assert "zero.stage=1" in str(e.value) and "grad_clip=0" in str(e.value)
    build("tiny", overrides=["parallel.pipeline=2", "zero.stage=0", "optimizer.grad_clip=0"])
    with pytest.raises(ConfigError) as e:
        build("tiny", overrides=["parallel.activation_checkpoint_interval=1"])
    assert "model.activation_checkpointing=true" in str(e.value)


def test_tensor_and_pipeline_sections_render_and_read_back():
    cfg = build(
        "tiny",
        overrides=["model.arch=llama", "model.n_head=4", "model.n_kv_head=2", "parallel.tensor=2",
                   "parallel.pipeline=2", "zero.stage=1", "model.activation_checkpointing=true"],
        world_size=8,
    )  # fmt: skip
    ds = render_deepspeed(cfg)
    tp = ds["tensor_parallel"]
    assert tp["autotp_size"] == 2
    c_attn, _, c_fc, _ = tp["partition_config"]["layer_specs"]
    assert c_attn["shape"] == [[128, 64, 64], -1]  # q, k, v split each on its own: whole heads a rank
    assert c_fc["shape"] == [2, -1]  # SwiGLU's [gate; up]
    assert ds["pipeline"] == {"stages": 2, "partition": "parameters", "activation_checkpoint_interval": 1}
    check_with_deepspeed(ds)
    base = cfg.model_dump(mode="json")
    back = validate(deep_merge(base, tree_from_deepspeed(ds, base=base, world_size=8)), 8)
    assert back.parallel == cfg.parallel and back.batch == cfg.batch
    # DeepSpeed's own defaults and "off" keep the tree's values
    read = tree_from_deepspeed(
        {"pipeline": {"stages": "auto", "partition": "best"}, "tensor_parallel": {"autotp_size": 0}}
    )
    assert read.get("parallel") == {"tensor": 1}


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("model:\n  n_layer: true\n", "n_layer: true is a yes/no, not a number"),
        ("model:\n  n_layer: 010\n", "010: a number with a leading 0 reads as octal in YAML (8)"),
        ("optimizer:\n  lr: false\n", "lr: false is a yes/no, not a number"),
    ],
)
def test_a_yes_no_or_an_octal_where_a_number_goes_is_refused(source, needle, tmp_path):
    """`n_layer: true` became 1 and `n_layer: 010` became 8, silently."""
    from pretrain.config.presets import build

    path = tmp_path / "run.yaml"
    path.write_text(source)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build("tiny", config_file=path)
    key, value = source.split(":")[0], source.split(":")[2].strip()
    field = source.split("\n")[1].split(":")[0].strip()
    with pytest.raises(
        ConfigError, match=re.escape(needle.split(" reads")[0] if "octal" in needle else needle)
    ):
        build("tiny", overrides=[f"{key}.{field}={value}"])
    assert (
        build("tiny", overrides=["model.bias=true", "model.n_layer=3"]).model.n_layer == 3
    )  # bools stay bools


def test_a_sections_own_problem_and_one_across_sections_are_listed_together():
    """A section's rule that failed kept pydantic from the rules across sections: only the warmup was
    listed, not the tensor degree the model cannot take."""
    with pytest.raises(ConfigError) as e:
        build("tiny", overrides=["schedule.max_steps=3", "schedule.warmup_steps=5", "parallel.tensor=3"])
    assert e.value.problems[0] == "schedule: warmup_steps (5) must be below max_steps (3)"
    assert any(p.startswith("parallel.tensor (3) must divide model.n_head (2)") for p in e.value.problems)
    # a field that does not validate still stops there: the rules need every field
    with pytest.raises(ConfigError) as e:
        build("tiny", overrides=["model.n_layer=0", "parallel.tensor=3"])
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith("model.n_layer")


def test_the_run_banner_names_the_model_it_trains():
    """The preset's model by the preset's name; a changed model as the run's own; init_from by its
    directory (the banner said `tiny:` for all three)."""
    from pretrain.training.run import _model_name

    assert _model_name(build(preset="tiny", overrides=["model.vocab_size=77"])) == "tiny preset"
    assert _model_name(build(preset="tiny", overrides=["model.n_layer=3"])) == (
        "own model (gpt2, from the tiny preset's defaults)"
    )
    cfg = build(preset="tiny")
    cfg.model.init_from = InitFromConfig(path="/models/llama-local")
    assert _model_name(cfg) == "llama-local (model.init_from)"
