"""The batch section and its arithmetic: `train_batch_size = micro_batch_size x
gradient_accumulation_steps x data_parallel_size`, derived here and nowhere else, with the
data-parallel size a world of ranks leaves and the accumulation a global batch gives."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from pretrain.config.section import Section
from pretrain.errors import ConfigError


def data_parallel_of(context: dict[str, Any]) -> int | None:
    """The data-parallel size a world of ranks leaves: world / (tensor x pipeline), the one place it
    is derived (None: no world size, or one the model-parallel size does not divide)."""
    world, mp = context.get("world_size"), context.get("model_parallel", 1)
    return None if world is None or world % mp else world // mp


class BatchConfig(Section):
    """`train_batch_size = micro_batch_size x gradient_accumulation_steps x data_parallel_size`,
    derived here and nowhere else. The world size is the validation's `context`: without one (a
    config shown or checked before launch) the data-parallel size, and so the batch, stay unresolved
    (None); a config built for a world size has both, and `sequences` reads the batch as an int.

    A global batch (`global_batch_sequences`, or `global_batch_tokens` with the context's block
    size) gives gradient_accumulation_steps for the data-parallel size at hand instead."""

    micro_batch_size: int = Field(32, ge=1, description="Sequences per rank per forward/backward.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro batches per optimizer step.")
    data_parallel_size: int | None = Field(
        None,
        ge=1,
        validate_default=True,
        description="Data-parallel ranks. None: the launch's world size / (parallel.tensor x parallel.pipeline).",
    )
    train_batch_size: int | None = Field(
        None,
        ge=1,
        validate_default=True,
        description="Sequences per optimizer step. Derived; if given it must match.",
    )
    global_batch_sequences: int | None = Field(
        None,
        ge=1,
        le=10**9,
        description="Sequences per optimizer step, from which gradient_accumulation_steps is derived for the "
        "world size at hand: global / (micro_batch_size x data_parallel_size), which must be whole. "
        "None: the accumulation as given.",
    )
    global_batch_tokens: int | None = Field(
        None,
        ge=1,
        le=10**13,
        description="Tokens per optimizer step (global_batch_sequences x model.block_size, as GPT-NeoX and "
        "nanoGPT state a batch, e.g. 524288), from which gradient_accumulation_steps is derived likewise. "
        "Give this or global_batch_sequences.",
    )

    @model_validator(mode="before")
    @classmethod
    def _accumulation_from_global_batch(cls, data: Any, info: ValidationInfo) -> Any:
        """A global batch sets the accumulation, where the data-parallel size is known and the global
        batch divides into it and no accumulation is given (`broken_rules` reports the rest)."""
        if not isinstance(data, dict) or data.get("gradient_accumulation_steps") is not None:
            return data
        context = info.context or {}
        seqs = global_sequences(
            data.get("global_batch_sequences"), data.get("global_batch_tokens"), context.get("block_size")
        )
        dp = data.get("data_parallel_size")
        dp = data_parallel_of(context) if dp is None else dp
        micro = data.get("micro_batch_size", cls.model_fields["micro_batch_size"].default)
        if all(positive_int(x) for x in (seqs, dp, micro)) and seqs % (micro * dp) == 0:
            data = {**data, "gradient_accumulation_steps": seqs // (micro * dp)}
        return data

    @field_validator("data_parallel_size")
    @classmethod
    def _from_world(cls, dp: int | None, info: ValidationInfo) -> int | None:
        """None: world size / model-parallel size (tensor x pipeline), where the world size is known
        and that divides it (a given one that differs, or a world it does not divide, is a broken rule)."""
        return data_parallel_of(info.context or {}) if dp is None else dp

    @field_validator("train_batch_size")
    @classmethod
    def _derived(cls, tbs: int | None, info: ValidationInfo) -> int | None:
        """None: the product, where the data-parallel size is known (a given one must match it)."""
        micro, acc = info.data.get("micro_batch_size"), info.data.get("gradient_accumulation_steps")
        dp = info.data.get("data_parallel_size")
        if tbs is not None or micro is None or acc is None or dp is None:
            return tbs
        return int(micro * acc * dp)

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        world, dp, mp = context.get("world_size"), self.data_parallel_size, context.get("model_parallel", 1)
        problems = []
        if world is not None and dp is not None and dp * mp != world:  # None took world / mp
            problems.append(self._world_mismatch(dp, world, mp))
        if dp is not None:
            derived = self.micro_batch_size * self.gradient_accumulation_steps * dp
            if self.train_batch_size != derived:
                problems.append(
                    f"train_batch_size ({self.train_batch_size}) != micro_batch_size ({self.micro_batch_size})"
                    f" x gradient_accumulation_steps ({self.gradient_accumulation_steps})"
                    f" x data_parallel_size ({dp}) = {derived}"
                )
        return problems + self._global_batch_problems(dp, context.get("block_size"))

    def _global_batch_problems(self, dp: int | None, block_size: int | None) -> list[str]:
        """The global batch that no whole accumulation gives (with the nearest that do), or one that
        disagrees with the accumulation given beside it."""
        g_seq, g_tok = self.global_batch_sequences, self.global_batch_tokens
        if g_seq is not None and g_tok is not None:
            return [
                f"global_batch_sequences ({g_seq}) and global_batch_tokens ({g_tok}) both given: give one"
            ]
        if dp is None and block_size is not None:
            return self._global_batch_without_world(block_size)
        if (g_tok is not None and block_size is None) or (g_seq is None and g_tok is None) or dp is None:
            return []  # no global batch, or nothing yet to derive the accumulation from
        micro, acc = self.micro_batch_size, self.gradient_accumulation_steps
        name, given, per = (
            ("global_batch_tokens", g_tok, block_size)
            if g_tok is not None
            else ("global_batch_sequences", g_seq, 1)
        )
        assert given is not None and per is not None
        unit = micro * dp * per  # what one more accumulation step adds
        times_block = f" x model.block_size ({per})" if per > 1 else ""
        if given % unit == 0:
            if given // unit == acc:
                return []
            return [
                f"{name} ({given}) and gradient_accumulation_steps ({acc}) disagree: {given} / (micro_batch_size "
                f"({micro}) x data_parallel_size ({dp}){times_block}) is accumulation {given // unit}. Give one of "
                "them: a global batch derives the accumulation for the world size at hand"
            ]
        below, above = given // unit * unit, (given // unit + 1) * unit
        nearest = (
            f"{below} and {above} (accumulation {below // unit} and {above // unit})"
            if below
            else f"{above} (accumulation 1)"
        )
        micros = _nearest_divisors(given // (dp * per), micro) if given % (dp * per) == 0 else []
        keep = (
            f", or keep {given} with micro_batch_size {' or '.join(map(str, micros))}"
            if micros
            else f" (no micro batch size keeps {given}: it is not a multiple of data_parallel_size ({dp}){times_block})"
        )
        return [
            f"{name} ({given}) is not a multiple of micro_batch_size ({micro}) x data_parallel_size ({dp})"
            f"{times_block} = {unit}, so no whole gradient_accumulation_steps gives it: the nearest "
            f"{name} that divide are {nearest}{keep}"
        ]

    def _global_batch_without_world(self, block_size: int) -> list[str]:
        """Without a world size (`pretrain config`): a global batch that no world size gives, as
        `render` and `train` would refuse it for theirs. Not a whole number of sequences; or not a
        multiple of the micro batch (x the accumulation, where one is given beside it)."""
        g_seq, g_tok = self.global_batch_sequences, self.global_batch_tokens
        if g_tok is not None and g_tok % block_size:
            below, above = g_tok // block_size * block_size, (g_tok // block_size + 1) * block_size
            near = f"{below} or {above}" if below else str(above)
            return [
                f"global_batch_tokens ({g_tok}) is not a whole number of sequences of model.block_size "
                f"({block_size}): the nearest that are, {near}"
            ]
        seqs = global_sequences(g_seq, g_tok, block_size)
        if seqs is None:
            return []
        micro, given = self.micro_batch_size, "gradient_accumulation_steps" in self.model_fields_set
        per_rank = micro * (self.gradient_accumulation_steps if given else 1)
        if seqs % per_rank == 0:
            return []
        name = "global_batch_tokens" if g_tok is not None else "global_batch_sequences"
        value = g_tok if g_tok is not None else g_seq
        if given:
            return [
                f"{name} ({value}) and gradient_accumulation_steps ({self.gradient_accumulation_steps}) disagree "
                f"whatever the world size: {seqs} sequences are not a multiple of micro_batch_size ({micro}) x "
                f"{self.gradient_accumulation_steps}. Give one of them: a global batch derives the accumulation "
                "for the world size at hand"
            ]
        of = f" ({seqs} sequences)" if g_tok is not None else ""
        return [
            f"{name} ({value}){of} is not a multiple of micro_batch_size ({micro}): no world size gives it a "
            "whole gradient_accumulation_steps. Change micro_batch_size or the global batch"
        ]

    @property
    def sequences(self) -> int:
        """train_batch_size, resolved: sequences per optimizer step of a config built for a world size."""
        if self.train_batch_size is None:
            raise ConfigError(["batch.data_parallel_size is unresolved: pass a world size"], "batch")
        return self.train_batch_size

    def _world_mismatch(self, dp: int, world: int, mp: int) -> str:
        # No "; " in the message: `validate` splits a section's problems there.
        if world % mp:
            return (
                f"data_parallel_size ({dp}) x tensor x pipeline ({mp}) cannot make the world size ({world}): "
                f"a world of {world} ranks is not a multiple of {mp}"
            )
        want = world // mp
        fix = f"pass --set batch.data_parallel_size={want}"
        acc = self.gradient_accumulation_steps * dp
        if self.global_batch_sequences is not None or self.global_batch_tokens is not None:
            fix += " (the global batch derives the accumulation for it)"
        elif acc % want == 0:
            batch = self.micro_batch_size * acc
            fix += f" (with --set batch.gradient_accumulation_steps={acc // want} to keep {batch} sequences per step)"
        of = (
            f"the world size ({world})"
            if mp == 1
            else f"world size / (tensor x pipeline) ({world} / {mp} = {want})"
        )
        return f"data_parallel_size ({dp}) does not match {of}: {fix}"


def global_sequences(sequences: Any, tokens: Any, block_size: Any) -> int | None:
    """The sequences of a global batch given in sequences, or in tokens of `block_size` (None: no
    global batch, or one that is not a whole number of sequences)."""
    if sequences is not None and tokens is None:
        return sequences if positive_int(sequences) else None
    if sequences is None and positive_int(tokens) and positive_int(block_size) and tokens % block_size == 0:
        return int(tokens // block_size)
    return None


def positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _nearest_divisors(n: int, near: int) -> list[int]:
    """The divisors of `n` nearest `near`: the largest below it and the smallest above it."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = sorted({*small, *(n // d for d in small)})
    below = [d for d in divisors if d < near][-1:]
    above = [d for d in divisors if d > near][:1]
    return below + above
