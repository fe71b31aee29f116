"""The sections that keep a run going rather than shape what it trains: checkpoints, what a bad step
does (stability), logs and evaluation, the launch environment of every rank, and the hang watchdog."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field

from pretrain.config.section import Section


class CheckpointConfig(Section):
    dir: str = Field(
        "checkpoints", min_length=1, description="Checkpoint directory, relative to the run dir."
    )
    interval: int = Field(
        500, ge=1, description="Save every this many steps, at the end, and on SIGTERM/SIGINT."
    )
    keep_last: int = Field(3, ge=1, description="Keep the newest this many checkpoints.")
    milestone_interval: int | None = Field(
        None, ge=1, description="Also keep, for good, every checkpoint whose step is a multiple of this."
    )
    keep_best: bool = Field(
        False,
        description="Also keep the checkpoint with the lowest validation loss (among checkpoints saved "
        "at an evaluation step: align interval with logging.eval_interval).",
    )
    checksums: bool = Field(
        True,
        description="Record the BLAKE3 digest of every checkpoint file, and verify them before resuming; "
        "off, only the file sizes are checked.",
    )
    async_save: bool = Field(
        True,
        description="Save checkpoints in the background: the step waits only for a copy of the state in "
        "host memory, then the files are written, hashed, fsynced and committed (`latest` moved) on a "
        "thread while training goes on, one save in flight at most. The last save of a run (its end, a "
        "stop signal, schedule.max_hours) is synchronous, and waits for the one in flight. Off: every "
        "save holds the step until the checkpoint is committed.",
    )

    def due(self, step: int, max_steps: int, stop_requested: bool = False) -> bool:
        """Whether step `step` (1-based, just done) saves: every `interval`, at the end, and when a
        signal asks the run to stop."""
        return step % self.interval == 0 or step == max_steps or stop_requested


class StabilityConfig(Section):
    """What the loop does with a bad step: a non-finite loss anywhere, or a loss spike (spike_factor):
    skip its update, and after max_bad_steps in a row roll back to the newest checkpoint."""

    max_bad_steps: int = Field(
        3,
        ge=1,
        description="Steps in a row with a non-finite loss or a loss spike (spike_factor), each skipped, "
        "before the run rolls back to its last checkpoint and moves the data past the bad batches.",
    )
    max_rollbacks: int = Field(
        3, ge=0, description="Rollbacks one run may make before it stops with an error."
    )
    spike_factor: float | None = Field(
        None,
        gt=1.0,
        allow_inf_nan=False,
        description="A step whose loss (the mean over the data-parallel ranks) exceeds this many times the "
        "median of the last spike_window accepted steps' losses is a spike: skipped as a non-finite loss "
        "is (max_bad_steps in a row roll back). None: off. On, it is judged on the device and adds no host "
        "sync to a step (docs/checkpoints.md).",
    )
    spike_window: int = Field(
        50,
        ge=1,
        le=100_000,
        description="Accepted steps whose median loss a spike is measured against; the rule applies once "
        "this many are in (skipped steps and rolled-back ones never are).",
    )


class LoggingConfig(Section):
    run_dir: str = Field(
        "runs/{preset}", min_length=1, description="Run directory: config, logs, checkpoints."
    )
    log_interval: int = Field(10, ge=1, description="Log every this many steps.")
    eval_interval: int = Field(250, ge=1, description="Evaluate validation loss every this many steps.")
    eval_batches: int = Field(20, ge=1, description="Micro batches per rank in each evaluation.")
    sample_tokens: int = Field(300, ge=0, description="Tokens of text generated at the end of the run.")
    sample_prompt: str = Field("\n", description="Prompt of the final sample.")
    tensorboard: bool = Field(
        True, description="TensorBoard event files in <run_dir>/tensorboard, through DeepSpeed's monitor."
    )
    csv_monitor: bool = Field(
        False, description="DeepSpeed's csv_monitor too: one CSV per metric in <run_dir>/csv_monitor."
    )
    wandb: bool = Field(
        False, description="Weights & Biases through DeepSpeed's monitor, if the wandb package is installed."
    )
    wandb_project: str = Field("pretrain", min_length=1, description="W&B project.")
    wandb_group: str | None = Field(None, description="W&B group of runs.")
    wandb_team: str | None = Field(None, description="W&B team (entity).")
    progress_bar: bool | Literal["auto"] = Field(
        "auto", description="tqdm progress bar with an ETA on rank 0: true, false, or 'auto' (on a terminal)."
    )
    peak_tflops: float | None = Field(
        None,
        gt=0,
        description="Device peak TFLOP/s per rank for MFU. None: known GPUs from a table, "
        "the CPU from a matmul probe cached on disk.",
    )

    def log_due(self, step: int, max_steps: int) -> bool:
        """Whether step `step` (1-based) logs a metrics row: every `log_interval`, and at the end."""
        return step % self.log_interval == 0 or step == max_steps

    def eval_due(self, step: int, max_steps: int) -> bool:
        """Whether step `step` (1-based, just done) evaluates: every `eval_interval`, and at the end."""
        return step % self.eval_interval == 0 or step == max_steps


# Values that reach a shell on every host (DeepSpeed's pdsh runner, launch/*.sh): no spaces, quotes,
# `$` or backslashes, so nothing in them is ever expanded or split.
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_ENV_VALUE = r"^[A-Za-z0-9_@%+=:,./^-]*$"


class LaunchConfig(Section):
    """The environment of every rank on every host, rendered to `.deepspeed_env` by `pretrain launch-env`."""

    socket_ifname: str | None = Field(
        None,
        description="Network interface(s) for NCCL and gloo traffic (NCCL_SOCKET_IFNAME, "
        "GLOO_SOCKET_IFNAME), e.g. 'ib0' or 'eth0'. None lets each library choose.",
    )
    ib_hca: str | None = Field(
        None,
        description="InfiniBand adapters NCCL may use (NCCL_IB_HCA), e.g. 'mlx5_0,mlx5_1' or '^mlx5_2'.",
    )
    nccl_debug: Literal["VERSION", "WARN", "INFO", "TRACE"] | None = Field(
        "WARN", description="NCCL_DEBUG: INFO prints the chosen transports and rings at start-up."
    )
    nccl_ib_timeout: int | None = Field(
        None, ge=1, le=31, description="NCCL_IB_TIMEOUT: InfiniBand verbs timeout, 4.096 us x 2**this."
    )
    collective_timeout_s: int = Field(
        1800,
        ge=10,
        description="Process-group timeout: a collective waiting longer on a dead or stuck rank fails the "
        "run instead of hanging it.",
    )
    env: dict[str, str | int | float] = Field(
        default_factory=dict,
        description="Any other variables for every rank, e.g. {NCCL_NET_GDR_LEVEL: PHB} or PATH "
        "(keep the venv's bin first so DeepSpeed's op builds find the same ninja everywhere).",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        modeled = {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG", "NCCL_IB_TIMEOUT"}
        problems = [
            f"{name}={value!r}: only letters, digits and _@%+=:,./^- (no spaces, quotes or $)"
            for name, value in (("socket_ifname", self.socket_ifname), ("ib_hca", self.ib_hca))
            if value is not None and not re.match(_ENV_VALUE, value)
        ]
        for key, value in self.env.items():
            if not re.match(_ENV_NAME, key):
                problems.append(f"env: {key!r} is not a variable name")
            elif key in modeled:
                problems.append(f"env: {key} has its own launch field, set that")
            if not re.match(_ENV_VALUE, str(value)):
                problems.append(
                    f"env: {key}={value!r}: only letters, digits and _@%+=:,./^- (no spaces, quotes or $)"
                )
        return problems


class WatchdogConfig(Section):
    """The hang watchdog: a run whose steps stop completing dumps every rank's stacks and exits, so
    that a supervisor (`train --max-restarts`, Slurm) restarts it from the newest checkpoint."""

    timeout_s: int = Field(
        1800,
        ge=0,
        description="Seconds a step may take, counted from the end of the previous one, before every "
        "rank writes its Python stacks to <run_dir>/hang/ and the run exits with code 124. 0: no watchdog.",
    )
    slow_timeout_s: int = Field(
        3600,
        ge=0,
        description="The allowance instead of timeout_s for what legitimately takes long: the first step "
        "of a run or of a resume (compilation, warm-up), an evaluation, a checkpoint save, a rollback. 0: "
        "those are not watched.",
    )

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        if self.timeout_s and self.slow_timeout_s and self.slow_timeout_s < self.timeout_s:
            return [
                f"slow_timeout_s ({self.slow_timeout_s}) is below timeout_s ({self.timeout_s}): the "
                "allowance for the first step, evaluations and saves must be at least a step's"
            ]
        return []
