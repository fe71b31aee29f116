"""One rank's life, from the launcher's environment to its exit code: who it is, the config for its
world, the process group, the dataset prepared on rank 0, `train`, and the teardown (`pretrain
train` and `pretrain/main.py` under any launcher)."""

from __future__ import annotations

import signal
from collections.abc import Callable

import torch.distributed as tdist

from pretrain.cluster.supervise import restart_count
from pretrain.config.tree import DataConfig, RunConfig
from pretrain.data.dataset import MANIFEST, load_manifest, summary
from pretrain.data.prepare import prepare
from pretrain.data.report import format_report
from pretrain.errors import PretrainError, RankLostError
from pretrain.training.checkpoint.store import committed_tags
from pretrain.training.distributed import ranks
from pretrain.training.loop import train


def run_rank(config_for: Callable[[int], RunConfig], resume: str | None) -> int:
    """Train as this rank: `config_for(world_size)` gives the config, `resume` is --resume. Returns
    the exit code: 0, or 128 + the signal a stop was asked by (the run saved first)."""
    dist = ranks.launch_env()
    cfg = config_for(dist.world_size)
    ranks.init_distributed(dist, timeout_s=cfg.launch.collective_timeout_s)
    try:
        prepare_on_rank_0(dist, data=cfg.data)
        result = train(cfg, dist, resume=resume_spec(resume, cfg))
    except PretrainError:
        # Every rank raises it alike; tear the groups down here, or gloo's threads abort at exit.
        tdist.destroy_process_group()
        raise
    except RuntimeError as e:  # gloo's or NCCL's own error when another rank is gone: say which
        # The launcher stops the other ranks once one has died (torchrun: SIGTERM): this one is on its
        # way out already, and says why first.
        before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        said = ranks.lost_rank(e, dist.rank)
        if said is None:
            signal.signal(signal.SIGTERM, before)
            raise
        raise RankLostError(said) from e
    if result.val_loss is not None and result.stopped_by is None and result.ended_by != "max_hours":
        dist.log(f"done: step {result.final_step}, val loss {result.val_loss:.4f}, run dir {cfg.run_dir()}")
    tdist.barrier()
    tdist.destroy_process_group()
    if result.stopped_by is not None:
        return 128 + int(getattr(signal, result.stopped_by))
    return 0


def prepare_on_rank_0(dist: ranks.Dist, *, data: DataConfig) -> None:
    """Rank 0 prepares the dataset if needed; the others wait and learn whether it worked."""

    def act() -> None:
        building = not data.blend and not (data.resolved_dir() / MANIFEST).is_file()
        if building:
            dist.log(f"preparing {data.corpus} ({data.tokenizer}) into {data.resolved_dir()}")
        out = prepare(data)
        if building:  # what `data prepare` prints: the cleaning and dedup counts, then the summary
            m = load_manifest(out)
            dist.log(format_report(m["report"]))
            dist.log(f"dataset ready in {out}: {summary(m)}")

    ranks.rank_0_acts(act, ranks.world_group())


def resume_spec(resume: str | None, cfg: RunConfig) -> str | None:
    """--resume, or "auto" where this start is a restart after a failure (train --max-restarts,
    torchrun, a requeued Slurm job): it continues from the newest checkpoint."""
    if restart_count() > 0 and (
        resume in (None, "auto") or committed_tags(cfg.run_dir() / cfg.checkpoint.dir)[0]
    ):
        return "auto"
    return resume
