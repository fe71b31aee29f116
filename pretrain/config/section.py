"""The base of every section of the tree: unknown fields refused, no yes/no for a number, and
the rules across a section's fields (`broken_rules`) reported all at once."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, model_validator


class Section(BaseModel):
    """A section of the tree: unknown fields are errors, bounds live in the field types, and the
    rules across fields are `broken_rules`, all reported at once."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, data: Any) -> Any:
        """`n_layer: true` is a mistake, not 1: pydantic reads a bool as an int (or a float)."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                kinds = set(typing.get_args(field.annotation)) or {field.annotation}
                if isinstance(value, bool) and kinds & {int, float} and bool not in kinds:
                    raise ValueError(
                        f"{name}: {str(value).lower()} is a yes/no, not a number (write the number)"
                    )
        return data

    def broken_rules(self, context: dict[str, Any]) -> list[str]:
        """One message for each cross-field rule this section breaks (`context`: the world size)."""
        return []

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> Section:
        context = info.context or {}
        if context.get("rules_later"):  # `validate`'s second pass: the rules are asked for afterwards
            return self
        problems = self.broken_rules(context)
        if problems:
            raise ValueError("; ".join(problems))
        return self
