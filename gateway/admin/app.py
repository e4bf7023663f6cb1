"""The admin plane: metrics, detailed readiness, policy status, stored keys and spend, on a listener of their own.

What these answer (tenant names, the policy directory, the last reload error, replica URLs, every metric) helps
an attacker map the deployment, so none of it is served on the public port: `ByListener` sends each connection to
the app of the listener it arrived on, and the public app has no admin routes at all. The admin listener binds
loopback by default, and every request on it passes `AdminGuard` (gateway/admin/request_guard.py) first: a Host naming
the listener, no foreign Origin, a JSON body type for changes, and the admin token (gateway/admin/token.py).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admin.audit import AuditLog
from gateway.admin.keys import KeysApi
from gateway.admin.openapi import openapi_document
from gateway.admin.request_guard import AdminGuard
from gateway.admin.spend import spend_route
from gateway.errors import EXCEPTION_HANDLERS, GatewayError
from gateway.reload.config import config_version

if TYPE_CHECKING:
    from gateway.app import Gateway

log = logging.getLogger(__name__)


class ByListener:
    """Routes each connection by the local port it arrived on: the admin port to the admin app, the rest public."""

    def __init__(self, public: ASGIApp, admin: ASGIApp | None, admin_port: int | None) -> None:
        self.public = public
        self.admin = admin
        self.admin_port = admin_port

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        server = scope.get("server")
        if self.admin is not None and scope["type"] == "http" and server and server[1] == self.admin_port:
            await self.admin(scope, receive, send)
        else:
            await self.public(scope, receive, send)  # lifespan events too: the public app owns the gateway


async def gateway_error(request: Request, exc: GatewayError) -> Response:
    """What an admin route refuses (a bad body, an unknown key), in the same OpenAI error shape."""
    return exc.response()


async def store_unavailable(request: Request, exc: Exception) -> Response:
    """The key store or spend ledger failed (Redis down, the SQLite file locked or unwritable): the gateway is fine,
    and the same call may work once the store is back."""
    log.warning("admin %s: store unavailable (%s: %s)", request.url.path, type(exc).__name__, exc)
    return GatewayError(
        503,
        f"the store is unavailable ({type(exc).__name__}); try again",
        type="server_error",
        code="store_unavailable",
    ).response()


def build_admin_app(gateway: Gateway, token: str) -> Starlette:
    """The admin plane's routes, behind `AdminGuard` with the admin token `token`."""
    keys = KeysApi(gateway, AuditLog(gateway.config.admin.audit_log))
    document = openapi_document()

    async def readyz(request: Request) -> Response:
        ready, pools = await gateway.readiness()
        return JSONResponse(
            {"status": "ready" if ready else "not_ready", "pools": pools}, status_code=200 if ready else 503
        )

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        gateway.metrics.tallies.publish()  # what this process counted (and billed) since its last publish
        for pool in gateway.fleets.current.pools.pools:
            for replica in pool.replicas:
                gateway.metrics.upstream_outstanding.labels(pool=pool.name, replica=replica.url).set(
                    replica.outstanding
                )
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def admin_config(request: Request) -> Response:
        """The config served, and whether the last reload of its file was refused (and why)."""
        reloader = gateway.config_reloader
        status = reloader.status() if reloader else {"version": config_version(gateway.config), "file": None}
        return JSONResponse(status)

    async def admin_policy(request: Request) -> Response:
        policies = gateway.policies
        waf = policies.waf_for(None)
        return JSONResponse(
            {
                "version": policies.version,
                **gateway.reloader.status(),
                "tenants": sorted(policies.overlays),
                "waf": {
                    "mode": waf.mode,
                    "paranoia_level": waf.spec.paranoia_level,
                    "packs": [r.model_dump() for r in waf.spec.pack_refs()],
                    "rules": len(waf.rules),
                    "inbound_threshold": waf.threshold,
                    "tenant_overrides": sorted(policies.waf.tenants),
                },
            }
        )

    async def openapi(request: Request) -> Response:
        return JSONResponse(document)

    handlers: dict[type[Exception], Callable[..., Awaitable[Response]]] = {
        **EXCEPTION_HANDLERS,
        GatewayError: gateway_error,
        RedisError: store_unavailable,
        sqlite3.Error: store_unavailable,
    }

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/admin/policy", admin_policy, methods=["GET"]),
            Route("/admin/config", admin_config, methods=["GET"]),
            Route("/admin/openapi.json", openapi, methods=["GET"]),
            *keys.routes(),
            Route("/admin/spend", spend_route(gateway), methods=["GET"]),
        ],
        exception_handlers=handlers,
        middleware=[Middleware(AdminGuard, admin=gateway.config.admin, token=token)],
    )
    app.router.redirect_slashes = False  # a redirect would be built from the client's Host header
    return app
