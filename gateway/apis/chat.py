"""OpenAI chat completions (`POST /v1/chat/completions`): messages with roles, content parts, tools and tool calls."""

from __future__ import annotations

from typing import Any

from gateway.apis.openai_carriers import CHAT
from gateway.apis.openai_fields import GENERATION_FIELDS, TOOL_KEYS, check_fields, check_model, check_tools, objects
from gateway.apis.shape import Api, CountForm
from gateway.errors import invalid_request

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class Chat(Api):
    name = "chat"
    path = "/v1/chat/completions"
    operation = "chat"
    # OpenAI and vLLM honour max_completion_tokens when a request names both
    output_fields = ("max_completion_tokens", "max_tokens")
    choice_fields = ("n",)
    carriers = CHAT
    array_fields = ("messages",)

    def check(self, payload: dict[str, Any]) -> None:
        check_model(payload)
        check_fields(payload, GENERATION_FIELDS)
        for key in TOOL_KEYS:
            check_tools(key, payload.get(key))
        check_messages(payload.get("messages"))

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        return "chat", payload.get("messages")


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array", param="messages")
    for i, message in enumerate(messages):  # each message's path is written only where it is named
        if not isinstance(message, dict):
            raise invalid_request(f"'messages[{i}]' must be an object", param=f"messages[{i}]")
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise invalid_request(f"'messages[{i}].role' must be one of {sorted(_ROLES)}", param=f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):
            _check_parts(content, f"messages[{i}].content")
        elif content is not None and not isinstance(content, str):
            param = f"messages[{i}].content"
            raise invalid_request(f"'{param}' must be a string or an array of parts", param=param)
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise invalid_request(f"'messages[{i}].{key}' must be a string", param=f"messages[{i}].{key}")
        if (calls := message.get("tool_calls")) is not None:
            _check_tool_calls(calls, f"messages[{i}].tool_calls")


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
    for where, call in objects(calls, param):
        if "function" not in call:
            continue  # another call type: the upstream's to judge
        function = call["function"]
        if not isinstance(function, dict):
            raise invalid_request(f"'{where}.function' must be an object", param=f"{where}.function")
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise invalid_request(f"'{where}.function.{key}' must be a string", param=f"{where}.function.{key}")
