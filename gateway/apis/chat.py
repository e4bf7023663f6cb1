"""OpenAI chat completions (`POST /v1/chat/completions`): messages with roles, content parts, tools and tool calls."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gateway.apis.openai_fields import GENERATION_FIELDS, check_fields, check_model, check_tools, objects
from gateway.apis.shape import Api, CountForm, Location, PromptText
from gateway.errors import invalid_request
from gateway.tool_text import TOOL_KEYS, tool_descriptions

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


class Chat(Api):
    name = "chat"
    path = "/v1/chat/completions"
    operation = "chat"
    # OpenAI and vLLM honour max_completion_tokens when a request names both
    output_fields = ("max_completion_tokens", "max_tokens")
    choice_fields = ("n",)
    prompt_keys = frozenset(("messages", *TOOL_KEYS))
    array_fields = ("messages",)

    def check(self, payload: dict[str, Any]) -> None:
        check_model(payload)
        check_fields(payload, GENERATION_FIELDS)
        for key in TOOL_KEYS:
            check_tools(key, payload.get(key))
        check_messages(payload.get("messages"))

    def texts(self, payload: dict[str, Any]) -> Iterator[PromptText]:
        yield from message_texts(payload.get("messages"), ("messages",))
        yield from tool_definition_texts(payload)

    def is_prompt(self, loc: Location) -> bool:
        if loc[0] == "messages":  # messages[i].content..., messages[i].tool_calls[j].function.arguments
            return len(loc) >= 3 and (
                loc[2] == "content"
                or (len(loc) == 6 and loc[2] == "tool_calls" and loc[4] == "function" and loc[5] == "arguments")
            )
        return is_tool_description(loc)

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        return "chat", payload.get("messages")


def message_texts(messages: Any, at: Location) -> Iterator[PromptText]:
    """Chat messages' text: string content, text parts, and the arguments of earlier tool calls."""
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            continue
        role, loc = message["role"], (*at, i)
        content = message.get("content")
        if isinstance(content, str):
            yield PromptText(content, role, (*loc, "content"), message)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield PromptText(part["text"], role, (*loc, "content", j, "text"), part)
        calls = message.get("tool_calls")
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                where = (*loc, "tool_calls", j, "function", "arguments")
                yield PromptText(function["arguments"], role, where, function, "tool_arguments")


def tool_definition_texts(payload: dict[str, Any]) -> Iterator[PromptText]:
    for holder, _key, loc in tool_descriptions(payload):
        yield PromptText(holder["description"], "system", loc, holder, "tool_definition")


def is_tool_description(loc: Location) -> bool:
    """tools[i].function..., functions[i]..., tools[i]...: any description at least three levels down."""
    return loc[0] in TOOL_KEYS and len(loc) >= 3 and loc[-1] == "description"


def check_messages(messages: Any) -> None:
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
    for where, call in objects(calls, param):
        if "function" not in call:
            continue  # another call type: the upstream's to judge
        function = call["function"]
        if not isinstance(function, dict):
            raise invalid_request(f"'{where}.function' must be an object", param=f"{where}.function")
        for key in ("name", "arguments"):
            if not isinstance(function.get(key), str):
                raise invalid_request(f"'{where}.function.{key}' must be a string", param=f"{where}.function.{key}")
