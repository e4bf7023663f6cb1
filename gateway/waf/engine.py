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

from gateway.waf import matchers, tautology, transforms
from gateway.waf.model import Condition, Exclusion, WafRule, WafSpec
from gateway.waf.parts import RequestView

_NUMERIC_TARGETS = frozenset(
    {"body_size", "header_count", "arg_count", "json_depth", "json_keys", "invalid_utf8", "prompt_size"}
)


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
        return self.text[self.start : self.end] if self.end > self.start else self.text


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
    """Per-request caches: transformed values per (targets, transforms), and the regex leaves that can match."""

    __slots__ = ("view", "values", "texts", "found")

    def __init__(self, view: RequestView, scans: list[_PartScan]) -> None:
        self.view = view
        self.values: dict[tuple, list] = {}
        self.texts: dict = {}  # target -> (raw texts, all short); targets tuple -> key for remembering or None
        found: set[int] = set()
        for scan in scans:
            texts, short = self.part(scan.target)
            if texts:
                hits = scan.candidates(texts, short)
                if hits:
                    found |= hits
        self.found = found

    def part(self, target: str) -> tuple[tuple[str, ...], bool]:
        """The raw texts of one part, and whether none is longer than _SHORT."""
        out = self.texts.get(target)
        if out is None:
            texts = tuple(text for _, text, _ in self.view.values(target))
            out = self.texts[target] = (texts, all(len(text) <= _SHORT for text in texts))
        return out

    def short_texts(self, targets: tuple[str, ...]) -> tuple | None:
        """The raw texts of these parts when none is longer than _SHORT (a key for remembering), else None."""
        out = self.texts.get(targets, _UNSET)
        if out is _UNSET:
            parts = [self.part(target) for target in targets]
            out = self.texts[targets] = tuple(texts for texts, _ in parts) if all(short for _, short in parts) else None
        return out

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


class _PartScan:
    """Every grouped regex that reads one request part: one RE2 set per transform chain. `candidates` tells which
    regex leaves can match some value of the part, scanning each chain's set once over the values joined by
    newlines. Short values repeat across requests (header values, JSON keys, roles, model names), so each one's
    answer is remembered, keyed by the raw text (a hit skips the transforms too), and so is a whole part made of
    them (the same JSON keys, the same arguments). A new short value that every transform of the part leaves as
    it is (request ids, trace context, tokens) reads the same through every chain: one scan of a set holding all
    the part's regexes decides it."""

    __slots__ = ("target", "sets", "seen", "seen_parts", "every", "steps")

    def __init__(self, target: str, sets: list[tuple[tuple, matchers.RegexSet]]) -> None:
        self.target = target
        self.sets = sets
        self.seen: dict[str, frozenset[int]] = {}
        self.seen_parts: dict[tuple[str, ...], frozenset[int]] = {}
        self.every = matchers.RegexSet.union([group for _, group in sets]) if len(sets) > 1 else None
        self.steps = tuple(transforms.TRANSFORMS[name] for name in sorted({n for chain, _ in sets for n in chain}))

    def candidates(self, texts: tuple[str, ...], short: bool) -> frozenset[int]:
        if short:
            whole = self.seen_parts.get(texts)
            if whole is not None:
                return whole
        seen = self.seen
        found: set[int] = set()
        long: list[str] = []
        for text in texts:
            if len(text) > _SHORT:
                long.append(text)
                continue
            hit = seen.get(text)
            if hit is None:
                if self.every is not None and all(step(text) == text for step in self.steps):
                    hit = frozenset(self.every.candidates(text.encode("utf-8", "surrogatepass")))
                else:
                    hit = self._scan([text])
                _remember(seen, text, hit)
            found |= hit
        if long:
            found |= self._scan(long)
        result = frozenset(found) if found else _NONE
        if short:
            _remember(self.seen_parts, texts, result)
        return result

    def _scan(self, texts: list[str]) -> frozenset[int]:
        found: list[int] = []
        apply = transforms.apply
        for chain, group in self.sets:
            done = [apply(chain, t) for t in texts] if chain else texts
            found.extend(group.candidates("\n".join(done).encode("utf-8", "surrogatepass")))
        return frozenset(found)


Node = Callable[[_State], "Hit | None"]
_NONE: frozenset[int] = frozenset()
_SHORT = 256  # values up to this many characters are decided once and remembered
_UNSET = object()


# Process-wide caches of pure functions of short strings (bounded; cleared when full).
_CACHE_ENTRIES = 4096  # per RE2 set and per transform chain; a full cache starts over
_TRANSFORMED: dict[tuple, dict[str, str]] = {}


class _Compiler:
    """Builds each rule's condition tree into a `Node`, and with it the regex leaves the rule cannot match without:
    when none of them is among a request's candidates, the rule is skipped without evaluating it."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[tuple, matchers.RegexSet]] = {}  # target -> chain -> set
        self.leaf_count = 0

    def node(self, cond: Condition) -> tuple[Node, frozenset[int] | None]:
        """The node, and the leaves one of which must be a candidate for it to hold (None: no such set)."""
        if cond.all is not None:
            built = [self.node(c) for c in cond.all]
            children = [n for n, _ in built]
            needs = min((k for _, k in built if k is not None), key=len, default=None)

            def all_(state: _State) -> Hit | None:
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
            needs = None if any(k is None for _, k in built) else frozenset().union(*(k for _, k in built))

            def any_(state: _State) -> Hit | None:
                for child in children:
                    hit = child(state)
                    if hit is not None:
                        return hit
                return None

            return any_, needs
        if cond.not_ is not None:
            child, _ = self.node(cond.not_)
            return (lambda state: _NOT_HIT if child(state) is None else None), None
        if cond.regex is not None:
            return self._regex(cond.regex, (tuple(cond.target or ()), tuple(cond.transforms)))
        return self.leaf(cond), None

    def leaf(self, cond: Condition) -> Node:
        key = (tuple(cond.target or ()), tuple(cond.transforms))
        op = cond.operator
        if op == "phrases":
            find = matchers.phrase_matcher(cond.phrases)
            return _scan(key, op, find)
        if op == "sqli":
            least = cond.sqli.min_tokens if not isinstance(cond.sqli, bool) else 1
            return _scan(key, op, lambda text: (0, len(text)) if matchers.sqli_tokens(text) >= least else None)
        if op == "xss":
            return _scan(key, op, lambda text: (0, len(text)) if matchers.is_xss(text) else None)
        if op == "tautology":
            return _scan(key, op, tautology.find)
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

    def _regex(self, pattern: str, key: tuple) -> tuple[Node, frozenset[int] | None]:
        regex = matchers.compile_regex(pattern)

        def search(text: str) -> tuple[int, int] | None:
            match = regex.search(text)
            return match.span() if match else None

        scan = _scan(key, "regex", search)
        if matchers.needs_own_scan(pattern) or any(t in _NUMERIC_TARGETS for t in key[0]):
            return scan, None
        # One RE2 set per (part, transforms): every regex reading that part through those transforms is decided
        # by a single scan of it, shared by all rules whatever other parts they also read. Only a leaf the sets
        # found is searched value by value (for the matching value and span).
        leaf = self.leaf_count
        self.leaf_count += 1
        for target in key[0]:
            chains = self.groups.setdefault(target, {})
            group = chains.get(key[1])
            if group is None:
                group = chains[key[1]] = matchers.RegexSet()
            group.add(pattern, leaf)

        def regex_leaf(state: _State) -> Hit | None:
            return scan(state) if leaf in state.found else None

        return regex_leaf, frozenset((leaf,))

    def finish(self) -> list[_PartScan]:
        for chains in self.groups.values():
            for group in chains.values():
                group.compile()
        return [_PartScan(target, list(chains.items())) for target, chains in self.groups.items()]


def _text(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _scan(key: tuple, operator: str, find: Callable[[str], tuple[int, int] | None]) -> Node:
    """A leaf that tries `find` on each transformed value. Every operator is a pure function of the text, so when
    the parts read are all short their outcome (which value, which span) is remembered by their raw texts: the
    same arguments, keys and headers on the next request cost one lookup."""
    targets = key[0]
    memo: dict[tuple, tuple[int, int, int] | None] = {}

    def scan(state: _State) -> Hit | None:
        texts = state.short_texts(targets)
        if texts is not None:
            known = memo.get(texts, _UNSET)
            if known is None:
                return None
            if known is not _UNSET:
                part, text, loc = state.get(key)[known[0]]
                return Hit(part, text, known[1], known[2], operator, loc)
        for i, (part, text, loc) in enumerate(state.get(key)):
            span = find(text)
            if span is not None:
                if texts is not None:
                    _remember(memo, texts, (i, span[0], span[1]))
                return Hit(part, text, span[0], span[1], operator, loc)
        if texts is not None:
            _remember(memo, texts, None)
        return None

    return scan


def _remember(cache: dict, key: object, value: object) -> None:
    if len(cache) > _CACHE_ENTRIES:
        cache.clear()
    cache[key] = value


@dataclass(frozen=True)
class CompiledRule:
    rule: WafRule
    node: Node
    points: int
    pack: str | None
    needs: frozenset[int] | None  # regex leaves one of which must be a candidate for the rule to hold
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
            redactors = (
                tuple((targets, matchers.compile_regex(pattern)) for targets, pattern in _regex_leaves(rule.when))
                if rule.action == "redact"
                else ()
            )
            node, needs = compiler.node(rule.when)
            self.rules.append(CompiledRule(rule, node, points, pack, needs, redactors))
        self._scans = compiler.finish()
        # Which rules a request must evaluate: those that need no regex candidate, plus those a candidate wakes.
        self._always = tuple(i for i, r in enumerate(self.rules) if r.needs is None)
        self._woken: dict[int, tuple[int, ...]] = {}
        for i, r in enumerate(self.rules):
            for leaf in r.needs or ():
                self._woken[leaf] = (*self._woken.get(leaf, ()), i)
        self.exclusions: list[tuple[Exclusion, frozenset[str]]] = [
            (exc, frozenset(r.rule.id for r in self.rules if _excluded(exc, r.rule))) for exc in spec.exclusions
        ]

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
        state = _State(view, self._scans)
        order = self._always
        if state.found:
            woken = self._woken
            order = sorted({*order, *(i for leaf in state.found for i in woken.get(leaf, ()))})
        rules = self.rules
        score = 0
        for index in order:
            compiled = rules[index]
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
            for targets, regex in compiled.redactors:
                for target in targets:
                    for _, _, loc in view.values(target):
                        text = _get_at(payload, loc) if loc else None
                        if not isinstance(text, str):
                            continue
                        new, n = _redact_text(regex, compiled.rule.replacement, text)
                        if n:
                            _set_at(payload, loc, new)
                            count += n
        return count

    def _excluded_ids(self, view: RequestView) -> frozenset[str] | set[str]:
        if not self.exclusions:
            return frozenset()
        out: set[str] = set()
        for exc, ids in self.exclusions:
            if (
                (not exc.routes or view.route in exc.routes)
                and (not exc.tenants or view.tenant in exc.tenants)
                and (not exc.paths or any(view.path.startswith(p) for p in exc.paths))
            ):
                out |= ids
        return out


def _redact_text(regex, replacement: str, text: str) -> tuple[str, int]:
    """`text` with every non-empty match replaced, and how many were. An empty match hides nothing, and replacing
    it would put the replacement between every two characters of the prompt (`[0-9]*` matches empty everywhere)."""
    replaced = 0

    def swap(found) -> str:
        nonlocal replaced
        if found.start() == found.end():
            return ""
        replaced += 1
        return replacement

    new, _ = regex.subn(swap, text)
    return new, replaced


def _excluded(exc: Exclusion, rule: WafRule) -> bool:
    return any(fnmatch.fnmatchcase(rule.id, pattern) for pattern in exc.rules) or any(
        tag in rule.tags for tag in exc.tags
    )


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
