"""Rate-limit response headers: OpenAI's `x-ratelimit-*` pairs and the IETF `RateLimit-Policy` / `RateLimit`
fields (draft-ietf-httpapi-ratelimit-headers), so both SDK retry logic and generic clients can pace themselves."""

from __future__ import annotations

import math

from gateway.policy.model import RateLimitRule
from gateway.ratelimit.gcra import Outcome


def rate_limit_headers(decided: list[tuple[RateLimitRule, Outcome]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        of_kind = [(rule, out) for rule, out in decided if rule.kind == kind]
        if not of_kind:
            continue
        rule, outcome = min(of_kind, key=lambda pair: pair[1].remaining / _quota(pair[0]))  # the tightest
        headers[f"x-ratelimit-limit-{kind}"] = str(_quota(rule))
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(outcome.remaining, 0))
        headers[f"x-ratelimit-reset-{kind}"] = go_duration(outcome.reset)
    headers["ratelimit-policy"] = ", ".join(_policy_item(rule) for rule, _ in decided)
    headers["ratelimit"] = ", ".join(
        f'"{rule.id}";r={max(out.remaining, 0)};t={math.ceil(out.reset)}' for rule, out in decided)
    return headers


def _quota(rule: RateLimitRule) -> int:
    limit = rule.requests or rule.tokens or rule.concurrency
    return limit.limit


def _policy_item(rule: RateLimitRule) -> str:
    window = rule.requests or rule.tokens
    return f'"{rule.id}";q={_quota(rule)}' + (f";w={math.ceil(window.per)}" if window else "")


def go_duration(seconds: float) -> str:
    """OpenAI writes resets like Go durations: '20ms', '1.5s', '6m0s', '1h2m3s'."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{round(seconds)}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{hours}h" if hours else "") + f"{minutes}m{secs}s"
