"""Parse stage: bounded body read, JSON decode within the operator's limits, and the schema essentials every later
stage relies on (each route's own, gateway/apis/).

Everything after it trusts what it checked: a field the gateway (or the bundled engine) reads has the type OpenAI
documents, and the model is a name every later use can carry as it is (gateway/apis/model_name.py), so bad input is
a 400 here and never a 500 in a later stage, nor a request an upstream is paid for. Big bodies are decoded and
checked on the offload executor (gateway/edge/offload.py): decoding and walking a 4 MB body takes the event loop tens of
milliseconds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect

from gateway.apis.inventory import Inventory
from gateway.apis.model_name import check_model_name
from gateway.apis.openai_fields import TOOL_KEYS
from gateway.apis.routes import BY_NAME
from gateway.apis.shape import Api
from gateway.config import LimitsConfig
from gateway.context import RequestContext
from gateway.edge import json_bounds
from gateway.edge.offload import Offload
from gateway.edge.shape_gate import ShapeGate
from gateway.errors import GatewayError, invalid_request
from gateway.json_path import dotted


class ParseStage:
    name = "parse"

    def __init__(self, limits: LimitsConfig, offload: Offload, gate: ShapeGate) -> None:
        self.limits = limits
        self.max_body_bytes = limits.max_body_bytes
        self._offload = offload
        self._gate = gate

    async def __call__(self, ctx: RequestContext) -> None:
        check_encoding(ctx)
        body = await self.read_body(ctx)
        await self._gate.check(ctx.route, body)
        payload, encoded, values, inventory = await self._offload.run(
            self._offload.is_big(len(body)), parse_body, ctx.route, body, self.limits
        )
        ctx.body = body
        ctx.payload = payload
        ctx.encoded_payload = encoded
        ctx.json_values = values
        if inventory is not None:
            ctx.keep_content(inventory)
        ctx.model = payload["model"]
        ctx.stream = bool(payload.get("stream", False))
        ctx.span.set_attribute("gen_ai.request.model", ctx.model)

    async def read_body(self, ctx: RequestContext) -> bytes:
        """The body, bounded in bytes as it arrives, in time between its chunks and in time in all: a slow client
        holds a slot and a connection, and one that sends a byte just inside each idle wait would hold them for as
        long as its body lasts."""
        request = ctx.request
        length = request.headers.get("content-length")
        if length is not None and length.isascii() and length.isdigit() and int(length) > self.max_body_bytes:
            raise _too_large(self.max_body_bytes)
        idle, whole = self.limits.body_idle_timeout, self.limits.body_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + whole
        chunks, size = [], 0
        try:
            # one timer, moved on by every chunk, never past the deadline
            async with asyncio.timeout_at(min(loop.time() + idle, deadline)) as timer:
                while True:
                    message = await request.receive()
                    if message["type"] == "http.disconnect":
                        raise ClientDisconnect()
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise _too_large(self.max_body_bytes)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
                    timer.reschedule(min(loop.time() + idle, deadline))
        except TimeoutError:
            why = f"not complete within {whole:g}s" if timer.when() == deadline else f"stalled for {idle:g}s"
            raise GatewayError(
                408, f"request body {why}", code="body_timeout", headers={"connection": "close"}
            ) from None


class RawBodyStage:
    """Parse on a passthrough route: the body read within the same bounds, decoded for the WAF where it is JSON
    within the same limits; no schema (the upstream's to judge)."""

    name = "parse"

    def __init__(self, parse: ParseStage) -> None:
        self._parse = parse

    async def __call__(self, ctx: RequestContext) -> None:
        ctx.body = await self._parse.read_body(ctx)
        if ctx.body and "json" in ctx.request.headers.get("content-type", ""):
            try:
                payload = json_bounds.decode(ctx.body, self._parse.limits)
            except GatewayError:
                return  # not JSON within the limits: the WAF reads it as a raw body
            if isinstance(payload, dict):
                ctx.payload = payload


def parse_body(
    route: str, body: bytes, limits: LimitsConfig
) -> tuple[dict[str, Any], bytes | None, int, Inventory | None]:
    """The payload, that payload encoded again (json_bounds.decode_encoded), its count of values and, where the body
    may name a model besides its own, its content inventory (taken once here, for every stage that reads content):
    limits first, so the schema checks walk a bounded payload."""
    api = BY_NAME[route]
    payload, encoded = json_bounds.decode_encoded(body, limits)
    if not isinstance(payload, dict):
        raise invalid_request("request body must be a JSON object", code="invalid_json")
    _check_array_lengths(api, payload, limits)
    values = json_bounds.within_limits_unwalked(body, limits) or json_bounds.check_shape(payload, limits)
    api.check(payload)
    if not api.names_model:  # an MCP message: no model to route, limit, charge or name the answer by
        return payload, encoded, values, None
    check_model_name(payload["model"])  # every model route's: what routes, keys limits and spend, and names the answer
    if not may_name_another_model(body, encoded):
        return payload, encoded, values, None
    inventory = api.inventory(payload)
    if inventory.other_models:
        where = dotted(inventory.other_models[0])
        raise invalid_request(
            f"{where} names a model for the provider to run besides {payload['model']!r}: this gateway authorises, "
            "limits and charges the model a request names (its own fallbacks are the operator's to configure)",
            param=where,
            code="unsupported_parameter",
        )
    return payload, encoded, values, inventory


def may_name_another_model(body: bytes, encoded: bytes | None) -> bool:
    """Whether a body could name a model for the provider to run besides its top-level one (every such field is a
    `model` or `fallbacks` member, gateway/apis/inventory.py's ModelChoice): a key spelled so twice or once, in the
    payload `encoded` again (each key as it decoded), else in the body, where an escape could spell one. Most requests
    are then not walked here: the WAF and the guard take the inventory when they are on."""
    if encoded is not None:
        return encoded.count(b'"model":') > 1 or encoded.find(b'"fallbacks":') >= 0
    return body.count(b'"model"') > 1 or b'"fallbacks"' in body or b"\\u" in body


def check_encoding(ctx: RequestContext) -> None:
    """A compressed body is refused before it is read (415), not decoded as JSON into a puzzling invalid_json: the
    gateway judges the JSON it reads, and decompressing on its behalf would let a small body grow past every bound."""
    encoding = ctx.request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise GatewayError(
            415,
            f"Content-Encoding {encoding!r} is not supported: send the JSON body uncompressed",
            code="unsupported_content_encoding",
            headers={"accept-encoding": "identity"},
        )


def _too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"request body exceeds the {limit}-byte limit", code="request_too_large")


def _check_array_lengths(api: Api, payload: dict[str, Any], limits: LimitsConfig) -> None:
    """The arrays with limits of their own, checked before the walk so the error names them, not a total."""
    for key in api.array_fields:
        value = payload.get(key)
        if isinstance(value, list) and len(value) > limits.max_messages:
            raise json_bounds.array_too_long(key, len(value), limits.max_messages, "limits.max_messages")
    for key in TOOL_KEYS:
        value = payload.get(key)
        if isinstance(value, list) and len(value) > limits.max_tools:
            raise json_bounds.array_too_long(key, len(value), limits.max_tools, "limits.max_tools")
