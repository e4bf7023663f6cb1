"""`portcullis mcp pins`: the `pinned:` entries of a server's tools, from its tools/list answer, for the security
team to read and paste into the policy (docs/mcp.md)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from gateway.mcp.pins import tool_hash
from gateway.mcp.spec import TOOL_NAME
from gateway.streaming.sse import event_data


def add_subcommands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    mcp = commands.add_parser("mcp", help="MCP servers' tools: their definition hashes")
    verbs = mcp.add_subparsers(dest="verb", required=True, metavar="VERB")
    pins = verbs.add_parser(
        "pins",
        help="print `pinned:` entries for the tools of a tools/list answer (JSON, or the SSE body that carries it)",
    )
    pins.add_argument("file", type=Path, nargs="?", help="the answer (default: stdin)")
    pins.set_defaults(func=_pins)


def _pins(args: argparse.Namespace) -> int:
    text = args.file.read_text() if args.file else sys.stdin.read()
    try:
        tools = listed_tools(text)
    except ValueError as exc:
        print(f"portcullis mcp pins: {exc}", file=sys.stderr)
        return 1
    for tool in tools:
        name = tool["name"]
        if re.fullmatch(TOOL_NAME, name):
            print(f"{name}: {tool_hash(tool)}")
        else:  # a policy cannot name it: never listed while pins are required
            print(f"# {json.dumps(name)}: a name no policy can pin (letters, digits, _ . / - only)")
    return 0


def listed_tools(text: str) -> list[dict[str, Any]]:
    """The tools of a tools/list answer: its JSON-RPC message, its result, or an SSE body with the message."""
    stripped = text.lstrip()
    if not stripped.startswith("{"):  # an SSE body: the event that carries the answer
        datas = [event_data(event.encode()) for event in stripped.replace("\r\n", "\n").split("\n\n")]
        stripped = next((d.decode() for d in datas if d and b'"tools"' in d), "")
    try:
        answer = json.loads(stripped)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a tools/list answer: {exc}") from None
    result = answer.get("result", answer) if isinstance(answer, dict) else None
    tools = result.get("tools") if isinstance(result, dict) else None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools):
        raise ValueError("not a tools/list answer: no list of named tools under result.tools")
    return tools
