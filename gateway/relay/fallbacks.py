"""Fallbacks across pools: where a request goes on arrival, and when its pool failed it before the client heard a
byte; which pools cool down for a model after failing it. Every place it goes is authorised for it before it goes
there (gateway/stages/authority.py: the key's allow-list, the count and window, limits and budgets of that place's
model): a step its attempt is refused at is passed over, as if it were not configured.

A model's steps are the place it is served (step 0: the pool serving it) and then its configured targets in order:
a `{model}` target is that model on whichever pool serves it (the payload's model rewritten: every request shape
keeps it at the top level), a `{pool}` target the same model on that pool.

On arrival a request starts at the first step not cooling down whose attempt is authorised; at its own step where
there is none (a gateway must not refuse everything because all cooled at once), and there its own refusal, if any,
is the client's answer. When its pool fails it with one of the model's triggers, that (model, pool) cools down for
`cooldown` seconds and the request moves on to the next step that is not cooling down and whose attempt is
authorised; where none is, the client gets the failure it met.

context_length_exceeded is the request's fault, not the pool's: nothing cools, and the request goes to the next
step with another model whose window fits it (cooling or not: nowhere else could serve it). The gateway knows it
before any upstream does where the model's `context_window` is configured: the attempt's count for that model
refuses it. A model with no configured window is one the gateway bounds nowhere: every request fits it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from gateway.config import FallbackConfig, FallbackTrigger
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.relay.upstream import PoolFailed
from gateway.routing.pool import Pool, Pools

# the triggers that say something about the pool, not the request: after them the pool cools down for the model
POOL_TRIGGERS: frozenset[FallbackTrigger] = frozenset({"429", "5xx", "timeout", "connection_error"})
COOLDOWN = "cooldown"  # the metric's trigger for a request sent past a cooling step on arrival
CONTEXT_LENGTH_EXCEEDED: FallbackTrigger = "context_length_exceeded"

# authorises the request's attempt at (model, pool): None once it is there, else the refusal
# (gateway/stages/authority.py)
Authorise = Callable[[RequestContext, str, Pool], Awaitable[GatewayError | None]]


@dataclass(frozen=True, slots=True)
class Step:
    """One place a model's requests may be served: which step it is, the model sent, the pool, and the target as
    configured (a model or pool name: the metric's `to`)."""

    number: int
    model: str
    pool: Pool
    label: str


class Fallbacks:
    def __init__(
        self,
        configs: Sequence[FallbackConfig],
        pools: Pools,
        counter: Counter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pools = pools
        self._configs = {c.model: c for c in configs}
        self._steps = {c.model: _steps(c, pools) for c in configs}
        self._counter = counter
        self._clock = clock
        self._cooling_until: dict[tuple[str, str], float] = {}  # (model, pool name): one entry per configured step

    async def first(self, ctx: RequestContext, authorise: Authorise) -> None:
        """Authorise the request's first attempt, at the first step not cooling down that takes it, else at its own
        step; raises its own step's refusal (404 where no pool serves its model)."""
        requested = ctx.model
        steps = self._steps.get(requested)
        if steps is None:  # no fallbacks: its own pool or nothing
            pool = self._pools.for_model(requested)
            refusal = _not_served(requested) if pool is None else await authorise(ctx, requested, pool)
            if refusal is not None:
                raise refusal
            return
        if not steps:
            raise _not_served(requested)
        own = steps[0]
        if self.cooling(own.model, own.pool.name):
            for step in steps[1:]:
                if (
                    not self.cooling(step.model, step.pool.name)
                    and await self._take(ctx, step, COOLDOWN, authorise) is None
                ):
                    return
        refusal = await self._take(ctx, own, COOLDOWN, authorise)
        if refusal is None:
            return
        if refusal.code != CONTEXT_LENGTH_EXCEEDED:
            raise refusal
        await self._fall_back(ctx, CONTEXT_LENGTH_EXCEEDED, refusal, None, authorise)

    async def after(self, ctx: RequestContext, failure: PoolFailed, authorise: Authorise) -> None:
        """After the request's pool failed it before the client heard a byte: cool that pool down for the model and
        authorise the request's next step; raises `failure` where the failure is not one of the model's triggers or
        no step is left that takes it."""
        failed = ctx.pool.name if ctx.pool is not None else None
        await self._fall_back(ctx, failure.trigger, failure, failed, authorise)

    def cooling(self, model: str, pool: str) -> bool:
        """Whether `pool` failed `model`'s requests less than the model's cooldown ago."""
        until = self._cooling_until.get((model, pool))
        return until is not None and self._clock() < until

    async def _fall_back(
        self,
        ctx: RequestContext,
        trigger: FallbackTrigger,
        failure: GatewayError,
        failed: str | None,
        authorise: Authorise,
    ) -> None:
        config = self._configs.get(_requested(ctx))
        if config is None or trigger not in config.on:
            raise failure
        if failed is not None and trigger in POOL_TRIGGERS and config.cooldown > 0:
            self._cooling_until[(ctx.model, failed)] = self._clock() + config.cooldown
        for step in self._steps[config.model]:
            if step.number <= ctx.fallback_step or (step.model, step.pool.name) == (ctx.model, failed):
                continue
            if trigger == CONTEXT_LENGTH_EXCEEDED:
                if step.model == ctx.model:  # the window it did not fit
                    continue
            elif self.cooling(step.model, step.pool.name):
                continue
            if await self._take(ctx, step, trigger, authorise) is None:
                return
        raise failure

    async def _take(self, ctx: RequestContext, step: Step, trigger: str, authorise: Authorise) -> GatewayError | None:
        """Authorise the request's attempt at `step`; once it is there, a move from the step it was at is counted
        and named on its span. The refusal where it is not."""
        requested = _requested(ctx)
        refusal = await authorise(ctx, step.model, step.pool)
        if refusal is None and step.number != ctx.fallback_step:
            self._counter.labels(model=requested, to=step.label, trigger=trigger).inc()
            ctx.fallback_from, ctx.fallback_step = requested, step.number
            ctx.span.set_attributes({"portcullis.fallback.step": step.number, "portcullis.fallback.trigger": trigger})
        return refusal


def _steps(config: FallbackConfig, pools: Pools) -> list[Step]:
    """A model's steps; a target no pool serves is left out (the config check names pools, not served models)."""
    by_name = {p.name: p for p in pools.pools}
    places = [(config.model, pools.for_model(config.model), config.model)]
    for target in config.to:
        if target.model is not None:
            places.append((target.model, pools.for_model(target.model), target.model))
        elif target.pool is not None:
            places.append((config.model, by_name.get(target.pool), target.pool))
    return [Step(n, model, pool, label) for n, (model, pool, label) in enumerate(places) if pool is not None]


def _requested(ctx: RequestContext) -> str:
    return ctx.fallback_from or ctx.model


def _not_served(model: str) -> GatewayError:
    return GatewayError(
        404, f"the model '{model}' does not exist or is not served here", code="model_not_found", param="model"
    )
