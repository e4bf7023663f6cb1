"""One decision for every limit that applies to a request, and its settlement when the response ends.

Tokens are reserved up front (prompt + the output budget the tokenize stage settled on: max_tokens x n) and
reconciled when the request ends (see `charged_tokens`). A backend decides all of a request's limits at once and
consumes nothing when any of them denies.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.policy.model import RateLimitRule, TokenRate
from gateway.ratelimit.checks import Backend, Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.failover import FailoverBackend
from gateway.ratelimit.gcra import Outcome
from gateway.ratelimit.headers import rate_limit_headers
from gateway.telemetry import Metrics

KEY_PREFIX = "portcullis:rl:"


@dataclass(slots=True)
class Grant:
    """Limits a request holds until it ends."""

    backend: Backend
    decided: list[tuple[RateLimitRule, Check, Outcome]]
    headers: dict[str, str]


class RateLimiter:
    def __init__(self, backend: FailoverBackend, metrics: Metrics) -> None:
        self.backend = backend
        # labels() builds and looks up a tuple under a lock (~2 µs): keep each counter's children at hand
        self._decisions = functools.lru_cache(maxsize=4096)(metrics.ratelimit_decisions.labels)
        self._tokens_charged = functools.lru_cache(maxsize=4096)(metrics.ratelimit_tokens_charged.labels)

    async def admit(self, ctx: RequestContext, rules: list[RateLimitRule]) -> Grant:
        """Decide all rules in one round trip; raise 429 if any denies."""
        checks = [_check(rule, ctx) for rule in rules]
        outcomes, backend = await self.backend.acquire(checks)
        decided = list(zip(rules, checks, outcomes))
        denied = [(rule, out) for rule, _, out in decided if not out.allowed]
        for rule, outcome in zip(rules, outcomes):
            self._decisions(rule.id, "allowed" if outcome.allowed else "limited", backend.name).inc()
        headers = rate_limit_headers(list(zip(rules, outcomes)))
        if denied:
            rule, outcome = max(denied, key=lambda pair: pair[1].retry_after)
            raise _too_many(rule, outcome, headers)
        return Grant(backend, decided, headers)

    async def settle(self, grant: Grant, ctx: RequestContext) -> None:
        """Reconcile token reservations with what the request cost and free concurrency slots."""
        adjustments, releases = [], []
        prompt, completion = charged_tokens(ctx)
        for rule, check, _ in grant.decided:
            if isinstance(check, SlotCheck):
                releases.append(check)
            elif rule.tokens:
                charged = {"input": prompt, "output": completion, "total": prompt + completion}[rule.tokens.count]
                if charged != check.cost:
                    adjustments.append((check, charged - check.cost))
                self._tokens_charged(rule.id).inc(charged)
        await grant.backend.settle(Settlement(tuple(adjustments), tuple(releases)))


def _check(rule: RateLimitRule, ctx: RequestContext) -> Check:
    key = _counter_key(rule, ctx)
    if rule.requests:
        interval = rule.requests.per / rule.requests.limit
        return RateCheck(key, interval, interval * (rule.requests.burst or rule.requests.limit), 1)
    if rule.tokens:
        interval = rule.tokens.per / rule.tokens.limit
        return RateCheck(key, interval, interval * rule.tokens.limit, _reservation(rule.tokens, ctx))
    assert rule.concurrency is not None
    return SlotCheck(key, rule.concurrency.limit, rule.concurrency.lease, ctx.request_id)


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


def charged_tokens(ctx: RequestContext) -> tuple[int, int]:
    """Prompt and completion tokens a finished request is charged.

    What the upstream reports is charged exactly, each part on its own. A part it did not report is inferred:
    - the upstream never accepted the request (it answered an error status such as 502/503/504, could not be
      reached, timed out before answering, or a later stage refused the request): nothing. An upstream that failed
      a request has not served its prompt (OpenAI and vLLM bill nothing for an error), and a client must not pay
      for the upstream's failure; the slot and the request rate still bound how often it can try;
    - the upstream accepted it (200) and so read the prompt: the prompt as counted by the tokenize stage. The
      completion costs nothing when no output reached the gateway (the stream ended or broke, or the client left,
      before any token); once output was seen, an unreported completion keeps its whole reservation, since how
      much more the upstream generated is unknown and a client must not skip the bill by hanging up.
    """
    usage = ctx.usage
    accepted = ctx.replica is not None and ctx.status == 200
    prompt, completion = _count(usage.prompt_tokens), _count(usage.completion_tokens)
    if prompt is None:
        prompt = (ctx.prompt_tokens or 0) if accepted else 0
    if completion is None:
        completion = (ctx.max_tokens or 0) if accepted and usage.generated else 0
    return prompt, completion


def _count(reported: object) -> int | None:
    """A token count as an upstream reported it, if it is one."""
    return reported if isinstance(reported, int) and not isinstance(reported, bool) and reported >= 0 else None


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
