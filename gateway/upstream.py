"""The upstream call: aiohttp to a replica, retried on the next candidate only before the client got a byte.

Streams are relayed event by event as they arrive (no buffering of the whole stream). A client disconnect cancels the
relay, which closes the upstream connection. An upstream that breaks mid-stream ends the client's stream with an
OpenAI-style error event and `[DONE]`, never silently.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from opentelemetry import propagate
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from starlette.responses import Response, StreamingResponse

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.routing.pool import Pool
from gateway.routing.replica import Replica
from gateway.sse import DONE, EventFramer, event_data
from gateway.telemetry import Metrics

log = logging.getLogger(__name__)

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass(slots=True)
class _Attempt:
    """An upstream response whose status line (and, for streams, first chunk) has arrived."""

    replica: Replica
    span: Span
    sent_at: float
    response: aiohttp.ClientResponse | None = None
    content: bytes = b""  # the whole body of a non-streaming answer
    first_chunk: bytes = b""
    chunks: AsyncIterator[bytes] | None = None


class Upstream:
    def __init__(self, tracer: Tracer, metrics: Metrics, replica_header: bool = False) -> None:
        self._tracer = tracer
        self._metrics = metrics
        self._replica_header = replica_header

    async def forward(self, ctx: RequestContext) -> Response:
        body, strip_usage = _request_body(ctx)
        attempt = await self._attempts(ctx, body)
        ctx.replica = attempt.replica
        ctx.status = attempt.response.status
        headers = {"x-request-id": ctx.request_id, **ctx.response_headers}
        if self._replica_header:
            headers["x-portcullis-replica"] = attempt.replica.url
        if attempt.chunks is None:
            try:
                if ctx.status == 200:
                    self._record_usage(ctx, _json_or_none(attempt.content))
                    if ctx.output_guard is not None:  # raises GuardBlocked (a GatewayError) on a block
                        attempt.content = await ctx.output_guard.check_body(attempt.content)
            finally:
                self._finish(ctx, attempt)
            media_type = attempt.response.headers.get("content-type", "application/json")
            return Response(attempt.content, status_code=ctx.status, headers=headers, media_type=media_type)
        return StreamingResponse(self._relay(ctx, attempt, strip_usage), headers={**_SSE_HEADERS, **headers},
                                 media_type="text/event-stream")

    async def _attempts(self, ctx: RequestContext, body: bytes) -> _Attempt:
        """Try candidates in order; a failure moves on only while nothing has reached the client."""
        pool = ctx.pool
        assert pool is not None, "route stage must run before the upstream call"
        candidates = ctx.candidates[: pool.config.max_attempts]
        failure: GatewayError | None = None
        for number, replica in enumerate(candidates, start=1):
            is_last = number == len(candidates)
            span = self._start_span(ctx, replica, number)
            replica.outstanding += 1
            attempt = _Attempt(replica=replica, span=span, sent_at=time.perf_counter())
            try:
                attempt.response = await self._send(pool, ctx, replica, span, body)
                status = attempt.response.status
                if status in pool.config.retry_on_status and not is_last:
                    raise GatewayError(502, f"upstream answered {status}", type="upstream_error",
                                       code="upstream_status")
                if ctx.stream and status == 200:
                    attempt.chunks = attempt.response.content.iter_any()
                    attempt.first_chunk = await anext(attempt.chunks, b"")
                else:
                    attempt.content = await attempt.response.read()
                    attempt.response.release()
                self._first_chunk_arrived(ctx, attempt)
                pool.record(replica, ok=status < 500)
                return attempt
            except (aiohttp.ClientError, TimeoutError, GatewayError) as exc:
                failure = _as_gateway_error(exc)
                pool.record(replica, ok=False)
                self._metrics.upstream_errors.labels(pool=pool.name, kind=failure.code).inc()
                log.warning("upstream %s attempt %d failed: %s", replica.url, number, failure.message)
                span.set_status(Status(StatusCode.ERROR, failure.message))
                span.set_attribute("error.type", failure.code or "upstream_error")
                if attempt.response is not None:
                    attempt.response.close()
                self._finish(ctx, attempt)
        assert failure is not None
        raise failure

    async def _send(self, pool: Pool, ctx: RequestContext, replica: Replica, span: Span,
                    body: bytes) -> aiohttp.ClientResponse:
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream" if ctx.stream else "application/json",
            "accept-encoding": "identity",
            "x-request-id": ctx.request_id,
        }
        if pool.api_key:
            headers["authorization"] = f"Bearer {pool.api_key}"
        propagate.inject(headers, context=set_span_in_context(span))
        return await pool.session.post(replica.url + _PATHS[ctx.route], data=body, headers=headers)

    def _start_span(self, ctx: RequestContext, replica: Replica, number: int) -> Span:
        host, port = replica.address
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": ctx.operation,
            "gen_ai.request.model": ctx.model,
            "server.address": host,
            "server.port": port,
            "portcullis.pool": ctx.pool.name if ctx.pool else "",
            "portcullis.attempt": number,
        }
        for key, attr in (("max_tokens", "gen_ai.request.max_tokens"), ("temperature", "gen_ai.request.temperature"),
                          ("top_p", "gen_ai.request.top_p")):
            if isinstance(ctx.payload.get(key), (int, float)):
                attributes[attr] = ctx.payload[key]
        return self._tracer.start_span(f"{ctx.operation} {ctx.model}", kind=SpanKind.CLIENT, attributes=attributes)

    def _first_chunk_arrived(self, ctx: RequestContext, attempt: _Attempt) -> None:
        ttft = time.perf_counter() - attempt.sent_at
        attempt.span.set_attribute("http.response.status_code", attempt.response.status)
        attempt.span.set_attribute("portcullis.upstream.time_to_first_chunk", ttft)
        self._metrics.upstream_ttft.labels(pool=ctx.pool.name).observe(ttft)

    async def _relay(self, ctx: RequestContext, attempt: _Attempt, strip_usage: bool) -> AsyncIterator[bytes]:
        framer = EventFramer()
        saw_done = False
        chunk = attempt.first_chunk
        try:
            while chunk:
                out = []
                for event in framer.feed(chunk):
                    data = event_data(event)
                    if data == b"[DONE]":
                        saw_done = True
                    elif data is not None and not self._inspect_event(ctx, data, strip_usage):
                        continue
                    out.append(event)
                if ctx.output_guard is not None:  # holds events back until scanned; raises GuardBlocked
                    out = await ctx.output_guard.feed(out)
                if out:
                    yield b"".join(out)
                chunk = await anext(attempt.chunks, b"")
            if not saw_done:
                raise GatewayError(502, "upstream closed the stream before it was complete", type="upstream_error",
                                   code="upstream_stream_truncated")
        except (aiohttp.ClientError, TimeoutError, GatewayError) as exc:
            error = _as_gateway_error(exc)
            ctx.stream_error = error.code
            attempt.span.set_status(Status(StatusCode.ERROR, error.message))
            attempt.span.set_attribute("error.type", error.code or "upstream_error")
            yield error.sse_event() + DONE
        except BaseException:
            ctx.stream_error = ctx.stream_error or "client_disconnected"
            raise
        finally:
            if saw_done:
                attempt.response.release()  # complete: the connection goes back to the pool
            else:
                attempt.response.close()  # broken or abandoned: drop the connection, so the upstream stops
            self._finish(ctx, attempt)

    def _inspect_event(self, ctx: RequestContext, data: bytes, strip_usage: bool) -> bool:
        """Record usage and finish reasons from one chunk; False drops a usage chunk the client did not ask for."""
        chunk = _json_or_none(data)
        if chunk is None:
            return True
        if "error" in chunk:
            ctx.stream_error = "upstream_error_event"
            return True
        self._record_usage(ctx, chunk)
        return not (strip_usage and chunk.get("usage") and not chunk.get("choices"))

    def _record_usage(self, ctx: RequestContext, body: dict | None) -> None:
        if not body:
            return
        for choice in body.get("choices") or ():
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if reason:
                ctx.usage.finish_reasons.append(reason)
            ctx.usage.generated = ctx.usage.generated or _carries_output(choice)
        usage = body.get("usage")
        if isinstance(usage, dict):
            ctx.usage.prompt_tokens = usage.get("prompt_tokens")
            ctx.usage.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                ctx.usage.cached_tokens = details.get("cached_tokens")

    def _finish(self, ctx: RequestContext, attempt: _Attempt) -> None:
        """Close the books on one attempt: in-flight count, duration, usage on the span, and the span itself."""
        pool_name = ctx.pool.name
        attempt.replica.outstanding -= 1
        self._metrics.upstream_duration.labels(pool=pool_name).observe(time.perf_counter() - attempt.sent_at)
        span, usage = attempt.span, ctx.usage
        if ctx.replica is attempt.replica:
            if usage.prompt_tokens is not None:
                span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
                self._metrics.tokens.labels(pool=pool_name, model=self._metrics.model_label(ctx.model),
                                            kind="prompt").inc(usage.prompt_tokens)
            if usage.completion_tokens is not None:
                span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
                self._metrics.tokens.labels(pool=pool_name, model=self._metrics.model_label(ctx.model),
                                            kind="completion").inc(usage.completion_tokens)
            if usage.finish_reasons:
                span.set_attribute("gen_ai.response.finish_reasons", usage.finish_reasons)
        span.end()


def _request_body(ctx: RequestContext) -> tuple[bytes, bool]:
    """The body to send, and whether the final usage chunk must be stripped (we asked for it, the client did not)."""
    options = ctx.payload.get("stream_options") or {}
    if not (ctx.stream and ctx.pool.config.include_usage) or options.get("include_usage"):
        return ctx.body, False
    payload = {**ctx.payload, "stream_options": {**options, "include_usage": True}}
    return json.dumps(payload).encode(), True


def _carries_output(choice: object) -> bool:
    """Whether a choice holds generated output (text, content, a tool call, reasoning), not just its role: token
    limits charge an unreported completion only once output was seen."""
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    part = choice.get("delta") or choice.get("message")
    return isinstance(part, dict) and any(value for key, value in part.items() if key != "role")


def _json_or_none(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _as_gateway_error(exc: Exception) -> GatewayError:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors too
        return GatewayError(504, f"upstream timed out ({type(exc).__name__})", type="upstream_error",
                            code="upstream_timeout")
    return GatewayError(502, f"upstream unreachable or failed ({type(exc).__name__})", type="upstream_error",
                        code="upstream_unavailable")
