"""OpenAI-compatible HTTP server for the engine (Starlette): the routes.

Routes: /v1/chat/completions, /v1/completions and /v1/responses (SSE streaming or not),
/v1/embeddings (the sentence-embedding model where there is one, or the chat model by its name),
/v1/models, /tokenize, /detokenize, /health, /metrics (vLLM metric names),
/v1/kv_events (NDJSON stream of prefix-cache block events), /reset_prefix_cache. Bodies are parsed
and shaped by `openai_protocol`; errors use OpenAI's JSON shape.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backend_engine import tracing
from backend_engine.async_engine import AsyncEngine, ChoiceOutputs
from backend_engine.embedding.encoder import SentenceEncoder
from backend_engine.embedding.worker import EncoderWorker
from backend_engine.engine import LLMEngine, RequestOutput
from backend_engine.http.openai_protocol.embeddings import embedding_response, parse_embedding_request
from backend_engine.http.openai_protocol.errors import APIError
from backend_engine.http.openai_protocol.requests import RequestParser
from backend_engine.http.openai_protocol.responses import ResponseShaper
from backend_engine.http.openai_protocol.responses_api import (
    ResponseDraft,
    final_response,
    parse_responses_request,
    response_events,
)
from backend_engine.http.streaming import (
    ClosingStreamingResponse,
    collect_or_disconnect,
    generation_error,
    until_disconnect,
)
from backend_engine.kv_events import KVEventBus
from gateway.edge.lingering_close import LingeringCloseProtocol

# /v1/kv_events' heartbeat, in seconds: a zero or tiny one would have the stream write heartbeats in a tight loop
MIN_HEARTBEAT = 0.1
MAX_HEARTBEAT = 3600.0


class EngineServer:
    """Holds the engine and builds the Starlette app around it."""

    def __init__(self, engine: LLMEngine, served_model_name: str | None = None, encoder: SentenceEncoder | None = None):
        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.encoder = EncoderWorker(encoder) if encoder is not None else None
        self.model_name = served_model_name or engine.config.served_model_name
        self.parser = RequestParser(engine, self.model_name)
        self.shaper = ResponseShaper(self.model_name, engine.tokenizer)
        self.kv_bus = KVEventBus(engine.config.block_size)
        engine.kv_event_sink = self.kv_bus.publish
        self.created = int(time.time())

    # --- lifecycle ----------------------------------------------------------------------------

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.async_engine.start()
        try:
            yield
        finally:
            self.async_engine.stop()
            if self.encoder is not None:
                self.encoder.close()

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/kv_events", self.kv_events, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
        ]
        return Starlette(
            routes=routes,
            lifespan=self.lifespan,
            exception_handlers={404: self._not_found, 405: self._method_not_allowed},
        )

    async def _not_found(self, request: Request, exc: Exception) -> JSONResponse:
        return APIError(404, f"no route {request.url.path}", "not_found_error", "not_found").response()

    async def _method_not_allowed(self, request: Request, exc: Exception) -> JSONResponse:
        return APIError(
            405, f"method {request.method} not allowed", "invalid_request_error", "method_not_allowed"
        ).response()

    # --- simple routes ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not self.async_engine.alive:
            return JSONResponse({"status": "error", "error": "engine thread not running"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: Request) -> Response:
        served = [(self.model_name, self.engine.loaded.source, self.engine.max_model_len)]
        if self.encoder is not None:
            encoder = self.encoder.encoder
            served.append((encoder.name, encoder.source, encoder.max_tokens))
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "portcullis",
                        "root": source,
                        "max_model_len": max_len,
                    }
                    for name, source, max_len in served
                ],
            }
        )

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, request: Request) -> Response:
        self.async_engine.reset_prefix_cache()
        return JSONResponse({"status": "ok"})

    async def tokenize(self, request: Request) -> Response:
        try:
            # off the event loop, as every body that is rendered or tokenized: /tokenize takes any length of text
            ids = await run_in_threadpool(self.parser.tokenize_ids, await self.parser.body(request))
        except APIError as e:
            return e.response()
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        try:
            # off the event loop, as /tokenize: checking and decoding 10 million ids there held every stream for 3 s
            text = await run_in_threadpool(self.parser.detokenize, await self.parser.body(request))
        except APIError as e:
            return e.response()
        # orjson: json.dumps holds the interpreter lock (and so the event loop) 8x as long over the same text
        return Response(orjson.dumps({"prompt": text}), media_type="application/json")

    async def kv_events(self, request: Request) -> Response:
        """NDJSON: one line per batch {"seq", "ts", "events": [...]}; the first is a snapshot."""
        try:
            heartbeat = float(request.query_params.get("heartbeat", "15"))
        except ValueError:
            heartbeat = math.nan
        if not MIN_HEARTBEAT <= heartbeat <= MAX_HEARTBEAT:  # also false for NaN
            message = f"heartbeat must be a number of seconds from {MIN_HEARTBEAT:g} to {MAX_HEARTBEAT:g}"
            return APIError(400, message, param="heartbeat").response()

        async def lines() -> AsyncIterator[bytes]:
            async with aclosing(self.kv_bus.batches(heartbeat)) as batches:
                async for batch in batches:
                    yield (json.dumps(batch) + "\n").encode()

        return ClosingStreamingResponse(lines(), media_type="application/x-ndjson")

    # --- generation ---------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            # off the event loop: rendering a chat of a million messages, or tokenizing 64 prompts, took seconds there,
            # and every other request (and /health) waited for it
            req = await run_in_threadpool(self.parser.generation, await self.parser.body(request), chat)
        except APIError as e:
            return e.response()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        outputs = self.async_engine.generate(
            req.jobs, request_id=rid, cache_salt=req.cache_salt, trace_context=tracing.extract_context(request.headers)
        )
        num_choices = len(req.jobs)
        return await self._reply(
            request,
            rid,
            outputs,
            num_choices,
            self.shaper.sse(outputs, num_choices, req.n, rid, chat, req.include_usage) if req.stream else None,
            lambda outs: self.shaper.final_body(outs, req.n, rid, chat),
        )

    async def responses(self, request: Request) -> Response:
        try:
            req = await run_in_threadpool(parse_responses_request, await self.parser.body(request), self.parser)
        except APIError as e:
            return e.response()
        draft = ResponseDraft(self.model_name, req.echo)
        outputs = self.async_engine.generate(
            [(req.prompt_token_ids, req.params)],
            request_id=draft.id,
            trace_context=tracing.extract_context(request.headers),
        )
        return await self._reply(
            request,
            draft.id,
            outputs,
            1,
            response_events(draft, outputs) if req.stream else None,
            lambda outs: final_response(draft, outs[0]),
        )

    async def _reply(
        self,
        request: Request,
        rid: str,
        outputs: AsyncGenerator[ChoiceOutputs, None],
        num_choices: int,
        stream: AsyncIterator[bytes] | None,
        final_body: Callable[[list[list[RequestOutput]]], dict[str, Any]],
    ) -> Response:
        """The SSE `stream` when there is one, else `final_body` of every choice's outputs once all finish."""
        headers = {"x-request-id": request.headers.get("x-request-id", rid)}
        if stream is not None:
            return ClosingStreamingResponse(stream, media_type="text/event-stream", headers=headers)
        try:
            outs = await collect_or_disconnect(request, outputs, num_choices)
        except APIError as e:
            return e.response()
        if outs is None:  # client went away: the sequences were aborted
            return Response(status_code=499)
        return JSONResponse(final_body(outs), headers=headers)

    async def embeddings(self, request: Request) -> Response:
        try:
            # tokenizing up to 2048 inputs: off the event loop
            encoder = self.encoder.encoder if self.encoder is not None else None
            req = await run_in_threadpool(
                parse_embedding_request, await self.parser.body(request), self.parser, encoder
            )
            embedder = self.encoder if req.encoder is not None else None
            work = embedder.embed(req.inputs) if embedder is not None else self.async_engine.embed(req.inputs)
            pooled = await until_disconnect(request, work)
        except Exception as e:  # noqa: BLE001 - every failure gets OpenAI's error shape
            return generation_error(e).response()
        if pooled is None:  # client went away: the groups not yet run were dropped
            return Response(status_code=499)
        return JSONResponse(embedding_response(req, pooled))


def build_app(
    engine: LLMEngine, served_model_name: str | None = None, encoder: SentenceEncoder | None = None
) -> Starlette:
    return EngineServer(engine, served_model_name, encoder).app()


class _QuietProbes(logging.Filter):
    """Leaves out uvicorn's access lines for health checks and metric scrapes: a gateway scrapes every replica each
    second, and those lines buried the requests' own in `portcullis up`'s output."""

    PATHS = frozenset({"/health", "/metrics"})

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) > 2 and args[2] in self.PATHS)


_QUIET_PROBES = _QuietProbes()


def http_server(app: Starlette, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> uvicorn.Server:
    """The app under uvicorn, as `portcullis engine serve` runs it (and the tests that serve it): uvicorn's httptools
    protocol whose close lingers while the client may still be sending (gateway/edge/lingering_close.py), so a 408 or
    413 answered before the body's end reaches the client instead of a reset."""
    access = logging.getLogger("uvicorn.access")
    if _QUIET_PROBES not in access.filters:
        access.addFilter(_QUIET_PROBES)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=LingeringCloseProtocol,
        log_level=log_level,
        log_config=None,  # uvicorn's lines go through the root logger, in the format the CLI chose
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)
