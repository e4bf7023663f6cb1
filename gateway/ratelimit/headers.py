"""Rate-limit response headers: OpenAI's `x-ratelimit-*` pairs and the IETF `RateLimit-Policy` / `RateLimit`
fields (draft-ietf-httpapi-ratelimit-headers), so both SDK retry logic and generic clients can pace themselves."""

from __future__ import annotations

import math

from gateway.policy.model import RateLimitRule
from gateway.ratelimit.gcra import Outcome


def rate_limit_headers(decided: list[tuple[RateLimitRule, Outcome]]) -> dict[str, str]:
    """One pass over the decided limits (this runs on every limited request)."""
    tightest: dict[str, tuple[float, int, Outcome]] = {}  # per kind: the smallest share left
    policy, state = [], []
    for rule, outcome in decided:
        window = rule.requests or rule.tokens
        limit = window or rule.concurrency
        assert limit is not None  # a rule has exactly one kind
        quota = limit.limit
        policy.append(f'"{rule.id}";q={quota};w={math.ceil(window.per)}' if window else f'"{rule.id}";q={quota}')
        state.append(f'"{rule.id}";r={max(outcome.remaining, 0)};t={math.ceil(outcome.reset)}')
        if window:
            kind = "requests" if rule.requests else "tokens"
            share = outcome.remaining / quota
            if kind not in tightest or share < tightest[kind][0]:
                tightest[kind] = (share, quota, outcome)
    headers: dict[str, str] = {}
    for kind, (_, quota, outcome) in tightest.items():
        headers[f"x-ratelimit-limit-{kind}"] = str(quota)
        headers[f"x-ratelimit-remaining-{kind}"] = str(max(outcome.remaining, 0))
        headers[f"x-ratelimit-reset-{kind}"] = go_duration(outcome.reset)
    headers["ratelimit-policy"] = ", ".join(policy)
    headers["ratelimit"] = ", ".join(state)
    return headers


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
