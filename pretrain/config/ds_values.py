"""A DeepSpeed JSON's values checked against the tree's field types, strictly ("true" is not true,
"2" is not 2), and `Reading`, the record of one JSON on its way into the tree: what it sets, what it
passes through, what is wrong with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, TypeAdapter, ValidationError

from pretrain.config.ds_keys import AUTO
from pretrain.config.tree import RunConfig
from pretrain.errors import did_you_mean

# ---------------------------------------------------------------------------------------------
# Values and their types


def shown(value: Any) -> str:
    """A JSON value as the user wrote it, saying when it is a string."""
    text = json.dumps(value, default=str)
    return f"{text} (a string)" if isinstance(value, str) else text


def not_a_mapping(where: str, value: Any) -> str:
    """The problem with a section given as a scalar, with the likely fix (`"zero_optimization": 2`
    meant `{"stage": 2}`; `"fp16": true` meant `{"enabled": true}`)."""
    fix = ""
    if where == "zero_optimization" and value in (0, 1, 2, 3) and not isinstance(value, bool):
        fix = f': write "zero_optimization": {{"stage": {value}}}'
    elif where in ("fp16", "bf16") and isinstance(value, bool):
        fix = f': write "{where}": {{"enabled": {json.dumps(value)}}}'
    return f"{where}: expected a mapping (a JSON object), got {shown(value)}{fix}"


def is_whole(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _accept(value: Any) -> bool:
    return True


# What JSON gives for each annotation type_problem meets, and how its error names it.
_JSON_TYPES: dict[Any, tuple[Callable[[Any], bool], str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (is_whole, "a whole number"),
    float: (is_number, "a number"),
    str: (lambda v: isinstance(v, str), "a string"),
    Path: (lambda v: isinstance(v, str), "a path (a string)"),
    dict: (lambda v: isinstance(v, dict), "a mapping (a JSON object)"),
    list: (lambda v: isinstance(v, list), "a list"),
    tuple: (lambda v: isinstance(v, list) and all(is_number(x) for x in v), "a list of numbers"),
}


def type_problem(value: Any, annotation: Any) -> str | None:
    """Why `value`, read from JSON, does not have the type `annotation`; None if it does.

    Stricter than pydantic's lax mode, which takes "true" for true and "2" for 2: in a DeepSpeed JSON
    those are mistakes. Whole-valued floats (5e8) are whole numbers, as JSON writes them."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return type_problem(value, get_args(annotation)[0])
    if origin in (Union, UnionType):
        return _union_problem(value, get_args(annotation))
    if origin is Literal:
        return _literal_problem(value, get_args(annotation))
    ok, want = _JSON_TYPES.get(origin or _as_json(annotation), (_accept, ""))
    return None if ok(value) else f"expected {want}, got {shown(value)}"


def _union_problem(value: Any, members: tuple[Any, ...]) -> str | None:
    """`value` against `A | B | None`: None if any member takes it, else the first member's problem."""
    options = [a for a in members if a is not type(None)]
    if value is None and len(options) < len(members):
        return None
    problems = [type_problem(value, a) for a in options]
    return None if None in problems else problems[0]


def _literal_problem(value: Any, choices: tuple[Any, ...]) -> str | None:
    if any(value == c and type(value) is type(c) for c in choices):
        return None
    return f"expected one of {', '.join(json.dumps(c) for c in choices)}, got {shown(value)}"


def _as_json(annotation: Any) -> Any:
    """The JSON type of an enum (its values' type, int or str) or a section (a mapping)."""
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return int if issubclass(annotation, int) else str if issubclass(annotation, str) else None
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return dict
    return annotation


@cache
def _field_adapter(section: str, key: str) -> tuple[Any, TypeAdapter[Any]]:
    model = RunConfig.model_fields[section].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel)
    info = model.model_fields[key]
    # a type built at run time: the field's annotation with its bounds (its metadata), not its
    # default or its model's validators
    bounded: Any = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return info.annotation, TypeAdapter(bounded)


def field_value(section: str, key: str, value: Any) -> Any:
    """`value` as the tree's field section.key takes it; ValueError says why it cannot."""
    annotation, adapter = _field_adapter(section, key)
    problem = type_problem(value, annotation)
    if problem:
        raise ValueError(problem)
    try:
        return adapter.validate_python(value)
    except ValidationError as e:
        raise ValueError(f"{e.errors()[0]['msg']} (got {shown(value)})") from None


def without_auto(value: Any) -> Any:
    """`value` with every "auto" entry left out: DeepSpeed's default, as the Hugging Face Trainer
    leaves the keys it has nothing for."""
    if isinstance(value, dict):
        return {k: without_auto(v) for k, v in value.items() if v != AUTO}
    return value


# ---------------------------------------------------------------------------------------------
# A JSON on its way into the tree


@dataclass
class Reading:
    """What one DeepSpeed JSON sets in the tree, what it passes through, what is wrong with it.

    `base` is the tree without the JSON (preset, config file, overrides): what "auto" and the LR
    scheduler's ratios resolve against."""

    base: dict[str, Any]
    tree: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    origin: dict[tuple[str, str], str] = field(default_factory=dict)
    defaulted: list[str] = field(default_factory=list)

    def default(self, section: str, key: str, value: Any) -> None:
        """DeepSpeed's default for section.key, where the JSON left it out (and nothing it set has)."""
        if key not in self.tree.get(section, {}):
            self.tree.setdefault(section, {})[key] = field_value(section, key, value)
            self.defaulted.append(f"{section}.{key}")

    def put(self, where: str, section: str, key: str, value: Any, *, replace: bool = False) -> None:
        """Set the tree's section.key from the JSON's `where`. "auto" keeps the tree's value; a value
        of the wrong type, out of bounds, or contradicting another key of the JSON is a problem."""
        if value == AUTO:
            return
        try:
            value = field_value(section, key, value)
        except ValueError as e:
            self.problems.append(f"{where}: {e}")
            return
        had = self.tree.get(section, {})
        if key in had and had[key] != value and not replace:
            self.problems.append(
                f"{where} ({json.dumps(value)}) contradicts {self.origin[(section, key)]} ({json.dumps(had[key])})"
            )
            return
        self.tree.setdefault(section, {})[key] = value
        self.origin[(section, key)] = where

    def current(self, section: str, key: str) -> Any:
        """The tree's section.key as it stands: set by the JSON, else by the base, else the default."""
        for layer in (self.tree, self.base):
            if key in layer.get(section, {}):
                return layer[section][key]
        model = RunConfig.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        return model.model_fields[key].default

    def mapping(self, where: str, value: Any) -> dict[str, Any]:
        """A section of the JSON, which must be a mapping; {} (and a problem) if it is not."""
        if isinstance(value, dict):
            return value
        self.problems.append(not_a_mapping(where, value))
        return {}

    def unknown(self, where: str, section: dict[str, Any], known: set[str] | dict[str, Any]) -> None:
        for k in section:
            if k not in known:
                self.problems.append(f"{where}.{k}: unknown key{did_you_mean(k, list(known))}")
