"""Budgets: spend per tenant or key and period, reserved before a request and settled on what it cost.

A request reserves what it may cost (its prompt at the input price, plus its whole output budget at the output
price: the most it can cost, at the price of the model the attempt goes to) before it goes upstream, and its
reservation is replaced by what it did cost when it ends (or given back whole when that attempt fails before its
upstream served anything). The store decides each reservation atomically against the spend of the period, so
however many requests and instances race, the reservations admitted never sum past the limit, and the spend a
period ends with is exactly the sum of its requests' settled costs. A period is a key of its own
(`...:<period start>`): it starts from nothing.

The store is Redis where there is one, else the SQLite file every process of the host shares
(gateway/spend/sqlite_budgets.py); the rate limiter reserves on slices of a budget (gateway/spend/leases.py).
"""

from __future__ import annotations

import calendar
import functools
import hashlib
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from gateway.context import Demand, RequestContext
from gateway.errors import GatewayError
from gateway.observability.telemetry import Metrics
from gateway.policy.model import KEY_BUDGET_ID, Budget, PriceTable
from gateway.ratelimit.checks import BudgetCheck, new_budget_check
from gateway.ratelimit.gcra import Outcome
from gateway.spend.store import NANOS, amount_text

log = logging.getLogger("portcullis.budget")

KEY_PREFIX = "portcullis:budget:"
HEADER = "x-portcullis-budget"  # "<id>; limit=20; remaining=19.999845; reset=2435156; currency=USD"
_WINDOW = re.compile(r"^\s*(\d+)\s*(h|d)\s*$")
_UNIT = {"h": 3600, "d": 86400}


@dataclass(slots=True)
class PeriodCounter:
    """A payer's budget counter for the period that held its last request: kept while the period lasts, so a
    request looks up neither its period nor its key."""

    start: float = 0.0
    end: float = 0.0
    key: str = ""


@dataclass(frozen=True, slots=True)
class AppliedBudget:
    """A budget as it applies to one payer: whose spend it bounds, and its limit in nanos."""

    id: str
    scope: str  # "tenant" | "api_key"
    who: str
    budget: Budget
    limit: int  # nanos
    quiet_above: int  # nanos left above which no soft threshold has been crossed
    header_head: str  # the header up to its remaining amount: "<id>; limit=20; remaining="
    counter: PeriodCounter = field(default_factory=PeriodCounter)


_applied: dict[tuple[str, str, int], AppliedBudget] = {}  # (id, payer, id(budget)) → built once, not per request
_APPLIED_CAPACITY = 65536


def applicable(ctx: RequestContext, rules: Sequence) -> list[AppliedBudget]:
    """The policy's budget rules for the request's tenant or key, and the key's own budget."""
    applied = []
    for rule in rules:
        who = ctx.tenant if rule.key == "tenant" else ctx.key_id
        if who:  # the built one looked up here: a call per rule per request is most of this function's cost
            found = _applied.get((rule.id, who, id(rule)))
            applied.append(
                found if found is not None and found.budget is rule else _applied_budget(rule.id, rule.key, who, rule)
            )
    if ctx.key is not None and ctx.key.budget is not None and ctx.key_id:
        applied.append(_applied_budget(KEY_BUDGET_ID, "api_key", ctx.key_id, ctx.key.budget))
    return applied


def _applied_budget(budget_id: str, scope: str, who: str, budget: Budget) -> AppliedBudget:
    found = _applied.get((budget_id, who, id(budget)))
    if found is None or found.budget is not budget:  # an id reused by a policy reloaded since is built anew
        if len(_applied) >= _APPLIED_CAPACITY:
            _applied.clear()
        limit = round(budget.limit * NANOS)
        quiet_above = limit - math.floor(min(budget.soft, default=1) * limit)
        head = f"{budget_id}; limit={amount_text(limit)}; remaining="
        found = _applied[budget_id, who, id(budget)] = AppliedBudget(
            budget_id, scope, who, budget, limit, quiet_above, head
        )
    return found


_current: dict[str, tuple[float, float]] = {}  # period name → the one that held the last `now` asked about


def period(budget: Budget, now: float) -> tuple[float, float]:
    """The start and end (Unix seconds) of the budget's period that holds `now` (kept while it lasts: every
    request asks)."""
    known = _current.get(budget.period)
    if known is not None and known[0] <= now < known[1]:
        return known
    found = _current[budget.period] = _period(budget, now)
    return found


def _period(budget: Budget, now: float) -> tuple[float, float]:
    if budget.period in ("day", "month"):
        day = datetime.fromtimestamp(now, UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        if budget.period == "day":
            start = day.timestamp()
            return start, start + 86400
        first = day.replace(day=1)
        days = calendar.monthrange(first.year, first.month)[1]
        return first.timestamp(), first.timestamp() + days * 86400
    length = window_seconds(budget.period)
    start = math.floor(now / length) * length
    return start, start + length


def window_seconds(text: str) -> int:
    match = _WINDOW.match(text)
    assert match is not None  # the policy model's pattern admitted it
    return int(match.group(1)) * _UNIT[match.group(2)]


def reservation(demand: Demand, prices: PriceTable) -> int:
    """The most the request can cost sent to `demand.model`: its prompt as that model counts it, uncached, and its
    whole output budget, at that model's price."""
    return prices.cost_nanos(demand.model, demand.prompt_tokens, 0, demand.max_tokens)


def current(budget: AppliedBudget, now: float) -> PeriodCounter:
    """The budget's counter for the period that holds `now` (its key names the period)."""
    counter = budget.counter
    if not counter.start <= now < counter.end:
        counter.start, counter.end = period(budget.budget, now)
        counter.key = _key(budget.id, budget.who, int(counter.start))
    return counter


def checks(applied: Sequence[AppliedBudget], demand: Demand, member: str, prices: PriceTable) -> list[BudgetCheck]:
    """Each budget's reservation of the most the request (`member`) can cost sent to `demand.model`, in the period
    that holds now, for a shared store to decide."""
    cost = reservation(demand, prices)
    now = time.time()
    reserved = []
    for budget in applied:
        counter = current(budget, now)
        reserved.append(new_budget_check((counter.key, budget.limit, cost, counter.end, member)))
    return reserved


@functools.lru_cache(maxsize=65536)
def _key(budget_id: str, who: str, start: int) -> str:
    """`portcullis:budget:{id:digest}:start` (a Redis Cluster hash tag per budget and payer, a key per period)."""
    return f"{KEY_PREFIX}{{{budget_id}:{hashlib.sha256(who.encode()).hexdigest()[:24]}}}:{start}"


def headers(applied: Sequence[AppliedBudget], outcomes: Sequence[Outcome], currency: str) -> dict[str, str]:
    """The tightest budget's limit, what is left of it and when it resets (seconds), in one header: one per
    answer costs the response path less than four."""
    tightest, outcome = applied[0], outcomes[0]
    if len(applied) > 1:
        for other, other_outcome in zip(applied, outcomes):
            if other_outcome.remaining * tightest.limit < outcome.remaining * other.limit:  # a smaller share left
                tightest, outcome = other, other_outcome
    left = amount_text(outcome.remaining) if outcome.remaining > 0 else "0"
    return {HEADER: f"{tightest.header_head}{left}; reset={math.ceil(outcome.reset)}; currency={currency}"}


def exceeded(applied: AppliedBudget, outcome: Outcome, currency: str, headers: dict[str, str]) -> GatewayError:
    whose = "tenant" if applied.scope == "tenant" else "API key"
    return GatewayError(
        429,
        f"Budget exceeded: this {whose}'s budget '{applied.id}' of {applied.budget.limit:g} {currency} per "
        f"{applied.budget.period} has {amount_text(max(outcome.remaining, 0))} {currency} left, less than this request "
        f"may cost. It resets in {math.ceil(outcome.reset)}s.",
        type="insufficient_quota",
        code="budget_exceeded",
        param=applied.id,
        headers={**headers, "retry-after": str(max(1, math.ceil(outcome.retry_after)))},
    )


class SoftThresholds:
    """Logs and counts each soft threshold a budget's spend crosses, once per period and process."""

    def __init__(self, metrics: Metrics, capacity: int = 65536) -> None:
        self._counter = metrics.budget_thresholds
        self._reported: OrderedDict[str, float] = OrderedDict()  # budget key → highest threshold reported
        self._capacity = capacity

    def observe(self, applied: AppliedBudget, key: str, outcome: Outcome) -> None:
        """`key`: the budget period's (the threshold is reported once per period)."""
        if outcome.remaining > applied.quiet_above:  # below every threshold: the common case, decided at once
            return
        used = 1 - outcome.remaining / applied.limit
        crossed = [t for t in applied.budget.soft if used >= t]
        if not crossed or self._reported.get(key, 0.0) >= max(crossed):
            return
        threshold = max(crossed)
        self._reported[key] = threshold
        self._reported.move_to_end(key)
        if len(self._reported) > self._capacity:
            self._reported.popitem(last=False)
        self._counter.labels(budget=applied.id, threshold=f"{threshold:g}").inc()
        log.warning(
            "budget soft threshold crossed",
            extra={
                "fields": {
                    "event": "budget_soft_threshold",
                    "budget": applied.id,
                    "scope": applied.scope,
                    "who": applied.who,
                    "threshold": threshold,
                    "used": round(used, 6),
                    "limit": applied.budget.limit,
                }
            },
        )
