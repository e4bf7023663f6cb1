"""String enums that take YAML 1.1 booleans: `mode: off` means "off", whatever the parser read.

PyYAML follows YAML 1.1, where unquoted off/no/false (any case) are the boolean false and on/yes/true the boolean
true; editors and linters on YAML 1.2 read `off` as a string and show the file as valid. A field whose choices
include "off" or "on" is wrapped in `Switch[...]`, so false becomes "off" and true "on" before the choices are
checked (`yes` still fails where no choice is "on"), and its JSON Schema accepts the booleans that stand for a
choice.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BeforeValidator, Field

T = TypeVar("T")

YAML11_NOTE = 'YAML 1.1 reads unquoted off/no/false as false and on/yes/true as true: false means "off", true "on"'


def _from_bool(value: Any) -> Any:
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value


def _schema_accepts_bool(schema: dict[str, Any]) -> None:
    """The choices, or the booleans that stand for the ones among them named "off" and "on"."""
    choices = {key: schema.pop(key) for key in ("type", "enum", "const") if key in schema}
    named = set(choices.get("enum", [choices.get("const")]))
    booleans = [flag for flag, name in ((False, "off"), (True, "on")) if name in named]
    boolean = {"type": "boolean"} if len(booleans) == 2 else {"const": booleans[0]}
    schema["anyOf"] = [choices, {**boolean, "description": YAML11_NOTE}]


Switch = Annotated[T, BeforeValidator(_from_bool), Field(json_schema_extra=_schema_accepts_bool)]
