"""Validation loss and text samples from the engine's model, on every rank in lockstep."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as tdist

from pretrain.data.loader import ShardedLoader


@torch.no_grad()
def evaluate(engine: Any, val: ShardedLoader, n_batches: int, pipelined: bool = False) -> tuple[float, float]:
    """Mean validation loss over the same `n_batches` micro batches per rank each time, and its
    perplexity. A pipeline evaluates them as one batch of `n_batches` micro-batches (`eval_batch`
    gives every stage the mean over them and over the data-parallel group)."""
    engine.eval()
    dev = engine.device
    total = torch.zeros(2, dtype=torch.float64, device=dev)
    if pipelined:
        batches = list(val.iter_eval(n_batches))
        total[0] += engine.eval_batch(iter(batches), num_micro_batches=len(batches)).double().reshape(())
        total[1] += 1
    else:
        for x, y in val.iter_eval(n_batches):
            _, loss = engine(x.to(dev), y.to(dev))
            total[0] += loss.double()
            total[1] += 1
    engine.train()
    tdist.all_reduce(total)  # sum over ranks; one host sync per evaluation
    mean = (total[0] / total[1]).item()
    return mean, math.exp(min(mean, 50.0))


@torch.no_grad()
def sample(
    engine: Any,
    tokenizer: Any,
    prompt: str,
    *,
    max_new_tokens: int,
    seed: int,
    temperature: float = 0.8,
    top_k: int | None = 200,
) -> str:
    """Generate text. Every rank must call this: under ZeRO-3 each forward gathers parameters."""
    model = engine.module
    engine.eval()
    ids = tokenizer.encode(prompt) or [tokenizer.eot_token or 0]
    idx = torch.tensor([ids], dtype=torch.long, device=engine.device)
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    # Eager even when the model is compiled (compile.enabled): every new length would be a new graph.
    with torch.compiler.set_stance("force_eager"):
        out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen)
    engine.train()
    return str(tokenizer.decode(out[0].tolist()))
