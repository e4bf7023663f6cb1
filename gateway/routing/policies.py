"""Routing policies: the order in which a request tries a pool's replicas (the first is the choice).

- `round_robin`: rotate.
- `least_outstanding`: fewest requests in flight from this gateway (needs no scraping).
- `least_load`: fewest requests running + waiting on the replica (scraped, corrected locally between scrapes),
  KV usage breaking near-ties.
- `prefix_affinity` / `kv_events`: the least expected time to first token (`ExpectedTtft`, the default scorer):
  every replica is priced in prompt tokens of prefill work it would do before this request's first token:
      the prompt minus the prefix predicted cached there
    + the prefill this gateway already sent there that has not produced a first token yet
    + other senders' waiting requests (scraped; priced at this prompt's length, the scrape has no token counts)
    + `decode_weight` x sequences decoding there (each rides along in every step of the prefill; calibrated with
      bench/decode_weight_bench.py, docs/benchmarks.md)
    + the cached tokens its new blocks would evict from a full replica (under cache pressure a miss is paid twice:
      now, and when the evicted prefix's owner comes back; the index's per-replica count against the scraped size)
  Replicas where the request's KV blocks do not fit go last; ties keep the rotation. One unit for every term, so
  no term needs a hand-tuned weight against another, unlike a weighted sum of normalised scores (llm-d's
  prefix-cache + queue + KV-utilisation scorers) or SGLang's switch between longest match and shortest queue at
  balance thresholds: a long cached prefix wins exactly while the prefill it saves exceeds the queue it waits in.
  `affinity.scorer: rules` keeps the previous rule-based policy (`PrefixAffinity`, below).
  Both learn from this gateway's own routing decisions; `kv_events` also follows the engines' KV-event streams,
  which add the blocks replies fill and remove evicted ones.
- `affinity.scorer: rules` (`PrefixAffinity`): cache first, load as the guard (SGLang's cache-aware rule, in blocks):
  1. if in-flight load is imbalanced past both thresholds, the least-loaded replica wins;
  2. replicas that took more than `max_share` x their fair share of recent decisions step aside (unless all did);
  3. among the rest, if some replica holds at least `match_threshold` of the prompt's blocks and has free KV
     blocks for the rest of the request, the longest match wins (ties: least loaded);
  4. else (a new prefix) cost = requests in flight + KV blocks in use / blocks per request.
  It counts requests, not work: measured on shared-prefix workloads under cache pressure (docs/benchmarks.md),
  its gain over round robin swung between runs and never reached the tail.
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
    prompt_tokens: int = 0
    block_size: int = 16


def blocks_needed(request: RouteRequest, cached_blocks: int) -> int:
    """New KV blocks the request takes on a replica already holding `cached_blocks` of its prompt."""
    return max(0, request.prompt_blocks - cached_blocks) + request.decode_blocks


@dataclass(slots=True)
class Ranked:
    replicas: list[Replica]
    cached_blocks: dict[str, int]  # predicted, per replica url

    def blocks_needed(self, replica: Replica, request: RouteRequest) -> int:
        return blocks_needed(request, self.cached_blocks.get(replica.url, 0))

    def uncached_tokens(self, replica: Replica, request: RouteRequest) -> int:
        """The prompt tokens `replica` is expected to compute: those past the prefix predicted cached there."""
        return uncached_tokens(request, self.cached_blocks.get(replica.url, 0))


def uncached_tokens(request: RouteRequest, cached_blocks: int) -> int:
    return max(0, request.prompt_tokens - cached_blocks * request.block_size)


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
        rotated = self._rotate(replicas)  # a list of its own, sorted in place where there is an order to find
        if len(rotated) > 1:
            rotated.sort(key=lambda r: r.outstanding)
        return Ranked(rotated, {})


class LeastLoad(RoutingPolicy):
    def __init__(self) -> None:
        self._rotate = Rotation()

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        return Ranked(sorted(self._rotate(replicas), key=lambda r: r.load + r.kv_usage), {})


def evicted_tokens(replica: Replica, request: RouteRequest, cached_blocks: int, held_blocks: int) -> int:
    """Cached tokens the request would push out of a full replica: blocks it adds beyond what is left of the
    replica's KV after the `held_blocks` the index believes cached there (0 until a scrape gives the size)."""
    if not replica.total_blocks:
        return 0
    overflow = held_blocks + blocks_needed(request, cached_blocks) - replica.total_blocks
    return max(0, overflow) * request.block_size


def expected_prefill(
    replica: Replica, request: RouteRequest, cached_blocks: int, decode_weight: float, held_blocks: int = 0
) -> float:
    """Prefill work, in prompt tokens, that routing `request` to `replica` costs: what runs there before its first
    token, plus the cached prefixes it would evict (each is prefilled again when its owner comes back)."""
    return (
        uncached_tokens(request, cached_blocks)
        + evicted_tokens(replica, request, cached_blocks, held_blocks)
        + replica.prefill_tokens
        + replica.foreign_waiting * request.prompt_tokens
        + decode_weight * replica.decoding
    )


class ExpectedTtft(RoutingPolicy):
    """The replica with the least prefill work ahead of this request's first token (module docstring)."""

    def __init__(self, index: PrefixIndex, config: AffinityConfig) -> None:
        self._rotate = Rotation()
        self.index = index
        self.decode_weight = config.decode_weight

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Ranked:
        cached = self.index.matched_blocks(request.block_hashes) if request.block_hashes else {}

        def key(replica: Replica) -> tuple[bool, float]:
            matched = cached.get(replica.url, 0)
            free = replica.free_blocks
            fits = free is None or blocks_needed(request, matched) <= free
            held = self.index.blocks_held(replica.url)
            return not fits, expected_prefill(replica, request, matched, self.decode_weight, held)

        return Ranked(sorted(self._rotate(replicas), key=key), cached)

    def learn(self, request: RouteRequest, replica: Replica) -> None:
        self.index.add(request.block_hashes, replica.url, replica.total_blocks or None)


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
        self.index.add(request.block_hashes, replica.url, replica.total_blocks or None)
        self.recent.add(replica.url)
