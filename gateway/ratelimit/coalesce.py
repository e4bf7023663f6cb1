"""Coalesce many callers' store operations into one round trip per batch.

Under load, a round trip per request costs more than the decision itself (a client call, a Redis command and a
script run each, and on each side a wake-up). Callers queue their items here; one sender task takes everything
queued — what arrived in the same event-loop turn or the next, and what arrived while the previous batch was in
flight — and sends it as one batch. A lone request waits one loop turn; a busy gateway sends fewer, larger batches.
Items that can wait (settlements) wait a moment for the next urgent one instead of going alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

MAX_BATCH = 256  # items per round trip: bounds how long one script call holds Redis
LINGER = 0.002  # seconds an item that can wait waits for an urgent one to ride with


class Coalescer(Generic[Item, Result]):
    """`send(items)` answers one result per item, in order, or raises for the whole batch."""

    def __init__(
        self,
        send: Callable[[Sequence[Item]], Awaitable[Sequence[Result]]],
        unsent: Callable[[Exception], Exception] | None = None,
    ) -> None:
        """`unsent(error)`: the error for the items queued when a batch fails with `error`, which then fail with it
        unsent rather than wait for their own batch: a store that stalls holds each batch for its whole timeout, so
        a caller queued behind one, or behind hundreds of settlements kept through an outage, would wait several
        timeouts. None: they are sent in turn."""
        self._send = send
        self._unsent = unsent
        self._queue: list[tuple[Item, asyncio.Future[Result]]] = []
        self._queued = asyncio.Event()  # set: the sender should send what is queued
        self._linger: asyncio.TimerHandle | None = None
        self._sender: asyncio.Task[None] | None = None
        self._closing = False

    def submit(self, item: Item, *, can_wait: bool = False) -> asyncio.Future[Result]:
        """Queue an item; the future resolves to its result when its batch comes back. An item that `can_wait`
        rides with the next batch, sent within LINGER seconds: at low load a settlement costs no round trip of its
        own."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._run(), name="ratelimit-coalescer")
        if not can_wait:
            self._queued.set()
        elif self._linger is None and not self._queued.is_set():
            self._linger = asyncio.get_running_loop().call_later(LINGER, self._queued.set)
        return future

    async def aclose(self) -> None:
        """Send what is still queued (the last requests' settlements), then stop."""
        if self._sender is not None:
            self._closing = True
            self._queued.set()
            await asyncio.gather(self._sender, return_exceptions=True)
            self._sender = None

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

    async def _deliver(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            results = await self._send([item for item, _ in batch])
        except asyncio.CancelledError:  # the loop is going away: so are the batch's callers
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # the batch's callers decide what a failure means (fail open, retry, ...)
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            if self._unsent is not None and self._queue:
                queued, self._queue = self._queue, []
                self._queued.clear()
                if self._linger is not None:
                    self._linger.cancel()
                    self._linger = None
                unsent = self._unsent(exc)
                for _, future in queued:
                    if not future.done():
                        future.set_exception(unsent)
            return
        for (_, future), result in zip(batch, results):
            if not future.done():  # done: its caller was cancelled
                future.set_result(result)
