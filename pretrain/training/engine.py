"""Process group, model construction and `deepspeed.initialize`: where the GPT meets DeepSpeed."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from pretrain.cluster.hardware import set_tf32
from pretrain.cluster.launch import launcher
from pretrain.cluster.ops import wait_for_op_builds
from pretrain.cluster.reach import free_port, who_holds
from pretrain.config.tree import RunConfig
from pretrain.errors import ConfigError, LaunchError, require
from pretrain.training import init_from
from pretrain.training.init_from import Source
from pretrain.training.model import GPT, init_seed, param_groups


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, msg: str) -> None:
        """Print on rank 0 only: every rank runs the same code, the terminal gets one copy."""
        if self.is_main:
            print(msg, flush=True)


def launch_env() -> Dist:
    """Rank and world size, as whatever started this process says, exported for torch.distributed.

    In order:
    - `RANK` already set: deepspeed's launcher (pdsh, `--no_ssh`), torchrun;
    - a Slurm job step (`srun`, as launch/slurm.sbatch starts the ranks): SLURM_PROCID and friends,
      with MASTER_ADDR/MASTER_PORT from the batch script;
    - an MPI launcher (`mpirun`, launch/mpirun.sh): rank, size and the ranks sharing this host from
      mpi4py, rank 0's host name as master unless MASTER_ADDR is set;
    - nothing: a plain `pretrain train`, rank 0 of 1 on loopback.
    Setting the variables here also keeps DeepSpeed from its own MPI discovery, which would take
    the master address from the first address of `hostname -I`.
    """
    kind = launcher()
    if kind != "env":
        if kind == "slurm":
            _env_from_slurm()
        elif kind == "mpi":
            _env_from_mpi()
        else:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
    world = int(os.environ["WORLD_SIZE"])
    return Dist(
        rank=int(os.environ["RANK"]),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", str(world)))),
    )


def _env_from_slurm() -> None:
    e = os.environ
    if "MASTER_ADDR" not in e:
        raise RuntimeError(
            "started by srun without MASTER_ADDR: submit with launch/slurm.sbatch, which sets it to the "
            "first host of the allocation, or export MASTER_ADDR (and MASTER_PORT) before srun"
        )
    # Tasks per node of this step, e.g. "8(x2)" or "2,1": take this node's entry.
    per_node = [
        int(n)
        for part in e.get("SLURM_STEP_TASKS_PER_NODE", e["SLURM_STEP_NUM_TASKS"]).split(",")
        for n, _, times in [part.partition("(x")]
        for _ in range(int(times.rstrip(")") or 1))
    ]
    local_world = str(per_node[min(int(e.get("SLURM_NODEID", "0")), len(per_node) - 1)])
    e.update(
        RANK=e["SLURM_PROCID"],
        WORLD_SIZE=e["SLURM_STEP_NUM_TASKS"],
        LOCAL_RANK=e.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=local_world,
    )
    e.setdefault("MASTER_PORT", "29500")


def _env_from_mpi() -> None:
    # Only under an MPI launcher: importing it initialises MPI.
    MPI = require("mpi4py.MPI", "an MPI launcher (mpirun, srun --mpi)", "mpi")

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    expected = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
    if expected is not None and int(expected) != size:
        raise RuntimeError(
            f"the launcher started {expected} ranks but mpi4py sees a world of {size}: mpi4py loaded "
            f"another MPI than the launcher's ({MPI.Get_library_version().splitlines()[0]}). Under Open "
            "MPI's mpirun set MPI4PY_MPIABI=openmpi (launch/mpirun.sh does), under MPICH's mpirun unset it"
        )
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)  # the ranks on this host
    master = comm.bcast(
        (os.environ.get("MASTER_ADDR") or socket.gethostname(), os.environ.get("MASTER_PORT") or "29500"),
        root=0,
    )
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(node.Get_rank()),
        LOCAL_WORLD_SIZE=str(node.Get_size()),
        MASTER_ADDR=master[0],
        MASTER_PORT=master[1],
    )
    node.Free()


def init_distributed(dist: Dist, timeout_s: float = 1800) -> None:
    """Join the process group: NCCL on CUDA, gloo on the CPU (DeepSpeed picks by accelerator).

    Each rank drives the accelerator LOCAL_RANK of its host. A collective that waits on a dead or
    stuck rank for `timeout_s` (config `launch.collective_timeout_s`) fails instead of hanging.
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    # DeepSpeed picks its accelerator when first imported: here and below, only after this line.
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu":
        # Ranks on one host share its cores; oversubscribed BLAS threads slow everything down.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.local_world_size))
        skip_shm_comm_op()
    else:
        accel.set_device(dist.local_rank)
    try:
        deepspeed.init_distributed(
            dist_backend=accel.communication_backend_name(),
            auto_mpi_discovery=False,  # launch_env() has set RANK, WORLD_SIZE and MASTER_* already
            verbose=False,
            timeout=timedelta(seconds=timeout_s),
        )
    except (torch.distributed.DistNetworkError, torch.distributed.DistStoreError) as e:
        raise rendezvous_error(dist, e) from None


def leave_distributed() -> None:
    """Tear the process group down before the interpreter exits: one left to the exit can abort in
    gloo's destructor ("terminate called without an active exception", SIGABRT) even after every
    line of the script has run. Call it after a script's work is done, not on its error path: where
    another rank is still inside a collective, the teardown can wait on it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rendezvous_error(dist: Dist, e: Exception) -> LaunchError:
    """The rendezvous failed: rank 0 could not listen on MASTER_PORT (torch's TCPStore server binds it
    on every address), or another rank could not reach rank 0 there. Under DeepSpeed's launcher the
    other ranks of the host are killed when rank 0 exits; this is the one message left."""
    addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
    where = f"{addr}:{port} (MASTER_ADDR:MASTER_PORT)"
    said = (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
    if dist.rank == 0 and ("EADDRINUSE" in said or "address already in use" in said.lower()):
        free = free_port()
        return LaunchError(
            f"rank 0 cannot listen on port {port} for the rendezvous at {where}: it is in use. Pick a free "
            f"port, e.g. {free} (free now): deepspeed --master_port {free} ..., or MASTER_PORT={free} "
            f"launch/...; or stop what holds it ({who_holds(port)})"
        )
    if dist.rank == 0:
        return LaunchError(f"rank 0 cannot start the rendezvous at {where}: {said}")
    return LaunchError(
        f"cannot join the rendezvous at {where}: {said}. Rank 0 must be running and listening there, "
        "and reachable from this host (the name, a firewall, launch.socket_ifname)"
    )


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


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator  # after init_distributed, see there

    return torch.device(get_accelerator().current_device_name())


def build_model(cfg: RunConfig, ds_config: dict[str, Any], init: Source | None = None) -> Any:
    """The GPT, or with parallel.pipeline > 1 this rank's pipeline stage of it (pipeline.py), on this
    rank's device, with the weights of `init` (model.init_from, checked).

    Under tensor or pipeline parallelism no rank builds the whole model, nor its whole stage: its
    part is built on the meta device and materialised a layer at a time, each cut to the rank's share
    as soon as it exists (tensor_parallel.py). The initial weights are drawn layer by layer on the
    device's generator, as a one-rank run draws them, so every layout starts from the same weights."""
    where = device()
    if cfg.parallel.pipeline > 1:
        from pretrain.training.pipeline import build_pipeline

        return build_pipeline(cfg, where, init)
    if cfg.parallel.tensor > 1:
        return build_tensor_parallel(cfg, where, init)
    return build_gpt(cfg, ds_config, where, init)


def build_gpt(
    cfg: RunConfig, ds_config: dict[str, Any], where: torch.device | None = None, init: Source | None = None
) -> GPT:
    """Construct the GPT; at ZeRO-3 partitioned from the start, so no rank ever holds it whole.

    Weights are (re)initialised module by module after construction, each from a seed of
    `cfg.seed` and its name (model.init_seed), so every ZeRO stage and every layout starts from the
    same weights: under zero.Init each submodule is partitioned as soon as its constructor returns,
    before GPT's own init pass could see it. Then `init`'s weights, if any, replace them
    (init_from.load_into: at ZeRO-3 one gathered parameter at a time).
    """
    import deepspeed  # after init_distributed, see there

    zero3 = cfg.zero.stage == 3 and cfg.zero.init_on_construct
    if not zero3:
        with where or device():
            model = GPT(cfg.model)
        model.reset_parameters(cfg.seed)
        if init is not None:
            init_from.load_into(model, init, cfg.model, zero3=False)
        return model
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = GPT(cfg.model)
    for name, module in model.named_modules():
        params = list(module.parameters(recurse=False))
        if params:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                torch.manual_seed(init_seed(cfg.seed, name))
                model.init_weights(module)
    if init is not None:
        init_from.load_into(model, init, cfg.model, zero3=True)
    return model


def build_tensor_parallel(cfg: RunConfig, where: torch.device, init: Source | None = None) -> GPT:
    """The GPT of a tensor-parallel rank (no pipeline): built on the meta device, then each layer in
    turn materialised on `where` with the weights it has in a one-rank GPT, `init`'s slices for this
    rank (init_from.load_shares), and, for a block, cut by AutoTP to this rank's share a part at a
    time (tensor_parallel.materialize_layer). The embeddings, the norms and the head stay whole, as
    AutoTP leaves them."""
    from pretrain.training.tensor_parallel import TensorSharder, materialize_layer

    m = cfg.model
    groups = tensor_parallel_groups(cfg)
    with torch.device("meta"):
        model = GPT(m)
    sharder = TensorSharder(model, m, cfg.parallel.tensor, groups.get_tensor_model_parallel_group())
    layers: list[tuple[str, torch.nn.Module]] = [("wte", model.wte)]
    layers += [("wpe", model.wpe)] if model.wpe is not None else []
    layers += [(f"h.{i}", block) for i, block in enumerate(model.h)]
    layers += [("ln_f", model.ln_f)] + ([] if m.tie_embeddings else [("lm_head", model.lm_head)])
    load = (
        None
        if init is None
        else functools.partial(init_from.load_shares, source=init, m=m, tensor=tensor_place(cfg))
    )
    for name, layer in layers:
        materialize_layer(
            layer, m, gpt_name=name, root_name=name, seed=cfg.seed, where=where, load=load, sharder=sharder
        )
    if m.tie_embeddings:
        model.lm_head.weight = model.wte.weight  # the embedding was given new storage: tie it again
    model.to_empty(device=where, recurse=False)  # the GPT's own buffers (RoPE tables)
    with where:
        model.reset_buffers()
    sharder.finish(model, universal_info=True)
    return model


def tensor_place(cfg: RunConfig) -> tuple[int, int]:
    """(tensor-parallel degree, this rank's place in its tensor group), before DeepSpeed's groups
    exist: the tensor-parallel peers are neighbours (see data_parallel_rank)."""
    tp = cfg.parallel.tensor
    return tp, (torch.distributed.get_rank() % tp if tp > 1 else 0)


def tensor_parallel_groups(cfg: RunConfig) -> Any:
    """DeepSpeed's data x tensor mesh of AutoTP (tensor-parallel peers neighbours), built before
    `deepspeed.initialize` and passed as its `mpu`: the engine builds the same mesh itself, but
    DeepSpeed's config would count every rank as data-parallel in its batch check without it."""
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=cfg.parallel.tensor)
    return groups


def data_parallel_rank(cfg: RunConfig, dist: Dist, engine: Any) -> tuple[int, int]:
    """This rank's place in its data-parallel group, and the group's size (batch.data_parallel_size,
    checked against DeepSpeed's groups): ranks are laid out pipeline-major, then data, then tensor
    (DeepSpeed's PipeModelDataParallelTopology, and AutoTP's data x tensor mesh), so the
    tensor-parallel peers are neighbours, on one node."""
    par, dp = cfg.parallel, cfg.batch.data_parallel_size
    assert dp is not None
    rank = (dist.rank // par.tensor) % dp
    if par.pipeline > 1:
        ours = engine.grid.get_data_parallel_rank()
    else:
        ours = engine.mpu.get_data_parallel_rank() if par.tensor > 1 else dist.rank
    if ours != rank or engine.dp_world_size != dp:
        raise RuntimeError(
            f"rank {dist.rank}: DeepSpeed's data-parallel rank {ours} of {engine.dp_world_size} is not "
            f"the layout's {rank} of {dp} (tensor {par.tensor} x pipeline {par.pipeline})"
        )
    return rank, dp


def check_precision(cfg: RunConfig) -> None:
    """bf16 or fp16 where this accelerator has it (DeepSpeed asks the same, with a traceback)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    for name, supported in (("bf16", acc.is_bf16_supported), ("fp16", acc.is_fp16_supported)):
        if getattr(cfg.precision, name) and not supported():
            others = [n for n, ok in (("bf16", acc.is_bf16_supported()), ("fp32", True)) if ok and n != name]
            raise ConfigError(
                [
                    f"precision.{name}: DeepSpeed's {acc.device_name()} accelerator on this machine does "
                    f"not support {name}; use {' or '.join(others)} here (e.g. --set precision.{name}=false)"
                ]
            )


def initialize(cfg: RunConfig, model: Any, ds_config: dict[str, Any]) -> Any:
    """Wrap the model in the DeepSpeed engine, with AdamW over decay / no-decay groups: the GPT in
    DeepSpeed's engine (AutoTP sharding it with parallel.tensor > 1), a pipeline stage in its
    pipeline engine (already sharded, see pipeline.py)."""
    import deepspeed  # after init_distributed, see there

    check_precision(cfg)
    if device().type == "cuda":
        set_tf32(cfg.precision.tf32)  # fp32 matmuls; the MFU's peak reads the same switch
    pipelined = cfg.parallel.pipeline > 1
    if pipelined:
        # The pipeline engine takes its groups from the stage's topology; AutoTP's config path
        # would build a data x tensor mesh of its own over them.
        ds_config = {k: v for k, v in ds_config.items() if k != "tensor_parallel"}
    wait_for_op_builds(ds_config)  # torch's own wait on a JIT build's lock is silent, and endless if stale
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg.optimizer.weight_decay),
        config=ds_config,
        mpu=tensor_parallel_groups(cfg) if cfg.parallel.tensor > 1 and not pipelined else None,
    )
    if pipelined:
        return engine
    if cfg.zero.stage == 0 and engine.dp_world_size == 1 and cfg.parallel.tensor == 1:
        # One data-parallel rank: DeepSpeed would still flatten every gradient into a bucket,
        # all-reduce it over the single rank and copy it back, each micro step. Nothing to reduce.
        engine.enable_backward_allreduce = False
    if clips_itself(cfg):
        engine._config.gradient_clipping = 0.0  # train_step clips, see clips_itself
    if cfg.zero.stage == 0 and cfg.precision.name == "fp32":
        # After each step DeepSpeed's `zero_grad` here walks `module.named_parameters()` (the whole
        # module tree, every step: 0.4 ms of a 66 ms step of a 4-layer model on the CPU). The
        # optimizer holds the same parameters (every one is in a group) in flat lists.
        zero_grad = engine.optimizer.zero_grad
        if "set_to_none" in inspect.signature(zero_grad).parameters:  # torch's; FusedAdam's sets None itself
            zero_grad = functools.partial(zero_grad, set_to_none=True)
        engine.zero_grad = zero_grad
    c = cfg.compile
    if c.enabled:
        # In place (nn.Module.compile): the engine still holds the GPT itself, so parameter names,
        # checkpoints and exports carry no `_orig_mod.` prefix. Compilation happens at the first step.
        kwargs: dict[str, Any] = {"dynamic": c.dynamic}
        if c.mode != "default":
            kwargs["mode"] = c.mode
        if engine.device.type == "cpu" and c.backend == "inductor":
            # Inductor's own dropout RNG is slow in C++ on the CPU (15% of a `medium` step): draw
            # the masks with torch's kernels instead, as eager does.
            import torch._inductor.config as inductor_config

            inductor_config.fallback_random = True
        engine.compile(backend=c.backend, compile_kwargs=kwargs)
    return engine


def clips_itself(cfg: RunConfig) -> bool:
    """Whether the loop clips the gradients instead of DeepSpeed: at stage 0 in fp32, where DeepSpeed
    would take a norm per parameter in Python, all_reduce the global norm every rank already holds
    (a host round trip each step) and scale each gradient. `torch.nn.utils.clip_grad_norm_` does the
    same arithmetic in one foreach pass and hands back the norm for the logs. The rendered JSON keeps
    `gradient_clipping`; only this engine's copy is turned off."""
    single = cfg.parallel.model_parallel == 1  # a sharded parameter's norm needs its peers' shards
    return single and cfg.zero.stage == 0 and cfg.precision.name == "fp32" and cfg.optimizer.grad_clip > 0
