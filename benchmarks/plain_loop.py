"""The reference the benchmarks race: a textbook PyTorch training step on our GPT and data loader.

nanoGPT's loop: GPT + torch.optim.AdamW over the decay / no-decay groups, the LR schedule set each
step, the forward under autocast (bf16 if asked), `backward()`, `clip_grad_norm_`, the step and
`zero_grad`; `torch.compile` on the model if asked. Used by vs_plain_torch.py and gpu_gpt2.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pretrain.config.tree import RunConfig
from pretrain.data.dataset import load_manifest
from pretrain.data.loader import ShardedLoader
from pretrain.training.model.gpt import GPT
from pretrain.training.schedule import lr_at


def plain_step(
    cfg: RunConfig,
    device: torch.device,
    compiled: bool,
    bf16: bool,
    fused: bool | None = None,
    **loader_args: Any,
) -> Callable[[int], torch.Tensor]:
    """One step of the textbook loop a call: `step(i)` trains step i and returns its loss on the
    device. `fused`: torch AdamW's own choice if None. `loader_args` go to the ShardedLoader."""
    data_dir = cfg.data.resolved_dir()
    torch.manual_seed(cfg.seed)
    model: Any = GPT(cfg.model).to(device)
    groups = model.param_groups(cfg.optimizer.weight_decay)
    for g in groups:
        g.pop("name")
    o = cfg.optimizer
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=fused)
    if compiled:
        model = torch.compile(model)
    loader = ShardedLoader(
        [data_dir / s["path"] for s in load_manifest(data_dir)["train"]],
        block_size=cfg.model.block_size,
        micro_batch_size=cfg.batch.micro_batch_size,
        grad_accum=1,
        rank=0,
        world_size=1,
        seed=cfg.data.seed,
        shuffle=True,
        **loader_args,
    )
    model.train()

    def step(i: int) -> torch.Tensor:
        for group in opt.param_groups:
            group["lr"] = lr_at(i, o.lr, cfg.schedule)
        x, y = loader.next_batch()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step
