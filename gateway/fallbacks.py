"""Fallbacks across pools: where a request goes when its pool failed it before the client heard a byte, and which
pools cool down for a model after failing it.

A model's steps are the place it is served (step 0: the pool serving it) and then its configured targets in order:
a `{model}` target is that model on whichever pool serves it (the payload's model rewritten: every request shape
keeps it at the top level), a `{pool}` target the same model on that pool. A request starts at the first step not
cooling down (at the first of all when every one is: a gateway must not refuse everything because all cooled at
once). When its pool fails it with one of the model's triggers, that (model, pool) cools down for `cooldown`
seconds and the request moves on to the next step that is not cooling and whose model's context window fits it.

context_length_exceeded is the request's fault, not the pool's: nothing cools, and the request goes to the next
step with another model whose window fits it (cooling or not: nowhere else could serve it). The gateway knows it
before any upstream does where the model's `context_window` is configured (`ContextWindowFallback`). A model with
no configured window is one the gateway bounds nowhere: every request fits it, here as in the tokenize stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from gateway.config import FallbackConfig, FallbackTrigger, ModelConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.pipeline import Stage
from gateway.routing.pool import Pool, Pools

# the triggers that say something about the pool, not the request: after them the pool cools down for the model
POOL_TRIGGERS: frozenset[FallbackTrigger] = frozenset({"429", "5xx", "timeout", "connection_error"})
COOLDOWN = "cooldown"  # the metric's trigger for a request sent past a cooling step on arrival
CONTEXT_LENGTH_EXCEEDED: FallbackTrigger = "context_length_exceeded"


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
        models: Sequence[ModelConfig],
        counter: Counter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pools = pools
        self._configs = {c.model: c for c in configs}
        self._steps = {c.model: _steps(c, pools) for c in configs}
        self._windows = {m.name: m.context_window for m in models}
        self._counter = counter
        self._clock = clock
        self._cooling_until: dict[tuple[str, str], float] = {}  # (model, pool name): one entry per configured step

    def first(self, ctx: RequestContext) -> Pool | None:
        """The pool a request starts on: from the step it is at (the tokenize stage may have moved it), the first
        not cooling down, else that step anyway; None where no pool serves its model."""
        steps = self._steps.get(_requested(ctx))
        if steps is None:
            return self._pools.for_model(ctx.model)
        ahead = [s for s in steps if s.number >= ctx.fallback_step and self._fits(ctx, s)]
        if not ahead:
            return None
        step = next((s for s in ahead if not self.cooling(s.model, s.pool.name)), ahead[0])
        if step.number != ctx.fallback_step:
            self._move(ctx, step, COOLDOWN)
        return step.pool

    def after(self, ctx: RequestContext, trigger: FallbackTrigger) -> Pool | None:
        """After the request's pool failed it (or, before it was placed, the gateway found it too long for its
        model): cool that pool down for the model and move the request to its next step; None when the failure is
        not one of the model's triggers or no step is left."""
        config = self._configs.get(_requested(ctx))
        if config is None or trigger not in config.on:
            return None
        failed = ctx.placement.pool.name if ctx.placement is not None else None
        if failed is not None and trigger in POOL_TRIGGERS and config.cooldown > 0:
            self._cooling_until[(ctx.model, failed)] = self._clock() + config.cooldown
        for step in self._steps[config.model]:
            if step.number <= ctx.fallback_step or (step.model, step.pool.name) == (ctx.model, failed):
                continue
            if trigger == CONTEXT_LENGTH_EXCEEDED:
                usable = step.model != ctx.model and self._fits(ctx, step)
            else:
                usable = self._fits(ctx, step) and not self.cooling(step.model, step.pool.name)
            if usable:
                self._move(ctx, step, trigger)
                return step.pool
        return None

    def cooling(self, model: str, pool: str) -> bool:
        """Whether `pool` failed `model`'s requests less than the model's cooldown ago."""
        until = self._cooling_until.get((model, pool))
        return until is not None and self._clock() < until

    def _fits(self, ctx: RequestContext, step: Step) -> bool:
        """Whether the request fits the step's model's context window (the tokenize stage checked its own model's)."""
        window = self._windows.get(step.model)
        if window is None or step.model == ctx.model:
            return True
        return (ctx.prompt_tokens or 0) + _output_budget(ctx) <= window

    def _move(self, ctx: RequestContext, step: Step, trigger: str) -> None:
        requested = _requested(ctx)
        self._counter.labels(model=requested, to=step.label, trigger=trigger).inc()
        ctx.fallback_from, ctx.fallback_step = requested, step.number
        if step.model != ctx.model:
            ctx.model = ctx.payload["model"] = step.model
            ctx.payload_rewritten = True
        ctx.span.set_attributes({"portcullis.fallback.step": step.number, "portcullis.fallback.trigger": trigger})


class ContextWindowFallback:
    """The tokenize stage, with a way out: a request the stage refuses as too long for its model's configured
    context window moves to the model's first fallback model whose window fits it, and is counted again for it
    (before rate limits, so its limits are reserved once, for the model that serves it)."""

    name = "tokenize"

    def __init__(self, tokenize: Stage, fallbacks: Fallbacks) -> None:
        self._tokenize = tokenize
        self._fallbacks = fallbacks

    async def __call__(self, ctx: RequestContext) -> None:
        try:
            await self._tokenize(ctx)
        except GatewayError as refused:
            if refused.code != CONTEXT_LENGTH_EXCEEDED or self._fallbacks.after(ctx, CONTEXT_LENGTH_EXCEEDED) is None:
                raise
            await self._tokenize(ctx)


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


def _output_budget(ctx: RequestContext) -> int:
    """What one choice may generate: the largest output bound the request names, or one token where it names
    none (the tokenize stage then fills what the window leaves)."""
    named = [v for f in ctx.api.output_fields if isinstance(v := ctx.payload.get(f), int)]
    return max(named, default=1 if ctx.api.generates else 0)
