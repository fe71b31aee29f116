"""The sections that set up DeepSpeed's engine: the optimizer, tensor and pipeline parallelism,
precision, ZeRO and torch.compile."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pretrain.config.section import Section


class OptimizerConfig(Section):
    lr: float = Field(1e-3, gt=0.0, le=10.0, description="Peak learning rate, reached after warmup.")
    betas: tuple[Annotated[float, Field(ge=0.0, lt=1.0)], Annotated[float, Field(ge=0.0, lt=1.0)]] = Field(
        (0.9, 0.95), description="AdamW betas."
    )
    eps: float = Field(1e-8, gt=0.0, le=1.0, description="AdamW epsilon.")
    weight_decay: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Decoupled weight decay; never applied to biases, norms or embeddings.",
    )
    grad_clip: float = Field(1.0, ge=0.0, description="Clip the global gradient norm to this; 0 disables.")
    adam_w_mode: bool = Field(
        True,
        description="AdamW (decoupled weight decay). False: Adam with L2 regularization, the decay added to the "
        "gradient (DeepSpeed's adam_w_mode false).",
    )
    bias_correction: bool = Field(
        True,
        description="Adam's bias correction of the moments. False (DeepSpeed's bias_correction false, as BERT's "
        "recipes train) needs DeepSpeed's FusedAdam or CPUAdam: torch.optim.AdamW always corrects.",
    )
    fused_adam: bool = Field(
        False,
        description="DeepSpeed's FusedAdam kernel (JIT-built, fast on CUDA) instead of torch.optim.AdamW. "
        "Optimizer offload always uses DeepSpeedCPUAdam.",
    )
    torch_fused: bool = Field(
        True,
        description="With torch.optim.AdamW (fused_adam off, no offload): its fused kernel, one pass over "
        "all parameters instead of a Python loop per tensor (CPU and CUDA).",
    )


class ParallelConfig(Section):
    """Model parallelism through DeepSpeed. A world of ranks is tensor x pipeline x data-parallel:
    a block's heads and MLP width split over `tensor` ranks (DeepSpeed AutoTP), the layers split
    into `pipeline` stages (deepspeed.pipe), each stage's tensor group replicated over the
    data-parallel ranks that remain, with ZeRO over those. The pipeline's micro-batches per step
    are batch.gradient_accumulation_steps, as DeepSpeed names them."""

    tensor: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel degree (DeepSpeed's tensor_parallel.autotp_size): each block's attention "
        "heads and MLP width split across this many ranks. Keep it within a node (its all-reduces run "
        "twice per block, forward and backward).",
    )
    pipeline: int = Field(
        1,
        ge=1,
        le=256,
        description="Pipeline stages (DeepSpeed's pipeline engine): the layers split into this many stages, "
        "e.g. one per node. Micro-batches per step: batch.gradient_accumulation_steps.",
    )
    partition_method: Literal["parameters", "uniform"] = Field(
        "parameters",
        description="How the layers are balanced over the stages (PipelineModule's partition_method): "
        "'parameters' evens out the parameter counts (the embeddings weigh on the first and last stage), "
        "'uniform' the layer counts.",
    )
    activation_checkpoint_interval: int | None = Field(
        None,
        ge=0,
        description="Pipeline: recompute the activations of every this many layers in backward "
        "(PipelineModule's activation_checkpoint_interval; 0: none). None: 1 with "
        "model.activation_checkpointing, else 0.",
    )

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline


class PrecisionConfig(Section):
    bf16: bool = Field(False, description="bfloat16 parameters and compute (fp32 master weights).")
    fp16: bool = Field(False, description="float16 with dynamic loss scaling.")
    initial_scale_power: int = Field(16, ge=0, le=64, description="fp16: initial loss scale is 2**this.")
    loss_scale_window: int = Field(1000, ge=1, description="fp16: clean steps before the scale grows.")
    hysteresis: int = Field(2, ge=1, description="fp16: overflows tolerated before the scale drops.")
    min_loss_scale: float = Field(1.0, gt=0, description="fp16: floor of the dynamic loss scale.")
    loss_scale: float = Field(
        0.0,
        ge=0.0,
        description="fp16: a static loss scale; 0 scales dynamically (from 2**initial_scale_power).",
    )
    grad_accum_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16: the dtype the micro batches' gradients are summed in (DeepSpeed's "
        "data_types.grad_accum_dtype), at ZeRO stages 1-3. fp32 keeps an fp32 gradient buffer (4 bytes a "
        "parameter: whole at stage 1, partitioned at 2 and 3) and all-reduces in fp32; bf16 sums in bf16 and "
        "loses about 2e-2 of each gradient over 256 micro batches (fp32: 2e-8). DeepSpeed's stage 0 sums in "
        "bf16 only.",
    )
    tf32: bool = Field(
        True,
        description="fp32 matmuls and convolutions on the TF32 tensor cores of NVIDIA Ampere and later (8x the "
        "fp32 rate on an A100, a 10-bit mantissa in the products, fp32 sums), as Megatron does; no effect on "
        "CPUs, older GPUs, or the 16-bit matmuls of bf16 and fp16.",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        return ["bf16 and fp16 cannot both be on"] if self.bf16 and self.fp16 else []

    @property
    def accumulates_in_fp32(self) -> bool:
        """Whether DeepSpeed is asked to sum bf16 gradients in an fp32 buffer."""
        return self.bf16 and self.grad_accum_dtype == "fp32"

    def accumulation_note(self, micro_batches: int, data_parallel: int | None) -> str | None:
        """What summing bf16 gradients in bf16 costs, where the config asks for it (said by `pretrain
        config` and `render`); None where nothing is summed in bf16."""
        if not self.bf16 or self.grad_accum_dtype != "bf16" or micro_batches * (data_parallel or 1) < 2:
            return None
        ranks = f" x {data_parallel} data-parallel ranks" if data_parallel and data_parallel > 1 else ""
        return (
            f"precision.grad_accum_dtype bf16: the gradients of {micro_batches} micro batches{ranks} are summed "
            "in bf16, which keeps 8 bits of each sum (over 256 micro batches about 2e-2 of the gradient is lost, "
            "2e-8 in fp32); it saves the fp32 gradient buffer (4 bytes a parameter). "
            "precision.grad_accum_dtype=fp32 (the default, zero.stage 1-3) sums them in fp32"
        )

    @property
    def name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


class ZeroConfig(Section):
    stage: Literal[0, 1, 2, 3] = Field(
        0, description="ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."
    )
    offload_optimizer: bool = Field(False, description="Keep optimizer state in CPU memory (stages 1-3).")
    offload_param: bool = Field(False, description="Keep parameters in CPU memory (stage 3 only).")
    pin_memory: bool = Field(True, description="Page-locked CPU buffers for offload (faster copies on CUDA).")
    overlap_comm: bool = Field(True, description="Overlap gradient reduction with backward.")
    contiguous_gradients: bool = Field(True, description="Copy gradients into one buffer as produced.")
    reduce_bucket_size: int = Field(500_000_000, ge=1, description="Elements per gradient reduce bucket.")
    allgather_bucket_size: int = Field(500_000_000, ge=1, description="Elements per allgather bucket.")
    init_on_construct: bool = Field(
        True, description="Stage 3: build the model under deepspeed.zero.Init, partitioned from the start."
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        problems = []
        if self.offload_param and self.stage != 3:
            problems.append(f"offload_param needs stage 3 (stage is {self.stage})")
        if self.offload_optimizer and self.stage == 0:
            problems.append("offload_optimizer needs stage 1, 2 or 3 (stage is 0)")
        return problems


class CompileConfig(Section):
    """torch.compile of the model, applied through DeepSpeed's engine (`engine.compile`), which
    compiles the module in place: its parameters and state_dict keys stay those of the eager model,
    so checkpoints and exports are the same either way."""

    enabled: bool = Field(
        False,
        description="Compile the model's forward (and, through AOTAutograd, its backward) with torch.compile. "
        "The first steps pay the compilation (tens of seconds on a CPU, cached on disk by TorchInductor).",
    )
    backend: str = Field(
        "inductor", min_length=1, description="torch.compile backend: inductor, aot_eager, eager, ..."
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default",
        description="torch.compile mode: 'reduce-overhead' adds CUDA graphs, 'max-autotune' searches kernels "
        "(long compiles).",
    )
    dynamic: bool | None = Field(
        None,
        description="Dynamic shapes: False compiles for the exact shapes met, True for symbolic ones, None "
        "(torch's default) starts static and goes dynamic on a shape change. Training shapes are fixed.",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        if self.mode != "default" and self.backend != "inductor":
            return [
                f"mode {self.mode!r} is a TorchInductor mode: it needs backend 'inductor', not {self.backend!r}"
            ]
        return []
