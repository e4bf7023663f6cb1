"""One upstream replica as the router sees it: health, scraped load, and this gateway's own corrections."""

from __future__ import annotations

import time
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(slots=True, eq=False)
class Replica:
    url: str
    # this gateway's own view, always current
    outstanding: int = 0  # requests in flight from this gateway
    reserved_blocks: int = 0  # KV blocks this gateway's in-flight requests are expected to hold
    prefilling: int = 0  # requests this gateway sent that have not produced their first token yet
    prefill_tokens: int = 0  # their prompt tokens still to compute (predicted cached prefix excluded)
    # the replica's view, from its last /metrics scrape
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    total_blocks: int = 0  # 0 until a scrape says
    outstanding_at_scrape: int = 0
    reserved_at_scrape: int = 0
    prefilling_at_scrape: int = 0
    # health: active (scrapes) and passive (upstream attempts)
    failures: int = 0
    ejected_until: float = 0.0

    @property
    def address(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)

    def available(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) >= self.ejected_until

    @property
    def load(self) -> int:
        """Requests running or waiting on the replica, corrected by what this gateway sent since the scrape."""
        return max(0, self.running + self.waiting + self.outstanding - self.outstanding_at_scrape)

    @property
    def active_blocks(self) -> int:
        """KV blocks in use, corrected likewise between scrapes."""
        scraped = round(self.kv_usage * self.total_blocks)
        return max(0, scraped + self.reserved_blocks - self.reserved_at_scrape)

    @property
    def free_blocks(self) -> int | None:
        return max(0, self.total_blocks - self.active_blocks) if self.total_blocks else None

    def observe(self, running: int, waiting: int, kv_usage: float, total_blocks: int) -> None:
        self.running, self.waiting, self.kv_usage = running, waiting, kv_usage
        if total_blocks:
            self.total_blocks = total_blocks
        self.outstanding_at_scrape, self.reserved_at_scrape = self.outstanding, self.reserved_blocks
        self.prefilling_at_scrape = self.prefilling

    @property
    def foreign_waiting(self) -> int:
        """Requests waiting on the replica beyond this gateway's own not-yet-started ones, at the last scrape: other
        senders' queue, whose prompt lengths the scrape does not tell."""
        return max(0, self.waiting - self.prefilling_at_scrape)

    @property
    def decoding(self) -> int:
        """Sequences past their prefill on the replica (and other senders' running ones), corrected between
        scrapes: every step of a new prompt's prefill carries them."""
        return max(0, self.load - self.prefilling - self.foreign_waiting)

    def record(self, ok: bool, failures_to_eject: int, eject_seconds: float) -> None:
        """Passive and active health: eject after consecutive failures, re-admit once the ejection lapses."""
        if ok:
            self.failures, self.ejected_until = 0, 0.0
            return
        self.failures += 1
        if self.failures >= failures_to_eject:
            self.ejected_until = time.monotonic() + eject_seconds

    @property
    def state(self) -> str:
        return "healthy" if self.available() else "ejected"


@dataclass(slots=True)
class KvHold:
    """What a request is expected to put on one replica: KV blocks, counted there until the response ends, and its
    prefill (uncached prompt tokens), counted until its first token arrives.

    Admission claims blocks where they fit; routing may then move them, with the prefill, to the replica it prefers.
    Either way the replica's `reserved_blocks` and `prefill_tokens` stay right; `release` and `prefill_done` are
    safe to call more than once.
    """

    replica: Replica | None = None
    blocks: int = 0
    prefill: int = 0
    prefilling: bool = False

    def move(self, replica: Replica, blocks: int, prefill: int | None = None) -> None:
        """Hold `blocks` on `replica`; with `prefill` (routing's move), also that many tokens of queued prefill."""
        self.release()
        replica.reserved_blocks += blocks
        self.replica, self.blocks = replica, blocks
        if prefill is not None:
            replica.prefilling += 1
            replica.prefill_tokens += prefill
            self.prefill, self.prefilling = prefill, True

    def prefill_done(self) -> None:
        """The first token arrived: the replica no longer has this request's prefill ahead of others."""
        if self.replica is not None and self.prefilling:
            self.replica.prefilling -= 1
            self.replica.prefill_tokens -= self.prefill
            self.prefill, self.prefilling = 0, False

    def release(self) -> None:
        self.prefill_done()
        if self.replica is not None:
            self.replica.reserved_blocks -= self.blocks
            self.replica, self.blocks = None, 0
