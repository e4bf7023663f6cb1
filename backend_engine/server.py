"""OpenAI-compatible HTTP server for the engine (Starlette).

Routes: /v1/chat/completions and /v1/completions (SSE streaming or not), /v1/models, /tokenize,
/detokenize, /health, /metrics (vLLM metric names), /v1/kv_events (NDJSON stream of prefix-cache
block events), /reset_prefix_cache. Errors use OpenAI's JSON shape; a stream that breaks ends
with an SSE error event and then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from backend_engine import tracing
from backend_engine.async_engine import AsyncEngine
from backend_engine.engine import LLMEngine, RequestOutput
from backend_engine.kv_events import KVEventBus
from backend_engine.model.prompt import PromptError
from backend_engine.sequence import SamplingParams, TokenLogprob

log = logging.getLogger("portcullis.engine.server")
MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # prompts x n per request


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code or str(self.status),
            }
        }


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends, so a client disconnect aborts the
    sequence immediately (instead of whenever the abandoned generator is garbage-collected)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


# --- request parsing -----------------------------------------------------------------------------

_MISSING = object()


def _field(body: dict, key: str, types: type | tuple, default: Any = None) -> Any:
    v = body.get(key, _MISSING)
    if v is _MISSING or v is None:
        return default
    if types is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if not isinstance(v, types) or (isinstance(v, bool) and types in (int, float)):
        names = types.__name__ if isinstance(types, type) else "/".join(t.__name__ for t in types)
        raise APIError(400, f"'{key}' must be of type {names}", param=key, code="invalid_type")
    return v


def _sampling_params(body: dict, max_tokens_default: int, chat: bool) -> SamplingParams:
    if _field(body, "best_of", int, 1) not in (1,):
        raise APIError(400, "best_of is not supported", param="best_of")
    for k in ("presence_penalty", "frequency_penalty"):
        if _field(body, k, float, 0.0) != 0.0:
            raise APIError(400, f"{k} is not supported by this engine", param=k)
    if _field(body, "echo", bool, False):
        raise APIError(400, "echo is not supported", param="echo")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    stop_ids = _field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) for t in stop_ids):
        raise APIError(400, "'stop_token_ids' must be a list of integers", param="stop_token_ids")
    if chat:
        want = _field(body, "logprobs", bool, False)
        top = _field(body, "top_logprobs", int, 0 if want else None)
        if top is not None and not want:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        logprobs = top if want else None
        max_tokens = _field(body, "max_completion_tokens", int, None) or _field(body, "max_tokens", int, None)
    else:
        logprobs = _field(body, "logprobs", int, None)
        max_tokens = _field(body, "max_tokens", int, None)
    sp = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=_field(body, "temperature", float, 1.0),
        top_p=_field(body, "top_p", float, 1.0),
        top_k=_field(body, "top_k", int, 0),
        seed=_field(body, "seed", int, None),
        stop=stop,
        stop_token_ids=stop_ids,
        ignore_eos=_field(body, "ignore_eos", bool, False),
        logprobs=logprobs,
        skip_special_tokens=_field(body, "skip_special_tokens", bool, True),
        include_stop_str_in_output=_field(body, "include_stop_str_in_output", bool, False),
    )
    return sp


class EngineServer:
    """Holds the engine and builds the Starlette app around it."""

    def __init__(self, engine: LLMEngine, served_model_name: str | None = None):
        self.engine = engine
        self.renderer = engine.loaded.renderer
        self.async_engine = AsyncEngine(engine)
        self.model_name = served_model_name or engine.config.served_model_name
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
        ]
        return Starlette(
            routes=routes,
            lifespan=self.lifespan,
            exception_handlers={404: self._not_found, 405: self._method_not_allowed},
        )

    async def _not_found(self, request: Request, exc: Exception) -> JSONResponse:
        return _error_response(APIError(404, f"no route {request.url.path}", "not_found_error", "not_found"))

    async def _method_not_allowed(self, request: Request, exc: Exception) -> JSONResponse:
        return _error_response(
            APIError(405, f"method {request.method} not allowed", "invalid_request_error", "method_not_allowed")
        )

    # --- simple routes ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if not self.async_engine.alive:
            return JSONResponse({"status": "error", "error": "engine thread not running"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "portcullis",
                        "root": self.engine.loaded.source,
                        "max_model_len": self.engine.max_model_len,
                    }
                ],
            }
        )

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, request: Request) -> Response:
        self.async_engine.reset_prefix_cache()
        return JSONResponse({"status": "ok"})

    async def _json(self, request: Request) -> dict:
        try:
            body = await request.json()
        except Exception:
            raise APIError(400, "request body must be valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        return body

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "not_found_error", "model_not_found", "model")

    def _render_chat(self, body: dict) -> list[int]:
        try:
            return self.renderer.chat_ids(
                body.get("messages"),
                add_generation_prompt=_field(body, "add_generation_prompt", bool, True),
                **(_field(body, "chat_template_kwargs", dict, {}) or {}),
            )
        except PromptError as e:
            raise APIError(400, str(e), param=e.param) from None

    def _prompt_list(self, body: dict) -> list[list[int]]:
        """A completions prompt: text, token ids, or a batch (list) of either."""
        prompt = body.get("prompt")

        def one(p: Any) -> list[int]:
            if isinstance(p, str):
                return self.engine.tokenizer.encode(p)
            if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                return list(p)
            raise APIError(400, "'prompt' must be text, token ids, or a list of either", param="prompt")

        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return [one(p) for p in prompt]
        return [one(prompt)]

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            self._check_model(body)
            if "messages" in body:
                ids = self._render_chat(body)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise APIError(400, "'prompt' must be a string", param="prompt")
                ids = self.engine.tokenizer.encode(prompt, add_bos=_field(body, "add_special_tokens", bool, None))
        except APIError as e:
            return _error_response(e)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._json(request)
            ids = body.get("tokens")
            vs = self.engine.tokenizer.vocab_size
            if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vs for t in ids):
                raise APIError(400, "'tokens' must be a list of valid token ids", param="tokens")
        except APIError as e:
            return _error_response(e)
        return JSONResponse({"prompt": self.engine.tokenizer.decode(ids, skip_special_tokens=False)})

    async def kv_events(self, request: Request) -> Response:
        """NDJSON: one line per batch {"seq", "ts", "events": [...]}; the first is a snapshot."""
        try:
            heartbeat = float(request.query_params.get("heartbeat", "15"))
        except ValueError:
            return _error_response(APIError(400, "heartbeat must be a number of seconds", param="heartbeat"))
        q, snapshot = self.kv_bus.subscribe()

        async def lines() -> AsyncIterator[bytes]:
            last = snapshot["seq"]
            try:
                yield (json.dumps(snapshot) + "\n").encode()
                while True:
                    try:
                        batch = await asyncio.wait_for(q.get(), timeout=heartbeat)
                    except TimeoutError:
                        yield (
                            json.dumps({"seq": last, "ts": time.time(), "heartbeat": True, "events": []}) + "\n"
                        ).encode()
                        continue
                    if batch["seq"] <= last:
                        continue  # already covered by the snapshot
                    last = batch["seq"]
                    yield (json.dumps(batch) + "\n").encode()
            finally:
                self.kv_bus.unsubscribe(q)

        return ClosingStreamingResponse(lines(), media_type="application/x-ndjson")

    # --- generation ---------------------------------------------------------------------------

    def _prepare(self, body: dict, chat: bool) -> list[tuple[list[int], SamplingParams]]:
        """One (prompt ids, params) job per choice: prompts x n, in OpenAI's choice order."""
        self._check_model(body)
        prompts = [self._render_chat(body)] if chat else self._prompt_list(body)
        n = _field(body, "n", int, 1)
        if not 1 <= n <= MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}", param="n")
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(400, f"at most {MAX_CHOICES} choices (prompts x n) per request", param="prompt")
        jobs = []
        for ids in prompts:
            room = self.engine.max_model_len - len(ids)
            sp = _sampling_params(body, max(room, 1) if chat else 16, chat)
            if len(ids) + sp.max_tokens > self.engine.max_model_len and (
                body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
            ):
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.engine.max_model_len} tokens. "
                    f"However, you requested {len(ids) + sp.max_tokens} tokens ({len(ids)} in the "
                    f"prompt, {sp.max_tokens} for the completion).",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            try:
                self.engine.validate(ids, sp)
            except ValueError as e:
                raise APIError(400, str(e)) from e
            for j in range(n):  # distinct seeds so seeded n>1 samples differ but stay reproducible
                jobs.append((ids, replace(sp, seed=sp.seed + j if sp.seed is not None else None)))
        return jobs

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            body = await self._json(request)
            jobs = self._prepare(body, chat)
            stream = _field(body, "stream", bool, False)
            so = _field(body, "stream_options", dict, {}) or {}
            include_usage = bool(so.get("include_usage", False))
            salt = _field(body, "cache_salt", str, None)
        except APIError as e:
            return _error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        ctx = tracing.extract_context(request.headers)
        gens = [
            self.async_engine.generate(
                ids, sp, request_id=f"{rid}-{k}" if len(jobs) > 1 else rid, cache_salt=salt, trace_context=ctx
            )
            for k, (ids, sp) in enumerate(jobs)
        ]
        n = _field(body, "n", int, 1)
        headers = {"x-request-id": request.headers.get("x-request-id", rid)}
        if stream:
            return ClosingStreamingResponse(
                self._sse(gens, n, rid, chat, include_usage), media_type="text/event-stream", headers=headers
            )
        try:
            outs = await self._collect_or_disconnect(request, gens)
        except APIError as e:
            return _error_response(e)
        if outs is None:  # client went away: the sequences were aborted
            return Response(status_code=499)
        return JSONResponse(self._final_body(outs, n, rid, chat), headers=headers)

    @staticmethod
    async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave several choices' outputs as they arrive; closing this aborts the rest."""
        if len(gens) == 1:
            try:
                async for o in gens[0]:
                    yield 0, o
            finally:
                await gens[0].aclose()  # a closed stream must abort its sequence now, not at GC
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
            try:
                async for o in g:
                    await q.put((i, o))
                await q.put((i, None))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                await q.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            remaining = len(gens)
            while remaining:
                i, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _collect_or_disconnect(
        self, request: Request, gens: list[AsyncIterator[RequestOutput]]
    ) -> list[list[RequestOutput]] | None:
        merged = self._merge(gens)

        async def collect() -> list[list[RequestOutput]]:
            per: list[list[RequestOutput]] = [[] for _ in gens]
            try:
                async for i, o in merged:
                    per[i].append(o)
            except ValueError as e:
                raise APIError(400, str(e)) from e
            except Exception as e:  # noqa: BLE001
                raise APIError(500, f"generation failed: {e}", "server_error", "internal_error") from e
            return per

        async def disconnected() -> None:
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        work = asyncio.ensure_future(collect())
        watch = asyncio.ensure_future(disconnected())
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            watch.cancel()
            return work.result()
        work.cancel()
        try:
            await work
        except (asyncio.CancelledError, APIError):
            pass
        await merged.aclose()
        return None

    # --- response shapes ----------------------------------------------------------------------

    @staticmethod
    def _usage(lasts: list[RequestOutput | None], n: int) -> dict[str, Any]:
        """Prompt tokens once per prompt (not per n), completion tokens summed over choices."""
        firsts = [o for k, o in enumerate(lasts) if k % n == 0 and o is not None]
        prompt = sum(o.num_prompt_tokens for o in firsts)
        completion = sum(o.num_output_tokens for o in lasts if o is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in firsts)},
        }

    def _completion_logprobs(self, lps: list[TokenLogprob], offset0: int) -> dict[str, Any]:
        tok = self.engine.tokenizer
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for lp in lps:
            t = tok.token_text(lp.token_id)
            tokens.append(t)
            token_lps.append(lp.logprob)
            top: dict[str, float] = {}
            for i, v in lp.top:
                top.setdefault(tok.token_text(i), v)
            tops.append(top)
            offsets.append(off)
            off += len(t)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        tok = self.engine.tokenizer

        def entry(i: int, v: float) -> dict[str, Any]:
            return {"token": tok.token_text(i), "logprob": v, "bytes": list(tok.token_bytes[i])}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in lps
            ]
        }

    def _final_body(self, per: list[list[RequestOutput]], n: int, rid: str, chat: bool) -> dict[str, Any]:
        choices = []
        for idx, outs in enumerate(per):
            last = outs[-1]
            text = "".join(o.new_text for o in outs)
            lps = [lp for o in outs for lp in o.logprobs]
            if chat:
                choices.append(
                    {
                        "index": idx,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": self._chat_logprobs(lps) if lps else None,
                        "finish_reason": last.finish_reason,
                        "stop_reason": last.stop_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": idx,
                        "text": text,
                        "logprobs": self._completion_logprobs(lps, 0) if lps else None,
                        "finish_reason": last.finish_reason,
                        "stop_reason": last.stop_reason,
                    }
                )
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": self._usage([o[-1] for o in per], n),
        }

    async def _sse(
        self, gens: list[AsyncIterator[RequestOutput]], n: int, rid: str, chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], usage: dict | None = None) -> bytes:
            d: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.model_name,
                "choices": choices,
            }
            if include_usage:
                d["usage"] = usage
            return b"data: " + json.dumps(d).encode() + b"\n\n"

        lasts: list[RequestOutput | None] = [None] * len(gens)
        text_off = [0] * len(gens)
        merged = self._merge(gens)
        try:
            if chat:
                for idx in range(len(gens)):
                    yield event(
                        [
                            {
                                "index": idx,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
            async for idx, o in merged:
                lasts[idx] = o
                if not o.new_text and not o.finished and not o.logprobs:
                    continue
                fin = o.finish_reason if o.finished else None
                if chat:
                    delta = {"content": o.new_text} if o.new_text else {}
                    choice = {
                        "index": idx,
                        "delta": delta,
                        "logprobs": self._chat_logprobs(o.logprobs) if o.logprobs else None,
                        "finish_reason": fin,
                    }
                else:
                    choice = {
                        "index": idx,
                        "text": o.new_text,
                        "logprobs": self._completion_logprobs(o.logprobs, text_off[idx]) if o.logprobs else None,
                        "finish_reason": fin,
                    }
                if fin is not None:
                    choice["stop_reason"] = o.stop_reason
                text_off[idx] += len(o.new_text)
                yield event([choice])
            if include_usage:
                yield event([], self._usage(lasts, n))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - report, never end silently
            log.exception("stream %s failed", rid)
            err = APIError(
                400 if isinstance(e, ValueError) else 500,
                str(e),
                "invalid_request_error" if isinstance(e, ValueError) else "server_error",
            )
            yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
        finally:
            await merged.aclose()
        yield b"data: [DONE]\n\n"


def build_app(engine: LLMEngine, served_model_name: str | None = None) -> Starlette:
    return EngineServer(engine, served_model_name).app()
