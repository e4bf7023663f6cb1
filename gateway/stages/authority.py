"""Authority stage: whether this key may make this attempt, decided for every upstream attempt a request makes, the
first and each fallback (to another model, or to the same model on another pool), as for a request of its own.

What a request may do depends on the model it is sent to, not only on the one it named, so each attempt is
authorised for the model and pool it actually calls:
- the calling key's model allow-list (a stored key's `models`);
- the model's owner: a model another tenant made (a fine-tune) is not found, nor is an unrecorded one unless the
  operator lets it be used (gateway/tenancy/models.py), so a fallback reaches no other tenant's model either;
- the prompt as that model's tokenizer counts it, and its output bounded by that model's context window;
- the rate limits that match that model, their counters keyed on it and their token reservations as it counts them;
- the budgets, reserved at that model's price.
Granted, the request is at that target: its model (the payload's too), its counts, what its limits granted and its
pool are the target's. Refused, it is left as it was, and the refusal says why.

A request holds one authorisation at a time. Deciding another gives back the one it holds first: that attempt failed
before its upstream served anything, so its reservations cost nothing and its slots are free (the requests it
counted stay counted: its upstream was asked). What the last attempt holds is settled when the request ends, at the
price of the model that served it.

Which targets a request tries, and in what order, is gateway/relay/fallbacks.py's to say: the stage starts the request
at the first step that takes it, and `after` moves it on when its pool failed it. Retries on other replicas of one pool
call the same model on the same pool: they run under that attempt's authorisation.

Each attempt's two costly parts show in the trace as spans of their own under the stage's (`tokenize` for the
target model, `ratelimit` for its limits and budgets), so a trace still reads stage by stage, once per attempt.
"""

from __future__ import annotations

from collections.abc import Awaitable
from contextlib import AbstractContextManager

from opentelemetry.trace import Tracer

from gateway.context import Demand, RequestContext
from gateway.errors import GatewayError
from gateway.relay.fallbacks import Fallbacks
from gateway.relay.upstream import PoolFailed
from gateway.routing.pool import Pool
from gateway.stages.auth import model_not_allowed
from gateway.stages.ratelimit import RateLimitStage
from gateway.stages.tokenize import Tokenize
from gateway.tenancy.models import TenantModels


class AuthorityStage:
    name = "authority"

    def __init__(
        self, tokenize: Tokenize, limits: RateLimitStage, fallbacks: Fallbacks, models: TenantModels, tracer: Tracer
    ) -> None:
        self._tracer = tracer
        self._models = models
        self._tokenize = tokenize
        self._limits = limits
        self._fallbacks = fallbacks

    def __call__(self, ctx: RequestContext) -> Awaitable[None]:
        """The request's first attempt: at the first step of its model's fallbacks that takes it."""
        return self._fallbacks.first(ctx, self.authorise)

    async def after(self, ctx: RequestContext, failure: PoolFailed) -> None:
        """The request's next attempt, once its pool failed it before the client heard a byte; raises `failure`
        where no fallback step is left that takes it."""
        await self._fallbacks.after(ctx, failure, self.authorise)

    def settle(self, ctx: RequestContext) -> None:
        """Charge the request what it cost against what its last attempt was granted, and free its slots."""
        self._limits.settle(ctx)

    async def authorise(self, ctx: RequestContext, model: str, pool: Pool) -> GatewayError | None:
        """Authorise the request's next attempt, at `model` on `pool`: None once it is there, else the refusal
        (the request is left as it was, holding nothing)."""
        self._limits.release(ctx)
        key = ctx.key
        if key is not None and not key.allows(model):
            return model_not_allowed(model)
        models = self._models
        if models.looked_up(model) and (refusal := await models.refusal(ctx, model, pool)) is not None:
            return refusal
        try:
            if ctx.span.is_recording():
                with self._part("tokenize", model):
                    demand = self._counted(ctx, model) or await self._tokenize.demand(ctx, model)
                with self._part("ratelimit", model):
                    grant = await self._limits.grant(ctx, demand)
            else:  # an unsampled request's spans would record nothing and still cost the tracer's bookkeeping
                demand = self._counted(ctx, model) or await self._tokenize.demand(ctx, model)
                grant = await self._limits.grant(ctx, demand)
        except GatewayError as refusal:
            return refusal
        if model != ctx.model:
            ctx.model = ctx.payload["model"] = model  # every request shape keeps its model at the top level
            ctx.payload_rewritten = True
        if demand.filled is not None:  # the request named no output bound: the one this model's window leaves
            field = ctx.api.fill_field
            assert field is not None  # filled only for a shape that has one
            ctx.payload[field] = demand.filled
            ctx.payload_rewritten = True
        ctx.pool = pool
        ctx.prompt_tokens, ctx.prompt_token_ids = demand.prompt_tokens, demand.prompt_token_ids
        ctx.max_tokens = demand.max_tokens
        ctx.span.set_attribute("gen_ai.usage.input_tokens", demand.prompt_tokens)
        self._limits.hold(ctx, grant)
        return None

    def _part(self, name: str, model: str) -> AbstractContextManager[object]:
        """An attempt's part as a span of its own, where the request is traced."""
        return self._tracer.start_as_current_span(name, attributes={"gen_ai.request.model": model})

    @staticmethod
    def _counted(ctx: RequestContext, model: str) -> Demand | None:
        """What the request asks of `model` where an earlier attempt to the same model counted it already."""
        if model == ctx.model and ctx.prompt_tokens is not None:
            return Demand(model, ctx.prompt_tokens, ctx.prompt_token_ids, ctx.max_tokens or 0)
        return None
