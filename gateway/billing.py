"""What a finished request cost, counted per tenant and model: the tokens it is charged (the same reconciliation
token limits settle on, `charged_tokens`) priced by the policy's price table (`spec.prices`).

Labels stay bounded: tenants come from the configured keys, models are the configured ones or `other`
(`Metrics.model_label`). A request refused before auth has no tenant and is not billed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from gateway.context import RequestContext
from gateway.policy.loader import PolicySet
from gateway.ratelimit.limiter import charged_tokens
from gateway.telemetry import Metrics


class Billing:
    def __init__(self, metrics: Metrics, policies: Callable[[], PolicySet]) -> None:
        self._metrics = metrics
        self._policies = policies
        # a counter's child per label set, looked up once (prometheus-client's labels() takes a lock each call)
        self._requests = functools.lru_cache(maxsize=4096)(metrics.billed_requests.labels)
        self._tokens = functools.lru_cache(maxsize=4096)(metrics.billed_tokens.labels)
        self._spend = functools.lru_cache(maxsize=4096)(metrics.spend.labels)

    def record(self, ctx: RequestContext) -> float | None:
        """Count the request's tokens and spend; its cost, or None for a request no tenant sent."""
        if ctx.tenant is None:
            return None
        prompt, completion = charged_tokens(ctx)
        reported = ctx.usage.cached_tokens
        cached = min(reported, prompt) if isinstance(reported, int) and reported > 0 else 0
        prices = self._policies().base.spec.prices
        cost = prices.cost(ctx.model, prompt, cached, completion)
        tenant, model = ctx.tenant, self._metrics.model_label(ctx.model)
        self._requests(tenant, model).inc()
        for kind, tokens in (("prompt", prompt - cached), ("cached_prompt", cached), ("completion", completion)):
            if tokens:
                self._tokens(tenant, model, kind).inc(tokens)
        if cost:
            self._spend(tenant, model, prices.currency).inc(cost)
        return cost
