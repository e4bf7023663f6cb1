"""`portcullis config check [FILE]`: portcullis.yaml validated as `portcullis serve` loads it, without serving.

The errors are start's own, each naming the file and the key path (and an OTEL_* variable the gateway cannot use,
naming it: the variables fill what the file leaves out, gateway/observability/otel_env.py); exit 0 when the gateway
would start with it, 1 when it would not. Policies are checked by `portcullis policy check DIR`.
"""

from __future__ import annotations

import argparse
import os
import sys

from gateway.config import CONFIG_ENV, ConfigError, load_config
from gateway.observability.otel_env import with_environment


def add_subcommands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    config = commands.add_parser("config", help="check portcullis.yaml")
    verbs = config.add_subparsers(dest="verb", required=True, metavar="VERB")
    check = verbs.add_parser("check", help="validate portcullis.yaml as the gateway would load it (exit 1 on errors)")
    check.add_argument("file", nargs="?", help=f"portcullis.yaml (default: ${CONFIG_ENV}, else the embedded defaults)")
    check.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    path = args.file or os.environ.get(CONFIG_ENV)
    try:
        config = load_config(path)
        with_environment(config.telemetry, os.environ)
        for server in config.mcp_servers:
            server.credential()  # a variable it names and the environment lacks stops the start
    except ConfigError as exc:
        print(f"portcullis: {exc}", file=sys.stderr)
        return 1
    policies = f"; check its policies with: portcullis policy check {config.policy_dir}" if config.policy_dir else ""
    print(f"{path or 'the embedded defaults'}: ok{policies}")
    return 0
