"""The field reference generated from the tree: `pretrain fields`, and docs/configuration.md in sync."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pretrain.cli import main
from pretrain.config.reference import docs_block, reference_markdown, reference_text, sections
from pretrain.config.tree import RunConfig
from tests.conftest import ROOT

DOCS = ROOT / "docs" / "configuration.md"
REGENERATE = "run `.venv/bin/python -m pretrain.config.reference docs/configuration.md`"


def every_field(model: type[BaseModel] = RunConfig, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted name, field) for every field of the tree, read independently of the reference."""
    for name, info in model.model_fields.items():
        yield prefix + name, info
        for a in (info.annotation, *get_args(info.annotation)):
            if isinstance(a, type) and issubclass(a, BaseModel):
                many = get_origin(info.annotation) is list
                yield from every_field(a, f"{prefix}{name}{'[]' if many else ''}.")


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_the_docs_hold_the_generated_reference():
    block = docs_block(DOCS.read_text())
    assert block == reference_markdown().strip("\n"), (
        f"docs/configuration.md's field reference (between its fields markers) is out of date: {REGENERATE}"
    )


def test_every_field_is_listed_with_its_description():
    listing, markdown = reference_text(), reference_markdown()
    text = one_line(listing)
    fields = list(every_field())
    assert len(fields) > 150
    for name, info in fields:
        assert info.description, f"{name}: every field has a description"
        if name in sections():  # a section's block: its name and description head it
            assert f"{name}: {info.description}\n" in listing and f"### `{name}`" in markdown
            continue
        assert f"  {name}  (" in listing, f"{name}: not in `pretrain fields`"
        assert one_line(info.description) in text, f"{name}: its description is not in `pretrain fields`"
        assert f"| `{name}` |" in markdown, f"{name}: not in `pretrain fields --markdown`"


@pytest.mark.parametrize(
    "name, says",
    [
        ("model.n_layer", "(int, >= 1, <= 256, default 2)"),
        ("zero.stage", "(0 | 1 | 2 | 3, default 0)"),
        ("optimizer.betas", "each >= 0.0, < 1.0, default [0.9, 0.95]"),
        ("model.vocab_size", "(int | None, >= 2, <= 1_048_576, default None)"),
        ("data.blend[].weight", "(float | list[tuple[float, float]], default required)"),
        ("logging.progress_bar", "(bool | auto, default auto)"),
    ],
)
def test_types_choices_bounds_and_defaults_are_shown(name: str, says: str):
    line = next(x for x in reference_text().splitlines() if x.startswith(f"  {name}  ("))
    assert says in line


def test_fields_of_one_section_through_main(capsys):
    assert main(["fields", "model"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: ")
    assert "model.n_layer" in out and "model.init_from.path" in out
    assert "data.corpus" not in out and "zero.stage" not in out


def test_markdown_through_main(capsys):
    assert main(["fields", "--markdown"]) == 0
    assert capsys.readouterr().out == reference_markdown()


def test_an_unknown_section_is_one_error_naming_the_sections(capsys):
    assert main(["fields", "modle"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "unknown section 'modle' (did you mean 'model'?)" in captured.err
    assert ", ".join(sections()) in captured.err
    assert "Traceback" not in captured.err


def test_config_help_points_to_fields(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["config", "--help"])
    assert exit.value.code == 0
    assert "`pretrain fields` lists every field" in one_line(capsys.readouterr().out)


def test_every_top_level_section_has_a_block():
    text = reference_text()
    for name in sections():
        info: Any = RunConfig.model_fields[name]
        assert f"{name}: {info.description}" in text
