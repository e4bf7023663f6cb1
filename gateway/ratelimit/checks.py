"""What a backend is asked to decide: one `Check` per limit that applies to a request.

Each is an immutable NamedTuple: several are built per request, and a frozen dataclass's `__init__` costs about
four times as much."""

from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

from gateway.ratelimit.gcra import Outcome


class RateCheck(NamedTuple):
    """Consume `cost` units from a GCRA key (requests: 1; tokens: the reservation)."""

    key: str
    interval: float  # seconds per unit
    tolerance: float  # interval x burst
    cost: float


class SlotCheck(NamedTuple):
    """Take one of `limit` concurrency slots, held by `member` until released or `lease` seconds pass."""

    key: str
    limit: int
    lease: float
    member: str


class BudgetCheck(NamedTuple):
    """Reserve `cost` nanos of a spend budget of `limit` for the period ending at `resets_at` (Unix seconds; the key
    names the period, so a new period starts from nothing). The reservation is held by `member` (the request) until
    a settlement names its final cost, once: settling twice changes nothing, so a settlement whose answer was lost
    can be sent again. Nanos are whole numbers: spend adds up exactly."""

    key: str
    limit: int
    cost: int
    resets_at: float
    member: str


# A BudgetCheck from a tuple, built in C (a NamedTuple's own __new__ is a Python call): one per budget per request.
new_budget_check = functools.partial(tuple.__new__, BudgetCheck)

Check = RateCheck | SlotCheck | BudgetCheck


class Settlement(NamedTuple):
    """What to undo or correct after a decision: cost deltas for rate keys, slots to free, and budget reservations
    with the final cost that replaces each (0 gives one back)."""

    adjustments: tuple[tuple[RateCheck, float], ...] = ()
    releases: tuple[SlotCheck, ...] = ()
    spend: tuple[tuple[BudgetCheck, int], ...] = ()


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

    def settle(self, settlement: Settlement) -> None:
        """Apply cost corrections (negative refunds) and free slots, or hand them to a delivery that does: it never
        waits (the settle phase runs after the response, and nothing may interrupt it halfway), and a store that is
        down gets them when it is back."""
