"""A run's parallel layout, decided once: tensor x pipeline x data-parallel ranks, and the ZeRO stage
and offloads over the data-parallel ones. `layout_of` resolves it from the config for a world size;
the engine, the loop, the checkpoints, `plan` and `export` read this object, not the config fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pretrain.config.batch import data_parallel_of
from pretrain.errors import ConfigError

if TYPE_CHECKING:
    from pretrain.config.tree import RunConfig


@dataclass(frozen=True)
class Layout:
    """A world of ranks as tensor x pipeline x data-parallel groups (DeepSpeed's topology: tensor
    ranks adjacent, then data, pipeline stages outermost), with ZeRO over the data-parallel ranks."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor > 1

    @property
    def pipelined(self) -> bool:
        return self.pipeline > 1

    @property
    def shape(self) -> tuple[int, int]:
        """(tensor, pipeline): what a checkpoint's parameters are cut by (the data size is not)."""
        return self.tensor, self.pipeline

    def tensor_rank(self, rank: int) -> int:
        """`rank`'s place in its tensor-parallel group: the peers are neighbours."""
        return rank % self.tensor

    def data_rank(self, rank: int) -> int:
        """`rank`'s place in its data-parallel group (pipeline-major, then data, then tensor)."""
        return (rank // self.tensor) % self.data

    def __str__(self) -> str:
        return f"TP{self.tensor} x PP{self.pipeline} x DP{self.data}"


def layout_of(cfg: RunConfig, world: int | None = None) -> Layout:
    """`cfg`'s layout on `world` ranks (by default the world its batch was resolved for; one
    data-parallel rank where it has none)."""
    par, zero = cfg.parallel, cfg.zero
    dp = cfg.batch.data_parallel_size or 1
    if world is not None:
        found = data_parallel_of({"world_size": world, "model_parallel": par.model_parallel})
        if found is None:
            raise ConfigError(
                [
                    f"parallel: tensor x pipeline ({par.model_parallel}) does not divide the world size ({world})"
                ],
                "plan",
            )
        dp = found
    return Layout(
        tensor=par.tensor,
        pipeline=par.pipeline,
        data=dp,
        zero_stage=zero.stage,
        offload_optimizer=zero.offload_optimizer,
        offload_param=zero.offload_param,
    )
