"""Checkpoints → weights files: consolidated safetensors from any ZeRO stage, a Hugging Face GPT-2
directory for GPT-2-shaped models, and loading either back into a `GPT` for sampling.

An export directory holds `model.safetensors` (our parameter names; the tied lm_head is stored
once, as wte), `pretrain.json` (the model config and where the weights came from) and the
tokenizer; with a GPT-2-shaped model also `hf/` (`config.json` + `model.safetensors`), which
`transformers.GPT2LMHeadModel.from_pretrained` reads.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pretrain import checkpoint
from pretrain.config import ModelConfig, RunConfig
from pretrain.errors import CheckpointError, OutputError
from pretrain.files import check_output_dir, replace_dir, temp_name
from pretrain.model import GPT
from pretrain.tokenizer import GPT2_EOT, GPT2_VOCAB_SIZE, Tokenizer, load_tokenizer

WEIGHTS = "model.safetensors"
INFO = "pretrain.json"
HF_DIR = "hf"
EXPORT_NAMES = {WEIGHTS, INFO, HF_DIR, checkpoint.TOKENIZER}  # all an export holds
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def consolidated_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The fp32 weights of a checkpoint directory, gathered from every rank's shards (any ZeRO
    stage; from the fp32 master copy where there is one). Loaded weights-only."""
    meta = checkpoint.read_meta(ckpt)
    # DeepSpeed reports its progress on stdout, which belongs to `pretrain sample`'s text
    with checkpoint.safe_loading(), contextlib.redirect_stdout(sys.stderr):
        if any(ckpt.glob("*optim_states.pt")) and int(meta.get("zero_stage", 0)) > 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # seconds

            sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
        else:  # stage 0: rank 0's model file holds the whole module
            sd = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)[
                "module"
            ]
    return {k: v.detach().float().contiguous() for k, v in sd.items()}


def is_gpt2_shaped(m: ModelConfig) -> bool:
    """GPT-2's architecture: learned positions and biases (our MLP, GELU and LayerNorm match it)."""
    return m.position == "learned" and m.bias


def hf_state_dict(sd: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """Our names → GPT2LMHeadModel's. Its Conv1D layers store weights as (in, out): transposed."""
    out = {}
    for k, v in sd.items():
        if k == "lm_head.weight":
            continue  # tied to wte; transformers ties it back
        if k.startswith("h.") and k.endswith(".weight") and v.dim() == 2:
            v = v.t()
        out[f"transformer.{k}"] = v.contiguous()
    return out


def hf_config(m: ModelConfig, dtype: str, tokenizer_type: str) -> dict[str, Any]:
    eot = GPT2_EOT if tokenizer_type == "gpt2" and (m.vocab_size or 0) >= GPT2_VOCAB_SIZE else None
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.block_size,
        "n_embd": m.n_embd,
        "n_layer": m.n_layer,
        "n_head": m.n_head,
        "n_inner": 4 * m.n_embd,
        "activation_function": "gelu",  # exact erf GELU, as nn.GELU(); GPT-2's own is "gelu_new"
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
    }


def is_export(path: Path) -> bool:
    """`path` holds an export this command wrote, and nothing else: safe to replace."""
    try:
        info = json.loads((path / INFO).read_text())
    except (OSError, ValueError):
        return False
    names = {p.name for p in path.iterdir()}
    return isinstance(info, dict) and {"model", "source"} <= info.keys() and names <= EXPORT_NAMES


def export(
    src: Path, out: Path, dtype: str = "fp32", hf: bool = True, checksums: bool = True
) -> dict[str, Any]:
    """Export the checkpoint `src` (or the newest valid one under a run/checkpoints dir) into `out`,
    atomically. `out` must be new, empty or a previous export. Returns what was written."""
    ckpt = checkpoint.open_checkpoint(src, checksums)
    check_output_dir(
        out, is_export, "export", "--out", sources=[src, ckpt], no_inside=[ckpt], error=OutputError
    )
    meta = checkpoint.read_meta(ckpt)
    cfg = RunConfig.model_validate(meta["config"])
    sd = consolidated_state_dict(ckpt)
    cast = {k: v.to(_DTYPES[dtype]) for k, v in sd.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(out.with_name(f".{out.name}"))
    tmp.mkdir()
    try:
        native = {k: v for k, v in cast.items() if k != "lm_head.weight"}
        save_file(native, str(tmp / WEIGHTS), metadata={"format": "pt", "dtype": dtype})
        info = {
            "model": cfg.model.model_dump(mode="json"),
            "config": meta["config"],
            "dtype": dtype,
            "source": str(ckpt.resolve()),
            "step": meta.get("step"),
            "tokens_seen": meta.get("tokens_seen"),
            "tokenizer_fingerprint": meta.get("tokenizer_fingerprint"),
            "versions": meta.get("versions"),
        }
        (tmp / INFO).write_text(json.dumps(info, indent=1) + "\n")
        if (ckpt / checkpoint.TOKENIZER).is_file():
            shutil.copyfile(ckpt / checkpoint.TOKENIZER, tmp / checkpoint.TOKENIZER)
        wrote_hf = hf and is_gpt2_shaped(cfg.model)
        if wrote_hf:
            (tmp / HF_DIR).mkdir()
            save_file(hf_state_dict(cast, cfg.model), str(tmp / HF_DIR / WEIGHTS), metadata={"format": "pt"})
            (tmp / HF_DIR / "config.json").write_text(
                json.dumps(hf_config(cfg.model, dtype, cfg.data.tokenizer), indent=1) + "\n"
            )
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "source": ckpt,
        "out": out,
        "params": sum(v.numel() for v in native.values()),
        "hf": wrote_hf,
        "step": meta.get("step"),
    }


def load_model(src: Path, device: str = "cpu", checksums: bool = True) -> tuple[GPT, RunConfig, Path]:
    """A GPT in eval mode from an export directory, or from a checkpoint (consolidated in memory).
    Also returns the run config it was trained with and the directory holding its tokenizer."""
    if (src / WEIGHTS).is_file() and (src / INFO).is_file():
        try:
            info = json.loads((src / INFO).read_text())
            cfg = RunConfig.model_validate(info["config"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # pydantic's error is a ValueError
            raise CheckpointError(
                f"{src / INFO}: unreadable export info ({str(e)[:300]}); export again"
            ) from e
        sd = load_file(str(src / WEIGHTS))
        where = src
    else:
        where = checkpoint.open_checkpoint(src, checksums)
        cfg = RunConfig.model_validate(checkpoint.read_meta(where)["config"])
        sd = consolidated_state_dict(where)
    model = GPT(cfg.model)
    sd = {k: v.float() for k, v in sd.items()}
    sd.setdefault("lm_head.weight", sd["wte.weight"])  # tied: stored once
    model.load_state_dict(sd, strict=True)
    return model.to(device).eval(), cfg, where


def tokenizer_for(where: Path, cfg: RunConfig, tokenizer_path: str | None = None) -> Tokenizer:
    path = where / checkpoint.TOKENIZER
    if not path.is_file():
        path = cfg.data.resolved_dir() / checkpoint.TOKENIZER
    return load_tokenizer(path, tokenizer_path or cfg.data.tokenizer_path)


@torch.no_grad()
def generate(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    num_samples: int = 1,
) -> list[str]:
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) or [tokenizer.eot_token or 0]
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    return [str(tokenizer.decode(row.tolist())) for row in out]
