"""Rules that match every request: found before they reach traffic, not after.

A rule can be valid and still hold for everything: an empty regex, `.*`, `a*`, `length: {ge: 0}`, a `not` of
something no request has. As a `block` rule (or a `score` rule over the threshold) it takes all traffic down the
moment a reload installs it. Two checks find such rules, both cheap enough to run on every load:

- every regex is tried on a handful of unrelated texts, the empty one included: one that matches them all
  matches any text, so its condition only tests that the part is present. A `redact` regex that can match the
  empty string is flagged as well: such matches are skipped, and the author usually meant `+` rather than `*`;
- every compiled WAF (the base's, each tenant's) judges a few ordinary, harmless API requests: a rule that fires on
  all of them matches every request, and a WAF in mode `block` that blocks all of them is a blanket block.

Warnings go to `portcullis policy check` (failing it under `--strict`) and to the log at start and on every
reload. A blanket block is an error: the loader refuses the policy, so the gateway does not start with it and a hot
reload keeps serving the last good policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from gateway.waf import matchers
from gateway.waf.cases import request_of
from gateway.waf.engine import CompiledWaf
from gateway.waf.model import Condition
from gateway.waf.packs import WafSet

# Unrelated texts: a regex that finds a match in every one of them matches any text.
_TEXTS = ("", "x", "0", "\n", " \t", "Hello, world!", "é漢字🙂", "SELECT 1", "<b>", "/v1/chat/completions", "z" * 300)

# Ordinary requests of the kinds the WAF judges (chat and completions, streaming or not, different clients).
_REQUESTS = (
    {
        "uri": "/v1/chat/completions",
        "client_ip": "203.0.113.7",
        "headers": {
            "Host": "api.example.com",
            "User-Agent": "OpenAI/Python 1.40.0",
            "Accept": "application/json",
            "Authorization": "Bearer probe-key",
        },
        "json": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    },
    {
        "uri": "/v1/completions",
        "client_ip": "198.51.100.20",
        "headers": {"Host": "llm.internal", "User-Agent": "curl/8.5.0", "Accept": "*/*"},
        "json": {"model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 16},
    },
    {
        "uri": "/v1/chat/completions",
        "client_ip": "192.0.2.33",
        "headers": {
            "Host": "gateway.example.org",
            "User-Agent": "Mozilla/5.0 (X11; Linux x86_64)",
            "Accept": "text/event-stream",
            "Accept-Language": "en-GB",
        },
        "json": {
            "model": "llama-3-8b",
            "stream": True,
            "temperature": 0.2,
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "Summarise in one sentence: the weather was mild."},
            ],
        },
    },
)


@dataclass(frozen=True)
class Findings:
    warnings: tuple[str, ...]  # rules and regexes that match every request or any text
    blanket_blocks: tuple[str, ...]  # WAFs in mode block that refuse every ordinary request


def inspect(waf_set: WafSet) -> Findings:
    """Match-all rules and blanket blocks of every distinct compiled WAF in the set (tenants sharing one are named
    together)."""
    warnings: list[str] = []
    blankets: list[str] = []
    for where, tenant, waf in _distinct(waf_set):
        warnings.extend(_regex_warnings(where, waf))
        if not waf.enabled:
            continue
        verdicts = [waf.evaluate(request_of({**given, "tenant": tenant}), all_matches=True) for given in _REQUESTS]
        fired_everywhere = set.intersection(*(set(v.rule_ids) for v in verdicts))
        for compiled in waf.rules:
            if compiled.rule.id in fired_everywhere:
                warnings.append(
                    f"warning: {where}: rule {compiled.rule.id!r} (action {compiled.rule.action}) "
                    f"matches every request: it fired on all {len(verdicts)} ordinary requests tried"
                )
        if waf.mode == "block" and all(v.blocked for v in verdicts):
            rules = sorted({v.blocking_rule.id for v in verdicts if v.blocking_rule})
            blankets.append(
                f"{where}: the WAF blocks every request (all {len(verdicts)} ordinary requests tried "
                f"were blocked, by {', '.join(repr(r) for r in rules)}); refused so it cannot take all "
                "traffic down: narrow the rule, or set `mode: monitor` to watch it first"
            )
    return Findings(tuple(warnings), tuple(blankets))


def matches_any_text(pattern: str) -> bool:
    regex = matchers.compile_regex(pattern)
    return all(regex.search(text) is not None for text in _TEXTS)


def matches_empty(pattern: str) -> bool:
    """Whether the regex can match the empty string somewhere (`a*`, `x?`, `\\b`, `^`)."""
    regex = matchers.compile_regex(pattern)
    return any(match.start() == match.end() for text in _TEXTS for match in regex.finditer(text))


def _distinct(waf_set: WafSet) -> Iterator[tuple[str, str | None, CompiledWaf]]:
    """(who, a tenant to judge as, the WAF): the base, then each tenant WAF once, naming every tenant sharing it."""
    yield "base", None, waf_set.base
    sharing: dict[int, list[str]] = {}
    wafs: dict[int, CompiledWaf] = {}
    for tenant, waf in sorted(waf_set.tenants.items()):
        if waf is not waf_set.base:
            sharing.setdefault(id(waf), []).append(tenant)
            wafs[id(waf)] = waf
    for key, names in sharing.items():
        yield f"tenant{'s' if len(names) > 1 else ''} {', '.join(names)}", names[0], wafs[key]


def _regex_warnings(where: str, waf: CompiledWaf) -> Iterator[str]:
    for compiled in waf.rules:
        rule = compiled.rule
        for targets, pattern in _regex_leaves(rule.when):
            parts = ", ".join(targets)
            if matches_any_text(pattern):
                yield (
                    f"warning: {where}: rule {rule.id!r}: regex {pattern!r} on {parts} matches any text, "
                    f"even empty: the condition only tests that {parts} is present"
                )
            elif rule.action == "redact" and matches_empty(pattern):
                yield (
                    f"warning: {where}: rule {rule.id!r} (action redact): regex {pattern!r} can match the "
                    "empty string; empty matches are not redacted (did you mean + rather than *?)"
                )


def _regex_leaves(cond: Condition) -> Iterator[tuple[list[str], str]]:
    """(targets, pattern) of every regex in the condition, `not` included."""
    if cond.regex is not None:
        yield cond.target or [], cond.regex
    for child in (cond.all or []) + (cond.any or []) + ([cond.not_] if cond.not_ else []):
        yield from _regex_leaves(child)
