"""The Generic Cell Rate Algorithm: one stored timestamp per key, smooth rates, no bursts at window edges.

Each unit of cost pushes the key's theoretical arrival time (TAT) `interval` seconds into the future; a request is
allowed while the TAT it would leave is no more than `tolerance` (= interval x burst) ahead of now. Over any span of
time the allowed cost therefore never exceeds burst + elapsed / interval. `lua/batch.lua` runs the same arithmetic
inside Redis (tests/integration/test_gcra_parity.py holds the two to the same decisions).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple


class Outcome(NamedTuple):
    """One check's decision (a NamedTuple: one is built per check per request, at a fraction of a frozen
    dataclass's cost)."""

    allowed: bool
    remaining: int  # units still available right now (after this request, if allowed)
    retry_after: float  # seconds until this request would be allowed (0 when allowed)
    reset: float  # seconds until the key is back to its full burst


# An Outcome from a tuple, built in C: a NamedTuple's own __new__ is a Python call, and the hot paths build one per
# check per request.
new_outcome = functools.partial(tuple.__new__, Outcome)

EPSILON = 1e-9  # seconds: float rounding must not turn an exact fit into a denial, nor keep a lease past its end


def _units(span: float, interval: float) -> int:
    return max(0, math.floor(span / interval + 1e-6))


def gcra(tat: float, now: float, interval: float, tolerance: float, cost: float) -> tuple[Outcome, float]:
    """Decide one request; returns the outcome and the TAT to store (unchanged when denied).

    The arithmetic is on how far the TAT is ahead of now: small numbers, where rounding stays far below EPSILON
    however large the clock's readings grow."""
    tat = max(tat, now)
    ahead = tat - now
    new_ahead = ahead + interval * cost
    allow_at = new_ahead - tolerance
    if allow_at > EPSILON:
        return Outcome(False, _units(tolerance - ahead, interval), allow_at, ahead), tat
    return Outcome(True, _units(tolerance - new_ahead, interval), 0.0, new_ahead), now + new_ahead
