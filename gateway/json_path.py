"""A JSON location as people read it, in error messages and verdicts."""

from __future__ import annotations


def dotted(loc: tuple) -> str:
    """("tools", 0, "function", "description") -> "tools[0].function.description"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out
