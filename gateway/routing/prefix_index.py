"""Which replica holds which prompt blocks: block hash → replicas, bounded, least recently used dropped first.

Hashes are the engine's own (`backend_engine.block_hash`), chained, so a run of leading matches is a cached
prefix. Fed by routing decisions (`prefix_affinity`, approximate) or by each engine's KV events (`kv_events`,
precise: evictions are seen). A decision can also name the replica's KV capacity: the index then keeps at most that
many blocks for it, the least recently routed dropped first, the way the engine's LRU evicts them. Without that
bound a decision-fed index believes, under cache pressure, in prefixes the replica evicted long ago, and piles
"cached" requests onto it that all prefill cold (docs/benchmarks.md, KV-cache-aware routing).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._holders: OrderedDict[int, set[str]] = OrderedDict()
        self._recent: dict[str, OrderedDict[int, None]] = {}  # per replica, least recently routed first

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, hashes: Iterable[int], replica: str, replica_capacity: int | None = None) -> None:
        """Record that `replica` holds these blocks; with `replica_capacity` (its KV blocks), forget its least
        recently added blocks beyond that many."""
        recent = self._recent.setdefault(replica, OrderedDict())
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = holders = set()
            else:
                self._holders.move_to_end(block)
            holders.add(replica)
            recent[block] = None
            recent.move_to_end(block)
        if replica_capacity:
            while len(recent) > replica_capacity:
                self._drop(recent.popitem(last=False)[0], replica)
        while len(self._holders) > self.capacity:
            block, holders = self._holders.popitem(last=False)
            for holder in holders:
                self._recent[holder].pop(block, None)

    def remove(self, hashes: Iterable[int], replica: str) -> None:
        recent = self._recent.get(replica)
        for block in hashes:
            if recent is not None:
                recent.pop(block, None)
            self._drop(block, replica)

    def _drop(self, block: int, replica: str) -> None:
        holders = self._holders.get(block)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block]

    def clear(self, replica: str) -> None:
        self.remove(list(self._recent.get(replica, ())), replica)

    def blocks_held(self, replica: str) -> int:
        """How many blocks the index believes `replica` caches."""
        recent = self._recent.get(replica)
        return len(recent) if recent is not None else 0

    def matched_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """For each replica, how many leading blocks of the prompt it holds."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, block in enumerate(hashes, start=1):
            holders = self._holders.get(block)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            self._holders.move_to_end(block)
            for replica in alive:
                matched[replica] = depth
        return matched
