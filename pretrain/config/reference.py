"""The field reference, generated from the tree: every field's dotted name, type or choices, bounds,
default and description, as plain text for the terminal (`pretrain fields`) and as Markdown for
docs/configuration.md (`pretrain fields --markdown`; `python -m pretrain.config.reference FILE`
rewrites the block between the markers in FILE)."""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from pretrain.config.tree import RunConfig
from pretrain.errors import ConfigError, did_you_mean

BEGIN = "<!-- fields:begin -->"
END = "<!-- fields:end -->"
TOP_LEVEL = "top level"
REQUIRED = "required"  # the default of a field that has none


@dataclass(frozen=True)
class FieldDoc:
    """One field of the tree, as the reference shows it."""

    name: str  # dotted: model.n_layer; the items of a list of sections: data.blend[].weight
    kinds: tuple[tuple[str, bool], ...]  # each alternative of the type: (text, whether a literal choice)
    bounds: str
    default: str
    description: str

    @property
    def kind(self) -> str:
        return " | ".join(text for text, _ in self.kinds)


def field_docs(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[FieldDoc]:
    """Every field of `model` and of the sections it holds, depth first, in declaration order."""
    docs = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        docs.append(
            FieldDoc(dotted, _kinds(info.annotation), _bounds(info), _default(info), info.description or "")
        )
        sub, many = _section_in(info.annotation)
        if sub is not None:
            docs += field_docs(sub, f"{dotted}{'[]' if many else ''}.")
    return docs


def sections() -> list[str]:
    """The names `pretrain fields SECTION` takes: the tree's top-level sections."""
    return [name for name, info in RunConfig.model_fields.items() if _is_section(info.annotation)]


def groups(section: str | None = None) -> list[tuple[str, str, list[FieldDoc]]]:
    """(title, description, fields) for the top-level fields, then each section; or `section` alone."""
    if section is not None and section not in sections():
        raise ConfigError(
            [
                f"unknown section {section!r}{did_you_mean(section, sections())}: the sections are "
                f"{', '.join(sections())}"
            ],
            "fields",
        )
    docs = field_docs()
    top = [d for d in docs if "." not in d.name and d.name not in sections()]
    out = [] if section is not None else [(TOP_LEVEL, "Fields of the run itself, beside its sections.", top)]
    for name in sections() if section is None else [section]:
        info = RunConfig.model_fields[name]
        out.append((name, info.description or "", [d for d in docs if d.name.startswith(f"{name}.")]))
    return out


def reference_text(section: str | None = None) -> str:
    """The reference for a terminal: a block per section, each field on a line, its description below."""
    lines: list[str] = []
    for title, description, docs in groups(section):
        lines += [f"{title}: {description}", ""]
        for d in docs:
            facts = ", ".join(x for x in (d.kind, d.bounds, d.default and f"default {d.default}") if x)
            lines.append(f"  {d.name}  ({facts})")
            lines += textwrap.wrap(
                d.description, width=100, initial_indent=" " * 6, subsequent_indent=" " * 6
            )
        lines.append("")
    return "\n".join(lines)


def reference_markdown(section: str | None = None) -> str:
    """The reference as Markdown: a heading, the section's description and a table per section."""
    lines: list[str] = []
    for title, description, docs in groups(section):
        heading = title if title == TOP_LEVEL else f"`{title}`"
        lines += [f"### {heading}", "", _markdown_text(description), ""]
        lines += ["| field | type | bounds | default | description |", "| --- | --- | --- | --- | --- |"]
        for d in docs:
            kind = " | ".join(f"`{text}`" if choice else text for text, choice in d.kinds)
            default = d.default if d.default in ("", REQUIRED) else f"`{d.default}`"
            cells = [f"`{d.name}`", kind, d.bounds, default, _markdown_text(d.description)]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)


def docs_block(text: str) -> str:
    """What a document holds between the markers (without the newlines next to them)."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[start + len(BEGIN) : end].strip("\n")


def with_reference(text: str) -> str:
    """`text` with the block between the markers replaced by the Markdown reference."""
    docs_block(text)  # both markers, in order
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return f"{text[:start]}\n{reference_markdown().rstrip()}\n{text[end:]}"


# ---------------------------------------------------------------------------------------------
# Types, bounds and defaults as text


def _kinds(annotation: Any) -> tuple[tuple[str, bool], ...]:
    """The alternatives of a field's type: a literal's choices (marked), `None`, or a type's name."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _kinds(args[0])
    if origin in (Union, UnionType):
        return tuple(k for a in args for k in _kinds(a))
    if origin is Literal:
        return tuple((str(a), True) for a in args)
    if annotation is type(None):
        return (("None", False),)
    return ((_type_name(annotation), False),)


def _type_name(annotation: Any) -> str:
    if _is_section(annotation):
        return "section"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin in (Union, UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = {
    annotated_types.Gt: (">", "gt"),
    annotated_types.Ge: (">=", "ge"),
    annotated_types.Lt: ("<", "lt"),
    annotated_types.Le: ("<=", "le"),
    annotated_types.MinLen: ("length >=", "min_length"),
    annotated_types.MaxLen: ("length <=", "max_length"),
}


def _bounds(info: FieldInfo) -> str:
    """The field's bounds (`>= 1, <= 256`); for a tuple whose items share bounds, `each ...`."""
    said = _said_bounds(info.metadata)
    if said or get_origin(info.annotation) is not tuple:
        return said
    items = {_said_bounds(getattr(a, "__metadata__", ())) for a in get_args(info.annotation)}
    return f"each {items.pop()}" if len(items) == 1 and "" not in items else ""


def _said_bounds(metadata: Any) -> str:
    parts = []
    # an item's Field(...) in an Annotated holds its bounds in its own metadata
    flat = [b for m in metadata for b in (m.metadata if isinstance(m, FieldInfo) else [m])]
    for m in flat:
        if type(m) in _BOUNDS:
            sign, attr = _BOUNDS[type(m)]
            parts.append(f"{sign} {_value(getattr(m, attr))}")
    return ", ".join(parts)


def _default(info: FieldInfo) -> str:
    """The default as a config file writes it; '' for a section (its fields have theirs)."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return "" if isinstance(value, BaseModel) else _value(value)
    return REQUIRED if info.default is PydanticUndefined else _value(info.default)


def _value(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, str) and value and value.isprintable() and value == value.strip():
        return value  # as YAML takes it: gpt2, runs/{preset}
    if isinstance(value, bool | str | list | tuple | dict):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    if isinstance(value, int):
        return f"{value:_}" if abs(value) >= 10_000 else str(value)
    return repr(value)


def _section_in(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The section a field holds (also optional), and whether it holds a list of them."""
    if _is_section(annotation):
        return annotation, False
    origin, args = get_origin(annotation), get_args(annotation)
    for a in args:
        if _is_section(a):
            return a, origin is list
    return None, False


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _markdown_text(text: str) -> str:
    """`text` for a Markdown table cell: `*` and `<` escaped outside code spans, on one line."""
    parts = text.replace("\n", " ").split("`")
    return "`".join(p if i % 2 else p.replace("*", "\\*").replace("<", "\\<") for i, p in enumerate(parts))


if __name__ == "__main__":  # python -m pretrain.config.reference docs/configuration.md
    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(with_reference(path.read_text()))
