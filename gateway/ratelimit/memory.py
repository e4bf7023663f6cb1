"""In-process backend: exact for one gateway process, and the fallback when Redis is unreachable."""

from __future__ import annotations

import time

from gateway.ratelimit.checks import Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.gcra import Outcome, gcra

_SWEEP_EVERY = 10_000


class MemoryBackend:
    name = "memory"

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._tats: dict[str, float] = {}
        self._slots: dict[str, dict[str, float]] = {}
        self._ops = 0

    async def acquire(self, checks: list[Check]) -> list[Outcome]:
        now = self._clock()
        self._maybe_sweep(now)
        return [self._rate(c, now) if isinstance(c, RateCheck) else self._slot(c, now) for c in checks]

    async def settle(self, settlement: Settlement) -> None:
        now = self._clock()
        for check, delta in settlement.adjustments:
            tat = max(self._tats.get(check.key, now), now) + check.interval * delta
            if tat > now:
                self._tats[check.key] = tat
            else:
                self._tats.pop(check.key, None)
        for check in settlement.releases:
            self._slots.get(check.key, {}).pop(check.member, None)

    def _rate(self, check: RateCheck, now: float) -> Outcome:
        outcome, tat = gcra(self._tats.get(check.key, now), now, check.interval, check.tolerance, check.cost)
        if outcome.allowed:
            self._tats[check.key] = tat
        return outcome

    def _slot(self, check: SlotCheck, now: float) -> Outcome:
        holders = self._slots.setdefault(check.key, {})
        for member in [m for m, expiry in holders.items() if expiry <= now]:
            del holders[member]
        if len(holders) >= check.limit:
            return Outcome(False, 0, min(holders.values()) - now, min(holders.values()) - now)
        holders[check.member] = now + check.lease
        return Outcome(True, check.limit - len(holders), 0.0, 0.0)

    def _maybe_sweep(self, now: float) -> None:
        """Drop keys that are back at full capacity so memory stays bounded by active keys."""
        self._ops += 1
        if self._ops % _SWEEP_EVERY:
            return
        self._tats = {k: t for k, t in self._tats.items() if t > now}
        self._slots = {k: h for k, h in self._slots.items() if any(e > now for e in h.values())}
