"""When no ZeRO stage fits the configured layout: the layouts of a small search that would.

`search_layouts` tries the others and lists those that fit as the `--set` overrides that give
them, fastest first.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pretrain.config.layout import Layout
from pretrain.config.loading import deep_merge, parse_override
from pretrain.config.tree import ModelConfig, RunConfig, validate
from pretrain.errors import ConfigError
from pretrain.plan.layout import layout_variants
from pretrain.plan.rates import rates_for_layout
from pretrain.plan.stages import offload_name, plan_stages
from pretrain.plan.target import Target
from pretrain.plan.timing import Rates, predict_step


@dataclass
class LayoutOption:
    """A layout that fits, as the overrides that give it."""

    overrides: list[str]
    layout: str
    stage: int
    offload: str
    device_total_gb: float
    step_s: float | None
    days: float | None


def micro_batches(micro: int) -> list[int]:
    """The micro batches the search tries: the configured one and its halves down to 1."""
    out = [micro]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def with_overrides(cfg: RunConfig, world: int, overrides: list[str]) -> RunConfig | None:
    """`cfg` with these `--set` overrides on `world` ranks, its batch derived again; None where the
    tree refuses the result (a layout the model's shape or ZeRO does not allow)."""
    data: dict[str, Any] = cfg.model_dump(mode="json")
    data["batch"] |= {"data_parallel_size": None, "train_batch_size": None}
    for item in overrides:
        data = deep_merge(data, parse_override(item))
    try:
        return validate(data, world)
    except ConfigError:
        return None


def search_layouts(cfg: RunConfig, to: Target, rates: Rates | None) -> tuple[list[LayoutOption], int]:
    """The layouts of a small search that fit the device (and host), fastest first, and how many
    were tried: tensor 1, 2, 4, 8 up to the ranks of a node, pipeline stages dividing the node count
    or the layers, every ZeRO stage and offload `layout_variants` allows, the micro batch as configured
    and halved down to 1, activation checkpointing as configured and on. The global batch stays: the
    accumulation makes up for the micro batch and the data-parallel size (a layout whose micro batch
    x data-parallel size does not divide it is left out)."""
    found, tried = [], 0
    for over, stage, offload in _candidates(cfg, to):
        tried += 1
        option = _layout_option(cfg, to, rates, over, stage=stage, offload=offload)
        if option is not None:
            found.append(option)
    found.sort(key=lambda o: (o.step_s if o.step_s is not None else 0.0, o.device_total_gb))
    best: dict[tuple[str, int, str], LayoutOption] = {}
    for o in found:  # the fastest of each layout, stage and offload (a micro batch or checkpointing apart)
        best.setdefault((o.layout, o.stage, o.offload), o)
    return list(best.values()), tried


def _candidates(cfg: RunConfig, to: Target) -> Iterator[tuple[list[str], int, str]]:
    """Each layout `search_layouts` tries, in its order: the overrides that give it, its ZeRO stage and
    its offload."""
    m, b = cfg.model, cfg.batch
    for tp, pp in _model_parallel(to, model=cfg.model):
        dp = to.world // (tp * pp)
        for micro, ckpt in itertools.product(
            micro_batches(b.micro_batch_size), sorted({m.activation_checkpointing, True})
        ):
            if b.sequences % (micro * dp):
                continue
            sets = _batch_sets(cfg, tp, pp, micro=micro, accum=b.sequences // (micro * dp), ckpt=ckpt)
            for stage, off, par in layout_variants(Layout(tp, pp, dp), optimizer=cfg.optimizer):
                over = [*sets, f"zero.stage={stage}"]
                if off != cfg.zero.offload_optimizer:
                    over.append(f"zero.offload_optimizer={str(off).lower()}")
                if par != cfg.zero.offload_param:
                    over.append(f"zero.offload_param={str(par).lower()}")
                yield over, stage, offload_name(off, par)


def _model_parallel(to: Target, *, model: ModelConfig) -> list[tuple[int, int]]:
    """The (tensor, pipeline) sizes searched: tensor 1, 2, 4, 8 up to the ranks of a node, pipeline
    stages dividing the node count or the layers, both dividing the world."""
    world, n_layer = to.world, model.n_layer
    per_node = to.ranks_per_node or min(world, 8)
    nodes = max(1, world // per_node)
    return [
        (tp, pp)
        for tp in (t for t in (1, 2, 4, 8) if t <= per_node)
        for pp in (p for p in range(1, n_layer + 1) if nodes % p == 0 or n_layer % p == 0)
        if not world % (tp * pp)
    ]


def _batch_sets(cfg: RunConfig, tp: int, pp: int, *, micro: int, accum: int, ckpt: bool) -> list[str]:
    """The `--set` overrides of a layout and batch shape, ZeRO aside: those that change the config."""
    m, b = cfg.model, cfg.batch
    sets = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}"]
    if micro != b.micro_batch_size:
        sets.append(f"batch.micro_batch_size={micro}")
    if accum != b.gradient_accumulation_steps:
        sets.append(f"batch.gradient_accumulation_steps={accum}")
    if ckpt != m.activation_checkpointing:
        sets.append("model.activation_checkpointing=true")
    if pp > 1 and cfg.compile.enabled:
        sets.append("compile.enabled=false")
    return sets


def _layout_option(
    cfg: RunConfig, to: Target, rates: Rates | None, overrides: list[str], *, stage: int, offload: str
) -> LayoutOption | None:
    """The layout these overrides give `cfg`, if the tree allows it and it fits the device and the host."""
    c = with_overrides(cfg, to.world, overrides)
    if c is None:
        return None
    plans = plan_stages(
        c, to.world, device_gb=to.device_gb, gpus_per_node=to.ranks_per_node or min(to.world, 8),
        host_gb=to.host_gb, cpu_ranks=to.on_cpu,
    )  # fmt: skip
    row = next(p for p in plans if (p.stage, p.offload) == (stage, offload))
    if not row.fits or row.host_fits is False:
        return None
    t = None
    if rates is not None:
        off, par = offload != "none", offload == "optimizer+params"
        mine = rates_for_layout(rates, c.parallel.tensor, c.parallel.pipeline)  # its kind's efficiency
        t = predict_step(c, to.world, stage=stage, offload_optimizer=off, offload_param=par, rates=mine)
    return LayoutOption(
        overrides=overrides,
        layout=row.layout,
        stage=stage,
        offload=row.offload,
        device_total_gb=row.device_total_gb,
        step_s=None if t is None else t.step_s,
        days=None if t is None else t.days,
    )
