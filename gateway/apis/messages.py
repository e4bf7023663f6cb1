"""Anthropic Messages (`POST /v1/messages`, `POST /v1/messages/count_tokens`): a system prompt, messages of content
blocks (text, images, tool_use, tool_result), tools with input schemas. Errors answer in Anthropic's shape.

An `anthropic` pool receives the request as sent; an `openai` pool receives it translated to chat completions
(gateway/apis/anthropic/), which is also how it is counted, so the count is the one the engine computes.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from gateway.apis.anthropic.carriers import MESSAGES
from gateway.apis.anthropic.checks import MessagesRequestError, check_messages_request
from gateway.apis.anthropic.errors import anthropic_error
from gateway.apis.anthropic.to_chat import messages_to_chat
from gateway.apis.shape import Api, CountForm
from gateway.errors import GatewayError, invalid_request
from gateway.streaming.sse import typed_event


class Messages(Api):
    name = "messages"
    path = "/v1/messages"
    operation = "chat"
    fill_field = None  # max_tokens is required
    carriers = MESSAGES
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

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        """The chat it is translated to for an OpenAI-compatible pool (exact for its tokenizer). What only an
        Anthropic pool serves (server tools, file sources) has no translation: its texts, counted as one turn."""
        try:
            return "chat", messages_to_chat(payload)["messages"]
        except MessagesRequestError:
            return "chat", [{"role": "user", "content": "\n".join(t.text for t in self.inventory(payload).texts())}]


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
