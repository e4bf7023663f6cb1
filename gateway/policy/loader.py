"""Load a policy directory into one validated, versioned PolicySet.

All files are read and validated together, so a set is either whole or refused; errors name the file, the line and
the key path. The version is a hash of the files' contents, so every decision can say which policy made it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from gateway.config import format_key_path
from gateway.policy.model import Document, Policy, PolicySpec, RateLimitRule, TenantPolicy

_DOCUMENT = TypeAdapter(Document)


class PolicyError(Exception):
    """A policy directory that cannot be used; the message lists every problem found."""


@dataclass(frozen=True)
class PolicySet:
    base: Policy
    overlays: dict[str, TenantPolicy]
    version: str
    _rate_limits: dict[str, tuple[RateLimitRule, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._rate_limits.update({t: _merge(self.base.spec.rate_limits, o) for t, o in self.overlays.items()})

    def rate_limits_for(self, tenant: str | None) -> tuple[RateLimitRule, ...]:
        if tenant in self._rate_limits:
            return self._rate_limits[tenant]
        return tuple(self.base.spec.rate_limits)


def _merge(base: list[RateLimitRule], overlay: TenantPolicy) -> tuple[RateLimitRule, ...]:
    replaced = {rule.id: rule for rule in overlay.spec.rate_limits}
    kept = [replaced.pop(rule.id, rule) for rule in base if rule.id not in overlay.spec.disable]
    return (*kept, *replaced.values())


def empty_policy_set() -> PolicySet:
    """What runs when no policy directory exists: no limits, no rules."""
    base = Policy(apiVersion="portcullis.dev/v1", kind="Policy", metadata={"name": "empty"}, spec=PolicySpec())
    return PolicySet(base=base, overlays={}, version="empty")


def load_policy_dir(directory: Path) -> PolicySet:
    """Read `DIR/*.yaml` (the base and shared documents) and `DIR/tenants/*.yaml` (overlays); nothing else."""
    files = sorted(p for folder in (directory, directory / "tenants") for p in folder.glob("*.y*ml") if p.is_file())
    digest = hashlib.sha256()
    problems: list[str] = []
    bases: list[tuple[Path, Policy]] = []
    overlays: dict[str, tuple[Path, TenantPolicy]] = {}
    for path in files:
        text = path.read_bytes()
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + text + b"\0")
        for document in _documents(path, text, problems):
            if isinstance(document, Policy):
                bases.append((path, document))
            elif document.tenant in overlays:
                problems.append(f"{path}: tenant {document.tenant!r} already has an overlay in "
                                f"{overlays[document.tenant][0]}")
            else:
                overlays[document.tenant] = (path, document)
    if len(bases) != 1 and not problems:
        found = ", ".join(str(p) for p, _ in bases) or "none"
        problems.append(f"{directory}: exactly one 'kind: Policy' document is required (found: {found})")
    if bases:
        base_ids = {rule.id for rule in bases[0][1].spec.rate_limits}
        for path, overlay in overlays.values():
            for rule_id in sorted(set(overlay.spec.disable) - base_ids):
                problems.append(f"{path}: tenant {overlay.tenant!r} disables unknown rule id {rule_id!r}")
    if problems:
        raise PolicyError("invalid policy:\n" + "\n".join(f"  {p}" for p in problems))
    return PolicySet(base=bases[0][1], overlays={t: o for t, (_, o) in overlays.items()},
                     version="sha256:" + digest.hexdigest()[:16])


def _documents(path: Path, text: bytes, problems: list[str]) -> list[Policy | TenantPolicy]:
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
                if loc and loc[0] in ("Policy", "TenantPolicy"):
                    loc = loc[1:]  # the discriminator's tag is not a key in the file
                line = _line_of(node, loc)
                problems.append(f"{path}:{line}: {format_key_path(loc)}{_rule_hint(data, loc)}: {err['msg']}")
    return out


def _line_of(node: yaml.Node, loc: tuple) -> int:
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


def _rule_hint(data: object, loc: tuple) -> str:
    """' (rule id X)' when the error sits inside a rule that has an id."""
    if len(loc) >= 3 and loc[0] == "spec" and isinstance(loc[2], int) and isinstance(data, dict):
        rules = (data.get("spec") or {}).get(loc[1])
        if isinstance(rules, list) and loc[2] < len(rules) and isinstance(rules[loc[2]], dict):
            rule_id = rules[loc[2]].get("id")
            if rule_id:
                return f" (rule id {rule_id})"
    return ""
