"""`pretrain plan` against published pretraining runs: the table of docs/plan.md.

    .venv/bin/python benchmarks/published_runs.py

For each run of `pretrain.plan.evidence.PUBLISHED` (llm.c, Megatron-LM, torchtitan, MPT, BLOOM),
`pretrain plan` is given the run's model, layout, batch and GPUs, and nothing else: its default
rates (the forward + backward efficiency of `evidence.FWD_BWD_EFFICIENCY`, the interconnect assumed
for the GPU class). Printed per run: published tokens/s a GPU, the plan's, their ratio, the
efficiency the plan used and the one that would give the published figure ("none" where no
efficiency would: the run's communication, as the plan counts it, takes longer than its published
step), and memory where the run published it. `tests/test_plan_published.py` checks docs/plan.md's
copy of this table against `pretrain plan` itself.
"""

from __future__ import annotations

import statistics

from pretrain.logs import deepspeed_logs_to_stderr
from pretrain.plan.evidence import FWD_BWD_EFFICIENCY, PUBLISHED, size_class
from pretrain.plan.published import implied_efficiency, planned

GIB = 2**30 / 1e9  # GB in a GiB


def main() -> None:
    deepspeed_logs_to_stderr()  # the table on stdout, nothing else
    print(
        "| run | published tokens/s a GPU | plan | plan / published | efficiency (implied) | used for | memory GB a GPU: plan (published) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    errors: dict[bool, list[float]] = {True: [], False: []}
    implied: dict[str, float | None] = {}
    for run in PUBLISHED:
        p = planned(run)
        implied[run.name] = mine = implied_efficiency(run)
        ratio = p.tokens_per_s_per_gpu / run.tokens_per_s_per_gpu
        errors[run.fit].append(abs(ratio - 1))
        memory = f"{p.device_gb:.1f}" + (f" ({run.memory_gib * GIB:.1f})" if run.memory_gib else "")
        print(
            f"| {run.name} | {run.tokens_per_s_per_gpu:,.0f} | {p.tokens_per_s_per_gpu:,.0f} | {ratio:.2f} | "
            f"{p.efficiency:.2f} ({'none' if mine is None else f'{mine:.3f}'}) | "
            f"{'fit' if run.fit else 'held out'} | {memory} |"
        )
    print()
    print(
        f"largest difference: {max(errors[True]):.0%} on the runs fitted, {max(errors[False]):.0%} on the runs held out"
    )
    print()
    print("| GPU | layout | model size | efficiency | mean implied by its runs |")
    print("| --- | --- | --- | --- | --- |")
    for e in FWD_BWD_EFFICIENCY:
        mean = statistics.fmean(v for r in e.runs if (v := implied[r]) is not None)  # a fitted run has one
        print(f"| {e.gpu} | {e.layout} | {size_class(e)} | {e.value:.2f} | {mean:.3f} |")


if __name__ == "__main__":
    main()
