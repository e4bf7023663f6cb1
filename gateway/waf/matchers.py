"""Operators, compiled once at policy load: RE2 regexes (grouped into RE2 sets), Aho-Corasick phrase lists,
libinjection SQLi/XSS, equality, numbers, lengths and CIDR lists."""

from __future__ import annotations

import functools
import ipaddress
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import ahocorasick
import libinjection
import re2

if TYPE_CHECKING:
    from gateway.waf.model import Numeric

# One RE2 DFA budget per compiled regex/set; RE2 never backtracks, so time stays linear in the input whatever the
# pattern.
_OPTIONS = re2.Options()
_OPTIONS.max_mem = 64 << 20


def compile_regex(pattern: str) -> re2._Regexp:
    return re2.compile(pattern, options=_OPTIONS)


class RegexSet:
    """Many regexes over the same (targets, transforms): one RE2 set scan tells which can match at all; only those
    are then searched value by value to find the matching value and span."""

    def __init__(self) -> None:
        self._set = re2.Set.SearchSet(_OPTIONS)
        self.members: list[int] = []  # leaf index per set index
        self.patterns: list[str] = []

    def add(self, pattern: str, leaf: int) -> None:
        # (?m): the set scans all values joined by newlines, so ^ and $ must also hold at value boundaries.
        self._set.Add("(?m)" + pattern)
        self.members.append(leaf)
        self.patterns.append(pattern)

    @classmethod
    def union(cls, sets: list[RegexSet]) -> RegexSet:
        """One set holding every member of these (compiled)."""
        out = cls()
        for one in sets:
            for pattern, leaf in zip(one.patterns, one.members):
                out.add(pattern, leaf)
        out.compile()
        return out

    def compile(self) -> None:
        self._set.Compile()
        self._match = self._set._set.Match  # the binding itself: bytes in, indices out

    def candidates(self, joined: bytes) -> list[int]:
        members = self.members
        return [members[i] for i in self._match(joined)]


def needs_own_scan(pattern: str) -> bool:
    """Patterns anchored to the whole text cannot be decided on joined values."""
    return "\\A" in pattern or "\\z" in pattern


def phrase_matcher(phrases: Sequence[str]) -> Callable[[str], tuple[int, int] | None]:
    automaton = ahocorasick.Automaton()
    for phrase in phrases:
        automaton.add_word(phrase, len(phrase))
    automaton.make_automaton()

    def find(text: str) -> tuple[int, int] | None:
        for end, length in automaton.iter(text):
            return end - length + 1, end + 1
        return None

    return find


@functools.lru_cache(maxsize=16384)
def _sqli(text: str) -> int:
    """Tokens in libinjection's SQLi fingerprint, 0 when it is not SQLi. libinjection reads English words such as
    'left' or 'quarter' before a parenthesis as SQL functions; a fingerprint of nothing but words, functions,
    brackets, numbers and commas, in a value that is mostly words, is prose, not a query. A value opening with a
    T-SQL statement word (WHILE, WAITFOR, EXEC) runs nothing unless a string, comment, variable or query follows it:
    it cannot leave the application's literal without one."""
    result = libinjection.is_sql_injection(text)
    if not result["is_sqli"]:
        return 0
    fingerprint = result["fingerprint"]
    if isinstance(fingerprint, bytes):
        fingerprint = fingerprint.decode()
    if set(fingerprint) <= _PROSE_TOKENS and not _CALL.search(text) and _PROSE.search(text):
        return 0
    if fingerprint[0] == "T" and set(fingerprint[1:]) <= _PROSE_TOKENS:
        return 0  # a T-SQL statement word opening the value ("while (foo) is bar."), with no string, comment or query
    return len(fingerprint)


_PROSE_TOKENS = set("nf()1,o")  # bareword, function, brackets, number, comma, operator: no string, comment, logic
_CALL = compile_regex(r"\w\(")  # a name directly followed by its parenthesis is a call, not a word and an aside
_PROSE = compile_regex(r"^[^A-Za-z]*(?:[A-Za-z][A-Za-z'\x{2019}-]*[^A-Za-z]+){8}")  # opens with eight words


def _xss_uncached(text: str) -> bool:
    return not _PLAIN_STYLE.search(text) and bool(libinjection.is_xss(text)["is_xss"])


_xss = functools.lru_cache(maxsize=16384)(_xss_uncached)


def sqli_tokens(text: str) -> int:
    # Short, repeated values (roles, model names) hit the cache; long ones are not worth keeping.
    return _sqli(text) if len(text) <= 256 else _sqli.__wrapped__(text)


# libinjection flags the style attribute by its name; an inline declaration list alone (style=color:red;...) runs
# script only through expression(), url(javascript:), behavior or -moz-binding, which the XSS pack looks for itself.
_PLAIN_STYLE = compile_regex(r'(?i)^\s*style\s*=\s*[^<>"\'`\\]*$')


def is_xss(text: str) -> bool:
    if "<" not in text and "=" not in text and ":" not in text and "`" not in text and "(" not in text:
        return False  # libinjection's HTML5 tokenizer needs a tag, an attribute, a URL scheme or a call
    return _xss(text) if len(text) <= 256 else _xss_uncached(text)


_BOUNDS = (("gt", operator.gt), ("ge", operator.ge), ("lt", operator.lt), ("le", operator.le), ("eq", operator.eq))


def numeric_test(spec: Numeric) -> Callable[[float], bool]:
    """Every bound the spec gives holds."""
    checks = [(compare, bound) for name, compare in _BOUNDS if (bound := getattr(spec, name)) is not None]
    if len(checks) == 1:
        compare, bound = checks[0]
        return lambda x: compare(x, bound)
    return lambda x: all(compare(x, bound) for compare, bound in checks)


def as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def cidr_test(networks: Sequence[str]) -> Callable[[str], bool]:
    nets = [ipaddress.ip_network(n, strict=False) for n in networks]

    def test(text: str) -> bool:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            return False
        return any(address in net for net in nets if net.version == address.version)

    return test
