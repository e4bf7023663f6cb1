"""Settlements owed to the shared store, kept in order until the store has them.

A request admitted by Redis holds its concurrency slot and its token reservation there until its settlement arrives.
A settlement lost while Redis is down or stalled would keep the slot until its lease runs out (minutes) and leave
the reservation charged: the tenant would be refused long after the store is back. So every settlement for the
store goes through this outbox. While the store answers, a settlement is sent at once (it rides with the next batch,
so an admission queued after it is decided after it); one that fails is kept, and so is every later one until the
store answers again: kept settlements are sent oldest first, retried with backoff (RETRY_FIRST doubling to
RETRY_MAX) until the store takes them, so a slot outlives an outage by about RETRY_MAX seconds. The settlement of a
request admitted by the local fallback never comes here: it is settled in memory, where it was admitted.

Bounded: at most `cap` settlements wait. At the cap the oldest one is dropped: its slot's lease is the nearest to
running out by itself, and its token correction the likeliest to be moot (the counter has been refilling since).

At most once for token corrections, at least once for slot releases: a batch that failed after it was sent whole
(a timeout, a connection lost while waiting) may have been applied. Freeing a slot twice is harmless, so releases
are retried; refunding tokens twice is not, so those corrections are dropped.

On shutdown what is pending gets one more try, without waiting out a backoff; what still fails is dropped.
Every drop is counted in `dropped` (by reason); the first of each reason is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from gateway.ratelimit.checks import BackendError, Settlement

log = logging.getLogger(__name__)

RETRY_FIRST = 0.05  # seconds before the first retry of a failed delivery
RETRY_MAX = 1.0  # the longest wait between retries: how long a slot may outlive an outage
IN_FLIGHT = 1024  # settlements sent at once (the coalescer cuts them into batches)


class SettlementOutbox:
    """`send(settlement)` queues one settlement for the store: its future fails with BackendError if the store did
    not take it."""

    def __init__(self, send: Callable[[Settlement], asyncio.Future[Any]], cap: int) -> None:
        self._send = send
        self._cap = cap
        self._sending: set[asyncio.Future[Any]] = set()  # sent at once, not answered yet
        self._pending: deque[Settlement] = deque()  # kept for retry, oldest first
        self._wake = asyncio.Event()  # set: something new is pending
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._failing = False  # the store failed a delivery and has not taken one since
        self.dropped: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, settlement: Settlement) -> None:
        if self._failing or self._pending:  # the store is failing: wait behind the older ones
            self._keep([settlement])
            return
        future = self._send(settlement)
        self._sending.add(future)
        future.add_done_callback(lambda done: self._sent(settlement, done))

    async def aclose(self) -> None:
        """Try once more to deliver what is pending (the last requests' settlements, or an outage's), then stop."""
        await asyncio.gather(*self._sending, return_exceptions=True)  # what fails of them is kept for the last try
        self._closing.set()
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

    def _sent(self, settlement: Settlement, future: asyncio.Future[Any]) -> None:
        self._sending.discard(future)
        error = None if future.cancelled() else future.exception()
        if isinstance(error, BackendError):
            self._failed(error)
            self._keep(_retryable(settlement, error, self.dropped))
        elif error is not None:
            log.error("rate limit settlement lost", exc_info=error)

    def _keep(self, settlements: list[Settlement]) -> None:
        self._pending.extend(settlements)
        self._enforce_cap()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ratelimit-settlements")

    async def _run(self) -> None:
        delay = RETRY_FIRST
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                if await self._deliver_oldest():
                    delay = RETRY_FIRST
                    continue
                if self._closing.is_set():
                    self._drop("unreachable_at_shutdown", len(self._pending))
                    self._pending.clear()
                    return
                with contextlib.suppress(TimeoutError):  # a shutdown cuts the wait short
                    await asyncio.wait_for(self._closing.wait(), delay)
                delay = min(delay * 2, RETRY_MAX)
            if self._closing.is_set():
                return

    async def _deliver_oldest(self) -> bool:
        """Send the oldest pending settlements; put back, in order, what the store did not take. False: it failed."""
        sending = [self._pending.popleft() for _ in range(min(IN_FLIGHT, len(self._pending)))]
        results = await asyncio.gather(*(self._send(s) for s in sending), return_exceptions=True)
        retry: list[Settlement] = []
        error: BackendError | None = None
        for settlement, result in zip(sending, results):
            if isinstance(result, BackendError):
                error = result
                retry += _retryable(settlement, result, self.dropped)
            elif isinstance(result, BaseException):
                log.error("rate limit settlement lost", exc_info=result)
        if error is None:
            if self._failing and not self._pending:
                log.warning(
                    "rate limit store reachable again: kept settlements delivered (dropped so far: %s)",
                    dict(self.dropped) or "none",
                )
                self._failing = False
            return True
        self._pending.extendleft(reversed(retry))
        self._enforce_cap()
        self._failed(error)
        return False

    def _failed(self, error: BackendError) -> None:
        if not self._failing:
            log.warning("rate limit store failed a delivery (%s): settlements kept for retry", error)
            self._failing = True

    def _enforce_cap(self) -> None:
        excess = len(self._pending) - self._cap
        if excess > 0:
            for _ in range(excess):
                self._pending.popleft()
            self._drop("outbox_full", excess)

    def _drop(self, reason: str, count: int) -> None:
        if count and not self.dropped[reason]:
            log.error("rate limit settlements dropped (%s): slots free when their leases run out", reason)
        self.dropped[reason] += count


def _retryable(settlement: Settlement, error: BackendError, dropped: Counter[str]) -> list[Settlement]:
    """What of a failed settlement may be sent again: all of it, unless the store may have applied it already."""
    if not error.maybe_applied or not settlement.adjustments:
        return [settlement]
    dropped["correction_maybe_applied"] += 1
    # releases and budget settlements apply once however often they are sent: those are sent again
    kept = Settlement(releases=settlement.releases, spend=settlement.spend)
    return [kept] if kept.releases or kept.spend else []
