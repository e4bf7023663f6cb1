"""Reading one request's parts for the rules, each at most once: raw texts, transformed values, and which regex
leaves can match at all (one RE2 set scan per part and transform chain).

Short values repeat across requests (header values, JSON keys, roles, model names), so the answers that are pure
functions of them are remembered between requests. Every such memory belongs to one `CompiledWaf` (its part scans,
its leaves, its `TransformCache`): a policy reload compiles a new one and the old memories go with the old policy.
"""

from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple, TypeVar

from gateway.waf import matchers, transforms
from gateway.waf.parts import RequestView, Value, part_source

SHORT = 256  # values up to this many characters are decided once and remembered
CACHE_ENTRIES = 4096  # per part scan, leaf and transform chain; a full memory starts over
_TRANSFORM_CACHED = 512  # values up to this many characters are remembered transformed

NO_LEAVES: frozenset[int] = frozenset()
_TEXT = itemgetter(1)  # a `Value`'s text

_Key = TypeVar("_Key")
_Answer = TypeVar("_Answer")


class Reading(NamedTuple):
    """What a leaf reads: these parts, through this transform chain. A plain tuple underneath, not a dataclass: it is
    a dict key built once at compile time and looked up for every leaf of every request, and a tuple hashes and
    compares in C. A single part's reading, `Reading((target,), chain)`, is also the key of that part's share of a
    wider reading, so both kinds of entry live in one map with one key type."""

    targets: tuple[str, ...]
    chain: tuple[str, ...]


def remember(cache: dict[_Key, _Answer], key: _Key, value: _Answer) -> None:
    """Store in a bounded memory: when it is full it starts over rather than tracking what was used last."""
    if len(cache) > CACHE_ENTRIES:
        cache.clear()
    cache[key] = value


class TransformCache:
    """Transformed short values per transform chain. One per compiled policy (see the module docstring)."""

    __slots__ = ("_by_chain",)

    def __init__(self) -> None:
        self._by_chain: dict[tuple[str, ...], dict[str, str]] = {}

    def for_chain(self, chain: tuple[str, ...]) -> dict[str, str]:
        cache = self._by_chain.get(chain)
        if cache is None or len(cache) > CACHE_ENTRIES:
            cache = self._by_chain[chain] = {}
        return cache


class PartScan:
    """Every grouped regex that reads one request part: one RE2 set per transform chain. `candidates` tells which
    regex leaves can match some value of the part, scanning each chain's set once over the values joined by
    newlines. Each short value's answer is remembered, keyed by the raw text (a hit skips the transforms too), and
    so is a whole part made of them (the same JSON keys, the same arguments). A new short value that every transform
    of the part leaves as it is (request ids, trace context, tokens) reads the same through every chain: one scan of
    a set holding all the part's regexes decides it. A part read from one header (or from the arguments) is not even
    extracted when the request lacks that `source`."""

    __slots__ = ("target", "source", "sets", "seen", "seen_parts", "every", "steps")

    def __init__(self, target: str, sets: list[tuple[tuple[str, ...], matchers.RegexSet]]) -> None:
        self.target = target
        self.source = part_source(target)
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
            if len(text) > SHORT:
                long.append(text)
                continue
            hit = seen.get(text)
            if hit is None:
                if self.every is not None and all(step(text) == text for step in self.steps):
                    hit = frozenset(self.every.candidates(text.encode("utf-8", "surrogatepass")))
                else:
                    hit = self._scan([text])
                remember(seen, text, hit)
            found |= hit
        if long:
            found |= self._scan(long)
        result = frozenset(found) if found else NO_LEAVES
        if short:
            remember(self.seen_parts, texts, result)
        return result

    def _scan(self, texts: list[str]) -> frozenset[int]:
        found: list[int] = []
        apply = transforms.apply
        for chain, group in self.sets:
            done = [apply(chain, t) for t in texts] if chain else texts
            found.extend(group.candidates("\n".join(done).encode("utf-8", "surrogatepass")))
        return frozenset(found)


class RequestState:
    """One request as the rules read it: each part's raw texts, each reading's transformed values, and `found`, the
    regex leaves some part scan says can match."""

    __slots__ = ("view", "transformed", "raw", "short_raw", "found", "_cache")

    def __init__(self, view: RequestView, scans: list[PartScan], cache: TransformCache) -> None:
        self.view = view
        self._cache = cache
        self.transformed: dict[Reading, list[Value]] = {}
        self.raw: dict[str, tuple[tuple[str, ...], bool]] = {}  # target -> (raw texts, whether all are short)
        self.short_raw: dict[tuple[str, ...], tuple[tuple[str, ...], ...] | None] = {}  # see short_texts
        found: set[int] = set()
        present = view.sources()
        for scan in scans:
            if scan.source is not None and scan.source not in present:
                continue
            texts, short = self.part(scan.target)
            if texts:
                hits = scan.candidates(texts, short)
                if hits:
                    found |= hits
        self.found = found

    def part(self, target: str) -> tuple[tuple[str, ...], bool]:
        """The raw texts of one part, and whether none is longer than SHORT."""
        out = self.raw.get(target)
        if out is None:
            texts = tuple(map(_TEXT, self.view.values(target)))
            out = self.raw[target] = (texts, max(map(len, texts), default=0) <= SHORT)
        return out

    def short_texts(self, targets: tuple[str, ...]) -> tuple[tuple[str, ...], ...] | None:
        """The raw texts of these parts when none is longer than SHORT (a key for remembering), else None."""
        known = self.short_raw
        if targets in known:
            return known[targets]
        parts = [self.part(target) for target in targets]
        out = known[targets] = tuple(texts for texts, _ in parts) if all(short for _, short in parts) else None
        return out

    def get(self, reading: Reading) -> list[Value]:
        """[(part, transformed text, location)] for the reading; each part is transformed once per chain, and short
        values come from the compiled policy's transform cache."""
        out = self.transformed.get(reading)
        if out is None:
            targets, chain = reading
            if len(targets) == 1:
                out = self._one(targets[0], chain)
            else:
                out = [v for t in targets for v in self.get(Reading((t,), chain))]
            self.transformed[reading] = out
        return out

    def transform(self, chain: tuple[str, ...], text: str) -> str:
        """One raw text through the chain, as `get` gives it."""
        if not chain:
            return text
        cache = self._cache.for_chain(chain)
        done = cache.get(text)
        return done if done is not None else _through(cache, chain, text)

    def _one(self, target: str, chain: tuple[str, ...]) -> list[Value]:
        raw = self.view.values(target)
        if not chain or not raw:
            return raw
        cache = self._cache.for_chain(chain)
        out: list[Value] = []
        for part, text, loc in raw:
            done = cache.get(text)
            if done is None:
                done = _through(cache, chain, text)
            out.append((part, done, loc))
        return out


def _through(cache: dict[str, str], chain: tuple[str, ...], text: str) -> str:
    """The text transformed, remembered in the chain's cache when it is short enough."""
    done = transforms.apply(chain, text)
    if len(text) <= _TRANSFORM_CACHED:
        cache[text] = done
    return done
