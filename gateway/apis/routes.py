"""The request shapes the gateway serves, by route name (policies, metrics) and by path."""

from __future__ import annotations

from typing import Literal, get_args

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from gateway.apis.chat import Chat
from gateway.apis.completions import Completions
from gateway.apis.embeddings import Embeddings
from gateway.apis.messages import CountTokens, Messages
from gateway.apis.passthrough import Passthrough
from gateway.apis.responses import Responses
from gateway.apis.shape import Api
from gateway.errors import GatewayError, http_error
from gateway.mcp.shape import Mcp

APIS: tuple[Api, ...] = (Chat(), Completions(), Responses(), Embeddings(), Messages(), CountTokens())
PASSTHROUGH = Passthrough()  # any other /v1/ route a pool opts in to
MCP = Mcp()  # /mcp/{server}: MCP servers' JSON-RPC messages (gateway/mcp/)
BY_NAME: dict[str, Api] = {api.name: api for api in (*APIS, PASSTHROUGH, MCP)}
BY_PATH: dict[str, Api] = {api.path: api for api in APIS}
# What policies may scope rules to (rate limits, WAF exclusions); a test keeps it equal to the shapes above.
RouteName = Literal["chat", "completions", "responses", "embeddings", "messages", "count_tokens", "passthrough", "mcp"]
ROUTE_NAMES: tuple[str, ...] = get_args(RouteName)


async def route_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404/405s in the shape of the route asked for; a 404 under /v1/ names the routes that exist,
    so a client on a route the gateway does not serve learns it from the gateway, not from a bare 404."""
    path = request.scope["path"]
    api = BY_PATH.get(path)
    if exc.status_code == 405 and api is not None:
        message = f"{request.method} is not allowed on {path}: send POST"
        return api.error_response(GatewayError(405, message, code="method_not_allowed", headers=exc.headers))
    if exc.status_code == 404 and path.startswith("/v1/"):
        served = ", ".join(["/v1/models", *(a.path for a in APIS)])
        message = f"Unknown route {request.method} {path}: this gateway serves {served}"
        # under /v1/messages/ (Message Batches...) the client is Anthropic's: its 404 in its own shape
        shape = BY_PATH["/v1/messages"] if path.startswith("/v1/messages/") else PASSTHROUGH
        return shape.error_response(GatewayError(404, message, code="not_found"))
    return await http_error(request, exc)
