"""Route stage: pick the pool serving the requested model and the order its replicas will be tried in."""

from __future__ import annotations

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.routing.pool import Pools


class RouteStage:
    name = "route"

    def __init__(self, pools: Pools) -> None:
        self.pools = pools

    async def __call__(self, ctx: RequestContext) -> None:
        pool = self.pools.for_model(ctx.model)
        if pool is None:
            raise GatewayError(404, f"the model '{ctx.model}' does not exist or is not served here",
                               code="model_not_found", param="model")
        ctx.pool = pool
        ctx.candidates = pool.candidates()
        ctx.span.set_attribute("portcullis.pool", pool.name)
