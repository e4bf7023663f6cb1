"""A Responses API request's `instructions` and `input` as the chat messages the engine's template renders.

Pure data in, data out, and free of engine imports: the gateway imports this module alone to count a Responses
request's tokens and hash its prefix blocks exactly as the engine will. Rules follow OpenAI's Responses API
reference: message items become chat messages with string content, `function_call` items become an assistant
message's `tool_calls`, `function_call_output` items become tool messages, and items that carry no text for the
model (reasoning, hosted tool calls) are skipped.
"""

from __future__ import annotations

from typing import Any

from backend_engine.model.prompt import PromptError

MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
TEXT_PART_TYPES = frozenset({"input_text", "output_text"})
# Items that carry nothing the model reads as text: kept out of the prompt rather than rejected.
SKIPPED_ITEM_TYPES = frozenset(
    {
        "reasoning",
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
    }
)


def responses_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages (OpenAI chat-completions shape) that a Responses request's `instructions` and `input`
    stand for: what the chat template renders, so the gateway's token counts and prefix hashes match the engine's.

    Raises `PromptError` whose `param` is the JSON path of the offending value, e.g. "input[2].content[0].text"."""
    messages: list[dict[str, Any]] = []
    instructions = payload.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise PromptError("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    items = payload.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            _append_item(messages, item, f"input[{i}]")
    else:
        raise PromptError("'input' must be a string or a list of input items", "input")
    if not messages:
        raise PromptError("'input' holds no message the model can read", "input")
    return messages


def _append_item(messages: list[dict[str, Any]], item: Any, path: str) -> None:
    if not isinstance(item, dict):
        raise PromptError(f"'{path}' must be an object", path)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise PromptError(f"'{path}.role' must be one of {', '.join(sorted(MESSAGE_ROLES))}", f"{path}.role")
        messages.append({"role": role, "content": _text(item.get("content"), f"{path}.content")})
    elif kind == "function_call":
        call = {
            "id": _string(item, "call_id", path),
            "type": "function",
            "function": {"name": _string(item, "name", path), "arguments": _string(item, "arguments", path)},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn, as chat completions has it
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append(
            {
                "role": "tool",
                "tool_call_id": _string(item, "call_id", path),
                "content": _text(item.get("output"), f"{path}.output"),
            }
        )
    elif kind == "item_reference":
        raise PromptError("item references are not supported: this engine stores no responses", f"{path}.type")
    elif kind not in SKIPPED_ITEM_TYPES:
        raise PromptError(f"unsupported input item type {kind!r}", f"{path}.type")


def _string(item: dict[str, Any], key: str, path: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise PromptError(f"'{path}.{key}' must be a string", f"{path}.{key}")
    return value


def _text(content: Any, path: str) -> str:
    """A string, or a list of text parts joined in order; image and file parts have no text to render."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise PromptError(f"'{path}' must be a string or a list of content parts", path)
    texts = []
    for j, part in enumerate(content):
        part_path = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise PromptError(f"'{part_path}' must be an object", part_path)
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES:
            raise PromptError(
                f"content part type {kind!r} is not supported: this engine reads only input_text and output_text",
                f"{part_path}.type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise PromptError(f"'{part_path}.text' must be a string", f"{part_path}.text")
        texts.append(text)
    return "".join(texts)
