"""Natural-language text of an OpenAI request that is not a message: the descriptions in its tool (function)
definitions and in their JSON-Schema parameters. The WAF counts it as prompt text (a `run_sql` tool may describe
SQL); the guard scans it when a policy lists `tool_definitions` (tool poisoning: instructions hidden in a
third-party tool's description)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

TOOL_KEYS = ("tools", "functions")  # `functions` is the deprecated form of `tools`


def tool_descriptions(payload: Any) -> Iterator[tuple[Any, Any, tuple]]:
    """(container, key, location) of every string under a "description" key below `tools` or `functions`, in
    document order; the container and key let a caller rewrite it in place (redaction)."""
    if not isinstance(payload, dict):
        return
    for top in TOOL_KEYS:
        stack: list[tuple[tuple, Any]] = [((top,), payload.get(top))]
        while stack:  # explicit stack: a deeply nested schema must not exhaust the recursion limit
            loc, node = stack.pop()
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            children = []
            for key, value in items:
                if key == "description" and isinstance(value, str):
                    yield node, key, (*loc, key)
                else:
                    children.append(((*loc, key), value))
            stack.extend(reversed(children))


def dotted(loc: tuple) -> str:
    """("tools", 0, "function", "description") -> "tools[0].function.description"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
