"""In-process backend: rate limits without Redis (exact for one gateway process), and the fallback for limits and
budgets while their store is unreachable."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.ratelimit.checks import BudgetCheck, Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.gcra import EPSILON, Outcome, gcra, new_outcome

_SWEEP_EVERY = 10_000

# What a check would store if the whole request is allowed: (the dictionary, the key, the value).
Writes = list[tuple[dict[Any, Any], Any, Any]]


@dataclass(slots=True)
class SpendAccount:
    """A budget's spend in one period (a key of its own), the reservations of requests in flight included: what
    the next reservation is decided against."""

    used: int  # nanos
    ends: float  # Unix seconds: the end of the period


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
        self._accounts: dict[str, SpendAccount] = {}  # budget key → its period's account
        self._held: dict[tuple[str, str], int] = {}  # (budget key, request) → its reservation, until settled
        self._ops = 0
        self._opened = 0  # accounts opened: every _SWEEP_EVERY, those of ended periods are dropped

    async def acquire(self, checks: list[Check]) -> list[Outcome]:
        return self.decide(checks)

    def decide(self, checks: list[Check], commit: bool = True) -> list[Outcome]:
        """`acquire` without a coroutine: the rate limiter calls it directly, since nothing here waits. Without
        `commit`, nothing is consumed even if every check allows (another part of the request was refused)."""
        now = self._clock()
        self._ops += 1
        if not self._ops % _SWEEP_EVERY:
            self._sweep(now)
        # each check decides and lists what it would store (a TAT, a lease end, a budget's spend and reservation);
        # the writes are made only if every check allowed the request
        outcomes: list[Outcome] = []
        writes: Writes = []
        reserving: list[tuple[SpendAccount, BudgetCheck]] = []
        allowed = commit
        for check in checks:  # a plain loop: every limited request runs this, and comprehensions cost frames
            if isinstance(check, BudgetCheck):
                outcome = self._budget(check, reserving)
            elif isinstance(check, RateCheck):
                outcome = self._rate(check, now, writes)
            else:
                outcome = self._slot(check, now, writes)
            outcomes.append(outcome)
            allowed = allowed and outcome.allowed
        if allowed:
            for store, key, value in writes:
                store[key] = value
            for account, budget_check in reserving:
                account.used += budget_check.cost
                self._held[budget_check.key, budget_check.member] = budget_check.cost
        return outcomes

    def _open_account(self, key: str, ends: float) -> SpendAccount:
        """The budget period's account, opened at nothing spent if this process has none."""
        account = self._accounts.get(key)
        if account is None or account.ends <= self._wall_clock():  # an ended period is not asked for again
            account = self._accounts[key] = SpendAccount(0, ends)
            self._opened += 1
            if not self._opened % _SWEEP_EVERY:
                self._sweep_accounts()
        return account

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
            account = self._accounts.get(key)
            if reserved is not None and account is not None:
                account.used += cost - reserved

    # Each check returns its outcome and adds to `writes` what to store if all of the request's checks are allowed.

    def _budget(self, check: BudgetCheck, reserving: list[tuple[SpendAccount, BudgetCheck]]) -> Outcome:
        """Whether `check.cost` more fits the budget's limit, what is left after it, and when the period ends."""
        account = self._open_account(check.key, check.resets_at)
        now = self._wall_clock()
        left = check.limit - account.used
        reset = account.ends - now if account.ends > now else 0.0
        if check.cost > left:
            return Outcome(False, left if left > 0 else 0, reset, reset)
        reserving.append((account, check))
        return new_outcome((True, left - check.cost, 0.0, reset))

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
        self._sweep_accounts()

    def _sweep_accounts(self) -> None:
        """Drop the accounts of periods that ended, and what their requests still hold."""
        wall = self._wall_clock()
        self._accounts = {k: account for k, account in self._accounts.items() if account.ends > wall}
        self._held = {k: cost for k, cost in self._held.items() if k[0] in self._accounts}
