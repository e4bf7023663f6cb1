"""`portcullis policy …`: the security team's tools — validate a policy directory, print the JSON Schema."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gateway.policy.loader import PolicyError, load_policy_dir
from gateway.policy.model import json_schema
from gateway.waf import cli as waf_cli


def add_subcommands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = commands.add_parser("policy", help="check policy files, print the policy JSON Schema")
    verbs = policy.add_subparsers(dest="verb", required=True, metavar="VERB")
    check = verbs.add_parser("check", help="validate a policy directory as the gateway would load it")
    check.add_argument("directory", type=Path)
    check.add_argument(
        "--strict",
        action="store_true",
        help=("fail (exit 1) on warnings too: rules that match every request, dead and shadowed rules"),
    )
    check.set_defaults(func=_check)
    schema = verbs.add_parser("schema", help="print the JSON Schema of policy documents")
    schema.set_defaults(func=_schema)
    waf_cli.add_verbs(verbs)


def _check(args: argparse.Namespace) -> int:
    try:
        policies = load_policy_dir(args.directory)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    rules = len(policies.base.spec.rate_limits)
    notes = waf_cli.lint(policies)
    for note in notes:
        print(note, file=sys.stderr)
    waf = policies.waf_for(None)
    errors = sum(n.startswith("error") for n in notes)
    warnings = sum(not n.startswith(("error", "note")) for n in notes)
    verdict = "errors" if errors else f"{warnings} warnings" if warnings else "ok"
    print(
        f"{args.directory}: {verdict}, version "
        f"{policies.version}, {rules} base rate limits, {len(policies.overlays)} tenant overlays, "
        f"WAF {waf.mode} at paranoia level {waf.spec.paranoia_level} with {len(waf.rules)} rules"
    )
    return 1 if errors or (args.strict and warnings) else 0


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0
