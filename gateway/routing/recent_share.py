"""Where the last N routing decisions went: the long-run balance guard of the cache-aware policies.

In-flight load alone cannot keep a cache-first router balanced: a replica that serves its cached prefixes
quickly always looks idle, so it keeps attracting them. Counting recent decisions bounds each replica's share
the way consistent hashing with bounded loads (Mirrokni et al., 2018) bounds a server's: at most `max_share`
times the mean.
"""

from __future__ import annotations

import math
from collections import Counter, deque


class RecentShare:
    def __init__(self, window: int) -> None:
        self._recent: deque[str] = deque(maxlen=window)
        self._counts: Counter[str] = Counter()

    def add(self, replica: str) -> None:
        if len(self._recent) == self._recent.maxlen:
            self._counts[self._recent[0]] -= 1
        self._recent.append(replica)
        self._counts[replica] += 1

    def over(self, replica: str, replicas: int, max_share: float) -> bool:
        """Whether one more request would take `replica` past `max_share` x the mean of the window, rounded up
        (as the paper does: with few decisions a strict bound would split even a two-turn conversation)."""
        total = len(self._recent)
        if total < replicas:  # too few decisions to call anything a hot spot
            return False
        return self._counts[replica] + 1 > math.ceil(max_share * (total + 1) / replicas)
