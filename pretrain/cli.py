"""`pretrain` command line: train, prepare, render, config, presets, checkpoints, cluster tools.

Every command takes the same config arguments: `--preset`, `--config run.yaml`, `--ds ds.json`
(or DeepSpeed's own `--deepspeed_config ds.json`) and any number of `--set key=value`, applied in
that order and validated once.

This module imports neither torch nor DeepSpeed: each command imports what it needs when it runs,
so that `--help`, `hostfile` and `launch-env` answer at once (the launch scripts call them before
every launch), and so does `config` without `--ds` (a DeepSpeed JSON is checked by DeepSpeed's own
validators, which `config`, `render`, `train`, `plan` and `preflight` import).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

from pretrain.cli_values import (
    COUNT,
    FRACTION,
    HOST,
    MEASURE,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    WORKERS,
    WORLD,
    Once,
    number,
    seed,
    stop,
)
from pretrain.cluster import environment
from pretrain.cluster.launch import (
    env_file_text,
    format_hostfile,
    launch_environment,
    launcher_world_size,
    read_hostfile,
    valid_host,
    world_size,
    write_env_file,
)
from pretrain.cluster.reach import LAUNCHERS, Launch, filter_hosts
from pretrain.cluster.reach import check as check_launch
from pretrain.cluster.supervise import REFUSED_FILE, refuse, restart_count, supervise
from pretrain.config.ds_configs import check_render_flags, render_all, render_json
from pretrain.config.presets import PRESETS, build, build_checked
from pretrain.config.reference import reference_markdown, reference_text
from pretrain.config.tree import RunConfig, to_yaml
from pretrain.errors import ConfigError, PretrainError, RankLostError
from pretrain.logs import deepspeed_logs_to_stderr


def _add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("config (applied in this order)")
    g.add_argument(
        "--preset",
        action=Once,
        choices=list(PRESETS),
        help="Starting point (default: tiny, or the config file's).",
    )
    g.add_argument("--config", action=Once, metavar="FILE", help="Run config, YAML or JSON: a partial tree.")
    g.add_argument(
        "--ds",
        "--deepspeed_config",
        "--deepspeed",
        action=Once,
        dest="ds",
        metavar="FILE",
        help="A DeepSpeed JSON, read back into the tree (one rendered by pretrain also names the preset).",
    )
    g.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override one field, e.g. --set model.n_layer=4 (repeatable).",
    )


def _config(args: argparse.Namespace, world_size: int | None, deepspeed: bool = True) -> RunConfig:
    """The run's config from the command line. `deepspeed`: also check the --ds JSON with DeepSpeed's
    own validators, which imports DeepSpeed (off for the commands that must answer at once)."""
    given = {
        "preset": args.preset,
        "config_file": args.config,
        "overrides": args.overrides,
        "world_size": world_size,
        # a resume (asked, or a supervised restart) takes the checkpoint's weights: init_from's
        # directory may be gone (presets.with_init_from_shape)
        "resume": bool(getattr(args, "resume", None)) or restart_count() > 0,
    }
    return build_checked(args.ds, **given) if deepspeed else build(ds_file=args.ds, **given)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pretrain", description=__doc__.split("\n")[0] if __doc__ else None)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="Train (one process, or one rank under deepspeed/torchrun).")
    _add_config_args(p)
    p.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        metavar="auto|CHECKPOINT",
        help="Continue from the newest valid checkpoint in the run dir (`--resume` or `--resume auto`), "
        "or from a checkpoint directory.",
    )
    p.add_argument(
        "--max-restarts",
        type=NON_NEGATIVE,
        metavar="N",
        help="Supervise: start the ranks under torchrun and, when any rank dies, restart them all from "
        "the newest checkpoint, up to N times.",
    )
    p.add_argument(
        "--nproc-per-node",
        type=COUNT,
        metavar="K",
        help="Start K ranks here under torchrun (supervised with --max-restarts; default 1).",
    )
    p.add_argument(
        "--local_rank", "--local-rank", type=NON_NEGATIVE, help=argparse.SUPPRESS
    )  # injected by launchers

    p = sub.add_parser("prepare", help="The same as `data prepare`.")
    _add_prepare_args(p)
    p = sub.add_parser("data", help="Datasets: `data prepare` reads, cleans, tokenizes and shards a corpus.")
    data = p.add_subparsers(dest="data_command", required=True)
    p = data.add_parser(
        "prepare",
        help="Read, clean, dedup, tokenize and shard data.corpus into data.dataset_dir (a no-op if done).",
    )
    _add_prepare_args(p)

    p = sub.add_parser("render", help="Print the DeepSpeed JSON of a config, or (--all) rewrite ds_configs/.")
    _add_config_args(p)
    p.add_argument("--world-size", type=WORLD, help="Data-parallel world size (default 1; not with --all).")
    p.add_argument(
        "--all",
        action="store_true",
        help="Render every file of ds_configs/, each from its own preset and world size (no config arguments).",
    )
    p.add_argument("--check", action="store_true", help="With --all: exit 1 if a file is out of date.")
    p.add_argument(
        "--out-dir",
        help="With --all: where the files go (default ds_configs); a new directory, or one holding only "
        "files render wrote.",
    )

    p = sub.add_parser(
        "config",
        help="Print the resolved run config as YAML.",
        epilog="`pretrain fields` lists every field of the tree: its type, bounds, default and description.",
    )
    _add_config_args(p)
    p.add_argument("--world-size", type=COUNT, default=None, help="Resolve the batch for this world size.")

    sub.add_parser("presets", help="List the presets and their parameter counts.")
    p = sub.add_parser("fields", help="List every config field: its type, bounds, default and description.")
    p.add_argument("section", nargs="?", metavar="SECTION", help="Only this section, e.g. model.")
    p.add_argument("--markdown", action="store_true", help="As Markdown, as docs/configuration.md holds it.")
    _add_checkpoint_parsers(sub)

    p = sub.add_parser(
        "plan",
        help="Before launch: batch, tokens, DeepSpeed JSON, memory, communication and step time per ZeRO "
        "stage for the tensor x pipeline x data-parallel layout, and the layouts that fit.",
    )
    p.add_argument(
        "config_file", nargs="?", metavar="CONFIG", help="Run config file (as --config), or a preset name."
    )
    _add_config_args(p)
    p.add_argument(
        "--world-size", type=WORLD, help="Data-parallel world size (default 1, or the hostfile's)."
    )
    p.add_argument(
        "--hostfile",
        help="Take the world size and ranks per node from this hostfile, and the GPU and host memory from its "
        "'# pretrain: device=A100-80GB host-gb=1024' line.",
    )
    p.add_argument(
        "--gpu-gb",
        type=MEASURE,
        help="Memory of one rank's GPU in GB (default: the GPU's name, the hostfile's line, else this "
        "machine's device).",
    )
    p.add_argument(
        "--device-gb", type=MEASURE, dest="old_gpu_gb", help=argparse.SUPPRESS
    )  # --gpu-gb's old name
    p.add_argument(
        "--host-gb",
        type=MEASURE,
        help="Host memory of one node in GB (default: the hostfile's line, else this machine's when it is the "
        "target).",
    )
    p.add_argument(
        "--gpus-per-node", type=WORLD, help="Ranks per node, for DeepSpeed's estimates (default: min(N, 8))."
    )
    t = p.add_argument_group(
        "step time (default: a previous run, preflight's figure, this machine, assumptions)"
    )
    t.add_argument(
        "--gpu",
        help="The GPU, for its datasheet peak and, where the name says it (A100-80GB) or the GPU comes in "
        "one size (H100), its memory; or 'cpu'.",
    )
    t.add_argument("--device", dest="old_gpu", help=argparse.SUPPRESS)  # --gpu's old name
    t.add_argument("--peak-tflops", type=MEASURE, help="One rank's peak TFLOP/s.")
    t.add_argument("--mfu", type=FRACTION, help="The fraction of the peak forward+backward reach.")
    t.add_argument("--busbw", type=MEASURE, help="All-reduce bus bandwidth in GB/s (preflight measures it).")
    t.add_argument(
        "--node-busbw",
        type=MEASURE,
        help="All-reduce bus bandwidth within a node in GB/s, for tensor parallelism (default: --busbw on one "
        "node, else assumed).",
    )
    t.add_argument(
        "--from-run",
        metavar="RUN_DIR",
        action="append",
        help="Take MFU and the optimizer's cost (on the device, or on the host if it offloaded) from a "
        "previous run (repeatable: e.g. one run with offload, one without).",
    )
    p.add_argument(
        "--layouts",
        action="store_true",
        help="List the tensor x pipeline x ZeRO layouts that fit, fastest first, even when the configured one "
        "fits (they are listed anyway when nothing fits).",
    )
    p.add_argument("--json", action="store_true", help="Print the plan as JSON.")

    p = sub.add_parser("plot", help="Plot a run's metrics.csv (loss, LR, tokens/s) to a PNG.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="The run directory (logging.run_dir).")
    p.add_argument(
        "--out",
        help="The PNG file to write, exactly this path (default: RUN_DIR/metrics.png); never a file that is "
        "not a PNG.",
    )
    _add_launch_parsers(sub)
    return ap


def _add_launch_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "preflight",
        help="Check every host of a hostfile (ssh, versions, accelerators, data, checkpoint dir, port), "
        "then time an all-reduce.",
    )
    p.add_argument("--hostfile", required=True, help="DeepSpeed hostfile: '<host> slots=<N>' lines.")
    _add_config_args(p)
    p.add_argument(
        "--master-addr", type=HOST, help="Rank 0's address as the other hosts reach it (default: first host)."
    )
    p.add_argument("--master-port", type=PORT, default=29500, help="Rendezvous port (default 29500).")
    p.add_argument("--ssh-port", type=PORT, help="ssh port, as deepspeed --ssh_port.")
    p.add_argument(
        "--no-ssh",
        action="store_true",
        help="Check a launch without ssh, as deepspeed --no_ssh (launch/no_ssh.sh): this machine's hosts "
        "are probed directly.",
    )
    p.add_argument(
        "--no-ssh-check",
        action="store_true",
        help="As deepspeed --no_ssh_check: no ssh check of the first host.",
    )
    p.add_argument(
        "--python", default=sys.executable, help="Interpreter on every host (default: this one's path)."
    )
    p.add_argument("--no-checksums", action="store_true", help="Check shards exist, without hashing them.")
    p.add_argument("--no-allreduce", action="store_true", help="Skip the timed all-reduce.")
    p.add_argument(
        "--allreduce-mb", type=POSITIVE, help="All-reduce size (default 256 MiB on GPUs, 8 on CPUs)."
    )
    p.add_argument(
        "--timeout", type=POSITIVE, default=120, help="Seconds to wait for each host (default 120)."
    )

    p = sub.add_parser(
        "launch-env",
        help="Print (or write) the launch environment (.deepspeed_env) of a config: NCCL/gloo variables.",
    )
    _add_config_args(p)
    p.add_argument("-o", "--output", help="Write to this file instead of stdout.")

    p = sub.add_parser(
        "launch-check",
        help="Before a launch (launch/*.sh run it): every host the launcher ssh'es to answers ssh as "
        "DeepSpeed's launcher runs it, and rank 0 can listen on the master port. One line per problem "
        "(on stderr), then exit 2.",
    )
    p.add_argument("hostfile", metavar="HOSTFILE", help="DeepSpeed hostfile: '<host> slots=<N>' lines.")
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="deepspeed",
        help="Who starts the ranks: deepspeed --hostfile (pdsh over ssh to every host, launch/pdsh.sh; "
        "the default), Open MPI's mpirun (ssh to every other host), deepspeed --no_ssh on every host "
        "(no ssh), or srun (no ssh).",
    )
    p.add_argument(
        "--node-rank",
        type=NON_NEGATIVE,
        default=0,
        help="With --launcher no-ssh: this host's line in the hostfile, from 0. Node 0 checks the master "
        "port; the others check that the master's name resolves (its port opens when node 0 starts).",
    )
    p.add_argument("--include", default="", help="As deepspeed --include: NAME[:SLOT,...][@NAME...].")
    p.add_argument("--exclude", default="", help="As deepspeed --exclude.")
    p.add_argument("--ssh-port", type=PORT, help="ssh port, as deepspeed --ssh_port.")
    p.add_argument("--master-addr", help="Rank 0's address (default: the first host the launch uses).")
    p.add_argument("--master-port", type=PORT, default=29500, help="Rendezvous port (default 29500).")
    p.add_argument(
        "--script", default="launch-check", help="The name each line starts with (the launch script's)."
    )

    p = sub.add_parser("hostfile", help="Validate a hostfile; print it, its first host or its world size.")
    p.add_argument("path", help="DeepSpeed hostfile.")
    p.add_argument(
        "--first",
        action="store_true",
        help="Print only the first host (the master), of those --include/--exclude leave.",
    )
    p.add_argument("--include", default="", help="With --first: as deepspeed --include.")
    p.add_argument("--exclude", default="", help="With --first: as deepspeed --exclude.")
    p.add_argument("--world-size", action="store_true", help="Print only the total number of slots.")
    p.add_argument("--count", action="store_true", help="Print only the number of hosts.")


def _add_checkpoint_parsers(sub: Any) -> None:
    src_help = "A checkpoint (runs/X/checkpoints/step_N), or a run or checkpoints dir (its newest)."

    def reading_a_checkpoint(name: str, help: str) -> Any:
        parser = sub.add_parser(name, help=help)
        parser.add_argument("src", metavar="CHECKPOINT", help=src_help)
        return parser

    p = reading_a_checkpoint(
        "convert",
        "Write DeepSpeed's universal checkpoint of a ZeRO checkpoint (into CHECKPOINT/universal), "
        "so that `train --resume` can continue it on another world size.",
    )
    p.add_argument(
        "--workers",
        type=number(int, 1, high=1024),
        default=1,
        help="Parallel extract/merge processes (default 1).",
    )
    p.add_argument("--no-checksums", action="store_true", help="Check file sizes only, not their digests.")

    p = reading_a_checkpoint(
        "export",
        "Consolidated weights as safetensors, and a Hugging Face dir (model, tokenizer, generation "
        "config), from any ZeRO stage.",
    )
    p.add_argument(
        "--out", required=True, help="Output directory: new, empty, or a previous export (then replaced)."
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="Weights dtype (default fp32).")
    p.add_argument("--no-hf", action="store_true", help="Skip the Hugging Face directory (hf/).")
    p.add_argument("--tokenizer-path", help="Local gpt2.tiktoken, for GPT-2 BPE models trained offline.")
    p.add_argument(
        "--no-checksums",
        action="store_true",
        help="Check the checkpoint's file sizes only, not their digests.",
    )

    p = sub.add_parser("sample", help="Generate text from a checkpoint or an export.")
    p.add_argument("src", metavar="CHECKPOINT_OR_EXPORT", help=src_help + " Or an export dir.")
    p.add_argument(
        "--prompt",
        action="append",
        help="Text to continue (default: a newline). Repeat it for several prompts, generated in one "
        "batch and printed in order.",
    )
    p.add_argument(
        "--prompt-file",
        metavar="FILE",
        help="Prompts, one per line (UTF-8; an empty line is an empty prompt), instead of --prompt.",
    )
    p.add_argument(
        "--stop",
        action="append",
        type=stop,
        default=[],
        metavar="STR",
        help="End a sample where its text (after the prompt) first holds STR; STR is not printed. "
        "Repeatable: the first of them ends it.",
    )
    p.add_argument(
        "--no-kv-cache",
        action="store_true",
        help="Compute the whole context for every token, without the KV cache (the same text, slower).",
    )
    p.add_argument(
        "--max-new-tokens",
        type=COUNT,
        default=200,
        help="Tokens to generate per sample (default 200; at most 10,000,000 over all samples).",
    )
    p.add_argument(
        "--temperature",
        type=number(float, 0),
        default=0.8,
        help="Softmax temperature (default 0.8); 0: greedy, the likeliest token each step (as --greedy).",
    )
    p.add_argument(
        "--greedy",
        action="store_true",
        help="The likeliest token each step (--temperature 0): transformers' do_sample=False.",
    )
    p.add_argument(
        "--top-k", type=NON_NEGATIVE, default=200, help="Sample among the k likeliest; 0: all (default 200)."
    )
    p.add_argument(
        "--seed",
        type=seed,
        default=1337,
        help="Sampling seed, 0 to 2**64-1; sample i uses seed+i (default 1337).",
    )
    p.add_argument(
        "--num-samples",
        type=COUNT,
        default=1,
        help="Independent samples, made in batches and printed as each is done (default 1).",
    )
    p.add_argument("--device", default="cpu", help="torch device (default cpu).")
    p.add_argument("--tokenizer-path", help="Local gpt2.tiktoken, for GPT-2 BPE models trained offline.")
    p.add_argument(
        "--no-checksums",
        action="store_true",
        help="Check the checkpoint's file sizes only, not their digests.",
    )


def cmd_train(args: argparse.Namespace) -> int:
    if args.max_restarts is not None or args.nproc_per_node is not None:
        if "RANK" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
            if args.ds is None:
                _check_before_the_ranks(args)
            return supervise(
                args.argv[1:],  # after `train`: the top-level parser has no options of its own
                script=Path(__file__).resolve().parent / "main.py",
                nproc_per_node=args.nproc_per_node or 1,
                max_restarts=args.max_restarts or 0,
            )
    elif args.ds is None and (world := launcher_world_size()) is not None:
        # A typo in the config or a bad --set is reported now, in a fraction of a second, not after
        # torch and DeepSpeed have loaded (seconds). With a --ds JSON the check below runs
        # DeepSpeed's own validators too, so that one error lists every problem.
        _config(args, world, deepspeed=False)
    from pretrain.training.entry import run_rank  # torch and DeepSpeed: only for the commands that run them

    return run_rank(lambda world: _config(args, world), args.resume)


def _check_before_the_ranks(args: argparse.Namespace) -> None:
    """The supervisor's check of the config: every rank would refuse a bad one alike, so it is said
    here, once, before any starts. Its notes are rank 0's to say, unless with the error. (With a --ds
    JSON the ranks run DeepSpeed's validators too, so that one error lists every problem: not here.)"""
    notes = io.StringIO()
    try:
        with contextlib.redirect_stderr(notes):
            _config(args, args.nproc_per_node or 1, deepspeed=False)
    except PretrainError:
        sys.stderr.write(notes.getvalue())
        raise


def cmd_convert(args: argparse.Namespace) -> int:
    from pretrain.training.checkpoint.universal import convert_and_say  # torch, DeepSpeed

    print(convert_and_say(Path(args.src), workers=args.workers, checksums=not args.no_checksums))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pretrain.export import export  # torch

    info = export(
        Path(args.src),
        Path(args.out),
        dtype=args.dtype,
        hf=not args.no_hf,
        tokenizer_path=args.tokenizer_path,
        checksums=not args.no_checksums,
    )
    print(
        f"exported {info['source']} (step {info['step']}, {info['params'] / 1e6:.2f}M params, {args.dtype}) "
        f"to {info['out']}" + (f"; Hugging Face {info['hf']} dir {info['out'] / 'hf'}" if info["hf"] else "")
    )
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from pretrain.generate import print_samples  # torch

    print_samples(
        Path(args.src),
        prompt=args.prompt,
        prompt_file=args.prompt_file,
        max_new_tokens=args.max_new_tokens,
        temperature=0.0 if args.greedy else args.temperature,
        top_k=args.top_k or None,
        seed=args.seed,
        num_samples=args.num_samples,
        stop=args.stop,
        kv_cache=not args.no_kv_cache,
        device=args.device,
        tokenizer_path=args.tokenizer_path,
        checksums=not args.no_checksums,
    )
    return 0


def _add_prepare_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--force", action="store_true", help="Rebuild even if the dataset is already prepared.")
    p.add_argument(
        "--source",
        metavar="FILE",
        help="A local copy of a downloaded corpus (data.source), e.g. of tinyshakespeare: no network.",
    )
    p.add_argument("--workers", type=WORKERS, metavar="N", help="Worker processes (data.workers; 0: none).")


def cmd_prepare(args: argparse.Namespace) -> int:
    from pretrain.data.prepare import prepare_and_report  # numpy, tiktoken: per command, as above

    data = _config(args, None, deepspeed=False).data
    return prepare_and_report(data, source=args.source, workers=args.workers, force=args.force)


def cmd_render(args: argparse.Namespace) -> int:
    given = [
        flag
        for flag, value in (
            ("--check", args.check),
            ("--out-dir", args.out_dir),
            ("--preset", args.preset),
            ("--config", args.config),
            ("--ds", args.ds),
            ("--set", args.overrides),
            ("--world-size", args.world_size),
        )
        if value
    ]
    check_render_flags(all_files=args.all, given=given)
    if not args.all:
        cfg = _config(args, args.world_size or 1)
        _precision_note(cfg)
        print(render_json(cfg), end="")
        return 0
    report = render_all(Path(args.out_dir or "ds_configs"), check=args.check)
    print(report.message, file=sys.stderr if report.exit_code else sys.stdout)
    return report.exit_code


def cmd_config(args: argparse.Namespace) -> int:
    cfg = _config(args, args.world_size)
    _precision_note(cfg)
    print(to_yaml(cfg), end="")
    return 0


def _precision_note(cfg: RunConfig) -> None:
    """What the config's bf16 sums cost, on stderr (the output stays a valid config or JSON)."""
    b = cfg.batch
    note = cfg.precision.accumulation_note(b.gradient_accumulation_steps, b.data_parallel_size)
    if note:
        print(f"note: {note}", file=sys.stderr)


def cmd_presets(args: argparse.Namespace) -> int:
    from pretrain.config.tree import analytic_num_params
    from pretrain.data.dataset import tokenizer_vocab_size  # tiktoken, torch: per command, as above

    for name in PRESETS:
        cfg = build(name)
        m = cfg.model
        vocab = m.vocab_size or tokenizer_vocab_size(cfg.data)
        n = analytic_num_params(m.model_copy(update={"vocab_size": vocab}))
        heads = f"{m.n_head}/{m.kv_heads}" if m.kv_heads != m.n_head else str(m.n_head)
        print(
            f"{name:<12} {m.arch:<5} {m.n_layer:>3} layers {heads:>5} heads n_embd {m.n_embd:>5} "
            f"block {m.block_size:>5} vocab {vocab:>6} {cfg.data.tokenizer:<5} {n / 1e6:>9.2f}M params"
        )
    return 0


def cmd_fields(args: argparse.Namespace) -> int:
    print(reference_markdown(args.section) if args.markdown else reference_text(args.section), end="")
    return 0


def _renamed(args: argparse.Namespace, dest: str, old: str) -> Any:
    """The value of plan's `--gpu`/`--gpu-gb`, also taken under their old names (`--device` is a torch
    device in `sample`, so plan's GPU is `--gpu`), said once."""
    new, was = getattr(args, dest), getattr(args, "old_" + dest)
    flag = "--" + dest.replace("_", "-")
    if was is None:
        return new
    if new is not None and new != was:
        raise ConfigError(
            [f"{old} {was} and {flag} {new}: {old} is {flag}'s old name; give {flag} alone"], "plan arguments"
        )
    print(f"note: plan {old} is now {flag} (sample's --device is a torch device)", file=sys.stderr)
    return was


def cmd_plan(args: argparse.Namespace) -> int:
    from pretrain.plan.report import plan_json, render_plan
    from pretrain.plan.target import plan_inputs

    cfg, to, rates, vocab_src = plan_inputs(
        config_file=args.config_file,
        preset=args.preset,
        config=args.config,
        ds=args.ds,
        overrides=args.overrides,
        hostfile=args.hostfile,
        world_size=args.world_size,
        gpus_per_node=args.gpus_per_node,
        device=_renamed(args, "gpu", "--device"),
        device_gb=_renamed(args, "gpu_gb", "--device-gb"),
        host_gb=args.host_gb,
        peak_tflops=args.peak_tflops,
        mfu=args.mfu,
        busbw=args.busbw,
        node_busbw=args.node_busbw,
        from_run=args.from_run,
    )
    if args.json:
        print(json.dumps(plan_json(cfg, to, rates, search=args.layouts), indent=2))
        return 0
    print(render_plan(cfg, to, rates, search=args.layouts))
    print(f"(vocab {cfg.model.vocab_size} from {vocab_src})")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from pretrain.plot import plot_run  # matplotlib

    out = plot_run(Path(args.run_dir), args.out, report=lambda line: print(line, file=sys.stderr))
    print(f"wrote {out}")
    return 0


def cmd_preflight(args: argparse.Namespace) -> int:
    from pretrain.preflight import Options, format_report, preflight, save_allreduce  # numpy, tiktoken

    hosts = read_hostfile(args.hostfile)
    cfg = _config(args, world_size(hosts))
    # train's --resume, among the train arguments passed on: the checkpoint it would load is checked.
    resume = argparse.ArgumentParser(add_help=False)
    resume.add_argument("--resume", nargs="?", const="auto")
    opts = Options(
        resume=resume.parse_known_args(args.unknown)[0].resume,
        hostfile=args.hostfile,
        hosts=hosts,
        python=args.python,
        master_addr=args.master_addr,
        master_port=args.master_port,
        ssh_port=args.ssh_port,
        no_ssh=args.no_ssh,
        no_ssh_check=args.no_ssh_check,
        checksums=not args.no_checksums,
        allreduce=not args.no_allreduce,
        allreduce_mb=args.allreduce_mb,
        timeout_s=args.timeout,
    )
    report = preflight(cfg, opts)
    print(format_report(report), flush=True)
    save_allreduce(report, cfg.run_dir(), args.hostfile)  # for `pretrain plan`'s communication time
    return 1 if report.problems else 0


def cmd_launch_env(args: argparse.Namespace) -> int:
    env = launch_environment(_config(args, None, deepspeed=False).launch)
    if args.output:
        write_env_file(Path(args.output), env)
    else:
        print(env_file_text(env), end="")
    return 0


def cmd_launch_check(args: argparse.Namespace) -> int:
    if args.master_addr is not None and not valid_host(args.master_addr):
        print(
            f"{args.script}: MASTER_ADDR='{args.master_addr}' is not a host name or address", file=sys.stderr
        )
        return 2
    if args.node_rank and args.launcher != "no-ssh":  # only deepspeed --no_ssh takes a node rank
        print(
            f"{args.script}: --node-rank {args.node_rank} is for --launcher no-ssh only (deepspeed --no_ssh): "
            "add --launcher no-ssh, or leave --node-rank out",
            file=sys.stderr,
        )
        return 2
    launch = Launch(
        hostfile=args.hostfile,
        hosts=read_hostfile(args.hostfile),
        launcher=args.launcher,
        master_addr=args.master_addr,
        master_port=args.master_port,
        ssh_port=args.ssh_port,
        include=args.include,
        exclude=args.exclude,
        node_rank=args.node_rank,
    )
    problems, notes = check_launch(launch)
    for line in problems or ([f"checked: {', '.join(notes)}"] if notes else []):
        print(f"{args.script}: {line}", file=sys.stderr)
    return 2 if problems else 0


def cmd_hostfile(args: argparse.Namespace) -> int:
    hosts = read_hostfile(args.path)
    if args.first:
        active, problems = filter_hosts(hosts, args.include, args.exclude)
        if problems:
            raise ConfigError(problems, "INCLUDE/EXCLUDE")
        print(active[0])
    elif args.world_size:
        print(world_size(hosts))
    elif args.count:
        print(len(hosts))
    else:
        print(format_hostfile(hosts), end="")
        # The verdict beside the hostfile itself, which stdout keeps exactly (it is a hostfile).
        n = len(hosts)
        print(
            f"{args.path}: {n} host{'s' if n != 1 else ''}, {world_size(hosts)} slots, valid", file=sys.stderr
        )
    return 0


# The commands that import DeepSpeed (or start ranks that do): the environment it reads is checked first.
DEEPSPEED_COMMANDS = {"train", "render", "convert", "export", "sample", "preflight", "plan"}

COMMANDS = {
    "train": cmd_train,
    "prepare": cmd_prepare,
    "data": cmd_prepare,  # its one subcommand, `data prepare`
    "render": cmd_render,
    "config": cmd_config,
    "presets": cmd_presets,
    "fields": cmd_fields,
    "convert": cmd_convert,
    "export": cmd_export,
    "sample": cmd_sample,
    "preflight": cmd_preflight,
    "launch-env": cmd_launch_env,
    "launch-check": cmd_launch_check,
    "hostfile": cmd_hostfile,
    "plan": cmd_plan,
    "plot": cmd_plot,
}


def main(argv: list[str] | None = None) -> int:
    deepspeed_logs_to_stderr()
    # torch deprecates collectives DeepSpeed still calls (all_gather_into_tensor, ...): a FutureWarning
    # on every rank at every start, about nothing a user of pretrain can change.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.c10d_logger")
    ap = parser()
    args, unknown = ap.parse_known_args(argv)
    # launch-env and preflight take `train`'s arguments (launch/*.sh pass them on), whatever they are.
    if unknown and args.command not in ("launch-env", "preflight"):
        ap.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown = unknown
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `train` passes its own on to the ranks
    try:
        if args.command in DEEPSPEED_COMMANDS:
            environment.check()
        return COMMANDS[args.command](args)
    except PretrainError as e:
        # A person's mistake, or the machine's (a full disk): one message, no traceback. Raised on
        # every rank alike (collective), printed by rank 0; or by the one rank that saw it.
        # Under `train --nproc-per-node`/`--max-restarts`: not to be retried, unless another rank died
        # (a restart is for that); the supervisor prints it once torchrun has stopped every rank.
        rank = os.environ.get("RANK", "0")
        refused = os.environ.get(REFUSED_FILE, "")
        supervised = refused and not isinstance(e, RankLostError) and rank.isdigit()
        if supervised and refuse(refused, rank=int(rank), message=str(e), collective=e.collective):
            return 2
        if rank == "0" or not e.collective:
            print(f"error: {e}" if rank == "0" else f"error (rank {rank}): {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C where nothing asks for a clean stop (a second Ctrl-C in `train`, which saves on the
        # first; any other command): one line, the shell's exit status for SIGINT.
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            what = (
                "stopped at once, without saving; `--resume` continues from the newest checkpoint"
                if args.command == "train"
                else "stopped; what it had not finished is not written"
            )
            print(f"\ninterrupted (Ctrl-C): {what}", file=sys.stderr)
        return 128 + signal.SIGINT
    except OSError as e:
        # A path that cannot be read or written (permissions, a full disk, a file where a directory
        # should be) that no check above named: still the machine's or a person's, still one line.
        where = f"{e.filename}: " if e.filename else ""
        rank = os.environ.get("RANK", "0")
        print(f"error{'' if rank == '0' else f' (rank {rank})'}: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
