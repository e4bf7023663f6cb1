"""A pool of interchangeable upstream replicas: one pooled aiohttp session, a routing policy, and the background
work that keeps the policy informed (metrics scrapes, KV-event streams).

aiohttp rather than httpx for the data plane: measured on this project's proxy benchmark, httpx's connection pool
cost ~1.6 ms of CPU per request at 32 connections (it re-checks every pooled connection on each request), aiohttp
~0.07 ms — the difference between missing and meeting the gateway's throughput target (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from collections.abc import Callable

import aiohttp

from backend_engine.block_hash import hash_prompt_blocks
from gateway.apis.passthrough import matches
from gateway.config import ConfigError, PoolConfig
from gateway.routing import kv_events, scraper, vllm_events
from gateway.routing.policies import (
    ExpectedTtft,
    LeastLoad,
    LeastOutstanding,
    PrefixAffinity,
    Ranked,
    RoundRobin,
    RouteRequest,
    RoutingPolicy,
)
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.replica import Replica
from gateway.routing.vllm_block_hash import VllmBlockHasher, reported_cached_tokens

_SCRAPED_POLICIES = {"least_load", "prefix_affinity", "kv_events"}


_POLICIES_WITHOUT_INDEX: dict[str, Callable[[], RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "least_load": LeastLoad,
}


def _policy(config: PoolConfig, index: PrefixIndex) -> RoutingPolicy:
    if config.routing in ("prefix_affinity", "kv_events"):
        # kv_events learns from its own decisions too: a follow-up turn often arrives before the engine's event
        # for the first turn's blocks does; the events then confirm them, or remove them on eviction.
        scorer = ExpectedTtft if config.affinity.scorer == "expected_ttft" else PrefixAffinity
        return scorer(index, config.affinity)
    return _POLICIES_WITHOUT_INDEX[config.routing]()


def _rank_endpoint(endpoint: str, rank: int) -> str:
    try:
        return vllm_events.rank_endpoint(endpoint, rank)
    except ValueError as exc:
        raise ConfigError(f"kv_events.data_parallel_size: {exc}") from None


class Pool:
    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.name = config.name
        self.replicas = [Replica(url=r.url) for r in config.replicas]
        self.api_key = config.api_key()  # read once at start; the file never holds it
        self.tenant_api_keys = config.tenant_api_keys()
        self.index = PrefixIndex(config.affinity.index_capacity)
        self.policy = _policy(config, self.index)
        events = config.kv_events
        self.vllm_hasher = (
            VllmBlockHasher(events.hash_algo, config.vllm_hash_seed(), config.block_size)
            if events.source == "vllm"
            else None
        )
        self.vllm_subscriptions = [
            vllm_events.Subscription(
                r.url,
                _rank_endpoint(r.kv_events, rank),
                _rank_endpoint(r.kv_events_replay, rank) if r.kv_events_replay else None,
                events.topic,
            )
            for r in config.replicas
            if r.kv_events and events.source == "vllm"
            for rank in range(events.data_parallel_size)
        ]
        self.on_change: list[Callable[[], None]] = []  # capacity may have freed (admission re-dispatches)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def api_key_for(self, tenant: str | None) -> str | None:
        """The upstream key a tenant's requests carry: its own where it has one, else the pool's."""
        return self.tenant_api_keys.get(tenant, self.api_key) if tenant is not None else self.api_key

    def has_own_key(self, tenant: str | None) -> bool:
        """Whether the provider keeps this tenant's objects apart (its own upstream key)."""
        return tenant is not None and tenant in self.tenant_api_keys

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pool's connections; created on first use, inside the running event loop."""
        if self._session is None:
            t = self.config.timeouts
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self.config.max_connections, limit_per_host=0, keepalive_timeout=t.keepalive
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=t.pool + t.connect, sock_connect=t.connect, sock_read=t.read
                ),
                auto_decompress=False,
                trust_env=False,
                skip_auto_headers=("user-agent",),
                # the session is every client's: a cookie one upstream answer sets must not ride on the next request
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    @property
    def scraped(self) -> bool:
        return self.config.routing in _SCRAPED_POLICIES or self.config.admission.enabled

    def start(self) -> None:
        """Background work for policies that need it; call from a running event loop."""
        if self.scraped:
            self._tasks.append(asyncio.create_task(scraper.scrape_forever(self, self.changed)))
        elif path := self.config.health.path:
            self._tasks.append(asyncio.create_task(scraper.probe_forever(self, path)))
        if self.vllm_subscriptions:
            self._tasks += [asyncio.create_task(vllm_events.follow(s, self.index)) for s in self.vllm_subscriptions]
        elif self.config.routing == "kv_events":
            self._tasks += [asyncio.create_task(kv_events.follow(self.session, r, self.index)) for r in self.replicas]

    def changed(self) -> None:
        for callback in self.on_change:
            callback()

    def cache_salt(self, tenant: str | None) -> str | None:
        """The cache_salt this pool's upstreams get for a tenant (never one a client chose)."""
        if self.config.cache_isolation == "shared":
            return None
        return hashlib.sha256(f"portcullis-tenant:{tenant or ''}".encode()).hexdigest()[:16]

    def request_shape(
        self, prompt_tokens: int, max_tokens: int, token_ids: list[int] | None, salt: str | None = None
    ) -> RouteRequest:
        """A request in KV blocks; prompt block hashes (the replicas' own scheme) only where the exact token ids are
        known."""
        size = self.config.block_size
        hashes: list[int] = []
        if token_ids and self.config.routing in ("prefix_affinity", "kv_events"):
            if self.vllm_hasher is not None:
                hashes = self.vllm_hasher.prompt_keys(token_ids, salt)
            else:
                hashes = hash_prompt_blocks(token_ids, size, salt)
        return RouteRequest(hashes, math.ceil(prompt_tokens / size), math.ceil(max_tokens / size), prompt_tokens, size)

    def predicted_cached_tokens(self, cached_blocks: int, prompt_tokens: int) -> int:
        """The `cached_tokens` a replica holding `cached_blocks` of the prompt is expected to report."""
        if self.vllm_hasher is not None:
            return reported_cached_tokens(cached_blocks, prompt_tokens, self.config.block_size)
        return cached_blocks * self.config.block_size

    def rank(self, request: RouteRequest) -> Ranked:
        """Replicas in the order to try them; ejected ones last (still tried if nothing else is left)."""
        ranked = self.policy.rank(self.replicas, request)
        if len(ranked.replicas) > 1:  # one replica is in order already: no key asked of it
            ranked.replicas.sort(key=lambda r: not r.available())
        return ranked

    def record(self, replica: Replica, ok: bool) -> None:
        replica.record(ok, self.config.health.failures_to_eject, self.config.health.eject_seconds)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()


class Pools:
    """All configured pools; picks the one serving a model (explicit model lists win over catch-alls)."""

    def __init__(self, pools: list[Pool]) -> None:
        self.pools = pools

    def for_model(self, model: str) -> Pool | None:
        catch_all = None
        for pool in self.pools:  # loops, not next() over generators: this runs for every request
            if model in pool.config.models:
                return pool
            if catch_all is None and not pool.config.models:
                catch_all = pool
        return catch_all

    def for_passthrough(self, path: str) -> Pool | None:
        """The first pool that opted in to passing this route through."""
        return next((p for p in self.pools if any(matches(route, path) for route in p.config.passthrough)), None)

    def start(self) -> None:
        for pool in self.pools:
            pool.start()

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()
