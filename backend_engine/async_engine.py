"""`AsyncEngine`: LLMEngine's step loop on a background thread, one asyncio queue per request.

HTTP handlers never touch engine state: they queue commands (add, abort, reset the prefix cache)
that the engine thread applies between steps, and read each request's outputs from its own queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

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


EngineCommand = AddRequest | AbortRequest | ResetPrefixCache
# What a request's queue carries: its outputs, or the error that ends it.
StreamItem = RequestOutput | BaseException


class AsyncEngine:
    """Runs LLMEngine.step in a background thread; each request streams through an asyncio queue."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: deque[EngineCommand] = deque()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StreamItem]]] = {}
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
        else:
            eng.reset_prefix_cache()

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            while self._commands:
                self._apply(self._commands.popleft())
            if not eng.has_unfinished():
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
