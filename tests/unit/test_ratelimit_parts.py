"""Small rate-limit parts: client IP behind trusted proxies, the rate-limit response headers, the key parts' table."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import get_args

import pytest

from gateway.context import RequestContext
from gateway.edge.client_ip import client_ip
from gateway.policy.model import KeyPart, RateLimitRule
from gateway.ratelimit.gcra import Outcome
from gateway.ratelimit.headers import go_duration, rate_limit_headers
from gateway.ratelimit.limiter import KEY_PART_FIELDS

TRUSTED = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128")]


@pytest.mark.parametrize(
    "peer, xff, trusted, expected",
    [
        ("203.0.113.9", "1.2.3.4", TRUSTED, "203.0.113.9"),  # untrusted peer: its XFF is ignored
        ("10.0.0.2", "198.51.100.7", TRUSTED, "198.51.100.7"),
        ("10.0.0.2", "6.6.6.6, 198.51.100.7, 10.1.1.1", TRUSTED, "198.51.100.7"),  # spoofed left part skipped
        ("10.0.0.2", None, TRUSTED, "10.0.0.2"),
        ("10.0.0.2", "10.9.9.9", TRUSTED, "10.9.9.9"),  # every hop trusted: the farthest one
        ("10.0.0.2", "198.51.100.7", [], "10.0.0.2"),  # no trusted proxies configured: never believe XFF
        ("::1", "2001:db8::1", TRUSTED, "2001:db8::1"),
        ("10.0.0.2", "garbage, 198.51.100.7", TRUSTED, "198.51.100.7"),
    ],
)
def test_client_ip_walks_back_through_trusted_proxies(peer, xff, trusted, expected):
    assert client_ip(peer, [xff] if xff else [], trusted) == expected


def test_client_ip_reads_every_forwarded_for_line_right_to_left():
    # The client wrote the first line; the trusted proxy appended its own line with what it saw.
    lines = ["6.6.6.6", "198.51.100.7, 10.1.1.1"]
    assert client_ip("10.0.0.2", lines, TRUSTED) == "198.51.100.7"


@pytest.mark.parametrize(
    "seconds, text", [(0.02, "20ms"), (1.5, "1.5s"), (12.2, "12s"), (360, "6m0s"), (3723, "1h2m3s")]
)
def test_reset_durations_are_written_like_openai(seconds, text):
    assert go_duration(seconds) == text


def test_headers_report_the_tightest_limit_of_each_kind():
    rules = [
        RateLimitRule(id="rpm", requests={"limit": 100, "per": 60}),
        RateLimitRule(id="rpd", requests={"limit": 1000, "per": "1d"}),
        RateLimitRule(id="tpm", tokens={"limit": 5000, "per": 60}),
        RateLimitRule(id="slots", concurrency={"limit": 4}),
    ]
    outcomes = [
        Outcome(True, 50, 0, 30),
        Outcome(True, 10, 0, 80000),
        Outcome(True, 4000, 0, 12),
        Outcome(True, 3, 0, 0),
    ]
    headers = rate_limit_headers(list(zip(rules, outcomes)))
    assert headers["x-ratelimit-limit-requests"] == "1000"  # 10/1000 left is tighter than 50/100
    assert headers["x-ratelimit-remaining-requests"] == "10"
    assert headers["x-ratelimit-reset-requests"] == "22h13m20s"
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("5000", "4000")
    assert headers["ratelimit-policy"] == '"rpm";q=100;w=60, "rpd";q=1000;w=86400, "tpm";q=5000;w=60, "slots";q=4'
    assert headers["ratelimit"] == '"rpm";r=50;t=30, "rpd";r=10;t=80000, "tpm";r=4000;t=12, "slots";r=3;t=0'


def test_every_key_part_a_policy_may_name_reads_a_request_attribute() -> None:
    """The policy's KeyPart and the limiter's table are one list: a part added to one and not the other, or one
    reading an attribute the request context does not have, fails here rather than on the first request."""
    assert set(get_args(KeyPart)) == set(KEY_PART_FIELDS)
    attributes = {f.name for f in dataclasses.fields(RequestContext)}
    assert {field for field in KEY_PART_FIELDS.values() if field is not None} <= attributes
