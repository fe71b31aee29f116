"""The GPT as pipeline stages: a `deepspeed.pipe.PipelineModule` of layer specs, and tensor
parallelism inside it.

DeepSpeed's pipeline engine runs a list of layers, each taking the previous one's output tensor,
split into `parallel.pipeline` stages. Here the list is the GPT of model.py, piece by piece:

    token embedding, positions (+ dropout), block 0 .. block L-1, final norm, head

The token embedding and a tied head are one `TiedLayerSpec` ("wte"): the first stage embeds with
it, the last stage projects onto the vocabulary with it, and DeepSpeed all-reduces its gradient
between the two. Every layer keeps the parameter names it has in `GPT` under its own prefix
(`gpt_names` maps them back), and initialises each module from `init_seed(seed, its GPT name)`, so
a stage built alone holds exactly the weights a single-rank GPT would.

Tensor parallelism within a pipeline: DeepSpeed's AutoTP training path (`tensor_parallel` in the
engine config) builds a 2-D data x tensor mesh of its own, which would override the pipeline
engine's groups. So for a pipeline the same AutoTP layers are applied here, before
`deepspeed.initialize`, over the pipeline topology's model-parallel groups, and the engine config
goes without `tensor_parallel`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

from pretrain.config.ds_render import autotp_layer_specs, pipeline_checkpoint_interval
from pretrain.config.tree import ModelConfig, RunConfig, required_vocab_size
from pretrain.training import init_from
from pretrain.training.init_from import Source
from pretrain.training.model import Block, init_seed, init_weights, norm, rope_cache

TIED = "wte"  # the key of the tied embedding / head in the PipelineModule


class TokenEmbedding(nn.Embedding):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(required_vocab_size(cfg), cfg.n_embd)


class Positions(nn.Module):
    """Learned position embeddings added to the token embeddings (none with RoPE), then dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:  # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(x.size(1), device=x.device))
        return self.drop(x)


class PipelineBlock(Block):
    """A block that carries its own RoPE tables (a stage holds no GPT to share them)."""

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.rope = cfg.position == "rope"
        if self.rope:
            cos, sin = rope_cache(cfg.block_size, cfg.rotary_dims, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        T = x.size(1)
        return super().forward(x, (self.rope_cos[:T], self.rope_sin[:T]) if self.rope else None)


class FinalNorm(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_f = norm(cfg)

    def forward(self, x: Tensor) -> Tensor:
        return self.ln_f(x)


class Head(nn.Module):
    """The untied language-model head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.lm_head = nn.Linear(cfg.n_embd, required_vocab_size(cfg), bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm_head(x)


def tied_logits(embedding: nn.Embedding, x: Tensor) -> Tensor:
    """The tied head: project onto the token embedding (B, T, C) -> (B, T, V)."""
    return F.linear(x, embedding.weight)


class LossFn:
    """Cross-entropy of the last stage's logits, as GPT.forward computes it. `poison` (a test hook:
    PRETRAIN_FAULT_NAN_STEPS) makes the next step's losses NaN."""

    def __init__(self) -> None:
        self.poison = False

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return loss * float("nan") if self.poison else loss


def gpt_names(cfg: ModelConfig) -> list[str]:
    """The prefix, in GPT's names, of each pipeline layer's parameters (by layer index)."""
    head = "" if not cfg.tie_embeddings else "wte."
    return ["wte.", "", *(f"h.{i}." for i in range(cfg.n_layer)), "", head]


def build_pipeline(cfg: RunConfig, init: Source | None = None) -> Any:
    """The PipelineModule of `cfg` on this rank: only this stage's layers are built, each initialised
    as in the whole GPT, then given the weights of `init` (model.init_from), if any: only this
    stage's tensors are read, and with parallel.tensor > 1 only the slices AutoTP leaves to this rank
    (init_from.load_shares); then, with parallel.tensor > 1, sharded by AutoTP over the tensor groups."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from torch.distributed import get_world_size

    m, par = cfg.model, cfg.parallel
    embed = TiedLayerSpec(TIED, TokenEmbedding, m, tied_weight_attr="weight")
    head = (
        TiedLayerSpec(TIED, TokenEmbedding, m, forward_fn=tied_logits, tied_weight_attr="weight")
        if m.tie_embeddings
        else LayerSpec(Head, m)
    )
    layers = [embed, LayerSpec(Positions, m), *(LayerSpec(PipelineBlock, m) for _ in range(m.n_layer))]
    layers += [LayerSpec(FinalNorm, m), head]
    dp = get_world_size() // par.model_parallel
    module = PipelineModule(
        layers=layers,
        topology=PipeModelDataParallelTopology(num_pp=par.pipeline, num_mp=par.tensor, num_dp=dp),
        loss_fn=LossFn(),
        partition_method=par.partition_method,
        activation_checkpoint_interval=pipeline_checkpoint_interval(cfg),
        activation_checkpoint_func=_checkpoint,
    )
    _init_stage(module, cfg)
    if init is not None:
        place = (par.tensor, module._grid.get_slice_parallel_rank())  # within this rank's tensor group
        init_from.load_shares(stage_parameters(module, m), init, m, place)
    if par.tensor > 1:
        shard_tensor_parallel(module, cfg)
    return module


def _checkpoint(function: Any, *args: Tensor) -> Any:
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _init_stage(module: Any, cfg: RunConfig) -> None:
    """Initialise this stage's layers as the whole GPT would (model.init_seed of each GPT name)."""
    names = gpt_names(cfg.model)
    for idx, layer in _local_layers(module):
        for sub_name, sub in layer.named_modules():
            if any(True for _ in sub.parameters(recurse=False)):
                name = f"{names[idx]}{sub_name}".strip(".") or names[idx].strip(".")
                torch.manual_seed(init_seed(cfg.seed, name))
                init_weights(sub, cfg.model)


def stage_parameters(module: Any, m: ModelConfig) -> dict[str, nn.Parameter]:
    """This stage's parameters by their names in GPT (a tied embedding once, as `wte.weight`)."""
    names = gpt_names(m)
    return {
        f"{names[idx]}{name}": p
        for idx, layer in _local_layers(module)
        for name, p in layer.named_parameters()
    }


def _local_layers(module: Any) -> Iterator[tuple[int, nn.Module]]:
    """(layer index, layer) of this stage, a tied layer once under its first index here."""
    seen: set[int] = set()
    for offset, layer in enumerate(module.forward_funcs):
        if isinstance(layer, nn.Module) and id(layer) not in seen:
            seen.add(id(layer))
            yield module._local_start + offset, layer
    for key, layer in module.tied_modules.items():  # a tied head built on the last stage only
        if id(layer) not in seen and key == TIED:
            seen.add(id(layer))
            yield 0, layer


def shard_tensor_parallel(module: Any, cfg: RunConfig) -> None:
    """AutoTP's training layers over the pipeline topology's tensor groups (see the module doc)."""
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.module_inject.layers import set_autotp_mode
    from deepspeed.utils import groups

    group = module._grid.get_slice_parallel_group()  # this rank's tensor-parallel peers
    set_autotp_mode(training=True)
    # AutoTP's training layers ask DeepSpeed's groups for their group: it is the pipeline's.
    groups._TENSOR_MODEL_PARALLEL_GROUP = group
    spec = AutoTPConfig.from_dict(
        {
            "tp_size": cfg.parallel.tensor,
            "use_default_specs": False,
            "layer_specs": autotp_layer_specs(cfg.model),
        }
    )
    autotp = AutoTP(
        module=module,
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
    autotp.set_tensor_parallel_config(cfg.parallel.tensor, group)
    autotp.update_linear_policies()
    autotp._replace_module(module)
    autotp.register_replicated_grad_hooks(module)
    module.ds_autotp_parsed = True
