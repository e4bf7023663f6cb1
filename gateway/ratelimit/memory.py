"""In-process backend: exact for one gateway process, and the fallback when Redis is unreachable."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.ratelimit.checks import BudgetCheck, Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.gcra import EPSILON, Outcome, gcra, new_outcome

_SWEEP_EVERY = 10_000

# What a check would store if the whole request is allowed: (the dictionary, the key, the value).
Writes = list[tuple[dict[Any, Any], Any, Any]]


class MemoryBackend:
    name = "memory"

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time
    ) -> None:
        """`wall_clock`: Unix seconds, for budgets, whose periods are calendar days and months."""
        self._clock = clock
        self._wall_clock = wall_clock
        self._tats: dict[str, float] = {}
        self._slots: dict[str, dict[str, float]] = {}
        self._spent: dict[str, tuple[int, float]] = {}  # budget key → (nanos spent or reserved, period end)
        self._held: dict[tuple[str, str], int] = {}  # (budget key, request) → its reservation, until settled
        self._ops = 0

    async def acquire(self, checks: list[Check]) -> list[Outcome]:
        return self.decide(checks)

    def decide(self, checks: list[Check]) -> list[Outcome]:
        """`acquire` without a coroutine: the rate limiter calls it directly, since nothing here waits."""
        now = self._clock()
        self._ops += 1
        if not self._ops % _SWEEP_EVERY:
            self._sweep(now)
        # each check decides and lists what it would store (a TAT, a lease end, a budget's spend and reservation);
        # the writes are made only if every check allowed the request
        outcomes: list[Outcome] = []
        writes: Writes = []
        allowed = True
        for check in checks:  # a plain loop: every limited request runs this, and comprehensions cost frames
            if isinstance(check, BudgetCheck):
                outcome = self._budget(check, writes)
            elif isinstance(check, RateCheck):
                outcome = self._rate(check, now, writes)
            else:
                outcome = self._slot(check, now, writes)
            outcomes.append(outcome)
            allowed = allowed and outcome.allowed
        if allowed:
            for store, key, value in writes:
                store[key] = value
        return outcomes

    def seed(self, check: BudgetCheck, spent: int) -> None:
        """Start a budget's period from what the spend ledger says was spent in it (after a restart); a period this
        process already counts keeps its own count, which is the more recent."""
        self._spent.setdefault(check.key, (spent, check.resets_at))

    def settle(self, settlement: Settlement) -> None:
        adjustments, releases, spend = settlement
        if adjustments:
            now = self._clock()
            for check, delta in adjustments:
                tat = max(self._tats.get(check.key, now), now) + check.interval * delta
                if tat > now:
                    self._tats[check.key] = tat
                else:
                    self._tats.pop(check.key, None)
        for slot in releases:
            self._slots.get(slot.key, {}).pop(slot.member, None)
        for (key, _, _, _, member), cost in spend:
            reserved = self._held.pop((key, member), None)
            counted = self._spent.get(key)
            if reserved is not None and counted is not None:
                self._spent[key] = (counted[0] + cost - reserved, counted[1])

    # Each check returns its outcome and adds to `writes` what to store if all of the request's checks are allowed.

    def _budget(self, check: BudgetCheck, writes: Writes) -> Outcome:
        key, limit, cost, resets_at, member = check
        now = self._wall_clock()
        counted = self._spent.get(key)
        # a period that ended is not asked for again: this is a clock at the boundary
        left = limit - counted[0] if counted is not None and counted[1] > now else limit
        reset = resets_at - now if resets_at > now else 0.0
        if cost > left:
            return Outcome(False, left if left > 0 else 0, reset, reset)
        writes.append((self._spent, key, (limit - left + cost, resets_at)))
        writes.append((self._held, (key, member), cost))
        return new_outcome((True, left - cost, 0.0, reset))

    def _rate(self, check: RateCheck, now: float, writes: Writes) -> Outcome:
        outcome, tat = gcra(self._tats.get(check.key, now), now, check.interval, check.tolerance, check.cost)
        writes.append((self._tats, check.key, tat))
        return outcome

    def _slot(self, check: SlotCheck, now: float, writes: Writes) -> Outcome:
        holders = self._slots.setdefault(check.key, {})
        for member in [m for m, expiry in holders.items() if expiry <= now + EPSILON]:  # ran out: holds nothing
            del holders[member]
        if len(holders) >= check.limit:
            wait = min(holders.values()) - now
            return Outcome(False, 0, wait, wait)
        writes.append((holders, check.member, now + check.lease))
        return Outcome(True, check.limit - len(holders) - 1, 0.0, 0.0)

    def _sweep(self, now: float) -> None:
        """Drop keys that are back at full capacity so memory stays bounded by active keys (every `_SWEEP_EVERY`
        decisions)."""
        self._tats = {k: t for k, t in self._tats.items() if t > now}
        self._slots = {k: h for k, h in self._slots.items() if any(e > now for e in h.values())}
        wall = self._wall_clock()
        self._spent = {k: held for k, held in self._spent.items() if held[1] > wall}
        self._held = {k: cost for k, cost in self._held.items() if k[0] in self._spent}
