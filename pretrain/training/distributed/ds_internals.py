"""Every place this project reaches into DeepSpeed's private attributes, in one room: each is a
function naming what it touches and why, and tests/test_ds_internals.py checks that each still
exists in the installed DeepSpeed. Checked on DeepSpeed 0.19.8 (`CHECKED_ON`); after an upgrade,
that test is the first to run.
"""

from __future__ import annotations

import importlib
from typing import Any

CHECKED_ON = "0.19.8"


def skip_shm_comm_op() -> None:
    """Keep DeepSpeed's CPU backend from building and loading its shared-memory all-reduce op.

    On every start on the CPU, DeepSpeed's torch backend probes the compatibility of all its ops
    (compiling a test program for libaio: 0.3 s), then loads `deepspeed_shm_comm`, a C++ op it
    JIT-builds with ninja (35 s on this 2-core machine) the first time in each environment, and
    again whenever another environment has built it into the shared torch-extensions cache, and
    maps shared memory for the ranks of a host. The op serves only `inference_all_reduce`, which
    DeepSpeed's tensor-parallel inference layers call and which falls back to torch.distributed
    without it; training's collectives go through torch.distributed (gloo) either way.
    """
    # By module name: the attribute `deepspeed.comm.torch` is torch itself (re-exported by comm)
    ds_torch: Any = importlib.import_module("deepspeed.comm.torch")
    if callable(getattr(ds_torch, "build_shm_op", None)):  # a DeepSpeed without it: nothing to skip
        ds_torch.build_shm_op = lambda: None  # what it returns where the op cannot be built


def init_tensor_mesh(tensor: int) -> Any:
    """DeepSpeed's data x tensor mesh of AutoTP (`groups._init_tp_mesh_device`, private), built before
    `deepspeed.initialize` and passed as its `mpu`; returns the `groups` module that serves it."""
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=tensor)
    return groups


def set_tensor_group(group: Any) -> None:
    """Point DeepSpeed's global tensor-parallel group (`groups._TENSOR_MODEL_PARALLEL_GROUP`) at a
    pipeline stage's own: AutoTP's training layers ask `groups` for it, and under pipeline
    parallelism the engine never builds AutoTP's mesh."""
    from deepspeed.utils import groups

    groups._TENSOR_MODEL_PARALLEL_GROUP = group


def stage_grid(module: Any) -> Any:
    """A PipelineModule's topology grid (`_grid`), built before its layers."""
    return module._grid


def stage_start(module: Any) -> int:
    """The index of a PipelineModule's first local layer (`_local_start`)."""
    return int(module._local_start)


def turn_off_engine_clipping(engine: Any) -> None:
    """The engine's own copy of `gradient_clipping` (`engine._config`) set to 0, where the loop clips
    instead; the rendered JSON keeps the value."""
    engine._config.gradient_clipping = 0.0


def load_universal_next(engine: Any, universal: bool) -> None:
    """Whether the engine's next `load_checkpoint` reads a universal checkpoint
    (`engine._config.load_universal_checkpoint`, read only while loading)."""
    engine._config.load_universal_checkpoint = universal


def get_checkpoint_engine(engine: Any) -> Any:
    """The CheckpointEngine the engine saves and loads through (`engine.checkpoint_engine`)."""
    return engine.checkpoint_engine


def set_checkpoint_engine(engine: Any, checkpoint_engine: Any) -> None:
    """Make `checkpoint_engine` (a `CheckpointEngine`) the one the engine saves and loads through.

    DeepSpeed 0.19 has no public way to pass a checkpoint engine of one's own: `deepspeed.initialize`
    takes none, and `_configure_checkpointing` builds one of its own kinds (torch.save, its fast or
    decoupled writers, DataStates) from the config's `checkpoint.writer` and `datastates` keys. Every
    save and load of the engine and of a PipelineModule then calls `engine.checkpoint_engine`'s methods,
    so this one assignment, after `deepspeed.initialize`, is where ours goes in."""
    engine.checkpoint_engine = checkpoint_engine
