"""The guard over what MCP servers send that a model will read: each tool definition of a tools/list answer
(provenance `tool_definitions`), a tools/call's result (`tool_result`), a resource read or a prompt got
(`document`). Each is read as the guard stage reads a request, by its content inventory (gateway/mcp/carriers.py),
with the caller's tenant's guard policy: the classifier's threshold and action per provenance, the PII and secret
detectors (a redaction rewrites the message relayed).
"""

from __future__ import annotations

from typing import Any

from gateway.apis.inventory import Spec, take
from gateway.context import RequestContext
from gateway.stages.guard import GuardStage


class Scanner:
    def __init__(self, guard: GuardStage) -> None:
        self._guard = guard

    async def scan(self, ctx: RequestContext, spec: Spec, message: Any, raw: bytes) -> bool:
        """Raises the guard's refusal (GuardBlocked, a GatewayError) when the policy blocks; True when a redaction
        rewrote `message` in place. `raw`: the message as the server sent it (its size decides whether the work
        leaves the event loop)."""
        scanned = RequestContext(
            request=ctx.request,
            route=ctx.route,
            span=ctx.span,
            client_ip=ctx.client_ip,
            request_id=ctx.request_id,
            tenant=ctx.tenant,
            key_id=ctx.key_id,
            key=ctx.key,
        )
        scanned.body = raw
        scanned.payload = message
        scanned.keep_content(take(spec, message))
        await self._guard(scanned)
        return scanned.payload_rewritten
