"""Admission stage: resolve the model's pool, price the request in KV blocks, and let it in only where it fits.

A request needs ceil((prompt + max_tokens − predicted cached prefix) / block size) blocks on a replica. If no
available replica has that many free (scraped usage, corrected locally between scrapes), it waits in the pool's
fair queue until capacity frees or its deadline passes.
"""

from __future__ import annotations

import json

from opentelemetry.trace import Tracer

from gateway.admission.fair_queue import FairQueue
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.routing.policies import blocks_needed
from gateway.routing.pool import Pool, Pools
from gateway.routing.replica import KvHold
from gateway.telemetry import Metrics


class AdmissionStage:
    name = "admission"

    def __init__(self, pools: Pools, tracer: Tracer, metrics: Metrics) -> None:
        self.pools = pools
        self._tracer = tracer
        self._metrics = metrics
        self.queues: dict[str, FairQueue] = {}
        for pool in pools.pools:
            if pool.config.admission.enabled:
                queue = self.queues[pool.name] = FairQueue(pool.config.admission.max_queue)
                pool.on_change.append(queue.dispatch)

    async def __call__(self, ctx: RequestContext) -> None:
        pool = self.pools.for_model(ctx.model)
        if pool is None:
            raise GatewayError(
                404,
                f"the model '{ctx.model}' does not exist or is not served here",
                code="model_not_found",
                param="model",
            )
        ctx.pool = pool
        salt = pool.cache_salt(ctx.tenant)
        if salt is not None or "cache_salt" in ctx.payload:  # a client never picks whose cache it shares
            ctx.payload.pop("cache_salt", None)
            if salt is not None:
                ctx.payload["cache_salt"] = salt
            ctx.body = json.dumps(ctx.payload).encode()
        ctx.route_request = pool.request_shape(ctx.prompt_tokens or 0, ctx.max_tokens or 0, ctx.prompt_token_ids, salt)
        ctx.span.set_attribute("portcullis.pool", pool.name)
        ctx.kv_hold = KvHold()

        async def release(done: RequestContext) -> None:
            done.kv_hold.release()
            pool.changed()

        ctx.on_complete.append(release)
        queue = self.queues.get(pool.name)
        if queue is not None:
            await self._admit(ctx, pool, queue)

    async def _admit(self, ctx: RequestContext, pool: Pool, queue: FairQueue) -> None:
        request = ctx.route_request
        cached = pool.index.matched_blocks(request.block_hashes) if request.block_hashes else {}

        def take() -> bool:
            """Claim blocks on the first available replica where they fit (routing may move them)."""
            for replica in pool.replicas:
                free = replica.free_blocks
                need = blocks_needed(request, cached.get(replica.url, 0))
                if replica.available() and (free is None or need <= free):
                    ctx.kv_hold.move(replica, need)
                    return True
            return False

        tenant = ctx.tenant or "anonymous"
        prompt, output = ctx.prompt_tokens or 0, ctx.max_tokens or 0
        with self._tracer.start_as_current_span("admission.queue") as span:
            waited = await queue.admit(tenant, prompt, output, take, pool.config.admission.queue_timeout)
            span.set_attribute("portcullis.queue.wait_seconds", waited)
            span.set_attribute("portcullis.queue.length", len(queue))
        self._metrics.admission_queue_wait.labels(pool=pool.name).observe(waited)

        async def settle(done: RequestContext) -> None:
            if done.usage.completion_tokens is not None:  # VTC charges real output, not the reservation
                queue.charge(tenant, 0, done.usage.completion_tokens - output)

        ctx.on_complete.append(settle)
