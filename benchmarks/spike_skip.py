"""What the loss-spike rule costs a step, and what a device-decided skip by `torch.where` would.

    .venv/bin/python benchmarks/spike_skip.py [--params 10000000] [--window 50] [--repeats 5]

On one thread, torch's AdamW (foreach) over one fp32 tensor of --params:
- the optimizer's step;
- a skip decided on the device by `torch.where`: a copy of the weights and of every state tensor
  before the step, the step, and each put back where the 0/1 verdict says so (the alternative
  docs/checkpoints.md weighs against `guards.OptimizerSkip`, which costs nothing);
- the rule itself on a full window (`mean_loss`, `SpikeRule.judge`, `SpikeRule.accept`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pretrain.training.guards import SpikeRule, mean_loss


def per_call_ms(f: Callable[[], object], repeats: int) -> float:
    f()  # warm
    t0 = time.perf_counter()
    for _ in range(repeats):
        f()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.randn(args.params))
    p.grad = torch.randn(args.params)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=True)
    opt.step()  # the moments exist
    keep = torch.tensor(True)

    def where_skip() -> None:
        state = opt.state[p]
        live = [p.data, state["exp_avg"], state["exp_avg_sq"], state["step"]]
        before = [t.clone() for t in live]
        opt.step()
        for now, was in zip(live, before, strict=True):
            now.copy_(torch.where(keep, now, was))

    rule = SpikeRule(3.0, args.window, [1.0] * args.window)
    loss = torch.tensor(2.0)

    def judge() -> None:
        agreed = mean_loss(loss, 4)
        rule.judge(agreed)
        rule.accept(agreed)

    step = per_call_ms(opt.step, args.repeats)
    where = per_call_ms(where_skip, args.repeats)
    print(f"AdamW step, {args.params:,} fp32 parameters, 1 thread: {step:.1f} ms")
    print(f"copy + step + torch.where back: {where:.1f} ms ({where / step:.1f}x the step)")
    print(f"the rule on the device, window {args.window}: {per_call_ms(judge, 2000) * 1e3:.0f} us a step")


if __name__ == "__main__":
    main()
