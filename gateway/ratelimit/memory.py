"""In-process backend: exact for one gateway process, and the fallback when Redis is unreachable."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.ratelimit.checks import Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.gcra import EPSILON, Outcome, gcra

_SWEEP_EVERY = 10_000


class MemoryBackend:
    name = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tats: dict[str, float] = {}
        self._slots: dict[str, dict[str, float]] = {}
        self._ops = 0

    async def acquire(self, checks: list[Check]) -> list[Outcome]:
        now = self._clock()
        self._maybe_sweep(now)
        decided = [self._rate(c, now) if isinstance(c, RateCheck) else self._slot(c, now) for c in checks]
        if all(outcome.allowed for outcome, _ in decided):
            for check, (_, stored) in zip(checks, decided):
                if isinstance(check, RateCheck):
                    self._tats[check.key] = stored
                else:
                    self._slots[check.key][check.member] = stored
        return [outcome for outcome, _ in decided]

    async def settle(self, settlement: Settlement) -> None:
        now = self._clock()
        for check, delta in settlement.adjustments:
            tat = max(self._tats.get(check.key, now), now) + check.interval * delta
            if tat > now:
                self._tats[check.key] = tat
            else:
                self._tats.pop(check.key, None)
        for slot in settlement.releases:
            self._slots.get(slot.key, {}).pop(slot.member, None)

    # Each check returns its outcome and what to store if all of the request's checks are allowed: a TAT or a lease end.

    def _rate(self, check: RateCheck, now: float) -> tuple[Outcome, float]:
        return gcra(self._tats.get(check.key, now), now, check.interval, check.tolerance, check.cost)

    def _slot(self, check: SlotCheck, now: float) -> tuple[Outcome, float]:
        holders = self._slots.setdefault(check.key, {})
        for member in [m for m, expiry in holders.items() if expiry <= now + EPSILON]:  # ran out: holds nothing
            del holders[member]
        if len(holders) >= check.limit:
            wait = min(holders.values()) - now
            return Outcome(False, 0, wait, wait), now
        return Outcome(True, check.limit - len(holders) - 1, 0.0, 0.0), now + check.lease

    def _maybe_sweep(self, now: float) -> None:
        """Drop keys that are back at full capacity so memory stays bounded by active keys."""
        self._ops += 1
        if self._ops % _SWEEP_EVERY:
            return
        self._tats = {k: t for k, t in self._tats.items() if t > now}
        self._slots = {k: h for k, h in self._slots.items() if any(e > now for e in h.values())}
