"""One decision for every limit and budget that applies to a request, and its settlement when the response ends.

Tokens are reserved up front (prompt + the output budget the tokenize stage settled on: max_tokens x n) and
reconciled when the request ends (`gateway/spend/charge.py`); so is a budget's spend (gateway/spend/budgets.py). A
backend decides all of a request's limits and budgets at once and consumes nothing when any of them denies.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.policy.model import PriceTable, RateLimitRule, TokenRate
from gateway.ratelimit.checks import Backend, BudgetCheck, Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.failover import FailoverBackend
from gateway.ratelimit.gcra import Outcome
from gateway.ratelimit.headers import rate_limit_headers
from gateway.spend import budgets
from gateway.spend.budgets import AppliedBudget, BudgetSeeder, SoftThresholds
from gateway.spend.charge import charge, charged_tokens
from gateway.telemetry import Metrics, cached_labels

KEY_PREFIX = "portcullis:rl:"


@dataclass(slots=True)
class Grant:
    """Limits and budget reservations a request holds until it ends."""

    backend: Backend
    decided: list[tuple[RateLimitRule, Check, Outcome]]
    headers: dict[str, str]
    budgets: list[BudgetCheck] = field(default_factory=list)
    prices: PriceTable | None = None  # the table the budgets reserved at: the same one settles them


class RateLimiter:
    def __init__(self, backend: FailoverBackend, metrics: Metrics, seeder: BudgetSeeder | None = None) -> None:
        """`seeder`: where budgets live in this process only (no Redis), how a period's past spend is read back."""
        self.backend = backend
        self._local = backend.local
        self._seeder = seeder
        self._thresholds = SoftThresholds(metrics)
        self._decisions = cached_labels(metrics.ratelimit_decisions)
        self._budgets_exceeded = cached_labels(metrics.budgets_exceeded)
        self._tokens_charged = cached_labels(metrics.ratelimit_tokens_charged)

    async def admit(
        self,
        ctx: RequestContext,
        rules: Sequence[RateLimitRule],
        applied: Sequence[AppliedBudget] = (),
        prices: PriceTable | None = None,
    ) -> Grant:
        """Decide all rules and budgets in one round trip; raise 429 if any denies."""
        checks: list[Check] = [_check(rule, ctx) for rule in rules] if rules else []
        reserved: list[BudgetCheck] = []
        if applied:
            assert prices is not None  # budgets are priced
            reserved = budgets.checks(applied, ctx, prices)
            if self._seeder is not None and not self._seeder.seeded(reserved):
                await self._seeder.seed(applied, reserved)
            checks += reserved
        backend: Backend
        if self._local is not None:
            outcomes, backend = self._local.decide(checks), self._local
        else:
            outcomes, backend = await self.backend.acquire(checks)
        decided: list[tuple[RateLimitRule, Check, Outcome]] = []
        headers: dict[str, str] = {}
        denied = None
        if rules:
            limited = outcomes[: len(rules)]
            decided = list(zip(rules, checks, limited))
            for rule, outcome in zip(rules, limited):
                self._decisions(rule.id, "allowed" if outcome.allowed else "limited", backend.name).inc()
                if not outcome.allowed and (denied is None or outcome.retry_after > denied[1].retry_after):
                    denied = rule, outcome
            headers = rate_limit_headers(list(zip(rules, limited)))
        if denied is not None:
            raise _too_many(*denied, headers)
        if reserved:
            assert prices is not None
            self._spend(applied, reserved, outcomes[len(rules) :], backend, prices.currency, headers)
        return Grant(backend, decided, headers, reserved, prices)

    def _spend(
        self,
        applied: Sequence[AppliedBudget],
        reserved: Sequence[BudgetCheck],
        outcomes: Sequence[Outcome],
        backend: Backend,
        currency: str,
        headers: dict[str, str],
    ) -> None:
        """Refuse (429) for the first budget the request did not fit; note the soft thresholds of those it did. The
        answer says what is left of the tightest budget once one is past its first soft threshold (and on a refusal):
        far from it the header would tell a client nothing it acts on, and writing it costs every answer more than
        the budget's own decision."""
        exceeded, near = None, False
        for budget, budget_check, outcome in zip(applied, reserved, outcomes):
            if not outcome.allowed:
                self._budgets_exceeded(budget.id, backend.name).inc()
                exceeded = exceeded or (budget, outcome)
            elif outcome.remaining <= budget.quiet_above:  # past a soft threshold: rarely
                self._thresholds.observe(budget, budget_check, outcome)
                near = True
        if exceeded is not None or near:
            headers.update(budgets.headers(applied, outcomes, currency))
        if exceeded is not None:
            raise budgets.exceeded(*exceeded, currency, headers)

    def settle(self, grant: Grant, ctx: RequestContext) -> None:
        """Reconcile token and spend reservations with what the request cost, and free concurrency slots."""
        grant.backend.settle(self._settlement(grant, ctx))

    def _settlement(self, grant: Grant, ctx: RequestContext) -> Settlement:
        if grant.budgets:
            assert grant.prices is not None
            charged_cost = charge(ctx, grant.prices)
            spend = tuple(zip(grant.budgets, repeat(charged_cost.cost_nanos)))
            if not grant.decided:  # budgets alone: nothing else to settle
                return Settlement((), (), spend)
            prompt, completion = charged_cost.prompt, charged_cost.completion
        else:
            spend = ()
            prompt, completion = charged_tokens(ctx)
        adjustments, releases = [], []
        for rule, check, _ in grant.decided:
            if isinstance(check, SlotCheck):
                releases.append(check)
            elif rule.tokens and isinstance(check, RateCheck):
                charged = {"input": prompt, "output": completion, "total": prompt + completion}[rule.tokens.count]
                if charged != check.cost:
                    adjustments.append((check, charged - check.cost))
                self._tokens_charged(rule.id).inc(charged)
        return Settlement(tuple(adjustments), tuple(releases), spend)


def _check(rule: RateLimitRule, ctx: RequestContext) -> RateCheck | SlotCheck:
    key = _counter_key(rule, ctx)
    limit = _limit_for(rule, ctx.key.limits if ctx.key is not None else None)
    if rule.requests:
        interval = rule.requests.per / limit
        return RateCheck(key, interval, interval * (rule.requests.burst or limit), 1)
    if rule.tokens:
        interval = rule.tokens.per / limit
        return RateCheck(key, interval, interval * limit, _reservation(rule.tokens, ctx))
    assert rule.concurrency is not None
    return SlotCheck(key, limit, rule.concurrency.lease, ctx.request_id)


def _limit_for(rule: RateLimitRule, overrides: Mapping[str, int] | None) -> int:
    """The rule's limit, or the calling key's own for it (a stored key's `limits`, by rule id)."""
    if overrides and rule.id in overrides:
        return int(overrides[rule.id])
    window = rule.requests or rule.tokens or rule.concurrency
    assert window is not None  # a rule has exactly one kind
    return window.limit


_FIELDS = {"api_key": "key_id", "tenant": "tenant", "client_ip": "client_ip", "model": "model", "route": "route"}


def _counter_key(rule: RateLimitRule, ctx: RequestContext) -> str:
    identity = "\x1f".join(f"{part}={getattr(ctx, _FIELDS[part]) or '-'}" for part in rule.key)
    return _key(rule.id, identity)


@functools.lru_cache(maxsize=65536)  # the same callers come back: hash each identity once, not per request
def _key(rule_id: str, identity: str) -> str:
    """`portcullis:rl:{rule:digest}`: the braces are a Redis Cluster hash tag, one slot per counter."""
    return f"{KEY_PREFIX}{{{rule_id}:{hashlib.sha256(identity.encode()).hexdigest()[:24]}}}"


def _reservation(tokens: TokenRate, ctx: RequestContext) -> int:
    """Prompt tokens as counted by the tokenize stage, plus the output budget it settled on."""
    prompt, output = ctx.prompt_tokens or 0, ctx.max_tokens or 0
    return {"input": prompt, "output": output, "total": prompt + output}[tokens.count]


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
