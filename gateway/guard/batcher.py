"""A dynamic micro-batcher shared by concurrent requests.

Requests submit their windows and await their own scores. One worker drains the queue: it waits at most
`max_wait_us` after the first window arrives (or until `max_batch` windows are waiting), sorts what it took by length
into buckets so a short prompt is not padded to a long one's width, and runs each bucket as one ONNX call in a
worker thread. While a batch runs, new windows queue up and ride the next one, so batches grow with load by
themselves. Each window carries its own future: every request gets exactly its own scores back.

A long scan (a document of hundreds of windows) goes into a second lane, scored `long_batch` windows a call, up to
`long_calls` calls at once (on a CPU, the cores one call's threads leave idle, so a document read by one model
alone still uses every core). When both lanes wait, the worker alternates between them: a short request waits
behind at most one round of long-scan calls, and long scans still progress under a steady stream of short ones. A
window's future holds its score and its share of its call's CPU seconds, what a scan's budget is charged.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

BUCKETS = (16, 32, 64, 128, 256, 512)


@dataclass(slots=True)
class _Item:
    ids: list[int]
    future: asyncio.Future[tuple[float, float]]  # (score, this window's share of its call's CPU seconds)


@dataclass
class BatchStats:
    batches: int = 0
    windows: int = 0
    largest: int = 0


class MicroBatcher:
    def __init__(
        self,
        score: Callable[[list[list[int]]], np.ndarray],
        *,
        max_batch: int = 32,
        max_wait_us: int = 1000,
        long_batch: int = 8,
        threads: int = 1,
        long_calls: int = 1,
        on_batch: Callable[[int, int, float], None] | None = None,
    ) -> None:
        self._score = score
        self.max_batch = max_batch
        self.long_batch = long_batch
        self.threads = threads  # the scorer's threads: a call's CPU time is its calling thread's times this
        self.long_calls = long_calls  # long-scan calls at once: cores that one call's threads leave idle
        self.max_wait = max_wait_us / 1e6
        self._on_batch = on_batch
        self._queue: list[_Item] = []  # short scans' windows
        self._long: deque[_Item] = deque()  # long scans' windows, in the order they came
        self._long_turn = False  # the last call was a short batch: a waiting long scan goes next
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False  # a batch taken from the queue is being scored
        self._closed = False
        self._alone: set[asyncio.Task[None]] = set()  # calls of a retired batcher's late scans
        self.stats = BatchStats()

    async def score(self, windows: Sequence[list[int]]) -> list[float]:
        """Scores of these windows, in order, batched with whatever else is waiting."""
        results = await asyncio.gather(*self.submit(windows))
        return [margin for margin, _ in results]

    def submit(self, windows: Sequence[list[int]], long: bool = False) -> list[asyncio.Future[tuple[float, float]]]:
        """A future per window for its (score, seconds); `long` puts them in the long-scan lane. A cancelled future's
        window is skipped if it has not been taken into a call yet."""
        if not windows:
            return []
        loop = asyncio.get_running_loop()
        items = [_Item(list(ids), loop.create_future()) for ids in windows]
        if self._closed:  # a scan that began before a reload retired this batcher: scored alone, no worker kept
            alone = loop.create_task(self._calls_alone(items))
            self._alone.add(alone)
            alone.add_done_callback(self._alone.discard)
        else:
            (self._long if long else self._queue).extend(items)
            self._ensure_worker().set()
        return [item.future for item in items]

    def _ensure_worker(self) -> asyncio.Event:
        """The wakeup event of this loop's worker, started here when there is none (an event binds to one loop)."""
        loop = asyncio.get_running_loop()
        if self._wakeup is None or self._worker is None or self._worker.done() or self._loop is not loop:
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._run(self._wakeup))
        return self._wakeup

    async def retire(self) -> None:
        """Stop for good, once what is queued is scored: a reload replaced this batcher, and a scan that began
        before it is still scored, alone (see `submit`)."""
        self._closed = True
        await self.aclose()

    async def aclose(self) -> None:
        """Stop the worker once every window queued so far has its score (a later `score` starts it again)."""
        while self._worker and not self._worker.done() and (self._queue or self._long or self._running):
            await asyncio.sleep(0.001)
        if self._worker:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None

    def _take(self) -> tuple[list[list[_Item]], bool]:
        """The next calls and whether they run at once: a short batch's length buckets one after another, or, when it
        is the long lane's turn, up to `long_calls` calls of `long_batch` windows of long scans at once."""
        if self._long and (self._long_turn or not self._queue):
            self._long_turn = False
            calls = [self._take_long() for _ in range(self.long_calls)]
            return [call for call in calls if call], True
        taken, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
        self._long_turn = bool(self._long)
        return buckets([i for i in taken if not i.future.done()]), False  # a cancelled request's windows are skipped

    def _take_long(self) -> list[_Item]:
        taken: list[_Item] = []
        while self._long and len(taken) < self.long_batch:
            item = self._long.popleft()
            if not item.future.done():  # a cancelled scan's windows are dropped, not counted
                taken.append(item)
        return taken

    async def _run(self, wakeup: asyncio.Event) -> None:
        while True:
            while not self._queue and not self._long:
                wakeup.clear()
                await wakeup.wait()
            if self._queue and len(self._queue) < self.max_batch and self.max_wait > 0 and not self._long_turn:
                deadline = time.perf_counter() + self.max_wait
                while len(self._queue) < self.max_batch:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    wakeup.clear()
                    try:
                        await asyncio.wait_for(wakeup.wait(), left)
                    except TimeoutError:
                        break
            calls, at_once = self._take()
            self._running = True
            if at_once:
                await asyncio.gather(*(self._call(call) for call in calls))
            else:
                for call in calls:
                    await self._call(call)
            self._running = False

    def _cpu_timed(self, batch: list[list[int]]) -> tuple[np.ndarray, float]:
        """Scores, and the CPU seconds of this thread they took: on a busy machine a call's wall time is mostly
        other processes' turns, which no request should be charged for."""
        started = time.thread_time()
        scores = self._score(batch)
        return scores, time.thread_time() - started

    async def _calls_alone(self, items: list[_Item]) -> None:
        for start in range(0, len(items), self.long_batch):
            await self._call(items[start : start + self.long_batch])

    async def _call(self, bucket: list[_Item]) -> None:
        """One classifier call in a worker thread; each window's future gets its score and share of the CPU seconds."""
        started = time.perf_counter()
        try:
            scores, cpu = await asyncio.to_thread(self._cpu_timed, [i.ids for i in bucket])
        except Exception as exc:
            for item in bucket:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        seconds = time.perf_counter() - started
        share = cpu * self.threads / len(bucket)
        for item, s in zip(bucket, scores):
            if not item.future.done():
                item.future.set_result((float(s), share))
        self.stats.batches += 1
        self.stats.windows += len(bucket)
        self.stats.largest = max(self.stats.largest, len(bucket))
        if self._on_batch:
            self._on_batch(len(bucket), max(len(i.ids) for i in bucket), seconds)


def buckets(items: list[_Item]) -> list[list[_Item]]:
    """Group by length bucket (≤16, ≤32, ≤64, ... tokens); each group is padded only to its own longest."""
    groups: dict[int, list[_Item]] = {}
    for item in items:
        n = len(item.ids)
        bucket = next((b for b in BUCKETS if n <= b), n)
        groups.setdefault(bucket, []).append(item)
    return [groups[b] for b in sorted(groups)]
