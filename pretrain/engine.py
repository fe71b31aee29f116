"""Process group, model construction and `deepspeed.initialize`: where the GPT meets DeepSpeed."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.config import RunConfig
from pretrain.model import GPT


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_env() -> Dist:
    """Rank and world size as the launcher (deepspeed, torchrun, Slurm wrapper) set them.

    A plain `python -m pretrain train` has no launcher: it is rank 0 of 1 on loopback. Setting the
    variables here also keeps DeepSpeed from its MPI discovery, which would pick the master address
    from `hostname -I`.
    """
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    world = int(os.environ["WORLD_SIZE"])
    return Dist(
        rank=int(os.environ["RANK"]),
        world_size=world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))),
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(dist: Dist) -> None:
    """Join the process group: NCCL on CUDA, gloo on the CPU (DeepSpeed picks by accelerator)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu":
        # Ranks on one host share its cores; oversubscribed BLAS threads slow everything down.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.local_world_size))
    else:
        accel.set_device(dist.local_rank)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name(), verbose=False)


def device() -> torch.device:
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def build_model(cfg: RunConfig, ds_config: dict[str, Any]) -> GPT:
    """Construct the GPT; at ZeRO-3 partitioned from the start, so no rank ever holds it whole.

    Weights are (re)initialised module by module from `cfg.seed` after construction, so every
    ZeRO stage starts from the same weights: under zero.Init each submodule is partitioned as
    soon as its constructor returns, before GPT's own init pass could see it.
    """
    import deepspeed

    zero3 = cfg.zero.stage == 3 and cfg.zero.init_on_construct
    if zero3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = GPT(cfg.model)
    else:
        with torch.device(device()):
            model = GPT(cfg.model)
    torch.manual_seed(cfg.seed)
    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if zero3:
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                model.init_weights(module)
        elif params:
            model.init_weights(module)
    return model


def initialize(cfg: RunConfig, model: GPT, ds_config: dict[str, Any]) -> Any:
    """Wrap the model in the DeepSpeed engine, with AdamW over decay / no-decay groups."""
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.param_groups(cfg.optimizer.weight_decay),
        config=ds_config,
    )
    return engine
