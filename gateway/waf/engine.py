"""The WAF engine: a policy's rules compiled once into a `CompiledWaf`, then evaluated against a `RequestView`.

Compilation (gateway/waf/compile.py) resolves packs, paranoia levels and overlays into a flat rule list, compiles
every regex, phrase list and CIDR list, and groups the regexes that read the same parts through the same transforms
into one RE2 set. At request time (gateway/waf/evaluate.py) each reading of parts through transforms is extracted
and transformed at most once, each RE2 set scans the joined values once, and rule conditions short-circuit over
those cached results (gateway/waf/request_state.py). Redaction (gateway/waf/redact.py) edits the parsed body.

A `CompiledWaf` owns everything it remembers between requests, so a policy reload, which compiles new ones, starts
with nothing remembered from the old rules.
"""

from __future__ import annotations

from typing import Any

from gateway.waf.compile import compile_rules, excluded_rule_ids
from gateway.waf.evaluate import decide
from gateway.waf.model import Exclusion, WafRule, WafSpec
from gateway.waf.parts import RequestView
from gateway.waf.redact import redact_payload
from gateway.waf.request_state import TransformCache
from gateway.waf.verdict import Verdict

POLICY_RULES = "policy"  # the pack name metrics give the policy's own rules


class CompiledWaf:
    """One tenant's effective WAF: rules active at its paranoia levels, in evaluation order."""

    def __init__(self, spec: WafSpec, rules: list[tuple[WafRule, str | None]], version: str) -> None:
        self.spec = spec
        self.version = version
        self.mode = spec.mode
        self.threshold = spec.anomaly.inbound_threshold
        self.rules, self.scans = compile_rules(spec, rules)
        self.pack_of = {r.rule.id: r.pack or POLICY_RULES for r in self.rules}  # a rule id's pack, for metrics
        self.transformed = TransformCache()
        # Which rules a request must evaluate: those that need no regex candidate, plus those a candidate wakes.
        self.always = tuple(i for i, r in enumerate(self.rules) if r.needs is None)
        self.woken: dict[int, tuple[int, ...]] = {}
        for i, r in enumerate(self.rules):
            for leaf in r.needs or ():
                self.woken[leaf] = (*self.woken.get(leaf, ()), i)
        self.exclusions: list[tuple[Exclusion, frozenset[str]]] = [
            (exc, excluded_rule_ids(exc, self.rules)) for exc in spec.exclusions
        ]

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and bool(self.rules)

    def rule_ids(self) -> list[str]:
        return [r.rule.id for r in self.rules]

    def evaluate(self, view: RequestView, *, all_matches: bool = False) -> Verdict:
        """Run every active rule. Stops at the first `block` rule unless `all_matches` (explain, tests)."""
        return decide(self, view, all_matches=all_matches)

    def redact(self, view: RequestView, verdict: Verdict, payload: dict[str, Any]) -> int:
        """Replace, in `payload` (the parsed body, edited in place), what the matched redacting rules' regexes find.
        Returns the number of spans replaced."""
        return redact_payload(self.rules, view, verdict, payload)
