"""The MCP route's own stages, around the ones every route shares (gateway/mcp/service.py lists them in order):

- parse: the client's JSON-RPC message, one object, read within the body and JSON limits;
- access, after auth: the session the client names must be one this caller opened (else 404, as for an unknown
  session); a method the gateway does not read is refused unless the policy relays it; the headers the 2026
  revision routes on must say what the body says; a tools/call must name a tool the caller's allow-list has, whose
  definition was approved as last listed (pinned, passed by the guard); then the call's rate limits, per tool.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.context import Demand, RequestContext
from gateway.edge.offload import Offload
from gateway.edge.shape_gate import ShapeGate
from gateway.errors import GatewayError, invalid_request
from gateway.mcp import messages
from gateway.mcp.call import McpCall
from gateway.mcp.pins import Catalog
from gateway.mcp.sessions import SessionBinder, caller_of
from gateway.policy.loader import PolicySet
from gateway.stages.parse import ParseStage, check_encoding
from gateway.stages.ratelimit import RateLimitStage

SESSION_HEADER = "mcp-session-id"
# What the gateway reads of a client's messages: every other method is refused unless the policy relays it.
CLIENT_METHODS = frozenset(
    {
        "initialize",
        "ping",
        "server/discover",
        "tools/list",
        "tools/call",
        "resources/list",
        "resources/templates/list",
        "resources/read",
        "resources/subscribe",
        "resources/unsubscribe",
        "prompts/list",
        "prompts/get",
        "completion/complete",
        "logging/setLevel",
        "notifications/initialized",
        "notifications/cancelled",
        "notifications/progress",
        "notifications/roots/list_changed",
    }
)
# The 2026 revision's routing headers and the field of the body each must agree with.
_NAMED_BY = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}

# Lists a server's tools into the catalog (a tools/list of the gateway's own), for a call no list has shown yet.
Lookup = Callable[[RequestContext], Awaitable[None]]


def call_of(ctx: RequestContext) -> McpCall:
    assert ctx.mcp is not None  # the MCP endpoint sets it before its pipeline runs
    return ctx.mcp


class McpParse:
    name = "parse"

    def __init__(self, parse: ParseStage, offload: Offload, gate: ShapeGate) -> None:
        self._parse = parse
        self._offload = offload  # a big message is decoded and walked off the event loop
        self._gate = gate  # one with very many values is judged out of process first, as on every route

    async def __call__(self, ctx: RequestContext) -> None:
        check_encoding(ctx)
        content_type = ctx.request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise GatewayError(
                415, "an MCP message is sent as Content-Type: application/json", code="unsupported_media_type"
            )
        body = await self._parse.read_body(ctx)
        await self._gate.check(ctx.route, body)
        message = await self._offload.run(self._offload.is_big(len(body)), messages.read, body, self._parse.limits)
        call = call_of(ctx)
        call.message, call.kind = message, messages.kind_of(message)
        ctx.body, ctx.payload = body, message
        if call.method == "tools/call":
            name = call.params.get("name")
            if call.kind != "request":
                raise invalid_request("tools/call is a request: it has an id", param="id", code="invalid_jsonrpc")
            if not isinstance(name, str) or not name:
                raise invalid_request("tools/call names its tool in params.name", param="params.name")


class McpAccess:
    name = "mcp"

    def __init__(
        self,
        policies: Callable[[], PolicySet],
        binder: SessionBinder,
        catalog: Catalog,
        limits: RateLimitStage,
        lookup: Lookup,
    ) -> None:
        self._policies = policies
        self._binder = binder
        self._catalog = catalog
        self._limits = limits
        self._lookup = lookup

    async def __call__(self, ctx: RequestContext) -> None:
        call = call_of(ctx)
        self._bind_session(ctx, call)
        if call.kind is None or call.kind == "answer":
            return  # a stream, a session's end, or the client's answer to a request the server was let send
        spec = self._policies().mcp_for(ctx.tenant)
        method = call.method
        if method not in CLIENT_METHODS and method not in spec.relay:
            raise GatewayError(
                403,
                f"method {method[:64]!r} is not relayed to MCP servers by this gateway's policy (mcp.relay)",
                type="permission_error",
                code="method_not_relayed",
                param="method",
            )
        _check_routing_headers(ctx, call)
        tool = call.tool
        if not tool:
            return
        server = call.server.name
        ctx.span.set_attribute("gen_ai.tool.name", tool)
        if not spec.allowed(server, tool, ctx.key_id):
            raise GatewayError(
                403,
                f"tool {tool[:128]!r} of MCP server {server!r} is not on this caller's allow-list (mcp.servers)",
                type="permission_error",
                code="tool_not_allowed",
                param="params.name",
            )
        if self._catalog.of(ctx.tenant, server, tool) is None:
            await self._lookup(ctx)
        standing = self._catalog.of(ctx.tenant, server, tool)
        if standing != "approved":
            why = {
                None: "no tools/list of the server shows it",
                "unpinned": "its definition's hash is not pinned in the policy",
                "changed": "its definition changed since it was approved; the policy must pin the new hash",
                "poisoned": "the guard refused its definition",
            }[standing]
            raise GatewayError(
                403,
                f"tool {tool[:128]!r} of MCP server {server!r} is not approved: {why}",
                type="permission_error",
                code="tool_not_approved",
                param="params.name",
            )
        ctx.tool = f"{server}/{tool}"
        self._limits.hold(ctx, await self._limits.grant(ctx, Demand("", 0, None, 0)))

    def _bind_session(self, ctx: RequestContext, call: McpCall) -> None:
        presented = ctx.request.headers.get(SESSION_HEADER)
        if presented is None:
            return
        upstream = self._binder.inward(call.server.name, caller_of(ctx.key_id, ctx.tenant), presented)
        if upstream is None:
            raise GatewayError(404, "MCP session not found", code="session_not_found", param=SESSION_HEADER)
        call.upstream_session = upstream


def _check_routing_headers(ctx: RequestContext, call: McpCall) -> None:
    """The 2026 revision lets servers route on `Mcp-Method` and `Mcp-Name`: headers that say another method or name
    than the body would have the gateway judge one call and the server run another."""
    headers = ctx.request.headers
    method = headers.get("mcp-method")
    if method is not None and method != call.method:
        raise invalid_request("the Mcp-Method header differs from the message's method", code="header_mismatch")
    name = headers.get("mcp-name")
    field = _NAMED_BY.get(call.method)
    named: Any = call.params.get(field) if field else None
    if name is not None and name != named:
        raise invalid_request("the Mcp-Name header differs from the message's params", code="header_mismatch")
