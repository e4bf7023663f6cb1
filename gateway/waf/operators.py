"""The WAF's operators: how a match condition tests one (transformed) value of a request part.

An operator is two things, each in one place: an `Operator` here (the test it builds from the condition's value, and
what it refuses at load), and the field of `Condition` (gateway/waf/model.py) that carries it, which gives the name a
policy writes, the value's type and the description the policy schema publishes:

    cidr: Annotated[list[str] | None, operators.CIDR] = Field(default=None, description="...")

The compiler (gateway/waf/compile.py) reaches every operator through that field; tests/unit/test_waf_registries.py
fails when one is half added (an `Operator` no field carries, or an operator the policy docs do not list).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import re2

from gateway.waf import matchers, tautology

if TYPE_CHECKING:
    from gateway.waf.model import Numeric, SqliOptions

Span = tuple[int, int]
Find = Callable[[str], Span | None]  # an operator on one transformed value: the matching span, or None


def _any_value_runs(value: Any) -> None:
    """The field's type already admits only values the operator can run."""


@dataclass(frozen=True)
class Operator:
    """`build`: the condition's value (as the policy model validated it) -> its test on one value, built once at
    load. `check`: raises ValueError for a value that would fail or run slowly at request time, so that it never
    loads."""

    build: Callable[[Any], Find]
    check: Callable[[Any], None] = _any_value_runs


def _whole(holds: Callable[[str], bool]) -> Find:
    """A test that matches the whole value or nothing."""
    return lambda text: (0, len(text)) if holds(text) else None


def _text(value: object) -> str:
    """A policy's number as a request part reads it: 2.0 is "2"."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


_QUIET = re2.Options()
_QUIET.log_errors = False


def _compiles_under_re2(pattern: str) -> None:
    try:
        re2.compile(pattern, options=_QUIET)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else str(exc)
        raise ValueError(f"regex does not compile under RE2: {reason}") from None


def _regex(pattern: str) -> Find:
    regex = matchers.compile_regex(pattern)

    def search(text: str) -> Span | None:
        match = regex.search(text)
        return match.span() if match else None

    return search


def _non_empty_phrases(phrases: list[str]) -> None:
    if not phrases or any(not p for p in phrases):
        raise ValueError("phrases must be a non-empty list of non-empty strings")


def _equals(value: str | float) -> Find:
    wanted = _text(value)
    return _whole(lambda text: text == wanted)


def _in(values: list[str | float]) -> Find:
    allowed = frozenset(_text(v) for v in values)
    return _whole(lambda text: text in allowed)


def _number(spec: Numeric) -> Find:
    holds = matchers.numeric_test(spec)

    def number(text: str) -> Span | None:
        value = matchers.as_number(text)
        return (0, len(text)) if value is not None and holds(value) else None

    return number


def _length(spec: Numeric) -> Find:
    fits = matchers.numeric_test(spec)
    return lambda text: (0, min(len(text), 64)) if fits(len(text)) else None


def _sqli(value: bool | SqliOptions) -> Find:
    least = getattr(value, "min_tokens", 1)
    return _whole(lambda text: matchers.sqli_tokens(text) >= least)


def _networks(networks: list[str]) -> None:
    for net in networks:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            raise ValueError(f"invalid network {net!r}") from None


REGEX = Operator(_regex, _compiles_under_re2)
PHRASES = Operator(matchers.phrase_matcher, _non_empty_phrases)
EQUALS = Operator(_equals)
IN = Operator(_in)
NUMBER = Operator(_number)
LENGTH = Operator(_length)
SQLI = Operator(_sqli)
XSS = Operator(lambda _: _whole(matchers.is_xss))
TAUTOLOGY = Operator(lambda _: tautology.find)
CIDR = Operator(lambda networks: _whole(matchers.cidr_test(networks)), _networks)
