"""The `tautology` operator: a comparison between two SQL literals that holds (1=1, 'a'='a', 42 LIKE 42, OR 2>1,
1 IS NOT 2), the always-true condition an injection adds to a WHERE clause.

A regex cannot say "both sides are equal" in linear time (RE2 has no backreferences), so RE2 finds each
literal-operator-literal comparison and this module evaluates it the way a database would: numbers as numbers,
strings case-insensitively (MySQL's default collation), LIKE with its `%`/`_` wildcards, REGEXP through RE2. A
comparison that is false (11!=11, '1' NOT REGEXP '1') is a contradiction, which is no bypass. A string literal may
be left open at the end of the value ('1'='1), as an injection leaves it for the application's closing quote.
"""

from __future__ import annotations

import functools
from operator import ge, gt, le, lt

import re2

from gateway.waf.matchers import compile_regex

_NUMBER = r"-?\d+(?:\.\d+)?"
_OPERATOR = (
    r"<=>|==|=|!=|<>|>=|<=|<|>|\bnot\s+(?:like|rlike|regexp)\b|\blike\b|\brlike\b|\bregexp\b|"
    r"\bis\s+not\b|\bis\b"
)
# Groups: 1 left number, 2 left string, 3 operator, 4 right number, 5 right string. A number is a whole token, not
# the tail of a name (x1=1) or a decimal; a right-hand string may be left open at the end of the value.
_COMPARISON = compile_regex(
    rf"(?i)(?:(?:^|[^\w.])({_NUMBER})|('[^']{{0,64}}'|\"[^\"]{{0,64}}\"))\s*({_OPERATOR})\s*"
    rf"(?:({_NUMBER})(?:[^\w.]|$)|('[^']{{0,64}}(?:'|$)|\"[^\"]{{0,64}}(?:\"|$)))"
)
_MAX_COMPARISONS = 256
_NEGATED = frozenset(("!=", "<>", "is not", "not like", "not rlike", "not regexp"))
# "3 < 5" is everyday text; an ordering is a tautology only as a condition (OR 2>1, AND 3>=3, WHERE 1<2).
_ORDERING = {"<": lt, ">": gt, "<=": le, ">=": ge}
_LOGIC_BEFORE = compile_regex(r"(?i)(?:\bor|\band|\bxor|\bwhere|\bhaving|\bwhen|\bnot|\|\||&&)\s*\(?\s*$")


def find(text: str) -> tuple[int, int] | None:
    """The span of the first comparison in `text` that holds, or None. Only the first `_MAX_COMPARISONS` are
    judged: a value packed with false ones (each LIKE or REGEXP compiles a pattern) must not buy CPU, and one that
    long is many SQL metacharacters in a row, which sqli-190 reads."""
    pos = 0
    for _ in range(_MAX_COMPARISONS):
        match = _COMPARISON.search(text, pos)
        if match is None:
            return None
        first = 1 if match.group(1) else 2  # the left operand's group
        last = 4 if match.group(4) else 5  # the right operand's
        operator = " ".join(match.group(3).lower().split())
        condition = operator not in _ORDERING or _LOGIC_BEFORE.search(
            text[max(0, match.start(first) - 24) : match.start(first)]
        )
        if condition and _holds(_value(match.group(first)), operator, _value(match.group(last))):
            return match.start(first), match.end(last)
        pos = match.start(last) - 1  # the right operand may open the next comparison (1=2=2)
    return None


def _holds(a: float | str, operator: str, b: float | str) -> bool:
    negated = operator in _NEGATED
    if operator.endswith("like") and not operator.endswith("rlike"):
        return _like(str(a), str(b)) != negated
    if operator.endswith(("regexp", "rlike")):
        return _regexp(str(a), str(b)) != negated
    if isinstance(a, float) != isinstance(b, float):  # '1' = 1, 'a' = 0: the string read as a number, as MySQL does
        a, b = _number(a), _number(b)
    if operator in ("=", "==", "<=>", "is"):
        return a == b
    if negated:
        return a != b
    return bool(_ORDERING[operator](a, b))


def _value(literal: str) -> float | str:
    if literal[0] in "'\"":
        end = -1 if len(literal) > 1 and literal[-1] == literal[0] else None
        return literal[1:end].casefold()
    return float(literal)


def _number(value: float | str) -> float:
    """MySQL's reading of a string as a number: its leading numeric prefix, 0 without one."""
    if isinstance(value, float):
        return value
    prefix = _LEADING_NUMBER.match(value)
    return float(prefix.group(1)) if prefix else 0.0


_LEADING_NUMBER = compile_regex(rf"^\s*({_NUMBER})")


def _like(text: str, pattern: str) -> bool:
    """SQL LIKE through RE2 (linear time whatever the wildcards)."""
    regex = "".join("." if ch == "_" else ".*" if ch == "%" else re2.escape(ch) for ch in pattern)
    return _regexp(text, f"(?s)^{regex}$")


def _regexp(text: str, pattern: str) -> bool:
    compiled = _compiled(pattern)
    return compiled is not None and compiled.search(text) is not None


@functools.lru_cache(maxsize=256)
def _compiled(pattern: str) -> re2._Regexp | None:
    """A pattern the request wrote: compiled quietly (no log line per bad pattern) and in a small memory budget."""
    try:
        return re2.compile(pattern, options=_REQUEST_PATTERN)
    except re2.error:
        return None


_REQUEST_PATTERN = re2.Options()
_REQUEST_PATTERN.log_errors = False
_REQUEST_PATTERN.max_mem = 1 << 20
