"""What a Hugging Face model directory's config.json describes, in this tree's terms: the class, and
the model section's shape (`model.init_from`). Read without torch, so that the config is built
with the shape the run will have (`init_from.config`) by the light commands too; the weights are
`training/model/init_from.py`'s."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Any

from pretrain.errors import CheckpointError

INDEX = "model.safetensors.index.json"
HF_CLASSES = ("GPT2LMHeadModel", "GPTNeoXForCausalLM", "LlamaForCausalLM")
# The shape fields config.json gives (the rest of the model section is training's own).
SHAPE_FIELDS = (
    "arch", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "block_size", "vocab_size",
    "bias", "position", "rope_theta", "rotary_pct", "parallel_residual", "tie_embeddings", "activation",
    "norm_eps",
)  # fmt: skip
_GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def eps_of(value: Any) -> float:
    """A norm epsilon to 6 significant digits: a config.json written from float32 (9.99999975e-06) is 1e-05."""
    return float(f"{float(value):.6g}")


def fail(where: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"model.init_from {where}: {problem}")


def link_problem(path: Path) -> str | None:
    """Why `path` leads to nothing where it is a symbolic link that loops (named link by link) or whose
    target is not there; None for anything else (a file, a directory, nothing at all)."""
    try:
        if not path.is_symlink():
            return None
        path.stat()
        return None
    except OSError as e:
        if e.errno != errno.ELOOP:
            return f"{path.name} is a symbolic link to {os.readlink(path)}, which is not there"
    chain, at, seen = [path.name], path, set()
    while at.is_symlink() and at not in seen and len(chain) <= 8:
        seen.add(at)
        target = os.readlink(at)
        chain.append(target)
        at = Path(os.path.normpath(at.parent / target))
    return f"{path.name} is a symbolic link that loops ({' -> '.join(chain)})"


def read_config(path: str) -> tuple[Path, str, dict[str, Any]]:
    """The directory (an export's hf/ for an export directory), the class its config.json names,
    and the ModelConfig fields it describes. One CheckpointError for what cannot be used."""
    where = Path(os.path.expanduser(path))
    if why := link_problem(where):
        raise fail(where, f"{why}: point it at the model's directory")
    if why := link_problem(where / "config.json"):
        raise fail(where, f"{why}: point it at the model's config.json, or put the file there")
    if not where.is_dir():
        raise fail(
            where, "no such directory (a Hugging Face model directory: config.json + model.safetensors)"
        )
    if not (where / "config.json").is_file() and (where / "hf" / "config.json").is_file():
        where = where / "hf"  # an export directory: its Hugging Face part
    try:
        config = json.loads((where / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise fail(
            where,
            "holds no config.json: not a Hugging Face model directory (save_pretrained and pretrain export "
            "write config.json beside the weights)",
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(where, f"config.json is not readable JSON ({e})") from e
    if not isinstance(config, dict):
        raise fail(where, "config.json is not a JSON object")
    archs = config.get("architectures") or [config.get("model_type")]
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in HF_CLASSES:
        raise fail(
            where,
            f"config.json describes {archs!r}: model.init_from reads {', '.join(HF_CLASSES)} (what pretrain "
            "export writes), in safetensors",
        )
    model, problems = model_fields(config, archs[0])
    if problems:
        raise fail(where, f"a {archs[0]} that our GPT cannot compute:\n  - " + "\n  - ".join(problems))
    return where, archs[0], model


def model_shape(path: str) -> dict[str, Any]:
    """The model section's shape (SHAPE_FIELDS) that the directory's config.json describes: what
    `init_from.config` puts in the tree when the config is built, so every rule sees it."""
    _, _, model = read_config(path)
    return {k: model[k] for k in SHAPE_FIELDS}


def model_fields(c: dict[str, Any], arch: str) -> tuple[dict[str, Any], list[str]]:
    """The model section that config.json `c` of class `arch` describes (the inverse of
    export.hf_config), and every feature of it our GPT does not compute."""
    problems: list[str] = []

    def need(key: str, got: Any, want: Any, why: str) -> None:
        if got != want and not (
            isinstance(got, float) and isinstance(want, float) and math.isclose(got, want)
        ):
            problems.append(f"{key} is {got!r}: {why}")

    def rope(theta_key: str) -> float:
        params = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling")
        kind = params.get("rope_type", (scaling or {}).get("rope_type", "default"))
        need("rope_type", kind, "default", "our RoPE has no scaling")
        return float(params.get("rope_theta", c.get(theta_key, 10000.0)))

    if arch == "GPT2LMHeadModel":
        act = c.get("activation_function", "gelu_new")
        need(
            "scale_attn_weights", c.get("scale_attn_weights", True), True, "ours scales by 1/sqrt(head size)"
        )
        need(
            "scale_attn_by_inverse_layer_idx",
            c.get("scale_attn_by_inverse_layer_idx", False),
            False,
            "ours does not",
        )
        need("add_cross_attention", c.get("add_cross_attention", False), False, "ours has no cross-attention")
        if act not in _GELU:
            problems.append(f"activation_function is {act!r}: ours is gelu or gelu_new (tanh)")
        n_embd = int(c.get("n_embd", 768))
        return {
            "arch": "gpt2",
            "n_layer": int(c.get("n_layer", 12)),
            "n_head": int(c.get("n_head", 12)),
            "n_kv_head": None,
            "n_embd": n_embd,
            "intermediate_size": int(c.get("n_inner") or 4 * n_embd),
            "block_size": int(c.get("n_positions", 1024)),
            "vocab_size": int(c.get("vocab_size", 50257)),
            "bias": True,
            "position": "learned",
            "rope_theta": 10000.0,
            "rotary_pct": 1.0,
            "parallel_residual": False,
            "tie_embeddings": bool(c.get("tie_word_embeddings", True)),
            "activation": _GELU.get(act, "gelu"),
            "norm_eps": eps_of(c.get("layer_norm_epsilon", 1e-5)),
        }, problems
    if arch == "GPTNeoXForCausalLM":
        act = c.get("hidden_act", "gelu")
        partial = (c.get("rope_parameters") or {}).get("partial_rotary_factor", c.get("rotary_pct", 0.25))
        need("attention_bias", c.get("attention_bias", True), True, "ours has biases in every layer")
        if act not in _GELU:
            problems.append(f"hidden_act is {act!r}: ours is gelu or gelu_new (tanh)")
        return {
            "arch": "gpt2",
            "n_layer": int(c.get("num_hidden_layers", 44)),
            "n_head": int(c.get("num_attention_heads", 64)),
            "n_kv_head": None,
            "n_embd": int(c.get("hidden_size", 6144)),
            "intermediate_size": int(c.get("intermediate_size", 24576)),
            "block_size": int(c.get("max_position_embeddings", 2048)),
            "vocab_size": int(c.get("vocab_size", 50432)),
            "bias": True,
            "position": "rope",
            "rope_theta": rope("rotary_emb_base"),
            "rotary_pct": float(partial),
            "parallel_residual": bool(c.get("use_parallel_residual", True)),
            "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
            "activation": _GELU.get(act, "gelu"),
            "norm_eps": eps_of(c.get("layer_norm_eps", 1e-5)),
        }, problems
    d, heads = int(c.get("hidden_size", 4096)), int(c.get("num_attention_heads", 32))
    need("hidden_act", c.get("hidden_act", "silu"), "silu", "ours is SwiGLU with silu")
    partial = (c.get("rope_parameters") or {}).get(
        "partial_rotary_factor", c.get("partial_rotary_factor", 1.0)
    )
    need("partial_rotary_factor", float(partial), 1.0, "our llama rotates the whole head")
    need("attention_bias", c.get("attention_bias", False), False, "our llama has no biases")
    need("mlp_bias", c.get("mlp_bias", False), False, "our llama has no biases")
    need(
        "head_dim",
        int(c.get("head_dim") or d // heads),
        d // heads,
        "ours is hidden_size / num_attention_heads",
    )
    return {
        "arch": "llama",
        "n_layer": int(c.get("num_hidden_layers", 32)),
        "n_head": heads,
        "n_kv_head": int(c.get("num_key_value_heads") or heads),
        "n_embd": d,
        "intermediate_size": int(c.get("intermediate_size", 11008)),
        "block_size": int(c.get("max_position_embeddings", 2048)),
        "vocab_size": int(c.get("vocab_size", 32000)),
        "bias": False,
        "position": "rope",
        "rope_theta": rope("rope_theta"),
        "rotary_pct": 1.0,
        "parallel_residual": False,
        "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "activation": "swiglu",
        "norm_eps": eps_of(c.get("rms_norm_eps", 1e-6)),
    }, problems
