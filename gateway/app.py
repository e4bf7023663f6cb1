"""The Starlette app: routes, and the lifespan that owns pools, pipeline and telemetry (the proxy routes' endpoints
are gateway/endpoints.py's)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from gateway.admin.app import ByListener, build_admin_app
from gateway.admin.token import admin_token as resolve_admin_token
from gateway.apis.routes import APIS, route_error
from gateway.cache.semantic import Embedder
from gateway.cache.stores import build_answer_store
from gateway.config import ConfigError, GatewayConfig
from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.edge.shape_gate import ShapeGate
from gateway.endpoints import ModelRoutes, PassthroughEndpoint, ProxyEndpoint
from gateway.errors import EXCEPTION_HANDLERS, GatewayError
from gateway.fleet import FleetBuilder, Fleets, OnFleet
from gateway.guard.runtime import Guard
from gateway.keystore.keyring import KeyRing, static_keys
from gateway.keystore.store import build_key_store
from gateway.mcp.endpoint import McpEndpoint
from gateway.mcp.service import McpService
from gateway.observability.telemetry import (
    Metrics,
    build_tracer_provider,
    configured_models,
    records_spans,
)
from gateway.pipeline import Pipeline
from gateway.policy.loader import PolicySet, empty_policy_set, load_policy_dir
from gateway.policy.reload import PolicyReloader, log_policy_warnings
from gateway.ratelimit.checks import Backend
from gateway.ratelimit.failover import CircuitBreaker, FailoverBackend
from gateway.ratelimit.limiter import RateLimiter
from gateway.ratelimit.memory import MemoryBackend
from gateway.ratelimit.redis_backend import RedisBackend
from gateway.relay.upstream import Upstream
from gateway.reload.config import ConfigReloader, ConfigSource, config_version
from gateway.reload.watcher import reload_on_hangup, stop_reloading_on_hangup
from gateway.routing.pool import Pool
from gateway.spend.billing import Billing
from gateway.spend.ledger import SpendLedger
from gateway.spend.redis_ledger import RedisSpendStore
from gateway.spend.sqlite_budgets import SqliteBudgets
from gateway.spend.sqlite_ledger import SqliteSpendStore
from gateway.spend.store import SpendStore
from gateway.stages.auth import AuthStage
from gateway.stages.cache import CacheStage
from gateway.stages.guard import GuardStage
from gateway.stages.parse import ParseStage, RawBodyStage, parse_body
from gateway.stages.ratelimit import RateLimitStage
from gateway.stages.route import RouteStage
from gateway.stages.waf import WafStage
from gateway.tenancy.batch_requests import BatchRequestChecks
from gateway.tenancy.ownership import TenantObjects
from gateway.tenancy.stage import ObjectsStage
from gateway.tenancy.store import build_object_store

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 2.0
# Allocations between young-generation collections (CPython's default: 700). A request's objects die young, freed
# by reference counts, yet 32 requests in flight crossed 700 every ninth request or so: ~40 us of collection per
# request (6 % of a proxied request's CPU). At 10,000 it all but disappears; cyclic garbage waits at most that long.
YOUNG_GC_THRESHOLD = 10_000


class Gateway:
    """Everything one gateway process shares across requests."""

    def __init__(
        self, config: GatewayConfig, span_exporter: SpanExporter | None = None, reload: ConfigSource | None = None
    ) -> None:
        self.config = config
        self.metrics = Metrics(configured_models(config))
        self.tracer_provider = build_tracer_provider(config.telemetry, span_exporter)
        self.tracer = self.tracer_provider.get_tracer("portcullis.gateway")
        self.tracing = records_spans(self.tracer_provider)
        _warn_shared_prefix_caches(config)
        self.policies = _load_policies(config)
        self.metrics.watch_policy(lambda: self.policies.version)
        self.reloader = PolicyReloader(
            config.policy_dir, self._install, lambda: self.policies, self.metrics.policy_reloads
        )
        self.key_store = build_key_store(config)  # keys made through the admin API
        # shared: the WAF looks callers up, auth refuses them
        self.keys = KeyRing(config.auth, self.key_store, config.store, self.metrics.key_store_synced)
        self.auth = AuthStage(self.keys)
        self.offload = Offload(config.limits)  # big bodies' parse, WAF and tokenize run on its threads
        self.shape_gate = ShapeGate(config.limits, parse_body)  # bodies with very many values are judged out of process
        self.redis = (
            RedisBackend(config.redis.url, config.redis.timeout, config.redis.max_pending_settlements)
            if config.redis.url
            else None
        )
        if self.redis:
            self.metrics.watch_settlements(self.redis.settlements)
        self.spend = SpendLedger(
            _spend_store(config), config.store.flush_interval, lambda: self.policies.base.spec.prices.currency
        )
        limits = self._failover(self.redis or MemoryBackend())
        # without Redis, budgets are kept in the SQLite file every process of the host shares (workers included)
        self.budget_store = None if self.redis else _budget_store(config)
        if self.budget_store:
            self.metrics.watch_settlements(self.budget_store.settlements)
        self.guard = GuardStage(
            lambda: self.policies,
            Guard(self.metrics.registry),
            self.offload,
            lambda model, ids: self.fleets.current.tokenize.decode(model, ids),
        )
        parse = ParseStage(config.limits, self.offload, self.shape_gate)
        waf = WafStage(lambda: self.policies, self.keys, self.offload, self.metrics)
        self.rate_limiter = (
            RateLimiter(limits, self.metrics)
            if self.budget_store is None
            else RateLimiter(limits, self.metrics, self._failover(self.budget_store), self.budget_store.expect)
        )
        rate_limits = RateLimitStage(lambda: self.policies, self.rate_limiter)
        # what tenants make upstream (files, stored responses, fine-tuned models) is recorded where the keys are, and
        # theirs alone
        self.objects = TenantObjects(build_object_store(config), config.tenant_objects)
        self.upstream = Upstream(
            self.tracer, self.metrics, self.offload, config.telemetry.replica_header, recording=self.tracing
        )
        # pools, models and fallbacks, with the stages that decide on them: replaced whole by a config reload
        self.fleet_builder = FleetBuilder(
            lambda: self.policies,
            self.offload,
            rate_limits,
            self.objects,
            self.upstream,
            # a batch's requests meet the WAF and the input guard, one by one, when the batch is made
            BatchRequestChecks(lambda: self.policies, waf, self.guard, self.offload, config.limits),
            self.tracer,
            self.metrics,
        )
        self.fleets = Fleets(self.fleet_builder.build(config))
        self.metrics.watch_config(lambda: config_version(self.config))
        self.config_reloader = (
            ConfigReloader(
                reload.path, reload.prepare, lambda: self.config, self.reconfigure, self.metrics.config_reloads
            )
            if reload is not None
            else None
        )
        self.route = RouteStage()
        self.cache = CacheStage(
            lambda: self.policies,
            build_answer_store(config),
            self.metrics,
            config.response_cache.max_entry_bytes,
            Embedder(lambda: self.fleets.current.pools),
            config.response_cache.max_embeddings,
        )
        self.pipeline = Pipeline(
            [
                parse,
                waf,
                self.auth,
                ObjectsStage(self.objects),
                # every attempt, the first and each fallback, is authorised for the model and pool it calls
                OnFleet("authority"),
                OnFleet("admission"),
                self.guard,
                self.cache,  # after every input stage: a hit is judged, limited and billed as any request
                self.route,
            ],
            self.tracer,
            self.metrics,
            lambda: self.policies,
        )
        # a pool's passthrough routes: the same stages up to the rate limits, none that read a model request
        self.passthrough = Pipeline([RawBodyStage(parse), waf, self.auth, rate_limits], self.tracer, self.metrics)
        self.billing = Billing(self.metrics, lambda: self.policies, self.spend, config.telemetry)
        # /mcp/{server}: MCP servers' JSON-RPC, through the same WAF, auth, limits and guard (gateway/mcp/)
        self.mcp = McpService(
            config,
            lambda: self.policies,
            parse,
            self.offload,
            self.shape_gate,
            waf,
            self.auth,
            rate_limits,
            self.guard,
            self.tracer,
            self.metrics,
        )

    def _failover(self, store: Backend) -> FailoverBackend:
        """`store` with this process's memory to fall back on while it fails (`redis.on_failure` says whether)."""
        config = self.config.redis
        return FailoverBackend(
            store,
            MemoryBackend(),
            fail_open=config.on_failure == "fail_open",
            breaker=CircuitBreaker(config.breaker_failures, config.breaker_cooldown),
            metrics=self.metrics,
        )

    def _install(self, policies: PolicySet) -> None:
        self.policies = policies  # one assignment: each request reads one whole policy set

    async def reconfigure(self, config: GatewayConfig) -> None:
        """Put a reloaded config's pools, models, fallbacks and static keys in place (gateway/reload/config.py has
        checked that nothing else changed). Built and warmed first, then swapped in one step: a request arriving
        meanwhile starts on the old set, one after on the new."""
        fleet = self.fleet_builder.build(config, self.fleets.current)
        static = static_keys(config.auth)
        await asyncio.to_thread(fleet.tokenize.warm)
        self.fleets.swap(fleet)
        self.keys.use_static(static)
        fleet.tokenize.tokenizers.keep(fleet.tokenize.settings())
        self.metrics.known_models = configured_models(config)
        self.config = config
        _warn_shared_prefix_caches(config)

    async def aclose(self) -> None:
        await self.keys.aclose()
        await self.key_store.aclose()
        await self.fleets.aclose()
        await self.mcp.aclose()
        await self.guard.guard.aclose()
        await self.metrics.tallies.aclose()  # what was counted since the last publish, billing too
        await self.rate_limiter.aclose()  # before Redis goes: its budget slices go back there
        await self.spend.aclose()  # before Redis goes: it may hold the ledger
        await self.objects.aclose()
        await self.cache.aclose()
        if self.budget_store:
            await self.budget_store.aclose()
        if self.redis:
            await self.redis.aclose()
        self.offload.close()
        self.shape_gate.close()
        self.tracer_provider.shutdown()

    async def probe(self, pool: Pool) -> list[dict]:
        """Ask every replica of a pool for its model list, concurrently, with a short timeout."""

        async def one(url: str) -> dict:
            headers = {"authorization": f"Bearer {pool.api_key}"} if pool.api_key else {}
            try:
                async with pool.session.get(
                    url + "/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT)
                ) as response:
                    models = (await response.json()).get("data", []) if response.status == 200 else []
                    return {"url": url, "up": response.status < 500, "models": models}
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
                return {"url": url, "up": False, "models": []}

        return list(await asyncio.gather(*(one(r.url) for r in pool.replicas)))

    async def readiness(self) -> tuple[bool, dict[str, list[dict]]]:
        """Ready when every pool has at least one replica answering; with each replica's state."""
        with self.fleets.holding() as fleet:
            results = await asyncio.gather(*(self.probe(p) for p in fleet.pools.pools))
        pools = {p.name: [{"url": r["url"], "up": r["up"]} for r in res] for p, res in zip(fleet.pools.pools, results)}
        return all(any(r["up"] for r in replicas) for replicas in pools.values()), pools


def _spend_store(config: GatewayConfig) -> SpendStore:
    """The spend ledger lives where the keys do (`store.backend`)."""
    if config.store.backend == "redis":
        assert config.redis.url is not None  # the config's validation requires it
        return RedisSpendStore(config.redis.url, config.redis.timeout)
    try:
        return SqliteSpendStore(config.store.sqlite_path)  # opens the file: the first part of the gateway that does
    except sqlite3.Error as err:  # a missing directory, a path that is a directory, no permission
        raise ConfigError(f"store.sqlite_path: cannot open {config.store.sqlite_path}: {err}") from err


def _budget_store(config: GatewayConfig) -> SqliteBudgets:
    """Budgets without Redis: in the SQLite file the spend ledger shares (`store.sqlite_path`, whichever backend
    keeps the keys), so every process on the host reserves on the same counters."""
    try:
        return SqliteBudgets(config.store.sqlite_path)
    except sqlite3.Error as err:
        raise ConfigError(f"store.sqlite_path: cannot open {config.store.sqlite_path}: {err}") from err


def _warn_shared_prefix_caches(config: GatewayConfig) -> None:
    """A pool whose tenants share its engines' prefix cache lets one tenant time another's prompts (a cached prefix
    answers its first token sooner): said at start wherever more than one tenant may use it, that is, where static
    keys name several tenants or the admin plane can make keys."""
    tenants = {key.tenant for key in config.auth.keys}
    if len(tenants) < 2 and not config.admin.enabled:
        return
    for pool in config.pools:
        if pool.cache_isolation == "shared":
            log.warning(
                "pools[%s].cache_isolation: shared: tenants share its engines' prefix cache, so one can learn from "
                "its first token's time whether another sent a prompt; set cache_isolation: tenant where tenants "
                "must not learn about each other",
                pool.name,
            )


def _load_policies(config: GatewayConfig) -> PolicySet:
    if not config.policy_dir.is_dir():
        log.warning("policy directory %s not found: no policy limits or rules apply", config.policy_dir)
        return empty_policy_set()
    policies = load_policy_dir(config.policy_dir)
    log.info("policy %s loaded from %s", policies.version, config.policy_dir)
    log_policy_warnings(policies)
    return policies


def build_app(
    config: GatewayConfig, *, span_exporter: SpanExporter | None = None, reload: ConfigSource | None = None
) -> ASGIApp:
    """The public app and, on its own listener, the admin plane (gateway/admin/app.py). With `reload`, the file the
    config came from is reloaded on changes and SIGHUP (gateway/reload/config.py)."""

    admin_token = resolve_admin_token(config.admin) if config.admin.enabled else ""  # before anything else can fail
    gateway = Gateway(config, span_exporter, reload)

    async def list_models(request: Request) -> Response:
        ctx = RequestContext(request=request, route="models", span=trace.INVALID_SPAN)
        try:
            await gateway.auth(ctx)
        except GatewayError as err:
            return err.response()
        seen: dict[str, tuple[dict, Pool]] = {}  # each model with the pool offering it
        with gateway.fleets.holding() as fleet:
            pools = fleet.pools.pools
            for pool, replicas in zip(pools, await asyncio.gather(*(gateway.probe(p) for p in pools))):
                for model in pool.config.models:
                    entry = {"id": model, "object": "model", "created": 0, "owned_by": pool.name}
                    seen.setdefault(model, (entry, pool))
                for replica in replicas:
                    for model in replica["models"]:
                        if isinstance(model, dict) and isinstance(model.get("id"), str):
                            seen.setdefault(model["id"], (model, pool))
            try:  # another tenant's fine-tunes are not listed: the upstream lists its whole organization's
                usable = await fleet.models.visible(ctx, ((model, pool) for model, (_, pool) in seen.items()))
            except GatewayError as err:
                return err.response()
        key = ctx.key  # a stored key lists only the models it may call
        listed = [entry for model, (entry, _) in seen.items() if model in usable and (key is None or key.allows(model))]
        return JSONResponse({"object": "list", "data": listed})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """Ready or not, for load balancers; which replica is down is the admin plane's to say."""
        ready, _ = await gateway.readiness()
        return JSONResponse({"status": "ready" if ready else "not_ready"}, status_code=200 if ready else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gateway.keys.start()  # before serving: a stored key must work on the first request
        gateway.fleets.start()
        gateway.shape_gate.warm()
        reloaders = [gateway.reloader, *([gateway.config_reloader] if gateway.config_reloader else [])]
        for reloader in reloaders:
            reloader.start()
        reload_on_hangup(reloaders)
        gateway.spend.start()
        gateway.metrics.tallies.start()
        gateway.rate_limiter.start()
        warming = asyncio.create_task(asyncio.to_thread(gateway.fleets.current.tokenize.warm))
        await asyncio.to_thread(gateway.guard.warm)  # before serving: the first guarded request must not wait
        gc.freeze()  # what start-up built lives as long as the process: the collector need not rescan it per request
        gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
        yield
        await warming
        stop_reloading_on_hangup()
        for reloader in reloaders:
            await reloader.stop()
        await gateway.aclose()

    models = {api.path: ProxyEndpoint(gateway, api.name) for api in APIS}
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in models.items()),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/v1/{rest:path}", PassthroughEndpoint(gateway)),  # last: only what no route above serves
        Route("/mcp/{server}", McpEndpoint(gateway, gateway.mcp), methods=None),
    ]
    handlers: dict[type[Exception], Callable[..., Awaitable[Response]]] = {
        **EXCEPTION_HANDLERS,
        HTTPException: route_error,  # 404s under /v1/ name the routes served
    }
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[Middleware(ModelRoutes, endpoints=models)],  # their POSTs skip the router
    )
    app.router.redirect_slashes = False  # its redirect's Location is built from the client's own Host header
    if not config.admin.enabled:
        return ByListener(app, None, None)
    return ByListener(app, build_admin_app(gateway, admin_token), config.admin.port)
