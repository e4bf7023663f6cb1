"""Anthropic's error bodies and types (docs.anthropic.com "Errors"), for every answer a Messages client reads."""

from __future__ import annotations

from typing import Any

# docs.anthropic.com "Errors": the type each HTTP status carries; any other 4xx is an invalid_request_error.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # a pool without capacity is what Anthropic reports as overloaded (its 529)
    504: "timeout_error",  # the SDK's GatewayTimeoutErrorObject
    529: "overloaded_error",
}


# Types OpenAI's errors use too: there they say less than the status does (the gateway's WAF answers 403 with an
# invalid_request_error to OpenAI clients, which an Anthropic client knows as a permission_error).
_SHARED_WITH_OPENAI = frozenset({"invalid_request_error", "authentication_error"})


def anthropic_error_type(status: int) -> str:
    """Anthropic's error `type` for an HTTP status: the documented ones, other 4xx invalid_request_error, other
    5xx (502 included: the upstream failed) api_error."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """The error body Anthropic's API and SDKs use: {"type": "error", "error": {"type", "message"}}; `kind` where
    it already is one of Anthropic's types (an Anthropic upstream's own), else the status's."""
    specific = kind in _ERROR_TYPES.values() and kind not in _SHARED_WITH_OPENAI
    known = kind if specific else anthropic_error_type(status)
    return {"type": "error", "error": {"type": known, "message": message}}
