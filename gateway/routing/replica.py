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
    # the replica's view, from its last /metrics scrape
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    total_blocks: int = 0  # 0 until a scrape says
    outstanding_at_scrape: int = 0
    reserved_at_scrape: int = 0
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
    """KV blocks a request is expected to occupy on one replica, counted there until the response ends.

    Admission claims blocks where they fit; routing may then move them to the replica it prefers. Either way
    the replica's `reserved_blocks` stays right, and `release` is safe to call more than once.
    """

    replica: Replica | None = None
    blocks: int = 0

    def move(self, replica: Replica, blocks: int) -> None:
        self.release()
        replica.reserved_blocks += blocks
        self.replica, self.blocks = replica, blocks

    def release(self) -> None:
        if self.replica is not None:
            self.replica.reserved_blocks -= self.blocks
            self.replica, self.blocks = None, 0
