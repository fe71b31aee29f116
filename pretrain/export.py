"""Checkpoints → weights files: consolidated safetensors from any ZeRO stage, a Hugging Face
directory that transformers (and the tools built on it) load as is, and loading either back into a
`GPT` for sampling.

An export directory holds `model.safetensors` (our parameter names; a tied lm_head is stored
once, as wte), `pretrain.json` (the model config, where the weights came from, and the size and
sha256 of every other file, which `pretrain sample` checks) and our tokenizer as
`pretrain_tokenizer.json` (not `tokenizer.json`, Hugging Face's name for its own format). `hf/`
holds `config.json`, `model.safetensors`, a `tokenizers` `tokenizer.json` that encodes and decodes
as ours, `tokenizer_config.json` and `generation_config.json`, for:

- arch gpt2, learned positions: `GPT2LMHeadModel`;
- arch gpt2, rotary positions: `GPTNeoXForCausalLM` (`use_parallel_residual` and `rotary_pct` as
  the model's `parallel_residual` and `rotary_pct`);
- arch llama: `LlamaForCausalLM`.

Biases our model lacks are written as zeros where the Hugging Face class always has them. A
tied head is stored once, as the embedding, for every class (`tie_word_embeddings` ties it back).

Every reader here gives one `CheckpointError` naming the file and the fix for what it cannot use: a
file torch, DeepSpeed or safetensors cannot parse (damaged, truncated), a config this version does
not accept, weights that do not match their config, or weights that are not finite.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from pretrain.config.tree import ModelConfig, RunConfig, required_vocab_size
from pretrain.data.tokenizer import (
    BPE_RANKS_FILE,
    ENDOFTEXT,
    HF_TOKENIZER_FILE,
    UNK,
    HFTokenizer,
    Tokenizer,
    hf_added_tokens,
    hf_eot_token,
    hf_tokenizer,
    hf_vocab_size,
    load_tokenizer,
)
from pretrain.errors import CheckpointError, DataError, OutputError, PretrainError
from pretrain.files import (
    check_output_dir,
    default_mode,
    make_dir,
    replace_dir,
    staging_dir,
    write_atomic,
)
from pretrain.training.checkpoint import resume
from pretrain.training.checkpoint import store as checkpoint
from pretrain.training.model.gpt import GPT

WEIGHTS = "model.safetensors"
INFO = "pretrain.json"
HF_DIR = "hf"
TOKENIZER = "pretrain_tokenizer.json"
# All an export holds (and an older export's tokenizer.json): what `export --out` may replace.
EXPORT_NAMES = {WEIGHTS, INFO, HF_DIR, TOKENIZER, BPE_RANKS_FILE, HF_TOKENIZER_FILE, checkpoint.TOKENIZER}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def consolidated_state_dict(ckpt: Path, *, checksums: bool = True) -> dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint directory, gathered from every rank's shards (any ZeRO
    stage; from the fp32 master copy where there is one; under tensor or pipeline parallelism from
    the model's own weights, see `model_parallel_state_dict`). Loaded weights-only. A file that
    cannot be parsed is one CheckpointError naming it; `checksums`: whether the files were verified
    against their sha256 (else the error says that one may be damaged, and how to check)."""
    meta = checkpoint.read_meta(ckpt)
    run_config(meta, ckpt / checkpoint.META)  # a config this version does not accept: said as such
    reading = [ckpt]  # the file being read, for the error
    try:
        sd = _read_weights(ckpt, meta, reading)
    except PretrainError as e:
        if checksums and str(ckpt) in str(e):
            raise
        said = str(e) if str(ckpt) in str(e) else f"{reading[0]}: {e}"  # safe_loading's names no file
        collective = getattr(e, "collective", True)
        raise CheckpointError(said if checksums else f"{said}\n{_UNVERIFIED}", collective=collective) from e
    except Exception as e:  # torch's, DeepSpeed's or pickle's own error on a file it cannot parse
        first = (str(e).strip().splitlines() or [""])[0][:300]
        why = (
            _UNVERIFIED
            if not checksums
            else "its files match the sizes and sha256 recorded at save, so this torch or DeepSpeed cannot "
            "read what that one wrote: read it with the versions its pretrain_meta.json names"
        )
        raise CheckpointError(
            f"{reading[0]}: cannot read the weights ({type(e).__name__}: {first})\n{why}"
        ) from e
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{reading[0]}: holds no model weights (not a pretrain checkpoint's file)")
    return {k: v.detach().float().contiguous() for k, v in sd.items()}


def _read_weights(ckpt: Path, meta: dict[str, Any], reading: list[Path]) -> Any:
    """What a checkpoint's files hold as its weights, read as `consolidated_state_dict` says; `reading[0]`
    names the file being read."""
    if checkpoint.saved_layout(meta).shape != (1, 1) and meta.get("format") != "universal":
        return model_parallel_state_dict(ckpt, meta, reading)
    # DeepSpeed reports its progress on stdout, which belongs to `pretrain sample`'s text
    with checkpoint.safe_loading(), contextlib.redirect_stdout(sys.stderr):
        if any(ckpt.glob("*optim_states.pt")) and int(meta.get("zero_stage", 0)) > 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
        # stage 0: rank 0's model file holds the whole module
        reading[0] = ckpt / "mp_rank_00_model_states.pt"
        return torch.load(reading[0], map_location="cpu", weights_only=True)["module"]


# Said where a checkpoint was read with --no-checksums (sizes only) and turned out unreadable.
_UNVERIFIED = (
    "(checked with --no-checksums, sizes only: a file may be damaged. Check it against its sha256 by "
    "running without --no-checksums, or pass the run dir to use its newest valid checkpoint)"
)


def run_config(meta: dict[str, Any], meta_path: Path) -> RunConfig:
    """The run config a checkpoint's meta records, or one CheckpointError naming the field: a config
    this version of pretrain does not accept (another version wrote it, or it was edited)."""
    try:
        return RunConfig.model_validate(meta["config"])
    except (ValidationError, KeyError, TypeError) as e:
        if isinstance(e, ValidationError):
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            problem = f"config.{where}: {first['msg']}" if where else f"config: {first['msg']}"
        else:
            problem = "no config" if isinstance(e, KeyError) else "its config is not a JSON object"
        raise CheckpointError(
            f"{meta_path}: {problem}; a config this version of pretrain does not accept (another version "
            "wrote it, or it was edited): read it with the version its 'versions' names"
        ) from e


def check_weights(sd: dict[str, torch.Tensor], m: ModelConfig, what: Path, config: str, fix: str) -> None:
    """The weights `sd` (read from `what`) are those of a GPT of config `m` (read from the file
    `config`): every name, every shape (a tied head may be absent), and finite; else one
    CheckpointError naming them and `fix`."""
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in GPT(m).state_dict().items()}
    problems = []
    optional = {"lm_head.weight"} if m.tie_embeddings else set()
    missing = sorted(set(want) - set(sd) - optional)
    unexpected = sorted(set(sd) - set(want))
    if missing:
        problems.append(
            f"lacks {', '.join(missing[:3])}" + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        )
    if unexpected:
        problems.append(
            f"has {', '.join(unexpected[:3])}"
            + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
            + ", which the model has not"
        )
    for k in sorted(set(want) & set(sd)):
        if tuple(sd[k].shape) != want[k]:
            problems.append(f"{k} is {list(sd[k].shape)}, the model's is {list(want[k])}")
    if problems:
        raise CheckpointError(
            f"{what}: the weights do not match the model config in {config} (n_layer {m.n_layer}, "
            f"n_embd {m.n_embd}, vocab {m.vocab_size}): {'; '.join(problems[:3])}; {fix}"
        )
    for k, v in sd.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(
                f"{what}: {k} holds NaN or inf: the run diverged before this checkpoint, or a file is damaged; {fix}"
            )


def model_parallel_state_dict(
    ckpt: Path, meta: dict[str, Any], reading: list[Path] | None = None
) -> dict[str, torch.Tensor]:
    """The GPT's weights from a tensor- and/or pipeline-parallel checkpoint: each pipeline layer's
    file (or, without a pipeline, each tensor rank's model file) read, named as in GPT
    (pipeline.gpt_names), and the tensor ranks' shards put back together as AutoTP split them
    (ds_render.autotp_layer_specs). These are the weights the model trained with: fp32 in an fp32
    run, the bf16 copy in a bf16 run. `reading[0]` is set to each file as it is read."""
    from pretrain.training.distributed.pipeline import gpt_names

    reading = reading if reading is not None else [ckpt]
    m = ModelConfig.model_validate(meta["config"]["model"])
    tp, pp = checkpoint.saved_layout(meta).shape
    shards: dict[str, list[torch.Tensor]] = {}
    with checkpoint.safe_loading():
        for r in range(tp):
            if pp == 1:
                reading[0] = ckpt / f"mp_rank_{r:02d}_model_states.pt"
                named = torch.load(reading[0], map_location="cpu", weights_only=True)["module"]
            else:
                named = {}
                for idx, prefix in enumerate(gpt_names(m)):
                    f = ckpt / f"layer_{idx:02d}-model_{r:02d}-model_states.pt"
                    if f.is_file():  # a tied head is saved once, with the embedding (layer 0)
                        reading[0] = f
                        layer = torch.load(f, map_location="cpu", weights_only=True)
                        named.update({f"{prefix}{k}": v for k, v in layer.items()})
            for name, tensor in named.items():
                shards.setdefault(name, []).append(tensor)
    if m.tie_embeddings:
        shards["lm_head.weight"] = shards["wte.weight"]
    missing = set(gpt_param_names(m)) - set(shards)
    if missing:
        raise CheckpointError(
            f"{ckpt}: the model files lack {sorted(missing)[:5]}: not a complete checkpoint"
        )
    return {k: merge_tensor_parallel(k, v, m).float().contiguous() for k, v in shards.items()}


def gpt_param_names(m: ModelConfig) -> list[str]:
    with torch.device("meta"):
        return list(GPT(m).state_dict())


def merge_tensor_parallel(name: str, shards: list[torch.Tensor], m: ModelConfig) -> torch.Tensor:
    """One parameter whole again from its tensor ranks' shards. Column-parallel layers were split by
    output rows, each sub-matrix (q, k, v; SwiGLU's gate, up) on its own; row-parallel ones by input
    columns; everything else is whole on every rank."""
    if len(shards) == 1:
        return shards[0]
    kv = m.kv_heads * m.head_size
    if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        parts = [m.n_embd, kv, kv]  # q, k, v
    elif name.endswith(("mlp.c_fc.weight", "mlp.c_fc.bias")):
        parts = [m.ffn_hidden] * (2 if m.arch == "llama" else 1)  # [gate; up], or one matrix
    elif name.endswith(("attn.c_proj.weight", "mlp.c_proj.weight")):
        return torch.cat(shards, dim=1)
    else:
        return shards[0]
    n = len(shards)
    pieces = [s.split([p // n for p in parts], dim=0) for s in shards]  # per rank: its share of each part
    return torch.cat([torch.cat([rank[i] for rank in pieces], dim=0) for i in range(len(parts))], dim=0)


def hf_architecture(m: ModelConfig) -> str:
    if m.arch == "llama":
        return "LlamaForCausalLM"
    return "GPT2LMHeadModel" if m.position == "learned" else "GPTNeoXForCausalLM"


def hf_vocab_rows(m: ModelConfig, tok: Tokenizer | None) -> int:
    """The embedding rows of the Hugging Face model: the model's, or more where the Hugging Face
    tokenizer has more ids (the char tokenizer's <|endoftext|> and <unk>, `hf_added_tokens`), so
    that every id it gives indexes the embedding."""
    rows = required_vocab_size(m)
    return rows if tok is None else max(rows, hf_vocab_size(tok))


def hf_state_dict(
    sd: dict[str, torch.Tensor], m: ModelConfig, rows: int | None = None
) -> dict[str, torch.Tensor]:
    """Our parameters under the names and layouts of `hf_architecture(m)`; the embedding and head
    padded with zero rows up to `rows` (`hf_vocab_rows`): ids our model has no row for, which the
    generation config suppresses."""
    d, f, kv = m.n_embd, m.ffn_hidden, m.kv_heads * m.head_size
    arch = hf_architecture(m)
    sd = _padded(sd, m, rows or required_vocab_size(m))

    def bias(name: str, size: int) -> torch.Tensor:
        return sd.get(name, torch.zeros(size, dtype=sd["wte.weight"].dtype))

    out: dict[str, torch.Tensor] = {}
    for i in range(m.n_layer):
        h = f"h.{i}."
        w_attn, w_fc = sd[h + "attn.c_attn.weight"], sd[h + "mlp.c_fc.weight"]
        if arch == "LlamaForCausalLM":
            o = f"model.layers.{i}."
            out[o + "input_layernorm.weight"] = sd[h + "ln_1.weight"]
            q, k, v = w_attn.split([d, kv, kv])  # HF's rotate_half RoPE is ours: no permutation
            out.update({o + "self_attn.q_proj.weight": q, o + "self_attn.k_proj.weight": k})
            out[o + "self_attn.v_proj.weight"] = v
            out[o + "self_attn.o_proj.weight"] = sd[h + "attn.c_proj.weight"]
            out[o + "post_attention_layernorm.weight"] = sd[h + "ln_2.weight"]
            gate, up = w_fc.split([f, f])
            out.update({o + "mlp.gate_proj.weight": gate, o + "mlp.up_proj.weight": up})
            out[o + "mlp.down_proj.weight"] = sd[h + "mlp.c_proj.weight"]
        elif arch == "GPTNeoXForCausalLM":
            o = f"gpt_neox.layers.{i}."
            # its fused qkv is per head [q_h; k_h; v_h], ours [q (all heads); k; v]
            nh, hs = m.n_head, m.head_size
            qkv_bias = bias(h + "attn.c_attn.bias", 3 * d)
            out[o + "attention.query_key_value.weight"] = (
                w_attn.view(3, nh, hs, d).transpose(0, 1).reshape(3 * d, d)
            )
            out[o + "attention.query_key_value.bias"] = (
                qkv_bias.view(3, nh, hs).transpose(0, 1).reshape(3 * d)
            )
            for ours, theirs, size in (
                ("ln_1", "input_layernorm", d),
                ("attn.c_proj", "attention.dense", d),
                ("ln_2", "post_attention_layernorm", d),
                ("mlp.c_fc", "mlp.dense_h_to_4h", f),
                ("mlp.c_proj", "mlp.dense_4h_to_h", d),
            ):
                out[f"{o}{theirs}.weight"] = sd[f"{h}{ours}.weight"]
                out[f"{o}{theirs}.bias"] = bias(f"{h}{ours}.bias", size)
        else:  # GPT-2's Conv1D layers store weights as (in, out): transposed
            o = f"transformer.h.{i}."
            for name, size in (("ln_1", d), ("attn.c_attn", 3 * d), ("attn.c_proj", d), ("ln_2", d)):
                w = sd[f"{h}{name}.weight"]
                out[f"{o}{name}.weight"] = w.t() if w.dim() == 2 else w
                out[f"{o}{name}.bias"] = bias(f"{h}{name}.bias", size)
            for name, size in (("mlp.c_fc", f), ("mlp.c_proj", d)):
                out[f"{o}{name}.weight"] = sd[f"{h}{name}.weight"].t()
                out[f"{o}{name}.bias"] = bias(f"{h}{name}.bias", size)
    head = sd.get("lm_head.weight", sd["wte.weight"])
    if arch == "LlamaForCausalLM":
        out.update({"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f.weight"]})
        if not m.tie_embeddings:
            out["lm_head.weight"] = head
    elif arch == "GPTNeoXForCausalLM":
        out["gpt_neox.embed_in.weight"] = sd["wte.weight"]
        if not m.tie_embeddings:  # tied: the one tensor is the embedding (safetensors stores no alias)
            out["embed_out.weight"] = head  # transformers >= 5 reads it as lm_head.weight
        out["gpt_neox.final_layer_norm.weight"] = sd["ln_f.weight"]
        out["gpt_neox.final_layer_norm.bias"] = bias("ln_f.bias", d)
    else:
        out.update({"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"]})
        out["transformer.ln_f.weight"] = sd["ln_f.weight"]
        out["transformer.ln_f.bias"] = bias("ln_f.bias", d)
        if not m.tie_embeddings:
            out["lm_head.weight"] = head
    return unshared(out)


def _padded(sd: dict[str, torch.Tensor], m: ModelConfig, rows: int) -> dict[str, torch.Tensor]:
    """`sd` with its embedding and head grown with zero rows to `rows` (a copy; `sd` where they have as many)."""
    if rows > required_vocab_size(m):
        grow = rows - required_vocab_size(m)
        sd = dict(sd)
        for name in ("wte.weight", "lm_head.weight"):
            if name in sd:
                sd[name] = torch.cat([sd[name], sd[name].new_zeros(grow, m.n_embd)])
    return sd


def unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors`, contiguous, each one whose memory overlaps an earlier one's copied: safetensors
    refuses tensors that share memory (views of one tensor that do not overlap, as q, k and v split
    from one matrix, it stores as they are)."""
    spans: dict[int, list[tuple[int, int]]] = {}
    out = {}
    for name, t in tensors.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        start = int(t.storage_offset()) * t.element_size()
        end = start + t.numel() * t.element_size()
        if any(s < end and start < e for s, e in spans.get(ptr, [])):
            t = t.clone()
            ptr, start, end = t.untyped_storage().data_ptr(), 0, t.numel() * t.element_size()
        spans.setdefault(ptr, []).append((start, end))
        out[name] = t
    return out


def _special_ids(tok: Tokenizer | None, tok_config: dict[str, Any] | None = None) -> dict[str, int | None]:
    """bos, eos (and pad) ids. An hf tokenizer's: its end-of-text as eos, and the bos and pad its
    `tok_config` (tokenizer_config.json) names, none where it names none. The others': <|endoftext|>
    as bos and eos, the tokenizer's own or the one the char tokenizer's Hugging Face tokenizer adds
    (`hf_added_tokens`)."""
    if tok is None or (isinstance(tok, HFTokenizer) and tok.eot_token is None):
        return {}
    if isinstance(tok, HFTokenizer):
        named = {k: _token_id(tok, (tok_config or {}).get(f"{k}_token")) for k in ("bos", "pad")}
        return {"bos_token_id": named["bos"], "eos_token_id": tok.eot_token, "pad_token_id": named["pad"]}
    eot = hf_eot_token(tok)
    return {"bos_token_id": eot, "eos_token_id": eot}


def _token_id(tok: HFTokenizer, token: Any) -> int | None:
    """The id of a token as tokenizer_config.json names it (a string or an AddedToken's dump)."""
    token = token.get("content") if isinstance(token, dict) else token
    return tok.hf.token_to_id(token) if isinstance(token, str) else None


def hf_config(
    m: ModelConfig, dtype: str, tok: Tokenizer | None, ids: dict[str, int | None] | None = None
) -> dict[str, Any]:
    """config.json for `hf_architecture(m)`; `ids`: bos and eos (`_special_ids`)."""
    ids = _special_ids(tok) if ids is None else ids
    arch = hf_architecture(m)
    common: dict[str, Any] = {
        "architectures": [arch],
        "vocab_size": hf_vocab_rows(m, tok),
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
        "bos_token_id": ids.get("bos_token_id"),
        "eos_token_id": ids.get("eos_token_id"),
    }
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    # The shape in the names Llama and GPT-NeoX share (GPT-2 has its own, below).
    shape = {
        "hidden_size": m.n_embd,
        "intermediate_size": m.ffn_hidden,
        "num_hidden_layers": m.n_layer,
        "num_attention_heads": m.n_head,
        "max_position_embeddings": m.block_size,
    }
    if arch == "LlamaForCausalLM":
        return {
            **common,
            **shape,
            "model_type": "llama",
            "num_key_value_heads": m.kv_heads,
            "head_dim": m.head_size,
            "hidden_act": "silu",
            "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta,  # transformers < 5 reads these two keys
            "rope_scaling": None,
            "rope_parameters": rope,
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": m.dropout,
        }
    if arch == "GPTNeoXForCausalLM":
        return {
            **common,
            **shape,
            "model_type": "gpt_neox",
            "hidden_act": _HF_GELU[m.activation],
            "layer_norm_eps": m.norm_eps,
            "use_parallel_residual": m.parallel_residual,  # x + attn(ln_1(x)) + mlp(ln_2(x)), or sequential
            "rotary_pct": m.rotary_pct,  # transformers < 5 reads these two keys
            "rotary_emb_base": m.rope_theta,
            "rope_parameters": {**rope, "partial_rotary_factor": m.rotary_pct},
            "attention_bias": True,
            "attention_dropout": m.dropout,
            "hidden_dropout": m.dropout,
        }
    return {
        **common,
        "model_type": "gpt2",
        "n_positions": m.block_size,
        "n_embd": m.n_embd,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_inner": m.ffn_hidden,
        "activation_function": _HF_GELU[m.activation],
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout,
        "layer_norm_epsilon": m.norm_eps,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


# Our activations by the names transformers' ACT2FN gives them (GPT-2's own "gelu_new" is the tanh one).
_HF_GELU = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


def hf_tokenizer_config(tok: Tokenizer, m: ModelConfig) -> dict[str, Any]:
    """tokenizer_config.json: the generic fast tokenizer over tokenizer.json, nothing added to the
    text. <|endoftext|> is bos, eos and pad (the char tokenizer's is added, `hf_added_tokens`), and
    a batch is padded on the left, where generation continues each row from its last token. Special
    tokens split: a literal "<|endoftext|>" (or "<unk>") in text is plain text, as in ours."""
    unk = {"unk_token": UNK} if UNK in hf_added_tokens(tok) else {}
    eos = tok.eos if isinstance(tok, HFTokenizer) else ENDOFTEXT
    specials = {"bos_token": eos, "eos_token": eos, "pad_token": eos} if eos is not None else {}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": m.block_size,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "padding_side": "left",
        **specials,
        **unk,
    }


def hf_generation_config(
    tok: Tokenizer, m: ModelConfig, ids: dict[str, int | None] | None = None
) -> dict[str, Any]:
    """generation_config.json: `pretrain sample`'s defaults (temperature 0.8, top-k 200, 200 new
    tokens: no `max_length`, which transformers warns about beside every caller's max_new_tokens);
    end-of-text ends a sample and pads a batch. Ids past our tokenizer's
    vocabulary (a padded model's rows, the char tokenizer's added tokens) are suppressed: they are
    never generated, as `pretrain sample` draws among the tokenizer's ids only. `ids`: bos, eos and
    pad (`_special_ids`; pad is eos where the tokenizer has none)."""
    ids = _special_ids(tok) if ids is None else ids
    beyond = list(range(tok.vocab_size, hf_vocab_rows(m, tok)))
    suppress = {"suppress_tokens": beyond} if beyond else {}
    return {
        "do_sample": True,
        "temperature": 0.8,
        "top_k": 200,
        "max_new_tokens": 200,
        "bos_token_id": ids.get("bos_token_id"),
        "eos_token_id": ids.get("eos_token_id"),
        "pad_token_id": ids.get("pad_token_id")
        if ids.get("pad_token_id") is not None
        else ids.get("eos_token_id"),
        **suppress,
    }


# The files beside a Hugging Face tokenizer.json that tell transformers how to use it: its special
# tokens, padding side, chat template, length.
HF_TOKENIZER_NAME = "tokenizer.json"
HF_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def tokenizer_origin(tok: Tokenizer | None, cfg: RunConfig) -> Path | None:
    """The directory an hf tokenizer was read from, where it still holds that tokenizer.json byte
    for byte: data.tokenizer_path's, else model.init_from's (an export's hf/). None for the others."""
    if not isinstance(tok, HFTokenizer):
        return None
    places: list[Path] = []
    if cfg.data.tokenizer_path:
        given = Path(os.path.expanduser(cfg.data.tokenizer_path))
        places.append(given if given.suffix != ".json" else given.parent)
    if cfg.model.init_from is not None:
        places += [Path(cfg.model.init_from.path), Path(cfg.model.init_from.path) / HF_DIR]
    for place in places:
        with contextlib.suppress(OSError):
            if (place / HF_TOKENIZER_NAME).read_bytes() == tok.data:
                return place
    return None


def hf_tokenizer_files(
    tok: Tokenizer, m: ModelConfig, origin: Path | None
) -> tuple[dict[str, bytes], dict[str, Any], str | None]:
    """The tokenizer files of the hf/ directory (name -> bytes), its tokenizer_config.json, and a
    line saying what the export set in them (None: nothing to say).

    An hf tokenizer read from `origin` (`tokenizer_origin`) is written as it was: its tokenizer.json
    and the `HF_TOKENIZER_FILES` it has, byte for byte, but for the fields of tokenizer_config.json
    it lacks that transformers needs: model_max_length (the block size), eos_token (the end-of-text
    the documents ended with) and tokenizer_class (the generic fast tokenizer over tokenizer.json,
    not the one config.json's model type would pick). Without a tokenizer_config.json there, or
    without `origin`, and for the other tokenizers, the files are built (`hf_tokenizer`,
    `hf_tokenizer_config`)."""
    built = hf_tokenizer_config(tok, m)
    if not isinstance(tok, HFTokenizer):
        files = {
            HF_TOKENIZER_NAME: hf_tokenizer(tok).to_str().encode(),
            "tokenizer_config.json": _json_bytes(built),
        }
        return files, built, None
    files = {HF_TOKENIZER_NAME: tok.data}
    built_line = (
        "hf/tokenizer_config.json: built (bos, eos and pad the end-of-text, left padding, model_max_length "
        f"{m.block_size})"
    )
    if origin is None:
        note = f"{built_line}: the directory the run's tokenizer.json was read from no longer holds it"
        return {**files, "tokenizer_config.json": _json_bytes(built)}, built, note
    for name in HF_TOKENIZER_FILES:
        with contextlib.suppress(FileNotFoundError):
            files[name] = (origin / name).read_bytes()
    if "tokenizer_config.json" not in files:
        note = f"{built_line}: {origin} has none"
        return {**files, "tokenizer_config.json": _json_bytes(built)}, built, note
    try:
        config = json.loads(files["tokenizer_config.json"])
    except ValueError as e:
        raise DataError(f"{origin / 'tokenizer_config.json'}: not JSON ({e}); fix it or remove it") from e
    if not isinstance(config, dict):
        raise DataError(f"{origin / 'tokenizer_config.json'}: not a JSON object; fix it or remove it")
    missing = {
        "model_max_length": m.block_size,
        "eos_token": tok.eos,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    added = {k: v for k, v in missing.items() if k not in config and v is not None}
    if not added:
        return files, config, f"hf/: the tokenizer files of {origin}, unchanged"
    config.update(added)
    files["tokenizer_config.json"] = _json_bytes(config)
    said = ", ".join(f"{k} {v}" for k, v in added.items())
    return (
        files,
        config,
        f"hf/: the tokenizer files of {origin}; tokenizer_config.json has {said} added (it had none)",
    )


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1) + "\n").encode()


def write_hf(
    out: Path,
    m: ModelConfig,
    sd: dict[str, torch.Tensor],
    dtype: str,
    tok: Tokenizer,
    origin: Path | None = None,
) -> str | None:
    """The Hugging Face directory `out` (created) of the weights `sd` (ours, cast to `dtype`), its
    tokenizer files `hf_tokenizer_files`; returns their line."""
    out.mkdir()
    save_file(hf_state_dict(sd, m, hf_vocab_rows(m, tok)), str(out / WEIGHTS), metadata={"format": "pt"})
    default_mode(out / WEIGHTS)
    files, tok_config, note = hf_tokenizer_files(tok, m, origin)
    for name, data in files.items():
        write_atomic(out / name, data)
    ids = _special_ids(tok, tok_config)
    for name, obj in (
        ("config.json", hf_config(m, dtype, tok, ids)),
        ("generation_config.json", hf_generation_config(tok, m, ids)),
    ):
        write_atomic(out / name, json.dumps(obj, indent=1) + "\n")
    return note


def is_export(path: Path) -> bool:
    """`path` holds an export this command wrote, and nothing else: safe to replace."""
    try:
        info = json.loads((path / INFO).read_text())
    except (OSError, ValueError):
        return False
    names = {p.name for p in path.iterdir()}
    return isinstance(info, dict) and {"model", "source"} <= info.keys() and names <= EXPORT_NAMES


def export(
    src: Path,
    out: Path,
    dtype: str = "fp32",
    hf: bool = True,
    tokenizer_path: str | None = None,
    checksums: bool = True,
) -> dict[str, Any]:
    """Export the checkpoint `src` (or the newest valid one under a run/checkpoints dir) into `out`,
    atomically. `out` must be new, empty or a previous export. Returns what was written. A GPT-2
    BPE tokenizer is rebuilt from `tokenizer_path` (default: the run's data.tokenizer_path, else
    tiktoken's download)."""
    ckpt = resume.locate(src, checksums=checksums)
    try:
        out.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop: RuntimeError before Python 3.13
        raise OutputError(f"--out {out}: cannot be resolved ({e}); choose a new directory for --out") from e
    check_output_dir(
        out, is_export, "export", "--out", sources=[src, ckpt], no_inside=[ckpt], error=OutputError
    )
    meta = checkpoint.read_meta(ckpt)
    cfg = run_config(meta, ckpt / checkpoint.META)
    tok = _export_tokenizer(ckpt, cfg, tokenizer_path, hf=hf)
    sd = consolidated_state_dict(ckpt, checksums=checksums)
    check_weights(
        sd,
        cfg.model,
        ckpt,
        checkpoint.META,
        "export another checkpoint (pass the run dir: its newest valid one)",
    )
    cast = {k: v.to(_DTYPES[dtype]) for k, v in sd.items()}
    final = Path(os.path.abspath(out))  # `--out .` has no name to stage beside
    make_dir(final.parent, "--out", OutputError)
    tmp = staging_dir(final)
    tmp.mkdir()
    try:
        native = {k: v for k, v in cast.items() if k != "lm_head.weight" or not cfg.model.tie_embeddings}
        save_file(unshared(native), str(tmp / WEIGHTS), metadata={"format": "pt", "dtype": dtype})
        default_mode(tmp / WEIGHTS)
        if tok is not None:
            tok.save(tmp / TOKENIZER)
        note = None
        if hf and tok is not None:
            note = write_hf(tmp / HF_DIR, cfg.model, cast, dtype, tok, tokenizer_origin(tok, cfg))
        info = {
            "model": cfg.model.model_dump(mode="json"),
            "config": meta["config"],
            "dtype": dtype,
            "source": str(ckpt.resolve()),
            "step": meta.get("step"),
            "tokens_seen": meta.get("tokens_seen"),
            "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
            "versions": meta.get("versions"),
            "files": {  # what `sample` checks
                p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            },
        }
        write_atomic(tmp / INFO, json.dumps(info, indent=1) + "\n")
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    return {
        "source": ckpt,
        "out": out,
        "params": sum(v.numel() for v in native.values()),
        "hf": hf_architecture(cfg.model) if hf else None,
        "step": meta.get("step"),
    }


def _export_tokenizer(
    ckpt: Path, cfg: RunConfig, tokenizer_path: str | None, *, hf: bool
) -> Tokenizer | None:
    """The checkpoint's tokenizer (`tokenizer_for`); None where there is none and `hf` does not need it."""
    try:
        return tokenizer_for(ckpt, cfg, tokenizer_path)
    except DataError as e:
        if hf:
            raise DataError(
                f"{e}\nthe Hugging Face directory needs the tokenizer: pass --tokenizer-path, or --no-hf "
                "to export the weights alone"
            ) from e
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def verify_export(src: Path, info: dict[str, Any], *, checksums: bool = True) -> None:
    """The files of the export `src` against the sizes and sha256 its pretrain.json recorded
    (sizes only without `checksums`), as a checkpoint's are: one CheckpointError naming each file
    that differs, and the fix. An export made before they were recorded is read as it is, said so."""
    files = info.get("files")
    if not isinstance(files, dict):
        print(
            f"warning: {src / INFO} records no checksums (an export made before they were): its files are "
            "read unchecked; export it again to have them checked",
            file=sys.stderr,
            flush=True,
        )
        return
    problems = []
    for rel, want in sorted(files.items()):
        problem = _file_problem(src, rel, want, checksums=checksums)
        if problem:
            problems.append(problem)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        source = info.get("source") if isinstance(info.get("source"), str) else "CHECKPOINT"
        raise CheckpointError(
            f"{shown}: the export is damaged; export it again (pretrain export {source} --out {src})"
        )


def _file_problem(src: Path, rel: str, want: Any, *, checksums: bool) -> str | None:
    """What is wrong with the file `rel` of the export `src`, recorded in its info as `want`; None: nothing."""
    path = src / rel
    try:
        if not isinstance(want, dict) or Path(rel).is_absolute() or ".." in Path(rel).parts:
            return f"{src / INFO}: its entry {rel!r} is no file of the export"
        if not path.is_file():
            return f"{path}: {'not a regular file' if path.exists() else 'missing'}"
        if path.stat().st_size != want.get("bytes"):
            return f"{path}: {path.stat().st_size} bytes, {want.get('bytes')} recorded at export"
        if checksums and "sha256" in want and _sha256(path) != want["sha256"]:
            return f"{path}: its sha256 differs from the one recorded at export"
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return None


def load_model(src: Path, device: str = "cpu", checksums: bool = True) -> tuple[GPT, RunConfig, Path]:
    """A GPT in eval mode from an export directory, or from a checkpoint (consolidated in memory).
    Also returns the run config it was trained with and the directory holding its tokenizer."""
    if (src / WEIGHTS).is_file() and (src / INFO).is_file():
        again = f"export it again (pretrain export CHECKPOINT --out {src})"
        try:
            info = json.loads((src / INFO).read_text())
            cfg = RunConfig.model_validate(info["config"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # pydantic's error is a ValueError
            raise CheckpointError(f"{src / INFO}: unreadable export info ({str(e)[:300]}); {again}") from e
        try:
            sd = load_file(str(src / WEIGHTS))
        except Exception as e:  # safetensors' own error on a truncated or damaged file; OSError
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise CheckpointError(
                f"{src / WEIGHTS}: not a readable safetensors file ({type(e).__name__}: {first}); {again}"
            ) from e
        check_weights(sd, cfg.model, src / WEIGHTS, INFO, again)
        verify_export(src, info, checksums=checksums)
        where = src
    else:
        where = resume.locate(src, checksums=checksums)
        cfg = run_config(checkpoint.read_meta(where), where / checkpoint.META)
        sd = consolidated_state_dict(where, checksums=checksums)
        check_weights(
            sd,
            cfg.model,
            where,
            checkpoint.META,
            "sample another checkpoint (pass the run dir: its newest valid one)",
        )
    model = GPT(cfg.model)
    sd = {k: v.float() for k, v in sd.items()}
    if cfg.model.tie_embeddings:
        sd.setdefault("lm_head.weight", sd["wte.weight"])  # tied: stored once
    model.load_state_dict(sd, strict=True)
    return model.to(device).eval(), cfg, where


def tokenizer_for(where: Path, cfg: RunConfig, tokenizer_path: str | None = None) -> Tokenizer:
    """The tokenizer next to the weights at `where` (an export's, or a checkpoint's copy), else the
    dataset's. A GPT-2 BPE is rebuilt from `tokenizer_path` (default: the run's data.tokenizer_path)."""
    candidates = [
        where / TOKENIZER,
        where / checkpoint.TOKENIZER,
        cfg.data.resolved_dir() / checkpoint.TOKENIZER,
    ]
    found = [p for p in candidates if p.is_file()] or candidates[-1:]
    for path in found[:-1]:
        with contextlib.suppress(DataError):  # e.g. a trained BPE saved without its ranks file
            return load_tokenizer(path, tokenizer_path or cfg.data.tokenizer_path)
    return load_tokenizer(found[-1], tokenizer_path or cfg.data.tokenizer_path)
