"""The proxy's routes as ASGI endpoints: a model route runs the pipeline, then the upstream call; any other route
under /v1/ passes through to the pool that opted in to it.

Plain ASGI endpoints, not Starlette handlers, so the request's SERVER span and access-log line wrap the whole
response, including the last byte of a stream; the request is settled, billed and logged on every exit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Mapping
from typing import TYPE_CHECKING

from opentelemetry.trace import Status, StatusCode
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.apis.routes import BY_PATH, PASSTHROUGH
from gateway.context import RequestContext
from gateway.edge.client_exit import ClientWatch
from gateway.edge.client_ip import client_ip
from gateway.errors import GatewayError, internal_error
from gateway.observability.log_writer import log_access
from gateway.observability.telemetry import incoming_trace, server_span, trace_ids
from gateway.relay.upstream import PoolFailed
from gateway.spend.store import NANOS

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger(__name__)


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
        # read from the scope: request.url would parse the Host header, request.client build an Address, each time
        method, path, peer = scope["method"], scope["path"], _peer(scope) or ""
        parent, links = incoming_trace(request.headers, gw.config.telemetry.trust_client_trace)
        with server_span(
            gw.tracer,
            gw.tracing,
            gw.tracer_provider.id_generator,
            f"{method} {path}",
            parent,
            links,
            lambda: {"http.request.method": method, "url.path": path, "client.address": peer},
        ) as span:
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
                "method": ctx.request.scope["method"],
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
                "client": _peer(ctx.request.scope),
            }
        )


def _peer(scope: Scope) -> str | None:
    """The socket peer's address (None on a Unix socket)."""
    client = scope.get("client")
    return client[0] if client else None


class ModelRoutes:
    """The model routes (POST on an API's path), served ahead of Starlette's routing: a middleware, so within
    Starlette's answer to a defect (a 500 in the OpenAI shape) but past its exception middleware, its request objects
    and its router's path matching, none of which these endpoints use (each answers its own errors) and which cost a
    proxied request about two dozen calls. Anything else (another method or path) goes on to the router, which has
    the same endpoints for these paths."""

    def __init__(self, app: ASGIApp, endpoints: Mapping[str, ProxyEndpoint]) -> None:
        self.app = app
        self.endpoints = endpoints  # by path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # the router matches the path within root_path (none where `portcullis serve` runs): left to it
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            endpoint = self.endpoints.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
