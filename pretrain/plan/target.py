"""What a plan is for, from `pretrain plan`'s arguments: its config, ranks, memory and rates.

The ranks and the memory of a rank's device and a node's host (`Target`) come from the flags first,
then the hostfile's `# pretrain:` line, else this machine; `plan_inputs` gathers them with the
config and the step-time rates (`rates.resolve_rates`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.cluster import launch
from pretrain.cluster.hardware import gpu_memory_gb
from pretrain.cluster.reach import is_this_machine
from pretrain.cluster.supervise import restart_count
from pretrain.config.presets import PRESETS, build_checked
from pretrain.config.tree import RunConfig
from pretrain.data.dataset import resolve_vocab, vocab_size
from pretrain.errors import ConfigError
from pretrain.plan.memory import GB
from pretrain.plan.rates import resolve_rates
from pretrain.plan.timing import Rates


@dataclass
class Target:
    """What a plan is for: the ranks, and the memory of a rank's device and of a node's host."""

    world: int
    ranks_per_node: int | None = None  # default: min(world, 8)
    device_gb: float | None = None
    device_src: str = ""
    host_gb: float | None = None
    note: str = ""  # what the plan could not know about the target, and the flag that tells it
    device: str | None = None  # the device named (a GPU, or 'cpu'); None: this machine's

    @property
    def on_cpu(self) -> bool:
        """Whether the ranks run on CPUs, whose device memory is the host's (as `resolve_rates` decides)."""
        return self.device == "cpu" or (self.device is None and not torch.cuda.is_available())


def default_device_gb(world: int) -> tuple[float | None, str]:
    """One rank's memory here: the first GPU's, or on a CPU this host's RAM shared by the ranks."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GB, f"{props.name}"
    total = host_memory_gb()
    if total is None:
        return None, "unknown (pass --gpu-gb)"
    return total / world, f"host RAM {total:.1f} GB / {world} CPU ranks"


def host_memory_gb() -> float | None:
    """This machine's RAM."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return None


def plan_inputs(
    *,
    config_file: str | None,
    preset: str | None,
    config: str | None,
    ds: str | None,
    overrides: list[str],
    hostfile: str | None,
    world_size: int | None,
    gpus_per_node: int | None,
    device: str | None,
    device_gb: float | None,
    host_gb: float | None,
    peak_tflops: float | None,
    mfu: float | None,
    busbw: float | None,
    node_busbw: float | None,
    from_run: list[str] | None,
) -> tuple[RunConfig, Target, Rates, str]:
    """`plan`'s config, target and rates from its arguments (as `pretrain plan` names them), and where
    the vocabulary came from. `config_file` is the CONFIG argument: a config file, or a preset name."""
    preset, config = _config_source(config_file, preset, config)
    world, per_node = world_size or 1, gpus_per_node
    target: dict[str, str | float] = {}
    remote, where = False, ""
    if hostfile:
        hosts = launch.read_hostfile(hostfile)
        if world_size not in (None, launch.world_size(hosts)):
            raise ConfigError(
                [f"--world-size {world_size}, but {hostfile} has {launch.world_size(hosts)} slots"], "plan"
            )
        world, per_node = launch.world_size(hosts), per_node or max(hosts.values())
        target, where = launch.hostfile_target(hostfile)
        remote = not all(is_this_machine(h) for h in hosts)
    # as the CLI builds every command's config: a supervised restart counts as a resume
    cfg = build_checked(
        ds,
        preset=preset,
        config_file=config,
        overrides=overrides,
        world_size=world,
        resume=restart_count() > 0,
    )
    vocab, vocab_src = vocab_size(cfg)
    cfg = resolve_vocab(cfg, vocab)
    to, named = plan_target(
        target, where, world, per_node, remote=remote, hostfile=hostfile, device=device, device_gb=device_gb,
        host_gb=host_gb, peak_tflops=peak_tflops,
    )  # fmt: skip
    rates = resolve_rates(
        cfg,
        world,
        per_node or min(world, 8),
        device=named,
        device_src=where if named and not device else "",
        peak_tflops=peak_tflops,
        mfu=mfu,
        busbw_gbs=busbw,
        node_busbw_gbs=node_busbw,
        from_runs=[Path(r) for r in from_run or []],
    )
    return cfg, to, rates, vocab_src


def _config_source(
    config_file: str | None, preset: str | None, config: str | None
) -> tuple[str | None, str | None]:
    """The preset and the config file to build from: CONFIG names a preset (`pretrain plan gpt2-124m`)
    unless a file of that name exists, else a config file (as --config)."""
    if config_file in PRESETS and not Path(config_file).is_file():
        if preset not in (None, config_file):
            raise ConfigError(
                [
                    f"two presets, {config_file} and --preset {preset}: give one (its fields change with --set)"
                ],
                "plan",
            )
        preset, config_file = config_file, None
    if config_file:
        if config:
            raise ConfigError(["pass the run config either as CONFIG or as --config, not both"], "plan")
        config = config_file
    return preset, config


def plan_target(
    target: dict[str, str | float],
    where: str,
    world: int,
    per_node: int | None,
    *,
    remote: bool,
    hostfile: str | None,
    device: str | None,
    device_gb: float | None,
    host_gb: float | None,
    peak_tflops: float | None,
) -> tuple[Target, str | None]:
    """What `plan` plans for, and the device named for it: the flags first, then the hostfile's
    `# pretrain:` line (`target`, read from `where`), else this machine, said so when the hostfile's
    hosts are other machines (`remote`)."""
    named = device or (str(target["device"]) if "device" in target else None)
    memory, source = _device_memory(
        named, target, where, world, given=device_gb, named_by="--gpu" if device else where
    )
    if host_gb:
        host: float | None = host_gb
    elif "host-gb" in target:
        host = float(target["host-gb"])
    else:
        host = host_memory_gb() if named is None or named == "cpu" or not remote else None
    note = _target_note(
        named, host, source, remote=remote, hostfile=hostfile, device_gb=device_gb, peak_tflops=peak_tflops
    )
    return Target(world, per_node, memory, source, host, note, named), named


def _device_memory(
    device: str | None,
    target: dict[str, str | float],
    where: str,
    world: int,
    *,
    given: float | None,
    named_by: str,
) -> tuple[float | None, str]:
    """A rank's device memory in GB and where it came from: --gpu-gb, the hostfile's device-gb, the
    device's name, else this machine's (`default_device_gb`)."""
    named = gpu_memory_gb(device) if device and device != "cpu" else None
    if given:
        return given, "--gpu-gb"
    if "device-gb" in target:
        return float(target["device-gb"]), f"{where}: device-gb"
    if named is not None:
        return named, f"{named_by}: {device}"
    if device and device != "cpu":
        raise ConfigError(
            [f"{named_by}: {device} does not say its memory (an A100 comes in 40 and 80 GB): name it as "
             f"{device}-80GB, or pass --gpu-gb"], "plan",
        )  # fmt: skip
    return default_device_gb(world)


def _target_note(
    device: str | None,
    host_gb: float | None,
    device_src: str,
    *,
    remote: bool,
    hostfile: str | None,
    device_gb: float | None,
    peak_tflops: float | None,
) -> str:
    """What the plan could not know about its target, and the flag or hostfile line that tells it."""
    if device is None and peak_tflops is None and (remote or (not hostfile and device_gb)):
        said = f"{hostfile} does not say what its hosts are" if remote else "no --gpu names the GPU"
        return (
            f"planning step time for this machine's device, and memory for {device_src}: {said}. Pass --gpu "
            "(e.g. --gpu A100-80GB --host-gb 1024)"
            + (
                ", or add a line '# pretrain: device=A100-80GB host-gb=1024' to the hostfile."
                if remote
                else "."
            )
        )
    if device is not None and host_gb is None:
        return f"host memory unknown: pass --host-gb, or add host-gb=<GB> to {hostfile or 'the hostfile'}'s '# pretrain:' line."
    return ""
