"""`/mcp/{server}`: the MCP route as the gateway's other routes are served (gateway/endpoints.py's ProxyEndpoint: one
SERVER span, settlement, billing and the access log on every exit), its refusals as JSON-RPC errors, and every
tools/call in the audit log."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opentelemetry.trace import Status, StatusCode
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.context import RequestContext
from gateway.endpoints import ProxyEndpoint
from gateway.errors import GatewayError
from gateway.mcp import messages
from gateway.mcp.call import McpCall
from gateway.mcp.service import McpService
from gateway.observability.telemetry import trace_ids
from gateway.waf import audit

if TYPE_CHECKING:
    from gateway.app import Gateway

METHODS = ("POST", "GET", "DELETE")


class McpEndpoint(ProxyEndpoint):
    def __init__(self, gateway: Gateway, service: McpService) -> None:
        super().__init__(gateway, "mcp")
        self._service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path_params"]["server"]
        refusal = None
        if name not in self._service.servers:
            refusal = GatewayError(404, f"no MCP server is named {name[:64]!r} here", code="not_found")
        elif scope["method"] not in METHODS:
            message = f"{scope['method']} is not part of MCP's streamable HTTP: send POST, GET or DELETE"
            refusal = GatewayError(405, message, code="method_not_allowed", headers={"allow": ", ".join(METHODS)})
        if refusal is not None:
            await messages.error_response(refusal, None)(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    async def _answer(self, ctx: RequestContext) -> Response:
        call = ctx.mcp = McpCall(self._service.servers[ctx.request.path_params["server"]].config)
        try:
            return await self._service.answer(ctx)
        except GatewayError as err:
            call.decision, call.reason = "refused", err.code or err.type
            ctx.status = err.status
            ctx.span.set_attribute("error.type", err.code or err.type)
            return messages.error_response(err, call.request_id)

    def _account(self, ctx: RequestContext) -> None:
        call = ctx.mcp
        if call is not None and call.span is not None:
            if call.reason is not None or ctx.stream_error is not None:
                call.span.set_attribute("error.type", call.reason or ctx.stream_error or "")
                call.span.set_status(Status(StatusCode.ERROR, call.reason or ctx.stream_error or ""))
            call.span.end()
        if call is not None and call.method == "tools/call":
            trace_id, span_id = trace_ids(ctx.span)
            audit.emit(
                {
                    "type": "mcp",
                    "ts": time.time(),
                    "action": "allow" if call.reason is None else "block",
                    "decision": call.decision,
                    "reason": call.reason,
                    "server": call.server.name,
                    "method": call.method,
                    "tool": call.tool,
                    "tenant": ctx.tenant,
                    "key_id": ctx.key_id,
                    "status": ctx.status,
                    "request_id": ctx.request_id,
                    "trace_id": trace_id,
                    "span_id": span_id,
                    "client": ctx.client_ip or None,
                }
            )
        super()._account(ctx)
