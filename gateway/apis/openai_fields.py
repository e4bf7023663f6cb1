"""Checks shared by the OpenAI request shapes: the model, typed optional fields, and function tool definitions.

A field the gateway (or the engine behind it) reads must have the type OpenAI documents, so bad input is a 400 at
parse and never a 500 in a later stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

from gateway.errors import invalid_request

TOOL_KEYS = ("tools", "functions")  # `functions` is the deprecated form of `tools`

# (key, valid, what a valid value is)
FieldCheck = tuple[str, Callable[[Any], bool], str]


class FieldChecks:
    """A shape's typed optional fields. A request names a few of them, so a payload is checked by its own keys (one
    lookup each), not by every field the shape knows; a bad one is named as the ordered walk would name it, the
    first in this order."""

    __slots__ = ("ordered", "by_key")

    def __init__(self, *checks: FieldCheck) -> None:
        self.ordered = checks
        self.by_key = {key: valid for key, valid, _ in checks}


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_ids(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and bool(value) and all(is_int(t) and t >= 0 for t in value)


def _is_string_or_strings(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


STREAM: FieldCheck = ("stream", lambda v: isinstance(v, bool), "a boolean")
TEMPERATURE: FieldCheck = ("temperature", lambda v: is_number(v) and 0 <= v <= 2, "a number between 0 and 2")
TOP_P: FieldCheck = ("top_p", lambda v: is_number(v) and 0 <= v <= 1, "a number between 0 and 1")
USER: FieldCheck = ("user", lambda v: isinstance(v, str), "a string")
TOOL_CHOICE: FieldCheck = ("tool_choice", lambda v: isinstance(v, (str, dict)), "a string or an object")

# Chat and completions: the fields the gateway, or the engine behind it, reads.
GENERATION_FIELDS = FieldChecks(
    STREAM,
    ("max_tokens", lambda v: is_int(v) and v >= 1, "a positive integer"),
    ("max_completion_tokens", lambda v: is_int(v) and v >= 1, "a positive integer"),
    ("n", lambda v: is_int(v) and v >= 1, "a positive integer"),
    TEMPERATURE,
    TOP_P,
    ("presence_penalty", lambda v: is_number(v) and -2 <= v <= 2, "a number between -2 and 2"),
    ("frequency_penalty", lambda v: is_number(v) and -2 <= v <= 2, "a number between -2 and 2"),
    ("seed", is_int, "an integer"),
    ("logprobs", lambda v: isinstance(v, bool) or (is_int(v) and v >= 0), "a boolean (a count for completions)"),
    ("top_logprobs", lambda v: is_int(v) and v >= 0, "a non-negative integer"),
    ("stop", _is_string_or_strings, "a string or an array of strings"),
    USER,
    ("stream_options", lambda v: isinstance(v, dict), "an object"),
    ("response_format", lambda v: isinstance(v, dict), "an object"),
    TOOL_CHOICE,
    (
        "logit_bias",
        lambda v: isinstance(v, dict) and all(is_number(b) and -100 <= b <= 100 for b in v.values()),
        "an object of token ids to numbers between -100 and 100",
    ),
)


def check_model(payload: dict[str, Any]) -> None:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is required and must be a non-empty string", param="model")


def check_fields(payload: dict[str, Any], fields: FieldChecks) -> None:
    by_key = fields.by_key
    for key, value in payload.items():  # the payload's own keys find whether any field is bad
        valid = by_key.get(key)
        if valid is not None and value is not None and not valid(value):
            break
    else:
        return
    for name, check, what in fields.ordered:  # the error names the first bad one in the shape's order
        given = payload.get(name)
        if given is not None and not check(given):
            raise invalid_request(f"'{name}' must be {what}", param=name)


def check_tools(key: str, tools: Any) -> None:
    """`tools`: [{"type": "function", "function": {"name", ...}}] (chat), [{"type": "function", "name", ...}]
    (Responses); the deprecated `functions`: [{"name", ...}]. Other tool types (hosted tools) are the upstream's to
    judge."""
    if tools is None:  # most requests: no walk started
        return
    for param, tool in objects(tools, key):
        if key == "tools":
            if not isinstance(tool.get("type"), str):
                raise invalid_request(f"'{param}.type' must be a string", param=f"{param}.type")
            if "function" in tool:
                tool, param = tool["function"], f"{param}.function"
                if not isinstance(tool, dict):
                    raise invalid_request(f"'{param}' must be an object", param=param)
            elif tool["type"] != "function":
                continue
        check_function(tool, param)


def objects(items: Any, param: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each member of an optional array that must hold objects, with its JSON path; a 400 naming the first that
    does not (absent: nothing)."""
    if items is None:
        return
    if not isinstance(items, list):
        raise invalid_request(f"'{param}' must be an array", param=param)
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"'{where}' must be an object", param=where)
        yield where, item


def check_function(function: dict[str, Any], param: str) -> None:
    if not isinstance(function.get("name"), str):
        raise invalid_request(f"'{param}.name' must be a string", param=f"{param}.name")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "an object")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise invalid_request(f"'{param}.{key}' must be {what}", param=f"{param}.{key}")
