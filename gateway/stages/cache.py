"""Cache stage: answer a request from the response cache (gateway/cache/), after every input stage has judged it.

It runs last before routing: the WAF, auth, the request's authority (its key's models, rate limits, budgets) and the
input guard hold for a hit as for any request (a hit is counted by its limits and settled at the price table's
`cached` price), and the pool the key names is the one the request was placed on. A hit answers from the stored
answer: as stored, or replayed as the stream the client asked for, in the route's own event shapes
(gateway/cache/replay.py), through the output guard under the current policy and the Messages translation as an
upstream's answer goes; the stages after this one and the upstream do not run. A miss leaves a `CacheFill` for the
upstream relay to store the answer with. Where the policy turns the semantic match on, an exact miss may still be
answered with a paraphrase's answer (gateway/cache/semantic.py). Each is told to the client
(`x-portcullis-cache: hit|semantic-hit|miss`), counted (`portcullis_cache_requests_total{route,result}`, with `bypass`
for a request the policy covers but that is not cacheable) and set on the request's span (`portcullis.cache.result`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import orjson
from starlette.responses import Response

from gateway.cache.fill import CacheFill
from gateway.cache.key import bypass_reason, cache_key
from gateway.cache.replay import replayed
from gateway.cache.semantic import SEMANTIC_ROUTES, Embedder, SemanticIndex, bucket_key, last_user_text
from gateway.cache.stores import AnswerStore
from gateway.cache.wording import Wording
from gateway.context import RequestContext
from gateway.observability.telemetry import Metrics
from gateway.policy.loader import PolicySet
from gateway.policy.model import SemanticCache
from gateway.relay.upstream import SSE_HEADERS, answer_headers, whole_answer

HEADER = "x-portcullis-cache"


class CacheStage:
    name = "cache"

    def __init__(
        self,
        policies: Callable[[], PolicySet],
        store: AnswerStore,
        metrics: Metrics,
        max_entry_bytes: int,
        embedder: Embedder,
        max_embeddings: int,
    ) -> None:
        self._policies = policies
        self.store = store
        self._max_entry_bytes = max_entry_bytes
        self._requests = metrics.tallies.counter(metrics.cache_requests)  # by route and result
        self._writes: set[asyncio.Task[None]] = set()
        self._embedder = embedder
        self._index = SemanticIndex(max_embeddings)

    def applies(self, policies: PolicySet) -> bool:
        """Whether the policy set turns the cache on for anyone: where it does not, the pipeline leaves this stage
        out (gateway/pipeline.py's `Conditional`)."""
        specs = [policies.base.spec.cache, *(overlay.spec.cache for overlay in policies.overlays.values())]
        return any(spec is not None and spec.enabled for spec in specs)

    async def __call__(self, ctx: RequestContext) -> None:
        spec = self._policies().cache_for(ctx.tenant)
        if not spec.enabled:
            return
        pool = ctx.placed.pool
        if not spec.applies(ctx.route, ctx.model, pool.name):
            return
        headers = ctx.request.headers
        tenant = ctx.tenant if ctx.key_id is not None else None  # no key: the gateway runs anonymous, one "tenant"
        beta = headers.get("anthropic-beta") if pool.config.api == "anthropic" else None
        key = None
        if tenant is not None and not bypass_reason(spec, ctx.route, tenant, ctx.payload, headers.get("cache-control")):
            key = cache_key(tenant, ctx.route, pool.name, ctx.payload, beta)
        if tenant is None or key is None:
            self._result(ctx, "bypass")
            return
        if await self._answer_from(ctx, key, "hit"):
            return
        remember: Callable[[], None] | None = None
        if spec.semantic is not None:
            answered, remember = await self._semantic(ctx, spec.semantic, tenant, pool.name, beta, key)
            if answered:
                return
        self._result(ctx, "miss")
        path = ctx.exchange.path
        target = (ctx.model, pool.name)
        ctx.cache_fill = CacheFill(
            self.store, self._writes, key, spec.ttl, path, target, self._max_entry_bytes, remember
        )

    async def aclose(self) -> None:
        """Let the writes in flight finish, then close the store."""
        if self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)
        await self.store.aclose()

    async def _answer_from(self, ctx: RequestContext, key: str, result: str) -> bool:
        """Answer the request with the answer stored under `key`, where there is one."""
        found = await self.store.get(key)
        answer = _json_object(found) if found is not None else None
        if found is None or answer is None:
            return False
        self._result(ctx, result)
        ctx.answered = await self._replay(ctx, found, answer)
        return True

    async def _semantic(
        self, ctx: RequestContext, semantic: SemanticCache, tenant: str, pool: str, beta: str | None, key: str
    ) -> tuple[bool, Callable[[], None] | None]:
        """The semantic match (gateway/cache/semantic.py): whether it answered the request; if not, what remembers
        the request's embedding once its answer is stored (None where it has none)."""
        text = last_user_text(ctx.payload)
        if ctx.route not in SEMANTIC_ROUTES or text is None:
            return False, None
        if not semantic.tools and (ctx.payload.get("tools") or ctx.payload.get("functions")):
            return False, None
        bucket = bucket_key(tenant, ctx.route, pool, ctx.payload, beta, semantic.model)
        vector = await self._embedder.embed(semantic.model, text) if bucket is not None else None
        if bucket is None or vector is None:
            return False, None
        wording = Wording.of(text)
        near = self._index.nearest(bucket, vector, wording, semantic.threshold)
        if near is not None and await self._answer_from(ctx, near[0], "semantic_hit"):
            ctx.span.set_attribute("portcullis.cache.similarity", near[1])
            return True, None
        return False, functools.partial(self._index.add, bucket, vector, wording, key)

    def _result(self, ctx: RequestContext, result: str) -> None:
        ctx.cache_result = result
        self._requests(ctx.route, result).inc()
        ctx.span.set_attribute("portcullis.cache.result", result)
        if result != "bypass":
            ctx.response_headers[HEADER] = result.replace("_", "-")

    async def _replay(self, ctx: RequestContext, stored: bytes, answer: dict[str, Any]) -> Response:
        """The stored answer as the client asked for it; usage recorded from it, for limits and billing."""
        exchange = ctx.exchange
        ctx.status = 200
        exchange.answers.record(ctx.usage, answer)
        headers = answer_headers(ctx)
        if not ctx.stream:
            content = stored if ctx.output_guard is None else await ctx.output_guard.check_body(stored)
            return whole_answer(ctx, exchange, content, headers, "application/json")
        options = ctx.payload.get("stream_options")
        asked = isinstance(options, dict) and bool(options.get("include_usage"))
        events = replayed(exchange.path, answer, include_usage=asked or exchange.translation.asks_stream_usage)
        if ctx.output_guard is not None:  # raises GuardBlocked before the answer starts
            events = await ctx.output_guard.feed(events)
        translation = exchange.translation.stream(ctx.payload, ctx.model)
        if translation is not None:
            events = translation.feed(events)
        return Response(b"".join(events), headers={**SSE_HEADERS, **headers}, media_type="text/event-stream")


def _json_object(stored: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(stored)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None
