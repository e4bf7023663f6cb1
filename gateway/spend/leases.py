"""Budget slices leased from the shared store: most requests under a budget in Redis or the SQLite file decide in
this process.

Deciding each request's budget in the store costs a round trip (or a transaction) a request. Instead this process
takes a slice of the budget at a time: a reservation in the store like a request's (the store's budget check, under
a member name of its own) of a whole number of the request's reservations, up to LEASE_REQUESTS of them and never
more than 1/SHARE of what the store had left. Requests reserve on the slice here until it cannot hold the next one;
then a new slice is taken and the old one is settled, once its requests have ended, at what they used (the store's
budget settlement: replaced once, exactly). So the store's counter never passes the limit (no slice is granted past
it), and once every slice is settled it is the sum of the requests' costs.

Far from the limit (a whole slice of LEASE_REQUESTS is less than 1/SHARE of what is left), once a slice has less
than 1/AHEAD of its room left, the next one is taken in the background (the spare): requests move on to it when the
current one is full, and none waits for the store. Such a slice that nothing has used for IDLE seconds is settled.

Nearer the limit slices shrink with what is left, and each is settled as soon as no request is in flight on it.
With fewer than 2 x SHARE reservations left, a slice is exactly its request's reservation: the last requests are
decided one by one in the store, as without slices, and no instance holds back more than its requests in flight, so
a burst over several instances is served exactly as far as the budget goes.

While the store is down and the limiter fails open, the fallback (this process's memory) decides: a slice it
grants holds its request alone and is settled when that request ends, so each request asks again and the first
after the store is back (and the breaker closed) is decided in the store, not on the rest of a slice the outage
handed out.

A process killed outright leaves its open slices counted until their period ends (the current one, a spare, and any
retired one whose requests were still running): an undershoot, never an overshoot.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.ratelimit.checks import Backend, BudgetCheck, Settlement, new_budget_check
from gateway.ratelimit.failover import FailoverBackend
from gateway.ratelimit.gcra import Outcome

if TYPE_CHECKING:
    from gateway.spend.budgets import AppliedBudget


LEASE_REQUESTS = 128  # a slice holds at most this many of the request's reservations
SHARE = 16  # and at most 1/SHARE of what the store had left: below 2 x SHARE reservations left, exactly one
# far from the limit, the next slice is taken once the current one has less than 1/AHEAD of its room left: half, so
# that at 32 requests in flight the spare is in hand before the current slice is full even where taking it waits
# out the worker thread's turn at the GIL (several ms on a loaded host); a quarter left made one request in nine wait
AHEAD = 2
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
    spare: Lease | None = None  # the next slice, taken ahead while `lease` runs low: nothing reserved on it yet
    remaining: int | None = None  # what the store had left after granting this process's last slice
    taking: asyncio.Future[None] | None = None  # a new slice being asked for: later requests wait for it
    ahead_after: float = 0.0  # Unix seconds: no slice is taken ahead before (the store refused one, or failed)


class BudgetLeases:
    def __init__(self, backend: FailoverBackend) -> None:
        self._backend = backend
        self._accounts: dict[str, LeaseAccount] = {}  # budget period key → its account
        self._members = (f"lease:{secrets.token_hex(8)}:{n}" for n in itertools.count())
        self._sweeper: asyncio.Task[None] | None = None
        self._ahead: set[asyncio.Task] = set()  # slices being taken ahead
        self._closing = False  # no slice is taken ahead once stopping has begun

    def reserve_held(
        self, applied: Sequence[AppliedBudget], keys: Sequence[str], cost: int, now: float
    ) -> list[Lease] | None:
        """Reserve `cost` on this process's slices of each budget period (`keys`, one per budget) if every one of
        them holds it and none is left at or below a soft threshold (most requests: no store, no coroutine, no
        outcome to build); else None, and nothing is reserved."""
        leases = []
        for budget, key in zip(applied, keys):
            account = self._accounts.get(key)
            if account is None:
                return None
            lease = _holding(account, cost)
            if lease is None:
                return None
            if _left(account) - cost <= budget.quiet_above:
                return None
            room = lease.check.cost - lease.used - cost
            if room * AHEAD < lease.check.cost and lease.kept and account.spare is None and account.taking is None:
                if now >= account.ahead_after and not self._closing:
                    self._take_ahead(budget, key, account, cost)
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
        while short := [i for i, account in enumerate(accounts) if _holding(account, cost) is None]:
            taking = next((accounts[i].taking for i in short if accounts[i].taking is not None), None)
            if taking is not None:  # a slice of it is being taken (for another request, or ahead): wait for it
                await asyncio.shield(taking)
                continue
            # exact slices after a few: a request whose other budgets others keep using up is decided alone
            exact = takes >= _RETRIES
            refused = await self._take(keys, limits, ends, cost, accounts, short, _claim(accounts, short), exact)
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
        """Settle every slice at what it has used (a request still in flight counts at its reservation), once the
        slices being taken ahead have come (or failed)."""
        self._closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        while self._ahead:
            await asyncio.gather(*list(self._ahead), return_exceptions=True)
        for account in self._accounts.values():
            for lease in (account.lease, account.spare):
                if lease is not None:
                    _settle(lease)
            account.lease = account.spare = None

    def _take_ahead(self, budget: AppliedBudget, key: str, account: LeaseAccount, cost: int) -> None:
        """Take the next slice of one budget period in the background, for requests to move on to."""
        taking = _claim([account], [0])  # at once: the requests before the task starts must not take another
        task = asyncio.create_task(self._take_spare(key, budget.limit, budget.counter.end, account, cost, taking))
        self._ahead.add(task)

        def done(task: asyncio.Task) -> None:
            self._ahead.discard(task)
            if not taking.done():  # cancelled before it ran: its waiters must not wait for ever
                account.taking = None
                taking.set_result(None)

        task.add_done_callback(done)

    async def _take_spare(
        self, key: str, limit: int, end: float, account: LeaseAccount, cost: int, taking: asyncio.Future[None]
    ) -> None:
        try:  # _take answers the store's refusal, or None once granted
            granted = (
                await self._take([key], [limit], [end], cost, [account], [0], taking, exact=False, ahead=True) is None
            )
        except Exception:  # the store is down (and failing closed): the requests that need a slice meet it and say so
            granted = False
        if not granted:  # not again for a while, rather than once a request until the slice is full
            account.ahead_after = time.time() + IDLE

    async def _take(
        self,
        keys: Sequence[str],
        limits: Sequence[int],
        ends: Sequence[float],
        cost: int,
        accounts: Sequence[LeaseAccount],
        short: Sequence[int],
        taking: asyncio.Future[None],
        exact: bool,
        ahead: bool = False,
    ) -> dict[int, Outcome] | None:
        """New slices for the budgets at `short` (whose accounts `taking` is claimed on), all or none; None once
        granted, else the store's outcome for each of them. `ahead`: spares, for when the current slices are full;
        not taken at all rather than just for this request."""
        try:
            extra = [0 if exact else _extra(accounts[i].remaining, cost) for i in short]
            attempts = (extra,) if ahead else (extra, [0] * len(short))  # refused: the request alone may still fit
            for attempt in attempts:
                checks = [
                    new_budget_check((keys[i], limits[i], cost + more, ends[i], next(self._members)))
                    for i, more in zip(short, attempt)
                ]
                decided, backend = await self._backend.acquire(list(checks))
                if all(outcome.allowed for outcome in decided):
                    break
                if ahead or not any(attempt):
                    return dict(zip(short, decided))
            now = time.time()
            alone = backend is not self._backend.primary  # the store is down: the fallback decided (failing open)
            for i, check, outcome in zip(short, checks, decided):
                account = accounts[i]
                if alone:  # for this request only, so the next asks the store again: it may be back
                    lease = Lease(check._replace(cost=cost), backend, kept=False, touched=now)
                else:
                    kept = _far(outcome.remaining, cost)
                    lease = Lease(check, backend, kept=kept, touched=now)
                    account.remaining = outcome.remaining  # the store's word, not the fallback's
                if ahead:
                    account.spare = lease
                else:
                    _retire(account, lease)
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
            lease, spare = account.lease, account.spare
            if lease is not None and not lease.current:  # settled already, by its last request near the limit
                account.lease = None
            elif lease is not None and not lease.open and now - lease.touched >= IDLE:
                account.lease = None
                _settle(lease)
            if spare is not None and account.lease is None and now - spare.touched >= IDLE:  # unused, its slice idle
                account.spare = None
                _settle(spare)
            if account.lease is None and account.spare is None and account.taking is None and account.ends <= now:
                del self._accounts[key]


def _claim(accounts: Sequence[LeaseAccount], short: Sequence[int]) -> asyncio.Future[None]:
    """Mark the accounts at `short` as having a slice taken, so requests that need one wait for it."""
    taking = asyncio.get_running_loop().create_future()
    for i in short:
        accounts[i].taking = taking
    return taking


def _holding(account: LeaseAccount, cost: int) -> Lease | None:
    """The account's slice that holds `cost`: the current one, else its spare, which then becomes current."""
    lease = account.lease
    if lease is not None and lease.current and lease.used + cost <= lease.check.cost:
        return lease
    spare = account.spare
    if spare is None or spare.used + cost > spare.check.cost:
        return None
    account.spare = None
    _retire(account, spare)
    return spare


def _retire(account: LeaseAccount, new: Lease) -> None:
    """Make `new` the account's current slice; the old one is settled once its requests have ended."""
    old, account.lease = account.lease, new
    if old is not None and old.current:  # not settled yet
        old.current = False
        if not old.open:
            _settle(old)


def _reserve_on(leases: list[Lease], cost: int, now: float) -> list[Lease]:
    for lease in leases:
        lease.used += cost
        lease.open += 1
        lease.touched = now
    return leases


def _left(account: LeaseAccount) -> int:
    """The store's last word on what is left, and what this process's slices still hold."""
    left = account.remaining or 0
    for lease in (account.lease, account.spare):
        if lease is not None and lease.current:
            left += lease.check.cost - lease.used
    return left


def _extra(remaining: int | None, cost: int) -> int:
    """What a new slice holds beyond the request: whole reservations of the request's `cost` (a fragment of one
    would be room no request of that cost can use, held back from every instance), no more than make the slice
    LEASE_REQUESTS reservations or 1/SHARE of what the store had left; none until the store has said what it has
    left, nor once fewer than 2 x SHARE reservations are left."""
    if remaining is None or cost <= 0:
        return 0
    return cost * max(0, min(LEASE_REQUESTS, remaining // (SHARE * cost)) - 1)


def _far(remaining: int, cost: int) -> bool:
    """Whether the store has so much left that the next slice will be a whole one (LEASE_REQUESTS reservations):
    such a slice is kept while idle, and the next one is taken ahead."""
    return _extra(remaining, cost) >= (LEASE_REQUESTS - 1) * cost


def _settle(lease: Lease) -> None:
    lease.current = False
    lease.backend.settle(Settlement(spend=((lease.check, lease.used),)))
