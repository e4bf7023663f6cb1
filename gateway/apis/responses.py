"""OpenAI Responses (`POST /v1/responses`): `instructions`, and `input` as a string or a list of items (messages,
earlier function calls and their outputs); hosted tools and `previous_response_id` pass through to the upstream.

Its text is read in place (redaction rewrites the items themselves); it is counted as the chat the items stand for
(`backend_engine.openai_protocol.responses_input`, the same conversion the bundled engine renders).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gateway.apis.chat import is_tool_description, tool_definition_texts
from gateway.apis.openai_fields import (
    STREAM,
    TEMPERATURE,
    TOOL_CHOICE,
    TOP_P,
    USER,
    check_fields,
    check_model,
    check_tools,
    is_int,
    objects,
)
from gateway.apis.shape import Api, CountForm, Location, PromptText
from gateway.errors import GatewayError, invalid_request
from gateway.sse import typed_event

_MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_ITEM_FIELDS = frozenset({"type", "role", "id", "call_id", "name", "status"})  # an item's labels: application fields
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_FIELDS = (
    STREAM,
    TEMPERATURE,
    TOP_P,
    USER,
    TOOL_CHOICE,
    ("max_output_tokens", lambda v: is_int(v) and v >= 1, "a positive integer"),
    ("instructions", lambda v: isinstance(v, str), "a string"),
    ("previous_response_id", lambda v: isinstance(v, str), "a string"),
    ("store", lambda v: isinstance(v, bool), "a boolean"),
    ("parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean"),
    ("metadata", lambda v: isinstance(v, dict), "an object"),
    ("text", lambda v: isinstance(v, dict), "an object"),
    ("reasoning", lambda v: isinstance(v, dict), "an object"),
)


class Responses(Api):
    name = "responses"
    path = "/v1/responses"
    operation = "chat"
    output_fields = ("max_output_tokens",)
    fill_field = "max_output_tokens"
    prompt_keys = frozenset(("instructions", "input", "tools"))
    array_fields = ("input",)

    def check(self, payload: dict[str, Any]) -> None:
        check_model(payload)
        check_fields(payload, _FIELDS)
        check_tools("tools", payload.get("tools"))
        items = payload.get("input")
        if isinstance(items, str):
            return
        if not isinstance(items, list) or not items:
            raise invalid_request("'input' must be a string or a non-empty array of items", param="input")
        for where, item in objects(items, "input"):
            _check_item(item, where)

    def texts(self, payload: dict[str, Any]) -> Iterator[PromptText]:
        if isinstance(payload.get("instructions"), str):
            yield PromptText(payload["instructions"], "system", ("instructions",), payload)
        items = payload.get("input")
        if isinstance(items, str):
            yield PromptText(items, "user", ("input",), payload)
        for i, item in enumerate(items if isinstance(items, list) else ()):
            yield from _item_texts(item, ("input", i))
        yield from tool_definition_texts(payload)

    def is_prompt(self, loc: Location) -> bool:
        if loc[0] == "instructions" or loc == ("input",):
            return True
        if loc[0] == "input":  # what an item says (content, arguments, output, a reasoning summary, its encrypted
            return len(loc) >= 3 and loc[2] not in _ITEM_FIELDS  # state), not how it is labelled
        return is_tool_description(loc)

    def stream_error(self, error: GatewayError) -> bytes:
        """Responses' `error` event (its stream has no [DONE])."""
        body = {
            "type": "error",
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "sequence_number": 0,
        }
        return typed_event(body)

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        """The chat the items stand for, as the bundled engine renders them (exact for its tokenizer). What only a
        hosted pool reads (image and file parts, item references, item types the engine does not know) has no chat
        form there, but it passed `check` and is the pool's to judge, not a 400 here: its texts, counted as one
        turn, as Messages counts what has no translation."""
        from backend_engine.model.prompt import PromptError
        from backend_engine.openai_protocol.responses_input import responses_messages

        try:
            return "chat", responses_messages(payload)
        except PromptError:
            return "chat", [{"role": "user", "content": "\n".join(t.text for t in self.texts(payload))}]


def _item_kind(item: dict[str, Any]) -> str:
    kind = item.get("type")
    return kind if isinstance(kind, str) else "message"


def _check_item(item: dict[str, Any], where: str) -> None:
    kind = _item_kind(item)
    if kind == "message":
        if item.get("role") not in _MESSAGE_ROLES:
            raise invalid_request(f"'{where}.role' must be one of {sorted(_MESSAGE_ROLES)}", param=f"{where}.role")
        _check_content(item.get("content"), f"{where}.content", required=True)
    elif kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise invalid_request(f"'{where}.{key}' must be a string", param=f"{where}.{key}")
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise invalid_request(f"'{where}.call_id' must be a string", param=f"{where}.call_id")
        _check_content(item.get("output"), f"{where}.output", required=True)
    # other item types (reasoning, item references, hosted tools' calls) are the upstream's to judge


def _check_content(content: Any, where: str, *, required: bool) -> None:
    if isinstance(content, str) or (content is None and not required):
        return
    if not isinstance(content, list):
        raise invalid_request(f"'{where}' must be a string or an array of content parts", param=where)
    for param, part in objects(content, where):
        if not isinstance(part.get("type"), str):
            raise invalid_request(f"'{param}.type' must be a string", param=f"{param}.type")
        if part["type"] in _TEXT_PARTS and not isinstance(part.get("text", part.get("refusal")), str):
            raise invalid_request(f"'{param}.text' must be a string", param=f"{param}.text")


def _item_texts(item: Any, loc: Location) -> Iterator[PromptText]:
    if not isinstance(item, dict):
        return
    kind = _item_kind(item)
    if kind == "message" and isinstance(item.get("role"), str):
        yield from _content_texts(item, "content", item["role"], loc)
    elif kind == "function_call" and isinstance(item.get("arguments"), str):
        yield PromptText(item["arguments"], "assistant", (*loc, "arguments"), item, "tool_arguments")
    elif kind == "function_call_output":
        yield from _content_texts(item, "output", "tool", loc)
    elif kind == "reasoning":  # the model's own summary of its reasoning, sent back
        yield from _content_texts(item, "summary", "assistant", loc)


def _content_texts(item: dict[str, Any], key: str, role: str, loc: Location) -> Iterator[PromptText]:
    content = item.get(key)
    if isinstance(content, str):
        yield PromptText(content, role, (*loc, key), item)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                yield PromptText(part["text"], role, (*loc, key, j, "text"), part)
