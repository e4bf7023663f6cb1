"""The WAF section of the policy model (`spec.waf`) and the `kind: RulePack` document.

These classes are part of the one policy format (gateway/policy/model.py embeds `WafSpec` in `PolicySpec`); they
validate everything a security engineer can write, including that every regex compiles under RE2, so nothing that
loads can fail or run slowly at request time.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gateway.apis.routes import RouteName
from gateway.policy.yaml_bools import Switch
from gateway.waf import operators
from gateway.waf.operators import Operator
from gateway.waf.parts import PARAM_PARTS, PARTS
from gateway.waf.transforms import TRANSFORMS

WafRuleId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]
Severity = Literal["critical", "error", "warning", "notice"]
Level = Annotated[int, Field(ge=1, le=4)]
# A transform's name: one of gateway/waf/transforms.py's TRANSFORMS, which is where a transform is added.
if TYPE_CHECKING:
    Transform = str
else:
    Transform = Literal[tuple(TRANSFORMS)]

# Request parts a condition can read (gateway/waf/parts.py's readers): plain names, or `name:PARAM`.
PLAIN_TARGETS = tuple(PARTS)
PARAM_TARGETS = tuple(PARAM_PARTS)
_TARGET = re.compile(rf"^(?:{'|'.join(PLAIN_TARGETS)})$|^(?:{'|'.join(PARAM_TARGETS)}):.+$")
TARGET_HELP = (
    f"a request part: one of {', '.join(PLAIN_TARGETS)}; or header:NAME, cookie:NAME, arg:NAME, "
    "json:PATH (dotted, * for any key or index), prompt:ROLE"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Numeric(_Strict):
    """Numeric comparisons; every one given must hold."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    eq: float | None = None

    @model_validator(mode="after")
    def _some(self) -> Numeric:
        if all(getattr(self, k) is None for k in ("gt", "ge", "lt", "le", "eq")):
            raise ValueError("give at least one of gt, ge, lt, le, eq")
        return self


class SqliOptions(_Strict):
    min_tokens: Annotated[int, Field(ge=1, le=5)] = 1


class Condition(_Strict):
    """Either a combination (`all`, `any`, `not`) or a match: a `target` (one part or a list), optional
    `transforms` applied in order before matching, and exactly one operator."""

    all: list[Condition] | None = Field(default=None, description="every condition holds")
    any: list[Condition] | None = Field(default=None, description="at least one condition holds")
    not_: Condition | None = Field(default=None, alias="not", description="the condition does not hold")
    target: list[str] | None = Field(default=None, description=TARGET_HELP)
    transforms: list[Transform] = Field(default_factory=list, description="applied in order before matching")
    # The operators: each field carrying an `Operator` is one (gateway/waf/operators.py says how one is added).
    regex: Annotated[str | None, operators.REGEX] = Field(
        default=None, description="RE2 syntax (linear time, no backreferences/lookaround)"
    )
    phrases: Annotated[list[str] | None, operators.PHRASES] = Field(
        default=None, description="any of these substrings (Aho-Corasick)"
    )
    equals: Annotated[str | float | None, operators.EQUALS] = None
    in_: Annotated[list[str | float] | None, operators.IN] = Field(
        default=None, alias="in", description="equal to one of these"
    )
    number: Annotated[Numeric | None, operators.NUMBER] = Field(default=None, description="the part read as a number")
    length: Annotated[Numeric | None, operators.LENGTH] = Field(
        default=None, description="the part's length in characters"
    )
    sqli: Annotated[bool | SqliOptions | None, operators.SQLI] = Field(
        default=None,
        description=(
            "libinjection SQL-injection detection; {min_tokens: N} keeps only fingerprints of N tokens or more"
        ),
    )
    xss: Annotated[bool | None, operators.XSS] = Field(default=None, description="libinjection XSS detection")
    tautology: Annotated[bool | None, operators.TAUTOLOGY] = Field(
        default=None,
        description=(
            "a comparison between two SQL literals that holds (1=1, 'a'='a', 42 LIKE 42, 2>1), evaluated as a database "
            "would; a false one (11!=11) does not match"
        ),
    )
    cidr: Annotated[list[str] | None, operators.CIDR] = Field(
        default=None, description="client IP in one of these networks"
    )

    @field_validator("target", mode="before")
    @classmethod
    def _listify(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("target")
    @classmethod
    def _known_targets(cls, value: list[str] | None) -> list[str] | None:
        for target in value or ():
            if not _TARGET.match(target):
                raise ValueError(f"unknown target {target!r}: {TARGET_HELP}")
        return value

    @field_validator("*")
    @classmethod
    def _operator_value_runs(cls, value: Any, info: ValidationInfo) -> Any:
        operator = OPERATORS.get(info.field_name or "")
        if operator is not None and value is not None:
            operator.check(value)
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> Condition:
        combos = [k for k in ("all", "any", "not_") if getattr(self, k) is not None]
        ops = [name for name in OPERATORS if _given(getattr(self, name))]
        if len(combos) + len(ops) != 1:
            given = ", ".join(_policy_name(k) for k in combos + ops) or "none"
            names = ", ".join(_policy_name(k) for k in OPERATORS)
            raise ValueError(f"give exactly one of all, any, not, or one operator ({names}); given: {given}")
        if ops and not self.target:
            raise ValueError(f"'{_policy_name(ops[0])}' needs a 'target'")
        if combos and (self.target or self.transforms):
            raise ValueError("'target' and 'transforms' belong on a match, not on all/any/not")
        if combos in (["all"], ["any"]) and not getattr(self, combos[0]):
            raise ValueError(f"'{combos[0]}' needs at least one condition")
        return self

    @property
    def operator(self) -> str | None:
        """The name of the match's operator, as the policy writes it (None for a combination)."""
        given = self.given_operator()
        return given[0] if given else None

    def given_operator(self) -> tuple[str, Operator, Any] | None:
        """The match's operator: its name as the policy writes it, the `Operator`, and the value given to it."""
        for field, operator in OPERATORS.items():
            value = getattr(self, field)
            if _given(value):
                return _policy_name(field), operator, value
        return None


def _given(value: Any) -> bool:
    """An operator's value is given unless absent or `false` (`xss: false`); `equals: 0` is a value, not `false`."""
    return value is not None and value is not False


def _policy_name(field: str) -> str:
    return field.rstrip("_")  # in_ is `in`, not_ is `not`


# Condition's field name -> the Operator it carries: every operator, in the order the schema lists them.
OPERATORS: dict[str, Operator] = {
    name: marker
    for name, info in Condition.model_fields.items()
    for marker in info.metadata
    if isinstance(marker, Operator)
}


Action = Literal["score", "block", "monitor", "redact", "tag"]


class WafRule(_Strict):
    """One detection. `score` (the default) adds its severity's points to the request's anomaly score;
    `block` refuses at once; `monitor` only logs; `redact` masks what the regex matched in the prompt or JSON body;
    `tag` only labels the request."""

    id: WafRuleId
    description: str = ""
    severity: Severity = "critical"
    paranoia_level: Level = 1
    tags: list[str] = Field(default_factory=list)
    when: Condition
    action: Action = "score"
    score: Annotated[int | None, Field(ge=0, description="points instead of the severity's")] = None
    status: Annotated[int, Field(ge=400, le=599, description="for action: block")] = 403
    message: str | None = Field(default=None, description="for action: block; the client sees it")
    replacement: str = Field(default="[REDACTED]", description="for action: redact")

    @model_validator(mode="after")
    def _redact_has_regex(self) -> WafRule:
        if self.action == "redact" and not _has_regex(self.when):
            raise ValueError("action 'redact' needs a 'regex' condition (it replaces what the regex matched)")
        return self


def _has_regex(cond: Condition) -> bool:
    if cond.regex is not None:
        return True
    children = (cond.all or []) + (cond.any or []) + ([cond.not_] if cond.not_ else [])
    return any(_has_regex(c) for c in children)


class PackRef(_Strict):
    name: str
    paranoia_level: Level | None = Field(default=None, description="overrides the policy's level for this pack")


_DEFAULT_POINTS: dict[Severity, int] = {"critical": 5, "error": 4, "warning": 3, "notice": 2}


class Anomaly(_Strict):
    """CRS-style anomaly scoring: each matching `score` rule adds its severity's points; the request is blocked
    when the total reaches the inbound threshold."""

    inbound_threshold: Annotated[int, Field(gt=0)] = 5
    points: dict[Severity, Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: dict(_DEFAULT_POINTS))


class Exclusion(_Strict):
    """Rules that do not run where this applies. Empty scope lists mean everywhere; `rules` and `tags` select."""

    id: str = ""
    rules: list[str] = Field(default_factory=list, description="rule ids (a trailing * matches a prefix)")
    tags: list[str] = Field(default_factory=list, description="rules carrying any of these tags")
    routes: list[RouteName] = Field(default_factory=list)
    paths: list[str] = Field(default_factory=list, description="request path prefixes")
    tenants: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _selects(self) -> Exclusion:
        if not self.rules and not self.tags:
            raise ValueError("an exclusion names 'rules' or 'tags'")
        return self


class BlockResponse(_Strict):
    status: Annotated[int, Field(ge=400, le=599)] = 403
    message: str = "request blocked by the web application firewall"


class WafSpec(_Strict):
    """The WAF: built-in or custom rule packs at a paranoia level, the policy's own rules, scoring, exclusions."""

    mode: Switch[Literal["block", "monitor", "off"]] = Field(
        default="block", description="monitor: decide and log, never refuse; off: skip the WAF"
    )
    paranoia_level: Level = 1
    packs: list[str | PackRef] = Field(default_factory=list, description="rule packs enabled by name")
    anomaly: Anomaly = Anomaly()
    rules: list[WafRule] = Field(default_factory=list)
    exclusions: list[Exclusion] = Field(default_factory=list)
    block: BlockResponse = BlockResponse()

    @model_validator(mode="after")
    def _unique_ids(self) -> WafSpec:
        ids = [rule.id for rule in self.rules]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"WAF rule ids must be unique, repeated: {', '.join(repeated)}")
        return self

    def pack_refs(self) -> list[PackRef]:
        return [PackRef(name=p) if isinstance(p, str) else p for p in self.packs]


class PackMetadata(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]
    description: str = ""


class RulePack(_Strict):
    """A named set of WAF rules a policy enables with `spec.waf.packs`. Built-in packs ship inside the gateway;
    a policy directory may add its own."""

    apiVersion: Literal["portcullis.dev/v1"]
    kind: Literal["RulePack"]
    metadata: PackMetadata
    rules: list[WafRule] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_ids(self) -> RulePack:
        ids = [rule.id for rule in self.rules]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"rule ids must be unique within a pack, repeated: {', '.join(repeated)}")
        return self
