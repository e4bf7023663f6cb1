"""The security team's policy model: one versioned document format for everything `policies/` holds.

A policy directory holds one `kind: Policy` document (the base) and any number of `kind: TenantPolicy` overlays.
Each has a `spec` with one section per concern — today `rate_limits`; WAF rules, admission defaults and guard
thresholds are further sections of the same spec, never a second format. The JSON Schema published in
`policies/schema.json` is generated from these classes (`portcullis policy schema`).
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from gateway.apis.routes import RouteName
from gateway.guard.spec import GuardSpec
from gateway.mcp.spec import McpSpec
from gateway.waf.model import RulePack, WafSpec

API_VERSION = "portcullis.dev/v1"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def _seconds(value: object) -> object:
    """Durations as numbers of seconds or strings like '500ms', '1s', '1m', '24h', '1d'."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if not match:
            raise ValueError(f"invalid duration {value!r}: use a number of seconds or e.g. '1s', '1m', '1h', '1d'")
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return value


Duration = Annotated[
    float,
    BeforeValidator(_seconds),
    Field(
        gt=0,
        json_schema_extra={
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0},
                {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*(ms|s|m|h|d)?\s*$"},
            ]
        },
    ),
]

RuleId = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]
KeyPart = Literal["api_key", "tenant", "client_ip", "model", "route", "tool"]
_PER_TENANT: tuple[KeyPart, ...] = ("tenant",)  # a rule's default key: one counter per tenant


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestRate(_Strict):
    """Requests per period, enforced by GCRA: smooth, no burst at window edges."""

    limit: Annotated[int, Field(gt=0)]
    per: Duration
    burst: Annotated[int | None, Field(gt=0, description="requests allowed at once; default: limit")] = None


class TokenRate(_Strict):
    """Tokens per period. Reserved at admission (prompt + max_tokens), reconciled with real usage at the end."""

    limit: Annotated[int, Field(gt=0)]
    per: Duration
    count: Literal["input", "output", "total"] = "total"


class Concurrency(_Strict):
    """Requests in flight at once. A lease bounds how long a crashed gateway can hold a slot."""

    limit: Annotated[int, Field(gt=0)]
    lease: Duration = 600.0


class Scope(_Strict):
    """Where a rule applies; an empty list means everywhere."""

    routes: list[RouteName] = Field(default_factory=list)
    models: list[str] = Field(default_factory=list)
    tools: list[str] = Field(
        default_factory=list,
        description="MCP tools as 'server/tool': the rule applies only to calls of these (route mcp, tools/call)",
    )


class RateLimitRule(_Strict):
    id: RuleId
    description: str = ""
    key: list[KeyPart] = Field(
        default_factory=lambda: list(_PER_TENANT),
        description="request parts that identify one counter; [] is one global counter",
    )
    match: Scope = Scope()
    requests: RequestRate | None = None
    tokens: TokenRate | None = None
    concurrency: Concurrency | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> RateLimitRule:
        kinds = [k for k in ("requests", "tokens", "concurrency") if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError("give exactly one of 'requests', 'tokens' or 'concurrency'")
        return self

    @property
    def kind(self) -> str:
        return "requests" if self.requests else "tokens" if self.tokens else "concurrency"


class AdmissionPolicy(_Strict):
    """Defaults the admission stage applies before a request may enter."""

    default_max_tokens: Annotated[int, Field(gt=0, description="filled into requests that name no max_tokens")] = 1024
    max_n: Annotated[
        int,
        Field(
            gt=0,
            description=(
                "most choices one request may ask for (n, or best_of for completions): each multiplies what it may "
                "generate and what its token limits reserve; above it, 400"
            ),
        ),
    ] = 8


CacheableRoute = Literal["chat", "completions", "responses", "embeddings", "messages"]


class CacheScope(_Strict):
    """Which requests the response cache serves; an empty list means all."""

    routes: list[CacheableRoute] = Field(default_factory=list)
    models: list[str] = Field(default_factory=list)
    pools: list[str] = Field(default_factory=list)


class SemanticCache(_Strict):
    """Opt-in, beside the exact match: a chat or Messages request equal to one the tenant sent before in everything
    but its last user message, whose text is close enough to that one's (the cosine similarity of their embeddings),
    is answered with that request's answer. A paraphrase answered as its original is the point; a question that
    differs in one word it matters (a name, a number, a negation) answered as the other is the cost: measure it on
    your own traffic before choosing the threshold (docs/policies.md#response-cache-speccache)."""

    model: Annotated[str, Field(min_length=1, description="the embeddings model: a pool that serves it embeds")]
    threshold: Annotated[float, Field(gt=0, le=1, description="the least cosine similarity served as a hit")] = 0.95
    tools: bool = Field(default=False, description="requests with tools too (their calls depend on exact wording)")


class CacheSpec(_Strict):
    """The exact-match response cache (docs/policies.md#cache): an answer is served again, to the same tenant only,
    for a request whose canonical body, route, model and pool are the same. Off by default."""

    enabled: bool = False
    ttl: Duration = Field(default=300.0, description="how long an answer is served again after it was stored")
    deterministic_only: bool = Field(
        default=True,
        description=(
            "only requests whose answer is reproducible are cached: temperature 0 or a seed (embeddings always); "
            "false caches sampled answers too, so a repeated request gets the same sample"
        ),
    )
    match: CacheScope = CacheScope()
    semantic: SemanticCache | None = Field(default=None, description="off unless given")

    def applies(self, route: str, model: str, pool: str) -> bool:
        scope = self.match
        return (
            (not scope.routes or route in scope.routes)
            and (not scope.models or model in scope.models)
            and (not scope.pools or pool in scope.pools)
        )


class Price(_Strict):
    """What a model's tokens cost, per million tokens, in the table's currency."""

    input: Annotated[float, Field(ge=0)] = 0.0
    cached_input: Annotated[
        float | None, Field(ge=0, description="prompt tokens served from a prefix cache; default: the input price")
    ] = None
    output: Annotated[float, Field(ge=0)] = 0.0
    cached: Annotated[
        float,
        Field(
            ge=0,
            description=(
                "tokens (prompt and completion alike) of an answer the gateway's response cache served, which no "
                "upstream was asked for"
            ),
        ),
    ] = 0.0

    @property
    def rates(self) -> tuple[float, float, float]:
        """Input, cached input and output prices."""
        return self.input, self.input if self.cached_input is None else self.cached_input, self.output


class PriceTable(_Strict):
    """What a request costs, priced from the tokens it is charged after reconciliation (those token limits settle
    on): spend per tenant and model in /metrics and each request's cost in the access log."""

    currency: Annotated[str, Field(min_length=1, max_length=8)] = "USD"
    default: Price = Field(default_factory=Price, description="models the table does not name")
    models: dict[str, Price] = Field(default_factory=dict)

    def cost_nanos(self, model: str, prompt: int, cached: int, completion: int) -> int:
        """In whole nanos (1e-9) of the currency, rounded once per request, so spend adds up exactly; `cached` of
        the `prompt` tokens came from a prefix cache. A price per million tokens is nanos per thousand tokens."""
        rates = self._rates.get(model)
        input_price, cached_price, output_price = self._rates[None] if rates is None else rates
        return round(((prompt - cached) * input_price + cached * cached_price + completion * output_price) * 1000)

    def cache_hit_nanos(self, model: str, tokens: int) -> int:
        """What an answer served from the response cache costs: its tokens at the model's `cached` price."""
        return round(tokens * self.models.get(model, self.default).cached * 1000)

    @functools.cached_property
    def _rates(self) -> dict[str | None, tuple[float, float, float]]:
        """Each model's prices (None: the default's), read once rather than from the models' fields on every
        request, twice a request where a budget reserves."""
        rates: dict[str | None, tuple[float, float, float]] = {m: price.rates for m, price in self.models.items()}
        rates[None] = self.default.rates
        return rates


BudgetPeriod = Annotated[
    str,
    Field(
        pattern=r"^(day|month|\s*[1-9]\d*\s*(h|d)\s*)$",
        description=(
            "'day' and 'month' are calendar periods in UTC; whole hours or days such as '12h' or '7d' are a fixed "
            "window, windows counted from the Unix epoch (whole hours: the spend ledger keeps hours)"
        ),
    ),
]


KEY_BUDGET_ID = "key"  # the id of a stored key's own budget (gateway/spend/budgets.py), beside the policy's ids


class Budget(_Strict):
    """Spend allowed per period, in the price table's currency. Enforced before the request like token limits:
    the expected cost (prompt, plus the output budget at the output price) is reserved, and settled on the cost
    of the reconciled usage. Spent out: 429 `budget_exceeded`."""

    limit: Annotated[
        float,
        Field(gt=0, le=9_000_000, description="at most 9 million: spend is counted exactly in nanos up to 2^53"),
    ]
    period: BudgetPeriod = "month"
    soft: list[Annotated[float, Field(gt=0, lt=1)]] = Field(
        default_factory=lambda: [0.8],
        description="fractions of the limit whose crossing logs an event and counts a metric, once per period",
    )


class BudgetRule(Budget):
    id: RuleId
    description: str = ""
    key: Literal["tenant", "api_key"] = Field(
        default="tenant", description="one budget per tenant, or one per API key (each key its own limit)"
    )

    @field_validator("id")
    @classmethod
    def _not_a_keys_own(cls, budget_id: str) -> str:
        """A budget's counters are named by its id and payer: one with a key's own budget's id would share them."""
        if budget_id == KEY_BUDGET_ID:
            raise ValueError(
                f"'{KEY_BUDGET_ID}' is the id of a stored key's own budget, whose counters a policy budget of that id "
                "would share (one tenant's spend charged to another's key): name it otherwise"
            )
        return budget_id


class PolicySpec(_Strict):
    rate_limits: list[RateLimitRule] = Field(default_factory=list)
    budgets: list[BudgetRule] = Field(
        default_factory=list, description="spend per tenant or key and period; in an overlay, merged by id"
    )
    admission: AdmissionPolicy | None = Field(default=None, description="in an overlay, replaces the base's whole")
    cache: CacheSpec | None = Field(
        default=None, description="the response cache; in an overlay, replaces the base's whole"
    )
    waf: WafSpec = Field(
        default_factory=WafSpec,
        description=("web application firewall; in an overlay, the fields given replace the base's, rules merge by id"),
    )
    guard: GuardSpec = Field(
        default_factory=GuardSpec,
        description=(
            "guardrails: injection classifier, PII/secrets, output guard; in an overlay, the fields given replace "
            "the base's"
        ),
    )
    prices: PriceTable = Field(
        default_factory=PriceTable, description="per model, per million tokens; the base policy's only"
    )
    mcp: McpSpec = Field(
        default_factory=McpSpec,
        description=(
            "MCP servers' tool allow-lists and pinned definitions (docs/mcp.md); in an overlay, a server's tools "
            "replace the base's, pins and the rest are the base's only"
        ),
    )

    @model_validator(mode="after")
    def _unique_ids(self) -> PolicySpec:
        ids = [rule.id for rule in self.rate_limits] + [rule.id for rule in self.budgets]
        repeated = sorted({i for i in ids if ids.count(i) > 1})
        if repeated:
            raise ValueError(f"rate limit and budget ids must be unique, repeated: {', '.join(repeated)}")
        return self


class Metadata(_Strict):
    name: str
    description: str = ""


class Policy(_Strict):
    """The base policy every tenant starts from."""

    apiVersion: Literal["portcullis.dev/v1"]
    kind: Literal["Policy"]
    metadata: Metadata
    spec: PolicySpec = PolicySpec()


class TenantSpec(PolicySpec):
    disable: list[RuleId] = Field(default_factory=list, description="base rule ids that do not apply to this tenant")

    @model_validator(mode="after")
    def _no_prices(self) -> TenantSpec:
        if "prices" in self.model_fields_set:
            raise ValueError("'prices' belong to the base policy: a model's tokens cost the same whoever sends them")
        mcp = self.mcp
        if mcp.model_fields_set - {"servers"} or any(server.pinned for server in mcp.servers.values()):
            raise ValueError(
                "an overlay's 'mcp' gives servers' tools only: pins, the pin mode and relayed methods belong to the "
                "base policy (a tool's definition reads the same whoever lists it)"
            )
        return self


class TenantPolicy(_Strict):
    """An overlay for one tenant: rules with a base rule's id replace it, new ids add to it."""

    apiVersion: Literal["portcullis.dev/v1"]
    kind: Literal["TenantPolicy"]
    metadata: Metadata
    tenant: str
    spec: TenantSpec = TenantSpec()


Document = Annotated[Policy | TenantPolicy | RulePack, Field(discriminator="kind")]


def json_schema() -> dict[str, Any]:
    """The published schema (`policies/schema.json`): any one policy document."""
    schema = TypeAdapter(Document).json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://portcullis.dev/policy/v1",
        "title": "Portcullis policy document",
        **schema,
    }
