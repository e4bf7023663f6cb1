"""Routing policies: the order in which a request tries a pool's replicas (the first is the choice).

- `round_robin`: rotate.
- `least_outstanding`: fewest requests in flight from this gateway (needs no scraping).
- `least_load`: fewest requests running + waiting on the replica (scraped, corrected locally between scrapes),
  KV usage breaking near-ties.
- `prefix_affinity` / `kv_events`: cache first, load as the guard (SGLang's cache-aware rule, priced in blocks):
  1. if in-flight load is imbalanced past both thresholds, the least-loaded replica wins;
  2. replicas that took more than `max_share` x their fair share of recent decisions step aside (unless all did);
  3. among the rest, if some replica holds at least `match_threshold` of the prompt's blocks and has free KV
     blocks for the rest of the request, the longest match wins (ties: least loaded);
  4. else (a new prefix) cost = requests in flight + KV blocks in use / blocks per request, so cold prompts
     spread over the least busy replicas.
  Measured here (docs/benchmarks.md), the Dynamo-style additive cost (uncached prefill blocks + active blocks)
  sent most follow-up turns to idle cold replicas: one in-flight 1,000-token request holds more blocks than a
  cached system prompt saves, while on a CPU engine the cold prefill costs ~7x the warm one.
  Both learn from this gateway's own routing decisions; `kv_events` also follows the engines' KV-event streams,
  which add the blocks replies fill and remove evicted ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol

from gateway.config import AffinityConfig
from gateway.routing.prefix_index import PrefixIndex
from gateway.routing.recent_share import RecentShare
from gateway.routing.replica import Replica


@dataclass(slots=True)
class RouteRequest:
    """What routing knows of a request, in KV blocks."""

    block_hashes: list[int] = field(default_factory=list)  # the prompt's full blocks, engine hashing
    prompt_blocks: int = 0
    decode_blocks: int = 0


def blocks_needed(request: RouteRequest, cached_blocks: int) -> int:
    """New KV blocks the request takes on a replica already holding `cached_blocks` of its prompt."""
    return max(0, request.prompt_blocks - cached_blocks) + request.decode_blocks


@dataclass(slots=True)
class Ranked:
    replicas: list[Replica]
    cached_blocks: dict[str, int]  # predicted, per replica url

    def blocks_needed(self, replica: Replica, request: RouteRequest) -> int:
        return blocks_needed(request, self.cached_blocks.get(replica.url, 0))


class RoutingPolicy(Protocol):
    """Orders a pool's replicas for a request; `learn` hears where the request went."""

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked: ...

    def learn(self, request: RouteRequest, replica: Replica) -> None:
        """Policies with a learned prefix index record where a prompt went; the others need nothing."""


class Rotation:
    """The replicas, starting one further along on each call: round robin, and the tie-breaker of the others."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def __call__(self, replicas: list[Replica]) -> list[Replica]:
        start = next(self._counter) % len(replicas)
        return replicas[start:] + replicas[:start]


class RoundRobin(RoutingPolicy):
    def __init__(self) -> None:
        self._rotate = Rotation()

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        return Ranked(self._rotate(replicas), {})


class LeastOutstanding(RoutingPolicy):
    def __init__(self) -> None:
        self._rotate = Rotation()  # rotation spreads ties

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        return Ranked(sorted(self._rotate(replicas), key=lambda r: r.outstanding), {})


class LeastLoad(RoutingPolicy):
    def __init__(self) -> None:
        self._rotate = Rotation()

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        return Ranked(sorted(self._rotate(replicas), key=lambda r: r.load + r.kv_usage), {})


class PrefixAffinity(RoutingPolicy):
    def __init__(self, index: PrefixIndex, config: AffinityConfig) -> None:
        self._rotate = Rotation()
        self.index = index
        self.config = config
        self.recent = RecentShare(config.share_window)

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        rotated = self._rotate(replicas)
        cached = self.index.matched_blocks(request.block_hashes) if request.block_hashes else {}
        loads = [r.load for r in rotated]
        lightest, heaviest = min(loads), max(loads)
        if (
            heaviest - lightest > self.config.balance_abs_threshold
            and heaviest > self.config.balance_rel_threshold * lightest
        ):
            return Ranked(sorted(rotated, key=lambda r: r.load), cached)

        size = max(1, request.prompt_blocks + request.decode_blocks)

        def busy(replica: Replica) -> float:
            return replica.load + replica.active_blocks / size

        def fits(replica: Replica) -> bool:
            free = replica.free_blocks
            return free is None or blocks_needed(request, cached.get(replica.url, 0)) <= free

        within_share = [
            r for r in rotated if not self.recent.over(r.url, len(rotated), self.config.max_share)
        ] or rotated
        best = max((cached.get(r.url, 0) for r in within_share), default=0)
        if best and best >= self.config.match_threshold * request.prompt_blocks:
            holders = sorted((r for r in within_share if cached.get(r.url, 0) == best and fits(r)), key=busy)
            if holders:
                rest = sorted((r for r in rotated if r not in holders), key=busy)
                return Ranked(holders + rest, cached)
        order = sorted(within_share, key=busy)
        return Ranked(order + sorted((r for r in rotated if r not in order), key=busy), cached)

    def learn(self, request: RouteRequest, replica: Replica) -> None:
        self.index.add(request.block_hashes, replica.url)
        self.recent.add(replica.url)
