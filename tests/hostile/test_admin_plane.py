"""The admin plane answers only on its own listener: the public port says nothing about internals.

The tests that only read share one gateway; those that configure an admin token or stop Redis start their own."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.conftest import Launcher, Process, chat_body, pool

INTERNAL = ("/metrics", "/admin/policy")


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream()


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, upstream: Process) -> Process:
    return module_launcher.gateway(
        {
            "pools": [pool("main", upstream.url), pool("gone", "http://127.0.0.1:9", models=["x"])],
            "auth": {"keys": [{"tenant": "team-secret", "sha256": "a" * 64}]},
        }
    )


def test_internals_are_not_served_on_the_public_port(gw):
    for path in INTERNAL:
        response = httpx.get(gw.url + path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
        assert "team-secret" not in response.text
    ready = httpx.get(gw.url + "/readyz")
    assert ready.status_code == 503 and ready.json() == {"status": "not_ready"}  # no replica URLs
    assert httpx.get(gw.url + "/healthz").json() == {"status": "ok"}


def test_the_admin_listener_serves_metrics_readiness_and_policy(gw):
    assert "# TYPE portcullis_requests_total counter" in httpx.get(gw.admin_url + "/metrics").text
    assert httpx.get(gw.admin_url + "/admin/policy").json()["directory"] == "policies"
    pools = httpx.get(gw.admin_url + "/readyz").json()["pools"]
    assert pools["gone"] == [{"url": "http://127.0.0.1:9", "up": False}]


def test_the_admin_listener_does_not_proxy(gw):
    response = httpx.post(gw.admin_url + "/v1/chat/completions", json={"model": "m", "messages": []})
    assert response.status_code == 404


def test_an_admin_token_is_required_when_configured(upstream, gateway):
    gw = gateway(
        {"pools": [pool("main", upstream.url)], "admin": {"token_env": "ADMIN_TOKEN"}},
        env={"ADMIN_TOKEN": "s3cret-admin"},
    )
    refused = httpx.get(gw.admin_url + "/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"
    assert httpx.get(gw.admin_url + "/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(gw.admin_url + "/metrics", headers={"authorization": "Bearer s3cret-admin"}).status_code == 200


def test_a_store_that_is_down_is_a_503_on_the_key_and_spend_routes(upstream, gateway, redis_server):
    """Keys and spend in Redis, and Redis gone: the operator is told the store is unavailable, not that the gateway
    failed; once it is back the same calls work."""
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "redis": {"url": redis_server.url},
            "store": {"backend": "redis"},
        }
    )
    redis_server.kill()
    for answer in (
        httpx.post(gw.admin_url + "/admin/keys", json={"tenant": "team-a"}, timeout=10),
        httpx.post(gw.admin_url + "/admin/keys/0123456789ab/revoke", timeout=10),  # not taken as a 404
        httpx.get(gw.admin_url + "/admin/keys", timeout=10),
        httpx.get(gw.admin_url + "/admin/spend", timeout=10),
    ):
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "store_unavailable"
    redis_server.start()
    assert httpx.post(gw.admin_url + "/admin/keys", json={"tenant": "team-a"}, timeout=10).status_code == 201
    assert httpx.get(gw.admin_url + "/admin/spend", timeout=10).status_code == 200


def test_a_frozen_redis_costs_the_admin_plane_and_shutdown_only_redis_timeout(upstream, gateway, redis_server):
    """Keys and spend in Redis, and Redis stopped (it accepts connections, answers nothing): each call gives up after
    `redis.timeout`, so the operator gets a 503 at once, and a stopping gateway whose spend cannot be written does
    not wait on Redis."""
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "redis": {"url": redis_server.url, "timeout": 0.25},
            "store": {"backend": "redis", "flush_interval": 60},
            "models": [],  # no tokenizer to load: a stop waits for no warm-up, only for what it must write
        }
    )
    assert httpx.get(gw.admin_url + "/admin/spend", timeout=10).status_code == 200  # connected before the freeze
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), timeout=10).status_code == 200
        started = time.monotonic()
        answer = httpx.get(gw.admin_url + "/admin/spend", timeout=30)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "store_unavailable"
        assert time.monotonic() - started < 3  # a flush and a read, 0.25 s each, not redis-py's 5 s apiece
        started = time.monotonic()
        gw.proc.terminate()
        gw.proc.wait(timeout=30)
        assert time.monotonic() - started < 3, gw.output()  # its last flush fails in 0.25 s, not 5 s
        assert "rows could not be written before stopping" in gw.output()
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
