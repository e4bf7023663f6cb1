"""PII and secrets detectors: each type caught in context, validators reject look-alikes, redaction is typed."""

from __future__ import annotations

import base64
import re
import re._constants as sre  # the parsed pattern's opcodes: the needles' claims are read off them
import re._parser as sre_parse

import pytest

from gateway.guard import pii


def types(text: str) -> list[str]:
    return [f.type for f in pii.find(text)]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("mail me at jane.doe+tag@example.co.uk please", "email"),
        ("call +1 415-555-2671 tomorrow", "phone"),
        ("call (415) 555-2671 tomorrow", "phone"),
        ("card 4111 1111 1111 1111 exp 12/29", "credit_card"),
        ("card 5500-0000-0000-0004", "credit_card"),
        ("IBAN GB82 WEST 1234 5698 7654 32 for the transfer", "iban"),
        ("iban DE89370400440532013000", "iban"),
        ("ssn 123-45-6789", "us_ssn"),
        ("server at 203.0.113.42 is down", "ip_address"),
        ("v6 2001:db8:85a3::8a2e:370:7334 ok", "ip_address"),
        ("key AKIAIOSFODNN7EXAMPLE in the config", "aws_access_key"),
        ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "aws_secret_key"),
        ("gcp AIzaSyA-1234567890abcdefghijklmnopqrstu key", "gcp_api_key"),
        ('{"type": "service_account", "project_id": "x"}', "gcp_service_account"),
        ("token ghp_" + "a" * 36, "github_token"),
        ("OPENAI_API_KEY=sk-proj-" + "Ab3" * 15, "openai_api_key"),
        ("sk-ant-api03-" + "x" * 40, "anthropic_api_key"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "private_key"),
        ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAA", "private_key"),
        ("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "jwt"),
    ],
)
def test_each_type_is_found(text: str, expected: str) -> None:
    assert expected in types(text)


@pytest.mark.parametrize(
    "text",
    [
        "card 4111 1111 1111 1112",  # fails Luhn
        "iban GB82 WEST 1234 5698 7654 33",  # bad checksum
        "ssn 000-12-3456 and 666-12-3456 and 900-12-3456",  # impossible areas
        "version 1.2.3.4000 and 999.1.1.1",  # not IPv4
        "localhost is 127.0.0.1",  # loopback is not PII
        "order number 12345",
        "the sk-learn library and sk-short",
        "price 1,234.56 on 2024-05-01",
        "AKIA is a prefix, AKIASHORT too",
        "what is prompt injection?",
    ],
)
def test_look_alikes_are_not_found(text: str) -> None:
    assert types(text) == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tool get_AKIAIOSFODNN7EXAMPLE", "aws_access_key"),
        ("xAKIAIOSFODNN7EXAMPLEx", "aws_access_key"),
        ("gcp_AIzaSyA-1234567890abcdefghijklmnopqrstu", "gcp_api_key"),
        ("token_ghp_" + "a" * 36 + "_x", "github_token"),
        ("my_sk-proj-" + "Ab3" * 15, "openai_api_key"),
        ("xsk-ant-api03-" + "x" * 40, "anthropic_api_key"),
        ("slack_xoxb-1234567890-abcdef", "slack_token"),
        ("auth_eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U", "jwt"),
    ],
)
def test_a_key_glued_to_a_word_is_found(text: str, expected: str) -> None:
    """A key's prefix is its boundary: letters, digits or an underscore around it hide nothing from its reader."""
    assert expected in types(text)


def test_sk_at_the_end_of_a_word_is_not_a_key() -> None:
    assert types("the task-queue-processor-worker-pool and the desk-lamp-controller-firmware") == []


def test_luhn_and_iban_validators() -> None:
    assert pii.luhn("4111111111111111") and not pii.luhn("4111111111111112")
    assert pii.iban("GB82WEST12345698765432") and not pii.iban("GB82WEST12345698765431")
    assert not pii.iban("XX82WEST12345698765432")


def test_redaction_is_typed_and_keeps_the_rest() -> None:
    text = "Email jane@example.com, key AKIAIOSFODNN7EXAMPLE, card 4111-1111-1111-1111."
    out = pii.redact(text, pii.find(text))
    assert out == "Email [REDACTED:EMAIL], key [REDACTED:AWS_ACCESS_KEY], card [REDACTED:CREDIT_CARD]."


def test_kinds_and_type_filter() -> None:
    text = "jane@example.com AKIAIOSFODNN7EXAMPLE"
    assert {f.kind for f in pii.find(text)} == {"pii", "secret"}
    assert [f.type for f in pii.find(text, ["email"])] == ["email"]


def test_no_overlapping_findings() -> None:
    text = "ssn 123-45-6789 phone 415-555-2671 ip 10.1.2.3"
    spans = [(f.start, f.end) for f in pii.find(text)]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_linear_time_on_a_long_adversarial_input() -> None:
    import time

    text = ("1-" * 50_000) + ("a@" * 50_000) + ("-" * 100_000)
    started = time.perf_counter()
    pii.find(text)
    assert time.perf_counter() - started < 5.0


def test_linear_time_on_escapes_that_never_end() -> None:
    """Runs of backslashes, ampersands and percent signs that almost make escapes: the unescaped view stays linear
    (a run of 200k backslashes took minutes matched from each of its characters)."""
    import time

    for text in ("\\" * 200_000, ("\\" * 50 + "u004") * 4_000, "&#" * 100_000, "%4" * 100_000):
        started = time.perf_counter()
        pii.find(text)
        assert time.perf_counter() - started < 2.0


KEY = "AKIAIOSFODNN7EXAMPLE"


@pytest.mark.parametrize(
    "hidden",
    [
        "AKIA\u200dIOSFODNN7EXAMPLE",  # a zero-width joiner inside
        "AKIA\u202eIOSF\u2066ODNN7EXAMPLE",  # bidi controls
        "ＡＫＩＡIOSFODNN7EXAMPLE",  # fullwidth letters (NFKC)
        "AKIA\u00adIOSFODNN7\ufe0fEXAMPLE",  # a soft hyphen, a variation selector
        "&#65;&#x4B;IAIOSFODNN7EXAMPLE",  # character references, decimal and hex
        "&#xFF21;KIAIOSFODNN7EXAMPLE",  # a reference to a fullwidth letter: unescaped, then folded
        "%41%4BIAIOSFODNN7EXAMPLE",  # percent-escapes
        "\\u0041\\x4BIAIOSFODNN7EXAMPLE",  # string escapes
        "\\\\u0041KIAIOSFODNN7EXAMPLE",  # the same, in a JSON string inside a JSON string
    ],
)
def test_a_key_its_reader_sees_whole_is_found_and_redacted_whole(hidden: str) -> None:
    text = f"the key: {hidden}. bye"
    assert types(text) == ["aws_access_key"]
    assert pii.redact(text, pii.find(text)) == "the key: [REDACTED:AWS_ACCESS_KEY]. bye"


def test_a_key_in_base64_is_found_and_the_whole_run_redacted() -> None:
    encoded = base64.b64encode(KEY.encode()).decode()
    for run in (encoded, "token" + encoded, base64.urlsafe_b64encode(b"x:" + KEY.encode()).decode().rstrip("=")):
        text = f"here: {run} ok"
        assert types(text) == ["aws_access_key"], run
        assert pii.redact(text, pii.find(text)) == "here: [REDACTED:AWS_ACCESS_KEY] ok"
    plain = base64.b64encode(b"an ordinary sentence, nothing to see here").decode()
    assert types(f"data {plain}") == [], "base64 of ordinary text is ordinary"
    assert types("mail " + base64.b64encode(b"bob@example.org and more").decode()) == [], "only secrets are decoded"


def test_a_key_in_hex_is_found_and_its_digits_redacted() -> None:
    encoded = KEY.encode().hex()
    for run, expected in (
        (encoded, "[REDACTED:AWS_ACCESS_KEY]"),
        ("x0" + encoded.upper(), "x[REDACTED:AWS_ACCESS_KEY]"),
    ):
        text = f"here: {run} ok"
        assert types(text) == ["aws_access_key"], run
        assert pii.redact(text, pii.find(text)) == f"here: {expected} ok"
    assert types("sha256 " + "ab12" * 16 + " and " + b"an ordinary sentence".hex()) == []


def test_base64_runs_past_the_bound_are_not_decoded() -> None:
    """A run longer than MAX_BASE64_RUN is a file or an image: its cost is not paid, whatever it holds."""
    filler = base64.b64encode(b"\0" * (pii.MAX_BASE64_RUN)).decode()
    assert types(base64.b64encode(b"\0" * 30 + KEY.encode()).decode()) == ["aws_access_key"]
    assert types(base64.b64encode(b"\0" * len(filler) + KEY.encode()).decode()) == []


def test_an_address_right_after_another_scripts_letter_is_found() -> None:
    assert pii.redact("\u00e9bob@example.org", pii.find("\u00e9bob@example.org")) == "\u00e9[REDACTED:EMAIL]"


def _literal_prefixes(ops) -> tuple[set[str], bool]:
    """The literal texts one of which every match of a parsed pattern starts with (zero-width assertions skipped),
    and whether they are the whole of every match."""
    out = {""}
    for op, arg in ops:
        if op in (sre.AT, sre.ASSERT, sre.ASSERT_NOT):
            continue
        if op is sre.LITERAL:
            out = {prefix + chr(arg) for prefix in out}
            continue
        if op is sre.SUBPATTERN and not arg[1] and not arg[2]:  # a group that sets no flags
            alternatives = [_literal_prefixes(arg[3])]
        elif op is sre.BRANCH:
            alternatives = [_literal_prefixes(branch) for branch in arg[1]]
        elif op is sre.IN and all(kind is sre.LITERAL for kind, _ in arg):  # a set of characters: `[pousr]`
            alternatives = [({chr(code) for _, code in arg}, True)]
        else:
            return out, False
        out = {prefix + more for prefix in out for texts, _ in alternatives for more in texts}
        if not all(whole for _, whole in alternatives):
            return out, False
    return out, True


def _required_characters(ops) -> set[str]:
    """Characters that every match of a parsed pattern holds."""
    out: set[str] = set()
    for op, arg in ops:
        if op is sre.LITERAL:
            out.add(chr(arg))
        elif op is sre.SUBPATTERN and not arg[1] and not arg[2]:
            out |= _required_characters(arg[3])
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT) and arg[0] >= 1:
            out |= _required_characters(arg[2])
        elif op is sre.BRANCH:
            out |= set.intersection(*(_required_characters(branch) for branch in arg[1]))
    return out


@pytest.mark.parametrize("detector", [d for d in pii.DETECTORS if d.needles], ids=lambda d: d.type)
def test_a_detectors_needles_are_in_every_match_of_its_pattern(detector):
    """A text without any of a detector's needles is not searched: each claim is read off the pattern itself (every
    match starts with a literal holding a needle, or holds a needle character wherever it is), so a pattern edited
    without its needles fails here rather than missing what it should find."""
    assert not detector.pattern.flags & re.IGNORECASE
    parsed = sre_parse.parse(detector.pattern.pattern)
    prefixes, _ = _literal_prefixes(parsed)
    starts_with_one = all(any(needle in prefix for needle in detector.needles) for prefix in prefixes)
    holds_one = any(needle in _required_characters(parsed) for needle in detector.needles)
    assert starts_with_one or holds_one


def test_a_text_with_no_needle_is_still_read_by_the_detectors_without_any():
    """The needles skip patterns, never texts: an IBAN, a card number and a phone number have none of them."""
    assert types("IBAN GB82 WEST 1234 5698 7654 32 and card 4111 1111 1111 1111 or +1 415 555 2671") == [
        "iban",
        "credit_card",
        "phone",
    ]


@pytest.mark.parametrize(
    "text",
    [
        "Tom &amp; Jerry scored 50% &lt; 60%, path C:\\new\\table",
        "100%AB &copy; &nosuchentity; \\ud800 alone",
    ],
)
def test_escapes_that_hide_nothing_change_no_finding(text: str) -> None:
    assert pii.find(text) == []


def test_a_finding_in_the_unescaped_view_takes_out_whole_escapes_only() -> None:
    text = "a &amp; b, mail bob&#64;example.com, &#65;KIAIOSFODNN7EXAMPLE%21 end"
    assert pii.redact(text, pii.find(text)) == "a &amp; b, mail [REDACTED:EMAIL], [REDACTED:AWS_ACCESS_KEY]%21 end"


def test_a_key_split_across_texts_read_in_a_row_is_found_as_its_piece_in_each() -> None:
    parts = ["the key is AKIAIO", "SFOD", "NN7EXAMPLE.", "AKIAIOSFODNN7EXAMPLE"]
    pieces = pii.find_across(parts)
    assert [pii.redact(part, found) for part, found in zip(parts, pieces)] == [
        "the key is [REDACTED:AWS_ACCESS_KEY]",
        "[REDACTED:AWS_ACCESS_KEY]",
        "[REDACTED:AWS_ACCESS_KEY].",
        "AKIAIOSFODNN7EXAMPLE",  # whole in one text: that text's own finding, not one across
    ]
