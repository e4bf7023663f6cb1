"""One decision for every limit and budget that applies to a request sent to one model, and its settlement when the
response ends.

Tokens are reserved up front (prompt + the output budget the tokenize part settled on: max_tokens x n, both as the
attempt's model counts them) and reconciled when the request ends (`gateway/spend/charge.py`); so is a budget's spend
(gateway/spend/budgets.py), reserved at the attempt's model's price. A backend decides all of a request's limits and
budgets at once and consumes nothing when any of them denies. An attempt that fails before its upstream served
anything gives its grant back (`release`) before the next attempt is decided on its own model.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from gateway.context import Demand, RequestContext
from gateway.errors import GatewayError
from gateway.observability.telemetry import Metrics, cached_labels
from gateway.policy.model import PriceTable, RateLimitRule, TokenRate
from gateway.ratelimit.checks import Backend, BudgetCheck, Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.failover import FailoverBackend
from gateway.ratelimit.gcra import EPSILON, Outcome
from gateway.ratelimit.headers import rate_limit_headers
from gateway.ratelimit.memory import MemoryBackend
from gateway.spend import budgets
from gateway.spend.budgets import AppliedBudget, SoftThresholds
from gateway.spend.charge import Charge, charge, charged_tokens
from gateway.spend.leases import BudgetLeases, Lease

KEY_PREFIX = "portcullis:rl:"
NOTHING_SERVED = Charge(0, 0, 0, 0, 0)  # what an attempt that failed before its upstream served anything is charged


@dataclass(slots=True)
class Grant:
    """Limits and budget reservations a request holds until it ends."""

    backend: Backend
    decided: list[tuple[RateLimitRule, Check, Outcome]]
    headers: dict[str, str]
    budgets: list[BudgetCheck] = field(default_factory=list)  # reservations a shared store holds
    prices: PriceTable | None = None  # the table the budgets reserved at: the same one settles them
    leases: Sequence[Lease] = ()  # budgets reserved on this process's slices of them: `reserved` on each
    reserved: int = 0


# Told of each budget period (its key) before this process reserves on it: where the store needs to know whose
# spend it bounds.
Expect = Callable[[str, AppliedBudget], None]


class RateLimiter:
    def __init__(
        self,
        backend: FailoverBackend,
        metrics: Metrics,
        budget_store: FailoverBackend | None = None,
        expect: Expect | None = None,
    ) -> None:
        """`budget_store`: where budgets are kept, if not beside the limits in `backend` (without Redis, the limits
        are in this process and the budgets in the SQLite file every process shares)."""
        self.backend = backend
        self._local = backend.local
        self._budget_store = budget_store or backend
        self._leases = BudgetLeases(self._budget_store)
        self._expect = expect
        self._thresholds = SoftThresholds(metrics)
        self._decisions = cached_labels(metrics.ratelimit_decisions)
        self._budgets_exceeded = cached_labels(metrics.budgets_exceeded)
        self._tokens_charged = cached_labels(metrics.ratelimit_tokens_charged)

    async def admit(
        self,
        ctx: RequestContext,
        demand: Demand,
        rules: Sequence[RateLimitRule],
        applied: Sequence[AppliedBudget] = (),
        prices: PriceTable | None = None,
    ) -> Grant:
        """Decide all rules and budgets for the request sent to `demand.model`, in one round trip; raise 429 if any
        denies."""
        checks: list[Check] = [_check(rule, ctx, demand) for rule in rules] if rules else []
        for rule, check in zip(rules, checks):
            if isinstance(check, RateCheck) and check.cost * check.interval - check.tolerance > EPSILON:
                raise _too_large(rule, check)  # before any counter is touched: no wait would let it fit
        local = self._local
        if applied and (not rules or local is not None):  # no round trip that decides the budgets with the limits
            assert prices is not None  # budgets are priced
            return await self._admit_on_slices(demand, rules, checks, applied, prices, local)
        reserved: list[BudgetCheck] = []
        if applied:
            assert prices is not None
            reserved = budgets.checks(applied, demand, ctx.request_id, prices)
            checks += reserved
        backend: Backend
        if local is not None:
            outcomes, backend = local.decide(checks), local
        else:
            outcomes, backend = await self.backend.acquire(checks)
        headers = self._rate_headers(rules, outcomes, backend.name)
        if reserved:
            assert prices is not None
            keys = [check.key for check in reserved]
            self._spend(applied, keys, outcomes[len(rules) :], backend.name, prices.currency, headers)
        decided = list(zip(rules, checks, outcomes)) if rules else []
        return Grant(backend, decided, headers, reserved, prices)

    async def _admit_on_slices(
        self,
        demand: Demand,
        rules: Sequence[RateLimitRule],
        checks: list[Check],
        applied: Sequence[AppliedBudget],
        prices: PriceTable,
        local: MemoryBackend | None,
    ) -> Grant:
        """Budgets reserved on this process's slices of them (gateway/spend/leases.py), so most requests do not wait
        for the store: where they are the request's only limits, or where its limits are kept in this process
        (`local`), which decides them in the same event-loop step as the slices' reservation: all or none."""
        cost = budgets.reservation(demand, prices)
        now = time.time()
        keys = []
        for budget in applied:
            counter = budget.counter
            if not counter.start <= now < counter.end:
                counter = budgets.current(budget, now)
            keys.append(counter.key)
        leases = self._leases
        refusal, near = None, False
        taken = leases.reserve_held(applied, keys, cost, now)  # most requests: on the slices this process holds
        if taken is None:  # a slice to take, or a soft threshold near: rarely
            if self._expect is not None:
                for budget, key in zip(applied, keys):
                    self._expect(key, budget)
            limits, ends = [b.limit for b in applied], [b.counter.end for b in applied]
            taken, refusal = await leases.reserve(keys, limits, ends, cost)
            near = refusal is None and any(leases.left(k) <= b.quiet_above for b, k in zip(applied, keys))
        # from here on nothing waits: the limits are decided on the state the slices were reserved in
        headers: dict[str, str] = {}
        decided: list[tuple[RateLimitRule, Check, Outcome]] = []
        if checks:
            assert local is not None  # limits beside budgets on slices are this process's
            outcomes = local.decide(checks, commit=taken is not None)
            try:
                headers = self._rate_headers(rules, outcomes, local.name)  # a limit's refusal comes first
            except GatewayError:
                if taken is not None:
                    leases.settle(taken, -cost)
                raise
            decided = list(zip(rules, checks, outcomes))
        if refusal is not None or near:
            outcomes = refusal or [
                Outcome(True, leases.left(k), 0.0, max(b.counter.end - now, 0.0)) for b, k in zip(applied, keys)
            ]
            store = self._budget_store.primary.name
            self._spend(applied, keys, outcomes, store, prices.currency, headers)  # raises on a refusal
        assert taken is not None  # a refusal raised
        return Grant(local or self._budget_store.primary, decided, headers, prices=prices, leases=taken, reserved=cost)

    def start(self) -> None:
        self._leases.start()

    async def aclose(self) -> None:
        """Give the store back what this process's budget slices hold unused."""
        await self._leases.aclose()

    def _rate_headers(
        self, rules: Sequence[RateLimitRule], outcomes: Sequence[Outcome], backend: str
    ) -> dict[str, str]:
        """Count each rule's decision and say where the request stands; raise 429 for the rule that denied it with
        the longest wait, if any did. (`outcomes` may go on past the rules': the budgets' follow.)"""
        if not rules:
            return {}
        denied = None
        for rule, outcome in zip(rules, outcomes):
            self._decisions(rule.id, "allowed" if outcome.allowed else "limited", backend).inc()
            if not outcome.allowed and (denied is None or outcome.retry_after > denied[1].retry_after):
                denied = rule, outcome
        headers = rate_limit_headers(list(zip(rules, outcomes)))
        if denied is not None:
            raise _too_many(*denied, headers)
        return headers

    def _spend(
        self,
        applied: Sequence[AppliedBudget],
        keys: Sequence[str],
        outcomes: Sequence[Outcome],
        backend: str,
        currency: str,
        headers: dict[str, str],
    ) -> None:
        """Refuse (429) for the first budget the request did not fit; note the soft thresholds of those it did
        (`keys`: the budget periods'). The answer says what is left of the tightest budget once one is past its
        first soft threshold (and on a refusal): far from it the header would tell a client nothing it acts on,
        and writing it costs every answer more than the budget's own decision."""
        exceeded, near = None, False
        for budget, key, outcome in zip(applied, keys, outcomes):
            if not outcome.allowed:
                self._budgets_exceeded(budget.id, backend).inc()
                exceeded = exceeded or (budget, outcome)
            elif outcome.remaining <= budget.quiet_above:  # past a soft threshold: rarely
                self._thresholds.observe(budget, key, outcome)
                near = True
        if exceeded is not None or near:
            headers.update(budgets.headers(applied, outcomes, currency))
        if exceeded is not None:
            raise budgets.exceeded(*exceeded, currency, headers)

    def settle(self, grant: Grant, ctx: RequestContext) -> None:
        """Reconcile token and spend reservations with what the request cost (at the price of the model that served
        it, the one they were reserved for), and free concurrency slots."""
        if grant.prices is not None:  # budgets: tokens as they were charged
            self._settle(grant, charge(ctx, grant.prices))
        else:
            prompt, completion = charged_tokens(ctx)
            self._settle(grant, Charge(prompt, 0, completion, 0, 0))

    def release(self, grant: Grant) -> None:
        """Give back what an attempt was granted that failed before its upstream served anything: it costs
        nothing (token and spend reservations refunded whole) and frees its slots; requests counted stay counted."""
        self._settle(grant, NOTHING_SERVED)

    def _settle(self, grant: Grant, charged: Charge) -> None:
        if grant.leases:  # budgets on slices: the reservation is replaced by the cost on them (they go back whole)
            self._leases.settle(grant.leases, charged.cost_nanos - grant.reserved)
            if not grant.decided:
                return
        grant.backend.settle(self._settlement(grant, charged))

    def _settlement(self, grant: Grant, charged: Charge) -> Settlement:
        spend = tuple(zip(grant.budgets, repeat(charged.cost_nanos))) if grant.prices is not None else ()
        if grant.prices is not None and not grant.decided:  # budgets alone: nothing else to settle
            return Settlement((), (), spend)
        prompt, completion = charged.prompt, charged.completion
        adjustments, releases = [], []
        for rule, check, _ in grant.decided:
            if isinstance(check, SlotCheck):
                releases.append(check)
            elif rule.tokens and isinstance(check, RateCheck):
                tokens = {"input": prompt, "output": completion, "total": prompt + completion}[rule.tokens.count]
                if tokens != check.cost:
                    adjustments.append((check, tokens - check.cost))
                self._tokens_charged(rule.id).inc(tokens)
        return Settlement(tuple(adjustments), tuple(releases), spend)


def _check(rule: RateLimitRule, ctx: RequestContext, demand: Demand) -> RateCheck | SlotCheck:
    key = _counter_key(rule, ctx, demand.model)
    limit = _limit_for(rule, ctx.key.limits if ctx.key is not None else None)
    if rule.requests:
        interval = rule.requests.per / limit
        return RateCheck(key, interval, interval * (rule.requests.burst or limit), 1)
    if rule.tokens:
        interval = rule.tokens.per / limit
        return RateCheck(key, interval, interval * limit, _reservation(rule.tokens, demand))
    assert rule.concurrency is not None
    return SlotCheck(key, limit, rule.concurrency.lease, ctx.request_id)


def _limit_for(rule: RateLimitRule, overrides: Mapping[str, int] | None) -> int:
    """The rule's limit, or the calling key's own for it (a stored key's `limits`, by rule id)."""
    if overrides and rule.id in overrides:
        return int(overrides[rule.id])
    window = rule.requests or rule.tokens or rule.concurrency
    assert window is not None  # a rule has exactly one kind
    return window.limit


# Every key part a rule may name (policy/model.py's KeyPart) and the request attribute it reads; `model` is the
# attempt's, not the request's (tests/unit/test_ratelimit_keys.py holds the two lists equal)
KEY_PART_FIELDS: dict[str, str | None] = {
    "api_key": "key_id",
    "tenant": "tenant",
    "client_ip": "client_ip",
    "model": None,
    "route": "route",
    "tool": "tool",  # an MCP tools/call's "server/tool" (gateway/mcp/)
}


def _counter_key(rule: RateLimitRule, ctx: RequestContext, model: str) -> str:
    """The rule's counter for this caller and the model the attempt goes to."""
    identity = "\x1f".join(
        f"{part}={(model if (field := KEY_PART_FIELDS[part]) is None else getattr(ctx, field)) or '-'}"
        for part in rule.key
    )
    return _key(rule.id, identity)


@functools.lru_cache(maxsize=65536)  # the same callers come back: hash each identity once, not per request
def _key(rule_id: str, identity: str) -> str:
    """`portcullis:rl:{rule:digest}`: the braces are a Redis Cluster hash tag, one slot per counter."""
    return f"{KEY_PREFIX}{{{rule_id}:{hashlib.sha256(identity.encode()).hexdigest()[:24]}}}"


def _reservation(tokens: TokenRate, demand: Demand) -> int:
    """Prompt tokens as the attempt's model counts them, plus the output budget settled on for that model."""
    prompt, output = demand.prompt_tokens, demand.max_tokens
    return {"input": prompt, "output": output, "total": prompt + output}[tokens.count]


def _too_large(rule: RateLimitRule, check: RateCheck) -> GatewayError:
    """A reservation above the rule's whole window (a huge max_tokens, say): refused as OpenAI refuses a request
    over a tokens-per-minute limit, with no retry time, since waiting can never make it fit."""
    window = rule.tokens or rule.requests
    assert window is not None  # only rate rules reserve
    return GatewayError(
        429,
        f"Request too large for {rule.kind} (limit '{rule.id}'): Limit {_limit(check)} per {window.per:g}s, "
        f"Requested {check.cost:.0f}. The input or output tokens must be reduced in order to run successfully.",
        type=rule.kind,
        code="rate_limit_exceeded",
        param=rule.id,
    )


def _limit(check: RateCheck) -> int:
    """The units a window holds (the caller's own limit where its key overrides the rule's)."""
    return round(check.tolerance / check.interval)


def _too_many(rule: RateLimitRule, outcome: Outcome, headers: dict[str, str]) -> GatewayError:
    if rule.concurrency:
        message = f"Too many concurrent requests (limit '{rule.id}': {rule.concurrency.limit} in flight)."
    else:
        window = rule.requests or rule.tokens
        assert window is not None  # a rule has exactly one kind
        message = (
            f"Rate limit reached for {rule.kind} (limit '{rule.id}': {window.limit} per "
            f"{window.per:g}s). Please try again in {outcome.retry_after:.3g}s."
        )
    retry_after = str(max(1, math.ceil(outcome.retry_after)))
    return GatewayError(
        429,
        message,
        type=rule.kind,
        code="rate_limit_exceeded",
        param=rule.id,
        headers={**headers, "retry-after": retry_after},
    )
