"""Redaction: replacing, in the parsed request body, what the matched `redact` rules' regexes find.

A value is rewritten through its place in the content inventory, so a file sent as base64 is redacted in the
text it decodes to and sent encoded again. A match that only the value's folded view reveals (a key split by
zero-width characters, gateway/guard/folding.py) replaces the whole stretch of the value it comes from.
"""

from __future__ import annotations

from typing import Any

import re2

from gateway.apis.inventory import Carried, Location
from gateway.guard.folding import Folded
from gateway.waf.compile import CompiledRule
from gateway.waf.parts import RequestView
from gateway.waf.verdict import Verdict


def redact_payload(rules: list[CompiledRule], view: RequestView, verdict: Verdict, payload: object) -> int:
    """Replace, in `payload` (the parsed body the view reads, edited in place), every span the redacting rules'
    regexes match in the parts they read. Returns the number of spans replaced."""
    if payload is not view.payload:
        raise ValueError("redaction edits the payload the request view reads")
    by_id = {r.rule.id: r for r in rules}
    inventory = view.carried()
    count = 0
    for match in verdict.redactions:
        compiled = by_id[match.rule.id]
        for targets, regex in compiled.redactors:
            done: set[Location] = set()
            for target in targets:
                for _, _, loc in view.values(target):
                    if not loc or loc in done:
                        continue
                    done.add(loc)
                    carried = inventory.at(loc)
                    if carried is None:  # a value the inventory reads decoded (tool-call arguments), as sent
                        count += _redact_raw(payload, loc, regex, compiled.rule.replacement)
                    elif carried.holder is not None and carried.kind != "opaque":
                        count += _redact(carried, regex, compiled.rule.replacement)
    return count


def _redact_raw(payload: object, loc: Location, regex: re2._Regexp, replacement: str) -> int:
    """A rule that reads the body as sent (`json:PATH`, `json_strings`) redacts the string as sent."""
    node: Any = payload
    try:
        for step in loc[:-1]:
            node = node[step]
        text = node[loc[-1]]
    except (KeyError, IndexError, TypeError):
        return 0
    if not isinstance(text, str):
        return 0
    new, replaced = _redact_text(regex, replacement, text)
    if replaced:
        node[loc[-1]] = new
    return replaced


def _redact(carried: Carried, regex: re2._Regexp, replacement: str) -> int:
    if carried.decoded is None and type(carried.holder[carried.key]) is not str:
        return 0  # a number: its text is not what the body holds
    new, replaced = _redact_text(regex, replacement, carried.text)
    view = Folded.of(new)
    if view is not None:  # what only the folded view shows: its stretch of the value, invisible characters and all
        spans = [view.source(m.start(), m.end()) for m in regex.finditer(view.text) if m.end() > m.start()]
        for start, end in reversed(_merged(spans)):
            new = new[:start] + replacement + new[end:]
            replaced += 1
    if replaced:
        carried.rewrite(new)
    return replaced


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(end, out[-1][1]))
        else:
            out.append((start, end))
    return out


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
