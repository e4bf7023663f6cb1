"""What the input guard reads of a request: every text a model will see, with the role it came in and its place.

Chat: message contents and content parts (by role), and the descriptions of the request's tools and their parameters.
Completions: the prompt as text, and prompts sent as token ids (a list of ints, or a list of such lists) decoded
back to text: the model reads the ids as surely as text, so ids the guard cannot read would be a way around it.

The legacy `function` role carries tool results as `tool` does, so a policy that scans `tool` scans both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

from gateway.tool_text import dotted, tool_descriptions

PROMPT = "prompt"  # the role of completions prompts: always scanned
TOOL_DEFINITIONS = "tool_definitions"
ALIASES = {"function": "tool"}  # a message role → the policy role that selects it

# Token ids → their text, or None when no tokenizer is known for the model (the caller decides what that means).
Decode = Callable[[list[int], str], str | None]


@dataclass(slots=True)
class InputText:
    text: str  # as the client sent it (decoded, for token ids)
    role: str  # the policy role that selects it: a message role, "prompt" or "tool_definitions"
    where: str  # e.g. "messages[2]", "prompt[1]", "tools[0].function.description"
    holder: dict | list | None  # where it lives in the payload, for redaction in place; None for token ids
    key: str | int | None = None


def request_texts(route: str, payload: dict[str, Any], roles: Collection[str], decode: Decode) -> list[InputText]:
    """The texts of the request that these roles select (completions prompts always), in payload order."""
    if route == "completions":
        return list(_prompt_texts(payload, decode))
    return [t for t in _chat_texts(payload, TOOL_DEFINITIONS in roles) if t.role in roles]


def selected(texts: list[InputText], roles: Iterable[str]) -> list[InputText]:
    """The texts one policy's roles select (prompts always)."""
    wanted = set(roles) | {PROMPT}
    return [t for t in texts if t.role in wanted]


def _prompt_texts(payload: dict[str, Any], decode: Decode) -> Iterator[InputText]:
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        yield InputText(prompt, PROMPT, "prompt", payload, "prompt")
    elif _is_token_ids(prompt):
        yield from _decoded(prompt, "prompt", decode)
    elif isinstance(prompt, list):
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                yield InputText(item, PROMPT, f"prompt[{i}]", prompt, i)
            elif _is_token_ids(item):
                yield from _decoded(item, f"prompt[{i}]", decode)


def _decoded(ids: list[int], where: str, decode: Decode) -> Iterator[InputText]:
    text = decode(ids, where)
    if text is not None:
        yield InputText(text, PROMPT, where, None)


def _is_token_ids(value: Any) -> TypeGuard[list[int]]:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _chat_texts(payload: dict[str, Any], with_tools: bool) -> Iterator[InputText]:
    for i, message in enumerate(payload.get("messages") or ()):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            continue
        sent_role: str = message["role"]
        role = ALIASES.get(sent_role, sent_role)
        content = message.get("content")
        if isinstance(content, str):
            yield InputText(content, role, f"messages[{i}]", message, "content")
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield InputText(part["text"], role, f"messages[{i}].content[{j}]", part, "text")
    if not with_tools:
        return
    for holder, key, loc in tool_descriptions(payload):
        yield InputText(holder[key], TOOL_DEFINITIONS, dotted(loc), holder, key)
