"""KV-cache events for routers: which block hashes this engine stores and drops.

The engine thread publishes each step's events as one batch with a sequence number. The bus keeps
a mirror of the currently cached hashes, so a new subscriber first receives a snapshot batch
(AllBlocksCleared, then one BlockStored holding every cached hash) and then the live batches: it
never needs history, and a gap in `seq` tells it to resubscribe.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any


class KVEventBus:
    def __init__(self, block_size: int, max_queue: int = 10000):
        self.block_size = block_size
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._seq = 0
        self._cached: dict[int, None] = {}  # insertion-ordered set of stored hashes
        self._subs: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []

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
        for loop, q in subs:
            try:
                loop.call_soon_threadsafe(self._offer, q, batch)
            except RuntimeError:  # loop closed
                pass

    def _offer(self, q: asyncio.Queue, batch: dict) -> None:
        if q.qsize() >= self.max_queue:
            return  # a subscriber this far behind sees a seq gap and resubscribes
        q.put_nowait(batch)

    def subscribe(self) -> tuple[asyncio.Queue, dict[str, Any]]:
        """Register the caller's event loop; returns its queue and the snapshot batch."""
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._subs.append((asyncio.get_running_loop(), q))
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
        return q, snapshot

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with self._lock:
            self._subs = [(lp, qq) for lp, qq in self._subs if qq is not q]

    def cached_hashes(self) -> list[int]:
        with self._lock:
            return list(self._cached)
