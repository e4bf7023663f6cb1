"""Prompt → token ids, exactly as the engine sees them: chat messages through the model's template, or raw text.

Shared by the engine's server and by the gateway's admission stage, so the gateway's token counts and prefix-block
hashes match what the engine computes.
"""

from __future__ import annotations

from typing import Any

from backend_engine.model.chat_template import RENDER_ARGUMENTS, ChatTemplate, ChatTemplateError
from backend_engine.model.tokenizer import Tokenizer


class PromptError(ValueError):
    """A prompt that cannot be rendered; `param` names the offending request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def prompt_too_long(chars: int) -> str:
    return f"the prompt is {chars} characters, more than this model's maximum context length can hold"


class PromptRenderer:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.template = template

    def chat_ids(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        max_chars: int | None = None,
    ) -> list[int]:
        """`template_kwargs`: a request's extra template variables (chat_template_kwargs), never one of the
        template's own arguments. `max_chars`: a rendered prompt longer than this is refused before it is tokenized
        (a PromptError), for a caller that knows no prompt of that length can fit its context."""
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list", "messages")
        template_kwargs = template_kwargs or {}
        taken = sorted(RENDER_ARGUMENTS & template_kwargs.keys())
        if taken:
            raise PromptError(f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
        normalized = [_text_message(m) for m in messages]
        try:
            text = self.template.render(normalized, add_generation_prompt=add_generation_prompt, **template_kwargs)
        except ChatTemplateError as exc:
            raise PromptError(str(exc), "messages") from None
        if max_chars is not None and len(text) > max_chars:
            raise PromptError(prompt_too_long(len(text)), "messages")
        return self.tokenizer.encode(text, add_bos=False)

    def text_ids(self, prompt: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(prompt, add_bos=add_bos)


def _text_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise PromptError("each message needs a string 'role'", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        parts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) != len(content):
            raise PromptError("only text content parts are supported", "messages")
        texts = [p.get("text", "") for p in parts]
        if not all(isinstance(t, str) for t in texts):
            raise PromptError("a text content part needs a string 'text'", "messages")
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise PromptError("message 'content' must be a string or a list of text parts", "messages")
    return {**message, "content": content}
