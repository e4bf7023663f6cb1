"""Route stage: rank the pool's replicas for this request (its policy decides how) and move its KV hold to the
chosen one, so the next decision sees those blocks before the next scrape does (admission releases the hold), and
its prefill work, until its first token arrives (the upstream client releases that)."""

from __future__ import annotations

from gateway.context import RequestContext


class RouteStage:
    name = "route"

    async def __call__(self, ctx: RequestContext) -> None:
        placement = ctx.placed
        pool, request = placement.pool, placement.request
        ranked = pool.rank(request)
        placement.candidates = ranked.replicas
        chosen = ranked.replicas[0]
        placement.kv_hold.move(chosen, ranked.blocks_needed(chosen, request), ranked.uncached_tokens(chosen, request))
        pool.policy.learn(request, chosen)
        ctx.predicted_cached_tokens = pool.predicted_cached_tokens(
            ranked.cached_blocks.get(chosen.url, 0), ctx.prompt_tokens or 0
        )
        ctx.span.set_attributes(
            {
                "portcullis.route.policy": pool.config.routing,
                "portcullis.route.replica": chosen.url,
                "portcullis.route.replica_state": chosen.state,
                "portcullis.route.replica_load": chosen.load,
                "portcullis.route.replica_kv_usage": chosen.kv_usage,
                "portcullis.route.predicted_cached_tokens": ctx.predicted_cached_tokens,
            }
        )
