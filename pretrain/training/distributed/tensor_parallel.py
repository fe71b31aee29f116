"""Tensor parallelism: DeepSpeed's AutoTP training layers, put in one layer at a time.

A tensor-parallel rank never holds the whole model (or the whole pipeline stage). Its part of the
GPT is built on the meta device, then each layer in turn is given storage on the rank's device and
its initial weights (`model.materialize`), the weights of `model.init_from` for the rank's slices
(`init_from.load_shares`), and is cut by AutoTP to the rank's share (`TensorSharder.shard`): the
column-parallel projections keep their rows of each q/k/v (and gate/up) sub-matrix, the row-parallel
ones their columns (`ds_render.autotp_layer_specs`). The whole layer is freed as soon as it is cut,
so a rank's peak is its shard plus one layer. The values a rank keeps are those a one-rank run has
in the same places, so every layout starts from the same weights.

DeepSpeed's engine applies AutoTP to the whole model inside `deepspeed.initialize`, after the model
was built whole; a model marked `ds_autotp_parsed` is taken as already sharded.

Checked against DeepSpeed 0.19.8: `AutoTP._replace_module(module, prev_name)` (a private method:
the public path replaces the whole model) names a layer's linears `prev_name.attn.c_attn` and so on,
which the layer specs' patterns match; tests/test_parallel.py fails if the layers stop being
replaced (the losses of TP2 would not be one rank's).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from pretrain.config.ds_render import autotp_layer_specs
from pretrain.config.tree import ModelConfig
from pretrain.training.model.gpt import Block, HasDerivedBuffers, materialize

Load = Callable[[Mapping[str, nn.Parameter]], None]  # writes init_from's weights into parameters by GPT name


def materialize_layer(
    layer: nn.Module,
    m: ModelConfig,
    *,
    gpt_name: str,
    root_name: str,
    seed: int,
    where: torch.device,
    load: Load | None,
    sharder: TensorSharder | None,
) -> None:
    """One layer of a model-parallel rank's part, built on the meta device, made real on `where`.

    A block goes a part at a time (its norms, its attention, its MLP): each part is given storage and
    the initial weights it has in the whole GPT (`gpt_name`: the layer's name there, e.g. "h.3"), the
    weights of `load` (init_from's slices for this rank), and with a `sharder` is cut to this rank's
    share before the next part exists (`root_name`: the layer's name in the module AutoTP was given),
    so the largest thing held whole is one MLP. Any other layer (an embedding, a norm, the head) is
    made real whole, as AutoTP leaves it."""
    parts = list(layer.named_children()) if isinstance(layer, Block) else [("", layer)]
    for part_name, part in parts:
        suffix = f".{part_name}" if part_name else ""
        prefix = f"{gpt_name}{suffix}.".lstrip(".")  # a pipeline's positions layer has no name in GPT
        materialize(part, prefix, m, seed=seed, where=where)
        if load is not None:
            load({f"{prefix}{k}": p for k, p in part.named_parameters()})
        if sharder is not None and any(isinstance(c, nn.Linear) for c in part.children()):
            sharder.shard(part, f"{root_name}{suffix}")
        if where.type == "cpu":
            _return_freed_heap()
    if isinstance(layer, Block):  # the block's own buffers (a pipeline block's RoPE tables)
        layer.to_empty(device=where, recurse=False)
        if isinstance(layer, HasDerivedBuffers):
            with torch.device(where):
                layer.reset_buffers()


class TensorSharder:
    """AutoTP over one tensor-parallel group (`group`, of `tp` ranks), for the GPT of `m`; `root` is
    the model (or pipeline module) the layers belong to, whose module names AutoTP reads."""

    def __init__(self, root: nn.Module, m: ModelConfig, tp: int, group: Any) -> None:
        from deepspeed.module_inject.auto_tp import AutoTP
        from deepspeed.module_inject.autotp_config import AutoTPConfig
        from deepspeed.module_inject.layers import set_autotp_mode

        set_autotp_mode(training=True)
        spec = AutoTPConfig.from_dict(
            {"tp_size": tp, "use_default_specs": False, "layer_specs": autotp_layer_specs(m)}
        )
        self.autotp = AutoTP(
            module=root,
            all_reduce_linears=(),
            prefix="",
            state_dict=None,
            linear_layer_setting=(nn.Linear, nn.Embedding),
            orig_layer_impl=None,
            keep_module_on_host=False,
            partition_config=spec,
            vocab_parallel_lm_head=False,
            model_config=None,
            tp_grain_size=1,
            training_mode=True,
        )
        self.autotp.set_tensor_parallel_config(tp, group)
        self.autotp.update_linear_policies()

    def shard(self, layer: nn.Module, name: str) -> None:
        """Replace the linears of `layer` (named `name` in the root, e.g. "h.3.attn") by AutoTP's
        layers, which keep this rank's share on its device and free the whole weights."""
        self.autotp._replace_module(layer, prev_name=name)

    def finish(self, root: nn.Module, *, universal_info: bool) -> None:
        """After the last layer: the gradient hooks of the replicated parameters AutoTP asks for, the
        mark that tells DeepSpeed's engine the model is sharded, and (`universal_info`) the layout a
        universal checkpoint conversion reads, as the engine attaches it when it shards."""
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
        from deepspeed.module_inject.layers import collect_autotp_universal_checkpoint_info

        self.autotp.register_replicated_grad_hooks(root)
        if universal_info:
            setattr(root, UNIVERSAL_CHECKPOINT_INFO, collect_autotp_universal_checkpoint_info(root))
        setattr(root, "ds_autotp_parsed", True)  # noqa: B010 (nn.Module's setattr is typed for tensors)


def _return_freed_heap() -> None:
    """Give the heap pages freed by the part just cut back to the OS (glibc's malloc_trim): the whole
    weights of a part are freed once cut, but glibc keeps freed chunks under 32 MB in its heap, where
    the next parts' allocations fragment them and a CPU rank's resident memory would grow by them."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to ask
        ctypes.CDLL("libc.so.6").malloc_trim(0)
