"""Where `pretrain data prepare` runs when it runs as many tasks (`data.tasks`): on this host's
cores, on a Slurm cluster, or on a Ray cluster (`data.executor`), and what each of those needs.
The rules across these fields are in `engine_problems`, reported with the rest of `data`'s."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from pretrain.config.section import Section

EXECUTORS = ("local", "slurm", "ray")
Executor = Literal["local", "slurm", "ray"]
_SLURM_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")


class SlurmSection(Section):
    """data.executor 'slurm': one job array per stage of the prepare, submitted with sbatch."""

    partition: str | None = Field(None, min_length=1, description="Partition (None: the cluster's default).")
    time: str = Field(
        "24:00:00",
        description="Time limit of each task, as sbatch --time takes it (e.g. 4:00:00 or 1-00:00:00).",
    )
    cpus_per_task: int = Field(1, ge=1, le=1024, description="CPUs of each task (sbatch --cpus-per-task).")
    mem_per_cpu_gb: float = Field(
        2.0, gt=0.0, description="Memory per CPU of each task in GB (--mem-per-cpu)."
    )
    qos: str | None = Field(None, min_length=1, description="Quality of service (sbatch --qos); None: none.")

    @field_validator("time", mode="before")
    @classmethod
    def _minutes(cls, value: Any) -> Any:
        """`--set data.slurm.time=240` reads as a number: Slurm's minutes."""
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class RaySection(Section):
    """data.executor 'ray': the tasks of each stage as Ray tasks."""

    address: str | None = Field(
        None,
        min_length=1,
        description="The Ray cluster: 'auto' (the one this host belongs to), or HOST:PORT of its head (the GCS "
        "port, 6379 by default). None: a Ray instance started on this host for the prepare.",
    )
    cpus_per_task: int = Field(1, ge=1, le=1024, description="CPUs Ray reserves for each task.")


class DataEngineFields(Section):
    """data's fields on where a prepare runs (DataConfig derives from this)."""

    executor: Executor = Field(
        "local", description="Where data.tasks run: this host, Slurm or Ray (docs/data.md)."
    )
    tasks: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Prepare as this many tasks, each a run of the corpus, deduped "
        "across all of them. None: each stage one task in the prepare's own process, its encode over "
        "data.workers, with one host's shard names. Changes the shards, not the token stream.",
    )
    slurm: SlurmSection = Field(default_factory=SlurmSection, description="data.executor 'slurm'.")
    ray: RaySection = Field(default_factory=RaySection, description="data.executor 'ray'.")


def engine_problems(data: DataEngineFields) -> list[str]:
    """The rules across data.executor, data.tasks and their sections."""
    executor, tasks, slurm = data.executor, data.tasks, data.slurm
    problems = []
    if executor != "local" and tasks is None:
        problems.append(
            f"data.executor {executor!r} runs the prepare as data.tasks tasks: set data.tasks (e.g. 64, a few "
            "per CPU the cluster gives the prepare)"
        )
    if executor == "slurm" and not _SLURM_TIME.match(slurm.time):
        problems.append(
            f"data.slurm.time {slurm.time!r} is not a Slurm time: write MINUTES, HH:MM:SS or DAYS-HH:MM:SS "
            "(e.g. 4:00:00)"
        )
    return problems
