"""PII and secrets detectors: each type caught in context, validators reject look-alikes, redaction is typed."""

from __future__ import annotations

import base64

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


KEY = "AKIAIOSFODNN7EXAMPLE"


@pytest.mark.parametrize(
    "hidden",
    [
        "AKIA\u200dIOSFODNN7EXAMPLE",  # a zero-width joiner inside
        "AKIA\u202eIOSF\u2066ODNN7EXAMPLE",  # bidi controls
        "ＡＫＩＡIOSFODNN7EXAMPLE",  # fullwidth letters (NFKC)
        "AKIA\u00adIOSFODNN7\ufe0fEXAMPLE",  # a soft hyphen, a variation selector
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


def test_base64_runs_past_the_bound_are_not_decoded() -> None:
    """A run longer than MAX_BASE64_RUN is a file or an image: its cost is not paid, whatever it holds."""
    filler = base64.b64encode(b"\0" * (pii.MAX_BASE64_RUN)).decode()
    assert types(base64.b64encode(b"\0" * 30 + KEY.encode()).decode()) == ["aws_access_key"]
    assert types(base64.b64encode(b"\0" * len(filler) + KEY.encode()).decode()) == []


def test_an_address_right_after_another_scripts_letter_is_found() -> None:
    assert pii.redact("\u00e9bob@example.org", pii.find("\u00e9bob@example.org")) == "\u00e9[REDACTED:EMAIL]"
