"""The WAF against ../shared/corpora/waf (OWASP CRS regression tests, libinjection lists) at paranoia levels 1 and 2.

Floors are what the packs measure today (docs/benchmarks.md has every family); a rule change that loses detection
or adds false positives fails here. Where the coverage targets are met they are asserted as such.
"""

from __future__ import annotations

import pytest

from tests.waf_corpus.harness import (
    CRS,
    LIBINJECTION,
    contested_stages,
    crs_cases,
    crs_families,
    libinjection_lists,
    web_waf,
)

pytestmark = [pytest.mark.eval, pytest.mark.shared]


@pytest.fixture(scope="module")
def results() -> dict[int, dict]:
    if not CRS.is_dir() or not LIBINJECTION.is_dir():
        pytest.skip(f"WAF corpora not found under {CRS.parent} (../shared is absent on this checkout)")
    out = {}
    for level in (1, 2):
        waf = web_waf(level)
        out[level] = {**crs_families(waf), **{f"libinjection {k}": v for k, v in libinjection_lists(waf).items()}}
    return out


def test_libinjection_false_positive_list_passes_at_pl1(results):
    assert results[1]["libinjection false_positives"].pass_rate >= 0.98  # the false-positive target


def test_libinjection_false_positive_list_passes_at_pl2(results):
    """Prose with apostrophes, inch marks, quoted search phrases and pasted formatting markup is no injection."""
    tally = results[2]["libinjection false_positives"]
    assert tally.pass_rate >= 0.95, f"passed {tally.passed}/{tally.benign}"


def test_libinjection_attack_lists_are_caught(results):
    assert results[1]["libinjection sqli"].catch_rate >= 0.97
    assert results[1]["libinjection xss"].catch_rate >= 0.99
    assert results[2]["libinjection sqli"].catch_rate >= 0.995
    assert results[2]["libinjection xss"].catch_rate >= 0.999


@pytest.mark.parametrize(
    "family, level, catch, passed",
    [
        # the targets at PL2 (>= 90% caught, >= 95% of no-match stages pass), asserted where met
        ("REQUEST-930-APPLICATION-ATTACK-LFI", 2, 0.90, 0.95),
        ("REQUEST-941-APPLICATION-ATTACK-XSS", 2, 0.946, 0.962),
        # catch target met; the no-match stages left failing are mostly attack payloads CRS labels only for a sibling
        # rule: regression floors (docs/benchmarks.md)
        ("REQUEST-942-APPLICATION-ATTACK-SQLI", 2, 0.928, 0.89),
        ("REQUEST-932-APPLICATION-ATTACK-RCE", 2, 0.94, 0.84),
        ("REQUEST-930-APPLICATION-ATTACK-LFI", 1, 0.90, 0.95),
        ("REQUEST-942-APPLICATION-ATTACK-SQLI", 1, 0.31, 0.94),
        ("REQUEST-941-APPLICATION-ATTACK-XSS", 1, 0.52, 0.962),
        ("REQUEST-932-APPLICATION-ATTACK-RCE", 1, 0.55, 0.86),
        ("REQUEST-944-APPLICATION-ATTACK-JAVA", 2, 0.99, 1.0),
        ("REQUEST-933-APPLICATION-ATTACK-PHP", 2, 0.96, 0.93),
        ("REQUEST-934-APPLICATION-ATTACK-GENERIC", 2, 0.949, 0.94),
        ("REQUEST-931-APPLICATION-ATTACK-RFI", 2, 0.91, 1.0),
        ("REQUEST-921-PROTOCOL-ATTACK", 2, 0.93, 0.95),
        ("REQUEST-921-PROTOCOL-ATTACK", 1, 0.74, 0.95),
        ("REQUEST-943-APPLICATION-ATTACK-SESSION-FIXATION", 2, 0.95, 1.0),
        ("REQUEST-920-PROTOCOL-ENFORCEMENT", 2, 0.787, 0.926),
        ("REQUEST-920-PROTOCOL-ENFORCEMENT", 1, 0.424, 0.947),
        ("REQUEST-913-SCANNER-DETECTION", 1, 1.0, 1.0),
        ("REQUEST-913-SCANNER-DETECTION", 2, 1.0, 1.0),
    ],
)
def test_crs_family_floors(results, family, level, catch, passed):
    tally = results[level][family]
    assert tally.catch_rate >= catch, f"{family} PL{level}: caught {tally.caught}/{tally.attacks}"
    assert tally.pass_rate >= passed, f"{family} PL{level}: passed {tally.passed}/{tally.benign}"


@pytest.mark.parametrize(
    "family",
    [
        "REQUEST-933-APPLICATION-ATTACK-PHP",
        "REQUEST-934-APPLICATION-ATTACK-GENERIC",
        "REQUEST-921-PROTOCOL-ATTACK",
        "REQUEST-943-APPLICATION-ATTACK-SESSION-FIXATION",
        "REQUEST-920-PROTOCOL-ENFORCEMENT",
    ],
)
def test_uncontested_no_match_stages_pass_at_pl2(results, family):
    """The target of 95 % of no-match stages, over those that send no other stage's attack."""
    tally = results[2][family]
    assert tally.uncontested_pass_rate >= 0.95, f"passed {tally.uncontested_passed}/{tally.uncontested}"


def test_rce_no_match_stages_pass_at_pl2_once_contested_ones_are_set_aside(results):
    """The 95% pass target holds for RCE over the no-match stages whose payload no attack stage of the corpus sends
    (of the 44 blocked, 32 are another stage's attack, e.g. 932230's `;cat /path/file.gz` is 932236's). Since the
    harness runs the `protocol` pack and enforce-220, 932310's `%02` control character and 932311's `We%examine`
    are blocked as CRS's 920271/920220 would: 94.5 %, below the target."""
    tally = results[2]["REQUEST-932-APPLICATION-ATTACK-RCE"]
    assert tally.uncontested_pass_rate >= 0.945, f"passed {tally.uncontested_passed}/{tally.uncontested}"
    assert tally.benign - tally.uncontested >= 30  # the twins are found: a broken comparison would contest nothing


def test_contested_stages_are_exact_attack_payloads():
    """A no-match stage is contested only by a value an attack stage sends, never by shared filler."""
    if not CRS.is_dir():
        pytest.skip(f"WAF corpora not found under {CRS.parent} (../shared is absent on this checkout)")
    families = crs_cases()
    contested = contested_stages(families)
    names = {c.name.rpartition("/")[2] for cases in families.values() for c in cases if c.name in contested}
    assert "932230.yaml#46" in names  # `;cat /path/file.gz`: 932236's attack
    assert "942521.yaml#16" not in names  # the Wikipedia article on SQLi: no attack stage sends it
    assert "932390.yaml#15" not in names  # shares only the test User-Agent with attack stages
