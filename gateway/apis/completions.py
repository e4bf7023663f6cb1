"""OpenAI completions (`POST /v1/completions`): a prompt as text, texts, token ids, or lists of token ids."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gateway.apis.chat import is_tool_description, tool_definition_texts
from gateway.apis.openai_fields import GENERATION_FIELDS, check_fields, check_model, check_tools, is_token_ids
from gateway.apis.shape import PROMPT_ROLE, Api, CountForm, Location, PromptText, TokenPrompt
from gateway.errors import invalid_request
from gateway.tool_text import TOOL_KEYS


class Completions(Api):
    name = "completions"
    path = "/v1/completions"
    operation = "text_completion"
    choice_fields = ("n", "best_of")
    prompt_keys = frozenset(("prompt", *TOOL_KEYS))

    def check(self, payload: dict[str, Any]) -> None:
        check_model(payload)
        check_fields(payload, GENERATION_FIELDS)
        for key in TOOL_KEYS:
            check_tools(key, payload.get(key))
        check_prompt(payload.get("prompt"), "prompt")

    def texts(self, payload: dict[str, Any]) -> Iterator[PromptText]:
        yield from prompt_texts(payload, "prompt")
        yield from tool_definition_texts(payload)

    def token_prompts(self, payload: dict[str, Any]) -> Iterator[TokenPrompt]:
        return token_prompts(payload, "prompt")

    def is_prompt(self, loc: Location) -> bool:
        return loc[0] == "prompt" or is_tool_description(loc)

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        return "prompt", payload.get("prompt")


def check_prompt(prompt: Any, key: str) -> None:
    """A string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(is_token_ids(p) for p in prompt) or is_token_ids(prompt):
            return
    raise invalid_request(f"'{key}' must be a string, an array of strings, or an array of token ids", param=key)


def prompt_texts(payload: dict[str, Any], key: str) -> Iterator[PromptText]:
    prompt = payload.get(key)
    if isinstance(prompt, str):
        yield PromptText(prompt, PROMPT_ROLE, (key,), payload)
    elif isinstance(prompt, list):
        yield from (PromptText(p, PROMPT_ROLE, (key, i), prompt) for i, p in enumerate(prompt) if isinstance(p, str))


def token_prompts(payload: dict[str, Any], key: str) -> Iterator[TokenPrompt]:
    prompt = payload.get(key)
    if is_token_ids(prompt):
        yield TokenPrompt(prompt, (key,))
    elif isinstance(prompt, list):
        yield from (TokenPrompt(p, (key, i)) for i, p in enumerate(prompt) if is_token_ids(p))
