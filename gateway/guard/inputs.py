"""What the input guard reads of a request: every text a model will see, with the role it came in and its place.

The request's shape says what its texts are (gateway/apis/): messages, content parts and items by role, tool
results as the `tool` role, role-less prompts (completions prompts, embeddings inputs) as `prompt`, and the
descriptions of the request's tools as `tool_definitions`. Prompts sent as token ids are decoded back to text: the
model reads the ids as surely as text, so ids the guard cannot read would be a way around it. The arguments of the
model's own earlier tool calls are not the guard's: they are what the model wrote, not what it is told.

The legacy `function` role carries tool results as `tool` does, so a policy that scans `tool` scans both.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Any

from gateway.apis.shape import PROMPT_ROLE, Api, PromptText
from gateway.tool_text import dotted

TOOL_DEFINITIONS = "tool_definitions"
ALIASES = {"function": "tool"}  # a message role → the policy role that selects it

# Token ids → their text, or None when no tokenizer is known for the model (the caller decides what that means).
Decode = Callable[[list[int], str], str | None]


def request_texts(api: Api, payload: dict[str, Any], roles: Collection[str], decode: Decode) -> list[PromptText]:
    """The texts of the request that these roles select (role-less prompts always), in payload order, each with the
    policy role that selected it. A decoded token-id prompt has no holder: it cannot be rewritten in place."""
    wanted = {*roles, PROMPT_ROLE}
    texts = []
    for text in api.texts(payload):
        role = _policy_role(text)
        if role in wanted:
            texts.append(text if role == text.role else replace(text, role=role))
    decoded = [
        PromptText(plain, PROMPT_ROLE, prompt.loc, None)
        for prompt in api.token_prompts(payload)
        if (plain := decode(prompt.ids, dotted(prompt.loc))) is not None
    ]
    if decoded:  # prompts given partly as text, partly as ids: back in the order they were sent
        texts = sorted(texts + decoded, key=lambda t: t.loc)
    return texts


def selected(texts: list[PromptText], roles: Iterable[str]) -> list[PromptText]:
    """The texts one policy's roles select (role-less prompts always)."""
    wanted = {*roles, PROMPT_ROLE}
    return [t for t in texts if t.role in wanted]


def _policy_role(text: PromptText) -> str | None:
    if text.kind == "tool_definition":
        return TOOL_DEFINITIONS
    if text.kind == "tool_arguments":
        return None
    return ALIASES.get(text.role, text.role)
