"""Load a policy directory into one validated, versioned PolicySet.

All files are read and validated together, so a set is either whole or refused; errors name the file, the line and
the key path. The version is a hash of the files' contents, so every decision can say which policy made it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import TypeAdapter, ValidationError

from gateway.config import format_key_path
from gateway.guard.spec import GuardSpec
from gateway.guard.spec import overlay as guard_overlay
from gateway.mcp.spec import McpSpec
from gateway.mcp.spec import overlay as mcp_overlay
from gateway.policy.model import (
    AdmissionPolicy,
    BudgetRule,
    CacheSpec,
    Document,
    Metadata,
    Policy,
    PolicySpec,
    RateLimitRule,
    TenantPolicy,
)
from gateway.waf import match_all
from gateway.waf.engine import CompiledWaf
from gateway.waf.model import RulePack
from gateway.waf.packs import WafSet, build_waf_set, builtin_packs, check_packs, known_rule_ids, pack_rules

_DOCUMENT = TypeAdapter(Document)
R = TypeVar("R", RateLimitRule, BudgetRule)


_DEFAULT_ADMISSION = AdmissionPolicy()  # built once: every request asks for it
_NO_CACHE = CacheSpec()


class PolicyError(Exception):
    """A policy directory that cannot be used; the message lists every problem found."""


@dataclass(frozen=True)
class PolicySet:
    base: Policy
    overlays: dict[str, TenantPolicy]
    version: str
    _rate_limits: dict[str | None, tuple[RateLimitRule, ...]] = field(default_factory=dict, repr=False)
    _budgets: dict[str | None, tuple[BudgetRule, ...]] = field(default_factory=dict, repr=False)
    waf: WafSet = field(default_factory=WafSet.empty, repr=False)  # compiled once here, per tenant
    _guards: dict[str | None, GuardSpec] = field(default_factory=dict, repr=False, compare=False)
    warnings: tuple[str, ...] = ()  # rules that match every request (gateway.waf.match_all); logged, not fatal

    def __post_init__(self) -> None:
        # every tenant's rules merged once here, and the base's under None for the tenants with no overlay: each
        # request looks its rules up, none rebuilds them
        self._rate_limits.update({t: _merge(self.base.spec.rate_limits, o) for t, o in self.overlays.items()})
        self._rate_limits[None] = tuple(self.base.spec.rate_limits)
        self._budgets.update({t: _merge_budgets(self.base.spec.budgets, o) for t, o in self.overlays.items()})
        self._budgets[None] = tuple(self.base.spec.budgets)

    def admission_for(self, tenant: str | None) -> AdmissionPolicy:
        overlay = self.overlays.get(tenant) if tenant else None
        return (overlay and overlay.spec.admission) or self.base.spec.admission or _DEFAULT_ADMISSION

    def cache_for(self, tenant: str | None) -> CacheSpec:
        overlay = self.overlays.get(tenant) if tenant else None
        return (overlay and overlay.spec.cache) or self.base.spec.cache or _NO_CACHE

    def guard_for(self, tenant: str | None) -> GuardSpec:
        """The tenant's guard spec: the base's, with the fields its overlay gives (computed once per tenant)."""
        cache = self._guards
        spec = cache.get(tenant)
        if spec is None:
            overlay = self.overlays.get(tenant) if tenant else None
            given = (
                overlay.spec.guard.model_dump(exclude_unset=True)
                if overlay and "guard" in overlay.spec.model_fields_set
                else None
            )
            guard = overlay.spec.guard if overlay is not None else None
            spec = cache[tenant] = guard_overlay(self.base.spec.guard, guard, given)
        return spec

    def mcp_for(self, tenant: str | None) -> McpSpec:
        """The tenant's MCP spec: the base's, with the tool lists its overlay gives."""
        overlay = self.overlays.get(tenant) if tenant else None
        return mcp_overlay(self.base.spec.mcp, overlay.spec.mcp if overlay is not None else None)

    def waf_for(self, tenant: str | None) -> CompiledWaf:
        return self.waf.for_tenant(tenant)

    def rate_limits_for(self, tenant: str | None) -> tuple[RateLimitRule, ...]:
        found = self._rate_limits.get(tenant)
        return self._rate_limits[None] if found is None else found

    def budgets_for(self, tenant: str | None) -> tuple[BudgetRule, ...]:
        found = self._budgets.get(tenant)
        return self._budgets[None] if found is None else found


def _merge(base: list[RateLimitRule], overlay: TenantPolicy) -> tuple[RateLimitRule, ...]:
    return _by_id(base, [_counted_apart(rule) for rule in overlay.spec.rate_limits], overlay.spec.disable)


def _counted_apart(rule: RateLimitRule) -> RateLimitRule:
    """An overlay's rule counts its tenant's requests alone. A counter is named by its rule's id and key, so two
    overlays' rules of one id keyed by `client_ip`, `model`, `route` or nothing (or an overlay's replacement of such a
    base rule) shared one: another tenant's traffic from the same address used up this tenant's limit."""
    if "tenant" in rule.key or "api_key" in rule.key:  # a key belongs to one tenant
        return rule
    return rule.model_copy(update={"key": ["tenant", *rule.key]})


def _merge_budgets(base: list[BudgetRule], overlay: TenantPolicy) -> tuple[BudgetRule, ...]:
    return _by_id(base, overlay.spec.budgets, overlay.spec.disable)


def _by_id(base: list[R], given: list[R], disabled: list[str]) -> tuple[R, ...]:
    """An overlay's rules replace the base's with the same id and add the others; `disable` drops base ids."""
    replaced: dict[str, R] = {rule.id: rule for rule in given}
    kept: list[R] = [replaced.pop(rule.id, rule) for rule in base if rule.id not in disabled]
    return tuple(kept + list(replaced.values()))


def empty_policy_set() -> PolicySet:
    """What runs when no policy directory exists: no limits, no rules."""
    base = Policy(apiVersion="portcullis.dev/v1", kind="Policy", metadata=Metadata(name="empty"), spec=PolicySpec())
    return PolicySet(base=base, overlays={}, version="empty")


def load_policy_dir(directory: Path) -> PolicySet:
    """Read `DIR/*.yaml` (the base and shared documents) and `DIR/tenants/*.yaml` (overlays); nothing else."""
    files = sorted(p for folder in (directory, directory / "tenants") for p in folder.glob("*.y*ml") if p.is_file())
    digest = hashlib.sha256()
    problems: list[str] = []
    bases: list[tuple[Path, Policy]] = []
    overlays: dict[str, tuple[Path, TenantPolicy]] = {}
    packs: list[tuple[Path, RulePack]] = []
    for path in files:
        text = path.read_bytes()
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + text + b"\0")
        for document in _documents(path, text, problems):
            if isinstance(document, Policy):
                bases.append((path, document))
            elif isinstance(document, RulePack):
                packs.append((path, document))
            elif document.tenant in overlays:
                problems.append(
                    f"{path}: tenant {document.tenant!r} already has an overlay in {overlays[document.tenant][0]}"
                )
            else:
                overlays[document.tenant] = (path, document)
    if len(bases) != 1 and not problems:
        found = ", ".join(str(p) for p, _ in bases) or "none"
        problems.append(f"{directory}: exactly one 'kind: Policy' document is required (found: {found})")
    if bases:
        base_ids = {rule.id for rule in bases[0][1].spec.rate_limits}
        problems.extend(check_packs(bases[0][1].spec.waf, {t: o.spec.waf for t, (_, o) in overlays.items()}, packs))
        base_ids |= known_rule_ids(bases[0][1].spec.waf, pack_rules({p.metadata.name: p for _, p in packs}))
        for path, overlay in overlays.values():
            for rule_id in sorted(set(overlay.spec.disable) - base_ids):
                problems.append(f"{path}: tenant {overlay.tenant!r} disables unknown rule id {rule_id!r}")
    if problems:
        raise PolicyError("invalid policy:\n" + "\n".join(f"  {p}" for p in problems))
    digest.update(b"builtin-packs\0" + builtin_packs()[1].encode())
    version = "sha256:" + digest.hexdigest()[:16]
    base = bases[0][1]
    try:
        waf = build_waf_set(
            base.spec.waf,
            {
                t: (o.spec.waf if "waf" in o.spec.model_fields_set else None, o.spec.disable)
                for t, (_, o) in overlays.items()
            },
            {p.metadata.name: p for _, p in packs},
            version,
        )
    except Exception as exc:  # e.g. an RE2 set over its memory budget
        raise PolicyError(f"invalid policy:\n  {directory}: WAF rules do not compile: {exc}") from exc
    findings = match_all.inspect(waf)
    if findings.blanket_blocks:
        raise PolicyError("invalid policy:\n" + "\n".join(f"  {directory}: {b}" for b in findings.blanket_blocks))
    return PolicySet(
        base=base,
        overlays={t: o for t, (_, o) in overlays.items()},
        version=version,
        waf=waf,
        warnings=findings.warnings + _semantic_warnings(base, [o for _, o in overlays.values()]),
    )


def _semantic_warnings(base: Policy, overlays: list[TenantPolicy]) -> tuple[str, ...]:
    """The semantic cache answers a question with the answer to another one its embeddings call alike: said at every
    load where a policy turns it on, since a wrong threshold (or a model that is no embedding model) serves wrong
    answers without any error."""
    specs = [("base policy", base.spec.cache)] + [(f"tenant {o.tenant!r}", o.spec.cache) for o in overlays]
    return tuple(
        f"{where}: spec.cache.semantic answers a request with the answer of another whose last user text "
        f"{spec.semantic.model!r} embeds at least {spec.semantic.threshold:g} alike; a false hit is another question's "
        "answer: measure the model and threshold on your own traffic (docs/policies.md#the-semantic-match)"
        for where, spec in specs
        if spec is not None and spec.enabled and spec.semantic is not None
    )


def _documents(path: Path, text: bytes, problems: list[str]) -> list[Policy | TenantPolicy | RulePack]:
    try:
        source = text.decode()
        nodes = list(yaml.compose_all(source))  # for line numbers
        datas = list(yaml.safe_load_all(source))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        problems.append(f"{path}: invalid YAML: {exc}")
        return []
    out = []
    for node, data in zip(nodes, datas):
        if node is None:
            continue
        try:
            out.append(_DOCUMENT.validate_python(data))
        except ValidationError as exc:
            for err in exc.errors():
                loc = tuple(err["loc"])
                if loc and loc[0] in ("Policy", "TenantPolicy", "RulePack"):
                    loc = loc[1:]  # the discriminator's tag is not a key in the file
                line = _line_of(node, loc)
                problems.append(f"{path}:{line}: {format_key_path(loc)}{_rule_hint(data, loc)}: {err['msg']}")
    return out


def _line_of(node: yaml.Node, loc: tuple[str | int, ...]) -> int:
    """1-based line of the deepest YAML node on the error's key path."""
    for part in loc:
        child = None
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            child = node.value[part]
        if child is None:
            break
        node = child
    return node.start_mark.line + 1


def _rule_hint(data: object, loc: tuple[str | int, ...]) -> str:
    """' (rule id X)' when the error sits inside a rule that has an id."""
    if isinstance(data, dict) and len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):  # RulePack
        loc, data = ("spec", "rules", *loc[1:]), {"spec": data}
    if isinstance(data, dict) and len(loc) >= 4 and loc[:2] == ("spec", "waf") and isinstance(data.get("spec"), dict):
        loc, data = ("spec", *loc[2:]), {"spec": data["spec"].get("waf") or {}}
    if len(loc) >= 3 and loc[0] == "spec" and isinstance(loc[2], int) and isinstance(data, dict):
        rules = (data.get("spec") or {}).get(loc[1])
        if isinstance(rules, list) and loc[2] < len(rules) and isinstance(rules[loc[2]], dict):
            rule_id = rules[loc[2]].get("id")
            if rule_id:
                return f" (rule id {rule_id})"
    return ""
