"""Admission stage: place the request on its pool, price it in KV blocks, and let it in only where it fits.

A request needs ceil((prompt + max_tokens − predicted cached prefix) / block size) blocks on a replica. If no
available replica has that many free (scraped usage, corrected locally between scrapes), it waits in the pool's
fair queue until capacity frees or its deadline passes.

The pool is the one the request's attempt is authorised for (gateway/stages/authority.py): the model's own unless its
fallbacks said otherwise (gateway/relay/fallbacks.py). A request its pool failed is placed again, on the pool its next
attempt is authorised for, by `move`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence

from opentelemetry.trace import Tracer

from gateway.admission.fair_queue import FairQueue
from gateway.apis.answers import token_count
from gateway.context import Placement, RequestContext, StageOrderError
from gateway.observability.telemetry import Metrics
from gateway.routing.policies import blocks_needed
from gateway.routing.pool import Pool
from gateway.routing.replica import KvHold


class AdmissionStage:
    name = "admission"

    def __init__(
        self, pools: Sequence[Pool], tracer: Tracer, metrics: Metrics, carried: Mapping[str, FairQueue] | None = None
    ) -> None:
        """`carried`: the queues of pools a config reload kept as they were, which keep their waiting requests."""
        self._tracer = tracer
        self._metrics = metrics
        self.queues: dict[str, FairQueue] = {}
        for pool in pools:
            if (queue := (carried or {}).get(pool.name)) is not None:
                self.queues[pool.name] = queue
            elif pool.config.admission.enabled:
                queue = self.queues[pool.name] = FairQueue(pool.config.admission.max_queue)
                pool.on_change.append(queue.dispatch)

    def __call__(self, ctx: RequestContext) -> Awaitable[None]:
        return self._place(ctx)

    async def move(self, ctx: RequestContext) -> None:
        """Place a request again, on the pool its next attempt is authorised for after its pool failed it: what it
        held on the failed pool is settled as its end would settle it, then it is admitted on the new one as on
        arrival."""
        if ctx.placement is not None:
            self._release(ctx, ctx.placement)
            ctx.placement = None
        await self._place(ctx)

    async def _place(self, ctx: RequestContext) -> None:
        pool = ctx.pool
        if pool is None:
            raise StageOrderError("the request has no pool: the authority stage must run before admission")
        salt = pool.cache_salt(ctx.tenant)
        if salt is not None or "cache_salt" in ctx.payload:  # a client never picks whose cache it shares
            ctx.payload.pop("cache_salt", None)
            if salt is not None:
                ctx.payload["cache_salt"] = salt
            ctx.payload_rewritten = True
        request = pool.request_shape(ctx.prompt_tokens or 0, ctx.max_tokens or 0, ctx.prompt_token_ids, salt)
        placement = ctx.placement = Placement(pool, request, KvHold())
        ctx.span.set_attribute("portcullis.pool", pool.name)
        queue = self.queues.get(pool.name)
        if queue is not None:
            await self._admit(ctx, placement, queue)

    def settle(self, ctx: RequestContext) -> None:
        """Free the request's KV blocks for the next admission, and charge its fair queue the output it really
        generated (VTC charges real output, not the reservation)."""
        if ctx.placement is not None:
            self._release(ctx, ctx.placement)

    def _release(self, ctx: RequestContext, placement: Placement) -> None:
        placement.kv_hold.release()
        placement.pool.changed()
        completion = token_count(ctx.usage.completion_tokens)  # as the upstream reported it, if it is a count
        if placement.queue is not None and completion is not None:
            placement.queue.charge(_tenant(ctx), 0, completion - (ctx.max_tokens or 0))

    async def _admit(self, ctx: RequestContext, placement: Placement, queue: FairQueue) -> None:
        pool, request, hold = placement.pool, placement.request, placement.kv_hold
        cached = pool.index.matched_blocks(request.block_hashes) if request.block_hashes else {}

        def take() -> bool:
            """Claim blocks on the first available replica where they fit (routing may move them)."""
            for replica in pool.replicas:
                free = replica.free_blocks
                need = blocks_needed(request, cached.get(replica.url, 0))
                if replica.available() and (free is None or need <= free):
                    hold.move(replica, need)
                    return True
            return False

        prompt, output = ctx.prompt_tokens or 0, ctx.max_tokens or 0
        with self._tracer.start_as_current_span("admission.queue") as span:
            waited = await queue.admit(_tenant(ctx), prompt, output, take, pool.config.admission.queue_timeout)
            span.set_attribute("portcullis.queue.wait_seconds", waited)
            span.set_attribute("portcullis.queue.length", len(queue))
        self._metrics.admission_queue_wait.labels(pool=pool.name).observe(waited)
        placement.queue = queue


def _tenant(ctx: RequestContext) -> str:
    """Whom the fair queue serves and charges."""
    return ctx.tenant or "anonymous"
