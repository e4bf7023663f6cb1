"""What a backend is asked to decide: one `Check` per limit that applies to a request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.ratelimit.gcra import Outcome


@dataclass(frozen=True, slots=True)
class RateCheck:
    """Consume `cost` units from a GCRA key (requests: 1; tokens: the reservation)."""

    key: str
    interval: float  # seconds per unit
    tolerance: float  # interval x burst
    cost: float


@dataclass(frozen=True, slots=True)
class SlotCheck:
    """Take one of `limit` concurrency slots, held by `member` until released or `lease` seconds pass."""

    key: str
    limit: int
    lease: float
    member: str


Check = RateCheck | SlotCheck


@dataclass(frozen=True, slots=True)
class Settlement:
    """What to undo or correct after a decision: cost deltas for rate keys, slots to free."""

    adjustments: tuple[tuple[RateCheck, float], ...] = ()
    releases: tuple[SlotCheck, ...] = ()


class BackendError(Exception):
    """The shared store could not answer; the limiter then fails open or closed as configured.

    `maybe_applied`: the operations were sent whole and no answer came back, so the store may have applied them
    (a timeout, a connection lost while waiting); otherwise they certainly were not applied.
    """

    def __init__(self, message: str, *, maybe_applied: bool = False) -> None:
        super().__init__(message)
        self.maybe_applied = maybe_applied


class Backend(Protocol):
    name: str

    async def acquire(self, checks: list[Check]) -> list[Outcome]:
        """Decide one request's checks (each on its own key) atomically: if any is denied, none consumes anything."""

    async def settle(self, settlement: Settlement) -> None:
        """Apply cost corrections (negative refunds) and free slots; may return before the store has applied them,
        and then delivers them later (a store that is down gets them when it is back)."""
