"""One rank of the gradient-accumulation job, started from test_precision.py.

For each variant (ZeRO stage, optimizer offload, precision.grad_accum_dtype) the real engine of a
bf16 GPT is built as `pretrain train` builds it (the rendered DeepSpeed JSON, `engine.build_model`,
`engine.initialize`) and fed MICRO micro batches of one step; after the last backward, before the
step, DeepSpeed's accumulated gradient of every parameter (`safe_get_full_grad`, its fp32 view) is
compared with the exact sum of the same bf16 micro-batch gradients, computed here by a plain bf16
copy of the model and summed in fp64. Rank 0 writes each variant's relative error, the optimizer
DeepSpeed built and the dtype of its gradient buffer to a JSON file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

from pretrain.config.ds_render import render_deepspeed
from pretrain.config.presets import build
from pretrain.training.distributed import engine, ranks
from pretrain.training.model.gpt import GPT

MICRO = 256  # micro batches in the step: a power of two, so DeepSpeed's 1/MICRO loss scale is exact
BASE = [
    "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=16", "model.vocab_size=64",
    "batch.micro_batch_size=1", f"batch.gradient_accumulation_steps={MICRO}", "precision.bf16=true",
    "optimizer.fused_adam=false",
]  # fmt: skip

VARIANTS = {
    "zero1_fp32": ["zero.stage=1", "precision.grad_accum_dtype=fp32"],
    "zero1_bf16": ["zero.stage=1", "precision.grad_accum_dtype=bf16"],
    "zero2_fp32": ["zero.stage=2", "precision.grad_accum_dtype=fp32"],
    "zero2_bf16": ["zero.stage=2", "precision.grad_accum_dtype=bf16"],
    "zero3_fp32": ["zero.stage=3", "precision.grad_accum_dtype=fp32"],
    "zero3_bf16": ["zero.stage=3", "precision.grad_accum_dtype=bf16"],
    "zero2_offload_fp32": ["zero.stage=2", "zero.offload_optimizer=true", "precision.grad_accum_dtype=fp32"],
}


def batches(rank: int, vocab: int, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro batches: random tokens, the same on every run."""
    g = torch.Generator().manual_seed(1000 + rank)
    toks = torch.randint(0, vocab, (MICRO, block + 1), generator=g)
    return [(t[None, :-1], t[None, 1:]) for t in toks]


def exact_sum(cfg, data) -> dict[str, torch.Tensor]:
    """The sum over the micro batches of each bf16 gradient (of loss / MICRO, as DeepSpeed scales it),
    in fp64, averaged over the data-parallel ranks."""
    model = GPT(cfg.model)
    model.reset_parameters(cfg.seed)
    model = model.bfloat16()
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
    for x, y in data:
        model.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        (loss / MICRO).backward()
        for n, p in model.named_parameters():
            total[n] += p.grad.double()
    for t in total.values():
        tdist.all_reduce(t)
        t /= tdist.get_world_size()
    return total


def accumulated(cfg, data) -> tuple[dict[str, torch.Tensor], str, str]:
    """DeepSpeed's accumulated gradients after the step's last backward, its optimizer's class, and
    the dtype it accumulated in."""
    from deepspeed.utils import safe_get_full_grad

    ds_config = render_deepspeed(cfg)
    eng = engine.initialize(cfg, engine.build_model(cfg, ds_config), ds_config)
    for i, (x, y) in enumerate(data):
        _, loss = eng(x, y)
        eng.backward(loss)
        if i < len(data) - 1:
            eng.step()  # DeepSpeed counts the micro steps here; it steps the optimizer after the last
    grads = {n: safe_get_full_grad(p).double().cpu() for n, p in eng.module.named_parameters()}
    opt = eng.optimizer
    buffers = getattr(opt, "fp32_groups_gradients_flat", None) or []
    dtype = str(getattr(opt, "gradient_accumulation_dtype", None) or (buffers[0].dtype if buffers else "?"))
    name = type(opt).__name__
    eng.step()
    eng.destroy()
    return grads, name, dtype


def main() -> None:
    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    results = {}
    for name in names:
        cfg = build("tiny", overrides=[*BASE, *VARIANTS[name]], world_size=dist.world_size)
        data = batches(dist.rank, cfg.model.vocab_size, cfg.model.block_size)
        want = exact_sum(cfg, data)
        got, optimizer, dtype = accumulated(cfg, data)
        diff = sum(float((got[n] - w).pow(2).sum()) for n, w in want.items()) ** 0.5
        norm = sum(float(w.pow(2).sum()) for w in want.values()) ** 0.5
        results[name] = {"relative_error": diff / norm, "optimizer": optimizer, "accum_dtype": dtype}
    if dist.is_main:
        out.write_text(json.dumps(results, indent=1))
    ranks.leave_distributed()


if __name__ == "__main__":
    main()
