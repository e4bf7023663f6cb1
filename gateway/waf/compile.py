"""Compiling a WAF policy once, at load: the rules active at its paranoia levels, each rule's condition tree built
into a `Node` (a function of the request state), and the regexes grouped into one RE2 set per part and transform
chain (`PartScan`), so that a request scans each set once and only then looks at the rules a candidate wakes."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import re2

from gateway.waf import matchers, operators
from gateway.waf.model import Condition, Exclusion, WafRule, WafSpec
from gateway.waf.operators import Find, Span
from gateway.waf.parts import COUNTS
from gateway.waf.request_state import PartScan, Reading, RequestState, remember
from gateway.waf.verdict import NOT_HIT, Hit

Node = Callable[[RequestState], Hit | None]

# Parts that hold a number: no RE2 set reads them, their few regexes are searched directly.
_NUMERIC_TARGETS = frozenset(COUNTS)
_UNKNOWN = (-1, -1, -1)  # a leaf's memory has no answer for these texts yet (None is the answer "no match")
_UNKNOWN_SPAN = (-1, -1)  # likewise for one text


@dataclass(frozen=True)
class CompiledRule:
    rule: WafRule
    node: Node
    points: int
    pack: str | None
    needs: frozenset[int] | None  # regex leaves one of which must be a candidate for the rule to hold
    redactors: tuple[tuple[tuple[str, ...], re2._Regexp], ...] = ()  # (targets, compiled regex) for action: redact


def active_rules(
    spec: WafSpec, packs: dict[str, list[WafRule]], disabled: Iterable[str] = ()
) -> list[tuple[WafRule, str | None]]:
    """Rules at the paranoia levels in force: packs in the order enabled, then the policy's own rules. A policy
    rule with a pack rule's id replaces it."""
    disabled = set(disabled)
    own = {rule.id: rule for rule in spec.rules}
    out: list[tuple[WafRule, str | None]] = []
    for ref in spec.pack_refs():
        level = ref.paranoia_level or spec.paranoia_level
        for rule in packs[ref.name]:
            if rule.id in own or rule.id in disabled or rule.paranoia_level > level:
                continue
            out.append((rule, ref.name))
    out.extend(
        (rule, None) for rule in spec.rules if rule.id not in disabled and rule.paranoia_level <= spec.paranoia_level
    )
    return out


def compile_rules(spec: WafSpec, rules: list[tuple[WafRule, str | None]]) -> tuple[list[CompiledRule], list[PartScan]]:
    """Each rule compiled with its points under the spec's scoring, and the part scans their regexes share."""
    compiler = _Compiler()
    compiled: list[CompiledRule] = []
    for rule, pack in rules:
        points = rule.score if rule.score is not None else spec.anomaly.points.get(rule.severity, 0)
        redactors = (
            tuple((targets, matchers.compile_regex(pattern)) for targets, pattern in _regex_leaves(rule.when))
            if rule.action == "redact"
            else ()
        )
        node, needs = compiler.node(rule.when)
        compiled.append(CompiledRule(rule, node, points, pack, needs, redactors))
    return compiled, compiler.finish()


def excluded_rule_ids(exclusion: Exclusion, rules: list[CompiledRule]) -> frozenset[str]:
    """The ids of the rules an exclusion selects, by id pattern or tag (its scope is judged per request)."""
    return frozenset(
        r.rule.id
        for r in rules
        if any(fnmatch.fnmatchcase(r.rule.id, pattern) for pattern in exclusion.rules)
        or any(tag in r.rule.tags for tag in exclusion.tags)
    )


class _Compiler:
    """Builds each rule's condition tree into a `Node`, and with it the regex leaves the rule cannot match without:
    when none of them is among a request's candidates, the rule is skipped without evaluating it."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[tuple[str, ...], matchers.RegexSet]] = {}  # target -> chain -> set
        self.leaf_count = 0

    def node(self, cond: Condition) -> tuple[Node, frozenset[int] | None]:
        """The node, and the leaves one of which must be a candidate for it to hold (None: no such set)."""
        if cond.all is not None:
            built = [self.node(c) for c in cond.all]
            children = [n for n, _ in built]
            needs = min((k for _, k in built if k is not None), key=len, default=None)

            def all_(state: RequestState) -> Hit | None:
                first = None
                for child in children:
                    hit = child(state)
                    if hit is None:
                        return None
                    if first is None or (not first.part and hit.part):
                        first = hit
                return first

            return all_, needs
        if cond.any is not None:
            built = [self.node(c) for c in cond.any]
            children = [n for n, _ in built]
            wanted = [k for _, k in built if k is not None]
            needs = frozenset[int]().union(*wanted) if len(wanted) == len(built) else None

            def any_(state: RequestState) -> Hit | None:
                for child in children:
                    hit = child(state)
                    if hit is not None:
                        return hit
                return None

            return any_, needs
        if cond.not_ is not None:
            child, _ = self.node(cond.not_)
            return (lambda state: NOT_HIT if child(state) is None else None), None
        reading = Reading(tuple(cond.target or ()), tuple(cond.transforms))
        if cond.regex is not None:
            return self._regex(cond.regex, reading)
        if cond.number is not None and not reading.chain and len(reading.targets) == 1 and reading.targets[0] in COUNTS:
            return _count_leaf(reading.targets[0], matchers.numeric_test(cond.number)), None
        given = cond.given_operator()
        assert given is not None  # the model allows a match with exactly one operator
        name, operator, value = given
        leaf = _leaf(reading, name, operator.build(value))
        length = cond.length
        if length is not None and not reading.chain and length.lt is None and length.le is None and length.eq is None:
            return _longest_first(reading.targets, matchers.numeric_test(length), leaf), None
        return leaf, None

    def _regex(self, pattern: str, reading: Reading) -> tuple[Node, frozenset[int] | None]:
        scan = _leaf(reading, "regex", operators.REGEX.build(pattern))
        if matchers.needs_own_scan(pattern) or any(t in _NUMERIC_TARGETS for t in reading.targets):
            return scan, None
        # One RE2 set per (part, transforms): every regex reading that part through those transforms is decided
        # by a single scan of it, shared by all rules whatever other parts they also read. Only a leaf the sets
        # found is searched value by value (for the matching value and span).
        leaf = self.leaf_count
        self.leaf_count += 1
        for target in reading.targets:
            chains = self.groups.setdefault(target, {})
            group = chains.get(reading.chain)
            if group is None:
                group = chains[reading.chain] = matchers.RegexSet()
            group.add(pattern, leaf)

        def regex_leaf(state: RequestState) -> Hit | None:
            return scan(state) if leaf in state.found else None

        return regex_leaf, frozenset((leaf,))

    def finish(self) -> list[PartScan]:
        for chains in self.groups.values():
            for group in chains.values():
                group.compile()
        return [PartScan(target, list(chains.items())) for target, chains in self.groups.items()]


def _leaf(reading: Reading, operator: str, find: Find) -> Node:
    """A leaf that tries `find` on each transformed value. Every operator is a pure function of the text, so when
    the parts read are all short their outcome (which value, which span) is remembered by their raw texts: the
    same arguments, keys and headers on the next request cost one lookup, and when some of them are new (a request
    id among the headers) each value seen before costs a lookup of its own."""
    targets, chain = reading
    memo: dict[tuple[tuple[str, ...], ...], tuple[int, int, int] | None] = {}
    spans: dict[str, Span | None] = {}  # short raw text -> where `find` matches it transformed

    def first(state: RequestState, texts: tuple[tuple[str, ...], ...]) -> tuple[int, int, int] | None:
        """(value index, span) of the first value `find` matches, deciding each new short text once."""
        index = 0
        for part_texts in texts:
            for raw in part_texts:
                span = spans.get(raw, _UNKNOWN_SPAN)
                if span is _UNKNOWN_SPAN:
                    span = find(state.transform(chain, raw))
                    remember(spans, raw, span)
                if span is not None:
                    return index, span[0], span[1]
                index += 1
        return None

    def scan(state: RequestState) -> Hit | None:
        texts = state.short_texts(targets)
        if texts is None:
            for part, text, loc in state.get(reading):
                found = find(text)
                if found is not None:
                    return Hit(part, text, found[0], found[1], operator, loc)
            return None
        known = memo.get(texts, _UNKNOWN)
        if known is _UNKNOWN:
            known = first(state, texts)
            remember(memo, texts, known)
        if known is None:
            return None
        part, text, loc = state.get(reading)[known[0]]
        return Hit(part, text, known[1], known[2], operator, loc)

    return scan


def _count_leaf(target: str, holds: Callable[[float], bool]) -> Node:
    """A `number` condition on a count (body size, header count, JSON depth): the int compared as it is, with no
    text to make or remember unless it holds (most such rules run on every request and hold on almost none)."""
    read = COUNTS[target]

    def count(state: RequestState) -> Hit | None:
        value = read(state.view)
        if not holds(value):
            return None
        text = str(value)
        return Hit(target, text, 0, len(text), "number", None)

    return count


def _longest_first(targets: tuple[str, ...], fits: Callable[[float], bool], leaf: Node) -> Node:
    """A minimum length on untransformed parts (a header over 8 KiB): no value fits unless the longest does, which
    the raw texts tell without trying each value, so the leaf runs only when one may hold."""

    def longest(state: RequestState) -> Hit | None:
        for target in targets:
            texts, _ = state.part(target)
            if texts and fits(max(map(len, texts))):
                return leaf(state)
        return None

    return longest


def _regex_leaves(cond: Condition) -> list[tuple[tuple[str, ...], str]]:
    """(targets, pattern) of every regex under `all` and `any` (not under `not`: what it matches is no hit)."""
    if cond.regex is not None:
        return [(tuple(cond.target or ()), cond.regex)]
    children = (cond.all or []) + (cond.any or [])
    return [leaf for child in children for leaf in _regex_leaves(child)]
