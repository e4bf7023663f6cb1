"""Routing policies: the order in which a request tries a pool's replicas (the first is the choice).

- `round_robin`: rotate.
- `least_outstanding`: fewest requests in flight from this gateway (needs no scraping).
- `least_load`: fewest requests running + waiting on the replica (scraped, corrected locally between scrapes),
  KV usage breaking near-ties.
- `prefix_affinity` / `kv_events`: cost = overlap_weight x uncached prefill blocks + active KV blocks, lowest wins
  (the Dynamo KV-router cost), unless in-flight load is imbalanced past both balance thresholds, in which case the
  least-loaded replica wins (SGLang's cache-aware balance rule). The two differ only in how the prefix index
  learns: from this gateway's own routing decisions, or from the engines' KV-event streams (which also see
  evictions).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from gateway.config import AffinityConfig
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.replica import Replica


@dataclass(slots=True)
class RouteRequest:
    """What routing knows of a request, in KV blocks."""

    block_hashes: list[int] = field(default_factory=list)  # the prompt's full blocks, engine hashing
    prompt_blocks: int = 0
    decode_blocks: int = 0


@dataclass(slots=True)
class Ranked:
    replicas: list[Replica]
    cached_blocks: dict[str, int]  # predicted, per replica url

    def blocks_needed(self, replica: Replica, request: RouteRequest) -> int:
        return max(0, request.prompt_blocks - self.cached_blocks.get(replica.url, 0)) + request.decode_blocks


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        start = next(self._counter) % len(replicas)
        return Ranked(replicas[start:] + replicas[:start], {})

    def learn(self, request: RouteRequest, replica: Replica) -> None:
        """Policies with a learned prefix index record where a prompt went; the others need nothing."""


class LeastOutstanding(RoundRobin):
    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        rotated = super().rank(replicas, request).replicas  # rotation spreads ties
        return Ranked(sorted(rotated, key=lambda r: r.outstanding), {})


class LeastLoad(RoundRobin):
    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        rotated = super().rank(replicas, request).replicas
        return Ranked(sorted(rotated, key=lambda r: r.load + r.kv_usage), {})


class PrefixAffinity(RoundRobin):
    def __init__(self, index: PrefixIndex, config: AffinityConfig, learns: bool) -> None:
        super().__init__()
        self.index = index
        self.config = config
        self._learns = learns

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        rotated = super().rank(replicas, request).replicas
        cached = self.index.matched_blocks(request.block_hashes) if request.block_hashes else {}
        loads = [r.load for r in rotated]
        lightest, heaviest = min(loads), max(loads)
        if heaviest - lightest > self.config.balance_abs_threshold and \
                heaviest > self.config.balance_rel_threshold * lightest:
            return Ranked(sorted(rotated, key=lambda r: r.load), cached)

        def cost(replica: Replica) -> float:
            uncached = request.prompt_blocks - cached.get(replica.url, 0)
            return self.config.overlap_weight * uncached + replica.active_blocks + replica.load

        return Ranked(sorted(rotated, key=cost), cached)

    def learn(self, request: RouteRequest, replica: Replica) -> None:
        if self._learns:
            self.index.add(request.block_hashes, replica.url)
