"""One rank of the checkpoint test jobs, started by torchrun from test_checkpoint.py.

Runs a list of jobs (JSON: name, run dir, overrides, resume, fault environment, expect_error) in
turn with the real loop in one process group, so start-up is paid once. Rank 0 writes what each
job returned, or the error it was expected to raise.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as tdist

from pretrain.config.presets import build
from pretrain.errors import CheckpointError, DataError
from pretrain.training.distributed import ranks
from pretrain.training.loop import train

# A small GPT on tiny-shakespeare, logging every step.
BASE = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "batch.micro_batch_size=2",
    "optimizer.lr=3e-3",
    "schedule.max_steps=8",
    "schedule.warmup_steps=2",
    "logging.log_interval=1",
    "logging.eval_interval=4",
    "logging.eval_batches=2",
    "logging.sample_tokens=0",
]


def main() -> None:
    data_dir, out_dir, jobs_file = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    results = {}
    for job in json.loads(jobs_file.read_text()):
        cfg = build(
            "tiny",
            overrides=[
                *BASE,
                *job.get("overrides", []),
                f"data.dataset_dir={data_dir}",
                f"logging.run_dir={out_dir / job['run']}",
            ],
            world_size=dist.world_size,
        )
        env = job.get("env", {})
        os.environ.update(env)
        try:
            res = train(cfg, dist, resume=job.get("resume"))
        except (CheckpointError, DataError) as e:
            if not job.get("expect_error"):
                raise
            results[job["name"]] = {"error": str(e)}
            continue
        finally:
            for k in env:
                os.environ.pop(k, None)
        results[job["name"]] = {
            "losses": res.losses,
            "start_step": res.start_step,
            "final_step": res.final_step,
            "val_loss": res.val_loss,
            "skipped_steps": res.skipped_steps,
            "rollbacks": res.rollbacks,
            "stopped_by": res.stopped_by,
            "ended_by": res.ended_by,
        }
    if dist.is_main:
        (out_dir / f"{jobs_file.stem}.results.json").write_text(json.dumps(results, indent=1))
    # As the CLI does: a process group left to the interpreter's exit can abort in gloo's destructor
    # ("terminate called without an active exception"), most often after a job that raised.
    if tdist.is_initialized():
        tdist.destroy_process_group()


if __name__ == "__main__":
    main()
