"""What the WAF decided about one request: the rules that matched, why each did (`Hit`), the score and the action."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.waf.model import WafRule
from gateway.waf.parts import Location


@dataclass(frozen=True, slots=True)
class Hit:
    """Why a condition held: the part and the (transformed) text that matched, and the span within it."""

    part: str
    text: str
    start: int = 0
    end: int = 0
    operator: str = ""
    location: Location | None = None

    @property
    def matched(self) -> str:
        return self.text[self.start : self.end] if self.end > self.start else self.text


NOT_HIT = Hit(part="", text="", operator="not")  # a `not` condition holds without a part or text to show


@dataclass(frozen=True, slots=True)
class RuleMatch:
    rule: WafRule
    hit: Hit
    points: int


@dataclass(slots=True)
class Verdict:
    """The WAF's decision on one request."""

    matches: list[RuleMatch] = field(default_factory=list)
    score: int = 0
    action: str = "allow"  # allow | block | monitor (would have blocked, mode monitor) | log (monitor rules only)
    blocking_rule: WafRule | None = None
    tags: list[str] = field(default_factory=list)
    redactions: list[RuleMatch] = field(default_factory=list)

    @property
    def rule_ids(self) -> list[str]:
        return [m.rule.id for m in self.matches]

    @property
    def blocked(self) -> bool:
        return self.action == "block"

    def outcome(self, match: RuleMatch) -> str:
        """What one match did: `block` (it refused the request, alone or by its points), `monitor` (it would have, in
        monitor mode; or it is a monitor rule), or its rule's action where that is all it did (score, redact, tag)."""
        if match.rule.action == "monitor":
            return "monitor"
        if self.action in ("block", "monitor") and (match.points or match.rule is self.blocking_rule):
            return self.action
        return match.rule.action
