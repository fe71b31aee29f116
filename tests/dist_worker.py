"""One rank of a multi-variant training job, started by torchrun from test_distributed.py.

Trains each variant in turn with the real loop (`pretrain.training.loop.train`) in one process group, so
the process start-up and the first `deepspeed.initialize` are paid once. Rank 0 writes the per-step
losses of every variant to a JSON file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as tdist

from pretrain.config.presets import build
from pretrain.training.distributed import ranks
from pretrain.training.loop import train

# A small GPT on tiny-shakespeare, 20 steps, logging every step.
BASE = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=64",
    "model.block_size=64",
    "batch.micro_batch_size=4",
    "batch.gradient_accumulation_steps=1",
    "optimizer.lr=3e-3",
    "schedule.max_steps=20",
    "schedule.warmup_steps=2",
    "logging.log_interval=1",
    "logging.eval_interval=20",
    "logging.eval_batches=2",
    "logging.sample_tokens=0",
    "checkpoint.interval=1000",
]

VARIANTS = {
    "zero0": ["zero.stage=0"],
    "zero1": ["zero.stage=1"],
    "zero2": ["zero.stage=2"],
    "zero3": ["zero.stage=3"],
    "zero2_offload": ["zero.stage=2", "zero.offload_optimizer=true"],
    "zero3_offload": ["zero.stage=3", "zero.offload_optimizer=true", "zero.offload_param=true"],
    "bf16": ["zero.stage=1", "precision.bf16=true"],
    "accum4_micro1": ["zero.stage=0", "batch.micro_batch_size=1", "batch.gradient_accumulation_steps=4"],
}


def main() -> None:
    data_dir, out_dir, names = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    results = {}
    for name in names:
        cfg = build(
            "tiny",
            overrides=[
                *BASE,
                *VARIANTS[name],
                f"data.dataset_dir={data_dir}",
                f"logging.run_dir={out_dir / name}",
            ],
            world_size=dist.world_size,
        )
        res = train(cfg, dist)
        results[name] = {
            "losses": res.losses,
            "val_loss": res.val_loss,
            "optimizer": res.optimizer,
            "run_dir": str(cfg.run_dir()),
        }
    if dist.is_main:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    tdist.destroy_process_group()  # as the CLI does; left to the interpreter's exit, gloo can abort


if __name__ == "__main__":
    main()
