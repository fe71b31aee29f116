"""Published pretraining runs, and the compute efficiency `pretrain plan` assumes from them.

`plan` predicts a step as compute (the FLOPs of forward and backward, the recomputed forward
included, over the device's peak times an efficiency) plus the communication compute does not
hide, the pipeline's bubble and the optimizer step. The efficiency of forward + backward is the one
rate no datasheet gives. Without `--mfu` or `--from-run`, `plan` takes it from `FWD_BWD_EFFICIENCY`:
per device class and model size, fitted to the runs in `PUBLISHED` marked `fit`, each of which the
table names. The runs not marked `fit` are held out: they check the fit, and so do the runs no
efficiency reproduces (their communication, as `plan` counts it, takes longer than their published
step). `docs/plan.md` shows every run's published tokens/s beside what `plan` predicts for it, and
`tests/test_plan_published.py` checks that table against `plan` itself.

A run is given as the `pretrain plan` arguments that describe it: its model shape as overrides of
a preset, its layout, batch, precision (with the dtypes its gradients were summed and reduced in,
which set the bytes its communication takes) and activation checkpointing, and its GPUs. Positions
that this project does not model (BLOOM's ALiBi) are given as RoPE, which has no parameters either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str  # where the figure is published: a URL, or repository + path + commit
    quote: str  # the figure, as published
    args: tuple[str, ...]  # `pretrain plan` arguments for the run
    tokens_per_s_per_gpu: float  # as published, or derived from a published step time (see quote)
    fit: bool  # used to fit FWD_BWD_EFFICIENCY; False: held out, to check it
    memory_gib: float | None = None  # peak memory per GPU where published


def _sets(*items: str) -> tuple[str, ...]:
    return tuple(a for item in items for a in ("--set", item))


def _gpt(layers: int, heads: int, d: int, vocab: int, block: int) -> tuple[str, ...]:
    return _sets(
        f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_embd={d}",
        f"model.vocab_size={vocab}", f"model.block_size={block}",
    )  # fmt: skip


def _llama(layers: int, heads: int, kv: int, d: int, ffn: int, vocab: int, block: int) -> tuple[str, ...]:
    return _sets(
        f"model.n_layer={layers}", f"model.n_head={heads}", f"model.n_kv_head={kv}", f"model.n_embd={d}",
        f"model.intermediate_size={ffn}", f"model.vocab_size={vocab}", f"model.block_size={block}",
        "model.tie_embeddings=false",
    )  # fmt: skip


def _run(
    *,
    gpus: int,
    device: str,
    micro: int,
    accumulation: int,
    stage: int,
    checkpointing: bool,
    sums: str,
    comm: str | None = None,
    tensor: int = 1,
    pipeline: int = 1,
    per_node: int = 8,
) -> tuple[str, ...]:
    """`pretrain plan` arguments for a run. `sums`: the dtype it summed its gradients in over the
    micro batches (precision.grad_accum_dtype; DeepSpeed's stage 0 takes bf16 only); `comm`: the dtype
    it reduced them in over the data-parallel ranks, where that is not what `sums` renders (fp32 sums
    are reduced in fp32, bf16 sums in bf16), as deepspeed_extra.communication_data_type. The gradient
    bytes `plan` counts in the communication time follow from the two (`memory.gradient_comm_bytes`)."""
    extra = _sets(f"deepspeed_extra={{communication_data_type: {comm}}}") if comm else ()
    return (
        "--world-size", str(gpus), "--gpus-per-node", str(min(gpus, per_node)), "--gpu", device,
        *_sets(
            f"batch.micro_batch_size={micro}", f"batch.gradient_accumulation_steps={accumulation}",
            f"zero.stage={stage}", "zero.offload_optimizer=false", "zero.offload_param=false",
            f"model.activation_checkpointing={str(checkpointing).lower()}",
            f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}",
            "precision.bf16=true", "precision.fp16=false", "compile.enabled=false",
            f"precision.grad_accum_dtype={sums}",
        ),
        *extra,
    )  # fmt: skip


LLAMA3_8B = _llama(32, 32, 8, 4096, 14336, 128256, 8192)
LLAMA3_70B = _llama(80, 64, 8, 8192, 28672, 128256, 8192)
TORCHTITAN_2024 = "pytorch/torchtitan docs/performance.md (mid-2024), https://github.com/pytorch/torchtitan/commits/main/docs/performance.md"
MPT = "mosaicml/llm-foundry scripts/train/benchmarking/README.md @ 061f2c7ce64e655100286584a7629e2a09f827ba"
MEGATRON = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, arXiv 2104.04473, Table 1"

# What each run summed its gradients in over the micro batches and reduced them in over the data-parallel
# ranks (`_run`'s sums and comm), as its code did. plan counts a gradient at the bytes it was reduced in.
#
# llm.c sums them in bf16 and reduce-scatters them in bf16 (karpathy/llm.c @ 039904ee: train_gpt2.cu,
# "the gradients accumulate += into grads_memory", a floatX buffer; llmc/zero.cuh,
# multi_gpu_async_reduce_gradient: ncclReduceScatter of floatX, ncclFloatX = ncclBfloat16 by default).
LLMC_SUMS = "bf16"
# Megatron-LM's runs of the paper were fp16 without --accumulate-allreduce-grads-in-fp32
# (NVIDIA/Megatron-LM examples/sc21/CONFIG.sh: '--fp16 --loss-scale 8192'; arguments.py turns fp32
# accumulation and all-reduce on for bf16 only), so their gradients were summed and all-reduced in 16 bits:
# planned as bf16 sums, which are all-reduced in bf16 (2 bytes, as fp16).
MEGATRON_SUMS = "bf16"
# torchtitan's FSDP2 reduce-scatters in fp32 (pytorch/torchtitan torchtitan/config_manager.py @ 391ddd3d:
# --training.mixed_precision_reduce, default float32, its only choice, passed to MixedPrecisionPolicy as
# reduce_dtype; its later job_config keeps mixed_precision_reduce: Literal["float32"] = "float32"), into
# fp32 gradients: the default, fp32 sums reduced in fp32.
TORCHTITAN_SUMS = "fp32"
# llm-foundry's MPT rows ran with FSDP 'MP Mode DEFAULT' on the image mosaicml/pytorch:2.1.0_cu121-
# nightly20230827 (mosaicml/llm-foundry @ beb8dee6 scripts/train/benchmarking/h100new.csv, its Image
# column), on which submit_benchmarks.py (@ 061f2c7c) installs composer @ 784f50be. There Composer's
# DEFAULT is MixedPrecision(param_dtype=bf16, buffer_dtype=bf16) with no reduce_dtype, which torch FSDP
# takes as param_dtype: gradients reduce-scattered in bf16 (composer gave DEFAULT reduce_dtype fp32 only
# in d745fcb1, 2023-10-10, v0.16.4), then added into the fp32 sharded gradient: fp32 sums reduced in bf16.
MPT_SUMS, MPT_COMM = "fp32", "bf16"
# BLOOM ran DeepSpeed ZeRO stage 0 with bf16 (bigscience train/tr11-176B-ml/tr11-176B-ml.slurm:
# 'ZERO_STAGE=0 # important: bf16 must use z0! it implements its own zero stage 1 equivalent'), i.e.
# BF16_Optimizer, which sums in an fp32 buffer, and set no communication_data_type: DeepSpeed's engine
# casts each all-reduce bucket to communication_data_type, bf16 under bf16 in every engine.py read (the
# v0.5 one, before BF16_Optimizer, and 0.19's). Planned as ZeRO-1 (0.19's BF16_Optimizer) with fp32
# sums all-reduced in bf16, whose cast copy plan counts too.
BLOOM_SUMS, BLOOM_COMM = "fp32", "bf16"

PUBLISHED: tuple[PublishedRun, ...] = (
    PublishedRun(
        "llm.c GPT-2 124M, 8 x A100-80GB",
        "karpathy/llm.c scripts/run_gpt2_124M.sh @ 039904ee9fb925be226116d08b0e4c73e6518b7e",
        "524,288 tokens a step, 'steps in ~300ms/iter' (ZeRO-1, no recompute, micro 64 x 1024)",
        (
            "gpt2-124m",
            *_gpt(12, 12, 768, 50304, 1024),
            *_run(
                gpus=8,
                device="A100-80GB",
                micro=64,
                accumulation=1,
                stage=1,
                checkpointing=False,
                sums=LLMC_SUMS,
            ),
        ),
        524_288 / 0.300 / 8,
        fit=True,
    ),
    PublishedRun(
        "llm.c GPT-2 1.5B, 8 x H100-80GB",
        "karpathy/llm.c scripts/run_gpt2_1558M.sh @ 039904ee9fb925be226116d08b0e4c73e6518b7e",
        "1,048,576 tokens a step, 'steps in 2.80s/iter' (ZeRO-1, no recompute, micro 16 x 1024)",
        (
            "gpt2-124m",
            *_gpt(48, 25, 1600, 50304, 1024),
            *_run(
                gpus=8, device="H100", micro=16, accumulation=8, stage=1, checkpointing=False, sums=LLMC_SUMS
            ),
        ),
        1_048_576 / 2.80 / 8,
        fit=True,
    ),
    PublishedRun(
        "Megatron-LM GPT 1.7B, 32 x A100-80GB",
        MEGATRON,
        "137 TFLOP/s a GPU (44% of peak), counting the recomputed forward: 9,288 tokens/s a GPU",
        (
            "gpt2-124m",
            *_gpt(24, 24, 2304, 51200, 2048),
            *_run(
                gpus=32,
                device="A100-80GB",
                micro=1,
                accumulation=16,
                stage=0,
                checkpointing=True,
                sums=MEGATRON_SUMS,
            ),
        ),
        9288,
        fit=True,
    ),
    PublishedRun(
        "Megatron-LM GPT 18.4B, 256 x A100-80GB (TP8)",
        MEGATRON,
        "135 TFLOP/s a GPU (43%), counting the recomputed forward: 872 tokens/s a GPU",
        (
            "gpt2-124m",
            *_gpt(40, 48, 6144, 51200, 2048),
            *_run(
                gpus=256,
                device="A100-80GB",
                micro=1,
                accumulation=32,
                stage=0,
                checkpointing=True,
                tensor=8,
                sums=MEGATRON_SUMS,
            ),
        ),
        872,
        fit=True,
    ),
    PublishedRun(
        "Megatron-LM GPT 145.6B, 1536 x A100-80GB (TP8 x PP8)",
        MEGATRON,
        "148 TFLOP/s a GPU (47%), counting the recomputed forward: 124 tokens/s a GPU",
        (
            "gpt2-124m",
            *_gpt(80, 96, 12288, 51200, 2048),
            *_run(
                gpus=1536,
                device="A100-80GB",
                micro=1,
                accumulation=96,
                stage=1,
                checkpointing=True,
                tensor=8,
                pipeline=8,
                sums=MEGATRON_SUMS,
            ),
        ),
        124,
        fit=True,
    ),
    PublishedRun(
        "torchtitan Llama 3.1 8B, 8 x H100 (FSDP)",
        "pytorch/torchtitan docs/performance.md @ eaea6f6a2fa940f03a10906be1df3489cf30af85, Table 1",
        "5,762 tokens/s a GPU, 82.4 GiB (FSDP, local batch 2 x 8192, selective checkpointing; 96 GB H100s at 500 W)",
        (
            "llama-7b",
            *LLAMA3_8B,
            *_run(
                gpus=8,
                device="H100",
                micro=2,
                accumulation=1,
                stage=3,
                checkpointing=False,
                sums=TORCHTITAN_SUMS,
            ),
        ),
        5762,
        fit=True,
        memory_gib=82.4,
    ),
    PublishedRun(
        "torchtitan Llama 3.1 405B, 128 x H100 (FSDP16 x TP8)",
        TORCHTITAN_2024,
        "WPS 109, MFU 29.0% (FSDP2 16 x TP 8, local batch 2 x 8192, full checkpointing, bf16; 95 GB H100s at "
        "a lower TDP; ZeRO-2 here, as tensor parallel takes ZeRO 0-2)",
        (
            "llama-7b",
            *_llama(126, 128, 8, 16384, 53248, 128256, 8192),
            *_run(
                gpus=128,
                device="H100",
                micro=2,
                accumulation=1,
                stage=2,
                checkpointing=True,
                tensor=8,
                sums=TORCHTITAN_SUMS,
            ),
        ),
        109,
        fit=True,
    ),
    PublishedRun(
        "MPT 7B, 8 x H100-80GB (FSDP, no checkpointing)",
        MPT,
        "'7b | 2048 | 8 | h100_80gb | 46.44 | 46.44 | 6 | 1 | 48 | 85144 | 10643' (MFU, micro 6, accumulation 1)",
        (
            "gpt2-124m",
            *_gpt(32, 32, 4096, 50368, 2048),
            *_run(
                gpus=8,
                device="H100",
                micro=6,
                accumulation=1,
                stage=3,
                checkpointing=False,
                sums=MPT_SUMS,
                comm=MPT_COMM,
            ),
        ),
        10643,
        fit=True,
    ),
    # Held out because no efficiency reproduces them: reduce-scattering its fp32 gradients and gathering
    # its bf16 parameters (8 bytes a parameter a step) over 64 ranks at the 20 GB/s a GPU plan assumes
    # across A100 nodes takes 3.16 s for the 8B and 27.8 s for the 70B, longer than their published steps
    # (2.82 s, 24.7 s) whatever compute overlaps it (`published.implied_efficiency` is None). They bound the
    # assumed interconnect, not the efficiency; their cluster's network is not published.
    PublishedRun(
        "torchtitan Llama 3 8B, 64 x A100-80GB (FSDP)",
        TORCHTITAN_2024,
        "WPS 2904, MFU 56.8% (FSDP2, local batch 1 x 8192, selective layer checkpointing)",
        (
            "llama-7b",
            *LLAMA3_8B,
            *_run(
                gpus=64,
                device="A100-80GB",
                micro=1,
                accumulation=1,
                stage=3,
                checkpointing=False,
                sums=TORCHTITAN_SUMS,
            ),
        ),
        2904,
        fit=False,
    ),
    PublishedRun(
        "torchtitan Llama 3 70B, 64 x A100-80GB (FSDP)",
        TORCHTITAN_2024,
        "WPS 331, MFU 51.7% (FSDP2, local batch 1 x 8192, full checkpointing)",
        (
            "llama-7b",
            *LLAMA3_70B,
            *_run(
                gpus=64,
                device="A100-80GB",
                micro=1,
                accumulation=1,
                stage=3,
                checkpointing=True,
                sums=TORCHTITAN_SUMS,
            ),
        ),
        331,
        fit=False,
    ),
    PublishedRun(
        "torchtitan Llama 3.1 8B, 128 x H100 (FSDP)",
        "pytorch/torchtitan docs/performance.md @ eaea6f6a2fa940f03a10906be1df3489cf30af85, Table 3",
        "5,605 tokens/s a GPU, 67.0 GiB (FSDP, local batch 2 x 8192, selective checkpointing; 96 GB H100s at 500 W)",
        (
            "llama-7b",
            *LLAMA3_8B,
            *_run(
                gpus=128,
                device="H100",
                micro=2,
                accumulation=1,
                stage=3,
                checkpointing=False,
                sums=TORCHTITAN_SUMS,
            ),
        ),
        5605,
        fit=False,
        memory_gib=67.0,
    ),
    PublishedRun(
        "BLOOM 176B, 384 x A100-80GB (Megatron-DeepSpeed TP4 x PP12, ZeRO-1)",
        "bigscience-workshop/bigscience train/tr11-176B-ml/README.md @ e726b15982fa088fb6d9a4c869c19c3d4dbc84a7",
        "'elapsed time per iteration (s): 104.70 ... samples per second: 19.561 | TFLOPs: 149.77' (2048 x 2048 tokens)",
        (
            "gpt2-124m",
            *_gpt(70, 112, 14336, 250880, 2048),
            *_sets("model.position=rope"),
            *_run(
                gpus=384,
                device="A100-80GB",
                micro=2,
                accumulation=128,
                stage=1,
                checkpointing=True,
                tensor=4,
                pipeline=12,
                sums=BLOOM_SUMS,
                comm=BLOOM_COMM,
            ),
        ),
        19.561 * 2048 / 384,
        fit=False,
    ),
    PublishedRun(
        "MPT 7B, 8 x A100-80GB (FSDP, no checkpointing)",
        MPT,
        "'7b | 2048 | 8 | a100_80gb | 64.23 | 64.23 | 6 | 2 | 96 | 37130 | 4641' (MFU, micro 6, accumulation 2)",
        (
            "gpt2-124m",
            *_gpt(32, 32, 4096, 50368, 2048),
            *_run(
                gpus=8,
                device="A100-80GB",
                micro=6,
                accumulation=2,
                stage=3,
                checkpointing=False,
                sums=MPT_SUMS,
                comm=MPT_COMM,
            ),
        ),
        4641,
        fit=True,
    ),
    PublishedRun(
        "MPT 70B, 64 x H100-80GB (FSDP, checkpointing)",
        MPT,
        "'70b | 2048 | 64 | h100_80gb | 42.57 | 56.76 | 8 | 4 | 2048 | 66523 | 1039' (MFU, HFU, micro 8, accumulation 4)",
        (
            "gpt2-124m",
            *_gpt(80, 64, 8192, 50368, 2048),
            *_run(
                gpus=64,
                device="H100",
                micro=8,
                accumulation=4,
                stage=3,
                checkpointing=True,
                sums=MPT_SUMS,
                comm=MPT_COMM,
            ),
        ),
        1039,
        fit=True,
    ),
    PublishedRun(
        "Megatron-LM GPT 39.1B, 512 x A100-80GB (TP8 x PP2)",
        MEGATRON,
        "138 TFLOP/s a GPU (44%), counting the recomputed forward: 425 tokens/s a GPU",
        (
            "gpt2-124m",
            *_gpt(48, 64, 8192, 51200, 2048),
            *_run(
                gpus=512,
                device="A100-80GB",
                micro=1,
                accumulation=48,
                stage=1,
                checkpointing=True,
                tensor=8,
                pipeline=2,
                sums=MEGATRON_SUMS,
            ),
        ),
        425,
        fit=False,
    ),
)


@dataclass(frozen=True)
class Efficiency:
    """The fraction of the peak forward + backward reach on a GPU class under a kind of layout, for
    models up to a size: the mean of what its `runs` imply (`implied_efficiency`), rounded to two places."""

    gpu: str  # a `gpu_class`
    layout: str  # a `layout_kind`
    max_params: float
    value: float
    runs: tuple[str, ...]  # names of PUBLISHED runs marked fit


DATA, MODEL = "data parallel", "tensor or pipeline parallel"  # the kinds of layout, `layout_kind`
SMALL, MEDIUM = 3e9, 30e9  # the size bounds: up to 3B, up to 30B, larger
# Data parallel (every ZeRO stage and FSDP: whole layers a rank, large matrix products) and tensor or
# pipeline parallel (Megatron-LM's and BLOOM's: a layer cut in t, or stages waiting on each other)
# reach different parts of the peak; the A100 entries under data parallel are llm.c's, Megatron-LM's
# small run and MPT's FSDP, no longer the tensor parallel runs' for every layout.
FWD_BWD_EFFICIENCY: tuple[Efficiency, ...] = (
    Efficiency(
        "A100", DATA, SMALL, 0.55, ("llm.c GPT-2 124M, 8 x A100-80GB", "Megatron-LM GPT 1.7B, 32 x A100-80GB")
    ),
    Efficiency("A100", DATA, math.inf, 0.64, ("MPT 7B, 8 x A100-80GB (FSDP, no checkpointing)",)),
    Efficiency("A100", MODEL, MEDIUM, 0.60, ("Megatron-LM GPT 18.4B, 256 x A100-80GB (TP8)",)),
    Efficiency("A100", MODEL, math.inf, 0.70, ("Megatron-LM GPT 145.6B, 1536 x A100-80GB (TP8 x PP8)",)),
    Efficiency("H100", DATA, SMALL, 0.49, ("llm.c GPT-2 1.5B, 8 x H100-80GB",)),
    Efficiency(
        "H100",
        DATA,
        MEDIUM,
        0.41,
        ("torchtitan Llama 3.1 8B, 8 x H100 (FSDP)", "MPT 7B, 8 x H100-80GB (FSDP, no checkpointing)"),
    ),
    Efficiency("H100", DATA, math.inf, 0.57, ("MPT 70B, 64 x H100-80GB (FSDP, checkpointing)",)),
    Efficiency("H100", MODEL, math.inf, 0.51, ("torchtitan Llama 3.1 405B, 128 x H100 (FSDP16 x TP8)",)),
)


def layout_kind(tensor: int, pipeline: int) -> str:
    """The kind of layout an efficiency is fitted for: `DATA` (tensor = pipeline = 1, at any ZeRO
    stage, so every row of one plan shares it) or `MODEL`."""
    return DATA if tensor * pipeline == 1 else MODEL


def size_class(e: Efficiency) -> str:
    """The model sizes an entry covers: above the next smaller entry of its GPU and layout kind."""
    lower = max(
        (
            f.max_params
            for f in FWD_BWD_EFFICIENCY
            if (f.gpu, f.layout) == (e.gpu, e.layout) and f.max_params < e.max_params
        ),
        default=0.0,
    )
    if math.isinf(e.max_params):
        return f"over {lower / 1e9:g}B parameters" if lower else "any size"
    return (
        f"{lower / 1e9:g}B to {e.max_params / 1e9:g}B parameters"
        if lower
        else f"up to {e.max_params / 1e9:g}B parameters"
    )


def gpu_class(name: str) -> str | None:
    """The class a GPU's efficiency and interconnect are assumed by: 'A100' (40 and 80 GB, SXM and
    PCIe), 'H100' (H100 and H200), or None for any other."""
    upper = name.upper()
    if "A100" in upper:
        return "A100"
    if "H100" in upper or "H200" in upper:
        return "H100"
    return None


def default_efficiency(gpu: str | None, n_params: int, layout: str = DATA) -> tuple[float, str] | None:
    """The fraction of the peak forward + backward reach for a model of `n_params` on `gpu` (a
    `gpu_class`) under a `layout_kind`, and where it comes from; None for a device the table has no
    runs for."""
    for e in FWD_BWD_EFFICIENCY:
        if (gpu, layout) == (e.gpu, e.layout) and n_params <= e.max_params:
            return e.value, f"{gpu}, {layout}, {size_class(e)}: from {'; '.join(e.runs)}; see docs/plan.md"
    return None
