"""KV-cache events for routers: which block hashes this engine stores and drops.

The engine thread publishes each step's events as one batch with a sequence number. The bus keeps
a mirror of the currently cached hashes, so a new subscriber first receives a snapshot batch
(AllBlocksCleared, then one BlockStored holding every cached hash) and then the live batches: it
never needs history, and a gap in `seq` tells it to resubscribe. A subscriber too far behind loses batches
rather than growing a queue without bound; the heartbeats of a quiet stream carry the number of the newest batch
offered to it, so a loss shows as a gap even when the engine publishes nothing after it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator
from typing import Any


class _Subscription:
    """One subscriber's queue, and the number of the newest batch offered to it, queued or dropped."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.offered = 0


class KVEventBus:
    def __init__(self, block_size: int, max_queue: int = 10000):
        self.block_size = block_size
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._seq = 0
        self._cached: dict[int, None] = {}  # insertion-ordered set of stored hashes
        self._subs: list[_Subscription] = []

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Called from the engine thread after a step."""
        if not events:
            return
        with self._lock:
            for e in events:
                if e["type"] == "BlockStored":
                    for h in e["block_hashes"]:
                        self._cached[h] = None
                elif e["type"] == "BlockRemoved":
                    for h in e["block_hashes"]:
                        self._cached.pop(h, None)
                elif e["type"] == "AllBlocksCleared":
                    self._cached.clear()
            self._seq += 1
            batch = {"seq": self._seq, "ts": time.time(), "events": events}
            subs = list(self._subs)
        for sub in subs:
            try:
                sub.loop.call_soon_threadsafe(self._offer, sub, batch)
            except RuntimeError:  # loop closed
                pass

    def _offer(self, sub: _Subscription, batch: dict[str, Any]) -> None:
        sub.offered = batch["seq"]
        if sub.queue.qsize() < self.max_queue:  # else dropped: a subscriber this far behind sees a gap
            sub.queue.put_nowait(batch)

    async def batches(self, heartbeat: float) -> AsyncGenerator[dict[str, Any]]:
        """The snapshot, then each live batch, and a heartbeat after every `heartbeat` quiet seconds."""
        sub, snapshot = self._subscribe()
        last = sub.offered = snapshot["seq"]
        try:
            yield snapshot
            while True:
                try:
                    batch = await asyncio.wait_for(sub.queue.get(), timeout=heartbeat)
                except TimeoutError:
                    if sub.queue.empty():  # every batch offered was sent or dropped
                        yield {"seq": sub.offered, "ts": time.time(), "heartbeat": True, "events": []}
                    continue  # else one came as the wait ran out: it goes next, and no heartbeat claims it
                if batch["seq"] <= last:
                    continue  # already covered by the snapshot
                last = batch["seq"]
                yield batch
        finally:
            self._unsubscribe(sub)

    def _subscribe(self) -> tuple[_Subscription, dict[str, Any]]:
        sub = _Subscription(asyncio.get_running_loop())
        with self._lock:
            self._subs.append(sub)
            snapshot = {
                "seq": self._seq,
                "ts": time.time(),
                "snapshot": True,
                "events": [
                    {"type": "AllBlocksCleared"},
                    {
                        "type": "BlockStored",
                        "block_hashes": list(self._cached),
                        "parent_block_hash": None,
                        "token_ids": None,
                        "block_size": self.block_size,
                    },
                ],
            }
        return sub, snapshot

    def _unsubscribe(self, sub: _Subscription) -> None:
        with self._lock:
            self._subs = [s for s in self._subs if s is not sub]

    def cached_hashes(self) -> list[int]:
        with self._lock:
            return list(self._cached)
