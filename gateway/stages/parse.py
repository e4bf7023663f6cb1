"""Parse stage: bounded body read, JSON decode, and the OpenAI schema essentials every later stage relies on."""

from __future__ import annotations

import json
from typing import Any

from gateway.context import RequestContext
from gateway.errors import GatewayError, invalid_request

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class ParseStage:
    name = "parse"

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes

    async def __call__(self, ctx: RequestContext) -> None:
        body = await self._read_body(ctx)
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise invalid_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise invalid_request("request body must be a JSON object", code="invalid_json")
        _check_common(payload)
        if ctx.route == "chat":
            _check_messages(payload.get("messages"))
        else:
            _check_prompt(payload.get("prompt"))
        ctx.body = body
        ctx.payload = payload
        ctx.model = payload["model"]
        ctx.stream = bool(payload.get("stream", False))
        ctx.span.set_attribute("gen_ai.request.model", ctx.model)

    async def _read_body(self, ctx: RequestContext) -> bytes:
        request = ctx.request
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        if length is not None:
            return await request.body()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            chunks.append(chunk)
        return b"".join(chunks)


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body exceeds the {limit}-byte limit", code="request_too_large")


def _check_common(payload: dict[str, Any]) -> None:
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is required and must be a non-empty string", param="model")
    if "stream" in payload and not isinstance(payload["stream"], bool):
        raise invalid_request("'stream' must be a boolean", param="stream")
    for key in ("max_tokens", "max_completion_tokens", "n"):
        value = payload.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise invalid_request(f"'{key}' must be a positive integer", param=key)
    for key, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        value = payload.get(key)
        if value is not None and (not _is_number(value) or not low <= value <= high):
            raise invalid_request(f"'{key}' must be a number between {low:g} and {high:g}", param=key)
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid_request("'stream_options' must be an object", param="stream_options")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        if content is not None and not isinstance(content, (str, list)):
            raise invalid_request(f"'{param}.content' must be a string or an array of parts",
                                  param=f"{param}.content")


def _check_prompt(prompt: Any) -> None:
    """A completions prompt: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(_is_token_ids(p) for p in prompt) or _is_token_ids(prompt):
            return
    raise invalid_request("'prompt' must be a string, an array of strings, or an array of token ids", param="prompt")


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
