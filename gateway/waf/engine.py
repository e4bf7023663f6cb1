"""The WAF engine: a policy's rules compiled once into a `CompiledWaf`, then evaluated against a `RequestView`.

Compilation resolves packs, paranoia levels and overlays into a flat rule list, compiles every regex, phrase list
and CIDR list, and groups the regexes that read the same parts through the same transforms into one RE2 set. At
request time each (parts, transforms) pair is extracted and transformed at most once, each RE2 set scans the joined
values once, and rule conditions short-circuit over those cached results.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gateway.waf import matchers, transforms
from gateway.waf.model import Condition, Exclusion, WafRule, WafSpec
from gateway.waf.parts import RequestView

_NUMERIC_TARGETS = frozenset({"body_size", "header_count", "arg_count", "json_depth", "json_keys", "invalid_utf8",
                              "prompt_size"})


@dataclass(frozen=True, slots=True)
class Hit:
    """Why a condition held: the part and the (transformed) text that matched, and the span within it."""

    part: str
    text: str
    start: int = 0
    end: int = 0
    operator: str = ""
    location: tuple | None = None

    @property
    def matched(self) -> str:
        return self.text[self.start:self.end] if self.end > self.start else self.text


_NOT_HIT = Hit(part="", text="", operator="not")


@dataclass(frozen=True, slots=True)
class RuleMatch:
    rule: WafRule
    hit: Hit
    points: int


@dataclass(slots=True)
class Verdict:
    """The WAF's decision on one request."""

    matches: list[RuleMatch] = field(default_factory=list)
    score: int = 0
    action: str = "allow"  # allow | block | monitor (would have blocked, mode monitor) | log (monitor rules only)
    blocking_rule: WafRule | None = None
    tags: list[str] = field(default_factory=list)
    redactions: list[RuleMatch] = field(default_factory=list)

    @property
    def rule_ids(self) -> list[str]:
        return [m.rule.id for m in self.matches]

    @property
    def blocked(self) -> bool:
        return self.action == "block"


class _State:
    """Per-request caches: transformed values per (targets, transforms) and RE2 set results per group."""

    __slots__ = ("view", "values", "joined", "sets", "texts")

    def __init__(self, view: RequestView) -> None:
        self.view = view
        self.values: dict[tuple, list] = {}
        self.joined: dict[tuple, bytes] = {}
        self.sets: dict[int, frozenset[int]] = {}
        self.texts: dict[str, tuple[str, ...] | None] = {}

    def get(self, key: tuple) -> list:
        """[(part, transformed text, location)] for key = (targets, transforms); each target is transformed once
        per chain, and short values (headers, names, small arguments) come from a process-wide cache."""
        out = self.values.get(key)
        if out is None:
            targets, chain = key
            if len(targets) == 1:
                out = self._one(targets[0], chain)
            else:
                out = [v for t in targets for v in self._one(t, chain)]
            self.values[key] = out
        return out

    def _one(self, target: str, chain: tuple) -> list:
        key = (target, chain)
        out = self.values.get(key)
        if out is None:
            raw = self.view.values(target)
            if chain and raw:
                cache = _TRANSFORMED.get(chain)
                if cache is None or len(cache) > _CACHE_ENTRIES:
                    cache = _TRANSFORMED[chain] = {}
                apply = transforms.apply
                out = []
                for part, text, loc in raw:
                    done = cache.get(text)
                    if done is None:
                        done = apply(chain, text)
                        if len(text) <= 512:
                            cache[text] = done
                    out.append((part, done, loc))
            else:
                out = raw
            self.values[key] = out
        return out

    def candidates(self, pair: tuple, group: matchers.RegexSet) -> frozenset[int]:
        """Leaves of `group` that can match some value of the part; empty parts cost nothing. Short values repeat
        across requests (header values, JSON keys, roles, model names), so each one's answer is remembered; the
        rest are joined by newlines and scanned once."""
        target, chain = pair
        raw = self.view.values(target)
        if not raw:
            return _NONE
        # A whole part often repeats verbatim (the same JSON keys, the same arguments): one lookup decides it.
        texts = self.texts.get(target, _UNSET)
        if texts is _UNSET:
            texts = self.texts[target] = tuple(t for _, t, _ in raw) if all(len(t) <= 256 for _, t, _ in raw) \
                else None
        if texts is not None:
            whole = group.seen_parts.get(texts)
            if whole is not None:
                return whole
        seen = group.seen  # keyed by the raw text: a hit skips the transforms too
        found: set[int] | None = None
        long: list[str] = []
        apply = transforms.apply
        for _, text, _ in raw:
            if len(text) > 256:
                long.append(apply(chain, text) if chain else text)
                continue
            hit = seen.get(text)
            if hit is None:
                if len(seen) > _CACHE_ENTRIES:
                    seen.clear()
                done = apply(chain, text) if chain else text
                hit = seen[text] = frozenset(group.candidates(done.encode("utf-8", "surrogatepass")))
            if hit:
                found = set(hit) if found is None else found | hit
        if long:
            joined = "\n".join(long).encode("utf-8", "surrogatepass")
            hits = group.candidates(joined)
            if hits:
                found = set(hits) if found is None else found.union(hits)
        result = frozenset(found) if found else _NONE
        if texts is not None:
            if len(group.seen_parts) > _CACHE_ENTRIES:
                group.seen_parts.clear()
            group.seen_parts[texts] = result
        return result


Node = Callable[[_State], "Hit | None"]
_NONE: frozenset[int] = frozenset()
_UNSET = object()


# Process-wide caches of pure functions of short strings (bounded; cleared when full).
_CACHE_ENTRIES = 4096  # per RE2 set and per transform chain; a full cache starts over
_TRANSFORMED: dict[tuple, dict[str, str]] = {}


class _Compiler:
    def __init__(self) -> None:
        self.groups: dict[tuple, matchers.RegexSet] = {}
        self.group_ids: dict[tuple, int] = {}
        self.leaf_count = 0

    def node(self, cond: Condition) -> Node:
        if cond.all is not None:
            children = [self.node(c) for c in cond.all]

            def all_(state: _State) -> Hit | None:
                first = None
                for child in children:
                    hit = child(state)
                    if hit is None:
                        return None
                    if first is None or (not first.part and hit.part):
                        first = hit
                return first

            return all_
        if cond.any is not None:
            children = [self.node(c) for c in cond.any]

            def any_(state: _State) -> Hit | None:
                for child in children:
                    hit = child(state)
                    if hit is not None:
                        return hit
                return None

            return any_
        if cond.not_ is not None:
            child = self.node(cond.not_)
            return lambda state: _NOT_HIT if child(state) is None else None
        return self.leaf(cond)

    def leaf(self, cond: Condition) -> Node:
        key = (tuple(cond.target or ()), tuple(cond.transforms))
        op = cond.operator
        if op == "regex":
            return self._regex(cond.regex, key)
        if op == "phrases":
            find = matchers.phrase_matcher(cond.phrases)
            return _scan(key, op, find)
        if op == "sqli":
            least = cond.sqli.min_tokens if not isinstance(cond.sqli, bool) else 1
            return _scan(key, op, lambda text: (0, len(text)) if matchers.sqli_tokens(text) >= least else None)
        if op == "xss":
            return _scan(key, op, lambda text: (0, len(text)) if matchers.is_xss(text) else None)
        if op == "equals":
            wanted = _text(cond.equals)
            return _scan(key, op, lambda text: (0, len(text)) if text == wanted else None)
        if op == "in":
            allowed = frozenset(_text(v) for v in cond.in_)
            return _scan(key, op, lambda text: (0, len(text)) if text in allowed else None)
        if op == "number":
            test = matchers.numeric_test(cond.number)

            def number(text: str) -> tuple[int, int] | None:
                value = matchers.as_number(text)
                return (0, len(text)) if value is not None and test(value) else None

            return _scan(key, op, number)
        if op == "length":
            test = matchers.numeric_test(cond.length)
            return _scan(key, op, lambda text: (0, min(len(text), 64)) if test(len(text)) else None)
        if op == "cidr":
            test = matchers.cidr_test(cond.cidr)
            return _scan(key, op, lambda text: (0, len(text)) if test(text) else None)
        raise AssertionError(op)

    def _regex(self, pattern: str, key: tuple) -> Node:
        regex = matchers.compile_regex(pattern)
        leaf = self.leaf_count
        self.leaf_count += 1

        def search(text: str) -> tuple[int, int] | None:
            match = regex.search(text)
            return match.span() if match else None

        scan = _scan(key, "regex", search)
        if matchers.needs_own_scan(pattern) or any(t in _NUMERIC_TARGETS for t in key[0]):
            return scan
        # One RE2 set per (part, transforms): every regex reading that part through those transforms is decided
        # by a single scan of it, shared by all rules whatever other parts they also read.
        chain = key[1]
        pairs = []
        for target in key[0]:
            pair = (target, chain)
            group = self.groups.get(pair)
            if group is None:
                group = self.groups[pair] = matchers.RegexSet()
                self.group_ids[pair] = len(self.group_ids)
            group.add(pattern, leaf)
            pairs.append((self.group_ids[pair], pair, group))

        def regex_leaf(state: _State) -> Hit | None:
            sets = state.sets
            for group_id, pair, group in pairs:
                found = sets.get(group_id)
                if found is None:
                    found = sets[group_id] = state.candidates(pair, group)
                if leaf in found:
                    return scan(state)
            return None

        return regex_leaf

    def finish(self) -> None:
        for group in self.groups.values():
            group.compile()


def _text(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _scan(key: tuple, operator: str, find: Callable[[str], tuple[int, int] | None]) -> Node:
    def scan(state: _State) -> Hit | None:
        for part, text, loc in state.get(key):
            span = find(text)
            if span is not None:
                return Hit(part, text, span[0], span[1], operator, loc)
        return None

    return scan


@dataclass(frozen=True)
class CompiledRule:
    rule: WafRule
    node: Node
    points: int
    pack: str | None
    redactors: tuple = ()  # (targets, compiled regex) for action: redact


def _regex_leaves(cond: Condition) -> list[tuple[tuple[str, ...], str]]:
    if cond.regex is not None:
        return [(tuple(cond.target or ()), cond.regex)]
    children = (cond.all or []) + (cond.any or [])
    return [leaf for child in children for leaf in _regex_leaves(child)]


class CompiledWaf:
    """One tenant's effective WAF: rules active at its paranoia levels, in evaluation order."""

    def __init__(self, spec: WafSpec, rules: list[tuple[WafRule, str | None]], version: str) -> None:
        self.spec = spec
        self.version = version
        self.mode = spec.mode
        self.threshold = spec.anomaly.inbound_threshold
        compiler = _Compiler()
        self.rules: list[CompiledRule] = []
        for rule, pack in rules:
            points = rule.score if rule.score is not None else spec.anomaly.points.get(rule.severity, 0)
            redactors = tuple((targets, matchers.compile_regex(pattern)) for targets, pattern in
                              _regex_leaves(rule.when)) if rule.action == "redact" else ()
            self.rules.append(CompiledRule(rule, compiler.node(rule.when), points, pack, redactors))
        compiler.finish()
        self.exclusions: list[tuple[Exclusion, frozenset[str]]] = [
            (exc, frozenset(r.rule.id for r in self.rules if _excluded(exc, r.rule))) for exc in spec.exclusions]

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and bool(self.rules)

    def rule_ids(self) -> list[str]:
        return [r.rule.id for r in self.rules]

    def evaluate(self, view: RequestView, *, all_matches: bool = False) -> Verdict:
        """Run every active rule. Stops at the first `block` rule unless `all_matches` (explain, tests)."""
        verdict = Verdict()
        if not self.enabled:
            return verdict
        skip = self._excluded_ids(view)
        state = _State(view)
        score = 0
        for compiled in self.rules:
            rule = compiled.rule
            if skip and rule.id in skip:
                continue
            hit = compiled.node(state)
            if hit is None:
                continue
            action = rule.action
            match = RuleMatch(rule, hit, compiled.points if action == "score" or action == "block" else 0)
            verdict.matches.append(match)
            if rule.tags and action != "monitor":
                verdict.tags.extend(t for t in rule.tags if t not in verdict.tags)
            if action == "redact":
                verdict.redactions.append(match)
            score += match.points
            if action == "block" and verdict.blocking_rule is None:
                verdict.blocking_rule = rule
                if not all_matches:
                    break
        verdict.score = score
        if verdict.blocking_rule is None and score >= self.threshold:
            verdict.blocking_rule = next(m.rule for m in verdict.matches if m.points)
        if verdict.blocking_rule is not None:
            verdict.action = "block" if self.mode == "block" else "monitor"
        elif verdict.matches:
            verdict.action = "log"
        return verdict

    def redact(self, view: RequestView, verdict: Verdict, payload: dict) -> int:
        """Replace, in `payload` (the parsed body, edited in place), every span the redacting rules' regexes match
        in the parts they read. Returns the number of spans replaced."""
        by_id = {r.rule.id: r for r in self.rules}
        count = 0
        for match in verdict.redactions:
            compiled = by_id[match.rule.id]
            replacement = compiled.rule.replacement.replace("\\", "\\\\")
            for targets, regex in compiled.redactors:
                for target in targets:
                    for _, _, loc in view.values(target):
                        text = _get_at(payload, loc) if loc else None
                        if not isinstance(text, str):
                            continue
                        new, n = regex.subn(replacement, text)
                        if n:
                            _set_at(payload, loc, new)
                            count += n
        return count

    def _excluded_ids(self, view: RequestView) -> frozenset[str] | set[str]:
        if not self.exclusions:
            return frozenset()
        out: set[str] = set()
        for exc, ids in self.exclusions:
            if ((not exc.routes or view.route in exc.routes) and (not exc.tenants or view.tenant in exc.tenants)
                    and (not exc.paths or any(view.path.startswith(p) for p in exc.paths))):
                out |= ids
        return out


def _excluded(exc: Exclusion, rule: WafRule) -> bool:
    return (any(fnmatch.fnmatchcase(rule.id, pattern) for pattern in exc.rules)
            or any(tag in rule.tags for tag in exc.tags))


def active_rules(spec: WafSpec, packs: dict[str, list[WafRule]], disabled: Iterable[str] = ()
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
    out.extend((rule, None) for rule in spec.rules
               if rule.id not in disabled and rule.paranoia_level <= spec.paranoia_level)
    return out


def _set_at(payload: object, loc: tuple, value: str) -> None:
    node = payload
    for step in loc[:-1]:
        node = node[step]
    node[loc[-1]] = value


def _get_at(payload: object, loc: tuple) -> object:
    node = payload
    try:
        for step in loc:
            node = node[step]
    except (KeyError, IndexError, TypeError):
        return None
    return node
