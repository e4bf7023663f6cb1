"""Taking a missed request's answer into the response cache: whole from a non-streamed answer, assembled from a
stream as it passes (gateway/cache/assemble.py).

An answer is stored as the upstream gave it, before the output guard's redactions, and only once the output guard
let all of it through (a blocked answer is never stored); a hit runs it through the output guard again, under the
policy of that moment, so a policy made stricter since the answer was stored holds for it too. Only an answer that
ended normally is stored (gateway/cache/assemble.py's `complete`), and only one from the model and pool the key was
made for: an answer a fallback served came from another target, and is not stored under the first one's key.

Storing does not hold the answer up: the store's write (Redis's round trip) runs beside the response.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from gateway.cache.assemble import Assembly, complete
from gateway.cache.stores import AnswerStore

if TYPE_CHECKING:
    from gateway.context import RequestContext


class CacheFill:
    def __init__(
        self,
        store: AnswerStore,
        writes: set[asyncio.Task[None]],
        key: str,
        ttl: float,
        path: str,
        target: tuple[str, str],
        max_bytes: int,
        stored: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self._writes = writes  # the store's writes in flight, held so none is collected before it ran
        self._key = key
        self._ttl = ttl
        self._path = path  # the upstream route: the answer's format
        self._target = target  # (model, pool) the key was made for
        self._max_bytes = max_bytes
        self._stored = stored  # told once the answer is stored (the semantic match remembers its embedding then)
        self._assembly: Assembly | None = None

    def whole(self, ctx: RequestContext, content: bytes, answer: dict[str, Any]) -> None:
        """A non-streamed answer, as the upstream sent it and parsed."""
        if self._same_target(ctx) and complete(self._path, answer):
            self._put(content)

    def event(self, event: dict[str, Any], size: int) -> None:
        """One parsed event of a streamed answer (`size`: its data's bytes)."""
        if self._assembly is None:
            self._assembly = Assembly(self._path, self._max_bytes)
        self._assembly.feed(event, size)

    def stream_ended(self, ctx: RequestContext) -> None:
        """The stream ended whole, and the output guard let all of it through."""
        answer = self._assembly.answer() if self._assembly is not None else None
        if answer is not None and self._same_target(ctx) and complete(self._path, answer):
            self._put(orjson.dumps(answer))

    def _same_target(self, ctx: RequestContext) -> bool:
        return (ctx.model, ctx.placed.pool.name) == self._target

    def _put(self, content: bytes) -> None:
        if len(content) > self._max_bytes:
            return
        task = asyncio.create_task(self._store.put(self._key, content, self._ttl))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        if self._stored is not None:
            self._stored()
