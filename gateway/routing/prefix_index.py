"""Which replica holds which prompt blocks: block hash → replicas, bounded, least recently used dropped first.

Hashes are the engine's own (`backend_engine.block_hash`), chained, so a run of leading matches is a cached
prefix. Fed by routing decisions (`prefix_affinity`, approximate) or by each engine's KV events (`kv_events`,
precise: evictions are seen).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._holders: OrderedDict[int, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, hashes: Iterable[int], replica: str) -> None:
        for block in hashes:
            holders = self._holders.get(block)
            if holders is None:
                self._holders[block] = holders = set()
            else:
                self._holders.move_to_end(block)
            holders.add(replica)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def remove(self, hashes: Iterable[int], replica: str) -> None:
        for block in hashes:
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(replica)
                if not holders:
                    del self._holders[block]

    def clear(self, replica: str) -> None:
        self.remove(list(self._holders), replica)

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
