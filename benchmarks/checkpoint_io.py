"""Checkpoint cost against DeepSpeed's own, in alternated pairs, at ZeRO-0 and ZeRO-2 on 2 CPU ranks.

    .venv/bin/python benchmarks/checkpoint_io.py [--models gpt2-124m] [--stages 0,2] [--pairs 3]
        [--stall-model gpt2-350m] [--dir /tmp/pretrain_checkpoint_io] [--decoupled]

Starts itself under torchrun with 2 ranks. For each model and stage, one training step (so that
Adam's moments exist), then --pairs rounds, each timing back to back on the same engine:

- DS save: `engine.save_checkpoint` with DeepSpeed's own checkpoint engine (into the page cache),
  then the fsync of the files it wrote: the floor a durable save cannot go under;
- save: `checkpoint.save`, synchronous (the files, their digests and fsync, the meta file, the
  rename and `latest`);
- DS load: `engine.load_checkpoint` of DeepSpeed's bare checkpoint;
- verify + load: what `--resume auto` does: every file's size and digest, shared out over the
  ranks, then the weights-only load of ours;
- async: `checkpoint.save` in the background: the stall is the time the step waits (the snapshot
  to host memory); then the time until it is committed.

Every timing starts after `os.sync()` and a barrier. Prints the median of the pairs and the ratio
of each pair, which cancels most of what a loaded machine adds. --stall-model also measures the
stall of a larger model (two pairs: the first copy takes new memory, the second reuses it), of
300M parameters or more.

--decoupled compares, instead, the stall of our background save with DeepSpeed's own asynchronous
one, its DecoupledCheckpointEngine (`checkpoint.writer: {decoupled: true, type: python}`: a writer
process per rank, which DeepSpeed waits for in the next `engine.step`), each pair on two engines of
the same model: what the save call takes, what the step after it takes beyond a plain step (there
DeepSpeed's writer is waited for, and ours writes beside it), and when it is done (ours: committed,
every file fsynced; DeepSpeed's: its writer done, nothing fsynced).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def launch(args: argparse.Namespace) -> int:
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.call([*cmd, __file__, *sys.argv[1:]], env=env)


def _engine(name: str, stage: int, world: int, ds_checkpoint: dict | None = None):  # type: ignore[no-untyped-def]
    from pretrain.config.ds_render import render_deepspeed
    from pretrain.config.presets import build
    from pretrain.training.distributed import engine as ds_engine

    vocab = 50257 if name.startswith("gpt2") else 65
    cfg = build(
        name,
        overrides=[f"model.vocab_size={vocab}", f"zero.stage={stage}", "precision.bf16=false",
                   "batch.micro_batch_size=1", "batch.gradient_accumulation_steps=1", "model.dropout=0.0",
                   "optimizer.fused_adam=false", "model.activation_checkpointing=false",
                   "checkpoint.keep_last=1"],
        world_size=world,
    )  # fmt: skip
    ds = render_deepspeed(cfg)
    if ds_checkpoint:
        ds["checkpoint"] = {**ds.get("checkpoint", {}), **ds_checkpoint}
    eng = ds_engine.initialize(cfg, ds_engine.build_model(cfg, ds), ds)
    _train_step(eng, vocab)
    return cfg, eng


def _train_step(eng, vocab: int) -> None:  # type: ignore[no-untyped-def]
    x = torch.randint(0, vocab, (1, 16))
    _, loss = eng(x, x)
    eng.backward(loss)
    eng.step()


def _timed(fn, group) -> float:  # type: ignore[no-untyped-def]
    """Seconds of `fn` on the slowest rank: every rank starts together with nothing dirty."""
    import torch.distributed as tdist

    os.sync()
    tdist.barrier(group=group)
    t = time.perf_counter()
    fn()
    tdist.barrier(group=group)
    return time.perf_counter() - t


def _fsync_tree(path: Path, rank: int, world: int) -> None:
    for i, f in enumerate(sorted(p for p in path.rglob("*") if p.is_file())):
        if i % world == rank:
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def measure(name: str, stage: int, args: argparse.Namespace, dist, group) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    import torch.distributed as tdist

    from pretrain.config.layout import Layout
    from pretrain.training.checkpoint import resume
    from pretrain.training.checkpoint import store as checkpoint
    from pretrain.training.distributed import ds_internals

    cfg, eng = _engine(name, stage, dist.world_size)
    root = Path(args.dir) / f"{name}-z{stage}"
    if dist.is_main:
        shutil.rmtree(root, ignore_errors=True)
    state = {
        "step": 0, "tokens_seen": 0, "loader": {"consumed_samples": 0}, "config": cfg.model_dump(mode="json"),
        "zero_stage": stage, "rng": checkpoint.gather_rng(group),
    }  # fmt: skip
    checkpoint.preflight(root / "ours", need_bytes=checkpoint.estimate_bytes(cfg), keep=1, group=group)
    deepspeeds = ds_internals.get_checkpoint_engine(eng)
    rec = checkpoint.recorder(eng)
    ours_engine = ds_internals.get_checkpoint_engine(eng)
    saver = checkpoint.Saver(group, asynchronous=True)
    layout = Layout(data=dist.world_size, zero_stage=stage)
    t: dict[str, list[float]] = {k: [] for k in ("ds_save", "ds_fsync", "save", "ds_load", "verify_load",
                                                  "stall", "async_total", "snapshot_s")}  # fmt: skip
    bare = root / "bare"

    def ds_save_then_fsync(fsync_s: list[float]) -> None:
        eng.save_checkpoint(str(bare), tag="b", save_latest=False)
        tdist.barrier(group=group)
        t0 = time.perf_counter()
        _fsync_tree(bare / "b", dist.rank, dist.world_size)
        fsync_s.append(time.perf_counter() - t0)

    def ours(step: int, wait: bool) -> None:
        checkpoint.save(eng, root / "ours", {**state, "step": step}, step=step, policy=cfg.checkpoint,
                        group=group, saver=saver, wait=wait)  # fmt: skip

    def verify_and_load() -> None:
        found = resume.find(root / "ours", "auto", layout=layout, checksums=True, group=group)
        assert found is not None
        resume.load(eng, found)

    for pair in range(1, args.pairs + 1):
        ds_internals.set_checkpoint_engine(eng, deepspeeds)  # DeepSpeed's own, as DeepSpeed uses it
        fsync_s: list[float] = []
        # one block: no os.sync between DeepSpeed's save and its fsync
        floor = _timed(partial(ds_save_then_fsync, fsync_s), group)
        t["ds_save"].append(floor - fsync_s[0])
        t["ds_fsync"].append(fsync_s[0])
        t["ds_load"].append(_timed(partial(eng.load_checkpoint, str(bare), tag="b"), group))
        ds_internals.set_checkpoint_engine(eng, ours_engine)
        t["save"].append(_timed(partial(ours, 2 * pair - 1, True), group))
        t["verify_load"].append(_timed(verify_and_load, group))
        rec.snapshot_seconds = 0.0
        t["stall"].append(_timed(partial(ours, 2 * pair, False), group))
        t["snapshot_s"].append(rec.snapshot_seconds)
        t["async_total"].append(t["stall"][-1] + _timed(saver.wait, group))
        if dist.is_main:
            shutil.rmtree(bare, ignore_errors=True)
    meta = checkpoint.read_meta(root / "ours" / checkpoint.tag_for(2 * args.pairs))
    t["size"] = [sum(f["bytes"] for f in meta["files"].values())]
    t["snapshot"] = [saver.snapshot_bytes]
    if not args.keep and dist.is_main:
        shutil.rmtree(root, ignore_errors=True)
    return t


def measure_decoupled(name: str, stage: int, args: argparse.Namespace, dist, group) -> dict[str, list[float]]:  # type: ignore[no-untyped-def]
    """Per pair: a plain step of each engine, then ours (background save, the step after it, the
    wait for the commit) and DeepSpeed's DecoupledCheckpointEngine (its save call, the step after it,
    in which DeepSpeed waits for its writer process)."""
    from pretrain.training.checkpoint import store as checkpoint

    # DeepSpeed's writer placement reads the launcher's machine count and index, which torchrun does
    # not set; its `data_parallel: null` placement fails in 0.19.8 (`UniversalParallelInfo.dp_rank`)
    os.environ.setdefault("CROSS_SIZE", "1")
    os.environ.setdefault("CROSS_RANK", "0")
    cfg, eng = _engine(name, stage, dist.world_size)
    writer = {"writer": {"type": "python", "decoupled": True, "data_parallel": "replica"}}
    _, dec = _engine(name, stage, dist.world_size, ds_checkpoint=writer)
    vocab = cfg.model.vocab_size
    root = Path(args.dir) / f"{name}-z{stage}-decoupled"
    if dist.is_main:
        shutil.rmtree(root, ignore_errors=True)
    state = {
        "step": 0, "tokens_seen": 0, "loader": {"consumed_samples": 0}, "config": cfg.model_dump(mode="json"),
        "zero_stage": stage, "rng": checkpoint.gather_rng(group),
    }  # fmt: skip
    checkpoint.preflight(root / "ours", need_bytes=checkpoint.estimate_bytes(cfg), keep=1, group=group)
    saver = checkpoint.Saver(group, asynchronous=True)
    t: dict[str, list[float]] = {k: [] for k in ("step", "ours_call", "ours_next", "ours_done",
                                                  "dec_step", "dec_call", "dec_next")}  # fmt: skip
    for pair in range(1, args.pairs + 1):
        t["step"].append(_timed(partial(_train_step, eng, vocab), group))
        t0 = time.perf_counter()
        t["ours_call"].append(_timed(partial(checkpoint.save, eng, root / "ours", {**state, "step": pair},
                                             step=pair, policy=cfg.checkpoint, group=group, saver=saver,
                                             wait=False), group))  # fmt: skip
        t["ours_next"].append(_timed(partial(_train_step, eng, vocab), group))
        saver.wait()
        t["ours_done"].append(time.perf_counter() - t0)
        t["dec_step"].append(_timed(partial(_train_step, dec, vocab), group))
        t["dec_call"].append(_timed(partial(dec.save_checkpoint, str(root / "ds"), tag=f"d{pair}"), group))
        t["dec_next"].append(_timed(partial(_train_step, dec, vocab), group))
    dec.destroy()  # stops DeepSpeed's writer processes
    if not args.keep and dist.is_main:
        shutil.rmtree(root, ignore_errors=True)
    return t


def report_decoupled(name: str, stage: int, t: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in t.items()}
    ours = [c + n - s for c, n, s in zip(t["ours_call"], t["ours_next"], t["step"], strict=True)]
    dec = [c + n - s for c, n, s in zip(t["dec_call"], t["dec_next"], t["dec_step"], strict=True)]
    print(f"\n{name}, ZeRO-{stage}, median of {len(ours)} pairs (a plain step {med['step']:.2f} s):")
    print(f"  ours: save call {med['ours_call']:.2f} s + next step {med['ours_next']:.2f} s; stall "
          f"{statistics.median(ours):.2f} s (pairs {', '.join(f'{x:.2f}' for x in ours)}); committed after "
          f"{med['ours_done']:.2f} s")  # fmt: skip
    print(f"  DeepSpeed decoupled: save call {med['dec_call']:.2f} s + next step {med['dec_next']:.2f} s; "
          f"stall {statistics.median(dec):.2f} s (pairs {', '.join(f'{x:.2f}' for x in dec)}); "
          "done at the end of the next step, nothing fsynced")  # fmt: skip


def report(name: str, stage: int, t: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in t.items()}
    floor = [a + b for a, b in zip(t["ds_save"], t["ds_fsync"], strict=True)]
    save_ratio = [s / f for s, f in zip(t["save"], floor, strict=True)]
    load_ratio = [v / d for v, d in zip(t["verify_load"], t["ds_load"], strict=True)]
    stall_ratio = [s / w for s, w in zip(t["stall"], t["save"], strict=True)]
    mb = med["size"] / 1e6
    print(f"\n{name}, ZeRO-{stage}, {mb:,.0f} MB a checkpoint ({med['snapshot'] / 1e6:,.0f} MB snapshot on rank 0), "
          f"median of {len(t['save'])} pairs:")  # fmt: skip
    print(f"  DS save {med['ds_save']:.2f} s + fsync {med['ds_fsync']:.2f} s = floor {statistics.median(floor):.2f} s"
          f" | save {med['save']:.2f} s: {statistics.median(save_ratio):.2f}x the floor "
          f"(pairs {', '.join(f'{r:.2f}' for r in save_ratio)})")  # fmt: skip
    print(f"  DS load {med['ds_load']:.2f} s | verify + load {med['verify_load']:.2f} s: "
          f"{statistics.median(load_ratio):.2f}x (pairs {', '.join(f'{r:.2f}' for r in load_ratio)})")  # fmt: skip
    print(f"  async: the step waits {med['stall']:.2f} s, {statistics.median(stall_ratio):.2f} of a synchronous "
          f"save (pairs {', '.join(f'{r:.2f}' for r in stall_ratio)}), of which the copy {med['snapshot_s']:.2f} s; "
          f"committed after {med['async_total']:.2f} s")  # fmt: skip


def main(args: argparse.Namespace) -> None:
    import torch.distributed as tdist

    from pretrain.training.distributed import ranks

    dist = ranks.launch_env()
    ranks.init_distributed(dist)
    group = ranks.control_group()
    results = []
    run = measure_decoupled if args.decoupled else measure
    for name in args.models.split(","):
        for stage in (int(s) for s in args.stages.split(",")):
            results.append((name, stage, run(name, stage, args, dist, group)))
    if args.stall_model:
        one = argparse.Namespace(
            **{**vars(args), "pairs": 2}
        )  # the second copies into the first one's buffers
        results.append((args.stall_model, 2, measure(args.stall_model, 2, one, dist, group)))
    if dist.is_main:
        print(f"\n{dist.world_size} CPU ranks, {os.environ.get('OMP_NUM_THREADS')} thread(s) each, fp32; "
              f"checkpoints in {args.dir}")  # fmt: skip
        for name, stage, t in results:
            (report_decoupled if args.decoupled else report)(name, stage, t)
        if args.decoupled:
            print(
                "\nstall: the save call plus what the step after it takes beyond a plain step of the same engine"
            )
    if dist.is_main and not args.decoupled:
        print(
            "\nfloor: DeepSpeed's bare save (its own checkpoint engine, zip CRC-32 included) and the fsync of its\n"
            "files; save: ours, synchronous (no zip CRC, BLAKE3 of each file on a thread beside the next\n"
            "file's write, fsync, meta, rename, `latest`); verify + load: every file's size and BLAKE3\n"
            "(shared over the ranks, threads within a rank), then the weights-only load; async: the time\n"
            "the step waits for a background save (the snapshot to host memory), against a synchronous save"
        )
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2-124m", help="Presets, comma-separated.")
    ap.add_argument("--stages", default="0,2", help="ZeRO stages, comma-separated.")
    ap.add_argument("--pairs", type=int, default=3, help="Alternated rounds of each measurement.")
    ap.add_argument("--stall-model", default="", help="A larger preset whose async stall is measured once.")
    ap.add_argument("--dir", default="/tmp/pretrain_checkpoint_io", help="Where the checkpoints go.")
    ap.add_argument("--keep", action="store_true", help="Keep the checkpoints afterwards.")
    ap.add_argument(
        "--decoupled", action="store_true", help="Our async save against DeepSpeed's decoupled one."
    )
    a = ap.parse_args()
    sys.exit(launch(a) if "RANK" not in os.environ else main(a))
