"""What a rank holds as DeepSpeed 0.19.8 runs it: its model states, the buffer its gradients are summed
in over a step's micro batches, DeepSpeed's reduction buffers, its activations, and the host memory a
node's ranks take from the start. `plan` lays them out for every ZeRO stage and offload.

Model states follow the ZeRO paper (`plan`'s docstring), with what DeepSpeed allocates on top, read
from its sources (`runtime/engine.py`, `bf16_optimizer.py`, `zero/stage_1_and_2.py`, `zero/stage3.py`).
Where bf16 gradients are summed (`precision.grad_accum_dtype`, DeepSpeed's `data_types.grad_accum_dtype`)
decides which optimizer DeepSpeed builds and what it keeps (Ψ the rank's parameters, N the
data-parallel ranks, a the accumulation's bytes a gradient, 4 in fp32 and 2 in bf16):

- bf16 summed in fp32, stage 1 without offload: `BF16_Optimizer`. It keeps the flat bf16 parameters
  (2Ψ), their bf16 .grad (2Ψ, freed per parameter only with `bf16.immediate_grad_update`), a whole
  fp32 gradient buffer (`fp32_groups_gradients_flat`, 4Ψ on every rank, not partitioned) and the fp32
  master and Adam state of its partition (12Ψ/N); the step reads its partition of the buffer in place.
  After backward the engine all-reduces the buffer in fp32 (pretrain renders communication_data_type
  fp32 with fp32 sums: in bf16, DeepSpeed's own default, it would cast the buffer, 2Ψ more),
  concatenating the groups under `ALLREDUCE_BUCKET` elements first (`allreduce_copy_bytes`);
- bf16 summed in fp32, stage 1 with offload: `DeepSpeedZeroOptimizer` with `use_grad_accum_attribute`:
  each parameter's fp32 `grad_accum` on the device (4Ψ; the bf16 .grad is freed as it is added), its
  reduce buckets in fp32, and at the step's last micro batch the compact fp32 partition it reduces
  into (4Ψ/N), copied to the host's fp32 gradient (4Ψ/N, with the 12Ψ/N of state);
- bf16 summed in fp32, stage 2: `_use_compact_grad_partition_buffer`: the gradients are reduced into
  an fp32 partition (4Ψ/N, on the device also under offload), which the step reads in place: it takes
  the place of the bf16 partition (2Ψ/N) and of its fp32 conversion (4Ψ/N); under offload it is
  copied to the host's fp32 gradient, and the host keeps no bf16 partition;
- bf16 summed in fp32, stage 3: `grad_partitions_flat_buffer` in fp32 (4Ψ/N; on the host under
  optimizer offload), which the step flattens into fp32 one sub-group at a time;
- bf16 summed in bf16, and fp16: the ZeRO optimizers sum in the parameters' dtype (2Ψ, or 2Ψ/N
  partitioned from stage 2) and convert the partition to fp32 at the step (4Ψ/N); at stage 0 with a
  pipeline DeepSpeed builds `BF16_Optimizer` with a bf16 buffer (2Ψ beside the .grad, and its fp32
  state partitioned, 16Ψ/N). DeepSpeed's stage 0 sums bf16 gradients in bf16 only.

The dtype a gradient is reduced in over the data-parallel ranks (`gradient_comm_bytes`: fp32 with fp32
sums, unless deepspeed_extra's communication_data_type says otherwise) sets that cast copy, and the
bytes `plan` counts in the communication time.

Host memory at start (`host_at_start`), a rank: its process (`PROCESS_HOST_GB`), the model where it is
built (a GPU rank builds it on its device: in fp32 whole without tensor or pipeline parallelism, else
layer by layer, each cut to the rank's shard; on a CPU rank the device is the host, so the rank's
states and its fp32 build count there), and what offload moves to the host. A node holds its ranks'.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.config.layout import Layout
from pretrain.config.tree import RunConfig
from pretrain.plan.layout import StageShare, in_flight, layer_params, recomputes

GB = 1e9

# DeepSpeed's default zero_optimization.sub_group_size: stage 3 steps its optimizer one sub-group of
# at most this many elements at a time.
ZERO3_SUB_GROUP = 1e9
# The engine's MEMORY_OPT_ALLREDUCE_SIZE: `allreduce_no_retain` concatenates gradients until a bucket
# passes this many elements (a tensor over it is all-reduced alone, as a view).
ALLREDUCE_BUCKET = 500_000_000

# A rank's process in host memory before any model: torch with its CUDA libraries and context,
# DeepSpeed, NCCL, the data loader. pytorch/pytorch#113326 measured 2.06 GB of peak RSS for a process
# that only counts the GPUs and makes one CUDA tensor (torch 2.2, CUDA 11.8); 3 GB leaves room for
# NCCL's and the loader's. On a CPU a rank training a near-empty model peaks at 0.41-0.42 GB of RSS
# (the interpreter, torch, DeepSpeed, gloo: benchmarks/parallel.py, docs/parallel.md); 1 GB leaves room
# for the loader's and a real model's allocator.
PROCESS_HOST_GB = {"cuda": 3.0, "cpu": 1.0}


def bytes_per_param(precision: str, stage: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per parameter."""
    if precision in ("bf16", "fp16"):
        return 2, 2, 12
    return 4, 4, (8 if stage == 0 else 12)


def accumulation_bytes(precision: str, grad_accum_dtype: str, stage: int) -> int:
    """Bytes a gradient element is summed in over the micro batches: fp32 for bf16 training with
    grad_accum_dtype fp32 at stages 1-3 (DeepSpeed's stage 0 sums bf16 in bf16 only), else the
    parameters' own."""
    if precision == "bf16":
        return 4 if grad_accum_dtype == "fp32" and stage >= 1 else 2
    return bytes_per_param(precision, stage)[1]


def bf16_optimizer(
    precision: str, accum: int, *, stage: int, offload_optimizer: bool, pipeline: bool
) -> bool:
    """Whether DeepSpeed wraps the optimizer in `BF16_Optimizer` (`engine._do_optimizer_sanity_check`):
    bf16 summed in fp32 at stage 1 without offload, or bf16 summed in bf16 at stage 0 in a pipeline."""
    if precision != "bf16" or offload_optimizer:
        return False
    return (stage == 1 and accum == 4) or (stage == 0 and pipeline and accum == 2)


def model_states(
    n_params: int,
    *,
    stage: int,
    world: int,
    precision: str,
    offload_optimizer: bool,
    offload_param: bool,
    gathered: int = 0,
    accum: int | None = None,
    pipeline: bool = False,
    frees_16bit_grads: bool = False,
) -> tuple[float, float, float, float]:
    """(params, grads, optimizer) bytes on the device and bytes on the host, per rank.

    On top of the ZeRO paper's count, as DeepSpeed 0.19's optimizers run (as its estimators count
    them where the gradients are summed in their own 16 bits, `accum` None):
    - in 16-bit training the optimizer step converts the rank's gradient partition to fp32 (4Ψ/N,
      counted with the optimizer: DeepSpeed's "4_grads_32bit"), at stage 3 one sub-group of at most
      `ZERO3_SUB_GROUP` elements at a time;
    - stage 3 gathers one layer's parameters at a time (`gathered`, the largest) and holds its full
      gradients until they are reduce-scattered: p + g bytes of it on the device, offloaded or not;
    - under optimizer offload the gradient partition goes to the host as it is reduced (stage 2's
      `copy_grads_in_partition`, accumulated there across micro steps; stage 3's
      grad_partitions_flat_buffer on the CPU), with its fp32 copy and the fp32 state; stage 1 keeps
      its full gradients on the device until backward ends;
    - `accum` bytes a gradient is summed in (`accumulation_bytes`), `pipeline` and `frees_16bit_grads`
      (bf16.immediate_grad_update) choose DeepSpeed's buffers as the module docstring says.
    """
    p, g, k = bytes_per_param(precision, stage)
    a = g if accum is None else accum
    psi, n = float(n_params), float(world)
    if bf16_optimizer(precision, a, stage=stage, offload_optimizer=offload_optimizer, pipeline=pipeline):
        # the bf16 .grad, the whole flat buffer; the step's fp32 gradient is a view of an fp32 buffer
        grads = (0.0 if frees_16bit_grads else g * psi) + a * psi
        return p * psi, grads, 12 * psi / n + (0.0 if a == 4 else 4 * psi / n), 0.0
    if precision == "bf16" and a == 4 and stage >= 1:
        params, grads, optim, host = _fp32_summed(psi, n, stage=stage, offload_optimizer=offload_optimizer)
    else:
        params, grads, optim, host = _own_dtype_summed(
            psi, n, p=p, g=g, k=k, stage=stage, precision=precision, offload_optimizer=offload_optimizer
        )
    if offload_param:
        host += params
        params = 0.0
    if stage == 3:
        params += p * gathered
        grads += g * gathered
    return params, grads, optim, host


def _own_dtype_summed(
    psi: float, n: float, *, p: int, g: int, k: int, stage: int, precision: str, offload_optimizer: bool
) -> tuple[float, float, float, float]:
    """The ZeRO paper's states with DeepSpeed's fp32 conversion and offload, gradients summed in the
    parameters' dtype (`model_states`)."""
    params = p * psi / (n if stage >= 3 else 1)
    grads = g * psi / (n if stage >= 2 else 1)
    optim = k * psi / (n if stage >= 1 else 1)
    if stage >= 1 and precision in ("bf16", "fp16"):
        optim += 4 * (min(psi / n, ZERO3_SUB_GROUP) if stage == 3 else psi / n)
    host = 0.0
    if offload_optimizer:
        # The fp32 state and the fp32 copy of the partition's gradients the CPU optimizer steps on.
        host += k * psi / n + 4 * psi / n
        optim = 0.0
        if stage >= 2:
            # Stage 3 keeps the 16-bit gradient partition on the host; stage 2 accumulates the
            # partition's gradients there across micro steps (`async_accumulate_grad_in_cpu_via_gpu`).
            host += grads
            grads = 0.0
    return params, grads, optim, host


def _fp32_summed(
    psi: float, n: float, *, stage: int, offload_optimizer: bool
) -> tuple[float, float, float, float]:
    """bf16 states at stages 1-3 with the gradients summed in fp32 by the ZeRO optimizers (stage 1 here
    only under offload: without it DeepSpeed builds BF16_Optimizer)."""
    params = 2 * psi / (n if stage == 3 else 1)
    partition = 4 * psi / n  # the fp32 gradient partition the step reads
    if offload_optimizer:
        # the fp32 state and fp32 gradient on the host; stage 1's fp32 grad_accum and stage 1-2's compact
        # partition on the device, stage 3's grad_partitions_flat_buffer on the host
        device_grads = {1: 4 * psi + partition, 2: partition, 3: 0.0}[stage]
        host = 12 * psi / n + 4 * psi / n + (partition if stage == 3 else 0.0)
        return params, device_grads, 0.0, host
    # stage 2 reads its compact partition in place; stage 3 flattens a sub-group of its buffer
    optim = 12 * psi / n + (4 * min(psi / n, ZERO3_SUB_GROUP) if stage == 3 else 0.0)
    return params, partition, optim, 0.0


def allreduce_copy_bytes(n_params: int, accum: int, comm: int) -> float:
    """What BF16_Optimizer's all-reduce after backward allocates (`engine.allreduce_no_retain` over its
    flat buffers, taken as one group of the rank's parameters): a buffer over `ALLREDUCE_BUCKET`
    elements goes alone, as a view, smaller ones are concatenated (`accum` bytes each); each bucket is
    cast to the communication dtype (`comm` bytes each) unless it is in it already (fp32 sums are
    all-reduced in fp32: `gradient_comm_bytes`)."""
    psi = float(n_params)
    concatenated = accum * psi if psi <= ALLREDUCE_BUCKET else 0.0
    return concatenated + (comm * psi if accum != comm else 0.0)


@dataclass(frozen=True)
class HostAtStart:
    """A rank's host memory from its start, in bytes, and its node's."""

    process: float  # torch, DeepSpeed and (on a GPU rank) the CUDA context: PROCESS_HOST_GB
    model: float  # the model where the host is its device (CPU ranks): its states, or its fp32 build
    offloaded: float  # what offload moves to the host
    ranks: int  # a node's ranks

    @property
    def rank(self) -> float:
        return self.process + self.model + self.offloaded

    @property
    def node(self) -> float:
        return self.rank * self.ranks


def host_at_start(
    *, device_total: float, offloaded: float, build: float, cpu: bool, ranks: int
) -> HostAtStart:
    """A rank's host memory (`HostAtStart`): on a GPU its process and the offloaded states, the model
    being built on the GPU; on a CPU also the rank's device total (the host is its device), or the
    fp32 model it builds first when that is more (`build`, counted with the offloaded states)."""
    process = PROCESS_HOST_GB["cpu" if cpu else "cuda"] * GB
    if not cpu:
        return HostAtStart(process, 0.0, offloaded, ranks)
    model = max(device_total, build - offloaded)
    return HostAtStart(process, model, offloaded, ranks)


def snapshot_bytes(precision: str, n_params: int, *, stage: int, world: int) -> tuple[float, float]:
    """Host memory an asynchronous save's snapshot takes while it is written (checkpoint.async_save):
    (the rank that writes the weights, every other rank), for a rank holding `n_params` with ZeRO
    over `world` data-parallel ranks. The first data-parallel rank writes the module's weights in
    their training dtype; every rank its optimizer partition (the fp32 master, where the weights are
    16-bit, and Adam's two moments); at stage 0 the first rank writes it all."""
    weights = bytes_per_param(precision, stage)[0] * n_params
    state = (12 if precision in ("bf16", "fp16") else 8) * n_params
    if stage == 0:
        return weights + state, 0.0
    return weights + state / world, state / world


# ---------------------------------------------------------------------------------------------
# A rank of a config: its share of the layout, at a ZeRO stage and offload


def largest_layer_params(cfg: RunConfig) -> int:
    """The most parameters any one module holds (ZeRO-3 gathers one module's at a time)."""
    m = cfg.model
    d, vocab, f = m.n_embd, m.vocab_size or 0, m.ffn_hidden
    qkv = d + 2 * m.kv_heads * m.head_size  # c_attn's outputs
    fc = (2 if m.arch == "llama" else 1) * f  # c_fc's outputs: SwiGLU fuses gate and up
    b = 1 if m.bias else 0
    return max(vocab * d, fc * d + b * fc, f * d + b * d, qkv * d + b * qkv)


def accumulation_of(cfg: RunConfig, stage: int) -> int:
    """Bytes a gradient is summed in over the micro batches at `stage` (`accumulation_bytes`)."""
    return accumulation_bytes(cfg.precision.name, cfg.precision.grad_accum_dtype, stage)


DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def gradient_comm_bytes(cfg: RunConfig, stage: int) -> int:
    """Bytes a gradient element is all-reduced or reduce-scattered in at `stage`: DeepSpeed's
    communication_data_type as `deepspeed_extra` sets it, else as rendered: fp32 where bf16 gradients
    are summed in fp32 at that stage (`accumulation_of`: stages 1-3), so that the sum over the
    data-parallel ranks is fp32 too; else the gradients' own dtype (DeepSpeed's stage 0 sums and
    all-reduces bf16 gradients in bf16)."""
    given = cfg.deepspeed_extra.get("communication_data_type")
    if isinstance(given, str) and given.lower() in DTYPE_BYTES:
        return DTYPE_BYTES[given.lower()]
    return accumulation_of(cfg, stage)


def uses_bf16_optimizer(cfg: RunConfig, *, stage: int, offload_optimizer: bool) -> bool:
    """Whether DeepSpeed runs `cfg` at `stage` with BF16_Optimizer (`bf16_optimizer`)."""
    return bf16_optimizer(
        cfg.precision.name,
        accumulation_of(cfg, stage),
        stage=stage,
        offload_optimizer=offload_optimizer,
        pipeline=cfg.parallel.pipeline > 1,
    )


def rank_states(
    cfg: RunConfig, n_params: int, *, stage: int, world: int, offload_optimizer: bool, offload_param: bool
) -> tuple[float, float, float, float]:
    """`model_states` of a rank of `cfg` holding `n_params` at this stage and offload."""
    extra = cfg.deepspeed_extra.get("bf16")
    return model_states(
        n_params,
        stage=stage,
        world=world,
        precision=cfg.precision.name,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        gathered=largest_layer_params(cfg),
        accum=accumulation_of(cfg, stage),
        pipeline=cfg.parallel.pipeline > 1,
        frees_16bit_grads=isinstance(extra, dict) and bool(extra.get("immediate_grad_update")),
    )


def working_bytes(
    cfg: RunConfig, n_params: int, *, stage: int, world: int, offload_optimizer: bool = False
) -> float:
    """Buffers DeepSpeed adds on the device while it reduces gradients in backward (read from its sources):

    - stage 0: the gradients flattened into one all-reduce buffer of up to 5e8 elements (none with
      one rank: pretrain then skips the reduction);
    - stages 1-2: the reduce bucket, two of them when `overlap_comm` double-buffers, each of
      `reduce_bucket_size` elements whatever the model's size: `setup_buckets` allocates them with
      `torch.empty(reduce_bucket_size)` at a step's first backward and frees them after its last
      (measured: 4.0 GB more live at the default 5e8 fp32 elements for a 3.2M- and a 30k-parameter
      model alike), in fp32 at stage 1 where bf16 gradients are summed in fp32. The gradients are
      written into the first Ψ elements only, so on a CPU the rest is never resident
      (`bucket_written_bytes`), but a GPU's allocator hands out all of it;
    - stage 3: a reduce bucket (the gathered layer is a model state, `model_states`);
    - BF16_Optimizer: none (it all-reduces after backward, `after_backward_bytes`).
    """
    if uses_bf16_optimizer(cfg, stage=stage, offload_optimizer=offload_optimizer):
        return 0.0
    _, g, _ = bytes_per_param(cfg.precision.name, stage)
    z = cfg.zero
    if stage == 0:
        return 0.0 if world == 1 else float(g * min(n_params, ALLREDUCE_BUCKET))
    if stage in (1, 2):
        bucket = accumulation_of(cfg, stage) if stage == 1 else g  # stage 1 reduces its grad_accum
        return float(bucket * z.reduce_bucket_size * (2 if z.overlap_comm else 1))
    return float(g * min(z.reduce_bucket_size, n_params))


def after_backward_bytes(cfg: RunConfig, n_params: int, *, stage: int, offload_optimizer: bool) -> float:
    """What DeepSpeed allocates once backward has freed the activations: BF16_Optimizer's all-reduce
    of its flat gradient buffer (`allreduce_copy_bytes`); nothing on the other paths."""
    if not uses_bf16_optimizer(cfg, stage=stage, offload_optimizer=offload_optimizer):
        return 0.0
    return allreduce_copy_bytes(n_params, accumulation_of(cfg, stage), gradient_comm_bytes(cfg, stage))


def bucket_written_bytes(cfg: RunConfig, n_params: int, *, stage: int) -> float:
    """The part of stages 1-2's reduce buckets (`working_bytes`) that gradients are written into: each
    of the rank's Ψ gradients is copied into a bucket once, the buckets taking turns when one fills.
    Only these pages become resident on a CPU; the rest is allocated but never touched."""
    if stage not in (1, 2) or uses_bf16_optimizer(cfg, stage=stage, offload_optimizer=False):
        return working_bytes(cfg, n_params, stage=stage, world=2)
    _, g, _ = bytes_per_param(cfg.precision.name, stage)
    z = cfg.zero
    return float(g * min(n_params, z.reduce_bucket_size * (2 if z.overlap_comm else 1)))


def build_bytes(cfg: RunConfig, layout: Layout, share: StageShare) -> float:
    """The most a rank holds while its model is built, in fp32 on its device (training/distributed/engine.py): the
    whole GPT without tensor or pipeline parallelism (at ZeRO-3 under zero.Init its partition and the
    module being built), else its shard and the one layer being cut to it, whole."""
    m = cfg.model
    if layout.tensor * layout.pipeline > 1:
        emb, sharded, whole, head = layer_params(m)
        layer = max(
            sharded + whole if share.blocks else 0, emb if share.first else 0, head if share.last else 0
        )
        return 4.0 * (share.params + layer)
    if cfg.zero.stage == 3 and cfg.zero.init_on_construct:
        return 4.0 * (share.params / layout.data + largest_layer_params(cfg))
    return 4.0 * share.params


def document_mask_bytes(cfg: RunConfig, *, cpu: bool) -> float:
    """One micro batch's document mask (loader.document_mask), built once per micro batch (a stage's first
    block) and kept for backward by every layer, on the path the model takes (model/gpt.py's
    `document_path`): on CUDA ranks without attention dropout FlexAttention's block mask, int32 block
    counts (b, 1, n) and indices (b, 1, n, n) for the keys' and the queries' side, partial and full
    blocks each (n = ceil(s / 128)), and the (b, s) int64 document starts its rule reads; otherwise the
    dense additive (b, 1, s, s) mask in the activations' dtype, with no T x T copy per layer (it is
    passed in the dtype SDPA computes in)."""
    s, b = cfg.model.block_size, cfg.batch.micro_batch_size
    if not cfg.loader.document_mask:
        return 0.0
    if not cpu and cfg.model.dropout == 0:
        n = -(-s // 128)
        return float(4 * 4 * b * n * (n + 1) + 8 * b * s)
    return float(s * s * b * (2 if cfg.precision.name in ("bf16", "fp16") else 4))


def activation_bytes(
    cfg: RunConfig, layout: Layout | None = None, share: StageShare | None = None, *, cpu: bool = False
) -> float:
    """Activations kept for backward on one rank: one micro batch's through the whole model, or
    (`layout`, `share`) those of a pipeline stage's micro batches in flight on one of its tensor ranks
    (`cpu`: the ranks are CPUs, whose document mask is the dense one)."""
    m = cfg.model
    layout = layout or Layout()
    s, b, h, tp = m.block_size, cfg.batch.micro_batch_size, m.n_embd, layout.tensor
    blocks, first, last = (
        (m.n_layer, True, True) if share is None else (share.blocks, share.first, share.last)
    )
    vocab = m.vocab_size or 0
    a = 2 if cfg.precision.name in ("bf16", "fp16") else 4  # bytes per activation value
    masks = 2 * s * b * h if m.dropout > 0 else 0  # 1-byte dropout masks: attention out + MLP out
    # Values kept per token: the two norms' inputs (2h); attention's input, q, k, v and output
    # (3h + 2 kv, flash attention keeps no T x T scores); the MLP's input and hidden activations,
    # GELU's c_fc output and GELU output (2f), or SwiGLU's gate, up, silu(gate) and product (4f).
    # For gpt2 (f = 4h, kv = h) that is Korthikanti's 32 sbh bytes at a = 2, without masks. Tensor
    # parallel splits what lies between a column- and a row-parallel matrix (q, k, v, attention's
    # output, the MLP's hidden values) over the tensor ranks; the norms' and the matrices' inputs
    # stay whole on each (no sequence parallelism).
    kv, f = m.kv_heads * m.head_size, m.ffn_hidden
    whole = 2 * h + h + h
    split = 2 * h + 2 * kv + (4 if m.arch == "llama" else 2) * f
    per_layer = (whole + split / tp) * s * b * a + masks
    # With checkpointing: the input of every interval's first block, and one interval's activations
    # while it is recomputed (once, whatever the micro batches in flight).
    every = recomputes(cfg, layout.pipeline)
    kept = math.ceil(blocks / every) * s * b * h * a if every else blocks * per_layer
    recompute = min(every, blocks) * per_layer if every else 0
    logits = s * b * vocab * (a + 4) if last else 0  # the logits and cross-entropy's fp32 softmax
    embedded = s * b * h * a if first else 0  # the embedding output
    documents = document_mask_bytes(cfg, cpu=cpu) if blocks else 0
    count = 1 if share is None else in_flight(layout, share, batch=cfg.batch)
    return float(count * (kept + logits + embedded + documents) + recompute)


@dataclass(frozen=True)
class RankMemory:
    """One rank's bytes at one stage and offload (`rank_memory`)."""

    share: StageShare
    params: float
    grads: float
    optim: float
    host: float  # offloaded to host memory
    act: float
    working: float  # in backward: DeepSpeed's reduce buckets
    after: float  # after backward, the activations freed: BF16_Optimizer's all-reduce copy
    build: float  # the fp32 model while it is built

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optim

    @property
    def total(self) -> float:
        return self.states + max(self.act + self.working, self.after)


def rank_memory(
    cfg: RunConfig,
    layout: Layout,
    share: StageShare,
    *,
    stage: int,
    offload_optimizer: bool,
    offload_param: bool,
    cpu: bool = False,
) -> RankMemory:
    """What a rank of `share` holds at this stage and offload, ZeRO over the layout's data ranks
    (`cpu`: the ranks are CPUs)."""
    n, dp, off = share.params, layout.data, offload_optimizer
    params, grads, optim, host = rank_states(
        cfg, n, stage=stage, world=dp, offload_optimizer=off, offload_param=offload_param
    )
    return RankMemory(
        share=share,
        params=params,
        grads=grads,
        optim=optim,
        host=host,
        act=activation_bytes(cfg, layout, share, cpu=cpu),
        working=working_bytes(cfg, n, stage=stage, world=dp, offload_optimizer=off),
        after=after_backward_bytes(cfg, n, stage=stage, offload_optimizer=off),
        build=build_bytes(cfg, layout, share),
    )


def deepspeed_estimate(
    n_params: int,
    largest: int,
    *,
    stage: int,
    world: int,
    gpus_per_node: int,
    offload_optimizer: bool,
    offload_param: bool,
) -> tuple[float | None, float | None]:
    """DeepSpeed's own (device, host) model-state estimate in bytes per rank; None at stages 0 and 1,
    which it has no estimator for (its zero2 one partitions the gradients, which stage 1 does not)."""
    nodes = max(1, world // gpus_per_node)
    per_node = min(world, gpus_per_node)
    if stage == 2:
        # DeepSpeed only for its estimators: importing it takes seconds.
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(
            n_params, per_node, nodes, cpu_offload=offload_optimizer
        )
        return float(gpu), float(cpu)
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs  # as above

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            n_params,
            largest,
            per_node,
            nodes,
            cpu_offload=offload_optimizer,
            cpu_offload_params=offload_param,
            zero_init=True,
        )
        return float(gpu), float(cpu)
    return None, None


def deepspeed_host_reading(
    n_params: int,
    largest: int,
    *,
    stage: int,
    world: int,
    gpus_per_node: int,
    offload_optimizer: bool,
    offload_param: bool,
) -> tuple[float, str] | None:
    """DeepSpeed's host estimate for a node in bytes (`deepspeed_estimate`), and what its formula counts,
    as DeepSpeed 0.19.8's `estimate_zero2_model_states_mem_needs` (`zero/stage_1_and_2.py`) and
    `estimate_zero3_model_states_mem_needs` (`zero/stage3.py`, zero_init) write it; None at stages 0
    and 1. Each counts its states times `additional_buffer_factor` 1.5, and no process."""
    nodes = max(1, world // gpus_per_node)
    per_node = min(world, gpus_per_node)
    psi = f"{n_params / 1e9:.3g}B" if n_params >= 1e9 else f"{n_params / 1e6:.3g}M"
    if stage == 2 and not offload_optimizer:
        return 1.5 * 4 * n_params * per_node, (
            f"1.5 x 4 bytes x {psi} parameters x {per_node} rank{'s' if per_node > 1 else ''}: an fp32 copy of the "
            "whole model on the host "
            "for each of a node's ranks, as a model built on the CPU takes before it moves to the GPU"
        )
    if stage == 2:
        if 4 * world >= 16:
            return 1.5 * 4 * n_params * world, (
                f"1.5 x 4 bytes x {psi} parameters x {world} ranks, max(4 x all ranks, 16) bytes a parameter: "
                "an fp32 copy of the whole model for every rank of every node, counted on each node"
            )
        return 1.5 * 16 * n_params, (
            f"1.5 x 16 bytes x {psi} parameters, max(4 x all ranks, 16) bytes a parameter: the whole model's "
            "offloaded fp32 states on one node"
        )
    if stage == 3 and not offload_optimizer:
        return 1.5 * 4 * largest * per_node, (
            f"1.5 x 4 bytes x {largest / 1e6:.3g}M parameters of the largest layer x {per_node} "
            f"rank{'s' if per_node > 1 else ''}: "
            "zero.Init builds the model a layer at a time"
        )
    if stage == 3:
        per = 18 if offload_param else 16
        what = "fp32 states and 16-bit parameters" if offload_param else "fp32 states"
        return 1.5 * per * n_params / nodes, (
            f"1.5 x {per} bytes x {psi} parameters / {nodes} node{'s' if nodes > 1 else ''}: the whole "
            f"model's offloaded {what}, shared by the nodes"
        )
    return None
