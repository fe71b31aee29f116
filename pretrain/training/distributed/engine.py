"""Model construction and `deepspeed.initialize`: where the GPT meets DeepSpeed. Who the ranks are and
their process group: ranks.py."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from pretrain.cluster.hardware import set_tf32
from pretrain.cluster.ops import wait_for_op_builds
from pretrain.config.engine_sections import CompileConfig, PrecisionConfig
from pretrain.config.layout import Layout, layout_of
from pretrain.config.tree import RunConfig
from pretrain.errors import ConfigError
from pretrain.training.distributed.ds_internals import init_tensor_mesh, turn_off_engine_clipping
from pretrain.training.distributed.ranks import device
from pretrain.training.model import init_from
from pretrain.training.model.gpt import GPT, init_seed, param_groups
from pretrain.training.model.init_from import Source


def build_model(cfg: RunConfig, ds_config: dict[str, Any], init: Source | None = None) -> Any:
    """The GPT, or with parallel.pipeline > 1 this rank's pipeline stage of it (pipeline.py), on this
    rank's device, with the weights of `init` (model.init_from, checked).

    Under tensor or pipeline parallelism no rank builds the whole model, nor its whole stage: its
    part is built on the meta device and materialised a layer at a time, each cut to the rank's share
    as soon as it exists (tensor_parallel.py). The initial weights are drawn layer by layer on the
    device's generator, as a one-rank run draws them, so every layout starts from the same weights."""
    where, layout = device(), layout_of(cfg)
    if layout.pipelined:
        from pretrain.training.distributed.pipeline import build_pipeline

        return build_pipeline(cfg, where, init)
    if layout.tensor_parallel:
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

    zero3 = layout_of(cfg).zero_stage == 3 and cfg.zero.init_on_construct
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
    from pretrain.training.distributed.tensor_parallel import TensorSharder, materialize_layer

    m = cfg.model
    groups = tensor_parallel_groups(cfg)
    with torch.device("meta"):
        model = GPT(m)
    sharder = TensorSharder(model, m, layout_of(cfg).tensor, groups.get_tensor_model_parallel_group())
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
    layout = layout_of(cfg)
    return layout.tensor, layout.tensor_rank(torch.distributed.get_rank())


def tensor_parallel_groups(cfg: RunConfig) -> Any:
    """DeepSpeed's data x tensor mesh of AutoTP (tensor-parallel peers neighbours), built before
    `deepspeed.initialize` and passed as its `mpu`: the engine builds the same mesh itself, but
    DeepSpeed's config would count every rank as data-parallel in its batch check without it."""
    return init_tensor_mesh(layout_of(cfg).tensor)


def data_parallel_rank(layout: Layout, rank: int, engine: Any) -> tuple[int, int]:
    """Global `rank`'s place in its data-parallel group, and the group's size, checked against
    DeepSpeed's groups: ranks are laid out pipeline-major, then data, then tensor (DeepSpeed's
    PipeModelDataParallelTopology, and AutoTP's data x tensor mesh), so the tensor-parallel peers
    are neighbours, on one node."""
    dp_rank, dp = layout.data_rank(rank), layout.data
    if layout.pipelined:
        ours = engine.grid.get_data_parallel_rank()
    else:
        ours = engine.mpu.get_data_parallel_rank() if layout.tensor_parallel else rank
    if ours != dp_rank or engine.dp_world_size != dp:
        raise RuntimeError(
            f"rank {rank}: DeepSpeed's data-parallel rank {ours} of {engine.dp_world_size} is not "
            f"the layout's {dp_rank} of {dp} ({layout})"
        )
    return dp_rank, dp


def check_precision(*, precision: PrecisionConfig) -> None:
    """bf16 or fp16 where this accelerator has it (DeepSpeed asks the same, with a traceback)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    for name, supported in (("bf16", acc.is_bf16_supported), ("fp16", acc.is_fp16_supported)):
        if getattr(precision, name) and not supported():
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

    check_precision(precision=cfg.precision)
    if device().type == "cuda":
        set_tf32(cfg.precision.tf32)  # fp32 matmuls; the MFU's peak reads the same switch
    layout = layout_of(cfg)
    pipelined = layout.pipelined
    if pipelined:
        # The pipeline engine takes its groups from the stage's topology; AutoTP's config path
        # would build a data x tensor mesh of its own over them.
        ds_config = {k: v for k, v in ds_config.items() if k != "tensor_parallel"}
    wait_for_op_builds(ds_config)  # torch's own wait on a JIT build's lock is silent, and endless if stale
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg.optimizer.weight_decay),
        config=ds_config,
        mpu=tensor_parallel_groups(cfg) if layout.tensor_parallel and not pipelined else None,
    )
    if pipelined:
        return engine
    _lean_step(engine, cfg, layout)
    if cfg.compile.enabled:
        _compile(engine, cfg.compile)
    return engine


def _lean_step(engine: Any, cfg: RunConfig, layout: Layout) -> None:
    """What DeepSpeed's engine would do each step for nothing here: an all-reduce over one rank, a
    clip the loop does in one pass, a walk of the module tree to zero the gradients."""
    if layout.zero_stage == 0 and engine.dp_world_size == 1 and not layout.tensor_parallel:
        # One data-parallel rank: DeepSpeed would still flatten every gradient into a bucket,
        # all-reduce it over the single rank and copy it back, each micro step. Nothing to reduce.
        engine.enable_backward_allreduce = False
    if clips_itself(cfg, layout):
        turn_off_engine_clipping(engine)  # train_step clips, see clips_itself
    if layout.zero_stage == 0 and cfg.precision.name == "fp32":
        # After each step DeepSpeed's `zero_grad` here walks `module.named_parameters()` (the whole
        # module tree, every step: 0.4 ms of a 66 ms step of a 4-layer model on the CPU). The
        # optimizer holds the same parameters (every one is in a group) in flat lists.
        zero_grad = engine.optimizer.zero_grad
        if "set_to_none" in inspect.signature(zero_grad).parameters:  # torch's; FusedAdam's sets None itself
            zero_grad = functools.partial(zero_grad, set_to_none=True)
        engine.zero_grad = zero_grad


def _compile(engine: Any, c: CompileConfig) -> None:
    """In place (nn.Module.compile): the engine still holds the GPT itself, so parameter names,
    checkpoints and exports carry no `_orig_mod.` prefix. Compilation happens at the first step."""
    kwargs: dict[str, Any] = {"dynamic": c.dynamic}
    if c.mode != "default":
        kwargs["mode"] = c.mode
    if engine.device.type == "cpu" and c.backend == "inductor":
        # Inductor's own dropout RNG is slow in C++ on the CPU (15% of a `medium` step): draw
        # the masks with torch's kernels instead, as eager does.
        import torch._inductor.config as inductor_config

        inductor_config.fallback_random = True
    engine.compile(backend=c.backend, compile_kwargs=kwargs)


def clips_itself(cfg: RunConfig, layout: Layout) -> bool:
    """Whether the loop clips the gradients instead of DeepSpeed: at stage 0 in fp32, where DeepSpeed
    would take a norm per parameter in Python, all_reduce the global norm every rank already holds
    (a host round trip each step) and scale each gradient. `torch.nn.utils.clip_grad_norm_` does the
    same arithmetic in one foreach pass and hands back the norm for the logs. The rendered JSON keeps
    `gradient_clipping`; only this engine's copy is turned off."""
    single = layout.model_parallel == 1  # a sharded parameter's norm needs its peers' shards
    return single and layout.zero_stage == 0 and cfg.precision.name == "fp32" and cfg.optimizer.grad_clip > 0
