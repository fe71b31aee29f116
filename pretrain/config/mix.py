"""A blend's mix over the run: each dataset's weight fixed, or a schedule in tokens seen.

A weight is a number (fixed for the whole run) or a list of [tokens, weight] points: linear between
points, flat before the first and after the last. Two points at one token count make a step (the
second holds from there on). Tokens are what the run has trained on: samples x model.block_size, as
the loop counts tokens_seen. Weights are relative: the mix at t is each weight at t over their sum.

The loader evaluates the mix at the first token of each blend block of 65,536 samples, so the order
stays a function of (seed, samples consumed). This module is the rule and its checks, in plain
Python (no numpy): the config, `plan` and the log use it, the loader has a vectorized twin.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator

from pretrain.config.section import Section

Point = tuple[float, float]
NonNegative = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]  # a schedule point's tokens and weight
Weight = float | list[Point]

BLEND_BLOCK = 1 << 16  # samples per blend block: each dataset's share is a whole number of them
EXAMPLE = "[[0, 0.7], [8e9, 0.7], [1e10, 0.2]]"


def weight_at(weight: Weight, tokens: float) -> float:
    """One dataset's weight after `tokens` tokens: linear between points, flat outside them."""
    if not isinstance(weight, list):
        return float(weight)
    ts = [t for t, _ in weight]
    i = bisect.bisect_right(ts, tokens)
    if i == 0:
        return weight[0][1]
    if i == len(weight):
        return weight[-1][1]
    (t0, w0), (t1, w1) = weight[i - 1], weight[i]
    return w0 + (w1 - w0) * ((tokens - t0) / (t1 - t0))


def shares_at(weights: Sequence[Weight], tokens: float) -> list[float]:
    """The mix after `tokens` tokens: each weight over their sum."""
    at = [weight_at(w, tokens) for w in weights]
    total = sum(at)
    return [w / total for w in at]


def is_scheduled(weights: Sequence[Weight]) -> bool:
    return any(isinstance(w, list) for w in weights)


def turns(weights: Sequence[Weight]) -> list[float]:
    """Every token count where a weight has a point: the mix is linear between consecutive ones."""
    return sorted({t for w in weights if isinstance(w, list) for t, _ in w})


# ---------------------------------------------------------------------------------------------
# Checks


def read_weight(value: Any) -> Weight:
    """A config's weight as the tree holds it: a float, or a list of (tokens, weight) points. Number
    strings count as numbers, as YAML leaves them (`8e9` is text to YAML 1.1). Raises ValueError,
    naming the two shapes, for anything else."""
    number = _number(value)
    if isinstance(number, float):
        return number
    if isinstance(value, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in value):
        points = [(_number(t), _number(w)) for t, w in value]
        if all(isinstance(x, float) for p in points for x in p):
            return points
    raise ValueError(
        f"a weight is a number or a list of [tokens, weight] points, e.g. {EXAMPLE}, got {value!r}"
    )


def _number(x: Any) -> Any:
    """`x` as a float where it is a number or a number's text (not a yes/no), else `x`."""
    if isinstance(x, bool):
        return x
    if isinstance(x, int | float | str):
        try:
            return float(x)
        except (ValueError, OverflowError):  # text that is no number, an int past a float's range
            return x
    return x


def weight_problems(weight: Weight) -> list[str]:
    """What is wrong with one dataset's weight: a fixed one must be above 0, a schedule's points
    finite, at least 0, in order of tokens and not all 0."""
    if not isinstance(weight, list):
        if not (math.isfinite(weight) and weight > 0):
            return [
                f"a fixed weight must be a finite number above 0, got {weight:g}: drop a dataset never read "
                f"from data.blend, or give one read part of the run a schedule, e.g. {EXAMPLE}"
            ]
        return []
    if not weight:
        return [f"a schedule needs at least one [tokens, weight] point, e.g. {EXAMPLE}"]
    problems = []
    bad = [p for p in weight if not all(math.isfinite(x) and x >= 0 for x in p)]
    if bad:
        problems.append(f"point {list(bad[0])}: tokens and weight must be finite numbers of at least 0")
    ts = [t for t, _ in weight]
    if any(b < a for a, b in itertools.pairwise(ts)):
        problems.append(f"points must be in order of tokens, got tokens {ts} (sort them)")
    steps = [t for t in dict.fromkeys(ts) if ts.count(t) > 2]
    if steps:
        problems.append(
            f"{ts.count(steps[0])} points at {tokens(steps[0])} tokens: two make a step, keep the first and last"
        )
    if not bad and not any(w > 0 for _, w in weight):
        problems.append("every point's weight is 0: the dataset is never read (drop it from data.blend)")
    return problems


def blend_problems(weights: Sequence[Weight]) -> list[str]:
    """What is wrong with the mix as a whole, at every token count where a weight has a point (the
    mix is linear between them): the weights must sum above 0, and each dataset's share be 0 or at
    least 1/65536 (one sample of a blend block)."""
    problems = []
    for t in turns(weights) if is_scheduled(weights) else [0.0]:
        # the weights just before a step too: the mix holds there up to the step
        for at in ([weight_at(w, t) for w in weights], [_left(w, t) for w in weights]):
            total = sum(at)
            if total <= 0:
                problems.append(
                    f"at {tokens(t)} tokens every weight is 0: no dataset to read (give one a weight above 0 there)"
                )
                break
            small = [i for i, w in enumerate(at) if 0 < w / total < 1 / BLEND_BLOCK]
            if small:
                i = small[0]
                problems.append(
                    f"at {tokens(t)} tokens data.blend[{i}]'s share is {at[i] / total:.3g}, under 1/{BLEND_BLOCK} "
                    "(one sample in a blend block): make it 0 or larger"
                )
                break
    return list(dict.fromkeys(problems))


def _left(weight: Weight, tokens: float) -> float:
    """A weight just before `tokens`: at a step, the first of its two points."""
    if isinstance(weight, list):
        before = [w for t, w in weight if t == tokens]
        if before:
            return before[0]
    return weight_at(weight, tokens)


class BlendSource(Section):
    """One dataset of data.blend and its weight (fixed or scheduled)."""

    dataset_dir: str = Field(min_length=1, description="A dataset prepared by `pretrain data prepare`.")
    weight: Annotated[float, Field(gt=0.0)] | list[tuple[NonNegative, NonNegative]] = Field(
        description="Relative share of training samples drawn from it: a number for the whole run, or a "
        "schedule in tokens seen, [[tokens, weight], ...], linear between points and flat outside them "
        "(two points at one token count make a step, a weight of 0 reads nothing there), e.g. "
        "[[0, 0.7], [8e9, 0.7], [1e10, 0.2]]. See docs/data.md, Scheduled mix."
    )

    @field_validator("weight", mode="before")
    @classmethod
    def _read_weight(cls, value: Any) -> Weight:
        weight = read_weight(value)
        problems = weight_problems(weight)
        if problems:
            raise ValueError("; ".join(problems))
        return weight


def mixed_everywhere(blend: list[BlendSource]) -> list[BlendSource]:
    """data.blend, checked as a whole at every point of its schedules (`blend_problems`)."""
    problems = blend_problems([b.weight for b in blend]) if blend else []
    if problems:
        raise ValueError("; ".join(problems))
    return blend


# ---------------------------------------------------------------------------------------------
# Words


def mix_names(dataset_dirs: Sequence[str | Path]) -> list[str]:
    """Short names of the blended datasets: their directories' names, the whole paths where two
    share a name."""
    names = [Path(d).name or str(d) for d in dataset_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in dataset_dirs]


def tokens(t: float) -> str:
    """A token count as messages write it: `8,000,000,000`."""
    return f"{t:,.0f}"


def mix_text(names: Sequence[str], shares: Sequence[float]) -> str:
    """`web=0.70 hq=0.30`."""
    return " ".join(f"{n}={s:.2f}" for n, s in zip(names, shares, strict=True))


def mix_points(weights: Sequence[Weight], *, tokens_per_step: int) -> list[tuple[float, int, list[float]]]:
    """(tokens, the step that reaches them, the mix there) at every token count where the mix turns,
    linear between them (a fixed mix: once, at 0). A step is two entries: the mix up to it, then from it."""
    out = []
    for t in turns(weights) if is_scheduled(weights) else [0.0]:
        step, left, right = (
            math.ceil(t / tokens_per_step),
            [_left(w, t) for w in weights],
            shares_at(weights, t),
        )
        if sum(left) > 0 and (up_to := [w / sum(left) for w in left]) != right:
            out.append((t, step, up_to))
        out.append((t, step, right))
    return out


def mix_plan(
    names: Sequence[str], weights: Sequence[Weight], *, tokens_per_step: int, run_tokens: int
) -> list[str]:
    """The mix as `plan` shows it: fixed, or at each token count where it turns (with the step that
    reaches it)."""
    if not is_scheduled(weights):
        return [f"data mix (fixed): {mix_text(names, shares_at(weights, 0.0))}"]
    lines = ["data mix (scheduled in tokens seen, linear between these points):"]
    said = -1.0
    for t, step, shares in mix_points(weights, tokens_per_step=tokens_per_step):
        after = " (after the run ends)" if t > run_tokens else ""
        then = "then " if t == said else ""  # a step: the mix up to it, then from it
        lines.append(f"  {tokens(t):>18} tokens (step {step:,}){after}: {then}{mix_text(names, shares)}")
        said = t
    return lines
