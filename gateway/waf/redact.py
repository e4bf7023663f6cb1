"""Redaction: replacing, in the parsed request body, what the matched `redact` rules' regexes find."""

from __future__ import annotations

from typing import Any

import re2

from gateway.waf.compile import CompiledRule
from gateway.waf.parts import Location, RequestView
from gateway.waf.verdict import Verdict


def redact_payload(rules: list[CompiledRule], view: RequestView, verdict: Verdict, payload: object) -> int:
    """Replace, in `payload` (the parsed body, edited in place), every span the redacting rules' regexes match in the
    parts they read. Returns the number of spans replaced."""
    by_id = {r.rule.id: r for r in rules}
    count = 0
    for match in verdict.redactions:
        compiled = by_id[match.rule.id]
        for targets, regex in compiled.redactors:
            for target in targets:
                for _, _, loc in view.values(target):
                    if not loc:
                        continue
                    text = _get_at(payload, loc)
                    if not isinstance(text, str):
                        continue
                    new, n = _redact_text(regex, compiled.rule.replacement, text)
                    if n:
                        _set_at(payload, loc, new)
                        count += n
    return count


def _redact_text(regex: re2._Regexp, replacement: str, text: str) -> tuple[str, int]:
    """`text` with every non-empty match replaced, and how many were. An empty match hides nothing, and replacing
    it would put the replacement between every two characters of the prompt (`[0-9]*` matches empty everywhere)."""
    replaced = 0

    def swap(found: re2._Match) -> str:
        nonlocal replaced
        if found.start() == found.end():
            return ""
        replaced += 1
        return replacement

    new, _ = regex.subn(swap, text)
    return new, replaced


def _get_at(payload: object, loc: Location) -> object:
    node: Any = payload
    try:
        for step in loc:
            node = node[step]
    except (KeyError, IndexError, TypeError):
        return None
    return node


def _set_at(payload: object, loc: Location, value: str) -> None:
    node: Any = payload
    for step in loc[:-1]:
        node = node[step]
    node[loc[-1]] = value
