"""The MCP gateway's parts, built once per process, and the order an exchange goes through them.

A POST (one JSON-RPC message) runs parse, then the stages every route shares, with the MCP route's access checks
between auth and the guard (gateway/mcp/stages.py): the WAF over the whole request (a tools/call's arguments are
`tool_arguments` text, gateway/mcp/carriers.py), auth, access, and the guard's PII/secret detectors and classifier
over the message, which may redact the arguments; then the relay (gateway/mcp/relay.py). A GET (the server's own
stream) and a DELETE (a session's end) run auth and the session check. A tools/call runs inside its `execute_tool`
span, its stages' spans in it, until its answer has been relayed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from starlette.responses import Response

from gateway.apis.inventory import Provenance
from gateway.config import GatewayConfig, is_loopback
from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.edge.shape_gate import ShapeGate
from gateway.mcp.pins import Catalog
from gateway.mcp.relay import Relay
from gateway.mcp.scan import Scanner
from gateway.mcp.sessions import SessionBinder, process_secret
from gateway.mcp.stages import McpAccess, McpParse, call_of
from gateway.mcp.upstream import McpServer
from gateway.observability.telemetry import Metrics
from gateway.pipeline import Pipeline, Stage
from gateway.policy.loader import PolicySet
from gateway.stages.guard import GuardStage
from gateway.stages.parse import ParseStage
from gateway.stages.ratelimit import RateLimitStage

log = logging.getLogger(__name__)
# What MCP servers send that enters a model, by the provenance the guard reads it as (gateway/mcp/carriers.py).
READ_AS: tuple[Provenance, ...] = ("tool_definitions", "tool_result", "document")


class McpService:
    def __init__(
        self,
        config: GatewayConfig,
        policies: Callable[[], PolicySet],
        parse: ParseStage,
        offload: Offload,
        gate: ShapeGate,
        waf: Stage,
        auth: Stage,
        limits: RateLimitStage,
        guard: GuardStage,
        tracer: Tracer,
        metrics: Metrics,
    ) -> None:
        self.servers = {server.name: McpServer(server) for server in config.mcp_servers}
        if self.servers:
            warn_unsafe(config, policies())
        self._tracer = tracer
        binder = SessionBinder(process_secret())
        catalog = Catalog()
        self.relay = Relay(self.servers, policies, binder, catalog, Scanner(guard), config.limits)
        access = McpAccess(policies, binder, catalog, limits, self.relay.look_up)
        self._parse = Pipeline([McpParse(parse, offload, gate)], tracer, metrics)
        self.checks = Pipeline([waf, auth, access, guard], tracer, metrics)  # settles the rate limits it grants
        self._stream_checks = Pipeline([auth, access], tracer, metrics)

    async def answer(self, ctx: RequestContext) -> Response:
        call = call_of(ctx)
        if ctx.request.method != "POST":
            await self._stream_checks.run(ctx)
            return await self.relay.forward(ctx)
        await self._parse.run(ctx)
        if call.method != "tools/call":
            await self.checks.run(ctx)
            return await self.relay.forward(ctx)
        call.span = self._tracer.start_span(
            f"execute_tool {call.tool}",
            kind=SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": call.tool,
                "gen_ai.tool.call.id": str(call.request_id),
                "gen_ai.tool.type": "extension",
                "mcp.method.name": call.method,
                "portcullis.mcp.server": call.server.name,
            },
        )
        with trace.use_span(call.span, end_on_exit=False):
            await self.checks.run(ctx)
            return await self.relay.forward(ctx)

    async def aclose(self) -> None:
        for server in self.servers.values():
            await server.aclose()


def warn_unsafe(config: GatewayConfig, policies: PolicySet) -> None:
    """Said at start: the settings under which what MCP servers send reaches models less guarded than it could."""
    spec = policies.mcp_for(None)
    if spec.pin == "learn":
        log.warning(
            "policy mcp.pin: learn: each process pins the first definition it sees of each tool, whatever it says; "
            "pin approved hashes and set pin: required for production"
        )
    guard = policies.guard_for(None)
    if not (guard.enabled and guard.injection.enabled):
        log.warning(
            "mcp_servers: the guard's classifier is off (policy guard.enabled, guard.injection.enabled): tool "
            "descriptions, tool results, resources and prompts from MCP servers reach models unread; pins alone hold "
            "the definitions"
        )
    else:
        injection = guard.injection
        decisions = {p: injection.provenances.get(p) for p in READ_AS}
        actions = {p: (decision.action if decision else None) or injection.action for p, decision in decisions.items()}
        monitored = [provenance for provenance, action in actions.items() if action not in ("block", "redact")]
        if monitored:
            log.warning(
                "mcp_servers: the guard only records what it finds in %s (policy guard.injection.provenances): an "
                "injected tool result or a poisoned description reaches the model; docs/mcp.md has a policy that "
                "blocks them",
                ", ".join(monitored),
            )
    for server in config.mcp_servers:
        if server.name not in spec.servers:
            log.info("mcp_servers[%s]: the policy names no tools for it (mcp.servers): it serves none", server.name)
        address = urlsplit(server.url)
        if server.api_key_env and address.scheme == "http" and not is_loopback(address.hostname or ""):
            log.warning(
                "mcp_servers[%s].url: plain http to another host: its credential (%s) crosses the network unencrypted",
                server.name,
                server.api_key_env,
            )
