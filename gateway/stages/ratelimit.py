"""Rate-limit stage: every policy limit and budget that applies to this request, decided at once; settled when it
ends."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.context import RequestContext
from gateway.policy.loader import PolicySet
from gateway.policy.model import RateLimitRule
from gateway.ratelimit.limiter import RateLimiter
from gateway.spend import budgets


class RateLimitStage:
    name = "ratelimit"

    def __init__(self, policies: Callable[[], PolicySet], limiter: RateLimiter) -> None:
        self._policies = policies
        self._limiter = limiter

    async def __call__(self, ctx: RequestContext) -> None:
        policies = self._policies()
        rules: Sequence[RateLimitRule] = policies.rate_limits_for(ctx.tenant)
        if rules:
            rules = [r for r in rules if _applies(r, ctx)]
        applied = budgets.applicable(ctx, policies.budgets_for(ctx.tenant))
        if not rules and not applied:
            return
        span = ctx.span
        traced = span.is_recording()  # unsampled: skip building the attribute lists
        if traced:
            span.set_attribute("portcullis.ratelimit.limits", [r.id for r in rules])
            if applied:
                span.set_attribute("portcullis.budgets", [b.id for b in applied])
        grant = await self._limiter.admit(ctx, rules, applied, policies.base.spec.prices)
        if traced:
            span.set_attribute("portcullis.ratelimit.remaining", [o.remaining for _, _, o in grant.decided])
            span.set_attribute("portcullis.ratelimit.backend", grant.backend.name)
        ctx.rate_limits = grant
        if grant.headers:
            ctx.response_headers.update(grant.headers)

    def settle(self, ctx: RequestContext) -> None:
        """Charge the request what it cost against its token and spend reservations, and free its slots."""
        if ctx.rate_limits is not None:
            self._limiter.settle(ctx.rate_limits, ctx)


def _applies(rule: RateLimitRule, ctx: RequestContext) -> bool:
    scope = rule.match
    return (not scope.routes or ctx.route in scope.routes) and (not scope.models or ctx.model in scope.models)
