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
        now = self._clock()
        self._ops += 1
        if not self._ops % _SWEEP_EVERY:
            self._sweep(now)
        outcomes, stored, allowed = [], [], True
        for check in checks:  # one pass, no intermediate lists: every limited request runs this
            outcome, value = self._decide(check, now)
            outcomes.append(outcome)
            stored.append(value)
            allowed = allowed and outcome.allowed
        if allowed:
            for check, value in zip(checks, stored):
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

    async def settle(self, settlement: Settlement) -> None:
        now = self._clock() if settlement.adjustments else 0.0
        for check, delta in settlement.adjustments:
            tat = max(self._tats.get(check.key, now), now) + check.interval * delta
            if tat > now:
                self._tats[check.key] = tat
            else:
                self._tats.pop(check.key, None)
        for slot in settlement.releases:
            self._slots.get(slot.key, {}).pop(slot.member, None)
        for budget, cost in settlement.spend:
            reserved = self._held.pop((budget.key, budget.member), None)
            if reserved is not None and budget.key in self._spent:
                spent, resets_at = self._spent[budget.key]
                self._spent[budget.key] = (spent + cost - reserved, resets_at)

    # Each check returns its outcome and what to store if all of the request's checks are allowed: a TAT, a lease end
    # or a budget's new spend.

    def _decide(self, check: Check, now: float) -> tuple[Outcome, float]:
        if isinstance(check, RateCheck):
            return self._rate(check, now)
        if isinstance(check, SlotCheck):
            return self._slot(check, now)
        return self._budget(check)

    def _budget(self, check: BudgetCheck) -> tuple[Outcome, float]:
        now = self._wall_clock()
        spent, resets_at = self._spent.get(check.key, (0, check.resets_at))
        if resets_at <= now:  # the period ended: its key is not asked for again, this is a clock at the boundary
            spent = 0
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
