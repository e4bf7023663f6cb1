"""JSON-RPC 2.0 messages as MCP's streamable HTTP transport carries them: one message per POST body or SSE event,
read within the operator's JSON bounds (gateway/edge/json_bounds.py), and the gateway's refusals as JSON-RPC errors.

A refusal keeps the HTTP status that says why (400, 401, 403, 404, 413, 429, ...) and carries a JSON-RPC error with
the request's id, the gateway's error code in `data.code`, as the specification lets a server answer input it does
not accept; a refusal of an answer the upstream already gave (a blocked tool result) is an error message in place of
that answer.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from starlette.responses import Response

from gateway.config import LimitsConfig
from gateway.edge import json_bounds
from gateway.errors import GatewayError, invalid_request
from gateway.header_values import rendered

RequestId = str | int
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
REFUSED = -32000  # implementation-defined server error: the gateway's policy refused it
_CODES = {
    "invalid_json": PARSE_ERROR,
    "method_not_relayed": METHOD_NOT_FOUND,
    "tool_not_allowed": INVALID_PARAMS,
    "tool_not_approved": INVALID_PARAMS,
}

Kind = Literal["request", "notification", "answer"]


def read(raw: bytes, limits: LimitsConfig) -> dict[str, Any]:
    """One JSON-RPC message within the bounds, or a 400 naming what is wrong with it."""
    message = json_bounds.decode(raw, limits)
    if not isinstance(message, dict):
        raise invalid_request(
            "an MCP message is one JSON-RPC object (batches are not part of the protocol revisions served)",
            code="invalid_json",
        )
    if not json_bounds.within_limits_unwalked(raw, limits):
        json_bounds.check_shape(message, limits)
    kind_of(message)
    return message


def kind_of(message: dict[str, Any]) -> Kind:
    """A request (method and id), a notification (method, no id) or an answer (id and result or error)."""
    if message.get("jsonrpc") != "2.0":
        raise invalid_request("'jsonrpc' must be \"2.0\"", param="jsonrpc", code="invalid_jsonrpc")
    if "id" in message and not _is_id(message["id"]):
        raise invalid_request("'id' must be a string or an integer", param="id", code="invalid_jsonrpc")
    params = message.get("params")
    if params is not None and not isinstance(params, dict):
        raise invalid_request("'params' must be an object", param="params", code="invalid_jsonrpc")
    method = message.get("method")
    if isinstance(method, str) and method:
        return "request" if "id" in message else "notification"
    if method is None and "id" in message and ("result" in message) != ("error" in message):
        return "answer"
    raise invalid_request(
        "a JSON-RPC message has a 'method' (a request or notification) or an 'id' with one of 'result' and 'error'",
        code="invalid_jsonrpc",
    )


def _is_id(value: object) -> bool:
    return type(value) is str or type(value) is int


def encode(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message)


def error_message(error: GatewayError, request_id: RequestId | None) -> bytes:
    """The JSON-RPC error message that says `error`."""
    data = {"type": error.type, "code": error.code, "param": error.param}
    body = error.body().get("error", {})
    if "guard" in body:
        data["guard"] = body["guard"]
    return encode(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "error": {"code": _CODES.get(error.code or "", REFUSED), "message": error.message, "data": data},
        }
    )


def error_response(error: GatewayError, request_id: RequestId | None) -> Response:
    """A refusal answered: its HTTP status, a JSON-RPC error body."""
    return Response(
        error_message(error, request_id),
        status_code=error.status,
        headers=rendered(error.headers),
        media_type="application/json",
    )
