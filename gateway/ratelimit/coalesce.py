"""Coalesce many callers' store operations into one round trip per batch.

Under load, a round trip per request costs more than the decision itself (a client call, a Redis command and a
script run each, and on each side a wake-up). Callers queue their items here; one sender task takes everything
queued — what arrived in the same event-loop turn or the next, and what arrived while the previous batch was in
flight — and sends it as one batch. A lone request waits one loop turn; a busy gateway sends fewer, larger batches.
Items nobody awaits (settlements) wait a moment for the next awaited one instead of going alone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")

MAX_BATCH = 256  # items per round trip: bounds how long one script call holds Redis
LINGER = 0.002  # seconds an unawaited item waits for an awaited one to ride with


class Coalescer(Generic[Item, Result]):
    """`send(items)` answers one result per item, in order, or raises for the whole batch."""

    def __init__(self, send: Callable[[Sequence[Item]], Awaitable[Sequence[Result]]]) -> None:
        self._send = send
        self._queue: list[tuple[Item, asyncio.Future[Result] | None]] = []
        self._queued = asyncio.Event()  # set: the sender should send what is queued
        self._linger: asyncio.TimerHandle | None = None
        self._sender: asyncio.Task[None] | None = None
        self._closing = False

    def submit(self, item: Item) -> asyncio.Future[Result]:
        """Queue an item; the future resolves to its result when its batch comes back."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._enqueue(item, future)
        self._queued.set()
        return future

    def post(self, item: Item) -> None:
        """Queue an item nobody waits for: it rides with the next batch, sent within LINGER seconds (at low load a
        settlement then costs no round trip of its own). A failed batch logs what it lost."""
        self._enqueue(item, None)
        if self._linger is None and not self._queued.is_set():
            self._linger = asyncio.get_running_loop().call_later(LINGER, self._queued.set)

    async def aclose(self) -> None:
        """Send what is still queued (the last requests' settlements), then stop."""
        if self._sender is not None:
            self._closing = True
            self._queued.set()
            await asyncio.gather(self._sender, return_exceptions=True)
            self._sender = None

    def _enqueue(self, item: Item, future: asyncio.Future[Result] | None) -> None:
        self._queue.append((item, future))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._run(), name="ratelimit-coalescer")

    async def _run(self) -> None:
        while self._queue or not self._closing:
            await self._queued.wait()
            if not self._closing:
                await asyncio.sleep(0)  # one more loop turn, for requests read in the same poll: half as many batches
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            if not self._queue:
                self._queued.clear()
                if self._linger is not None:
                    self._linger.cancel()
                    self._linger = None
            if batch:
                await self._deliver(batch)

    async def _deliver(self, batch: list[tuple[Item, asyncio.Future[Result] | None]]) -> None:
        try:
            results = await self._send([item for item, _ in batch])
        except asyncio.CancelledError:  # the loop is going away: so are the batch's callers
            for _, future in batch:
                if future is not None:
                    future.cancel()
            raise
        except Exception as exc:  # the batch's callers decide what a failure means (fail open or closed)
            lost = sum(1 for _, future in batch if future is None)
            if lost:
                log.warning("rate limit store: %d settlement(s) lost: %s", lost, exc)
            for _, future in batch:
                if future is not None and not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            if future is not None and not future.done():  # done: its caller was cancelled
                future.set_result(result)
