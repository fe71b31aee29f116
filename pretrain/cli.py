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
import logging
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.cluster.launch import (
    env_file_text,
    format_hostfile,
    hostfile_target,
    launch_environment,
    launcher_world_size,
    read_hostfile,
    valid_host,
    world_size,
)
from pretrain.cluster.reach import LAUNCHERS, Launch, filter_hosts, is_this_machine
from pretrain.cluster.reach import check as check_launch
from pretrain.cluster.supervise import REFUSED_FILE, refuse, restart_count, supervise
from pretrain.config.ds_keys import RECORD
from pretrain.config.ds_render import check_with_deepspeed, render_deepspeed
from pretrain.config.presets import DS_CONFIG_RENDERS, PRESETS, build, build_checked
from pretrain.config.tree import RunConfig, to_yaml
from pretrain.errors import ConfigError, DataError, OutputError, PretrainError, RankLostError
from pretrain.files import make_dir, not_ours, read_bytes, write_atomic

if TYPE_CHECKING:
    from pretrain.cluster.plan import Rates, Target
    from pretrain.training.engine import Dist


def _number(
    kind: type[int] | type[float],
    low: float,
    *,
    above: bool = False,
    high: float | None = None,
    finite: bool = False,
) -> Any:
    """An argparse type: a `kind` number at least `low` (above it with `above`), at most `high`,
    and not infinite with `finite`. A bad value is argparse's one-line error (exit 2), naming the
    flag and the range."""
    bound = f"{'above' if above else 'at least'} {low:g}" + (
        f" and at most {high:g}" if kind is float and high is not None
        else f" and at most {int(high)}" if high is not None else ""
    )  # fmt: skip
    noun = "a whole number" if kind is int else "a finite number" if finite else "a number"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        out = value < low or (above and value == low) or (high is not None and value > high)
        if value != value or out or (finite and abs(value) == float("inf")):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {noun} {bound}")
        return value

    return parse


COUNT = _number(int, 1)  # ranks, workers, samples, tokens
NON_NEGATIVE = _number(int, 0)  # restarts, seeds, top-k (0: all)
PORT = _number(int, 1, high=65535)
POSITIVE = _number(float, 0, above=True)  # sizes, seconds, rates, temperature
FRACTION = _number(float, 0, above=True, high=1)
WORKERS = _number(int, 0, high=1024)  # processes on one machine
# The ranks of one job, for plans and renders: 2**20, well past the largest clusters built.
WORLD = _number(int, 1, high=2**20)
MEASURE = _number(float, 0, above=True, finite=True)  # a plan's sizes, peaks and bandwidths


def HOST(text: str) -> str:
    """A host name or IPv4 address, as a hostfile takes them (no shell metacharacters)."""
    if not valid_host(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a host name or address (letters, digits, '.', '-' and '_' only)"
        )
    return text


class Once(argparse.Action):
    """An option that takes one value: given twice, it is an error naming both, not the last one
    silently (`--config a.yaml --config b.yaml` would drop a.yaml)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            parser.error(
                f"{option_string} given twice ({given!r}, then {values!r}): give it once; "
                + ("layer files with --set KEY=VALUE or one --config that holds both" if self.dest != "preset"
                   else "a run starts from one preset; change its fields with --set KEY=VALUE")
            )  # fmt: skip
        setattr(namespace, self.dest, values)


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

    p = sub.add_parser("config", help="Print the resolved run config as YAML.")
    _add_config_args(p)
    p.add_argument("--world-size", type=COUNT, default=None, help="Resolve the batch for this world size.")

    sub.add_parser("presets", help="List the presets and their parameter counts.")
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
        "--device-gb",
        type=MEASURE,
        help="Memory of one rank's device in GB (default: the device's name, the hostfile's line, else this "
        "machine's).",
    )
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
        "--device",
        help="The GPU, for its datasheet peak and, where the name says it (A100-80GB) or the GPU comes in "
        "one size (H100), its memory; or 'cpu'.",
    )
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


def _seed(text: str) -> int:
    """--seed: a whole number torch's generators take, 0 to 2**64 - 1."""
    value = int(NON_NEGATIVE(text))
    if value > 2**64 - 1:
        raise argparse.ArgumentTypeError(
            f"{text} is out of range: a whole number from 0 to 2**64 - 1 ({2**64 - 1})"
        )
    return value


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
        type=_number(int, 1, high=1024),
        default=1,
        help="Parallel extract/merge processes (default 1).",
    )
    p.add_argument("--no-checksums", action="store_true", help="Check file sizes only, not sha256.")

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
        "--no-checksums", action="store_true", help="Check the checkpoint's file sizes only, not sha256."
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
        type=_stop,
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
    p.add_argument("--temperature", type=POSITIVE, default=0.8, help="Softmax temperature (default 0.8).")
    p.add_argument(
        "--top-k", type=NON_NEGATIVE, default=200, help="Sample among the k likeliest; 0: all (default 200)."
    )
    p.add_argument(
        "--seed",
        type=_seed,
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
        "--no-checksums", action="store_true", help="Check the checkpoint's file sizes only, not sha256."
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
    import torch.distributed as tdist  # torch and DeepSpeed: only for the commands that run them

    from pretrain.training import engine
    from pretrain.training.loop import train

    dist = engine.launch_env()
    cfg = _config(args, dist.world_size)
    engine.init_distributed(dist, timeout_s=cfg.launch.collective_timeout_s)
    _prepare_on_rank_0(cfg, dist)
    try:
        result = train(cfg, dist, resume=_resume(args.resume, cfg))
    except PretrainError:
        # Every rank raises it alike; tear the groups down here, or gloo's threads abort at exit.
        tdist.destroy_process_group()
        raise
    except RuntimeError as e:  # gloo's or NCCL's own error when another rank is gone: say which
        from pretrain.training.guards import lost_rank

        said = lost_rank(e, dist.rank)
        if said is None:
            raise
        raise RankLostError(said) from e
    if result.val_loss is not None and result.stopped_by is None and result.ended_by != "max_hours":
        dist.log(f"done: step {result.final_step}, val loss {result.val_loss:.4f}, run dir {cfg.run_dir()}")
    tdist.barrier()
    tdist.destroy_process_group()
    if result.stopped_by is not None:
        return 128 + int(getattr(signal, result.stopped_by))
    return 0


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


def _prepare_on_rank_0(cfg: RunConfig, dist: Dist) -> None:
    """Rank 0 prepares the dataset if needed; the others wait and learn whether it worked."""
    import torch.distributed as tdist

    from pretrain.data.dataset import MANIFEST
    from pretrain.data.prepare import prepare

    error: list[str | None] = [None]
    if dist.is_main:
        if not cfg.data.blend and not (cfg.data.resolved_dir() / MANIFEST).is_file():
            dist.log(f"preparing {cfg.data.corpus} ({cfg.data.tokenizer}) into {cfg.data.resolved_dir()}")
        try:
            prepare(cfg.data)
        except DataError as e:
            error = [str(e)]
    tdist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise DataError(error[0])


def _resume(resume: str | None, cfg: RunConfig) -> str | None:
    """--resume, or "auto" where this start is a restart after a failure (train --max-restarts,
    torchrun, a requeued Slurm job): it continues from the newest checkpoint."""
    from pretrain.training.checkpoint import committed_tags

    if restart_count() > 0 and (
        resume in (None, "auto") or committed_tags(cfg.run_dir() / cfg.checkpoint.dir)[0]
    ):
        return "auto"
    return resume


def cmd_convert(args: argparse.Namespace) -> int:
    from pretrain.training.checkpoint import convert_to_universal, read_meta, saved_layout  # torch, DeepSpeed

    out, wrote = convert_to_universal(Path(args.src), workers=args.workers, checksums=not args.no_checksums)
    pipeline = saved_layout(read_meta(out))[1]
    # A pipeline's parameters are named by stage layer, the GPT's by module: it resumes as a pipeline only.
    where = "on any world size" if pipeline == 1 else f"on any world size with parallel.pipeline={pipeline}"
    print(
        f"{'wrote the universal checkpoint' if wrote else 'already converted, and sound:'} {out}\n"
        f"`pretrain train --resume auto` (same run dir) now continues it {where}; or pass --resume {out}"
    )
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


def _stop(text: str) -> str:
    """--stop's argparse type: a string that can end a sample (an empty one would end each at once)."""
    if not text:
        raise argparse.ArgumentTypeError(
            "an empty stop string would end every sample before its first token: give the text that "
            "ends a sample, e.g. --stop $'\\n\\n'"
        )
    return text


def _prompts(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """--prompt's texts, or --prompt-file's lines, with the names an error gives them (None: `--prompt
    N`); a newline without either."""
    if args.prompt_file is None:
        return args.prompt or ["\n"], None
    if args.prompt:
        raise ConfigError(
            ["--prompt and --prompt-file both given: give the prompts one way (--prompt for each, or "
             "one per line in --prompt-file)"],
            "sample",
        )  # fmt: skip
    path = Path(args.prompt_file)
    fix = "give a text file of prompts, one per line"
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file" if not path.exists() else "not a file"
        raise ConfigError([f"--prompt-file {path}: {what}; {fix}"], "sample")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([f"--prompt-file {path}: not UTF-8 text ({e}); save it as UTF-8"], "sample") from e
    except OSError as e:
        raise ConfigError(
            [f"--prompt-file {path}: cannot read it ({e.strerror or e}); {fix}"], "sample"
        ) from e
    prompts = text.splitlines()
    if not prompts:
        raise ConfigError([f"--prompt-file {path}: empty; write one prompt per line"], "sample")
    return prompts, [f"--prompt-file {path}, line {i}" for i in range(1, len(prompts) + 1)]


def cmd_sample(args: argparse.Namespace) -> int:
    from pretrain.export import MAX_SAMPLE_TOKENS, SampleCount, load_model, stream_samples, tokenizer_for

    prompts, names = _prompts(args)
    if len(prompts) * args.num_samples * args.max_new_tokens > MAX_SAMPLE_TOKENS:
        many = f"{len(prompts)} prompts x " if len(prompts) > 1 else ""
        raise ConfigError(
            [
                f"{many}--num-samples {args.num_samples} x --max-new-tokens {args.max_new_tokens} = "
                f"{len(prompts) * args.num_samples * args.max_new_tokens:,} tokens: more than one `sample` "
                f"makes ({MAX_SAMPLE_TOKENS:,}); ask for fewer, or run it several times with other "
                "--seed values" + (" or prompts" if many else "")
            ],
            "sample",
        )
    _check_device(args.device)
    model, cfg, where = load_model(Path(args.src), device=args.device, checksums=not args.no_checksums)
    tokenizer = tokenizer_for(where, cfg, args.tokenizer_path)
    count = SampleCount()
    samples = stream_samples(
        model,
        tokenizer,
        prompts,
        args.max_new_tokens,
        args.temperature,
        args.top_k or None,
        args.seed,
        args.num_samples,
        stop=args.stop,
        kv_cache=not args.no_kv_cache,
        count=count,
        prompt_names=names,
    )
    current = -1
    start = time.perf_counter()
    try:
        for i, piece in samples:  # printed as it comes: a sample made alone, token by token
            if i != current:
                if current >= 0:
                    sys.stdout.write("\n")
                p, n = divmod(i, args.num_samples)  # prompt p's sample n
                heads = [f"prompt {p + 1}"] * (len(prompts) > 1)
                heads += [f"sample {n + 1}"] * (args.num_samples > 1)
                if heads:
                    sys.stdout.write(f"--- {', '.join(heads)} ---\n")
                current = i
            sys.stdout.write(piece)
            sys.stdout.flush()
        print(flush=True)
    except BrokenPipeError:  # `pretrain sample ... | head`: the reader has what it wanted
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    except RuntimeError as e:  # out of memory on the device (torch.OutOfMemoryError) or the host
        if "out of memory" not in str(e) and "can't allocate memory" not in str(e):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(
            [f"--device {args.device}: out of memory generating ({first}); ask for fewer --num-samples"],
            "sample",
        ) from e
    seconds = time.perf_counter() - start
    print(
        f"{count.tokens:,} tokens in {seconds:.2f} s: {count.tokens / max(seconds, 1e-9):,.1f} tokens/s "
        f"({'without' if args.no_kv_cache else 'with'} the KV cache, --device {args.device})",
        file=sys.stderr,
    )
    return 0


def _check_device(name: str) -> None:
    """--device names a device this machine has, that computes ('meta' holds no values)."""
    import torch

    try:
        device = torch.device(name)
        if device.type == "meta":
            raise ValueError("the meta device holds shapes, not values")
        torch.empty(0, device=device)
    except Exception as e:  # RuntimeError, NotImplementedError, AssertionError, ImportError: per backend
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        cuda = (
            f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA device"
        )
        raise ConfigError(
            [f"--device {name!r}: not usable here ({first}); this machine has {cuda}; try --device cpu"]
        ) from e


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
    from pretrain.data.dataset import load_manifest, summary  # numpy, tiktoken: per command, as above
    from pretrain.data.prepare import STUCK_POOL, Interrupted, format_report, prepare

    cfg = _config(args, None, deepspeed=False)
    data = cfg.data
    if args.source is not None or args.workers is not None:
        update = {
            "source": args.source or data.source,
            "workers": data.workers if args.workers is None else args.workers,
        }
        data = type(data).model_validate({**data.model_dump(), **update})

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        # Another prepare of this directory: refused at once here (`train` waits for it).
        out = prepare(data, force=args.force, log=log, wait=False)
    except Interrupted as e:  # SIGINT or SIGTERM: workers stopped, staging removed, lock released; one line
        print(e, file=sys.stderr, flush=True)
        if STUCK_POOL:  # the exit's join of a pool stopped mid-task would wait forever (CPython gh-94777)
            sys.stdout.flush()
            os._exit(128 + e.signum)
        return 128 + e.signum
    m = load_manifest(out)
    if not data.blend:
        print(format_report(m["report"]))
    print(f"dataset ready in {out}: {summary(m)}")
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    if not args.all:
        only_all = [flag for flag, given in (("--check", args.check), ("--out-dir", args.out_dir)) if given]
        if only_all:
            raise ConfigError(
                [
                    f"{' and '.join(only_all)} {'apply' if len(only_all) > 1 else 'applies'} only with --all "
                    "(which renders every file of ds_configs/): add --all, or drop "
                    f"{'them' if len(only_all) > 1 else 'it'} to print this config's JSON"
                ],
                "render",
            )
        cfg = _config(args, args.world_size or 1)
        _precision_note(cfg)
        print(_render_json(cfg), end="")
        return 0
    config_args = [
        flag
        for flag, given in (
            ("--preset", args.preset),
            ("--config", args.config),
            ("--ds", args.ds),
            ("--set", args.overrides),
            ("--world-size", args.world_size),
        )
        if given
    ]
    if config_args:
        raise ConfigError(
            [
                f"--all renders each file of ds_configs/ from its own preset, overrides and world size, so "
                f"{', '.join(config_args)} would be ignored: drop {'them' if len(config_args) > 1 else 'it'}, "
                "or drop --all to print the JSON of this config"
            ],
            "render",
        )
    out_dir = Path(args.out_dir or "ds_configs")
    stale, texts = [], {}
    for name, (preset, overrides, world) in DS_CONFIG_RENDERS.items():
        text = render_file(preset, overrides, world)
        path = out_dir / f"{name}.json"
        if read_bytes(path) == text.encode():
            continue
        stale.append(str(path))
        texts[path] = text
    if not args.check:
        # Only into a directory of this command's files: a DeepSpeed JSON of another project kept under
        # one of these names, or any other file (`--out-dir /`, a home directory), is refused, never
        # lost or mixed with ours.
        foreign = _not_rendered(out_dir)
        if foreign:
            listed = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
            raise OutputError(
                f"--out-dir {out_dir}: {listed} not written by `pretrain render`; refusing to write there: "
                "move them away or choose another --out-dir (a new directory, or one of render's)"
            )
        make_dir(out_dir, "--out-dir", OutputError)
        for path, text in texts.items():
            write_atomic(path, text)
    if args.check and stale:
        print("out of date (run `pretrain render --all`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(
        f"{'checked' if args.check else 'wrote'} {len(DS_CONFIG_RENDERS)} files in {out_dir}"
        + (f" ({len(stale)} changed)" if stale and not args.check else "")
    )
    return 0


def _not_rendered(out_dir: Path) -> list[str]:
    """What the directory `out_dir` holds that `render --all` did not write: anything but its JSONs
    (by content, not by name) and the temporary file of a write that was killed."""
    if not out_dir.is_dir():
        return []  # none yet; or a file, which make_dir names
    foreign = []
    for entry in sorted(out_dir.iterdir()):
        if re.fullmatch(r".+\.json\.tmp-\d+", entry.name) and entry.is_file():
            continue
        data = read_bytes(entry) if entry.name.endswith(".json") else None
        if data is None or not _is_render(data):
            foreign.append(str(entry))
    return foreign


def _is_render(data: bytes) -> bool:
    """A DeepSpeed JSON `pretrain render` wrote: it carries our record of the run config."""
    try:
        ds = json.loads(data)
    except ValueError:
        return False
    return isinstance(ds, dict) and isinstance(ds.get(RECORD), dict)


def render_file(preset: str, overrides: list[str], world_size: int) -> str:
    """One file of ds_configs/ (DS_CONFIG_RENDERS), as `render --all` writes it."""
    return _render_json(build(preset, overrides=overrides, world_size=world_size))


def _render_json(cfg: RunConfig) -> str:
    """The DeepSpeed JSON of `cfg`, checked by DeepSpeed's own parser."""
    ds = render_deepspeed(cfg)
    check_with_deepspeed(ds)
    return json.dumps(ds, indent=2) + "\n"


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


def plan_target(
    args: argparse.Namespace,
    target: dict[str, str | float],
    where: str,
    world: int,
    per_node: int | None,
    *,
    remote: bool,
) -> tuple[Target, str | None]:
    """What `plan` plans for, and the device named for it: the flags first, then the hostfile's
    `# pretrain:` line, else this machine, said so when the hostfile's hosts are other machines."""
    from pretrain.cluster.hardware import gpu_memory_gb
    from pretrain.cluster.plan import Target, default_device_gb, host_memory_gb

    device = args.device or (str(target["device"]) if "device" in target else None)
    named_by = "--device" if args.device else where
    named = gpu_memory_gb(device) if device and device != "cpu" else None
    if args.device_gb:
        device_gb, device_src = args.device_gb, "--device-gb"
    elif "device-gb" in target:
        device_gb, device_src = float(target["device-gb"]), f"{where}: device-gb"
    elif named is not None:
        device_gb, device_src = named, f"{named_by}: {device}"
    elif device and device != "cpu":
        raise ConfigError(
            [f"{named_by}: {device} does not say its memory (an A100 comes in 40 and 80 GB): name it as "
             f"{device}-80GB, or pass --device-gb"], "plan",
        )  # fmt: skip
    else:
        device_gb, device_src = default_device_gb(world)
    if args.host_gb:
        host_gb: float | None = args.host_gb
    elif "host-gb" in target:
        host_gb = float(target["host-gb"])
    else:
        host_gb = host_memory_gb() if device is None or device == "cpu" or not remote else None
    note = ""
    if device is None and args.peak_tflops is None and (remote or (not args.hostfile and args.device_gb)):
        said = f"{args.hostfile} does not say what its hosts are" if remote else "no --device names the GPU"
        note = (
            f"planning step time for this machine's device, and memory for {device_src}: {said}. Pass --device "
            "(e.g. --device A100-80GB --host-gb 1024)"
            + (
                ", or add a line '# pretrain: device=A100-80GB host-gb=1024' to the hostfile."
                if remote
                else "."
            )
        )
    elif device is not None and host_gb is None:
        note = f"host memory unknown: pass --host-gb, or add host-gb=<GB> to {args.hostfile or 'the hostfile'}'s '# pretrain:' line."
    return Target(world, per_node, device_gb, device_src, host_gb, note, device), device


def plan_inputs(args: argparse.Namespace) -> tuple[RunConfig, Target, Rates, str]:
    """`plan`'s config, target and rates from its arguments, and where the vocabulary came from."""
    from pretrain.cluster.plan import resolve_rates
    from pretrain.data.dataset import resolve_vocab, vocab_size  # tiktoken, torch: per command, as above

    if args.config_file in PRESETS and not Path(args.config_file).is_file():
        if args.preset not in (None, args.config_file):
            raise ConfigError(
                [
                    f"two presets, {args.config_file} and --preset {args.preset}: give one (its fields change with --set)"
                ],
                "plan",
            )
        args.preset, args.config_file = args.config_file, None  # `pretrain plan gpt2-124m`
    if args.config_file:
        if args.config:
            raise ConfigError(["pass the run config either as CONFIG or as --config, not both"], "plan")
        args.config = args.config_file
    world, per_node = args.world_size or 1, args.gpus_per_node
    target: dict[str, str | float] = {}
    remote, where = False, ""
    if args.hostfile:
        hosts = read_hostfile(args.hostfile)
        if args.world_size not in (None, world_size(hosts)):
            raise ConfigError(
                [f"--world-size {args.world_size}, but {args.hostfile} has {world_size(hosts)} slots"], "plan"
            )
        world, per_node = world_size(hosts), per_node or max(hosts.values())
        target, where = hostfile_target(args.hostfile)
        remote = not all(is_this_machine(h) for h in hosts)
    cfg = _config(args, world)
    vocab, vocab_src = vocab_size(cfg)
    cfg = resolve_vocab(cfg, vocab)
    to, device = plan_target(args, target, where, world, per_node, remote=remote)
    rates = resolve_rates(
        cfg,
        world,
        per_node or min(world, 8),
        device=device,
        device_src=where if device and not args.device else "",
        peak_tflops=args.peak_tflops,
        mfu=args.mfu,
        busbw_gbs=args.busbw,
        node_busbw_gbs=args.node_busbw,
        from_runs=[Path(r) for r in args.from_run or []],
    )
    return cfg, to, rates, vocab_src


def cmd_plan(args: argparse.Namespace) -> int:
    from pretrain.cluster.plan import plan_json, render_plan

    cfg, to, rates, vocab_src = plan_inputs(args)
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
    from pretrain.preflight import Options, format_report, preflight  # numpy, tiktoken

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
    if report.allreduce:  # for `pretrain plan`'s communication time
        from pretrain.cluster.plan import PREFLIGHT_FILE  # torch, which preflight has loaded already

        cfg.run_dir().mkdir(parents=True, exist_ok=True)
        text = json.dumps({"hostfile": args.hostfile, "allreduce": report.allreduce}, indent=1) + "\n"
        write_atomic(cfg.run_dir() / PREFLIGHT_FILE, text)
    return 1 if report.problems else 0


def cmd_launch_env(args: argparse.Namespace) -> int:
    env = launch_environment(_config(args, None, deepspeed=False).launch)
    text = env_file_text(env)
    if args.output:
        out = Path(args.output)
        # Rewritten only where it holds no more than this command writes: other settings are kept.
        ours = set(env)

        def lost(data: bytes) -> list[str]:
            theirs = {line.split("=", 1)[0].strip() for line in data.decode(errors="replace").splitlines()}
            return sorted(k for k in theirs - ours if k)

        if not_ours([out], lambda data: not lost(data)):
            old = read_bytes(out)
            what = (
                f"settings this command does not write ({', '.join(lost(old)[:4])})" if old else "no env file"
            )
            raise OutputError(
                f"--output {out}: holds {what}; refusing to overwrite it: choose another file, or add these "
                f"lines to it yourself:\n{text}"
            )
        write_atomic(out, text)
    else:
        print(text, end="")
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
    return 0


COMMANDS = {
    "train": cmd_train,
    "prepare": cmd_prepare,
    "data": cmd_prepare,  # its one subcommand, `data prepare`
    "render": cmd_render,
    "config": cmd_config,
    "presets": cmd_presets,
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


class _Stderr:
    """Whatever sys.stderr is when a line is written (a caller may have redirected it since)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _to_stderr(handler: logging.Handler) -> None:
    if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
        handler.setStream(_Stderr())


class _StderrLogger(logging.Logger):
    """A logger whose handlers on stdout write to stderr instead."""

    def addHandler(self, hdlr: logging.Handler) -> None:
        _to_stderr(hdlr)
        super().addHandler(hdlr)


def deepspeed_logs_to_stderr() -> None:
    """DeepSpeed's log lines ("Setting accelerator to CPU", its warnings) go to stderr: stdout is the
    commands' own output, which for `render`, `config` and `plan --json` is exactly JSON or YAML.

    DeepSpeed gives its logger a handler on sys.stdout when it is first imported; the logger is made
    here first, before any command imports DeepSpeed (this imports neither torch nor DeepSpeed), of
    a class that turns such a handler to stderr. Where DeepSpeed is loaded already, its handlers are
    turned now."""
    made = logging.getLoggerClass()
    logging.setLoggerClass(_StderrLogger)
    try:
        log = logging.getLogger("DeepSpeed")  # deepspeed/utils/logging.py's name
    finally:
        logging.setLoggerClass(made)
    for h in log.handlers:
        _to_stderr(h)
    if not any(isinstance(f, _NoCpuFallbackWarning) for f in log.filters):
        log.addFilter(_NoCpuFallbackWarning())


class _NoCpuFallbackWarning(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU. If you have GPU ... we were unable to detect
    it" on a machine with no GPU device to detect, where every command would print it for nothing. Where
    the machine has one (a CPU-only torch on a GPU host), the warning says something and stays."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Setting accelerator to CPU"):
            return True
        return any(Path("/dev").glob("nvidia[0-9]*")) or Path("/dev/kfd").exists()  # NVIDIA, ROCm


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
