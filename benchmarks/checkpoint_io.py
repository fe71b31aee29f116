"""Checkpoint save and load: time and size, at ZeRO-2 on 2 CPU ranks, for a small model and GPT-2 124M.

    .venv/bin/python benchmarks/checkpoint_io.py [--models small,gpt2-124m] [--dir /tmp/ckpt_io] [--repeats 2]

Starts itself under torchrun with 2 ranks. For each model: one training step (so that Adam's
moments exist; short sequences, the model keeps its shape), then `checkpoint.save` (DeepSpeed's
files on every rank, fsync and sha256 of each, the meta file, rename, `latest`), validation of the
newest checkpoint as `--resume auto` does it (sizes and sha256, shared out over the ranks), and
`resume.load` into the engine (weights-only). Prints the best of --repeats of each, the size
on disk against `checkpoint.estimate_bytes` (what the start-up free-space check asks for), and the
time `pretrain export` takes to consolidate the weights (rank 0 alone).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def launch(args: argparse.Namespace) -> int:
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        __file__,
        *sys.argv[1:],
    ]
    return subprocess.call(cmd, env=env)


def main(args: argparse.Namespace) -> None:
    import torch.distributed as tdist

    from pretrain.config.ds_render import render_deepspeed
    from pretrain.config.layout import Layout
    from pretrain.config.presets import build
    from pretrain.config.tree import analytic_num_params
    from pretrain.export import consolidated_state_dict
    from pretrain.training import checkpoint, ranks, resume
    from pretrain.training import engine as ds_engine

    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    group = ranks.control_group()
    root = Path(args.dir)
    rows = []
    for name in args.models.split(","):
        vocab = 50257 if name.startswith("gpt2") else 65
        cfg = build(
            name,
            overrides=[f"model.vocab_size={vocab}", "zero.stage=2", "precision.bf16=false", "batch.micro_batch_size=1",
                       "batch.gradient_accumulation_steps=1", "model.dropout=0.0", "optimizer.fused_adam=false",
                       "model.activation_checkpointing=false", "checkpoint.keep_last=1"],
            world_size=dist.world_size,
        )  # fmt: skip
        ds = render_deepspeed(cfg)
        model = ds_engine.build_model(cfg, ds)
        eng = ds_engine.initialize(cfg, model, ds)
        x = torch.randint(0, vocab, (1, 16))
        _, loss = eng(x, x)
        eng.backward(loss)
        eng.step()
        ckpt_dir = root / name
        if dist.is_main:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        tdist.barrier()
        state = {
            "step": 0,
            "tokens_seen": 0,
            "loader": {"consumed_samples": 0},
            "config": cfg.model_dump(mode="json"),
            "zero_stage": 2,
            "rng": checkpoint.gather_rng(group),
        }
        need = checkpoint.estimate_bytes(cfg)
        checkpoint.preflight(ckpt_dir, need_bytes=need, keep=1, group=group)
        save_s, bare_s, verify_s, load_s = [], [], [], []
        for step in range(1, args.repeats + 1):
            # DeepSpeed's save alone (page cache, no fsync, no hashing), for comparison
            rec = checkpoint.recorder(eng)
            eng.checkpoint_engine = rec.inner
            os.sync()  # each timing starts with no dirty pages of the last one to write back
            tdist.barrier()
            t = time.perf_counter()
            eng.save_checkpoint(str(root / "bare"), tag=f"bare{step}", save_latest=False)
            bare_s.append(time.perf_counter() - t)
            eng.checkpoint_engine = rec
            if dist.is_main:
                shutil.rmtree(root / "bare", ignore_errors=True)
            os.sync()
            tdist.barrier()
            t = time.perf_counter()
            checkpoint.save(
                eng, ckpt_dir, {**state, "step": step}, step=step, policy=cfg.checkpoint, group=group
            )
            save_s.append(time.perf_counter() - t)
            tdist.barrier()
            t = time.perf_counter()
            found = resume.find(
                ckpt_dir,
                "auto",
                layout=Layout(data=dist.world_size, zero_stage=2),
                checksums=True,
                group=group,
            )
            verify_s.append(time.perf_counter() - t)
            assert found is not None and found.step == step
            t = time.perf_counter()
            resume.load(eng, found)
            tdist.barrier()
            load_s.append(time.perf_counter() - t)
        meta = checkpoint.read_meta(ckpt_dir / checkpoint.tag_for(args.repeats))
        size = sum(f["bytes"] for f in meta["files"].values())
        export_s = None
        if dist.is_main:
            t = time.perf_counter()
            consolidated_state_dict(ckpt_dir / checkpoint.tag_for(args.repeats))
            export_s = time.perf_counter() - t
        rows.append(
            (
                name,
                analytic_num_params(cfg.model),
                size,
                need,
                min(bare_s),
                min(save_s),
                min(verify_s),
                min(load_s),
                export_s,
            )
        )
        del eng, model
        tdist.barrier()
    if dist.is_main:
        print(f"\nZeRO-2, fp32, {dist.world_size} CPU ranks, {os.environ.get('OMP_NUM_THREADS')} thread(s) each, "
              f"best of {args.repeats}; checkpoints in {root}")  # fmt: skip
        print(f"{'model':<10} {'params':>8} {'size':>9} {'estimate':>9} {'DS save':>8} {'save':>7} {'MB/s':>6} "
              f"{'verify':>7} {'load':>7} {'MB/s':>6} {'consolidate':>11}")  # fmt: skip
        for name, n, size, need, bare, save, verify, load, export in rows:
            mb = size / 1e6
            print(f"{name:<10} {n / 1e6:>7.2f}M {mb:>7.1f}MB {need / 1e6:>7.1f}MB {bare:>7.2f}s {save:>6.2f}s "
                  f"{mb / save:>6.0f} {verify:>6.2f}s {load:>6.2f}s {mb / load:>6.0f} {export:>10.2f}s")  # fmt: skip
        print(
            "DS save: engine.save_checkpoint alone (into the page cache); save: checkpoint.save, the same files\n"
            "plus fsync + sha256 of each, the meta file, rename and `latest`; verify: sizes + sha256 of every\n"
            "file, shared out over the ranks (what --resume auto does first); load: engine.load_checkpoint,\n"
            "weights only; consolidate: the fp32 weights gathered from the shards (pretrain export), rank 0"
        )
    tdist.barrier()
    if not args.keep and dist.is_main:
        shutil.rmtree(root, ignore_errors=True)
    tdist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="small,gpt2-124m", help="Presets, comma-separated.")
    ap.add_argument("--dir", default="/tmp/pretrain_checkpoint_io", help="Where the checkpoints go.")
    ap.add_argument("--repeats", type=int, default=2, help="Saves and loads of each model; the best counts.")
    ap.add_argument("--keep", action="store_true", help="Keep the checkpoints afterwards.")
    a = ap.parse_args()
    sys.exit(launch(a) if "RANK" not in os.environ else main(a))
