"""What `pretrain plan` says for the published runs of `evidence.PUBLISHED`, and the efficiency at
which it would say what each run published (benchmarks/published_runs.py, docs/plan.md)."""

from __future__ import annotations

from dataclasses import dataclass

from pretrain.cluster.hardware import gpu_memory_gb
from pretrain.config.presets import build
from pretrain.config.tree import RunConfig, analytic_num_params
from pretrain.plan.evidence import PublishedRun
from pretrain.plan.rates import resolve_rates
from pretrain.plan.stages import plan_stages
from pretrain.plan.target import Target, host_memory_gb
from pretrain.plan.timing import Rates, predict_step


@dataclass(frozen=True)
class Planned:
    """What `pretrain plan` says for a published run, at its default rates (no --mfu)."""

    tokens_per_s_per_gpu: float
    device_gb: float  # the configured stage's device total for the rank that needs the most
    efficiency: float  # the forward + backward efficiency it assumed
    params: int


def plan_of(run: PublishedRun) -> tuple[RunConfig, Target, Rates]:
    """The config, target and rates `pretrain plan RUN.args` plans with (the arguments a run uses:
    a preset, `--set`, `--world-size`, `--gpus-per-node`, `--gpu`)."""
    preset, rest = run.args[0], list(run.args[1:])
    flags: dict[str, str] = {}
    sets: list[str] = []
    for flag, value in zip(rest[::2], rest[1::2], strict=True):
        if flag == "--set":
            sets.append(value)
        elif flag in ("--world-size", "--gpus-per-node", "--gpu"):
            flags[flag] = value
        else:
            raise ValueError(f"{run.name}: {flag} is not an argument a published run takes")
    world, per_node, device = int(flags["--world-size"]), int(flags["--gpus-per-node"]), flags["--gpu"]
    cfg = build(preset, overrides=sets, world_size=world)
    to = Target(world, per_node, gpu_memory_gb(device), f"--gpu: {device}", host_memory_gb())
    return cfg, to, resolve_rates(cfg, world, per_node, device=device)


def planned(run: PublishedRun) -> Planned:
    """What `pretrain plan RUN.args` prints for the configured stage: tokens/s a GPU, memory."""
    cfg, to, rates = plan_of(run)
    z = cfg.zero
    t = predict_step(cfg, to.world, stage=z.stage, offload_optimizer=False, offload_param=False, rates=rates)
    rows = plan_stages(
        cfg, to.world, device_gb=to.device_gb, gpus_per_node=to.ranks_per_node, host_gb=to.host_gb
    )
    mem = next(r for r in rows if (r.stage, r.offload) == (z.stage, "none"))
    return Planned(t.tokens_per_s / to.world, mem.device_total_gb, rates.mfu, analytic_num_params(cfg.model))


def implied_efficiency(run: PublishedRun) -> float | None:
    """The forward + backward efficiency at which `plan` predicts the run's published tokens/s (the
    step's other parts, communication, bubble and optimizer, as `plan` counts them); None where no
    efficiency does: at 1 `plan` still predicts less, its communication (at the bus bandwidth it assumes
    for the GPU class), bubble and optimizer alone taking longer than the published step."""
    cfg, to, rates = plan_of(run)

    def tokens_per_s(mfu: float) -> float:
        rates.mfu = mfu
        t = predict_step(
            cfg, to.world, stage=cfg.zero.stage, offload_optimizer=False, offload_param=False, rates=rates
        )
        return t.tokens_per_s / to.world

    lo, hi = 0.01, 1.0
    if tokens_per_s(hi) < run.tokens_per_s_per_gpu:
        return None
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_s(mid) < run.tokens_per_s_per_gpu else (lo, mid)
    return (lo + hi) / 2
