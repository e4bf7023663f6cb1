"""Route stage: rank the pool's replicas for this request (its policy decides how) and hold its KV blocks on the
chosen one until the response ends, so the next decision sees them before the next scrape does."""

from __future__ import annotations

from gateway.context import RequestContext


class RouteStage:
    name = "route"

    async def __call__(self, ctx: RequestContext) -> None:
        pool, request = ctx.pool, ctx.route_request
        assert pool is not None and request is not None, "admission resolves the pool before routing"
        ranked = pool.rank(request)
        ctx.candidates = ranked.replicas
        chosen = ranked.replicas[0]
        blocks = ranked.blocks_needed(chosen, request)
        chosen.reserved_blocks += blocks
        pool.policy.learn(request, chosen)
        cached = ranked.cached_blocks.get(chosen.url, 0)
        ctx.span.set_attributes({
            "portcullis.route.policy": pool.config.routing,
            "portcullis.route.replica": chosen.url,
            "portcullis.route.replica_state": chosen.state,
            "portcullis.route.replica_load": chosen.load,
            "portcullis.route.replica_kv_usage": chosen.kv_usage,
            "portcullis.route.predicted_cached_tokens": cached * pool.config.block_size,
        })

        async def release(done: RequestContext) -> None:
            chosen.reserved_blocks -= blocks
            pool.changed()

        ctx.on_complete.append(release)
