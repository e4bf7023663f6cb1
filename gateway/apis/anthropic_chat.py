"""Anthropic's Messages API (`POST /v1/messages`) spoken to a pool that speaks OpenAI chat completions.

A Messages request becomes a chat-completions request, and the chat answer (a body, or a stream of chunks) becomes
a Message (or Anthropic's stream events), so that an `anthropic` SDK client cannot tell. The shapes follow the
public references: docs.anthropic.com "Messages" API reference and "Streaming Messages" guide, the "Errors" page,
platform.openai.com's chat-completions reference, and vLLM's extensions to it (`top_k`; a choice's `stop_reason`
naming the stop string that ended it; `reasoning_content`, or `reasoning` in newer releases, in message and delta).
Examples of each shape are recorded under tests/api_reference/.

What has no counterpart is named where it is decided: a tool result's `is_error` travels in its text; thinking
blocks sent back in history are dropped (a chat model takes no reasoning as input); server tools, file sources
and non-text documents are refused with a 400, never dropped silently; reasoning comes back as thinking blocks
only when the request asked for thinking, with an empty signature (the gateway cannot sign it).
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.apis.answers import token_count
from gateway.apis.chat_calls import StreamedCalls
from gateway.apis.streamed_json import StreamedJson
from gateway.json_path import dotted
from gateway.sse import typed_event

# --- errors ----------------------------------------------------------------------------------------------------

# docs.anthropic.com "Errors": the type each HTTP status carries; any other 4xx is an invalid_request_error.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # a pool without capacity is what Anthropic reports as overloaded (its 529)
    504: "timeout_error",  # the SDK's GatewayTimeoutErrorObject
    529: "overloaded_error",
}


# Types OpenAI's errors use too: there they say less than the status does (the gateway's WAF answers 403 with an
# invalid_request_error to OpenAI clients, which an Anthropic client knows as a permission_error).
_SHARED_WITH_OPENAI = frozenset({"invalid_request_error", "authentication_error"})


def anthropic_error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status: the documented ones, other 4xx invalid_request_error, other
    5xx (502 included: the upstream failed) api_error."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """The error body Anthropic's API and SDKs use: {"type": "error", "error": {"type", "message"}}; `kind` where
    it already is one of Anthropic's types (an Anthropic upstream's own), else the status's."""
    specific = kind in _ERROR_TYPES.values() and kind not in _SHARED_WITH_OPENAI
    known = kind if specific else anthropic_error_type(status)
    return {"type": "error", "error": {"type": known, "message": message}}


class MessagesRequestError(ValueError):
    """A Messages request the gateway refuses (a 400 invalid_request_error), naming the field as a JSON path."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _fail(loc: tuple, message: str) -> MessagesRequestError:
    path = dotted(loc)
    return MessagesRequestError(f"{path}: {message}" if path else message, path or None)


# --- request check ---------------------------------------------------------------------------------------------

_ROLES = ("user", "assistant")
_TOOL_CHOICES = ("auto", "any", "tool", "none")


def check_messages_request(payload: dict[str, Any]) -> None:
    """The schema essentials every later stage relies on (docs.anthropic.com Messages reference); raises
    MessagesRequestError naming the first field that breaks them. Fields the gateway does not read pass."""
    if not isinstance(payload, dict):
        raise _fail((), "the request body must be a JSON object")
    _check_string(payload.get("model"), ("model",), required=True)
    max_tokens: Any = payload.get("max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise _fail(("max_tokens",), "required, a positive integer")
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
        raise _fail(loc, "required, a non-empty string" if required else "must be a string")


def _check_optional_type(payload: dict[str, Any], key: str, kind: type, what: str) -> None:
    if payload.get(key) is not None and not isinstance(payload[key], kind):
        raise _fail((key,), f"must be {what}")


def _check_system(system: Any) -> None:
    if system is None or isinstance(system, str):
        return
    if not isinstance(system, list):
        raise _fail(("system",), "must be a string or an array of text blocks")
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _fail(("system", i), "must be a text block")
        if not isinstance(block.get("text"), str):
            raise _fail(("system", i, "text"), "must be a string")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _fail(("messages",), "required, a non-empty array")
    for i, message in enumerate(messages):
        loc: tuple = ("messages", i)
        if not isinstance(message, dict):
            raise _fail(loc, "must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise _fail((*loc, "role"), "must be 'user' or 'assistant'")
        content = message.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise _fail((*loc, "content"), "must be a string or an array of content blocks")
        for j, block in enumerate(content):
            _check_block(block, (*loc, "content", j), role)


def _check_block(block: Any, loc: tuple, role: str) -> None:
    """One content block: the fields translation reads, and tool blocks in the turn that may carry them."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise _fail(loc, "must be a content block (an object with a string type)")
    kind = block["type"]
    if kind == "text" and not isinstance(block.get("text"), str):
        raise _fail((*loc, "text"), "must be a string")
    if kind in ("image", "document") and not isinstance(block.get("source"), dict):
        raise _fail((*loc, "source"), "must be an object")
    if kind == "tool_use":
        if role != "assistant":
            raise _fail((*loc, "type"), "tool_use blocks belong to assistant messages")
        _check_string(block.get("id"), (*loc, "id"), required=True)
        _check_string(block.get("name"), (*loc, "name"), required=True)
        if not isinstance(block.get("input"), dict):
            raise _fail((*loc, "input"), "must be an object")
    if kind == "tool_result":
        if role != "user":
            raise _fail((*loc, "type"), "tool_result blocks belong to user messages")
        _check_string(block.get("tool_use_id"), (*loc, "tool_use_id"), required=True)
        _check_tool_result_content(block.get("content"), (*loc, "content"))
        if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
            raise _fail((*loc, "is_error"), "must be a boolean")


def _check_tool_result_content(content: Any, loc: tuple) -> None:
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _fail(loc, "must be a string or an array of content blocks")
    for k, inner in enumerate(content):
        _check_block(inner, (*loc, k), "user")
        if inner["type"] in ("tool_use", "tool_result"):
            raise _fail((*loc, k, "type"), "a tool result cannot hold tool blocks")


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _fail(("tools",), "must be an array")
    for i, tool in enumerate(tools):
        loc: tuple = ("tools", i)
        if not isinstance(tool, dict):
            raise _fail(loc, "must be an object")
        if tool.get("type") not in (None, "custom"):
            _check_string(tool.get("type"), (*loc, "type"), required=True)
            continue  # a server tool: its own schema, checked where it is served
        _check_string(tool.get("name"), (*loc, "name"), required=True)
        _check_string(tool.get("description"), (*loc, "description"))
        if not isinstance(tool.get("input_schema"), dict):
            raise _fail((*loc, "input_schema"), "required, an object (a JSON Schema)")


def _check_tool_choice(choice: Any, tools: Any) -> None:
    """The choice's shape; and a choice that demands a tool call (any, tool) only beside tools, as Anthropic's API
    refuses it: translated for a chat pool, which takes no tool_choice without tools, it would be dropped and the
    model would answer in text. auto and none without tools mean what no choice means, so they pass."""
    if choice is None:
        return
    if not isinstance(choice, dict) or choice.get("type") not in _TOOL_CHOICES:
        raise _fail(("tool_choice",), "must be an object with type auto, any, tool or none")
    if choice["type"] == "tool":
        _check_string(choice.get("name"), ("tool_choice", "name"), required=True)
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise _fail(("tool_choice", "disable_parallel_tool_use"), "must be a boolean")
    if choice["type"] in ("any", "tool") and not tools:
        raise _fail(("tool_choice",), f"type {choice['type']!r} may only be specified while providing tools")


def _check_sampling(payload: dict[str, Any]) -> None:
    stops = payload.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise _fail(("stop_sequences",), "must be an array of strings")
        for i, stop in enumerate(stops):
            _check_string(stop, ("stop_sequences", i), required=True)
    for key in ("temperature", "top_p"):
        value = payload.get(key)
        if value is not None and (not _is_number(value) or not 0 <= value <= 1):
            raise _fail((key,), "must be a number from 0 to 1")
    top_k = payload.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise _fail(("top_k",), "must be a non-negative integer")


# --- request: Messages -> chat ---------------------------------------------------------------------------------


def messages_to_chat(payload: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request (already checked) -> an OpenAI chat-completions request, same model name.

    `system` leads as a system message; each turn keeps its role, except that a user turn's tool results become
    `tool` messages placed before the rest of that turn; `stop_sequences` -> `stop`, `metadata.user_id` -> `user`,
    `top_k` and `cache_salt` (the pool's cache isolation sets it per tenant, gateway/stages/admission.py) pass as the
    vLLM extensions, `stream` asks for the usage chunk too. `thinking` is not forwarded: how a
    model enables reasoning is its chat template's business, not a field of the chat API."""
    messages = _system_messages(payload.get("system"))
    for i, message in enumerate(payload["messages"]):
        loc: tuple = ("messages", i)
        if message["role"] == "assistant":
            messages.append(_assistant_message(message["content"], loc))
        else:
            messages.extend(_user_messages(message["content"], loc))
    chat: dict[str, Any] = {"model": payload["model"], "messages": messages, "max_tokens": payload["max_tokens"]}
    for key in ("temperature", "top_p", "top_k", "cache_salt"):
        if payload.get(key) is not None:
            chat[key] = payload[key]
    if payload.get("stop_sequences"):
        chat["stop"] = list(payload["stop_sequences"])
    user_id = (payload.get("metadata") or {}).get("user_id")
    if user_id:
        chat["user"] = user_id
    chat.update(_chat_tools(payload.get("tools"), payload.get("tool_choice")))
    if payload.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _joined_text(parts: list[dict[str, Any]]) -> str:
    """Text parts as one string, joined by a newline: what vLLM's chat parser makes of a list of text parts."""
    return "\n".join(part["text"] for part in parts)


def _system_messages(system: Any) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else _joined_text(system)
    return [{"role": "system", "content": text}]


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Chat content: a string when every part is text (the form every chat template takes), else the parts."""
    if all(part["type"] == "text" for part in parts):
        return _joined_text(parts)
    return parts


def _user_part(block: dict[str, Any], loc: tuple) -> dict[str, Any] | None:
    """A user content block as a chat content part; None for what a chat model takes no input from."""
    kind = block["type"]
    if kind == "text":
        return {"type": "text", "text": block["text"]}
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(block["source"], (*loc, "source"))}}
    if kind == "document":
        return {"type": "text", "text": _document_text(block["source"], (*loc, "source"))}
    if kind in ("thinking", "redacted_thinking"):
        return None
    raise _fail((*loc, "type"), f"content blocks of type {kind!r} cannot be sent to this model")


def _image_url(source: dict[str, Any], loc: tuple) -> str:
    """An image source as the URL chat's `image_url` part takes: base64 data as a data: URL, a url as itself."""
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        if not isinstance(source.get("media_type"), str):
            raise _fail((*loc, "media_type"), "required for a base64 image, a string such as 'image/png'")
        return f"data:{source['media_type']};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _fail((*loc, "type"), "only base64 and url image sources can be sent to this model")


def _document_text(source: dict[str, Any], loc: tuple) -> str:
    """A plain-text document's text; PDFs and files have no chat-completions part a pool is known to read."""
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        return source["data"]
    raise _fail((*loc, "type"), "only plain-text documents can be sent to this model")


def _user_messages(content: str | list[dict[str, Any]], loc: tuple) -> list[dict[str, Any]]:
    """A user turn: its tool results as `tool` messages first (chat wants them right after the assistant's calls),
    then the rest as one user message. Images inside a tool result join that user message, since a chat tool
    message holds text only."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    carried: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        if block["type"] == "tool_result":
            text, images = _tool_result(block, (*loc, "content", j))
            tool_messages.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
            carried.extend(images)
        elif (part := _user_part(block, (*loc, "content", j))) is not None:
            parts.append(part)
    parts = carried + parts
    return tool_messages + ([{"role": "user", "content": _content(parts)}] if parts else [])


def _tool_result(block: dict[str, Any], loc: tuple) -> tuple[str, list[dict[str, Any]]]:
    """A tool result's text, and its images. `is_error` has no field in a chat tool message, so it leads the
    text, where the model reads it."""
    content = block.get("content")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    if isinstance(content, str):
        texts.append(content)
    for k, inner in enumerate(content if isinstance(content, list) else ()):
        part = _user_part(inner, (*loc, "content", k))
        if part is not None and part["type"] == "text":
            texts.append(part["text"])
        elif part is not None:
            images.append(part)
    text = "\n".join(texts)
    return (f"Error: {text}" if block.get("is_error") else text), images


def _assistant_message(content: str | list[dict[str, Any]], loc: tuple) -> dict[str, Any]:
    """An assistant turn: its text as content, its tool_use blocks as `tool_calls` (arguments: the input as JSON),
    its thinking dropped."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block["type"]
        if kind == "text":
            texts.append(block)
        elif kind == "tool_use":
            arguments = orjson.dumps(block["input"]).decode()
            calls.append(
                {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
            )
        elif kind not in ("thinking", "redacted_thinking"):
            raise _fail((*loc, "content", j, "type"), f"assistant blocks of type {kind!r} cannot be sent to this model")
    text = _joined_text(texts) if texts else None if calls else ""  # content may be null only beside tool calls
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_tools(tools: Any, choice: Any) -> dict[str, Any]:
    """`tools` as function tools, and `tool_choice`: auto -> "auto", any -> "required", tool -> that function,
    none -> "none"; `disable_parallel_tool_use` -> `parallel_tool_calls: false`. A server tool (web search, code
    execution...) runs at Anthropic only, so a request that needs one is refused."""
    if not tools:
        return {}
    functions = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise _fail(("tools", i, "type"), f"server tool {tool['type']!r} is not available on this model")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        functions.append({"type": "function", "function": function})
    out: dict[str, Any] = {"tools": functions}
    if choice:
        kind = choice["type"]
        named = {"type": "function", "function": {"name": choice.get("name")}}
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind, named)
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    return out


def asks_thinking(payload: dict[str, Any]) -> bool:
    """Whether a Messages request asked for extended thinking (`thinking` of a type other than "disabled"): only
    then does a chat pool's reasoning come back, as thinking blocks."""
    thinking = payload.get("thinking")
    return isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled")


# --- response: chat -> Message ---------------------------------------------------------------------------------


def _message_id(upstream_id: Any) -> str:
    """ "msg_" and the upstream's id (its alphanumerics), so a log line joins both; a fresh one without it."""
    tail = "".join(c for c in str(upstream_id or "").removeprefix("chatcmpl-") if c.isalnum())
    return f"msg_{tail or uuid.uuid4().hex}"


def _stop(finish_reason: Any, stop_reason: Any, stop_sequences: Sequence[str], tool_calls: bool) -> tuple[str, Any]:
    """(stop_reason, stop_sequence) for a chat finish: length -> max_tokens, tool_calls -> tool_use (as is a stop
    after tool calls: vLLM says "stop" when tool_choice forced them), content_filter -> refusal, a stop on one of
    the request's sequences (vLLM names it in the choice's `stop_reason`) -> stop_sequence, else end_turn."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "content_filter":
        return "refusal", None
    if tool_calls or finish_reason in ("tool_calls", "function_call"):
        return "tool_use", None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: Any) -> dict[str, int]:
    """Anthropic usage from chat usage: the cached prompt tokens are cache reads, the rest are input tokens; a
    pool's prefix cache writes nothing anyone is billed for, so cache_creation_input_tokens is 0."""
    usage = usage if isinstance(usage, dict) else {}
    prompt = _count(usage, "prompt_tokens")
    cached = _count(usage.get("prompt_tokens_details"), "cached_tokens")
    return {
        "input_tokens": max(prompt - cached, 0),
        "output_tokens": _count(usage, "completion_tokens"),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _count(fields: Any, key: str) -> int:
    """A usage count as charging takes it (token_count); 0 where the upstream reported none."""
    return (token_count(fields.get(key)) if isinstance(fields, dict) else None) or 0


def _text(value: Any) -> str:
    """An upstream's text field: "" where it is not a string, so no block carries what Anthropic's types cannot
    hold (and the output guard, which reads strings only, never saw)."""
    return value if isinstance(value, str) else ""


def _reasoning(fields: dict[str, Any]) -> str:
    """vLLM's reasoning text: `reasoning_content`, or `reasoning` as newer releases name it."""
    return _text(fields.get("reasoning_content")) or _text(fields.get("reasoning"))


def _tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's `input` must be; {} when the model wrote no object."""
    try:
        value = orjson.loads(_text(arguments) or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def chat_to_message(
    body: dict[str, Any], model: str, *, stop_sequences: Sequence[str] = (), thinking: bool = False
) -> dict[str, Any]:
    """A non-streaming chat completion -> an Anthropic Message. `stop_sequences` are the request's (to tell a
    stop_sequence from an end_turn); `thinking` whether it asked for thinking blocks."""
    choices = body.get("choices") or [{}]
    choice = choices[0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if thinking and _reasoning(message):
        content.append({"type": "thinking", "thinking": _reasoning(message), "signature": ""})
    text = _text(message.get("content")) or _text(message.get("refusal"))
    if text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls") or []
    for call in calls:
        function = call.get("function") or {}
        call_id, name = _text(call.get("id")) or _tool_use_id(), _text(function.get("name"))
        content.append(
            {"type": "tool_use", "id": call_id, "name": name, "input": _tool_input(function.get("arguments"))}
        )
    stop_reason, stop_sequence = _stop(
        choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences, bool(calls)
    )
    return {
        "id": _message_id(body.get("id")),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(body.get("usage")),
    }


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex}"


def _arguments_delta(block: int, arguments: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": block,
        "delta": {"type": "input_json_delta", "partial_json": arguments},
    }


@dataclass(slots=True, eq=False)
class _ToolCall:
    """A streamed tool call: its tool_use block's id and name, its arguments so far, its block index once started.
    Each is its own call (no equality by value): two calls may carry the same fields."""

    id: str
    name: str
    arguments: StreamedJson = field(default_factory=StreamedJson)
    block: int | None = None


@dataclass(slots=True)
class _Piece:
    """Text or thinking that arrived while a tool call's arguments were not whole: it waits for its block."""

    kind: str  # "text" or "thinking": the block's type, and its delta's text field
    text: str


# The block each kind of piece opens, and its delta's type.
# Text and thinking held back behind one call whose arguments are not yet whole JSON. A pool whose call never parses
# (Python-dict arguments, a broken stream) would otherwise hold the rest of its answer in memory to the end; past
# this the stream ends with an error event: the call's block cannot stop before its input is whole (the client
# reads the input at the stop), and nothing may follow the block's stop for it.
MAX_HELD_CHARS = 1 << 20


class _CallNeverWhole(Exception):
    """MAX_HELD_CHARS of the answer arrived behind a call whose arguments are still not JSON."""


_PIECE_BLOCKS = {
    "thinking": ({"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta"),
    "text": ({"type": "text", "text": ""}, "text_delta"),
}


# --- stream: chat chunks -> Anthropic events -------------------------------------------------------------------


class ChatStreamToMessages:
    """Chat-completion chunks in, Anthropic stream events out (docs.anthropic.com "Streaming Messages").

    message_start goes out with the first chunk; then one content block at a time: text, thinking (when asked for),
    and one tool_use block per tool call in the order the calls start, its arguments as input_json_delta. A block
    stops when the next one starts or the stream ends. Anthropic's blocks are sequential, while a chat stream may
    interleave a call's argument fragments with another call's (index 0, 1, 0, 1) or with text: while the open block
    is a call whose arguments are not yet whole JSON, whatever else arrives (another call, text, thinking) is held,
    in order, and goes out once they are whole (or at the end). So a call's block never stops before its input is
    whole (a client reads the input at the stop), every delta comes between its own block's start and stop, and
    nothing is dropped; text that interrupted a call comes after it, in a block of its own, the one place
    Anthropic's stream has for it. A fragment's call is found by its `index` or its `id`, as servers other than
    OpenAI and vLLM need (gateway/apis/chat_calls.py), the way the output guard finds it. The upstream sends usage
    in its last chunk only (`include_usage`), after message_start has gone, so message_start counts 0 and the final
    message_delta carries the real input, cache-read and output counts: the SDK's accumulator takes each one it
    finds there.
    Only choice 0 is read: a Messages request asks for one answer.
    """

    def __init__(self, model: str, *, stop_sequences: Sequence[str] = (), thinking: bool = False) -> None:
        self.model = model
        self.stop_sequences = tuple(stop_sequences)
        self.thinking = thinking
        self._started = False
        self._closed = False
        self._blocks = 0  # content blocks started so far: the next one's index
        self._open: str | _ToolCall | None = None  # the open block: "text", "thinking", or a tool call
        self._calls: list[_ToolCall] = []  # every tool call seen, in the order they started
        self._numbers = StreamedCalls()  # which of them a fragment belongs to
        self._held: deque[_ToolCall | _Piece] = deque()  # what waits for the open call to be whole, in order
        self._held_chars = 0  # of the text and thinking in it
        self._finish_reason: Any = None
        self._stop_reason: Any = None
        self._usage: Any = None

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        """One parsed chat chunk -> the events it makes (none once the stream closed). An upstream error chunk
        (`{"error": {...}}`, as vLLM and the bundled engine send mid-stream) becomes the error event."""
        if self._closed:
            return []
        if isinstance(chunk.get("error"), dict):
            return [self._upstream_error(chunk["error"])]
        events = self._start(chunk)
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        try:
            for choice in chunk.get("choices") or ():
                if choice.get("index", 0) == 0:
                    events += self._choice(choice)
        except _CallNeverWhole:
            message = f"a tool call's arguments were still not JSON after {MAX_HELD_CHARS} more characters"
            return [typed_event(e) for e in events] + [self.error("api_error", message)]
        return [typed_event(e) for e in events]

    def finish(self) -> list[bytes]:
        """At the upstream's [DONE]: the open block's content_block_stop, message_delta (stop reason, usage) and
        message_stop; nothing when the stream already closed (finished, or ended by an error)."""
        if self._closed:
            return []
        events = self._start({})
        events += self._release(to_the_end=True)
        events += self._close_block()
        stop_reason, stop_sequence = _stop(
            self._finish_reason, self._stop_reason, self.stop_sequences, bool(self._calls)
        )
        usage = _usage(self._usage)
        delta_usage = usage if self._usage else {"output_tokens": 0}
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": delta_usage,
            }
        )
        events.append({"type": "message_stop"})
        self._closed = True
        return [typed_event(e) for e in events]

    def error(self, error_type: str, message: str) -> bytes:
        """The `error` event for a stream that breaks after it started; the stream is closed after it."""
        self._closed = True
        return typed_event({"type": "error", "error": {"type": error_type, "message": message}})

    def _upstream_error(self, error: dict[str, Any]) -> bytes:
        code = str(error.get("code") or "")
        status = int(code) if code.isascii() and code.isdigit() else 500
        return self.error(anthropic_error_type(status), str(error.get("message") or "upstream error"))

    def _start(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        usage = _usage(chunk.get("usage"))
        message: dict[str, Any] = {
            "id": _message_id(chunk.get("id")),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": 0},
        }
        return [{"type": "message_start", "message": message}]

    def _choice(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        delta = choice.get("delta") or {}
        events: list[dict[str, Any]] = []
        reasoning = _reasoning(delta)
        if reasoning and self.thinking:
            events += self._piece(_Piece("thinking", reasoning))
        text = _text(delta.get("content")) or _text(delta.get("refusal"))
        if text:
            events += self._piece(_Piece("text", text))
        for call in delta.get("tool_calls") or ():
            events += self._tool_call(call)
        if choice.get("finish_reason"):
            self._finish_reason = choice["finish_reason"]
            self._stop_reason = choice.get("stop_reason")
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call fragment: the call's first names it (id and name come first, as OpenAI and vLLM send them) and
        queues its tool_use block; an arguments fragment is an input_json_delta on that call's block once it started,
        kept with the call until then."""
        function = call.get("function") or {}
        number, starts = self._numbers.number(call)
        if starts:
            self._calls.append(_ToolCall(_text(call.get("id")) or _tool_use_id(), _text(function.get("name"))))
            self._held.append(self._calls[-1])
        entry = self._calls[number]
        arguments = _text(function.get("arguments"))
        entry.arguments.append(arguments)
        events: list[dict[str, Any]] = []
        if entry.block is not None and arguments:
            events.append(_arguments_delta(entry.block, arguments))
        return events + self._release()

    def _piece(self, piece: _Piece) -> list[dict[str, Any]]:
        """Text or thinking: a delta on its block, or held behind a call whose arguments are not yet whole (its
        block cannot stop yet, and no other block may start before it stops)."""
        if not self._call_in_progress():
            return self._unhold(piece)
        if self._held_chars + len(piece.text) > MAX_HELD_CHARS:
            raise _CallNeverWhole()
        self._held.append(piece)
        self._held_chars += len(piece.text)
        return []

    def _release(self, to_the_end: bool = False) -> list[dict[str, Any]]:
        """What was held, in order, up to a call whose arguments are still not whole (`to_the_end`: all of it)."""
        events: list[dict[str, Any]] = []
        while self._held and (to_the_end or not self._call_in_progress()):
            held = self._held.popleft()
            if isinstance(held, _Piece):
                self._held_chars -= len(held.text)
            events += self._unhold(held)
        return events

    def _call_in_progress(self) -> bool:
        """Whether the open block is a tool call whose arguments are not yet a whole JSON value."""
        call = self._open
        return isinstance(call, _ToolCall) and not call.arguments.whole()

    def _unhold(self, held: _ToolCall | _Piece) -> list[dict[str, Any]]:
        """A held piece's delta on its block; a held call's block, started with the arguments it gathered."""
        if isinstance(held, _Piece):
            start, delta_type = _PIECE_BLOCKS[held.kind]
            events = self._open_block(held.kind, {**start})
            events.append(self._delta({"type": delta_type, held.kind: held.text}))
            return events
        block = {"type": "tool_use", "id": held.id, "name": held.name, "input": {}}
        events = self._open_block(held, block)
        held.block = self._blocks - 1
        if held.arguments:
            events.append(_arguments_delta(held.block, str(held.arguments.text)))
        return events

    def _open_block(self, key: str | _ToolCall, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Start a block unless it is the open one, stopping the open one first."""
        if self._open == key:
            return []
        events = self._close_block()
        events.append({"type": "content_block_start", "index": self._blocks, "content_block": block})
        self._open = key
        self._blocks += 1
        return events

    def _close_block(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._blocks - 1}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._blocks - 1, "delta": delta}
