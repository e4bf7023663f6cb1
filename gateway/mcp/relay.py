"""The relay between a client and an upstream MCP server: the client's message sent on with the server's credential
(never the caller's key), the server's answer read back message by message, as one JSON body or as SSE events, each
within `max_message_bytes` and the JSON bounds, and each judged before it is relayed:

- the answer to the client's request: a tools/list keeps only the tools the caller may call whose definitions are
  approved (gateway/mcp/pins.py) and pass the guard; a tools/call result, a resource read and a prompt got are
  scanned by the guard (gateway/mcp/scan.py), and a blocked one is replaced by a JSON-RPC error;
- the server's own requests and notifications: those the gateway knows a client may get, and those the policy
  relays (`mcp.relay`); others are dropped;
- answers the gateway cannot pair with the request it read (a replay after a reconnection): dropped, since the
  gateway cannot say what they answer, so it cannot judge them.

A server that breaks the protocol (a message past the limits, not JSON-RPC, silent past `idle_timeout`) ends the
exchange with a 502, or, once a stream has started, with an error event for the client's request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from opentelemetry import propagate
from opentelemetry.trace import set_span_in_context
from starlette.responses import Response, StreamingResponse

from gateway.config import LimitsConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.mcp import messages
from gateway.mcp.call import McpCall
from gateway.mcp.carriers import ANSWERS, TOOL
from gateway.mcp.pins import Catalog, Standing, tool_hash
from gateway.mcp.scan import Scanner
from gateway.mcp.sessions import SessionBinder, caller_of
from gateway.mcp.spec import McpSpec
from gateway.mcp.stages import SESSION_HEADER, call_of
from gateway.mcp.upstream import McpServer
from gateway.policy.loader import PolicySet
from gateway.streaming.sse import EventFramer, EventTooLarge, event_parts

log = logging.getLogger(__name__)

# What a server may send a client unasked, beside what the policy relays.
SERVER_METHODS = frozenset(
    {
        "ping",
        "notifications/progress",
        "notifications/message",
        "notifications/cancelled",
        "notifications/tools/list_changed",
        "notifications/prompts/list_changed",
        "notifications/resources/list_changed",
        "notifications/resources/updated",
    }
)
# The client's headers the server is sent (the protocol's own), and the server's the client is sent.
_FORWARDED = ("accept", "content-type", "mcp-protocol-version", "mcp-method", "mcp-name", "last-event-id")
_RETURNED = ("content-type", "cache-control", "mcp-protocol-version")
MAX_LOOKUP_PAGES = 16


class Relay:
    def __init__(
        self,
        servers: dict[str, McpServer],
        policies: Callable[[], PolicySet],
        binder: SessionBinder,
        catalog: Catalog,
        scanner: Scanner,
        limits: LimitsConfig,
    ) -> None:
        self._servers = servers
        self._policies = policies
        self._binder = binder
        self._catalog = catalog
        self._scanner = scanner
        self._limits = limits

    async def forward(self, ctx: RequestContext) -> Response:
        """The client's request sent on, and the server's answer as the client gets it."""
        call = call_of(ctx)
        body = ctx.outgoing_body() if ctx.body else None  # as redaction left it, if it rewrote the arguments
        upstream = await self._send(ctx, call, ctx.request.method, body, self._headers(ctx, call))
        status = upstream.status
        headers = {name: upstream.headers[name] for name in _RETURNED if name in upstream.headers}
        session = upstream.headers.get(SESSION_HEADER)
        if session is not None:
            headers[SESSION_HEADER] = self._binder.outward(call.server.name, caller_of(ctx.key_id, ctx.tenant), session)
        ctx.status = status
        content_type = upstream.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if status >= 400:
            return await self._refused(call, upstream, status, content_type, headers)
        if content_type not in ("application/json", "text/event-stream"):
            upstream.release()
            if content_type:
                raise _broken(call, f"answered with Content-Type {content_type[:64]!r}")
            return Response(status_code=status, headers=headers)  # 202 for a notification or an answer
        if content_type == "application/json":
            try:
                raw = await _read_bounded(upstream, call.server.max_message_bytes)
            finally:
                upstream.release()
            if not raw and call.kind != "request":
                return Response(status_code=status, headers=headers)  # a notification taken, a session ended
            out = await self._from_server(ctx, call, raw)
            if out is None:
                raise _broken(call, "answered with a message that is no answer to the request")
            return Response(out, status_code=status, headers=headers, media_type="application/json")
        return StreamingResponse(self._events(ctx, call, upstream), status_code=status, headers=headers)

    async def _refused(
        self,
        call: McpCall,
        upstream: aiohttp.ClientResponse,
        status: int,
        content_type: str,
        headers: dict[str, str],
    ) -> Response:
        """The server's refusal: its JSON-RPC error relayed with its status where it sent one (a 4xx), else the
        gateway's own (a 5xx is the server's failure: 502)."""
        try:
            raw = (
                await _read_bounded(upstream, call.server.max_message_bytes)
                if content_type == "application/json"
                else b""
            )
        finally:
            upstream.release()
        if status < 500 and raw:
            try:
                error = messages.read(raw, self._limits).get("error")
            except GatewayError:
                error = None
            if isinstance(error, dict):
                answer = {"jsonrpc": "2.0", "id": call.request_id, "error": error}
                return Response(messages.encode(answer), status, headers, media_type="application/json")
        raise GatewayError(
            status if status < 500 else 502,
            f"the MCP server {call.server.name!r} answered HTTP {status}",
            type="upstream_error",
            code="upstream_refused" if status < 500 else "upstream_error",
        )

    def _headers(self, ctx: RequestContext, call: McpCall) -> dict[str, str]:
        sent = ctx.request.headers
        headers = {name: sent[name] for name in _FORWARDED if name in sent}
        credential = self._servers[call.server.name].credential
        if credential:
            headers["authorization"] = f"Bearer {credential}"
        if call.upstream_session is not None:
            headers[SESSION_HEADER] = call.upstream_session
        propagate.inject(headers, context=set_span_in_context(call.span or ctx.span))
        return headers

    async def _send(
        self, ctx: RequestContext, call: McpCall, method: str, body: bytes | None, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        config = call.server
        timeout = aiohttp.ClientTimeout(
            total=config.total_timeout if method == "POST" else None,
            sock_connect=config.connect_timeout,
            sock_read=config.idle_timeout,
        )
        server = self._servers[config.name]
        try:
            return await server.session.request(
                method, config.url, data=body, headers=headers, timeout=timeout, allow_redirects=False
            )
        except TimeoutError:
            raise GatewayError(
                504, f"the MCP server {config.name!r} did not answer in time", type="upstream_error", code="timeout"
            ) from None
        except aiohttp.ClientError as err:
            raise GatewayError(
                502,
                f"the MCP server {config.name!r} cannot be reached: {type(err).__name__}",
                type="upstream_error",
                code="upstream_unreachable",
            ) from None

    async def _events(
        self, ctx: RequestContext, call: McpCall, upstream: aiohttp.ClientResponse
    ) -> AsyncIterator[bytes]:
        """The server's SSE stream, event by event, each message judged; a broken one ends it with an error."""
        try:
            async for event in _sse_events(upstream, call.server.max_message_bytes):
                out = await self._event(ctx, call, event)
                if out:
                    yield out
        except GatewayError as err:
            ctx.stream_error = err.code
            yield b"event: message\ndata: " + messages.error_message(err, call.request_id) + b"\n\n"
        finally:
            upstream.release()

    async def _event(self, ctx: RequestContext, call: McpCall, event: bytes) -> bytes:
        data, other = event_parts(event)
        if not data:
            return event  # a comment, or a priming event (an id to resume from, no data)
        out = await self._from_server(ctx, call, data)
        if out is None:
            return b""
        if out is data:
            return event
        return b"".join(line + b"\n" for line in other) + b"data: " + out + b"\n\n"

    async def _from_server(self, ctx: RequestContext, call: McpCall, raw: bytes) -> bytes | None:
        """One message from the server as the client gets it: `raw` itself, a rewritten one, or None (dropped)."""
        message = _read(call, raw, self._limits)
        spec = self._policies().mcp_for(ctx.tenant)
        method = message.get("method")
        if isinstance(method, str):
            if method in SERVER_METHODS or method in spec.relay:
                return raw
            log.warning("MCP server %r sent %r, which the policy does not relay: dropped", call.server.name, method)
            return None
        if call.request_id is None or message.get("id") != call.request_id:
            log.warning("MCP server %r sent an answer to no request of this exchange: dropped", call.server.name)
            return None
        if "result" not in message:
            return raw  # the server's JSON-RPC error
        if call.method == "tools/list":
            await self._tools(ctx, call, spec, message)
            return messages.encode(message)
        answer = ANSWERS.get(call.method)
        if answer is None:
            return raw
        try:
            rewritten = await self._scanner.scan(ctx, answer, message, raw)
        except GatewayError as blocked:  # the guard's block, or text too long for it to scan whole
            call.decision, call.reason = "blocked", "result_blocked"
            refusal = GatewayError(
                502,
                f"the MCP server's answer was withheld: {blocked.message}",
                type="guard_error",
                code="result_blocked",
                param=blocked.param,
            )
            return messages.error_message(refusal, call.request_id)
        return messages.encode(message) if rewritten else raw

    async def _tools(self, ctx: RequestContext, call: McpCall, spec: McpSpec, message: dict[str, Any]) -> None:
        """Keep the tools the caller may call whose definitions are approved; record each tool's standing."""
        result = message["result"]
        tools = result.get("tools") if isinstance(result, dict) else None
        if not isinstance(tools, list):
            raise _broken(call, "answered tools/list without a list of tools")
        server = call.server.name
        standings = await asyncio.gather(*(self._judge(ctx, spec, server, tool) for tool in tools))
        result["tools"] = [
            tool
            for tool, standing in zip(tools, standings)
            if standing == "approved" and spec.allowed(server, tool["name"], ctx.key_id)
        ]

    async def _judge(self, ctx: RequestContext, spec: McpSpec, server: str, tool: object) -> Standing | None:
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            return None
        name = tool["name"]
        digest = tool_hash(tool)
        standing = self._catalog.judge(spec, server, name, digest)
        try:
            await self._scanner.scan(ctx, TOOL, tool, messages.encode(tool))
        except GatewayError as blocked:  # the guard's block, or a description too long for it to scan whole
            standing = "poisoned"
            log.warning("MCP server %r: tool %r refused by the guard: %s", server, name, blocked.message)
        self._catalog.record(ctx.tenant, server, name, standing)
        if standing != "approved":
            log.warning(
                "MCP server %r: tool %r left out of tools/list (%s); its definition hash is %s",
                server,
                name,
                standing,
                digest,
            )
        return standing

    async def look_up(self, ctx: RequestContext) -> None:
        """A tools/list of the gateway's own, for a call naming a tool no list has shown this process: its tools'
        standings recorded, as any tools/list the gateway relays records them."""
        call = call_of(ctx)
        spec = self._policies().mcp_for(ctx.tenant)
        meta = call.params.get("_meta")
        cursor: object = None
        for page in range(MAX_LOOKUP_PAGES):
            params: dict[str, Any] = {} if cursor is None else {"cursor": cursor}
            if meta is not None:
                params["_meta"] = meta  # the 2026 revision's per-request envelope, as the client sent it
            asked = {"jsonrpc": "2.0", "id": f"portcullis-{ctx.request_id}-{page}", "method": "tools/list"}
            listing = McpCall(call.server, {**asked, "params": params}, "request", call.upstream_session)
            headers = {k: v for k, v in self._headers(ctx, call).items() if k not in ("mcp-name", "last-event-id")}
            if "mcp-method" in headers:
                headers["mcp-method"] = "tools/list"
            upstream = await self._send(ctx, listing, "POST", messages.encode(listing.message), headers)
            try:
                answer = await _answer_of(listing, upstream, self._limits)
            finally:
                upstream.release()
            if answer is None or not isinstance(answer.get("result"), dict):
                return
            await self._tools(ctx, listing, spec, answer)
            cursor = answer["result"].get("nextCursor")
            if not isinstance(cursor, str):
                return


async def _answer_of(call: McpCall, upstream: aiohttp.ClientResponse, limits: LimitsConfig) -> dict[str, Any] | None:
    """The answer to `call` in a server's JSON or SSE answer; None where there is none."""
    content_type = upstream.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if upstream.status != 200:
        return None
    if content_type == "application/json":
        message = _read(call, await _read_bounded(upstream, call.server.max_message_bytes), limits)
        return message if message.get("id") == call.request_id else None
    if content_type != "text/event-stream":
        return None
    async for event in _sse_events(upstream, call.server.max_message_bytes):
        data, _ = event_parts(event)
        if data:
            message = _read(call, data, limits)
            if message.get("id") == call.request_id and "method" not in message:
                return message
    return None


async def _sse_events(upstream: aiohttp.ClientResponse, limit: int) -> AsyncIterator[bytes]:
    framer = EventFramer(limit)
    try:
        async for chunk in upstream.content.iter_any():
            for event in framer.feed(chunk):
                yield event
    except EventTooLarge:
        raise GatewayError(502, f"the MCP server sent an event past {limit} bytes", code="upstream_error") from None
    except (TimeoutError, aiohttp.ClientError) as err:
        raise GatewayError(
            502, f"the MCP server's stream broke: {type(err).__name__}", type="upstream_error", code="upstream_error"
        ) from None


async def _read_bounded(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    chunks, size = [], 0
    try:
        async for chunk in upstream.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise GatewayError(
                    502, f"the MCP server's answer exceeds {limit} bytes", type="upstream_error", code="upstream_error"
                )
            chunks.append(chunk)
    except (TimeoutError, aiohttp.ClientError) as err:
        raise GatewayError(
            502,
            f"the MCP server's answer broke off: {type(err).__name__}",
            type="upstream_error",
            code="upstream_error",
        ) from None
    return b"".join(chunks)


def _read(call: McpCall, raw: bytes, limits: LimitsConfig) -> dict[str, Any]:
    """A server's message, or the 502 that says the server broke the protocol."""
    try:
        return messages.read(raw, limits)
    except GatewayError as err:
        raise _broken(call, f"sent a message that is not one: {err.message}") from None


def _broken(call: McpCall, what: str) -> GatewayError:
    return GatewayError(
        502, f"the MCP server {call.server.name!r} {what}", type="upstream_error", code="upstream_error"
    )
