"""Rate limits and budgets: every policy limit and budget that applies to a request sent to one model, decided at
once; settled when it ends, or given back when the attempt they were granted for fails.

The rate-limit part of an attempt's authority (gateway/stages/authority.py), which decides them for each attempt's
model; a passthrough route, which names no model, runs it as a stage of its pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.context import Demand, RequestContext
from gateway.policy.loader import PolicySet
from gateway.policy.model import RateLimitRule
from gateway.ratelimit.limiter import Grant, RateLimiter
from gateway.spend import budgets


class RateLimitStage:
    name = "ratelimit"

    def __init__(self, policies: Callable[[], PolicySet], limiter: RateLimiter) -> None:
        self._policies = policies
        self._limiter = limiter

    async def __call__(self, ctx: RequestContext) -> None:
        """A request as it came (a passthrough route's): its limits for the model it names, if any."""
        demand = Demand(ctx.model, ctx.prompt_tokens or 0, None, ctx.max_tokens or 0)
        self.hold(ctx, await self.grant(ctx, demand))

    async def grant(self, ctx: RequestContext, demand: Demand) -> Grant | None:
        """The limits and budgets of the request sent to `demand.model`: the rules that match that model, counters
        keyed on it, tokens reserved as it counts them, budgets reserved at its price. Raises 429 if any refuses;
        None where none applies."""
        policies = self._policies()
        rules: Sequence[RateLimitRule] = policies.rate_limits_for(ctx.tenant)
        if rules:
            rules = [r for r in rules if _applies(r, ctx.route, demand.model, ctx.tool)]
        applied = budgets.applicable(ctx, policies.budgets_for(ctx.tenant))
        if not rules and not applied:
            return None
        span = ctx.span
        traced = span.is_recording()  # unsampled: skip building the attribute lists
        if traced:
            span.set_attribute("portcullis.ratelimit.limits", [r.id for r in rules])
            if applied:
                span.set_attribute("portcullis.budgets", [b.id for b in applied])
        grant = await self._limiter.admit(ctx, demand, rules, applied, policies.base.spec.prices)
        if traced:
            span.set_attribute("portcullis.ratelimit.remaining", [o.remaining for _, _, o in grant.decided])
            span.set_attribute("portcullis.ratelimit.backend", grant.backend.name)
        return grant

    def hold(self, ctx: RequestContext, grant: Grant | None) -> None:
        """The request holds `grant` until it ends (or its attempt fails); its answer says where it stands."""
        ctx.rate_limits = grant
        if grant is not None and grant.headers:
            ctx.response_headers.update(grant.headers)

    def release(self, ctx: RequestContext) -> None:
        """Give back what the request holds for an attempt that failed before its upstream served anything: its
        reservations cost nothing and its slots are free; the requests it counted stay counted (its upstream was
        asked). Its answer no longer reports those limits."""
        grant = ctx.rate_limits
        if grant is None:
            return
        ctx.rate_limits = None
        for name in grant.headers:
            ctx.response_headers.pop(name, None)
        self._limiter.release(grant)

    def settle(self, ctx: RequestContext) -> None:
        """Charge the request what it cost against its token and spend reservations, and free its slots."""
        if ctx.rate_limits is not None:
            self._limiter.settle(ctx.rate_limits, ctx)


def _applies(rule: RateLimitRule, route: str, model: str, tool: str) -> bool:
    scope = rule.match
    return (
        (not scope.routes or route in scope.routes)
        and (not scope.models or model in scope.models)
        and (not scope.tools or tool in scope.tools)
    )
