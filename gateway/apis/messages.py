"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`): a system prompt, messages of content
blocks (text, images, tool_use, tool_result), tools with input schemas. Errors answer in Anthropic's shape.

An `anthropic` pool receives the request as sent; an `openai` pool receives it translated to chat completions
(gateway/apis/anthropic_chat.py), which is also how it is counted, so the count is the one the engine computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from starlette.responses import Response

from gateway.apis.anthropic_chat import (
    MessagesRequestError,
    anthropic_error,
    check_messages_request,
    messages_to_chat,
)
from gateway.apis.chat import is_tool_description, tool_definition_texts
from gateway.apis.shape import Api, CountForm, Location, PromptText
from gateway.errors import GatewayError, invalid_request
from gateway.sse import typed_event


class Messages(Api):
    name = "messages"
    path = "/v1/messages"
    operation = "chat"
    fill_field = None  # max_tokens is required
    prompt_keys = frozenset(("system", "messages", "tools"))
    array_fields = ("messages",)

    def check(self, payload: dict[str, Any]) -> None:
        try:
            check_messages_request(payload)
        except MessagesRequestError as exc:
            raise invalid_request(str(exc), param=exc.param) from None

    def error_response(self, error: GatewayError) -> Response:
        return error.response(anthropic_error(error.status, error.message, error.type))

    def stream_error(self, error: GatewayError) -> bytes:
        return typed_event(anthropic_error(error.status, error.message, error.type))

    def texts(self, payload: dict[str, Any]) -> Iterator[PromptText]:
        system = payload.get("system")
        if isinstance(system, str):
            yield PromptText(system, "system", ("system",), payload)
        elif isinstance(system, list):
            yield from _block_texts(system, "system", ("system",))
        for i, message in enumerate(payload.get("messages") or ()):
            content = message.get("content")
            loc = ("messages", i, "content")
            if isinstance(content, str):
                yield PromptText(content, message["role"], loc, message)
            elif isinstance(content, list):
                yield from _block_texts(content, message["role"], loc)
        yield from tool_definition_texts(payload)

    def is_prompt(self, loc: Location) -> bool:
        if loc[0] == "system":
            return True
        if loc[0] == "messages":
            return len(loc) >= 3 and loc[2] == "content"
        return is_tool_description(loc)

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        """The chat it is translated to for an OpenAI-compatible pool (exact for its tokenizer). What only an
        Anthropic pool serves (server tools, file sources) has no translation: its texts, counted as one turn."""
        try:
            return "chat", messages_to_chat(payload)["messages"]
        except MessagesRequestError:
            return "chat", [{"role": "user", "content": "\n".join(t.text for t in self.texts(payload))}]


class CountTokens(Messages):
    """`POST /v1/messages/count_tokens`: the same body less `max_tokens`; answered `{"input_tokens": n}`."""

    name = "count_tokens"
    path = "/v1/messages/count_tokens"
    output_fields = ()

    def guarded(self, embeddings: bool) -> bool:
        return False  # counted, never sent to a model

    def check(self, payload: dict[str, Any]) -> None:
        super().check(_with_max_tokens(payload))

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        return super().counted(_with_max_tokens(payload))


def _with_max_tokens(payload: dict[str, Any]) -> dict[str, Any]:
    """A count_tokens body as the Messages body it is, less the max_tokens that nothing here generates."""
    return {"max_tokens": 1, **payload}


def _block_texts(blocks: list[Any], role: str, at: Location) -> Iterator[PromptText]:
    """Text blocks; a tool_use block's input (model-written arguments); a tool_result's content, as the tool role."""
    for j, block in enumerate(blocks):
        if not isinstance(block, dict):
            continue
        loc = (*at, j)
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            yield PromptText(block["text"], role, (*loc, "text"), block)
        elif kind == "tool_use":
            yield from _leaf_texts(block.get("input"), role, (*loc, "input"))
        elif kind == "tool_result":
            content = block.get("content")
            if isinstance(content, str):
                yield PromptText(content, "tool", (*loc, "content"), block)
            elif isinstance(content, list):
                yield from _block_texts(content, "tool", (*loc, "content"))


def _leaf_texts(node: Any, role: str, loc: Location) -> Iterator[PromptText]:
    """Every string in a tool call's input object, in document order (explicit stack: the input is client-shaped)."""
    stack: list[tuple[Location, Any, Any]] = [(loc, node, None)]
    while stack:
        where, value, holder = stack.pop()
        if isinstance(value, str) and holder is not None:
            yield PromptText(value, role, where, holder, "tool_arguments")
        elif isinstance(value, dict):
            stack.extend(((*where, k), v, value) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*where, i), value[i], value) for i in range(len(value) - 1, -1, -1))
