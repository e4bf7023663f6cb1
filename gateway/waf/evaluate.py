"""Evaluating a compiled WAF on one request: which rules to run, in order, scoring them into a `Verdict`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.waf.parts import RequestView
from gateway.waf.request_state import RequestState
from gateway.waf.verdict import RuleMatch, Verdict

if TYPE_CHECKING:
    from gateway.waf.engine import CompiledWaf


def decide(waf: CompiledWaf, view: RequestView, *, all_matches: bool = False) -> Verdict:
    """Run every active rule. Stops at the first `block` rule unless `all_matches` (explain, tests)."""
    verdict = Verdict()
    if not waf.enabled:
        return verdict
    skip = _excluded_ids(waf, view)
    state = RequestState(view, waf.scans, waf.transformed)
    order: tuple[int, ...] | list[int] = waf.always
    if state.found:
        woken = waf.woken
        order = sorted({*order, *(i for leaf in state.found for i in woken.get(leaf, ()))})
    rules = waf.rules
    score = 0
    for index in order:
        compiled = rules[index]
        rule = compiled.rule
        if skip and rule.id in skip:
            continue
        hit = compiled.node(state)
        if hit is None:
            continue
        action = rule.action
        match = RuleMatch(rule, hit, compiled.points if action == "score" or action == "block" else 0)
        verdict.matches.append(match)
        if rule.tags and action != "monitor":
            verdict.tags.extend(t for t in rule.tags if t not in verdict.tags)
        if action == "redact":
            verdict.redactions.append(match)
        score += match.points
        if action == "block" and verdict.blocking_rule is None:
            verdict.blocking_rule = rule
            if not all_matches:
                break
    verdict.score = score
    if verdict.blocking_rule is None and score >= waf.threshold:
        verdict.blocking_rule = next(m.rule for m in verdict.matches if m.points)
    if verdict.blocking_rule is not None:
        verdict.action = "block" if waf.mode == "block" else "monitor"
    elif verdict.matches:
        verdict.action = "log"
    return verdict


def _excluded_ids(waf: CompiledWaf, view: RequestView) -> frozenset[str] | set[str]:
    """The rules this request's route, tenant and path exclude."""
    if not waf.exclusions:
        return frozenset()
    out: set[str] = set()
    for exc, ids in waf.exclusions:
        if (
            (not exc.routes or view.route in exc.routes)
            and (not exc.tenants or view.tenant in exc.tenants)
            and (not exc.paths or any(view.path.startswith(p) for p in exc.paths))
        ):
            out |= ids
    return out
