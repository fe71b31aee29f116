"""DeepSpeed's private attributes that this project touches, all in training/distributed/ds_internals.py, each
checked here against the installed DeepSpeed: after an upgrade this file says what moved."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from pretrain.training.distributed import ds_internals

PACKAGE = Path(__file__).resolve().parent.parent / "pretrain"
# The private names DeepSpeed defines that ds_internals reaches for.
PRIVATE = {
    "_grid",
    "_local_start",
    "_config",
    "_init_tp_mesh_device",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "build_shm_op",
    "checkpoint_engine",  # public in name, but DeepSpeed offers no way to set it (set_checkpoint_engine)
}


def _source(dotted: str) -> str:
    module, _, name = dotted.rpartition(".")
    return inspect.getsource(getattr(importlib.import_module(module), name))


def test_the_private_names_are_touched_in_ds_internals_only():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "ds_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} .{node.attr}")
    assert found == [], "DeepSpeed's private attributes belong in training/distributed/ds_internals.py"


@pytest.mark.parametrize(
    "where, what",
    [
        ("deepspeed.comm.torch", "build_shm_op"),
        ("deepspeed.utils.groups", "_init_tp_mesh_device"),
        ("deepspeed.utils.groups", "_TENSOR_MODEL_PARALLEL_GROUP"),
    ],
)
def test_module_attributes_exist(where, what):
    module = importlib.import_module(where)
    assert hasattr(module, what), (
        f"{where}.{what} is gone from DeepSpeed {importlib.import_module('deepspeed').__version__} "
        f"(ds_internals was checked on {ds_internals.CHECKED_ON}): see ds_internals.py"
    )


@pytest.mark.parametrize(
    "where, assigned",
    [
        ("deepspeed.runtime.pipe.module.PipelineModule", ["self._grid", "self._local_start"]),
        ("deepspeed.runtime.engine.DeepSpeedEngine", ["self._config"]),
        (
            "deepspeed.runtime.config.DeepSpeedConfig",
            ["self.gradient_clipping", "self.load_universal_checkpoint"],
        ),
    ],
)
def test_instance_attributes_are_still_set(where, assigned):
    """The attributes ds_internals reads or writes on DeepSpeed's objects are still set by them."""
    source = _source(where)
    missing = [a for a in assigned if f"{a} =" not in source]
    assert missing == [], f"{where} no longer sets {missing} (checked on {ds_internals.CHECKED_ON})"


def test_the_engine_reads_what_ds_internals_writes():
    """The engine reads its copies of gradient_clipping and load_universal_checkpoint (set per load
    by `load_universal_next`) where it clips and loads."""
    source = _source("deepspeed.runtime.engine.DeepSpeedEngine")
    assert "return self._config.gradient_clipping" in source
    assert "return self._config.load_universal_checkpoint" in source


def test_the_checkpoint_engine_is_set_by_the_engine_alone_and_used_for_every_save_and_load():
    """`deepspeed.initialize` takes no checkpoint engine (the day it does, set_checkpoint_engine goes);
    the engine builds its own in `_configure_checkpointing` and saves and loads through it."""
    import deepspeed

    assert "checkpoint_engine" not in inspect.signature(deepspeed.initialize).parameters
    source = _source("deepspeed.runtime.engine.DeepSpeedEngine")
    assert "self.checkpoint_engine = create_checkpoint_engine(" in source
    for call in (
        "self.checkpoint_engine.save(",
        "self.checkpoint_engine.load(",
        "self.checkpoint_engine.commit(",
    ):
        assert call in source, f"{call} (checked on {ds_internals.CHECKED_ON})"
    assert "checkpoint_engine.save(" in _source("deepspeed.runtime.pipe.module.PipelineModule")


def test_skip_shm_comm_op_leaves_a_callable_that_builds_nothing():
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    before = ds_torch.build_shm_op
    try:
        ds_internals.skip_shm_comm_op()
        assert ds_torch.build_shm_op() is None
    finally:
        ds_torch.build_shm_op = before


# The DeepSpeed versions the distributed tier (`pytest -m distributed`) was run on, with torch 2.13.0
# (docs/dependencies.md). pyproject.toml's range starts at the oldest that passed and stops below the
# next minor version.
CHECKED_VERSIONS = {
    "0.19.8": "passes",
    "0.19.0": "fails: AutoTP has no vocab_parallel_lm_head (tensor parallel); ZeRO-3 resume and accumulation differ",
    "0.18.9": "fails: ZeRO-1/2's all-gather writes into a view of torch.split (torch 2.13 refuses it)",
    "0.17.6": "not run past tests/test_distributed.py (passes), below 0.19.0",
    "0.16.9": "fails: no CheckpointCommitInfo (deepspeed.runtime.checkpoint_engine)",
}


def test_pyprojects_deepspeed_range_is_the_tested_one():
    import re

    from packaging.version import Version

    spec = re.findall(r'^\s*"(deepspeed[<>=].*)",', (PACKAGE.parent / "pyproject.toml").read_text(), re.M)[0]
    passed = sorted((Version(v) for v, said in CHECKED_VERSIONS.items() if said == "passes"))
    below = Version(f"{passed[-1].major}.{passed[-1].minor + 1}")
    assert spec == f"deepspeed>={passed[0]},<{below.major}.{below.minor}"
    assert (
        ds_internals.CHECKED_ON in CHECKED_VERSIONS and CHECKED_VERSIONS[ds_internals.CHECKED_ON] == "passes"
    )


def test_the_installed_deepspeed_is_in_the_tested_range():
    """Fails on a DeepSpeed outside pyproject.toml's range, as `pretrain` refuses to run on it."""
    from pretrain.cluster import environment

    installed, spec = environment.deepspeed_range()
    assert installed is not None and spec == ">=0.19.8,<0.20", (installed, spec)
    assert environment.deepspeed_problem(installed, spec) is None
    said = environment.deepspeed_problem("0.18.9", spec)
    assert said == (
        "DeepSpeed 0.18.9 is installed, and pretrain is tested on deepspeed>=0.19.8,<0.20 (docs/dependencies.md): "
        "pip install 'deepspeed>=0.19.8,<0.20', or set PRETRAIN_UNTESTED_DEEPSPEED=1 to run on 0.18.9 anyway"
    )
    assert environment.deepspeed_problem("0.20.0", spec) is not None
    assert environment.deepspeed_problem("0.19.9+cu128", spec) is None
