"""No client-chosen identity: the client's address and its trace are the gateway's to decide, not the client's.

Each test fills a per-address limit or traces on a gateway of its own; they share the module's fake upstream."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Launcher, Process, chat_body, policy_dir, pool
from tests.integration.test_tracing import http_receiver, traced_gateway  # noqa: F401 (fixture)

ONE_PER_CLIENT_IP = [{"id": "per-ip", "key": ["client_ip"], "requests": {"limit": 1, "per": "1h"}}]


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream()


def post(gw, forwarded_for: list[str]) -> int:
    headers = [("x-forwarded-for", line) for line in forwarded_for]
    return httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=headers, timeout=10).status_code


def test_forwarded_for_from_an_untrusted_local_peer_is_ignored(upstream, gateway, tmp_path):
    gw = gateway({"pools": [pool("main", upstream.url)], "policy_dir": policy_dir(tmp_path, ONE_PER_CLIENT_IP)})
    assert post(gw, ["198.51.100.1"]) == 200
    assert post(gw, ["198.51.100.2"]) == 429  # same socket peer: the header chose nothing


def test_forwarded_for_is_read_over_every_header_line_right_to_left(upstream, gateway, tmp_path):
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "trusted_proxies": ["127.0.0.1/32", "10.0.0.0/8"],
            "policy_dir": policy_dir(tmp_path, ONE_PER_CLIENT_IP),
        }
    )
    # the client wrote the first line; two trusted proxies appended what they saw on a second line
    assert post(gw, ["6.6.6.6", "198.51.100.7, 10.0.0.5"]) == 200
    assert post(gw, ["7.7.7.7", "198.51.100.7, 10.0.0.5"]) == 429  # same real client, whatever it wrote itself
    assert post(gw, ["6.6.6.6", "198.51.100.8, 10.0.0.5"]) == 200


def test_a_client_can_neither_unsample_a_request_nor_choose_its_trace(upstream, gateway, http_receiver):  # noqa: F811
    endpoint, received = http_receiver
    gw = traced_gateway(gateway, upstream, endpoint, "http/protobuf")
    unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    assert (
        httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"traceparent": unsampled}).status_code
        == 200
    )
    root = next(s for s in received.wait_for("POST /v1/chat/completions") if s["name"] == "POST /v1/chat/completions")
    assert root["trace_id"] != "0af7651916cd43dd8448eb211c80319c" and root["parent_id"] == ""
    assert root["links"] == [("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")]  # still joinable
