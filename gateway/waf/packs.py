"""Rule packs: the built-in ones shipped in `gateway/waf/packs/*.yaml`, and `kind: RulePack` documents a policy
directory adds; plus building each tenant's compiled WAF from the base policy and its overlay."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from gateway.waf.compile import active_rules
from gateway.waf.engine import CompiledWaf
from gateway.waf.model import RulePack, WafRule, WafSpec

BUILTIN_DIR = Path(__file__).parent / "packs"
_PACK = TypeAdapter(RulePack)


@functools.lru_cache(maxsize=1)
def builtin_packs() -> tuple[dict[str, RulePack], str]:
    """Every built-in pack by name, and a digest of their files (part of the policy version)."""
    packs: dict[str, RulePack] = {}
    digest = hashlib.sha256()
    for path in sorted(BUILTIN_DIR.glob("*.yaml")):
        text = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + text + b"\0")
        try:
            pack = _PACK.validate_python(yaml.safe_load(text))
        except ValidationError as exc:  # a bug in the gateway itself: the packs are tested
            raise RuntimeError(f"built-in rule pack {path} is invalid: {exc}") from exc
        packs[pack.metadata.name] = pack
    return packs, digest.hexdigest()[:16]


def pack_rules(custom: dict[str, RulePack]) -> dict[str, list[WafRule]]:
    packs = {name: list(p.rules) for name, p in builtin_packs()[0].items()}
    packs.update({name: list(p.rules) for name, p in custom.items()})
    return packs


def merge_overlay(base: WafSpec, overlay: WafSpec) -> WafSpec:
    """A tenant's WAF: fields the overlay sets replace the base's; rules with a base rule's id replace it, new ids
    add to it; exclusions add to the base's."""
    updates = {name: getattr(overlay, name) for name in overlay.model_fields_set if name not in ("rules", "exclusions")}
    replaced = {rule.id: rule for rule in overlay.rules}
    rules = [replaced.pop(rule.id, rule) for rule in base.rules] + list(replaced.values())
    return base.model_copy(update={**updates, "rules": rules, "exclusions": [*base.exclusions, *overlay.exclusions]})


def known_rule_ids(spec: WafSpec, packs: dict[str, list[WafRule]]) -> set[str]:
    ids = {rule.id for rule in spec.rules}
    for ref in spec.pack_refs():
        ids.update(rule.id for rule in packs.get(ref.name, ()))
    return ids


def compile_waf(
    spec: WafSpec, packs: dict[str, list[WafRule]], version: str, disabled: list[str] | tuple[str, ...] = ()
) -> CompiledWaf:
    return CompiledWaf(spec, active_rules(spec, packs, disabled), version)


class WafSet:
    """Every tenant's compiled WAF for one policy version; tenants without a WAF overlay share the base's."""

    def __init__(self, base: CompiledWaf, tenants: dict[str, CompiledWaf] | None = None) -> None:
        self.base = base
        self.tenants = tenants or {}

    @classmethod
    def empty(cls) -> WafSet:
        return cls(CompiledWaf(WafSpec(), [], "empty"))

    def for_tenant(self, tenant: str | None) -> CompiledWaf:
        return self.tenants.get(tenant, self.base) if tenant else self.base

    @functools.cached_property
    def enabled_anywhere(self) -> bool:
        """False when no tenant has a rule to run: the stage then skips even the caller lookup (asked of every
        request, answered once per set)."""
        return self.base.enabled or any(waf.enabled for waf in self.tenants.values())


def check_packs(base: WafSpec, overlays: dict[str, WafSpec], custom: list[tuple[Path, RulePack]]) -> list[str]:
    """Problems with pack names: custom packs named twice or like a built-in one, unknown packs enabled."""
    problems = []
    builtin = builtin_packs()[0]
    seen: dict[str, Path] = {}
    for path, pack in custom:
        name = pack.metadata.name
        if name in builtin:
            problems.append(f"{path}: rule pack {name!r} has the name of a built-in pack")
        elif name in seen:
            problems.append(f"{path}: rule pack {name!r} is already defined in {seen[name]}")
        seen[name] = path
    known = set(builtin) | set(seen)
    for where, spec in [("base policy", base), *((f"tenant {t!r}", s) for t, s in overlays.items())]:
        for ref in spec.pack_refs():
            if ref.name not in known:
                problems.append(
                    f"{where}: spec.waf.packs names unknown rule pack {ref.name!r} (known: {', '.join(sorted(known))})"
                )
    return problems


def build_waf_set(
    base: WafSpec, overlays: dict[str, tuple[WafSpec | None, list[str]]], custom: dict[str, RulePack], version: str
) -> WafSet:
    """Compile the base WAF and one per tenant whose overlay changes it (a `waf` section or disabled WAF ids)."""
    packs = pack_rules(custom)
    compiled = compile_waf(base, packs, version)
    ids = known_rule_ids(base, packs)
    tenants = {}
    shared: dict[str, CompiledWaf] = {}  # tenants whose effective WAF is identical share one compilation
    for tenant, (overlay, disabled) in overlays.items():
        waf_disabled = [d for d in disabled if d in ids or (overlay and d in known_rule_ids(overlay, packs))]
        if overlay is None and not waf_disabled:
            continue
        spec = merge_overlay(base, overlay) if overlay is not None else base
        key = spec.model_dump_json() + "\0" + ",".join(sorted(waf_disabled))
        if key not in shared:
            shared[key] = compile_waf(spec, packs, version, waf_disabled)
        tenants[tenant] = shared[key]
    return WafSet(compiled, tenants)
