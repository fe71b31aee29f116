"""One rank of the init_from test jobs, started by torchrun (or alone) from test_init_from.py.

Each job starts a run with model.init_from through the real setup (`run.setup`: tokenizer check,
the model section from config.json, the DeepSpeed engine at the job's ZeRO stage) and records the
engine's logits on the input ids before any step; a job with `train` runs the real loop instead
(the resume case). A pipeline's logits come from its last stage (`eval_batch`); under ZeRO 1 and 2
each job also records how far the optimizer's fp32 master copy is from the weights. Rank 0 writes
the logits of every job to a safetensors file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from safetensors.torch import save_file

from pretrain.config.presets import build
from pretrain.config.tree import required_vocab_size
from pretrain.training.distributed import ranks
from pretrain.training.loop import train
from pretrain.training.run import setup

BASE = [
    "batch.micro_batch_size=2",
    "schedule.max_steps=2",
    "schedule.warmup_steps=1",
    "logging.log_interval=1",
    "logging.eval_interval=100",
    "logging.eval_batches=1",
    "logging.sample_tokens=0",
    "checkpoint.interval=2",
]


def main() -> None:
    data_dir, out_dir, jobs_file = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    ids = torch.tensor(json.loads(sys.argv[4]))
    logits = {}
    for job in json.loads(jobs_file.read_text()):
        cfg = build(
            "tiny",
            overrides=[
                *BASE,
                *job["overrides"],
                f"data.dataset_dir={data_dir}",
                f"logging.run_dir={out_dir / job['run']}",
            ],
            world_size=dist.world_size,
        )
        if job.get("train"):
            train(cfg, dist, resume=job.get("resume"))
            continue
        run = setup(cfg, dist, resume=None)
        run.engine.eval()
        if cfg.parallel.pipeline > 1:
            logits[job["name"]] = pipeline_logits(run.engine, ids, required_vocab_size(run.cfg.model))
        else:
            with torch.no_grad():
                out, _ = run.engine(ids, ids)  # with targets: the logits at every position
            logits[job["name"]] = out.float().contiguous()
        if cfg.zero.stage in (1, 2):
            logits[f"{job['name']}.master"] = master_difference(run.engine.optimizer)
    if dist.is_main:
        save_file(logits, str(out_dir / f"{jobs_file.stem}.logits.safetensors"))
    if tdist.is_initialized():
        tdist.destroy_process_group()


def pipeline_logits(engine: Any, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The last stage's logits on `ids` (one micro-batch through the pipeline), sent to every rank."""
    _, out = engine.eval_batch(iter([(ids, ids)]), return_logits=True, num_micro_batches=1)
    logits = out.float().contiguous() if engine.is_last_stage() else torch.empty(*ids.shape, vocab)
    tdist.broadcast(logits, src=engine.grid.stage_to_global(engine.num_stages - 1, data=0, model=0))
    return logits


def master_difference(optimizer: Any) -> torch.Tensor:
    """ZeRO-1/2: the largest difference between the optimizer's fp32 master copy of this rank's
    partition and the parameters it was made from (0: made from the loaded weights)."""
    diffs = []
    for i, master in enumerate(optimizer.single_partition_of_fp32_groups):
        ours = tdist.get_rank(group=optimizer.real_dp_process_group[i])
        diffs.append((master - optimizer.parallel_partitioned_bit16_groups[i][ours].float()).abs().max())
    worst = torch.stack(diffs).max().reshape(1)
    tdist.all_reduce(worst, op=tdist.ReduceOp.MAX)  # every rank's partition (every stage's)
    return worst


if __name__ == "__main__":
    main()
