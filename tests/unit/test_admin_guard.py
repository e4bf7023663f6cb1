"""Which Host header values name the admin listener (gateway/admin/request_guard.py), by the address a connection
reached.

The refusals a browser can provoke are held against a real gateway in tests/hostile/test_admin_plane.py; this holds
the rule itself over the addresses a test cannot bind (a pod's address, IPv6, a wildcard bind) and
`admin.allowed_hosts`.
"""

from __future__ import annotations

import pytest

from gateway.admin.request_guard import AdminGuard
from gateway.config import AdminConfig


async def _unused(scope, receive, send) -> None:
    raise AssertionError("not called")


def guard(**admin: object) -> AdminGuard:
    return AdminGuard(_unused, AdminConfig.model_validate({"token_env": "T", **admin}), token="t")


@pytest.mark.parametrize(
    "admin, server, host",
    [
        ({}, ("127.0.0.1", 9901), "127.0.0.1:9901"),
        ({}, ("127.0.0.1", 9901), "localhost:9901"),
        ({}, ("127.0.0.1", 9901), "[::1]:9901"),  # a loopback connection: every loopback name
        ({"host": "::1"}, ("::1", 9901), "[::1]:9901"),
        ({"host": "0.0.0.0"}, ("10.1.2.3", 9901), "10.1.2.3:9901"),  # a scrape of the pod's address
        ({"host": "admin.internal"}, ("10.1.2.3", 9901), "admin.internal:9901"),
        ({"host": "0.0.0.0", "allowed_hosts": ["Ops.Example"]}, ("10.1.2.3", 9901), "ops.example"),
        ({"host": "0.0.0.0", "allowed_hosts": ["ops.example"]}, ("10.1.2.3", 9901), "ops.example:443"),
        ({"host": "0.0.0.0", "allowed_hosts": ["ops.example:8443"]}, ("10.1.2.3", 9901), "ops.example:8443"),
    ],
)
def test_the_listeners_own_names_pass(admin, server, host):
    assert guard(**admin).names_this_listener(host, server)


@pytest.mark.parametrize(
    "admin, server, host",
    [
        ({}, ("127.0.0.1", 9901), "evil.example:9901"),  # a DNS-rebound name
        ({}, ("127.0.0.1", 9901), "127.0.0.1:9902"),
        ({}, ("127.0.0.1", 9901), "127.0.0.1"),
        ({}, ("127.0.0.1", 9901), ""),
        ({"host": "0.0.0.0"}, ("10.1.2.3", 9901), "localhost:9901"),  # not a loopback connection
        ({"host": "0.0.0.0", "allowed_hosts": ["ops.example:8443"]}, ("10.1.2.3", 9901), "ops.example:443"),
        ({"host": "0.0.0.0", "allowed_hosts": ["ops.example"]}, ("10.1.2.3", 9901), "ops.example.evil:9901"),
        ({}, ("/run/portcullis.sock", None), "localhost:None"),  # a Unix socket has no address to name
    ],
)
def test_other_names_are_refused(admin, server, host):
    assert not guard(**admin).names_this_listener(host, server)
