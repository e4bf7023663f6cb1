"""Admin request bodies: read within a byte cap, decoded as JSON and validated by a pydantic model.

The admin plane is trusted, yet its bodies are still bounded: a token can leak, and a body the gateway holds in
memory should never be as large as a client chooses. A validation error names the field (`limits.tpm`), cut short
where the field is a key the client chose, and never echoes the value.
"""

from __future__ import annotations

from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from gateway.errors import GatewayError, invalid_request
from gateway.json_path import dotted

MAX_BODY_BYTES = 64 * 1024
_MAX_KEY_CHARS = 64

Model = TypeVar("Model", bound=BaseModel)


async def read_object(request: Request) -> dict:
    """The body as a JSON object (an empty body is `{}`); 413 past MAX_BODY_BYTES, 400 if not a JSON object."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
    if not body.strip():
        return {}
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise invalid_request("request body must be a JSON object", code="invalid_json")
    return payload


def validated(model: type[Model], payload: dict) -> Model:
    """`payload` as `model`, or a 400 naming the first field pydantic refused (and how many more there are)."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> GatewayError:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    param = dotted(tuple(_short(part) for part in first["loc"]))
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    where = f"Invalid '{param}'" if param else "Invalid body"
    return invalid_request(f"{where}: {first['msg']}{more}", param=param or None, code="invalid_value")


def _short(part: int | str) -> int | str:
    if isinstance(part, str) and len(part) > _MAX_KEY_CHARS:
        return part[: _MAX_KEY_CHARS - 3] + "..."
    return part


def _too_large() -> GatewayError:
    return GatewayError(413, f"request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")
