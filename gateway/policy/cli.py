"""`portcullis policy …`: the security team's tools — validate a policy directory, print the JSON Schema."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gateway.policy.loader import PolicyError, load_policy_dir
from gateway.policy.model import json_schema


def add_subcommands(commands: argparse._SubParsersAction) -> None:
    policy = commands.add_parser("policy", help="check policy files, print the policy JSON Schema")
    verbs = policy.add_subparsers(dest="verb", required=True, metavar="VERB")
    check = verbs.add_parser("check", help="validate a policy directory as the gateway would load it")
    check.add_argument("directory", type=Path)
    check.set_defaults(func=_check)
    schema = verbs.add_parser("schema", help="print the JSON Schema of policy documents")
    schema.set_defaults(func=_schema)


def _check(args: argparse.Namespace) -> int:
    try:
        policies = load_policy_dir(args.directory)
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    rules = len(policies.base.spec.rate_limits)
    print(f"{args.directory}: ok, version {policies.version}, {rules} base rate limits, "
          f"{len(policies.overlays)} tenant overlays")
    return 0


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0
