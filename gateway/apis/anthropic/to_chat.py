"""A Messages request as the OpenAI chat-completions request a chat pool is sent (platform.openai.com's reference,
with vLLM's extensions). What has no counterpart is refused with a 400 naming the field, never dropped silently:
server tools, file sources, non-text documents; thinking sent back in history is dropped (a chat model takes no
reasoning as input) and a tool result's `is_error` travels in its text."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.apis.anthropic.checks import field_error


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
    raise field_error((*loc, "type"), f"content blocks of type {kind!r} cannot be sent to this model")


def _image_url(source: dict[str, Any], loc: tuple) -> str:
    """An image source as the URL chat's `image_url` part takes: base64 data as a data: URL, a url as itself."""
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        if not isinstance(source.get("media_type"), str):
            raise field_error((*loc, "media_type"), "required for a base64 image, a string such as 'image/png'")
        return f"data:{source['media_type']};base64,{source['data']}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise field_error((*loc, "type"), "only base64 and url image sources can be sent to this model")


def _document_text(source: dict[str, Any], loc: tuple) -> str:
    """A plain-text document's text; PDFs and files have no chat-completions part a pool is known to read."""
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        return source["data"]
    raise field_error((*loc, "type"), "only plain-text documents can be sent to this model")


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
            raise field_error(
                (*loc, "content", j, "type"), f"assistant blocks of type {kind!r} cannot be sent to this model"
            )
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
            raise field_error(("tools", i, "type"), f"server tool {tool['type']!r} is not available on this model")
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
