"""OpenAI Responses (`POST /v1/responses`): `instructions`, and `input` as a string or a list of items (messages,
earlier function calls and their outputs); hosted tools and `previous_response_id` pass through to the upstream.

Its text is read in place (redaction rewrites the items themselves); it is counted as the chat the items stand for
(`backend_engine.http.openai_protocol.responses_input`, the same conversion the bundled engine renders).
"""

from __future__ import annotations

from typing import Any

from gateway.apis.openai_carriers import RESPONSES
from gateway.apis.openai_fields import (
    STREAM,
    TEMPERATURE,
    TOOL_CHOICE,
    TOP_P,
    USER,
    FieldChecks,
    check_fields,
    check_model,
    check_tools,
    is_int,
    objects,
)
from gateway.apis.shape import Api, CountForm
from gateway.errors import GatewayError, invalid_request
from gateway.streaming.sse import typed_event

_MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
_FIELDS = FieldChecks(
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
    carriers = RESPONSES
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
        from backend_engine.http.openai_protocol.responses_input import responses_messages
        from backend_engine.model.prompt import PromptError

        try:
            return "chat", responses_messages(payload)
        except PromptError:
            return "chat", [{"role": "user", "content": "\n".join(t.text for t in self.inventory(payload).texts())}]


def _item_kind(item: dict[str, Any]) -> str:
    kind = item.get("type")
    return kind if isinstance(kind, str) else "message"


def _check_item(item: dict[str, Any], where: str) -> None:
    kind = _item_kind(item)
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _MESSAGE_ROLES:
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
