"""What a valid Messages request is (docs.anthropic.com Messages reference): the fields every later stage and the
translation read, checked before anything else reads them."""

from __future__ import annotations

from typing import Any

from gateway.json_path import dotted


class MessagesRequestError(ValueError):
    """A Messages request the gateway refuses (a 400 invalid_request_error), naming the field as a JSON path."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def field_error(loc: tuple, message: str) -> MessagesRequestError:
    """The refusal of the field at `loc` (a JSON path), saying what it must be."""
    path = dotted(loc)
    return MessagesRequestError(f"{path}: {message}" if path else message, path or None)


_ROLES = ("user", "assistant")
_TOOL_CHOICES = ("auto", "any", "tool", "none")


def check_messages_request(payload: dict[str, Any]) -> None:
    """The schema essentials every later stage relies on (docs.anthropic.com Messages reference); raises
    MessagesRequestError naming the first field that breaks them. Fields the gateway does not read pass."""
    if not isinstance(payload, dict):
        raise field_error((), "the request body must be a JSON object")
    _check_string(payload.get("model"), ("model",), required=True)
    max_tokens: Any = payload.get("max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise field_error(("max_tokens",), "required, a positive integer")
    _check_system(payload.get("system"))
    _check_messages(payload.get("messages"))
    _check_tools(payload.get("tools"))
    _check_tool_choice(payload.get("tool_choice"), payload.get("tools"))
    _check_sampling(payload)
    _check_optional_type(payload, "stream", bool, "a boolean")
    _check_optional_type(payload, "metadata", dict, "an object")
    _check_optional_type(payload, "thinking", dict, "an object")
    user_id = (payload.get("metadata") or {}).get("user_id")
    if user_id is not None:
        _check_string(user_id, ("metadata", "user_id"))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_string(value: Any, loc: tuple, *, required: bool = False) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or (required and not value):
        raise field_error(loc, "required, a non-empty string" if required else "must be a string")


def _check_optional_type(payload: dict[str, Any], key: str, kind: type, what: str) -> None:
    if payload.get(key) is not None and not isinstance(payload[key], kind):
        raise field_error((key,), f"must be {what}")


def _check_system(system: Any) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise field_error(("system",), "must be a string or an array of text blocks")
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise field_error(("system", i), "must be a text block")
        if not isinstance(block.get("text"), str):
            raise field_error(("system", i, "text"), "must be a string")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise field_error(("messages",), "required, a non-empty array")
    for i, message in enumerate(messages):
        loc: tuple = ("messages", i)
        if not isinstance(message, dict):
            raise field_error(loc, "must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise field_error((*loc, "role"), "must be 'user' or 'assistant'")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise field_error((*loc, "content"), "must be a string or an array of content blocks")
        for j, block in enumerate(content):
            _check_block(block, (*loc, "content", j), role)


def _check_block(block: Any, loc: tuple, role: str) -> None:
    """One content block: the fields translation reads, and tool blocks in the turn that may carry them."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise field_error(loc, "must be a content block (an object with a string type)")
    kind = block["type"]
    if kind == "text" and not isinstance(block.get("text"), str):
        raise field_error((*loc, "text"), "must be a string")
    if kind in ("image", "document") and not isinstance(block.get("source"), dict):
        raise field_error((*loc, "source"), "must be an object")
    if kind == "tool_use":
        if role != "assistant":
            raise field_error((*loc, "type"), "tool_use blocks belong to assistant messages")
        _check_string(block.get("id"), (*loc, "id"), required=True)
        _check_string(block.get("name"), (*loc, "name"), required=True)
        if not isinstance(block.get("input"), dict):
            raise field_error((*loc, "input"), "must be an object")
    if kind == "tool_result":
        if role != "user":
            raise field_error((*loc, "type"), "tool_result blocks belong to user messages")
        _check_string(block.get("tool_use_id"), (*loc, "tool_use_id"), required=True)
        _check_tool_result_content(block.get("content"), (*loc, "content"))
        if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
            raise field_error((*loc, "is_error"), "must be a boolean")


def _check_tool_result_content(content: Any, loc: tuple) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise field_error(loc, "must be a string or an array of content blocks")
    for k, inner in enumerate(content):
        _check_block(inner, (*loc, k), "user")
        if inner["type"] in ("tool_use", "tool_result"):
            raise field_error((*loc, k, "type"), "a tool result cannot hold tool blocks")


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise field_error(("tools",), "must be an array")
    for i, tool in enumerate(tools):
        loc: tuple = ("tools", i)
        if not isinstance(tool, dict):
            raise field_error(loc, "must be an object")
        if tool.get("type") not in (None, "custom"):
            _check_string(tool.get("type"), (*loc, "type"), required=True)
            continue  # a server tool: its own schema, checked where it is served
        _check_string(tool.get("name"), (*loc, "name"), required=True)
        _check_string(tool.get("description"), (*loc, "description"))
        if not isinstance(tool.get("input_schema"), dict):
            raise field_error((*loc, "input_schema"), "required, an object (a JSON Schema)")


def _check_tool_choice(choice: Any, tools: Any) -> None:
    """The choice's shape; and a choice that demands a tool call (any, tool) only beside tools, as Anthropic's API
    refuses it: translated for a chat pool, which takes no tool_choice without tools, it would be dropped and the
    model would answer in text. auto and none without tools mean what no choice means, so they pass."""
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICES:
        raise field_error(("tool_choice",), "must be an object with type auto, any, tool or none")
    if choice["type"] == "tool":
        _check_string(choice.get("name"), ("tool_choice", "name"), required=True)
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise field_error(("tool_choice", "disable_parallel_tool_use"), "must be a boolean")
    if choice["type"] in ("any", "tool") and not tools:
        raise field_error(("tool_choice",), f"type {choice['type']!r} may only be specified while providing tools")


def _check_sampling(payload: dict[str, Any]) -> None:
    stops = payload.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise field_error(("stop_sequences",), "must be an array of strings")
        for i, stop in enumerate(stops):
            _check_string(stop, ("stop_sequences", i), required=True)
    for key in ("temperature", "top_p"):
        value = payload.get(key)
        if value is not None and (not _is_number(value) or not 0 <= value <= 1):
            raise field_error((key,), "must be a number from 0 to 1")
    top_k = payload.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise field_error(("top_k",), "must be a non-negative integer")
