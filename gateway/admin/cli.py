"""`portcullis keys`: stored API keys and the spend report, through a running gateway's admin API.

It talks to `--admin-url` (default: $PORTCULLIS_ADMIN_URL, else the admin listener's default address) with the admin
token from `--admin-token-file`, else $PORTCULLIS_ADMIN_TOKEN, else the file a gateway of this user generated it in
(gateway/admin/token.py), and names the local user in `x-portcullis-actor` for the audit log. A refusal prints the
API's own message and exits 1; an admin API it cannot reach exits 2.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from gateway.admin.token import default_token_file, read_token_file
from gateway.config import ConfigError
from gateway.spend.store import amount_text

URL_ENV = "PORTCULLIS_ADMIN_URL"
TOKEN_ENV = "PORTCULLIS_ADMIN_TOKEN"
DEFAULT_URL = "http://127.0.0.1:9901"
TIMEOUT = 30.0
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_LIST_COLUMNS = ("id", "tenant", "label", "models", "expires_at", "revoked_at", "created_at")
_SPEND_TOTALS = (
    "requests",
    "refused_requests",
    "prompt_tokens",
    "cached_tokens",
    "completion_tokens",
    "cost",
    "currency",
)


class CliError(Exception):
    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def add_subcommands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--admin-url",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"admin API (default: ${URL_ENV} or {DEFAULT_URL})",
    )
    common.add_argument(
        "--admin-token-file",
        type=Path,
        help=(
            f"file holding the admin token (default: ${TOKEN_ENV}, else the token a gateway generated for this user "
            "in $XDG_STATE_HOME/portcullis/admin-token or ~/.local/state/portcullis/admin-token)"
        ),
    )
    shown = argparse.ArgumentParser(add_help=False, parents=[common])
    shown.add_argument("--json", action="store_true", help="print the API's JSON")

    keys = commands.add_parser("keys", help="create, rotate and revoke stored API keys; the spend report")
    verbs = keys.add_subparsers(dest="verb", required=True, metavar="VERB")

    create = verbs.add_parser("create", parents=[shown], help="create a key and print its secret (shown once)")
    create.add_argument("--tenant", required=True)
    _add_settings(create)
    create.set_defaults(func=_run, call=_create)

    listing = verbs.add_parser("list", parents=[shown], help="every key (revoked ones too)")
    listing.add_argument("--tenant", help="only this tenant's keys")
    listing.set_defaults(func=_run, call=_list)

    get = verbs.add_parser("get", parents=[shown], help="one key")
    get.add_argument("id")
    get.set_defaults(func=_run, call=_get)

    update = verbs.add_parser("update", parents=[shown], help="change a key's settings: what is given replaces")
    update.add_argument("id")
    update.add_argument("--tenant")
    _add_settings(update)
    update.set_defaults(func=_run, call=_update)

    rotate = verbs.add_parser("rotate", parents=[shown], help="a new secret; the old one works for --grace more")
    rotate.add_argument("id")
    rotate.add_argument("--grace", type=_duration, help="how long the old secret keeps working: 1d (default), 0")
    rotate.set_defaults(func=_run, call=_rotate)

    revoke = verbs.add_parser("revoke", parents=[shown], help="revoke a key for good")
    revoke.add_argument("id")
    revoke.set_defaults(func=_run, call=_revoke)

    spend = verbs.add_parser("spend", parents=[shown], help="the spend report (default: this month)")
    spend.add_argument("--by", default="", help="groups, comma-separated: key, tenant, model, hour, day, month")
    spend.add_argument("--start", help="Unix seconds, ISO date or datetime (UTC)")
    spend.add_argument("--end", help="excluded; a date covers its whole day")
    spend.add_argument("--tenant")
    spend.add_argument("--key", help="a key id")
    spend.add_argument("--csv", action="store_true", help="CSV to stdout")
    spend.set_defaults(func=_run, call=_spend)


def _add_settings(verb: argparse.ArgumentParser) -> None:
    verb.add_argument("--label")
    verb.add_argument(
        "--model", action="append", dest="models", metavar="GLOB", help="a model glob it may call (repeat); none: any"
    )
    verb.add_argument("--expires", help="an ISO date or datetime (UTC), a duration from now (90d), or 'never'")
    verb.add_argument("--budget", type=float, help="spend limit per --period, in the price table's currency")
    verb.add_argument("--period", help="the budget's period: day, month (default) or a duration such as 7d")
    verb.add_argument("--limit", action="append", default=[], metavar="RULE=N", help="a rate-limit rule's limit")
    verb.add_argument("--meta", action="append", default=[], metavar="K=V", help="metadata (repeat)")


def _run(args: argparse.Namespace) -> int:
    """Run one verb; its API refusal or an unreachable API becomes a message on stderr and the exit status."""
    try:
        return args.call(args, AdminClient(args.admin_url, _token(args.admin_token_file)))
    except CliError as exc:
        print(f"portcullis keys: {exc}", file=sys.stderr)
        return exc.status


def _token(given_file: Path | None) -> str | None:
    """The admin token: `--admin-token-file`, else $PORTCULLIS_ADMIN_TOKEN, else the generated token's default file;
    None when there is none of them (the API's 401 then says so)."""
    if given_file is not None:
        token = _read_token(given_file, "--admin-token-file")
        if token is None:
            raise CliError(f"--admin-token-file: no such file: {given_file}")
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    try:
        default = default_token_file()
    except ConfigError:  # no home directory: no generated token to find there either
        return None
    return _read_token(default, "the generated admin token")


def _read_token(path: Path, what: str) -> str | None:
    try:
        return read_token_file(path, what)
    except ConfigError as exc:  # unreadable, readable by others, not a token
        raise CliError(str(exc)) from None


class AdminClient:
    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"x-portcullis-actor": _local_user()}
        if token:
            self.headers["authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, body: dict | None = None, params: dict | None = None) -> httpx.Response:
        """One API call; a change always sends a JSON body (an empty object where it has none), as the API requires."""
        if method != "GET" and body is None:
            body = {}
        try:
            response = httpx.request(
                method, self.url + path, json=body, params=params, headers=self.headers, timeout=TIMEOUT
            )
        except httpx.HTTPError as exc:
            raise CliError(f"cannot reach the admin API at {self.url}: {exc}", status=2) from None
        if response.is_success:
            return response
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        if response.status_code == 401 and "authorization" not in self.headers:
            message += f" (none found: give --admin-token-file or set ${TOKEN_ENV})"
        raise CliError(f"{response.status_code}: {message}")


def _create(args: argparse.Namespace, admin: AdminClient) -> int:
    key = admin.call("POST", "/admin/keys", {"tenant": args.tenant, **_settings(args)}).json()
    _print_secret(args, key)
    return 0


def _list(args: argparse.Namespace, admin: AdminClient) -> int:
    params = {"tenant": args.tenant} if args.tenant else None
    keys = admin.call("GET", "/admin/keys", params=params).json()["data"]
    if args.json:
        print(json.dumps(keys, indent=2))
    else:
        print(_table(_LIST_COLUMNS, [[_shown(column, key.get(column)) for column in _LIST_COLUMNS] for key in keys]))
    return 0


def _get(args: argparse.Namespace, admin: AdminClient) -> int:
    _print_key(args, admin.call("GET", f"/admin/keys/{args.id}").json())
    return 0


def _update(args: argparse.Namespace, admin: AdminClient) -> int:
    changes = _settings(args)
    if args.tenant:
        changes["tenant"] = args.tenant
    if not changes:
        raise CliError("nothing to change: give --tenant, --label, --model, --expires, --budget, --limit or --meta")
    _print_key(args, admin.call("PATCH", f"/admin/keys/{args.id}", changes).json())
    return 0


def _rotate(args: argparse.Namespace, admin: AdminClient) -> int:
    body = {} if args.grace is None else {"grace": args.grace}
    _print_secret(args, admin.call("POST", f"/admin/keys/{args.id}/rotate", body).json())
    return 0


def _revoke(args: argparse.Namespace, admin: AdminClient) -> int:
    _print_key(args, admin.call("POST", f"/admin/keys/{args.id}/revoke").json())
    return 0


def _spend(args: argparse.Namespace, admin: AdminClient) -> int:
    params = {"group_by": args.by, "start": args.start, "end": args.end, "tenant": args.tenant, "key": args.key}
    params = {name: value for name, value in params.items() if value}
    if args.csv:
        sys.stdout.write(admin.call("GET", "/admin/spend", params={**params, "format": "csv"}).text)
        return 0
    report = admin.call("GET", "/admin/spend", params=params).json()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    groups = ["period" if g in ("hour", "day", "month") else "key_id" if g == "key" else g for g in report["group_by"]]
    columns = (*groups, *_SPEND_TOTALS)
    print(f"spend from {report['start']} to {report['end']}")
    rows = [{**row, "cost": amount_text(row["cost_nanos"])} for row in report["data"]]  # exact, never 1.6e-05
    print(_table(columns, [[_shown(column, row.get(column)) for column in columns] for row in rows]))
    return 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The key settings the options give; options not given are left out (an update leaves those as they are)."""
    settings: dict[str, Any] = {}
    if args.label is not None:
        settings["label"] = args.label
    if args.models:
        settings["models"] = args.models
    if args.expires:
        settings["expires_at"] = None if args.expires == "never" else _moment(args.expires)
    if args.budget is not None:
        settings["budget"] = {"limit": args.budget, **({"period": args.period} if args.period else {})}
    elif args.period:
        raise CliError("--period needs --budget")
    if args.limit:
        settings["limits"] = {rule: _count(rule, n) for rule, n in (_pair(item, "--limit") for item in args.limit)}
    if args.meta:
        settings["metadata"] = dict(_pair(item, "--meta") for item in args.meta)
    return settings


def _print_secret(args: argparse.Namespace, key: dict) -> None:
    if args.json:
        print(json.dumps(key, indent=2))
        return
    print(f"id      {key['id']}\ntenant  {key['tenant']}\nsecret  {key['secret']}")
    print("the secret is shown this once: store it now", file=sys.stderr)


def _print_key(args: argparse.Namespace, key: dict) -> None:
    if args.json:
        print(json.dumps(key, indent=2))
        return
    width = max(len(name) for name in key)
    for name, value in key.items():
        print(f"{name:<{width}}  {_shown(name, value)}")


def _table(columns: Sequence[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(columns, *rows)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in [list(columns), *rows]
    )


def _shown(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column.endswith("_at") or column == "previous_valid_until":  # Unix seconds
        return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(value, list):
        return ",".join(map(str, value)) or "*"
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _duration(text: str) -> float:
    """Seconds: a plain number or 30s, 15m, 12h, 1d, 2w."""
    match = _DURATION.match(text)
    try:
        return float(match.group(1)) * _UNITS[match.group(2)] if match else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 3600, 30m, 12h, 1d)") from None


def _moment(text: str) -> float:
    """Unix seconds for --expires: an ISO date or datetime (UTC unless it says otherwise) or a duration from now."""
    if _DURATION.match(text):
        return time.time() + _duration(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"--expires: not a date, datetime or duration: {text!r}") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _pair(item: str, option: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep or not name:
        raise CliError(f"{option} takes NAME=VALUE, not {item!r}")
    return name, value


def _count(rule: str, text: str) -> int:
    if not (text.isascii() and text.isdigit()):
        raise CliError(f"--limit {rule}: not a whole number: {text!r}")
    return int(text)


def _local_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no user name for this uid (a container)
        return f"uid-{os.getuid()}"
