"""`AsyncEngine`: LLMEngine's step loop on a background thread, handing each step's outputs to asyncio at once.

HTTP handlers never touch engine state: they queue commands (add, abort, reset the prefix cache,
embed) that the engine thread applies between steps. After each step the engine thread hands every
output of that step to the event loop in one `call_soon_threadsafe` (not one per token or per stream),
where each request's `RequestStream` collects its choices' outputs and wakes its reader once; a reader
that fell behind takes every step it missed in one go. Embeddings run on the engine thread too, one
group of inputs between two steps, so they share the KV cache and the array backend with generation
without a lock.
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
    loop: asyncio.AbstractEventLoop  # where the request's outputs are handed over


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
# What the engine thread hands over for one sequence: an output, or the error that ends it.
Handover = tuple[str, RequestOutput | BaseException]
# What a request's stream yields: (choice index, output) pairs, in the order the engine produced them.
ChoiceOutputs = list[tuple[int, RequestOutput]]


class RequestStream:
    """One request's choices, as the engine thread's outputs reach the event loop: touched only on that loop.

    `put` collects and wakes the reader once; `take` returns everything collected since the last call."""

    def __init__(self, num_choices: int):
        self._outputs: ChoiceOutputs = []
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.unfinished = set(range(num_choices))

    def put(self, index: int, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            self._outputs.append((index, item))
            if item.finished:
                self.unfinished.discard(index)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> ChoiceOutputs:
        """The outputs collected since the last call (at least one), or [] once every choice has finished and
        been taken; raises the error that ended a choice."""
        while not self._outputs and self._error is None and self.unfinished:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._outputs:
            outputs, self._outputs = self._outputs, []
            return outputs
        if self._error is not None:
            raise self._error
        return []


class AsyncEngine:
    """Runs LLMEngine.step in a background thread; each request's outputs reach it through a `RequestStream`."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: deque[EngineCommand] = deque()
        self._wake = threading.Event()
        # Event loop only: sequence id -> (its request's stream, its choice index).
        self._streams: dict[str, tuple[RequestStream, int]] = {}
        # Engine thread only: sequence id -> the event loop its outputs go to.
        self._loops: dict[str, asyncio.AbstractEventLoop] = {}
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
        jobs: list[tuple[list[int], SamplingParams]],
        request_id: str | None = None,
        cache_salt: str | None = None,
        trace_context: Any = None,
    ) -> AsyncGenerator[ChoiceOutputs, None]:
        """Validate every choice's (prompt ids, params) job now (raises ValueError), then yield the choices' outputs
        as they arrive, all that arrived since the last yield at once, until every choice finishes.

        A request with one choice runs as sequence `request_id`, else as `request_id-<index>`. Closing the iterator
        early (client disconnect) aborts the unfinished sequences and frees their blocks."""
        for ids, params in jobs:
            self.engine.validate(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        seq_ids = [rid] if len(jobs) == 1 else [f"{rid}-{k}" for k in range(len(jobs))]
        stream = RequestStream(len(jobs))
        loop = asyncio.get_running_loop()
        for k, (seq_id, (ids, params)) in enumerate(zip(seq_ids, jobs)):
            self._streams[seq_id] = (stream, k)
            self._commands.append(AddRequest(seq_id, list(ids), params, cache_salt, trace_context, loop))
        self._wake.set()
        try:
            while outputs := await stream.take():
                yield outputs
        finally:
            for k, seq_id in enumerate(seq_ids):
                del self._streams[seq_id]
                if k in stream.unfinished:
                    self._submit(AbortRequest(seq_id))

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

    def _hand_over(self, items: list[Handover]) -> None:
        """Engine thread: one step's outputs (or errors) to their event loops, one callback per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Handover]] = {}
        for item in items:
            loop = self._loops.get(item[0])
            if loop is None:
                continue  # aborted: its reader is gone
            by_loop.setdefault(loop, []).append(item)
            if isinstance(item[1], BaseException) or item[1].finished:
                del self._loops[item[0]]
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._dispatch, batch)
            except RuntimeError:
                pass  # that loop is closed: nobody is left to read

    def _dispatch(self, items: list[Handover]) -> None:
        """Event loop: each output to its request's stream (a stream closed meanwhile is skipped)."""
        streams = self._streams
        for seq_id, item in items:
            target = streams.get(seq_id)
            if target is not None:
                target[0].put(target[1], item)

    def _apply(self, cmd: EngineCommand) -> list[Handover]:
        """Apply one command; a request the engine refuses comes back as its error."""
        eng = self.engine
        if isinstance(cmd, AddRequest):
            self._loops[cmd.request_id] = cmd.loop
            try:
                eng.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.cache_salt, cmd.trace_context)
            except Exception as e:  # noqa: BLE001 - delivered to the caller
                return [(cmd.request_id, e)]
        elif isinstance(cmd, AbortRequest):
            self._loops.pop(cmd.request_id, None)
            eng.abort(cmd.request_id)
        elif isinstance(cmd, Embed):
            self._embeds.append(cmd)  # run one group per step by _embed_next, not all at once here
        else:
            eng.reset_prefix_cache()
        return []

    def _loop(self) -> None:
        eng = self.engine
        while not self._stop:
            refused: list[Handover] = []
            while self._commands:
                refused += self._apply(self._commands.popleft())
            if refused:
                self._hand_over(refused)
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
                failure = RuntimeError(f"engine step failed: {e}")
                self._hand_over([(rid, failure) for rid in eng.abort_all()])
                continue
            self._hand_over([(out.request_id, out) for out in outs])
