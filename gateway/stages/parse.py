"""Parse stage: bounded body read, JSON decode within the operator's limits, and the OpenAI schema essentials every
later stage relies on.

Everything after it trusts what it checked: a field the gateway (or the bundled engine) reads has the type OpenAI
documents, so bad input is a 400 here and never a 500 in a later stage. Big bodies are decoded and checked on the
offload executor (gateway/offload.py): decoding and walking a 4 MB body takes the event loop tens of milliseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

from starlette.requests import ClientDisconnect

from gateway import json_bounds
from gateway.config import LimitsConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError, invalid_request
from gateway.offload import Offload
from gateway.shape_gate import ShapeGate

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class ParseStage:
    name = "parse"

    def __init__(self, limits: LimitsConfig, offload: Offload, gate: ShapeGate) -> None:
        self.limits = limits
        self.max_body_bytes = limits.max_body_bytes
        self._offload = offload
        self._gate = gate

    async def __call__(self, ctx: RequestContext) -> None:
        body = await self._read_body(ctx)
        await self._gate.check(ctx.route, body)
        payload, values = await self._offload.run(
            self._offload.is_big(len(body)), parse_body, ctx.route, body, self.limits
        )
        ctx.body = body
        ctx.payload = payload
        ctx.json_values = values
        ctx.model = payload["model"]
        ctx.stream = bool(payload.get("stream", False))
        ctx.span.set_attribute("gen_ai.request.model", ctx.model)

    async def _read_body(self, ctx: RequestContext) -> bytes:
        """The body, bounded in bytes as it arrives and in time between its chunks (a slow client holds a slot)."""
        request = ctx.request
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        idle = self.limits.body_idle_timeout
        loop = asyncio.get_running_loop()
        chunks, size = [], 0
        try:
            async with asyncio.timeout(idle) as stalled:  # one timer, moved on by every chunk
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        raise ClientDisconnect()
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise _too_large(self.max_body_bytes)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
                    stalled.reschedule(loop.time() + idle)
        except TimeoutError:
            raise GatewayError(
                408, f"request body stalled for {idle:g}s", code="body_timeout", headers={"connection": "close"}
            ) from None


def parse_body(route: str, body: bytes, limits: LimitsConfig) -> tuple[dict[str, Any], int]:
    """The payload and its count of values: limits first, so the schema checks walk a bounded payload."""
    payload = json_bounds.decode(body, limits)
    if not isinstance(payload, dict):
        raise invalid_request("request body must be a JSON object", code="invalid_json")
    _check_array_lengths(payload, limits)
    values = json_bounds.within_limits_unwalked(body, limits) or json_bounds.check_shape(payload, limits)
    _check_common(payload)
    if route == "chat":
        _check_messages(payload.get("messages"))
    else:
        _check_prompt(payload.get("prompt"))
    return payload, values


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body exceeds the {limit}-byte limit", code="request_too_large")


def _check_array_lengths(payload: dict[str, Any], limits: LimitsConfig) -> None:
    """The arrays with limits of their own, checked before the walk so the error names them, not a total."""
    for key, limit, setting in (
        ("messages", limits.max_messages, "limits.max_messages"),
        ("tools", limits.max_tools, "limits.max_tools"),
        ("functions", limits.max_tools, "limits.max_tools"),
    ):
        value = payload.get(key)
        if isinstance(value, list) and len(value) > limit:
            raise json_bounds.array_too_long(key, len(value), limit, setting)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_string_or_strings(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


# Optional top-level fields: (key, valid, what a valid value is). The gateway, or the engine behind it, reads them.
_FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("stream", lambda v: isinstance(v, bool), "a boolean"),
    ("max_tokens", lambda v: _is_int(v) and v >= 1, "a positive integer"),
    ("max_completion_tokens", lambda v: _is_int(v) and v >= 1, "a positive integer"),
    ("n", lambda v: _is_int(v) and v >= 1, "a positive integer"),
    ("temperature", lambda v: _is_number(v) and 0 <= v <= 2, "a number between 0 and 2"),
    ("top_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number between 0 and 1"),
    ("presence_penalty", lambda v: _is_number(v) and -2 <= v <= 2, "a number between -2 and 2"),
    ("frequency_penalty", lambda v: _is_number(v) and -2 <= v <= 2, "a number between -2 and 2"),
    ("seed", _is_int, "an integer"),
    ("logprobs", lambda v: isinstance(v, bool) or (_is_int(v) and v >= 0), "a boolean (a count for completions)"),
    ("top_logprobs", lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    ("stop", _is_string_or_strings, "a string or an array of strings"),
    ("user", lambda v: isinstance(v, str), "a string"),
    ("stream_options", lambda v: isinstance(v, dict), "an object"),
    ("response_format", lambda v: isinstance(v, dict), "an object"),
    ("tool_choice", lambda v: isinstance(v, (str, dict)), "a string or an object"),
    (
        "logit_bias",
        lambda v: isinstance(v, dict) and all(_is_number(b) and -100 <= b <= 100 for b in v.values()),
        "an object of token ids to numbers between -100 and 100",
    ),
)


def _check_common(payload: dict[str, Any]) -> None:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is required and must be a non-empty string", param="model")
    for key, valid, what in _FIELDS:
        value = payload.get(key)
        if value is not None and not valid(value):
            raise invalid_request(f"'{key}' must be {what}", param=key)
    for key in ("tools", "functions"):
        _check_tools(key, payload.get(key))


def _check_tools(key: str, tools: Any) -> None:
    """`tools`: [{"type": "function", "function": {"name", ...}}]; the deprecated `functions`: [{"name", ...}]."""
    for param, tool in _objects(tools, key):
        if key == "tools":
            if not isinstance(tool.get("type"), str):
                raise invalid_request(f"'{param}.type' must be a string", param=f"{param}.type")
            if "function" not in tool:
                continue  # another tool type (a hosted tool): the upstream's to judge
            tool, param = tool["function"], f"{param}.function"
            if not isinstance(tool, dict):
                raise invalid_request(f"'{param}' must be an object", param=param)
        _check_function(tool, param)


def _objects(items: Any, param: str) -> Iterator[tuple[str, dict[str, Any]]]:
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


def _check_function(function: dict[str, Any], param: str) -> None:
    if not isinstance(function.get("name"), str):
        raise invalid_request(f"'{param}.name' must be a string", param=f"{param}.name")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "an object")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise invalid_request(f"'{param}.{key}' must be {what}", param=f"{param}.{key}")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid_request(f"'{param}' must be an object", param=param)
        if message.get("role") not in _ROLES:
            raise invalid_request(f"'{param}.role' must be one of {sorted(_ROLES)}", param=f"{param}.role")
        content = message.get("content")
        if isinstance(content, list):
            _check_parts(content, f"{param}.content")
        elif content is not None and not isinstance(content, str):
            raise invalid_request(f"'{param}.content' must be a string or an array of parts", param=f"{param}.content")
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise invalid_request(f"'{param}.{key}' must be a string", param=f"{param}.{key}")
        _check_tool_calls(message.get("tool_calls"), f"{param}.tool_calls")


def _check_parts(parts: list[Any], param: str) -> None:
    """Content parts: text parts need string text (every stage reads it); other part types pass through."""
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid_request(f"'{where}' must be an object with a string 'type'", param=where)
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise invalid_request(f"'{where}.text' must be a string", param=f"{where}.text")


def _check_tool_calls(calls: Any, param: str) -> None:
    """An assistant's earlier tool calls: the WAF and the guard read their arguments, the chat template renders them."""
    for where, call in _objects(calls, param):
        if "function" not in call:
            continue  # another call type: the upstream's to judge
        function = call["function"]
        if not isinstance(function, dict):
            raise invalid_request(f"'{where}.function' must be an object", param=f"{where}.function")
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise invalid_request(f"'{where}.function.{key}' must be a string", param=f"{where}.function.{key}")


def _check_prompt(prompt: Any) -> None:
    """A completions prompt: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt) or _is_token_ids(prompt):
            return
    raise invalid_request("'prompt' must be a string, an array of strings, or an array of token ids", param="prompt")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) and t >= 0 for t in value)
