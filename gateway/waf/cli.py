"""`portcullis policy test` and `portcullis policy explain`, and the WAF checks `portcullis policy check` adds:
rules that match every request (gateway/waf/match_all.py), duplicate rule ids across enabled packs, dead rules
(never active at any tenant's paranoia level, or excluded everywhere) and shadowed rules (the same condition as an
earlier rule)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gateway.policy.loader import PolicyError, PolicySet, load_policy_dir
from gateway.waf.cases import load_cases, request_of, run_cases
from gateway.waf.engine import CompiledWaf
from gateway.waf.model import Condition, WafSpec
from gateway.waf.packs import builtin_packs, merge_overlay
from gateway.waf.verdict import RuleMatch


def add_verbs(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    test = verbs.add_parser(
        "test", help="run request fixtures (go-ftw style YAML) against a policy; non-zero on failure"
    )
    test.add_argument("directory", type=Path)
    test.add_argument("--cases", type=Path, required=True, help="a case file, or a directory of them")
    test.add_argument("-v", "--verbose", action="store_true", help="print passing cases too")
    test.set_defaults(func=_test)
    explain = verbs.add_parser("explain", help="which WAF rules fire for a request, and why")
    explain.add_argument("directory", type=Path)
    explain.add_argument("--tenant")
    explain.add_argument("--key-label")
    explain.add_argument("--method", default="POST")
    explain.add_argument("--uri", default="/v1/chat/completions")
    explain.add_argument("-H", "--header", action="append", default=[], help="'Name: value' (repeatable)")
    body = explain.add_mutually_exclusive_group()
    body.add_argument("--data", help="raw body")
    body.add_argument("--json", help="JSON body")
    body.add_argument("--prompt", help="a chat request whose user message is this text")
    explain.add_argument("--format", choices=["text", "json"], default="text")
    explain.set_defaults(func=_explain)


def _load(directory: Path) -> PolicySet | None:
    try:
        return load_policy_dir(directory)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return None


def _test(args: argparse.Namespace) -> int:
    policies = _load(args.directory)
    if policies is None:
        return 2
    cases = load_cases(args.cases)
    results = run_cases(cases, policies.waf_for)
    failed = 0
    for case, verdict, problems in results:
        if problems:
            failed += 1
            print(
                f"FAIL {case.name} {case.desc}: {'; '.join(problems)} (fired: {', '.join(verdict.rule_ids) or 'none'},"
                f" score {verdict.score})"
            )
        elif args.verbose:
            print(f"ok   {case.name} {verdict.action} {', '.join(verdict.rule_ids)}")
    print(f"{len(results) - failed} passed, {failed} failed (policy {policies.version})")
    return 1 if failed else 0


def _explain(args: argparse.Namespace) -> int:
    policies = _load(args.directory)
    if policies is None:
        return 2
    given: dict[str, Any] = {
        "method": args.method,
        "uri": args.uri,
        "headers": dict(h.split(":", 1) for h in args.header) if args.header else None,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if args.data is not None:
        given["data"] = args.data
    if args.json is not None:
        given["json"] = json.loads(args.json)
    if args.prompt is not None:
        given["prompt"] = args.prompt
    for key in ("tenant", "key_label"):
        if getattr(args, key):
            given[key] = getattr(args, key)
    view = request_of(given)
    if "headers" in given:
        view.headers = [(k.strip().lower(), v.strip()) for k, v in given["headers"].items()]
        if not any(k == "content-type" for k, _ in view.headers) and view.payload is not None:
            view.headers.append(("content-type", "application/json"))
    waf = policies.waf_for(view.tenant)
    verdict = waf.evaluate(view, all_matches=True)
    out: dict[str, Any] = {
        "policy_version": policies.version,
        "tenant": view.tenant,
        "mode": waf.mode,
        "paranoia_level": waf.spec.paranoia_level,
        "verdict": verdict.action,
        "score": verdict.score,
        "threshold": waf.threshold,
        "blocking_rule": verdict.blocking_rule.id if verdict.blocking_rule else None,
        "rules": [_why(waf, m) for m in verdict.matches],
    }
    if args.format == "json":
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"policy {out['policy_version']}  tenant {out['tenant']}  mode {out['mode']}  "
        f"paranoia level {out['paranoia_level']}"
    )
    for rule in out["rules"]:
        print(
            f"  {rule['id']:<18} {rule['severity']:<8} +{rule['points']:<2} {rule['action']:<7} "
            f"{rule['part']}: {rule['operator']} matched {rule['matched']!r}"
        )
        print(
            f"  {'':<18} {rule['description']} (pack {rule['pack'] or 'policy'}, transforms "
            f"{', '.join(rule['transforms']) or 'none'})"
        )
    print(
        f"verdict: {out['verdict']} (score {out['score']}/{out['threshold']}"
        f"{', by ' + out['blocking_rule'] if out['blocking_rule'] else ''})"
    )
    return 0


def _why(waf: CompiledWaf, match: RuleMatch) -> dict[str, Any]:
    compiled = next(r for r in waf.rules if r.rule is match.rule)
    return {
        "id": match.rule.id,
        "description": match.rule.description,
        "severity": match.rule.severity,
        "points": match.points,
        "action": match.rule.action,
        "pack": compiled.pack,
        "part": match.hit.part,
        "operator": match.hit.operator,
        "matched": match.hit.matched[:120],
        "transforms": sorted({t for c in _leaves(match.rule.when) for t in c.transforms}),
    }


def _leaves(cond: Condition) -> list[Condition]:
    if cond.operator:
        return [cond]
    children = (cond.all or []) + (cond.any or []) + ([cond.not_] if cond.not_ else [])
    return [leaf for child in children for leaf in _leaves(child)]


def lint(policies: PolicySet) -> list[str]:
    """Warnings about rules that match every request (found at load), that can never act or that repeat another's
    condition; duplicate ids across packs."""
    notes: list[str] = list(policies.warnings)
    specs: dict[str, WafSpec] = {"base": policies.base.spec.waf}
    for tenant, overlay in policies.overlays.items():
        if "waf" in overlay.spec.model_fields_set:
            specs[f"tenant {tenant}"] = merge_overlay(policies.base.spec.waf, overlay.spec.waf)
    compiled_by = {"base": policies.waf.base, **{f"tenant {t}": w for t, w in policies.waf.tenants.items()}}
    for where, spec in specs.items():
        seen_ids: dict[str, str] = {}
        for compiled in (compiled_by.get(where) or policies.waf.base).rules:
            owner = compiled.pack or "policy"
            if compiled.rule.id in seen_ids:
                notes.append(
                    f"error: {where}: rule id {compiled.rule.id!r} is in {seen_ids[compiled.rule.id]!r} and {owner!r}"
                )
            seen_ids[compiled.rule.id] = owner
        pack_ids = {r.id: name for name, pack in builtin_packs()[0].items() for r in pack.rules}
        for rule in spec.rules:
            if rule.paranoia_level > spec.paranoia_level:
                notes.append(
                    f"dead: {where}: rule {rule.id!r} needs paranoia level {rule.paranoia_level}, the "
                    f"policy runs at {spec.paranoia_level}"
                )
            if rule.id in pack_ids:
                notes.append(
                    f"note: {where}: rule {rule.id!r} replaces the rule of that id in pack {pack_ids[rule.id]!r}"
                )
        for exc in spec.exclusions:
            if not (exc.routes or exc.paths or exc.tenants):
                notes.append(
                    f"dead: {where}: exclusion {exc.id or exc.rules or exc.tags} applies everywhere: the "
                    "rules it names never run (disable them instead)"
                )
        if spec.mode == "off" and (spec.rules or spec.packs):
            notes.append(f"dead: {where}: WAF mode is off; its {len(spec.rules)} rules and packs never run")
    for where, waf in [("base", policies.waf.base), *((f"tenant {t}", w) for t, w in policies.waf.tenants.items())]:
        conditions: dict[str, str] = {}
        for compiled in waf.rules:
            key = json.dumps(compiled.rule.when.model_dump(exclude_defaults=True), sort_keys=True)
            if key in conditions:
                notes.append(
                    f"shadowed: {where}: rule {compiled.rule.id!r} has the same condition as {conditions[key]!r}"
                )
            else:
                conditions[key] = compiled.rule.id
    return notes
