"""Tokenize stage: count the prompt exactly for its model, fill max_tokens from policy, enforce the context window.

It runs before rate limits so token limits reserve real counts, and before admission and routing, which price a
request in KV-cache blocks and hash its prompt blocks to predict cache hits.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

from gateway.admission.counting import EstimateCounter, PromptCounter, build_counter
from gateway.config import ModelConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.policy.loader import PolicySet


class TokenizeStage:
    name = "tokenize"

    def __init__(self, models: list[ModelConfig], policies: Callable[[], PolicySet]) -> None:
        self._models = {m.name: m for m in models}
        self._counters: dict[str, PromptCounter] = {}  # loaded on first use or by warm(): loading takes seconds
        self._loading = threading.Lock()
        self._estimate = EstimateCounter()
        self._policies = policies

    def warm(self) -> None:
        """Load every configured tokenizer (run in a thread at start, so the first requests need not wait)."""
        for name in self._models:
            self._counter(name)

    def _counter(self, model: str) -> PromptCounter:
        if model not in self._models:
            return self._estimate
        counter = self._counters.get(model)
        if counter is None:
            with self._loading:
                counter = self._counters.get(model) or build_counter(self._models[model].tokenizer)
                self._counters[model] = counter
        return counter

    def decode(self, model: str, ids: list[int]) -> str | None:
        """Token ids as the model's tokenizer reads them, for the guard; None when no tokenizer is known for it.
        Blocking (may load the tokenizer), so call it off the event loop."""
        return self._counter(model).decode(ids)

    async def __call__(self, ctx: RequestContext) -> None:
        count = self._counter(ctx.model).count(ctx.route, ctx.payload)
        ctx.prompt_tokens, ctx.prompt_token_ids = count.tokens, count.token_ids
        ctx.span.set_attribute("gen_ai.usage.input_tokens", count.tokens)
        requested = ctx.payload.get("max_completion_tokens") or ctx.payload.get("max_tokens")
        window = self._models[ctx.model].context_window if ctx.model in self._models else None
        if requested is not None:
            if window and count.tokens + requested > window:
                raise _too_long(window, count.tokens, requested)
            ctx.max_tokens = requested
            return
        if window and count.tokens >= window:
            raise _too_long(window, count.tokens, 0)
        default = self._policies().admission_for(ctx.tenant).default_max_tokens
        ctx.max_tokens = min(default, window - count.tokens) if window else default
        ctx.payload["max_tokens"] = ctx.max_tokens
        ctx.body = json.dumps(ctx.payload).encode()


def _too_long(window: int, prompt: int, completion: int) -> GatewayError:
    return GatewayError(
        400, f"This model's maximum context length is {window} tokens. However, you requested "
             f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
             "Please reduce the length of the messages or completion.",
        code="context_length_exceeded", param="messages")
