"""`AsyncEngine`: LLMEngine's step loop on a background thread, one asyncio queue per request.

HTTP handlers never touch engine state: they queue commands (add, abort, reset the prefix cache,
embed) that the engine thread applies between steps, and read each request's outputs from its own
queue. Embeddings run on that thread too, one group of inputs between two steps, so they share the
KV cache and the array backend with generation without a lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import numpy as np

from backend_engine.engine import LLMEngine, RequestOutput
from backend_engine.sequence import SamplingParams

log = logging.getLogger("portcullis.engine")


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    trace_context: Any


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class Embed:
    inputs: list[list[int]]
    future: concurrent.futures.Future[list[np.ndarray]]


EngineCommand = AddRequest | AbortRequest | ResetPrefixCache | Embed
# What a request's queue carries: its outputs, or the error that ends it.
StreamItem = RequestOutput | BaseException


class AsyncEngine:
    """Runs LLMEngine.step in a background thread; each request streams through an asyncio queue."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: deque[EngineCommand] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StreamItem]]] = {}
        self._embeds: deque[Embed] = deque()  # engine thread only: groups waiting for their turn
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.last_error: str | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _submit(self, cmd: EngineCommand) -> None:
        self._commands.append(cmd)
        self._wake.set()

    def reset_prefix_cache(self) -> None:
        self._submit(ResetPrefixCache())

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        trace_context: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate now (raises ValueError), then yield outputs until the request finishes.

        Closing the iterator early (client disconnect) aborts the sequence and frees its blocks."""
        self.engine.validate(prompt_token_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        q: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), q)
        self._submit(AddRequest(rid, list(prompt_token_ids), params, cache_salt, trace_context))
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._submit(AbortRequest(rid))

    async def embed(self, inputs: list[list[int]]) -> list[np.ndarray]:
        """Each input's mean-pooled final hidden states, computed on the engine thread a group at a time
        (see `LLMEngine.embedding_groups`), with generation steps in between; cancelling (client gone)
        drops the groups not yet run."""
        for ids in inputs:
            self.engine.validate_embedding_input(ids)
        futures: list[concurrent.futures.Future[list[np.ndarray]]] = []
        for group in self.engine.embedding_groups(inputs):
            futures.append(concurrent.futures.Future())
            self._submit(Embed([inputs[i] for i in group], futures[-1]))
        try:
            return [v for f in futures for v in await asyncio.wrap_future(f)]
        finally:
            for f in futures:
                f.cancel()

    def _embed_next(self) -> None:
        """Run the oldest waiting embedding group if the KV cache has room for it now."""
        while self._embeds and self._embeds[0].future.cancelled():
            self._embeds.popleft()
        if not self._embeds:
            return
        cmd = self._embeds[0]
        try:
            vectors = self.engine.embed(cmd.inputs)
            if vectors is None:
                if self.engine.has_unfinished():
                    return  # running sequences hold the blocks: retry after the next step
                raise RuntimeError("the embedding inputs do not fit the KV cache")
        except Exception as e:  # noqa: BLE001 - delivered to the caller
            self._embeds.popleft()
            if cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(e)
            return
        self._embeds.popleft()
        if cmd.future.set_running_or_notify_cancel():
            cmd.future.set_result(vectors)

    def _deliver(self, rid: str, item: StreamItem) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:
                pass

    def _apply(self, cmd: EngineCommand) -> None:
        eng = self.engine
        if isinstance(cmd, AddRequest):
            if cmd.request_id not in self._streams:
                return  # caller already gone
            try:
                eng.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.cache_salt, cmd.trace_context)
            except Exception as e:  # noqa: BLE001 - delivered to the caller
                self._deliver(cmd.request_id, e)
        elif isinstance(cmd, AbortRequest):
            eng.abort(cmd.request_id)
        elif isinstance(cmd, Embed):
            self._embeds.append(cmd)  # run one group per step by _embed_next, not all at once here
        else:
            eng.reset_prefix_cache()

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            while self._commands:
                self._apply(self._commands.popleft())
            self._embed_next()
            if not eng.has_unfinished():
                if not self._embeds:
                    self._wake.wait(0.5)
                    self._wake.clear()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail every in-flight request, keep serving
                log.exception("engine step failed")
                self.last_error = repr(e)
                for rid in eng.abort_all():
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            for out in outs:
                self._deliver(out.request_id, out)
