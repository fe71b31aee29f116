"""`pretrain` command line: train, prepare, render, config, presets.

Every command takes the same config arguments: `--preset`, `--config run.yaml`, `--ds ds.json`
and any number of `--set key=value`, applied in that order and validated once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pretrain.config import (
    ConfigError,
    RunConfig,
    build,
    check_with_deepspeed,
    render_deepspeed,
    to_yaml,
)
from pretrain.corpus import DataError
from pretrain.presets import DS_CONFIG_RENDERS, PRESETS


def _add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("config (applied in this order)")
    g.add_argument(
        "--preset", choices=list(PRESETS), help="Starting point (default: tiny, or the config file's)."
    )
    g.add_argument("--config", metavar="FILE", help="Run config, YAML or JSON: a partial tree.")
    g.add_argument("--ds", metavar="FILE", help="A DeepSpeed JSON, read back into the tree.")
    g.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override one field, e.g. --set model.n_layer=4 (repeatable).",
    )


def _config(args: argparse.Namespace, world_size: int | None) -> RunConfig:
    return build(args.preset, args.config, args.ds, args.overrides, world_size=world_size)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pretrain", description=__doc__.split("\n")[0] if __doc__ else None)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="Train (one process, or one rank under deepspeed/torchrun).")
    _add_config_args(p)
    p.add_argument(
        "--resume", action="store_true", help="Continue from the latest checkpoint in the run dir."
    )
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # injected by launchers

    p = sub.add_parser("prepare", help="Read, tokenize and shard the corpus into data.dataset_dir.")
    _add_config_args(p)
    p.add_argument("--force", action="store_true", help="Rebuild even if the dataset is already prepared.")

    p = sub.add_parser("render", help="Print the DeepSpeed JSON of a config, or (--all) rewrite ds_configs/.")
    _add_config_args(p)
    p.add_argument("--world-size", type=int, default=1, help="Data-parallel world size (default 1).")
    p.add_argument("--all", action="store_true", help="Render every file of ds_configs/.")
    p.add_argument("--check", action="store_true", help="With --all: exit 1 if a file is out of date.")
    p.add_argument("--out-dir", default="ds_configs", help="With --all: where the files go.")

    p = sub.add_parser("config", help="Print the resolved run config as YAML.")
    _add_config_args(p)
    p.add_argument("--world-size", type=int, default=None, help="Resolve the batch for this world size.")

    sub.add_parser("presets", help="List the presets and their parameter counts.")
    return ap


def cmd_train(args: argparse.Namespace) -> int:
    from pretrain import engine
    from pretrain.prepare import prepare
    from pretrain.train import train

    dist = engine.launch_env()
    cfg = _config(args, dist.world_size)
    engine.init_distributed(dist)
    import torch.distributed as tdist

    # Rank 0 prepares the dataset if needed; the others wait and learn whether it worked.
    error = [None]
    if dist.is_main:
        if not (cfg.data.resolved_dir() / "manifest.json").is_file():
            print(
                f"preparing {cfg.data.corpus} ({cfg.data.tokenizer}) into {cfg.data.resolved_dir()}",
                flush=True,
            )
        try:
            prepare(cfg.data)
        except DataError as e:
            error = [str(e)]  # type: ignore[list-item]
    tdist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise DataError(error[0])
    result = train(cfg, dist, resume=args.resume)
    if dist.is_main and result.val_loss is not None:
        print(f"done: step {result.final_step}, val loss {result.val_loss:.4f}, run dir {cfg.run_dir()}")
    tdist.barrier()
    tdist.destroy_process_group()
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from pretrain.prepare import prepare

    cfg = _config(args, None)
    from pretrain.prepare import load_manifest

    out = prepare(cfg.data, force=args.force)
    m = load_manifest(out)
    counts = ", ".join(
        f"{split} {sum(s['n_tokens'] for s in m[split]):,} tokens / {sum(s['n_docs'] for s in m[split])} docs"
        for split in ("train", "val")
    )
    print(
        f"dataset ready in {out}: {counts}, vocab {m['tokenizer']['vocab_size']} ({m['tokenizer']['type']})"
    )
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    if not args.all:
        ds = render_deepspeed(_config(args, args.world_size))
        check_with_deepspeed(ds)
        print(json.dumps(ds, indent=2))
        return 0
    stale = []
    for name, (preset, overrides, world) in DS_CONFIG_RENDERS.items():
        text = render_file(preset, overrides, world)
        path = Path(args.out_dir) / f"{name}.json"
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(str(path))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("out of date (run `pretrain render --all`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(
        f"{'checked' if args.check else 'wrote'} {len(DS_CONFIG_RENDERS)} files in {args.out_dir}"
        + (f" ({len(stale)} changed)" if stale and not args.check else "")
    )
    return 0


def render_file(preset: str, overrides: list[str], world_size: int) -> str:
    ds = render_deepspeed(build(preset, overrides=overrides, world_size=world_size))
    check_with_deepspeed(ds)
    return json.dumps(ds, indent=2) + "\n"


def cmd_config(args: argparse.Namespace) -> int:
    print(to_yaml(_config(args, args.world_size)), end="")
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from pretrain.model import analytic_num_params

    for name in PRESETS:
        cfg = build(name)
        m = cfg.model
        vocab = m.vocab_size or (65 if cfg.data.tokenizer == "char" else 50257)
        n = analytic_num_params(m.model_copy(update={"vocab_size": vocab}))
        print(
            f"{name:<10} {m.n_layer:>3} layers {m.n_head:>3} heads n_embd {m.n_embd:>5} "
            f"block {m.block_size:>5} vocab {vocab:>6} {cfg.data.tokenizer:<5} {n / 1e6:>9.2f}M params"
        )
    return 0


COMMANDS = {
    "train": cmd_train,
    "prepare": cmd_prepare,
    "render": cmd_render,
    "config": cmd_config,
    "presets": cmd_presets,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, DataError) as e:
        # A person's mistake: one screen, no traceback, from one rank only.
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
