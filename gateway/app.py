"""The Starlette app: routes, and the lifespan that owns pools, pipeline and telemetry.

Proxy routes are plain ASGI endpoints so the request's SERVER span and access-log line wrap the whole response,
including the last byte of a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sqlite3
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

import aiohttp
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import Status, StatusCode
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin.app import ByListener, build_admin_app
from gateway.admin.token import admin_token as resolve_admin_token
from gateway.apis.routes import APIS, BY_PATH, PASSTHROUGH, route_error
from gateway.cache.semantic import Embedder
from gateway.cache.stores import build_answer_store
from gateway.config import ConfigError, GatewayConfig
from gateway.context import RequestContext
from gateway.edge.client_exit import ClientWatch
from gateway.edge.client_ip import client_ip
from gateway.edge.offload import Offload
from gateway.edge.shape_gate import ShapeGate
from gateway.errors import EXCEPTION_HANDLERS, GatewayError, internal_error
from gateway.fleet import FleetBuilder, Fleets, OnFleet
from gateway.guard.runtime import Guard
from gateway.keystore.keyring import KeyRing, static_keys
from gateway.keystore.store import build_key_store
from gateway.mcp.service import McpService
from gateway.observability.log_writer import log_access
from gateway.observability.telemetry import (
    Metrics,
    build_tracer_provider,
    configured_models,
    incoming_trace,
    records_spans,
    server_span,
    trace_ids,
)
from gateway.pipeline import Pipeline
from gateway.policy.loader import PolicySet, empty_policy_set, load_policy_dir
from gateway.policy.reload import PolicyReloader, log_policy_warnings
from gateway.ratelimit.checks import Backend
from gateway.ratelimit.failover import CircuitBreaker, FailoverBackend
from gateway.ratelimit.limiter import RateLimiter
from gateway.ratelimit.memory import MemoryBackend
from gateway.ratelimit.redis_backend import RedisBackend
from gateway.relay.upstream import PoolFailed, Upstream
from gateway.reload.config import ConfigReloader, ConfigSource, config_version
from gateway.reload.watcher import reload_on_hangup, stop_reloading_on_hangup
from gateway.routing.pool import Pool
from gateway.spend.billing import Billing
from gateway.spend.ledger import SpendLedger
from gateway.spend.redis_ledger import RedisSpendStore
from gateway.spend.sqlite_budgets import SqliteBudgets
from gateway.spend.sqlite_ledger import SqliteSpendStore
from gateway.spend.store import NANOS, SpendStore
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
        self.upstream = Upstream(self.tracer, self.metrics, self.offload, config.telemetry.replica_header)
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
                OnFleet("authority", lambda fleet: fleet.authority),
                OnFleet("admission", lambda fleet: fleet.admission),
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


class ProxyEndpoint:
    """POST on a model route (gateway/apis/routes.py): the pipeline, then the upstream call."""

    def __init__(self, gateway: Gateway, route: str) -> None:
        self.gateway = gateway
        self.route = route
        self._requests = gateway.metrics.tallies.counter(gateway.metrics.requests)  # by route and status
        self._duration = gateway.metrics.tallies.histogram(gateway.metrics.request_duration)(route)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gateway
        watch = ClientWatch(scope)  # until the answer starts, a client that leaves cancels the work done for it
        request = Request(scope, receive)
        path = scope["path"]  # request.url would parse the Host header on every request
        name = f"{request.method} {path}"
        parent, links = incoming_trace(request.headers, gw.config.telemetry.trust_client_trace)
        with server_span(
            gw.tracer,
            gw.tracing,
            name,
            parent,
            links,
            lambda: {
                "http.request.method": request.method,
                "url.path": path,
                "client.address": request.client.host if request.client else "",
            },
        ) as span:
            peer = request.client.host if request.client else ""
            ctx = RequestContext(
                request=request,
                route=self.route,
                span=span,
                client_ip=client_ip(peer, request.headers.getlist("x-forwarded-for"), gw.config.trusted_proxies),
                fleet=gw.fleets.current.enter(),
            )
            try:
                await self._respond(ctx, watch, scope, receive, send)
            finally:
                # even when the client vanished, a stage failed or the server cancelled the request (a shutdown past
                # its grace period, mid-stream): settled, then billed and logged, or the spend a restart reads budgets
                # back from would miss it; none of it waits, so nothing can cut it short
                gw.pipeline.settle(ctx)
                ctx.on_fleet.leave()  # settled: the pools a config reload dropped may close once none holds them
                span.set_attribute("http.response.status_code", ctx.status)
                if ctx.status >= 500 or ctx.stream_error not in (None, "client_disconnected"):
                    span.set_status(Status(StatusCode.ERROR, ctx.stream_error or str(ctx.status)))
                self._account(ctx)

    async def _respond(
        self, ctx: RequestContext, watch: ClientWatch, scope: Scope, receive: Receive, send: Send
    ) -> None:
        try:
            response = await watch.unless_client_leaves(self._answer(ctx))
        except GatewayError as err:
            ctx.status = err.status
            response = ctx.api.error_response(err)
            response.headers["x-request-id"] = ctx.request_id
            ctx.span.set_attribute("error.type", err.code or err.type)
        except ClientDisconnect:  # gone before its answer started: nobody to answer, nothing wrong with the gateway
            ctx.status = 499  # nginx's "client closed request", for the access log and metrics
            log.info("client disconnected before its answer started (request id %s)", ctx.request_id)
            return
        except Exception:
            log.exception("unhandled error serving %s", ctx.request.scope["path"])
            ctx.status = 500
            response = ctx.api.error_response(internal_error())
        try:
            await response(scope, receive, watch.sending(send))
        except ClientDisconnect:  # gone while its answer was going out: the stream records it
            # (gateway/relay/upstream.py)
            log.info("client gone while its answer was sent (request id %s)", ctx.request_id)
        except Exception:  # a defect after the answer started: the request is still settled, billed and logged
            log.exception("unhandled error answering %s", ctx.request.scope["path"])
            ctx.stream_error = "internal_error"
        finally:
            body = getattr(response, "body_iterator", None)
            if isinstance(body, AsyncGenerator):  # a stream left mid-way: settled now, not when it is collected
                await body.aclose()

    async def _answer(self, ctx: RequestContext) -> Response:
        """The pipeline, then the upstream; a pool that fails the request before the client heard a byte hands it
        to the model's next fallback its attempt is authorised for (gateway/relay/fallbacks.py), placed there as
        admission and routing place any; where none is, the client gets that failure."""
        gw = self.gateway
        await gw.pipeline.run(ctx)
        if ctx.answered is not None:  # the response cache's hit
            return ctx.answered
        while True:
            try:
                return await gw.upstream.forward(ctx)
            except PoolFailed as failure:
                await ctx.on_fleet.authority.after(ctx, failure)
                await ctx.on_fleet.admission.move(ctx)
                await gw.route(ctx)

    def _account(self, ctx: RequestContext) -> None:
        elapsed = time.perf_counter() - ctx.started
        self._requests(self.route, str(ctx.status)).inc()
        self._duration.observe(elapsed)
        charged = self.gateway.billing.record(ctx)
        if not self.gateway.config.telemetry.access_log:
            return
        trace_id, span_id = trace_ids(ctx.span)
        log_access(
            {
                "ts": time.time(),
                "request_id": ctx.request_id,
                "trace_id": trace_id,
                "span_id": span_id,
                "method": ctx.request.method,
                "path": ctx.request.scope["path"],
                "status": ctx.status,
                "duration_ms": round(elapsed * 1000, 3),
                "tenant": ctx.tenant,
                "model": ctx.model or None,  # the model that served: the one asked for, or its fallback's
                "fallback_from": ctx.fallback_from,
                "stream": ctx.stream,
                "pool": ctx.placement.pool.name if ctx.placement else None,
                "upstream": ctx.replica.url if ctx.replica else None,
                "prompt_tokens": ctx.usage.prompt_tokens,
                "completion_tokens": ctx.usage.completion_tokens,
                "cached_tokens": ctx.usage.cached_tokens,
                "cost": None if charged is None else charged.cost_nanos / NANOS,
                # completion tokens charged beyond the reservation: an upstream that reported more than max_tokens x n
                "over_reservation_tokens": charged.over_reservation if charged and charged.over_reservation else None,
                "predicted_cached_tokens": ctx.predicted_cached_tokens,
                "finish_reasons": ctx.usage.finish_reasons or None,
                "stream_error": ctx.stream_error,
                "cache": ctx.cache_result,
                "client": ctx.request.client.host if ctx.request.client else None,
            }
        )


class PassthroughEndpoint(ProxyEndpoint):
    """Any other route under /v1/: passed through to the pool that opted in to it (gateway/apis/passthrough.py);
    where none did, the 404 that names the routes served."""

    def __init__(self, gateway: Gateway) -> None:
        super().__init__(gateway, PASSTHROUGH.name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path in BY_PATH:
            raise HTTPException(405)  # a model route, asked with another method than POST
        if self.gateway.fleets.current.pools.for_passthrough(path) is None:
            raise HTTPException(404)
        await super().__call__(scope, receive, send)

    async def _answer(self, ctx: RequestContext) -> Response:
        fleet = ctx.on_fleet
        pool = fleet.pools.for_passthrough(ctx.request.scope["path"])
        assert pool is not None  # checked on arrival, on the fleet the request then took
        await self.gateway.passthrough.run(ctx)
        return await fleet.object_passthrough(ctx, pool)


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
    from gateway.mcp.endpoint import McpEndpoint  # (a ProxyEndpoint: imported once this module has defined it)

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

    routes = [
        *(Route(api.path, ProxyEndpoint(gateway, api.name), methods=["POST"]) for api in APIS),
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
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.router.redirect_slashes = False  # its redirect's Location is built from the client's own Host header
    if not config.admin.enabled:
        return ByListener(app, None, None)
    return ByListener(app, build_admin_app(gateway, admin_token), config.admin.port)
