"""In-process backend: exact for one gateway process, and the fallback when Redis is unreachable."""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.ratelimit.checks import BudgetCheck, Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.gcra import EPSILON, Outcome, gcra

_SWEEP_EVERY = 10_000


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
        outcomes, values, allowed = [], [], True
        for check in checks:  # a plain loop: every limited request runs this, and comprehensions cost frames
            outcome, value = self._budget(check) if isinstance(check, BudgetCheck) else self._rate_or_slot(check, now)
            outcomes.append(outcome)
            values.append(value)
            allowed = allowed and outcome.allowed
        if allowed:
            for check, value in zip(checks, values):
                if isinstance(check, BudgetCheck):
                    self._spent[check.key] = (int(value), check.resets_at)
                    self._held[check.key, check.member] = check.cost
                elif isinstance(check, RateCheck):
                    self._tats[check.key] = value
                else:
                    self._slots[check.key][check.member] = value
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
        for budget, cost in spend:
            reserved = self._held.pop((budget.key, budget.member), None)
            if reserved is not None and budget.key in self._spent:
                spent, resets_at = self._spent[budget.key]
                self._spent[budget.key] = (spent + cost - reserved, resets_at)

    # Each check returns its outcome and what to store if all of the request's checks are allowed: a TAT, a lease end
    # or a budget's new spend.

    def _rate_or_slot(self, check: Check, now: float) -> tuple[Outcome, float]:
        if isinstance(check, RateCheck):
            return self._rate(check, now)
        assert isinstance(check, SlotCheck)
        return self._slot(check, now)

    def _budget(self, check: BudgetCheck) -> tuple[Outcome, float]:
        now = self._wall_clock()
        counted = self._spent.get(check.key)
        # a period that ended is not asked for again: this is a clock at the boundary
        spent = counted[0] if counted is not None and counted[1] > now else 0
        reset = max(check.resets_at - now, 0.0)
        if spent + check.cost > check.limit:
            return Outcome(False, max(check.limit - spent, 0), reset, reset), spent
        return Outcome(True, check.limit - spent - check.cost, 0.0, reset), spent + check.cost

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

    def _sweep(self, now: float) -> None:
        """Drop keys that are back at full capacity so memory stays bounded by active keys (every `_SWEEP_EVERY`
        decisions)."""
        self._tats = {k: t for k, t in self._tats.items() if t > now}
        self._slots = {k: h for k, h in self._slots.items() if any(e > now for e in h.values())}
        wall = self._wall_clock()
        self._spent = {k: held for k, held in self._spent.items() if held[1] > wall}
        self._held = {k: cost for k, cost in self._held.items() if k[0] in self._spent}
