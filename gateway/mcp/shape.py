"""The MCP route as a request shape (gateway/apis/shape.py), so the stages every route shares (the WAF, auth, the
guard, rate limits) read a client's JSON-RPC message as they read any request: through its content inventory."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from gateway.apis.shape import Api, CountForm
from gateway.errors import GatewayError
from gateway.mcp.carriers import CLIENT_MESSAGE
from gateway.mcp.messages import error_response


class Mcp(Api):
    name = "mcp"
    path = "/mcp/{server}"
    operation = "execute_tool"
    output_fields = ()
    fill_field = None
    carriers = CLIENT_MESSAGE
    names_model = False

    def check(self, payload: dict[str, Any]) -> None:
        return None  # a JSON-RPC message's checks are the MCP parse stage's (gateway/mcp/stages.py)

    def counted(self, payload: dict[str, Any]) -> tuple[CountForm, Any]:
        return "prompt", ""

    def error_response(self, error: GatewayError) -> Response:
        """A failure the MCP endpoint did not answer itself (a defect: 500), as a JSON-RPC error."""
        return error_response(error, None)
