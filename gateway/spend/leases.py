"""Budget slices leased from the shared store: most requests under a budget in Redis decide in this process.

Deciding each request's budget in Redis costs a round trip a request. Instead this process takes a slice of the
budget at a time: a reservation in the store like a request's (the batch script's budget check, under a member name
of its own), of up to LEASE_REQUESTS times the request's cost and never more than 1/SHARE of what the store had left.
Requests reserve on the slice here until it cannot hold the next one; then a new slice is taken and the old one is
settled, once its requests have ended, at what they used (the script's budget settlement: replaced once, exactly).
So the store's counter never passes the limit (no slice is granted past it), and once every slice is settled it is
the sum of the requests' costs.

Near the limit (less than SHARE x LEASE_REQUESTS reservations left), slices shrink with what is left, down to
exactly the request's cost when less than SHARE + 1 reservations' worth is left, and each is settled as soon as no
request is in flight on it: the last requests are decided one by one in the store, as without slices, and no
instance holds back more than its requests in flight. Far from it, a slice nothing has used for IDLE seconds is
settled. A process
killed outright leaves its open slices counted until their period ends: at most LEASE_REQUESTS reservations per
budget, never an overshoot.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.ratelimit.checks import Backend, BudgetCheck, Settlement, new_budget_check
from gateway.ratelimit.failover import FailoverBackend
from gateway.ratelimit.gcra import Outcome

LEASE_REQUESTS = 128  # a slice holds at most this many of the request's reservations
SHARE = 16  # and at most 1/SHARE of what the store had left
IDLE = 1.0  # seconds a slice with no request in flight is kept before it is settled
_RETRIES = 3  # slices with room for others one request takes before it takes exact ones


@dataclass(slots=True)
class Lease:
    """A slice of one budget period: `check.cost` nanos held in `backend` under `check.member`."""

    check: BudgetCheck
    backend: Backend  # the store that granted it (the local fallback while Redis is down): it is settled there
    used: int = 0  # nanos reserved or spent by requests on it
    open: int = 0  # its requests in flight
    current: bool = True  # new requests may reserve on it
    kept: bool = True  # kept while idle (up to IDLE seconds); near the limit, settled as soon as nothing is in flight
    touched: float = 0.0  # Unix seconds of its last reservation


@dataclass(slots=True)
class LeaseAccount:
    """This process's view of one budget period in the store."""

    ends: float  # Unix seconds: the end of the period (the account is forgotten after it)
    lease: Lease | None = None
    remaining: int | None = None  # what the store had left after granting this process's last slice
    taking: asyncio.Future[None] | None = None  # a new slice being asked for: later requests wait for it


class BudgetLeases:
    def __init__(self, backend: FailoverBackend) -> None:
        self._backend = backend
        self._accounts: dict[str, LeaseAccount] = {}  # budget period key → its account
        self._members = (f"lease:{secrets.token_hex(8)}:{n}" for n in itertools.count())
        self._sweeper: asyncio.Task[None] | None = None

    def reserve_held(self, keys: Sequence[str], cost: int, now: float) -> list[Lease] | None:
        """Reserve `cost` on this process's current slice of each budget period, if every one of them holds it
        (most requests: no store, no coroutine); else None, and nothing is reserved."""
        leases = []
        for key in keys:
            account = self._accounts.get(key)
            lease = account.lease if account is not None else None
            if lease is None or not _fits(lease, cost):
                return None
            leases.append(lease)
        return _reserve_on(leases, cost, now)

    def left(self, key: str) -> int:
        """What is left of the budget period as this process knows it: the store's last word and what this
        process's slice still holds."""
        account = self._accounts.get(key)
        return 0 if account is None else _left(account)

    async def reserve(
        self, keys: Sequence[str], limits: Sequence[int], ends: Sequence[float], cost: int
    ) -> tuple[list[Lease], None] | tuple[None, list[Outcome]]:
        """`reserve_held`, taking new slices from the store where this process's do not hold `cost` (`limits` and
        period `ends` per budget period); all or none. Returns the slices reserved on, or the store's refusal (per
        budget, what is left)."""
        accounts = []
        for key, end in zip(keys, ends):
            account = self._accounts.get(key)
            if account is None:
                account = self._accounts[key] = LeaseAccount(end)
            accounts.append(account)
        takes = 0
        while short := [i for i, account in enumerate(accounts) if not _fits(account.lease, cost)]:
            taking = next((accounts[i].taking for i in short if accounts[i].taking is not None), None)
            if taking is not None:  # another request is taking a slice of it: wait for that one
                await asyncio.shield(taking)
                continue
            # exact slices after a few: a request whose other budgets others keep using up is decided alone
            refused = await self._take(keys, limits, ends, cost, accounts, short, takes >= _RETRIES)
            takes += 1
            if refused is not None:
                wall = time.time()
                return None, [
                    refused.get(i) or Outcome(True, _left(account) - cost, 0.0, max(end - wall, 0.0))
                    for i, (account, end) in enumerate(zip(accounts, ends))
                ]
        # nothing waited since every slice was found to hold the request: no other request can have used them
        leases = []
        for account in accounts:
            assert account.lease is not None
            leases.append(account.lease)
        return _reserve_on(leases, cost, time.time()), None

    def settle(self, leases: Sequence[Lease], correction: int) -> None:
        """A request on these slices ended: its reservation is corrected by `correction` (its cost less it)."""
        for lease in leases:
            lease.used += correction
            lease.open -= 1
            if not lease.open and not (lease.current and lease.kept):
                _settle(lease)

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="budget-leases")

    async def aclose(self) -> None:
        """Settle every slice at what it has used (a request still in flight counts at its reservation)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for account in self._accounts.values():
            if account.lease is not None:
                _settle(account.lease)
                account.lease = None

    async def _take(
        self,
        keys: Sequence[str],
        limits: Sequence[int],
        ends: Sequence[float],
        cost: int,
        accounts: Sequence[LeaseAccount],
        short: Sequence[int],
        exact: bool,
    ) -> dict[int, Outcome] | None:
        """New slices for the budgets at `short`, all or none; None once granted, else the store's outcome for
        each of them."""
        taking = asyncio.get_running_loop().create_future()
        for i in short:
            accounts[i].taking = taking
        try:
            extra = [0 if exact else _extra(accounts[i].remaining, cost) for i in short]
            for attempt in (extra, [0] * len(short)):  # a slice refused: the request alone may still fit
                checks = [
                    new_budget_check((keys[i], limits[i], cost + more, ends[i], next(self._members)))
                    for i, more in zip(short, attempt)
                ]
                decided, backend = await self._backend.acquire(list(checks))
                if all(outcome.allowed for outcome in decided):
                    break
                if not any(attempt):
                    return dict(zip(short, decided))
            for i, check, outcome in zip(short, checks, decided):
                account = accounts[i]
                kept = _extra(outcome.remaining, cost) >= LEASE_REQUESTS * cost  # far from the limit
                old, account.lease = account.lease, Lease(check, backend, kept=kept)
                account.remaining = outcome.remaining
                if old is not None and old.current:  # not settled yet
                    old.current = False
                    if not old.open:
                        _settle(old)
            return None
        finally:
            for i in short:
                accounts[i].taking = None
            taking.set_result(None)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(IDLE / 2)
            self._sweep(time.time())

    def _sweep(self, now: float) -> None:
        """Settle the slices idle for IDLE seconds; forget the periods that ended (a period's account is kept while
        it lasts: a request may be taking a slice of it)."""
        for key, account in list(self._accounts.items()):
            lease = account.lease
            if lease is not None and not lease.open and now - lease.touched >= IDLE:
                account.lease = None
                _settle(lease)
            if account.lease is None and account.ends <= now:
                del self._accounts[key]


def _reserve_on(leases: list[Lease], cost: int, now: float) -> list[Lease]:
    for lease in leases:
        lease.used += cost
        lease.open += 1
        lease.touched = now
    return leases


def _fits(lease: Lease | None, cost: int) -> bool:
    return lease is not None and lease.current and lease.used + cost <= lease.check.cost


def _left(account: LeaseAccount) -> int:
    """The store's last word on what is left, and what this process's slice still holds."""
    lease = account.lease
    spare = lease.check.cost - lease.used if lease is not None and lease.current else 0
    return (account.remaining or 0) + spare


def _extra(remaining: int | None, cost: int) -> int:
    """What a new slice holds beyond the request: nothing until the store has said what it has left."""
    if remaining is None:
        return 0
    return max(0, min(LEASE_REQUESTS * cost, (remaining - cost) // SHARE))


def _settle(lease: Lease) -> None:
    lease.current = False
    lease.backend.settle(Settlement(spend=((lease.check, lease.used),)))
