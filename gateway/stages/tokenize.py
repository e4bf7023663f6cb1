"""Tokenize: count the prompt exactly for a model, fill max_tokens from policy, enforce that model's context window.

The tokenize part of an attempt's authority (gateway/stages/authority.py): each attempt's model counts the request by
its own tokenizer and bounds it by its own window, before rate limits reserve those counts and budgets price them, and
before admission and routing, which price a request in KV-cache blocks and hash its prompt blocks to predict cache
hits. A long prompt takes its tokenizer milliseconds to seconds, and a tokenizer not loaded yet takes seconds to
load: those counts run on the offload executor, not on the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from gateway.config import ModelConfig
from gateway.context import Demand, RequestContext
from gateway.edge.offload import Offload
from gateway.errors import GatewayError
from gateway.policy.loader import PolicySet
from gateway.tokenization import EstimateCounter, PromptCount, PromptCounter, build_counter, tool_shapes


class Tokenizers:
    """The tokenizers loaded, by their setting (`models[].tokenizer`): loading one takes seconds, so it is loaded once
    per process, on first use or by warm(), and a config reload loads only a setting that is new."""

    def __init__(self) -> None:
        self._loaded: dict[str | None, PromptCounter] = {}
        self._loading = threading.Lock()

    def get(self, setting: str | None) -> PromptCounter:
        counter = self._loaded.get(setting)
        if counter is None:
            with self._loading:
                counter = self._loaded.get(setting) or build_counter(setting)
                self._loaded[setting] = counter
        return counter

    def loaded(self, setting: str | None) -> bool:
        return setting in self._loaded

    def keep(self, settings: set[str | None]) -> None:
        """Forget the tokenizers no model is configured with now (after a reload). Called on the event loop, so it
        never waits for the lock a load holds for seconds; a load finishing meanwhile is forgotten and done again."""
        self._loaded = {setting: c for setting, c in dict(self._loaded).items() if setting in settings}


class Tokenize:
    def __init__(
        self,
        models: list[ModelConfig],
        policies: Callable[[], PolicySet],
        offload: Offload,
        tokenizers: Tokenizers | None = None,
    ) -> None:
        self._models = {m.name: m for m in models}
        self.tokenizers = tokenizers or Tokenizers()
        self._estimate = EstimateCounter()
        self._policies = policies
        self._offload = offload

    def for_models(self, models: list[ModelConfig]) -> Tokenize:
        """The same counting for a reloaded config's `models`, with the tokenizers loaded already."""
        return Tokenize(models, self._policies, self._offload, self.tokenizers)

    def settings(self) -> set[str | None]:
        return {model.tokenizer for model in self._models.values()}

    def warm(self) -> None:
        """Load every configured tokenizer (run in a thread at start, so the first requests need not wait)."""
        for name in self._models:
            self._counter(name)

    def _counter(self, model: str) -> PromptCounter:
        if model not in self._models:
            return self._estimate
        return self.tokenizers.get(self._models[model].tokenizer)

    def decode(self, model: str, ids: list[int]) -> str | None:
        """Token ids as the model's tokenizer reads them, for the guard; None when no tokenizer is known for it.
        Blocking (may load the tokenizer), so call it off the event loop."""
        return self._counter(model).decode(ids)

    def _count(self, ctx: RequestContext, model: str) -> PromptCount:
        """The messages (or prompt) and the function definitions, which the model reads as part of the prompt."""
        counter = self._counter(model)
        count = counter.count(*ctx.api.counted(ctx.payload))
        shapes = tool_shapes(ctx.payload)
        if not shapes:  # most requests: no tools to count
            return count
        tools = counter.tool_tokens(shapes)
        return PromptCount(count.tokens + tools, count.token_ids) if tools else count

    async def demand(self, ctx: RequestContext, model: str) -> Demand:
        """What the request asks of `model`: its prompt counted by that model's tokenizer, and the output it may
        generate within that model's window (a 400 where it does not fit), with the output bound to fill in where
        the request names none (written into its payload only once the attempt is authorised)."""
        admission = self._policies().admission_for(ctx.tenant)
        choices = _choices(ctx.payload, ctx.api.choice_fields, admission.max_n)  # before counting: refusing is free
        loaded = model not in self._models or self.tokenizers.loaded(self._models[model].tokenizer)
        big = self._offload.is_big(len(ctx.body), ctx.json_values)
        count = await self._offload.run(big or not loaded, self._count, ctx, model)
        window = self._models[model].context_window if model in self._models else None
        output, filled = _per_choice(ctx, count.tokens, window, admission.default_max_tokens)
        return Demand(model, count.tokens, count.token_ids, output * choices, filled)


def _per_choice(ctx: RequestContext, prompt: int, window: int | None, default: int) -> tuple[int, int | None]:
    """The most tokens one choice may generate, which token limits reserve (times the choices), and the bound to
    fill in where the request names none.

    Where a shape has two such fields (chat: OpenAI and vLLM honour max_completion_tokens when a request names
    both, another upstream may honour max_tokens), the larger one is reserved, and it must fit the context window
    too. A request whose two fields disagree beyond the window is refused (400), not checked with the one it names
    first and reserved with the other: what a request reserves is always something it could really generate.
    Naming none, it gets the policy's default, cut to what the window leaves, to be written into the body the
    upstream sees. A shape that generates nothing (embeddings) reserves nothing, but its prompt must fit the window.
    """
    api, payload = ctx.api, ctx.payload
    honoured_field = largest_field = ""
    honoured = largest = 0
    for field in api.output_fields:  # in the order upstreams honour them (parse checked they are positive integers)
        value = payload.get(field)
        if value is None:
            continue
        if not honoured_field:
            honoured_field, honoured = field, value
        if not largest_field or value > largest:  # the first of the largest
            largest_field, largest = field, value
    if not honoured_field:
        if window and (prompt >= window if api.generates else prompt > window):  # generating needs room for one
            raise _too_long(window, prompt, 0)
        if api.fill_field is None:
            return 0, None
        filled = min(default, window - prompt) if window else default
        return filled, filled
    if window and prompt + honoured > window:
        raise _too_long(window, prompt, honoured)
    if window and prompt + largest > window:
        raise GatewayError(
            400,
            f"{largest_field} ({largest}) exceeds what this model's context window of {window} tokens leaves "
            f"after the prompt's {prompt} tokens, while {honoured_field} is {honoured}: the two fields "
            "disagree; send one of them, or both within the window.",
            code="context_length_exceeded",
            param=largest_field,
        )
    return largest, None


def _choices(payload: dict[str, Any], fields: tuple[str, ...], most: int) -> int:
    """How many completions the request asks for (n, or best_of for completions), at most `most` (else 400)."""
    choices = 1
    for field in fields:
        value = payload.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GatewayError(
                400, f"Invalid '{field}': expected a positive integer.", code="invalid_type", param=field
            )
        if value > most:
            raise GatewayError(
                400,
                f"Invalid '{field}': integer above maximum value. Expected a value <= {most}, but got {value} instead.",
                code="integer_above_max_value",
                param=field,
            )
        choices = max(choices, value)
    return choices


def _too_long(window: int, prompt: int, completion: int) -> GatewayError:
    return GatewayError(
        400,
        f"This model's maximum context length is {window} tokens. However, you requested "
        f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
        "Please reduce the length of the messages or completion.",
        code="context_length_exceeded",
        param="messages",
    )
