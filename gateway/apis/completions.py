"""OpenAI completions (`POST /v1/completions`): a prompt as text, texts, token ids, or lists of token ids."""

from __future__ import annotations

from typing import Any

from gateway.apis.openai_carriers import COMPLETIONS
from gateway.apis.openai_fields import (
    GENERATION_FIELDS,
    TOOL_KEYS,
    check_fields,
    check_model,
    check_tools,
    is_token_ids,
)
from gateway.apis.shape import Api, CountForm
from gateway.errors import invalid_request


class Completions(Api):
    name = "completions"
    path = "/v1/completions"
    operation = "text_completion"
    choice_fields = ("n", "best_of")
    carriers = COMPLETIONS

    def check(self, payload: dict[str, Any]) -> None:
        check_model(payload)
        check_fields(payload, GENERATION_FIELDS)
        for key in TOOL_KEYS:
            check_tools(key, payload.get(key))
        check_prompt(payload.get("prompt"), "prompt")

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
