"""What the MCP route's stages know of one HTTP exchange with a client, beside the request's context."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from gateway.config import McpServerConfig
from gateway.mcp.messages import Kind, RequestId


@dataclass(slots=True)
class McpCall:
    server: McpServerConfig
    message: dict[str, Any] = field(default_factory=dict)  # the client's message, as parsed (POST only)
    kind: Kind | None = None  # None: no message (a GET stream, a DELETE)
    upstream_session: str | None = None  # the upstream's session id, once the caller's claim to it is checked
    span: Span | None = None  # a tools/call's execute_tool span, ended when its answer has been relayed
    decision: str = "relayed"  # what the gateway did, for the audit log: relayed, refused, blocked, ...
    reason: str | None = None

    @property
    def method(self) -> str:
        method = self.message.get("method")
        return method if isinstance(method, str) else ""

    @property
    def request_id(self) -> RequestId | None:
        found = self.message.get("id") if self.kind == "request" else None
        return found if isinstance(found, str | int) else None

    @property
    def params(self) -> dict[str, Any]:
        found = self.message.get("params")
        return found if isinstance(found, dict) else {}

    @property
    def tool(self) -> str:
        """The tool a tools/call names ("" for other messages; the parse stage checked it is a string)."""
        name = self.params.get("name") if self.method == "tools/call" else None
        return name if isinstance(name, str) else ""
