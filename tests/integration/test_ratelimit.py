"""Rate limits through real gateways: in memory, and exact across three gateway processes sharing a real Redis."""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest

from tests.conftest import chat_body, policy_dir, pool

KEYS = {f"sk-{t}": t for t in ("t1", "t2", "t3", "t4", "t5", "t6")}
AUTH = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for k, t in KEYS.items()]}

# One client for the module's requests (thread-safe, so the concurrent tests share it too): a bare httpx.post builds a
# client, and its TLS context, per call, which was most of the CPU the hundreds of requests here took.
http = httpx.Client(limits=httpx.Limits(max_connections=100, max_keepalive_connections=32))


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def metric(gw, name: str, **labels) -> float:
    """Sum of a Prometheus sample over series whose labels include `labels`."""
    total = 0.0
    for line in gw.admin.get("/metrics").text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def start(gateway, upstream, tmp_path, rules, redis=None, overlays=None, **redis_options):
    config = {
        "pools": [pool("main", upstream.url)],
        "auth": AUTH,
        "policy_dir": policy_dir(tmp_path, rules, overlays),
    }
    if redis:
        config["redis"] = {"url": redis.url, **redis_options}
    return gateway(config)


def upstream_requests(upstream) -> int:
    return http.get(upstream.url + "/_stats").json()["requests"]


@pytest.fixture(scope="module")
def upstream(module_launcher):
    """The module's upstream: a test counts the requests that reached it as a difference over its own."""
    return module_launcher.fake_upstream()


# A test that fills a limit shares a gateway only where the limit is its own: the shared gateways' base policy has
# no rule, and each test's rules are an overlay for its own tenants (an overlay's new rule ids add to the base's).
IN_MEMORY_RULES = {
    "t1": [{"id": "key-rph", "key": ["api_key"], "requests": {"limit": 3, "per": "1h"}}],
    "t3": [
        {"id": "t3-key-rph", "key": ["api_key"], "requests": {"limit": 2, "per": "1h"}},
        {"id": "key-tpm", "key": ["api_key"], "tokens": {"limit": 1000, "per": "1m"}},
    ],
}
IN_MEMORY_RULES["t2"] = IN_MEMORY_RULES["t1"]
IN_MEMORY_RULES["t4"] = [{"id": "ip-rph", "key": ["client_ip"], "requests": {"limit": 2, "per": "1h"}}]
IN_MEMORY_RULES["t5"] = [{"id": "ip-rph", "key": ["client_ip"], "requests": {"limit": 50, "per": "1h"}}]


@pytest.fixture(scope="module")
def in_memory(module_launcher, upstream):
    return start(module_launcher.gateway, upstream, module_launcher.directory / "memory", [], overlays=IN_MEMORY_RULES)


def test_requests_limit_in_memory_with_openai_and_ietf_headers(in_memory, upstream):
    gw, before = in_memory, upstream_requests(upstream)
    remaining = []
    for _ in range(3):
        ok = http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t1"))
        assert ok.status_code == 200
        remaining.append(ok.headers["x-ratelimit-remaining-requests"])
        assert ok.headers["x-ratelimit-limit-requests"] == "3"
        assert ok.headers["ratelimit-policy"] == '"key-rph";q=3;w=3600'
    assert remaining == ["2", "1", "0"]
    limited = http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t1"))
    assert limited.status_code == 429
    error = limited.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests" and error["param"] == "key-rph"
    assert 1100 <= int(limited.headers["retry-after"]) <= 1200  # one request per 1200 s comes back
    assert limited.headers["ratelimit"].startswith('"key-rph";r=0;t=')
    assert limited.headers["x-ratelimit-reset-requests"] in ("1h0m0s", "59m59s", "59m58s")
    # another key has its own counter; the refused request never reached the upstream
    assert http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t2")).status_code == 200
    assert upstream_requests(upstream) - before == 4
    assert metric(gw, "portcullis_ratelimit_decisions_total", limit="key-rph", result="limited") == 1


def test_one_tenants_traffic_does_not_use_up_another_tenants_rule_of_the_same_id(in_memory):
    """t4 and t5 each have an `ip-rph` rule keyed by the client's address, and both call from 127.0.0.1: t5's
    requests used up t4's counter, so t4 was refused before it had sent anything."""
    gw = in_memory
    for _ in range(5):
        assert http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t5")).status_code == 200
    t4 = [http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t4")) for _ in range(3)]
    assert [r.status_code for r in t4] == [200, 200, 429]
    assert t4[2].json()["error"]["param"] == "ip-rph"


def test_a_request_larger_than_a_whole_token_window_is_refused_as_too_large(in_memory, upstream):
    """No wait lets a reservation above the limit fit: the refusal says so and names no retry time, and the
    request takes nothing from the other rules (t3's: 2 requests an hour, 1000 tokens a minute)."""
    gw, before = in_memory, upstream_requests(upstream)
    for max_tokens in (10**12, 2**62):
        large = http.post(
            gw.url + "/v1/chat/completions", json=chat_body(max_tokens=max_tokens), headers=bearer("sk-t3")
        )
        assert large.status_code == 429
        error = large.json()["error"]
        assert error["type"] == "tokens" and error["param"] == "key-tpm" and error["code"] == "rate_limit_exceeded"
        assert "Request too large" in error["message"] and "Limit 1000" in error["message"], error["message"]
        assert "retry-after" not in large.headers
    # the refusals took no request from t3-key-rph and no tokens from key-tpm
    for _ in range(2):
        assert (
            http.post(
                gw.url + "/v1/chat/completions", json=chat_body(max_tokens=400), headers=bearer("sk-t3")
            ).status_code
            == 200
        )
    assert upstream_requests(upstream) - before == 2


def _hammer(gateways, key: str, count: int, body: dict, workers: int = 24) -> list[httpx.Response]:
    """`count` concurrent requests spread round-robin over the gateways."""

    def one(i: int) -> httpx.Response:
        return http.post(
            gateways[i % len(gateways)].url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=30
        )

    with ThreadPoolExecutor(workers) as pool_:
        return list(pool_.map(one, range(count)))


# Three gateways sharing one Redis, each test's rules an overlay for its own tenants
SHARED_RULES = {
    **{
        t: [{"id": "tenant-100", "key": ["tenant"], "requests": {"limit": 100, "per": "2h"}}]
        for t in ("t1", "t2", "t3")
    },
    "t4": [{"id": "tenant-tokens", "key": ["tenant"], "tokens": {"limit": 10_000, "per": "24h"}}],
    "t5": [{"id": "two-at-once", "key": ["tenant"], "concurrency": {"limit": 2}}],
    "t6": [{"id": "rph", "requests": {"limit": 2, "per": "1h"}}],
}


@pytest.fixture(scope="module")
def three_gateways(module_launcher, upstream, module_redis_server):
    # fail_closed with a generous timeout: on a loaded machine a slow Redis must not silently fall back to
    # per-gateway limits, which would (correctly, by design) admit more than the shared limit
    directory = module_launcher.directory / "shared"
    return [
        start(
            module_launcher.gateway,
            upstream,
            directory,
            [],
            module_redis_server,
            overlays=SHARED_RULES,
            timeout=5.0,
            on_failure="fail_closed",
        )
        for _ in range(3)
    ]


def test_exactly_the_limit_succeeds_across_three_gateways(three_gateways, upstream):
    gateways = three_gateways
    allowed = "portcullis_ratelimit_decisions_total"
    before = upstream_requests(upstream)
    allowed_before = sum(metric(gw, allowed, limit="tenant-100", result="allowed", backend="redis") for gw in gateways)
    for key in ("sk-t1", "sk-t2", "sk-t3"):  # three independent windows
        statuses = [r.status_code for r in _hammer(gateways, key, 250, chat_body())]
        assert statuses.count(200) == 100 and statuses.count(429) == 150, key
    assert (
        sum(metric(gw, allowed, limit="tenant-100", result="allowed", backend="redis") for gw in gateways)
        - allowed_before
        == 300
    )
    assert upstream_requests(upstream) - before == 300


def test_token_limit_reservations_reconcile_to_reported_usage(three_gateways, module_redis_server):
    gateways = three_gateways
    redis = module_redis_server.client()
    counters_before = set(redis.keys("portcullis:rl:*"))
    rng = random.Random(7)
    bodies = []
    for _ in range(60):
        max_tokens = rng.randint(100, 900)
        bodies.append(
            chat_body(
                stream=True,
                max_tokens=max_tokens,
                stream_options={"include_usage": True},
                fake={"chunks": rng.randint(1, max_tokens)},
            )
        )

    def one(i: int) -> tuple[int, int, str]:
        response = http.post(
            gateways[i % 3].url + "/v1/chat/completions", json=bodies[i], headers=bearer("sk-t4"), timeout=30
        )
        if response.status_code != 200:
            return response.status_code, 0, response.json()["error"]["type"]
        chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        return 200, chunks[-1]["usage"]["total_tokens"], ""

    with ThreadPoolExecutor(8) as workers:
        results = list(workers.map(one, range(len(bodies))))
    admitted_usage = sum(used for status, used, _ in results if status == 200)
    assert {kind for status, _, kind in results if status == 429} == {"tokens"}
    assert sum(1 for status, *_ in results if status == 200) >= 5
    # what the limit charged, summed over the three gateways, is exactly what the upstream reported
    charged = sum(metric(gw, "portcullis_ratelimit_tokens_charged_total", limit="tenant-tokens") for gw in gateways)
    assert charged == admitted_usage
    assert admitted_usage <= 10_000 + 10  # the bucket refills by ~0.1 token/s over the test
    tat_left = set(redis.keys("portcullis:rl:*")) - counters_before
    assert len(tat_left) == 1  # one counter for the tenant


def test_concurrency_slots_return_to_zero_after_clients_disconnect(three_gateways, module_redis_server):
    gw = three_gateways[0]  # t5: two at once
    slow = chat_body(stream=True, fake={"chunks": 200, "delay": 0.05})
    client = httpx.Client(timeout=10)
    streams = [
        client.stream("POST", gw.url + "/v1/chat/completions", json=slow, headers=bearer("sk-t5")) for _ in range(2)
    ]
    readers = []  # keep the line iterators alive: a collected iterator closes its connection
    for stream in streams:
        response = stream.__enter__()
        assert response.status_code == 200
        readers.append(response.iter_lines())
        next(readers[-1])
    third = http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t5"))
    assert third.status_code == 429 and third.json()["error"]["type"] == "concurrency"
    for stream in streams:
        stream.__exit__(None, None, None)  # the clients vanish mid-stream
    client.close()
    redis = module_redis_server.client()

    def slots_held() -> int:  # concurrency slots are sorted sets; the other tests' counters here are not
        return sum(redis.zcard(k) for k in redis.keys("portcullis:rl:*") if redis.type(k) == b"zset")

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and slots_held() > 0:
        time.sleep(0.05)
    assert slots_held() == 0
    assert http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t5")).status_code == 200


def test_scripts_are_reloaded_after_redis_forgets_them(three_gateways, module_redis_server):
    gw = three_gateways[0]  # t6: two requests an hour
    errors = metric(gw, "portcullis_ratelimit_backend_errors_total")
    assert http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t6")).status_code == 200
    module_redis_server.client().script_flush()
    assert http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t6")).status_code == 200
    assert http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t6")).status_code == 429
    assert metric(gw, "portcullis_ratelimit_backend_errors_total") == errors


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
def test_redis_outage_follows_the_failure_mode_and_limits_resume(upstream, gateway, tmp_path, redis_server, mode):
    rules = [{"id": "rph", "key": ["tenant"], "requests": {"limit": 3, "per": "1h"}}]
    gw = start(
        gateway,
        upstream,
        tmp_path,
        rules,
        redis_server,
        on_failure=mode,
        timeout=0.2,
        breaker_failures=2,
        breaker_cooldown=0.5,
    )

    def post() -> httpx.Response:
        return http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t1"), timeout=5)

    assert [post().status_code for _ in range(2)] == [200, 200]
    redis_server.kill()
    started = time.monotonic()
    during = [post() for _ in range(4)]
    assert time.monotonic() - started < 4  # no request hangs on the dead store
    if mode == "fail_open":  # local limits take over: a fresh local budget of 3
        assert [r.status_code for r in during] == [200, 200, 200, 429]
        assert metric(gw, "portcullis_ratelimit_decisions_total", backend="memory") == 4
    else:
        assert {r.status_code for r in during} == {503}
        assert during[0].json()["error"]["code"] == "rate_limiter_unavailable"
    assert metric(gw, "portcullis_ratelimit_backend_errors_total", backend="redis") >= 1

    redis_server.start()  # back, empty: the shared budget starts over
    time.sleep(0.7)  # past the breaker's cooldown
    assert [post().status_code for _ in range(4)] == [200, 200, 200, 429]
    assert metric(gw, "portcullis_ratelimit_decisions_total", backend="redis", result="limited") == 1


@pytest.mark.parametrize("mode", ["fail_open", "fail_closed"])
def test_a_redis_url_that_reaches_no_redis_follows_the_failure_mode(upstream, gateway, tmp_path, mode):
    """A server that answers every command with `+OK` (a misconfigured port, a proxy): redis-py trips on the reply's
    type, which must count as the store failing, not as a defect of the request."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_ok(conn: socket.socket) -> None:
        with conn:
            while conn.recv(65536):
                conn.sendall(b"+OK\r\n")

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end of the test
            while True:
                threading.Thread(target=answer_ok, args=(listener.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    not_redis = SimpleNamespace(url=f"redis://127.0.0.1:{listener.getsockname()[1]}/0")
    rules = [{"id": "rph", "key": ["tenant"], "requests": {"limit": 2, "per": "1h"}}]
    gw = start(gateway, upstream, tmp_path, rules, not_redis, on_failure=mode)
    try:
        answers = [
            http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=bearer("sk-t1"), timeout=5)
            for _ in range(3)
        ]
    finally:
        listener.close()
    if mode == "fail_open":  # the local limits decide
        assert [r.status_code for r in answers] == [200, 200, 429]
    else:
        assert [r.status_code for r in answers] == [503] * 3
        assert answers[0].json()["error"]["code"] == "rate_limiter_unavailable"
    assert metric(gw, "portcullis_ratelimit_backend_errors_total", backend="redis") >= 1
    assert "unhandled error" not in gw.output()
