"""The upstream call: aiohttp to a replica, bounded in bytes and time, retried on the next candidate only before the
upstream answered.

Retries and the client's headers: a candidate that fails before its status line arrives (refused, reset, timed out),
answers with one of the pool's `retry_on_status`, or sends a non-streaming 200 the gateway cannot use (past the size
limit, not a JSON object) is retried on the next candidate. A stream's 200 commits to its replica: the client's
headers go out at once, not when the first chunk arrives (a long prefill must not look like a dead gateway to the
client), so anything that fails after that ends the client's stream with an OpenAI-style error event and `[DONE]`,
never silently and never by splicing a second replica's stream behind the first one's headers. A non-streaming
answer is read whole before the client hears anything: its status and size decide what the client gets.

Bounds, per pool: a non-streaming (or error) body is read incrementally and dropped past `max_response_bytes`
(502); an SSE event may not grow past `max_event_bytes` (error event), nor be anything but one of the route's events
(SSE fields a client reads as the gateway did, data the route's format knows: gateway/streaming/sse.py's `read_event`,
the format's `is_event`): the first that is not ends the stream with the error event, unrelayed, and nothing after it is
read; `timeouts.total`, counted from the request's arrival, bounds the whole request (504 before the answer started,
error event after); `timeouts.stream_idle` bounds the silence between an answer's chunks once its body has begun (the
wait for the first is `timeouts.read`'s). Upstream errors reach the client OpenAI-shaped: the upstream's own message
(and its status, if a 4xx or 502-504) where it sent an OpenAI-style error, 502 for anything else (an HTML error page, a
non-JSON or non-UTF-8 body).

What differs between the client's API and the pool's (the body sent, the answer, the stream, the pool's headers) is
the exchange's translation and its pool API's (gateway/apis/translation.py, pool_api.py): no API is named here.

A pool that fails a request before the client heard anything (every attempt failed, or the last one answered an
error) raises `PoolFailed`, which names the failure in fallback terms (gateway/relay/fallbacks.py) where it is one of
them: the caller may place the request on another pool and forward it again. Every answer names the model that served it
(`x-portcullis-model`); every header value is rendered by gateway/header_values.py, whatever text it carries.

A client that leaves cancels the work done for it (gateway/edge/client_exit.py until the answer starts, Starlette's
disconnect listener during a stream); cancelling an attempt closes its upstream connection, so the upstream stops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from opentelemetry.trace import NonRecordingSpan, Span, SpanKind, Status, StatusCode, Tracer
from starlette.responses import Response, StreamingResponse

from gateway.apis.answers import AnswerFormat, token_count
from gateway.apis.exchange import POOL_APIS, Exchange
from gateway.config import FallbackTrigger
from gateway.context import RequestContext
from gateway.edge.offload import Offload
from gateway.errors import GatewayError, internal_error
from gateway.header_values import header_value, rendered
from gateway.observability.telemetry import Metrics, TraceHeaders, trace_headers
from gateway.relay.genai_spans import TIME_TO_FIRST_CHUNK, response_attributes
from gateway.routing.pool import Pool
from gateway.routing.replica import Replica
from gateway.streaming.sse import EventFramer, EventTooLarge, MalformedEvent, read_event

log = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
# A passthrough request's headers the upstream gets (never the client's credentials), and an answer's the client gets.
_PASSED_HEADERS = frozenset({"content-type", "accept", "openai-beta", "anthropic-beta"})
_RETURNED_HEADERS = frozenset({"content-type", "content-disposition", "cache-control"})
# upstream statuses that mean to a client what they meant to the gateway (529: Anthropic's "overloaded")
_KEPT_5XX = (502, 503, 504, 529)
_GATEWAY_CREDENTIAL_STATUSES = (401, 403, 407)  # the upstream judged the gateway's key, not the client's
_MAX_MESSAGE_CHARS = 4096  # of an upstream's error message passed on to the client


class PoolFailed(GatewayError):
    """The request's pool failed it before the client heard a byte: what the client is told if nothing else serves
    it, and the fallback trigger the failure is."""

    def __init__(self, error: GatewayError, trigger: FallbackTrigger) -> None:
        super().__init__(
            error.status, error.message, type=error.type, code=error.code, param=error.param, headers=error.headers
        )
        self.trigger: FallbackTrigger = trigger


@dataclass(slots=True)
class _Attempt:
    """One try at one replica of the request's pool; its response once the status line arrived."""

    pool: Pool
    replica: Replica
    span: Span
    sent_at: float
    response: aiohttp.ClientResponse | None = None
    content: bytes = b""  # the whole body of a non-streaming or error answer
    answer: dict[str, Any] | None = None  # a non-streaming 200's body, parsed

    @property
    def answered(self) -> aiohttp.ClientResponse:
        """The response of an attempt whose status line arrived (every attempt `_attempts` returns)."""
        if self.response is None:
            raise RuntimeError(f"the attempt at {self.replica.url} has no response yet")
        return self.response


@dataclass(slots=True)
class PassedAnswer:
    """A passthrough request's whole answer: its status, the headers a client may see, and its body."""

    status: int
    headers: dict[str, str]
    content: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def json(self) -> dict[str, Any] | None:
        """The body as a JSON object, or None."""
        return _json_or_none(self.content)

    def response(self) -> Response:
        return Response(self.content, status_code=self.status, headers=self.headers)


class _Deadline:
    """A request's total deadline (`timeouts.total`, counted from its arrival), in event-loop time."""

    def __init__(self, pool: Pool, started: float) -> None:
        self.total = pool.config.timeouts.total
        self.at = asyncio.get_running_loop().time() + self.total - (time.perf_counter() - started)
        self.cut = False  # `cut_at` closed the answer

    def left(self) -> float:
        return self.at - asyncio.get_running_loop().time()

    def cut_at(self, response: aiohttp.ClientResponse) -> asyncio.TimerHandle:
        """Close the upstream's answer when the deadline passes, wherever its relay is: a slow reader holds the relay
        in its writes, where no read's timer runs, until the kernel finds room in its socket (half of what it holds:
        seconds at hundreds of KB/s, minutes at a few). The relay cancels the handle when it ends."""

        def cut() -> None:
            self.cut = True
            response.close()

        return asyncio.get_running_loop().call_at(self.at, cut)

    def error_for(self, exc: Exception) -> GatewayError:
        """What ended a relayed answer: the deadline once it cut the answer (the read it broke says otherwise)."""
        return self.exceeded() if self.cut else _as_gateway_error(exc)

    def exceeded(self) -> GatewayError:
        return GatewayError(
            504,
            f"the request did not complete within its deadline of {self.total:g} s",
            type="upstream_error",
            code="deadline_exceeded",
        )


class Upstream:
    def __init__(
        self, tracer: Tracer, metrics: Metrics, offload: Offload, replica_header: bool = False, recording: bool = True
    ) -> None:
        """`recording`: whether any span can record (telemetry.py's `records_spans`)."""
        self._tracer = tracer
        self._trace_headers = trace_headers(recording)
        self._metrics = metrics
        self._ttft = metrics.tallies.histogram(metrics.upstream_ttft)  # by pool
        self._duration = metrics.tallies.histogram(metrics.upstream_duration)  # by pool
        self._tokens = metrics.tallies.counter(metrics.tokens)  # by pool, model, kind
        self._offload = offload  # re-encodes a big rewritten body off the event loop
        self._replica_header = replica_header

    async def forward(self, ctx: RequestContext) -> Response:
        pool, exchange = ctx.placed.pool, ctx.exchange
        local = exchange.translation.local_answer(ctx.prompt_tokens or 0)
        if local is not None:
            return self._answer_locally(ctx, exchange, local)
        strip_usage = exchange.asks_usage and _ask_for_usage(ctx, pool)
        # the request in the pool's API: the exchange's translation (a 400 where the request has none)
        encode = functools.partial(exchange.translation.request, ctx.payload, ctx.outgoing_body)
        encodes = ctx.payload_rewritten or exchange.translation.encodes_request
        big = encodes and self._offload.is_big(len(ctx.body), ctx.json_values)
        body = await self._offload.run(True, encode) if big else encode()
        deadline = _Deadline(pool, ctx.started)
        scope = asyncio.timeout_at(deadline.at)
        try:
            async with scope:
                attempt = await self._attempts(ctx, pool, exchange, body)
        except TimeoutError:
            if scope.expired():
                raise deadline.exceeded() from None
            raise
        response = attempt.answered
        ctx.replica = attempt.replica
        ctx.status = response.status
        headers = answer_headers(ctx, attempt.replica.url if self._replica_header else None)
        if ctx.stream and ctx.status == 200:
            return StreamingResponse(
                await _started(self._relay(ctx, attempt, exchange, strip_usage, deadline)),
                headers={**SSE_HEADERS, **headers},
                media_type="text/event-stream",
            )
        try:
            if ctx.status != 200:
                error = _upstream_error(ctx.status, attempt.content, response.headers.get("retry-after"))
                error.headers["x-portcullis-model"] = ctx.model
                raise _with_trigger(error, _status_trigger(ctx.status, error))
            as_answered = attempt.content
            if attempt.answer is not None:
                exchange.answers.record(ctx.usage, attempt.answer)
                if ctx.made_objects is not None:  # a stored response: the tenant's, before its id is told
                    await ctx.made_objects.answer(attempt.answer)
            if ctx.output_guard is not None:  # raises GuardBlocked (a GatewayError) on a block
                attempt.content = await ctx.output_guard.check_body(attempt.content)
            if ctx.cache_fill is not None and attempt.answer is not None:  # as the upstream said it, guard passed
                ctx.cache_fill.whole(ctx, as_answered, attempt.answer)
        finally:
            self._finish(ctx, attempt)
        media_type = response.headers.get("content-type", "application/json")
        return whole_answer(ctx, exchange, attempt.content, headers, media_type)

    def _answer_locally(self, ctx: RequestContext, exchange: Exchange, body: bytes) -> Response:
        """The answer of an exchange the gateway answers itself, from what the request's stages know (a count)."""
        ctx.status = 200
        exchange.answers.record(ctx.usage, {})
        headers = {"x-request-id": ctx.request_id, "x-portcullis-model": header_value(ctx.model)}
        return Response(body, headers=headers, media_type="application/json")

    async def _attempts(self, ctx: RequestContext, pool: Pool, exchange: Exchange, body: bytes) -> _Attempt:
        """Try candidates in order; a failure moves on only while the upstream has not answered."""
        candidates = ctx.placed.candidates[: pool.config.max_attempts]
        failure: GatewayError | None = None
        for number, replica in enumerate(candidates, start=1):
            attempt = _Attempt(
                pool=pool,
                replica=replica,
                span=self._start_span(ctx, pool, replica, number),
                sent_at=time.perf_counter(),
            )
            replica.outstanding += 1
            try:
                await self._answer(ctx, attempt, exchange, body, retry=number < len(candidates))
                return attempt
            except (aiohttp.ClientError, TimeoutError, GatewayError) as exc:
                failure = self._failed(ctx, attempt, number, exc)
            except BaseException:  # cancelled: the client left or the deadline passed
                self._drop(ctx, attempt)
                raise
        assert failure is not None
        raise failure

    async def _answer(
        self, ctx: RequestContext, attempt: _Attempt, exchange: Exchange, body: bytes, retry: bool
    ) -> None:
        """Send, and wait for the status line; read the whole body unless this is a stream that answered 200."""
        pool = attempt.pool
        response = attempt.response = await self._send(pool, ctx, exchange, attempt, body)
        status = response.status
        attempt.span.set_attribute("http.response.status_code", status)
        if status >= 400:  # the HTTP conventions' error.type for a refused call; a retry's failure names its code
            attempt.span.set_attribute("error.type", str(status))
        if retry and status in pool.config.retry_on_status:
            raise GatewayError(502, f"upstream answered {status}", type="upstream_error", code="upstream_status")
        if not (ctx.stream and status == 200):
            attempt.content = await _read_body(response, pool)
            response.release()
            self._first_chunk_arrived(ctx, attempt)
            if status == 200:
                attempt.answer = _json_or_none(attempt.content)
                if attempt.answer is None:
                    raise GatewayError(
                        502,
                        "upstream answered 200 with a body that is not a JSON object",
                        type="upstream_error",
                        code="upstream_bad_response",
                    )
        pool.record(attempt.replica, ok=status < 500)

    def _failed(self, ctx: RequestContext, attempt: _Attempt, number: int, exc: Exception) -> GatewayError:
        failure = _with_trigger(_as_gateway_error(exc), _attempt_trigger(exc))
        attempt.pool.record(attempt.replica, ok=False)
        self._metrics.upstream_errors.labels(pool=attempt.pool.name, kind=failure.code).inc()
        log.warning("upstream %s attempt %d failed: %s", attempt.replica.url, number, failure.message)
        attempt.span.set_status(Status(StatusCode.ERROR, failure.message))
        attempt.span.set_attribute("error.type", failure.code or "upstream_error")
        self._drop(ctx, attempt)
        return failure

    def _drop(self, ctx: RequestContext, attempt: _Attempt) -> None:
        """Give up on an attempt: closing (not releasing) its connection tells the upstream to stop."""
        if attempt.response is not None:
            attempt.response.close()
        self._finish(ctx, attempt)

    async def _send(
        self, pool: Pool, ctx: RequestContext, exchange: Exchange, attempt: _Attempt, body: bytes
    ) -> aiohttp.ClientResponse:
        headers = {
            "content-type": "application/json",
            "accept": "text/event-stream" if ctx.stream else "application/json",
            **_pool_headers(pool, ctx, attempt.span, self._trace_headers),
        }
        url = attempt.replica.url + exchange.path
        try:
            return await pool.session.post(url, data=body, headers=headers)
        except aiohttp.ClientConnectorError:
            raise  # no connection was made: the replica's failure
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # Closed unanswered on a connection that was made: above all a pooled one the upstream let go idle just
            # as this request went out on it (an idle timeout racing the gateway's keepalive), which says nothing of
            # the replica. Sent again once, on a new connection, as aiohttp does for idempotent methods (RFC 9112,
            # 9.3.1), before it counts as the replica's failure.
            return await pool.session.post(url, data=body, headers=headers)

    async def pass_through(self, ctx: RequestContext, pool: Pool) -> Response:
        """A passthrough route: the request to the pool's first available replica as it came (method, path, query,
        body, content type), no retry (a file upload is not idempotent); the answer back as it comes, within the
        pool's response-size and idle bounds and the request's deadline."""
        attempt, deadline = await self._pass(ctx, pool)
        response = attempt.answered
        return StreamingResponse(
            await _started(self._relay_raw(ctx, attempt, deadline)),
            status_code=response.status,
            headers=_passed_headers(ctx, response),
        )

    async def pass_through_whole(
        self,
        ctx: RequestContext,
        pool: Pool,
        *,
        method: str | None = None,
        path: str | None = None,
        query: str | None = None,
        body: bytes | None = None,
    ) -> PassedAnswer:
        """A passthrough request whose answer the gateway reads before the client hears it (the id of an object
        made, a list page to filter), read whole within the pool's `max_response_bytes` and the request's deadline.
        `method`, `path`, `query` and `body` replace the request's own (a list's next page, a create undone)."""
        attempt, deadline = await self._pass(ctx, pool, method, path, query, body)
        response = attempt.answered
        complete = False
        try:
            async with asyncio.timeout_at(deadline.at):
                content = await _read_body(response, pool)
            complete = True
        except TimeoutError:
            raise deadline.exceeded() from None
        except aiohttp.ClientError as exc:
            raise _as_gateway_error(exc) from None
        finally:
            if complete:
                response.release()
            else:
                response.close()
            self._finish(ctx, attempt)
        return PassedAnswer(response.status, _passed_headers(ctx, response), content)

    async def _pass(
        self,
        ctx: RequestContext,
        pool: Pool,
        method: str | None = None,
        path: str | None = None,
        query: str | None = None,
        body: bytes | None = None,
    ) -> tuple[_Attempt, _Deadline]:
        """Send a passthrough request and wait for its status line: the attempt, answered, and the deadline its
        answer is read within."""
        scope = ctx.request.scope
        replica = pool.rank(pool.request_shape(0, 0, None)).replicas[0]
        attempt = _Attempt(pool, replica, self._start_span(ctx, pool, replica, 1), time.perf_counter())
        replica.outstanding += 1
        headers = {
            k: v
            for k, v in ctx.request.headers.items()
            if k in _PASSED_HEADERS and not (body is not None and k == "content-type")  # not the body it describes
        }
        headers.update(_pool_headers(pool, ctx, attempt.span, self._trace_headers))
        if query is None:
            query = (scope.get("query_string") or b"").decode("latin-1")
        url = replica.url + (path or scope["path"]) + ("?" + query if query else "")
        deadline = _Deadline(pool, ctx.started)
        try:
            async with asyncio.timeout_at(deadline.at):
                attempt.response = await pool.session.request(
                    method or scope["method"], url, data=ctx.body if body is None else body, headers=headers
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed(ctx, attempt, 1, exc) from None
        except BaseException:
            self._drop(ctx, attempt)
            raise
        ctx.replica, ctx.status = replica, attempt.response.status
        pool.record(replica, ok=attempt.response.status < 500)
        return attempt, deadline

    async def _relay_raw(
        self, ctx: RequestContext, attempt: _Attempt, deadline: _Deadline
    ) -> AsyncGenerator[bytes, None]:
        """A passthrough answer's bytes as they come; cut (connection closed, logged) past the size bound or a
        silence, since its format is not the gateway's to end with an error event."""
        config, response = attempt.pool.config, attempt.answered
        sent, complete = 0, False
        cutter = deadline.cut_at(response)
        try:
            yield b""  # the step `_started` takes
            while chunk := await _next_bytes(response.content, config.timeouts.stream_idle, deadline):
                sent += len(chunk)
                if sent > config.max_response_bytes:
                    raise _too_large(config.max_response_bytes)
                yield chunk
            if deadline.cut:  # the end the closed answer reads as
                raise deadline.exceeded()
            complete = True
        except (aiohttp.ClientError, TimeoutError, GatewayError) as exc:
            error = deadline.error_for(exc)
            ctx.stream_error = error.code
            log.warning("passthrough answer from %s cut: %s", attempt.replica.url, error.message)
        finally:
            cutter.cancel()
            if complete:
                response.release()
            else:
                response.close()
            self._finish(ctx, attempt)

    def _start_span(self, ctx: RequestContext, pool: Pool, replica: Replica, number: int) -> Span:
        """The attempt's client span. A request that is not sampled has no recorded children either: its attempts
        carry the request span's context (the traceparent the upstream gets) and cost no span or attributes."""
        if not ctx.span.is_recording():
            return NonRecordingSpan(ctx.span.get_span_context())
        host, port = replica.address
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": ctx.operation,
            "gen_ai.provider.name": pool.config.api,  # the API the gateway speaks to it (see
            # gateway/observability/telemetry.py)
            "gen_ai.request.model": ctx.model,
            "gen_ai.request.stream": ctx.stream,
            "server.address": host,
            "server.port": port,
            "portcullis.pool": pool.name,
            "portcullis.attempt": number,
        }
        if ctx.fallback_from is not None:  # a fallback step's attempt: the model and pool above are the target's
            attributes["portcullis.fallback.step"] = ctx.fallback_step
            attributes["portcullis.fallback.from"] = ctx.fallback_from
        limit = next((ctx.payload[f] for f in ctx.api.output_fields if isinstance(ctx.payload.get(f), int)), None)
        if limit is not None:  # whichever field of its shape bounds the output (max_output_tokens, max_tokens...)
            attributes["gen_ai.request.max_tokens"] = limit
        for key, attr in (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p")):
            if isinstance(ctx.payload.get(key), (int, float)):
                attributes[attr] = ctx.payload[key]
        return self._tracer.start_span(f"{ctx.operation} {ctx.model}", kind=SpanKind.CLIENT, attributes=attributes)

    def _first_chunk_arrived(self, ctx: RequestContext, attempt: _Attempt) -> None:
        ttft = time.perf_counter() - attempt.sent_at
        if ctx.stream:  # the spec's attribute is a streaming answer's
            attempt.span.set_attribute(TIME_TO_FIRST_CHUNK, ttft)
        self._ttft(attempt.pool.name).observe(ttft)

    async def _relay(
        self, ctx: RequestContext, attempt: _Attempt, exchange: Exchange, strip_usage: bool, deadline: _Deadline
    ) -> AsyncGenerator[bytes, None]:
        config, response = attempt.pool.config, attempt.answered
        framer = EventFramer(config.max_event_bytes)
        translation = exchange.translation.stream(ctx.payload, ctx.model)
        fill = ctx.cache_fill
        saw_done = False
        idle: float | None = None  # the wait for the first chunk is `timeouts.read`'s (a long prefill)
        settled = False
        cutter = deadline.cut_at(response)

        def settle() -> None:
            """Let the upstream go and close the attempt's books, once: before an error event is written (a slow
            reader would hold the upstream connection and the replica's count until it read that far), or at the end."""
            nonlocal settled
            if not settled:
                settled = True
                if saw_done:
                    response.release()  # complete: the connection goes back to the pool
                else:
                    response.close()  # broken or abandoned: drop the connection, so the upstream stops
                cutter.cancel()
                self._finish(ctx, attempt)

        try:
            yield b""  # the step `_started` takes
            while chunk := await _next_bytes(response.content, idle, deadline):
                if idle is None:
                    self._first_chunk_arrived(ctx, attempt)
                    idle = config.timeouts.stream_idle
                out = []
                events, malformed = _read_events(exchange.answers, framer.feed(chunk))
                for event, data, parsed in events:
                    if data is None:
                        out.append(event)
                        continue
                    saw_done = saw_done or exchange.answers.ends(data, parsed)
                    if parsed is not None and fill is not None:
                        fill.event(parsed, len(data))
                    if parsed is not None and ctx.made_objects is not None:
                        await ctx.made_objects.event(parsed)  # before the event that tells the id goes out
                    if parsed is None or self._inspect_event(ctx, exchange, parsed, strip_usage):
                        out.append(event)
                if ctx.usage.generated:  # the first output token came: routing stops counting this prefill
                    ctx.placed.kv_hold.prefill_done()
                if ctx.output_guard is not None:  # holds events back until scanned; raises GuardBlocked
                    out = await ctx.output_guard.feed(out)
                if translation is not None:
                    out = translation.feed(out)
                if saw_done and malformed is None and fill is not None and ctx.stream_error is None:
                    fill.stream_ended(ctx)  # whole, unblocked, no error event: stored before its end is sent
                    fill = None
                if out:
                    yield b"".join(out)
                if malformed is not None:
                    raise malformed
            if not saw_done and ctx.stream_error != "upstream_error_event":  # its error event already ended it
                raise GatewayError(
                    502,
                    "upstream closed the stream before it was complete",
                    type="upstream_error",
                    code="upstream_stream_truncated",
                )
        except (aiohttp.ClientError, TimeoutError, GatewayError, EventTooLarge, MalformedEvent) as exc:
            error = deadline.error_for(exc)
            ctx.stream_error = error.code
            log.warning("upstream %s stream ended early: %s", attempt.replica.url, error.message)
            attempt.span.set_status(Status(StatusCode.ERROR, error.message))
            attempt.span.set_attribute("error.type", error.code or "upstream_error")
            settle()
            yield ctx.api.stream_error(error)
        except Exception:  # a defect of the gateway's own: the client still hears the stream end, in its shape
            log.exception("relaying %s's stream failed (request id %s)", attempt.replica.url, ctx.request_id)
            ctx.stream_error = "internal_error"
            attempt.span.set_status(Status(StatusCode.ERROR, "internal_error"))
            settle()
            yield ctx.api.stream_error(internal_error())
        except BaseException:  # GeneratorExit or cancellation: the client left, or its answer was closed early
            if ctx.stream_error is None:
                ctx.stream_error = "client_disconnected"
                log.info("client disconnected mid-stream (request id %s)", ctx.request_id)
            raise
        finally:
            settle()

    def _inspect_event(self, ctx: RequestContext, exchange: Exchange, chunk: dict[str, Any], strip_usage: bool) -> bool:
        """Record usage and finish reasons from one event; False drops a usage chunk the client did not ask for.
        An upstream's error event is read for usage too: Responses' `response.failed` reports what the failed
        attempt used, which is what the request is charged."""
        exchange.answers.record(ctx.usage, chunk)
        if exchange.answers.is_error(chunk):
            ctx.stream_error = "upstream_error_event"
            return True
        return not (strip_usage and chunk.get("usage") and not chunk.get("choices"))

    def _finish(self, ctx: RequestContext, attempt: _Attempt) -> None:
        """Close the books on one attempt: in-flight count, duration, usage on the span, and the span itself."""
        pool_name = attempt.pool.name
        attempt.replica.outstanding -= 1
        self._duration(pool_name).observe(time.perf_counter() - attempt.sent_at)
        span, usage = attempt.span, ctx.usage
        if ctx.replica is attempt.replica:
            # counted as the upstream reported them, if they are counts (a counter cannot go back)
            if (prompt := token_count(usage.prompt_tokens)) is not None:
                self._tokens(pool_name, self._metrics.model_label(ctx.model), "prompt").inc(prompt)
            if (completion := token_count(usage.completion_tokens)) is not None:
                self._tokens(pool_name, self._metrics.model_label(ctx.model), "completion").inc(completion)
            if span.is_recording():
                span.set_attributes(response_attributes(usage))
        span.end()


async def _started(relay: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """A relay run to its first `yield`, inside the `try` whose `finally` closes the upstream answer and the attempt's
    books. An async generator closed before its first step runs none of its code: a client gone before its answer's
    body began (its headers could not even be sent) left the upstream answer open and the replica's in-flight count
    up for good."""
    await anext(relay)
    return relay


def answer_headers(ctx: RequestContext, replica: str | None = None) -> dict[str, str]:
    """The headers of a model route's answer: the request id, the model that served it, what the stages added
    (`replica`: the replica's URL, where `telemetry.replica_header` asks for it), each rendered safe but the request
    id, 32 hex digits the gateway makes (gateway/context.py), a valid value as made."""
    headers = {"x-request-id": ctx.request_id, "x-portcullis-model": header_value(ctx.model)}
    if ctx.response_headers:
        headers.update(rendered(ctx.response_headers))
    if replica is not None:
        headers["x-portcullis-replica"] = header_value(replica)
    return headers


def whole_answer(
    ctx: RequestContext, exchange: Exchange, content: bytes, headers: dict[str, str], media_type: str
) -> Response:
    """A non-streamed 200 as the client gets it: the upstream's answer in the client's API (the exchange's
    translation)."""
    translation = exchange.translation
    content = translation.answer(content, ctx.payload, ctx.model)
    return Response(content, status_code=200, headers=headers, media_type=translation.media_type(media_type))


def _passed_headers(ctx: RequestContext, response: aiohttp.ClientResponse) -> dict[str, str]:
    """A passthrough answer's headers for the client: the upstream's that describe the body, and the gateway's."""
    kept = {k: v for k, v in response.headers.items() if k.lower() in _RETURNED_HEADERS}
    return rendered({**kept, "x-request-id": ctx.request_id, **ctx.response_headers})


def _ask_for_usage(ctx: RequestContext, pool: Pool) -> bool:
    """Ask a stream for its final usage chunk where the pool wants it and the client did not: True when the gateway
    asked, so the relay strips that chunk from what the client gets."""
    if ctx.usage_asked:  # on a pool tried before this one (fallbacks): still the gateway's ask, not the client's
        return True
    options = ctx.payload.get("stream_options") or {}
    if not (ctx.stream and pool.config.include_usage) or options.get("include_usage"):
        return False
    ctx.payload["stream_options"] = {**options, "include_usage": True}
    ctx.payload_rewritten = ctx.usage_asked = True
    return True


def _pool_headers(pool: Pool, ctx: RequestContext, span: Span, trace: TraceHeaders) -> dict[str, str]:
    """What every request to a pool carries: the pool's credentials for the tenant (its own key, else the pool's) in
    its API's way, the request id, the trace (`span`'s, written by `trace`)."""
    api_key = pool.api_key_for(ctx.tenant)
    headers = {
        "accept-encoding": "identity",
        "x-request-id": ctx.request_id,
        **POOL_APIS[pool.config.api].headers(pool.config, api_key, ctx.request.headers),
    }
    trace(headers, span)
    return headers


def _read_events(
    answers: AnswerFormat, events: list[bytes]
) -> tuple[list[tuple[bytes, bytes | None, dict[str, Any] | None]], MalformedEvent | None]:
    """A chunk's events as the route's format reads them (each with its data and that data parsed), up to the first
    that is none of its events: that one and any after it are never relayed, and the error says why. The events
    before it go out as any others: the client hears what the upstream said well, then the error."""
    read: list[tuple[bytes, bytes | None, dict[str, Any] | None]] = []
    for event in events:
        try:
            name, data = read_event(event)
        except MalformedEvent as exc:
            return read, exc
        parsed = None if data is None else _json_or_none(data)
        if data is not None and not answers.is_event(name, data, parsed):
            return read, MalformedEvent("an upstream event's data is none of the events of the route's stream format")
        read.append((event, data, parsed))
    return read, None


async def _read_body(response: aiohttp.ClientResponse, pool: Pool) -> bytes:
    """A whole answer, read as it arrives and given up on past the pool's `max_response_bytes`."""
    limit = pool.config.max_response_bytes
    length = response.content_length
    if (length or 0) > limit:
        raise _too_large(limit)
    body = bytearray()
    idle: float | None = None  # until the first byte, `timeouts.read` governs
    while chunk := await _next_bytes(response.content, idle):
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
        if len(body) == length:  # all it announced: no second read (and timer) just to see the end
            break
        idle = pool.config.timeouts.stream_idle
    return bytes(body)


def _too_large(limit: int) -> GatewayError:
    return GatewayError(
        502,
        f"the upstream's answer exceeded {limit} bytes (the pool's max_response_bytes)",
        type="upstream_error",
        code="upstream_response_too_large",
    )


async def _next_bytes(content: aiohttp.StreamReader, idle: float | None, deadline: _Deadline | None = None) -> bytes:
    """The next bytes of an answer (b"" at its end), within `idle` seconds and the request's deadline (checked before
    the read too: a slow client keeps the upstream's bytes waiting, so the read itself may never have to wait)."""
    left = deadline.left() if deadline else None
    if deadline is not None and (deadline.cut or (left is not None and left <= 0)):
        raise deadline.exceeded()
    if idle is None and left is None:
        return await content.readany()
    # which limit sets the timer is decided now: timers may fire a little early, so `left()` after it can be > 0
    by_deadline = left is not None and (idle is None or left <= idle)
    scope = asyncio.timeout(left if by_deadline else idle)
    try:
        async with scope:
            return await content.readany()
    except TimeoutError:
        if not scope.expired():
            raise  # aiohttp's own read timeout
        if by_deadline and deadline is not None:
            raise deadline.exceeded() from None
        raise GatewayError(
            504, f"upstream sent nothing for {idle:g} s", type="upstream_error", code="upstream_stream_idle"
        ) from None


def _upstream_error(status: int, content: bytes, retry_after: str | None = None) -> GatewayError:
    """An upstream's non-200 answer: its own message and type where it sent an OpenAI- or Anthropic-style error (with
    its status if a 4xx, 502-504 or 529, and its Retry-After), otherwise a 502 that names the status (the body may
    be an HTML page: not passed on)."""
    error = (_json_or_none(content) or {}).get("error")
    if status in _GATEWAY_CREDENTIAL_STATUSES:
        # about the pool's own key, not the client's: its message may quote part of that key, so it stays in the log
        log.warning(
            "upstream refused the pool's credentials (%d): %.300s",
            status,
            error.get("message") if isinstance(error, dict) else content[:300],
        )
        return GatewayError(
            502,
            f"upstream refused the gateway's credentials ({status})",
            type="upstream_error",
            code="upstream_auth_failed",
        )
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        kept = status if 400 <= status < 500 or status in _KEPT_5XX else 502
        return GatewayError(
            kept,
            error["message"][:_MAX_MESSAGE_CHARS],
            type=_text(error.get("type")) or "upstream_error",
            code=_text(error.get("code")),
            param=_text(error.get("param")),
            headers={"retry-after": retry_after}
            if retry_after and retry_after.isascii() and retry_after.isdigit()
            else None,
        )
    return GatewayError(
        502,
        f"upstream answered {status} without an OpenAI-style error",
        type="upstream_error",
        code="upstream_bad_response",
    )


def _with_trigger(error: GatewayError, trigger: FallbackTrigger | None) -> GatewayError:
    return error if trigger is None else PoolFailed(error, trigger)


def _attempt_trigger(exc: Exception) -> FallbackTrigger | None:
    """The fallback trigger a failed attempt is: a timeout (connect, read, a body that stalled), or a connection the
    upstream refused or dropped; None for the rest (an answer the gateway cannot use is not the pool being down)."""
    if isinstance(exc, TimeoutError) or (isinstance(exc, GatewayError) and exc.code == "upstream_stream_idle"):
        return "timeout"
    if isinstance(exc, aiohttp.ClientError):
        return "connection_error"
    return None


def _status_trigger(status: int, error: GatewayError) -> FallbackTrigger | None:
    """The fallback trigger an upstream's error answer is, by its own status and (a 400) its OpenAI-style code."""
    if status == 429:
        return "429"
    if status >= 500:
        return "5xx"
    return "context_length_exceeded" if status == 400 and error.code == "context_length_exceeded" else None


def _text(value: Any) -> str | None:
    """A string field of an upstream error; some servers send numeric codes."""
    if isinstance(value, str):
        return value[:_MAX_MESSAGE_CHARS]
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _json_or_none(data: bytes) -> dict[str, Any] | None:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:  # also invalid UTF-8 and nesting too deep
        return None
    return value if isinstance(value, dict) else None


def _as_gateway_error(exc: Exception) -> GatewayError:
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, EventTooLarge):
        return GatewayError(
            502, f"{exc} (the pool's max_event_bytes)", type="upstream_error", code="upstream_event_too_large"
        )
    if isinstance(exc, MalformedEvent):
        return GatewayError(502, f"{exc}: the stream ends there", type="upstream_error", code="upstream_bad_event")
    if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors too
        return GatewayError(
            504, f"upstream timed out ({type(exc).__name__})", type="upstream_error", code="upstream_timeout"
        )
    return GatewayError(
        502,
        f"upstream unreachable or failed ({type(exc).__name__})",
        type="upstream_error",
        code="upstream_unavailable",
    )
