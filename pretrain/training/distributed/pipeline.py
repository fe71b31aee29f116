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

A stage's layers are built on the meta device and materialised one at a time (`GPTStage`), so a
rank never holds its whole stage, and DeepSpeed's count of every layer's parameters (to balance the
stages) builds nothing real.

Packed documents (`model.document_eot`, model.py): the blocks of a later stage never see the token
ids, so the first stage derives each token's position in its document from them and the activations
travel as (hidden states, positions), the positions an integer tensor (B, T) that DeepSpeed's engine
sends between stages beside the hidden states and sends no gradient for. Each stage builds the block-
causal mask from the positions once, in its first block, and passes it to its next blocks as a third
item, which `GPTStage.forward` drops before the activations leave the stage: a dense (B, 1, T, T) mask
would cost more than the hidden states to send whenever T > n_embd, and FlexAttention's BlockMask (on
CUDA, model.py's `document_path`) is no tensor DeepSpeed's engine can send; within a stage it travels
as a Python object beside the tensors, which DeepSpeed's layers and torch's checkpoint pass as given.

Tensor parallelism within a pipeline: DeepSpeed's AutoTP training path (`tensor_parallel` in the
engine config) builds a 2-D data x tensor mesh of its own, which would override the pipeline
engine's groups. So for a pipeline the same AutoTP layers are applied here, layer by layer before
`deepspeed.initialize`, over the pipeline topology's model-parallel groups, and the engine config
goes without `tensor_parallel`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F

from pretrain.config.ds_render import pipeline_checkpoint_interval
from pretrain.config.layout import layout_of
from pretrain.config.tree import ModelConfig, RunConfig, required_vocab_size
from pretrain.training.distributed.ds_internals import set_tensor_group, stage_grid, stage_start
from pretrain.training.model import init_from
from pretrain.training.model.gpt import (
    Block,
    DocumentPath,
    HasDerivedBuffers,
    cross_entropy,
    document_positions,
    documents_of,
    norm,
    rope_cache,
)
from pretrain.training.model.init_from import Source

TIED = "wte"  # the key of the tied embedding / head in the PipelineModule

# What flows between the layers: the hidden states (B, T, C) alone, or with packed documents the hidden
# states and each token's position in its document (B, T), and within a stage the mask (model.Documents).
Activations = Tensor | tuple[Any, ...]


def hidden(inputs: Activations) -> Tensor:
    """The hidden states of what a layer is given."""
    return inputs[0] if isinstance(inputs, tuple) else inputs


def stage_output(outputs: Activations) -> Activations:
    """What a stage sends on: its last layer's outputs without the document mask, which the next stage
    builds again from the positions (module docstring)."""
    return outputs[:2] if isinstance(outputs, tuple) and len(outputs) == 3 else outputs


class TokenEmbedding(nn.Embedding):
    """The token embedding; with packed documents (B, T, C) and the token positions (B, T) it derives."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(required_vocab_size(cfg), cfg.n_embd)
        self.document_eot = cfg.document_eot

    def forward(self, idx: Tensor) -> Activations:  # type: ignore[override]
        x = super().forward(idx)  # (B, T, C)
        return x if self.document_eot is None else (x, document_positions(idx, self.document_eot))


class Positions(nn.Module):
    """Learned position embeddings added to the token embeddings (none with RoPE), then dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, inputs: Activations) -> Activations:  # (B, T, C), or with (B, T) positions
        if isinstance(inputs, tuple):  # packed documents: each token's position in its document
            x, pos = inputs
            return (self.drop(x + self.wpe(pos) if self.wpe is not None else x), pos)
        x = inputs
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(x.size(1), device=x.device))
        return self.drop(x)


class PipelineBlock(Block, HasDerivedBuffers):
    """A block that carries its own RoPE tables (a stage holds no GPT to share them)."""

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, cfg: ModelConfig, document_attention: DocumentPath = "auto") -> None:
        super().__init__(cfg)
        self.cfg = cfg
        self.document_attention = document_attention  # as GPT's
        self.rope = cfg.position == "rope"
        self.reset_buffers()

    def reset_buffers(self) -> None:
        if self.rope:
            cos, sin = rope_cache(self.cfg.block_size, self.cfg.rotary_dims, self.cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, inputs: Activations) -> Activations:  # type: ignore[override]
        if isinstance(inputs, tuple):  # packed documents: (x, positions), and the mask after a stage's first
            x, pos = inputs[:2]
            if len(inputs) == 3:
                mask = inputs[2]
            else:
                dropout = self.training and self.cfg.dropout > 0
                mask = documents_of(pos, x.dtype, self.document_attention, attention_dropout=dropout)
            rope = (self.rope_cos[pos][:, None], self.rope_sin[pos][:, None]) if self.rope else None
            return (super().forward(x, rope, documents=mask), pos, mask)
        T = inputs.size(1)
        return super().forward(inputs, (self.rope_cos[:T], self.rope_sin[:T]) if self.rope else None)


class FinalNorm(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_f = norm(cfg)

    def forward(self, inputs: Activations) -> Tensor:
        return self.ln_f(hidden(inputs))


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
    """Cross-entropy of the last stage's logits, as GPT.forward computes it: in fp32, whatever the
    logits' dtype, because DeepSpeed's pipeline engine sums the micro batches' losses (for the step's
    loss and for evaluation) in the loss's own dtype, and a bf16 running sum of 512 losses near 1.7
    stops growing at 512. `poison` (a test hook: PRETRAIN_FAULT_NAN_STEPS) makes the next step's
    losses NaN."""

    def __init__(self) -> None:
        self.poison = False

    def __call__(self, logits: Tensor, targets: Tensor) -> Tensor:
        loss = cross_entropy(logits, targets)
        return loss * float("nan") if self.poison else loss


def gpt_names(cfg: ModelConfig) -> list[str]:
    """The prefix, in GPT's names, of each pipeline layer's parameters (by layer index)."""
    head = "" if not cfg.tie_embeddings else "wte."
    return ["wte.", "", *(f"h.{i}." for i in range(cfg.n_layer)), "", head]


def build_pipeline(cfg: RunConfig, where: torch.device, init: Source | None = None) -> Any:
    """The PipelineModule of `cfg` on this rank, holding only this stage's layers: each built on the
    meta device (DeepSpeed builds every layer of the model once more to count its parameters, for
    `partition_method` parameters: on the meta device that costs nothing), then, one at a time on
    `where`, initialised as in the whole GPT, given the weights of `init` (model.init_from: only this
    stage's tensors, and with parallel.tensor > 1 only the slices AutoTP leaves to this rank), and with
    parallel.tensor > 1 cut to this rank's share (tensor_parallel.py). No rank holds its whole stage."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from torch.distributed import get_world_size

    spec, tied_spec = _meta_specs()
    m, layout = cfg.model, layout_of(cfg, get_world_size())
    embed = tied_spec(TIED, TokenEmbedding, m, tied_weight_attr="weight")
    head = (
        tied_spec(TIED, TokenEmbedding, m, forward_fn=tied_logits, tied_weight_attr="weight")
        if m.tie_embeddings
        else spec(Head, m)
    )
    layers = [embed, spec(Positions, m), *(spec(PipelineBlock, m) for _ in range(m.n_layer))]
    layers += [spec(FinalNorm, m), head]
    # No autograd while building: PipelineModule ties the embedding of the first and last stages by
    # broadcasting its weight in place, which with autograd on leaves a c10d::broadcast_ record that
    # every backward of the last stage then warns about (docs/parallel.md).
    with torch.no_grad():
        return _stage_class()(
            StageBuild(cfg, where, init),
            layers=layers,
            topology=PipeModelDataParallelTopology(
                num_pp=layout.pipeline, num_mp=layout.tensor, num_dp=layout.data
            ),
            loss_fn=LossFn(),
            partition_method=cfg.parallel.partition_method,
            activation_checkpoint_interval=pipeline_checkpoint_interval(cfg),
            activation_checkpoint_func=_checkpoint,
        )


@dataclass(frozen=True)
class StageBuild:
    """What a stage's layers are materialised with: the config, the device, `model.init_from`."""

    cfg: RunConfig
    where: torch.device
    init: Source | None


@functools.cache
def _meta_specs() -> tuple[Any, Any]:
    """DeepSpeed's LayerSpec and TiedLayerSpec, building their modules on the meta device."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    class MetaLayerSpec(LayerSpec):
        def build(self, log: bool = False) -> nn.Module:
            with torch.device("meta"):
                return super().build(log=log)

    class MetaTiedLayerSpec(TiedLayerSpec):
        def build(self, log: bool = False) -> nn.Module:
            with torch.device("meta"):
                return super().build(log=log)

    return MetaLayerSpec, MetaTiedLayerSpec


@functools.cache
def _stage_class() -> type:
    """DeepSpeed's PipelineModule, its meta-built layers materialised where it moves them to its device.

    PipelineModule's constructor builds the stage's layers, then calls `self.to(device)`, then ties
    the shared embedding across stages (a broadcast of its weight): `to` is the first point at which
    the stage's topology (its tensor-parallel group) exists and its layers are built. Later calls of
    `to` (the engine's) are the plain one."""
    from deepspeed.pipe import PipelineModule

    class GPTStage(PipelineModule):
        def __init__(self, build: StageBuild, **kwargs: Any) -> None:
            self.pending_build: StageBuild | None = build  # a plain attribute: set before Module.__init__
            super().__init__(**kwargs)

        def to(self, *args: Any, **kwargs: Any) -> Any:
            if self.pending_build is not None:
                build, self.pending_build = self.pending_build, None
                _materialize_stage(self, build)
            return super().to(*args, **kwargs)

        def forward(self, forward_input: Activations) -> Activations:
            return stage_output(super().forward(forward_input))

    return GPTStage


def _checkpoint(function: Any, *args: Tensor) -> Any:
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _materialize_stage(module: Any, build: StageBuild) -> None:
    """Each of this stage's layers in turn: storage on `build.where` and the initial weights it has in
    the whole GPT (model.materialize), `init_from`'s weights (this rank's slices), and its tensor-
    parallel share. Only the blocks hold split matrices; the embeddings, norms and head stay whole."""
    from pretrain.training.distributed.tensor_parallel import TensorSharder, materialize_layer

    cfg, m, layout = build.cfg, build.cfg.model, layout_of(build.cfg)
    names = gpt_names(m)
    grid = stage_grid(module)  # the stage's topology, built by PipelineModule before its layers
    sharder = None
    if layout.tensor_parallel:
        # AutoTP's training layers ask DeepSpeed's groups for their group: it is the pipeline's.
        set_tensor_group(grid.get_slice_parallel_group())
        sharder = TensorSharder(module, m, layout.tensor, grid.get_slice_parallel_group())
    place = (layout.tensor, grid.get_slice_parallel_rank())  # within this rank's tensor group
    load = None
    if build.init is not None:
        load = functools.partial(init_from.load_shares, source=build.init, m=m, tensor=place)
    for idx, layer in _local_layers(module):
        materialize_layer(
            layer,
            m,
            gpt_name=names[idx].rstrip("."),
            root_name=str(idx),
            seed=cfg.seed,
            where=build.where,
            load=load,
            sharder=sharder,
        )
    if sharder is not None:
        sharder.finish(module, universal_info=False)


def _local_layers(module: Any) -> Iterator[tuple[int, nn.Module]]:
    """(layer index, layer) of this stage, a tied layer once under its first index here."""
    seen: set[int] = set()
    for offset, layer in enumerate(module.forward_funcs):
        if isinstance(layer, nn.Module) and id(layer) not in seen:
            seen.add(id(layer))
            yield stage_start(module) + offset, layer
    for key, layer in module.tied_modules.items():  # a tied head built on the last stage only
        if id(layer) not in seen and key == TIED:
            seen.add(id(layer))
            yield 0, layer
