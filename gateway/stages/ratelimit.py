"""Rate-limit stage: every policy limit that applies to this request, decided at once; settled when it ends."""

from __future__ import annotations

from collections.abc import Callable

from gateway.context import RequestContext
from gateway.policy.loader import PolicySet
from gateway.policy.model import RateLimitRule
from gateway.ratelimit.limiter import RateLimiter


class RateLimitStage:
    name = "ratelimit"

    def __init__(self, policies: Callable[[], PolicySet], limiter: RateLimiter) -> None:
        self._policies = policies
        self._limiter = limiter

    async def __call__(self, ctx: RequestContext) -> None:
        rules = [r for r in self._policies().rate_limits_for(ctx.tenant) if _applies(r, ctx)]
        if not rules:
            return
        span = ctx.span
        traced = span.is_recording()  # unsampled: skip building the attribute lists
        if traced:
            span.set_attribute("portcullis.ratelimit.limits", [r.id for r in rules])
        grant = await self._limiter.admit(ctx, rules)
        if traced:
            span.set_attribute("portcullis.ratelimit.remaining", [o.remaining for _, _, o in grant.decided])
            span.set_attribute("portcullis.ratelimit.backend", grant.backend.name)
        ctx.rate_limits = grant
        ctx.response_headers.update(grant.headers)

    async def settle(self, ctx: RequestContext) -> None:
        """Charge the request what it cost against its token reservations, and free its slots."""
        if ctx.rate_limits is not None:
            await self._limiter.settle(ctx.rate_limits, ctx)


def _applies(rule: RateLimitRule, ctx: RequestContext) -> bool:
    scope = rule.match
    return (not scope.routes or ctx.route in scope.routes) and (not scope.models or ctx.model in scope.models)
