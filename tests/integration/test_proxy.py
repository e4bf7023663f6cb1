"""The real gateway under uvicorn, in front of real upstream processes, over loopback sockets."""

from __future__ import annotations

import gzip
import hashlib
import json
import time

import httpx
import openai
import pytest
import yaml

from tests.conftest import chat_body, pool

KEY = "sk-test-tenant-a"
AUTH = {"keys": [{"tenant": "team-a", "label": "ci", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
HEADERS = {"authorization": f"Bearer {KEY}"}

# One client for the module's requests: a bare httpx.post builds a client, and its TLS context (the CA bundle, tens
# of milliseconds of CPU), per call. Tests that need a fresh client (no cookie jar carried over, a body the gateway
# cuts off) make their own.
http = httpx.Client()


def sse_data(raw: str) -> list[str]:
    return [line[6:] for line in raw.splitlines() if line.startswith("data: ")]


def stats(upstream) -> dict:
    return http.get(upstream.url + "/_stats").json()


def series(gw, line: str) -> float:
    """The value of one exact series (`name{labels}`, as the gateway writes it) on the admin plane; 0 before it is
    written. The module's tests share a gateway, so a test asserts on what its own requests added."""
    for sample in gw.admin.get("/metrics").text.splitlines():
        if sample.startswith(line + " "):
            return float(sample.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def upstream(module_launcher):
    """The module's fake upstream: tests that count what it saw count the difference their own requests made."""
    return module_launcher.fake_upstream("up")


@pytest.fixture(scope="module")
def second_upstream(module_launcher):
    return module_launcher.fake_upstream("beta")


@pytest.fixture(scope="module")
def one_upstream(module_launcher, upstream):
    """The module's gateway: a key by its hash and one from the environment, and test-model named in `models`, so its
    token counts keep their own label (unknown models count as `other`)."""
    auth = {"keys": [*AUTH["keys"], {"tenant": "team-env", "key_env": "TEAM_ENV_KEY"}]}
    gw = module_launcher.gateway(
        {"pools": [pool("main", upstream.url)], "auth": auth, "models": [{"name": "test-model"}]},
        env={"TEAM_ENV_KEY": "sk-from-env"},
    )
    return gw, upstream


@pytest.fixture(scope="module")
def small_bodies(module_launcher, upstream):
    """A gateway with no keys and a 1 KiB body limit, for the requests it must refuse before any upstream."""
    return module_launcher.gateway({"pools": [pool("main", upstream.url)], "limits": {"max_body_bytes": 1024}})


def test_non_streaming_chat_is_relayed_with_usage_recorded(one_upstream):
    gw, upstream = one_upstream
    tokens = 'portcullis_tokens_total{kind="completion",model="test-model",pool="main"}'
    requests = 'portcullis_requests_total{route="chat",status="200"}'
    before = series(gw, tokens), series(gw, requests)
    response = http.post(gw.url + "/v1/chat/completions", json=chat_body(fake={"chunks": 4}), headers=HEADERS)
    assert response.status_code == 200
    body = response.json()
    assert body["choices"][0]["message"]["content"] == "w0 w1 w2 w3 "
    assert response.headers["x-request-id"]
    assert series(gw, tokens) == before[0] + 4
    assert series(gw, requests) == before[1] + 1
    # the client's own credential never reaches the upstream
    assert "authorization" not in stats(upstream)["last_headers"]


def test_stream_chunks_arrive_as_the_upstream_sends_them(one_upstream):
    gw, upstream = one_upstream
    body = chat_body(stream=True, fake={"chunks": 5, "delay": 0.3})
    arrivals = []
    started = time.perf_counter()
    with http.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.perf_counter() - started, line[6:]))
    payloads = [data for _, data in arrivals]
    assert payloads[-1] == "[DONE]"
    contents = [json.loads(p)["choices"][0]["delta"]["content"] for p in payloads[:-1]]
    assert contents == ["w0 ", "w1 ", "w2 ", "w3 ", "w4 "]
    total = arrivals[-1][0]
    assert total >= 1.2  # the upstream took 5 x 0.3 s
    assert arrivals[0][0] < total - 0.9  # the first chunk was not held back until the end
    gaps = [b[0] - a[0] for a, b in zip(arrivals, arrivals[1:4])]
    assert all(gap > 0.15 for gap in gaps), gaps  # chunk spacing is preserved, not batched


def written(gw) -> int:
    """The write system calls a gateway's process (every thread of it) has made so far."""
    for line in open(f"/proc/{gw.proc.pid}/io"):
        if line.startswith("syscw:"):
            return int(line.split()[1])
    raise AssertionError("no syscw in /proc/PID/io")


def test_a_proxied_answer_costs_one_write_each_way(gateway, upstream):
    """One send toward the upstream, and one toward the client: a fixed-length answer's head leaves with its body,
    not in a send of its own (each send is a pass through the kernel's TCP stack). Counted over requests on one
    connection, the access log off (its writer adds writes of its own)."""
    gw = gateway({"pools": [pool("main", upstream.url)], "telemetry": {"access_log": False}})
    requests = 60
    with httpx.Client() as client:
        assert client.post(gw.url + "/v1/chat/completions", json=chat_body()).status_code == 200  # connections made
        before = written(gw)
        for _ in range(requests):
            assert client.post(gw.url + "/v1/chat/completions", json=chat_body()).status_code == 200
        per_request = (written(gw) - before) / requests
    assert per_request < 2.5, per_request  # three with the head in a send of its own


def test_gateway_asks_for_usage_but_strips_it_when_the_client_did_not(one_upstream):
    gw, upstream = one_upstream
    prompt_tokens = 'portcullis_tokens_total{kind="prompt",model="test-model",pool="main"}'
    before = series(gw, prompt_tokens)
    response = http.post(
        gw.url + "/v1/chat/completions", json=chat_body(stream=True, fake={"chunks": 2}), headers=HEADERS
    )
    chunks = [json.loads(d) for d in sse_data(response.text) if d != "[DONE]"]
    assert all(c["choices"] for c in chunks), "usage-only chunk leaked to a client that did not ask for it"
    assert stats(upstream)["last_body"]["stream_options"] == {"include_usage": True}
    assert series(gw, prompt_tokens) == before + 7

    asked = http.post(
        gw.url + "/v1/chat/completions",
        json=chat_body(stream=True, stream_options={"include_usage": True}, fake={"chunks": 2}),
        headers=HEADERS,
    )
    last = json.loads(sse_data(asked.text)[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2


def test_client_disconnect_cancels_the_upstream_stream(one_upstream):
    gw, upstream = one_upstream
    before = stats(upstream)
    body = chat_body(stream=True, fake={"chunks": 100, "delay": 0.1})
    with http.stream("POST", gw.url + "/v1/chat/completions", json=body, headers=HEADERS) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and stats(upstream)["cancelled_streams"] == before["cancelled_streams"]:
        time.sleep(0.1)
    seen = stats(upstream)
    assert seen["cancelled_streams"] == before["cancelled_streams"] + 1
    assert seen["completed_streams"] == before["completed_streams"]
    metrics = gw.admin.get("/metrics").text
    assert f'portcullis_upstream_outstanding_requests{{pool="main",replica="{upstream.url}"}} 0.0' in metrics


def test_retry_on_another_replica_before_the_first_byte(fake_upstream, gateway, upstream):
    broken = fake_upstream("broken", fail_status=503)
    healthy, before = upstream, stats(upstream)["requests"]
    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    gw = gateway({"pools": [pool("main", dead, broken.url, healthy.url, routing="round_robin", max_attempts=3)]})
    for stream in (False, True):
        for _ in range(3):  # round robin starts each request on a different replica
            response = http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=stream))
            assert response.status_code == 200, response.text
    assert stats(healthy)["requests"] - before == 6
    assert stats(broken)["requests"] >= 2


def test_midstream_failure_ends_with_error_event_and_no_retry(gateway, upstream, second_upstream):
    first, second = upstream, second_upstream
    before = stats(first)["requests"] + stats(second)["requests"]
    gw = gateway({"pools": [pool("main", first.url, second.url, routing="round_robin")]})
    response = http.post(
        gw.url + "/v1/chat/completions", json=chat_body(stream=True, fake={"chunks": 5, "abort_after": 2})
    )
    assert response.status_code == 200
    data = sse_data(response.text)
    assert [json.loads(d)["choices"][0]["delta"]["content"] for d in data[:2]] == ["w0 ", "w1 "]
    error = json.loads(data[2])["error"]
    assert error["type"] == "upstream_error" and error["code"] == "upstream_unavailable"
    assert data[3] == "[DONE]" and len(data) == 4
    assert stats(first)["requests"] + stats(second)["requests"] - before == 1  # bytes were sent: never retried


def test_upstream_failures_map_to_clean_gateway_errors(gateway, upstream):
    slow = upstream
    gw = gateway(
        {
            "pools": [
                pool("dead", "http://127.0.0.1:9", models=["dead-model"]),
                pool("slow", slow.url, models=["slow-model"], timeouts={"read": 0.5}, max_attempts=1),
            ]
        }
    )
    dead = http.post(gw.url + "/v1/chat/completions", json=chat_body(model="dead-model"))
    assert dead.status_code == 502
    assert dead.json()["error"]["code"] == "upstream_unavailable"
    timeout = http.post(gw.url + "/v1/chat/completions", json=chat_body(model="slow-model", fake={"header_delay": 2}))
    assert timeout.status_code == 504
    assert timeout.json()["error"]["code"] == "upstream_timeout"
    unknown = http.post(gw.url + "/v1/chat/completions", json=chat_body(model="nope"))
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "headers, code",
    [
        ({}, "missing_api_key"),
        ({"authorization": "Bearer sk-wrong"}, "invalid_api_key"),
        ({"authorization": f"Basic {KEY}"}, "missing_api_key"),
    ],
)
def test_auth_failures_are_401_with_openai_errors(one_upstream, headers, code):
    gw, upstream = one_upstream
    before = stats(upstream)["requests"]
    response = http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=headers)
    assert response.status_code == 401
    assert response.json()["error"] == {
        "message": response.json()["error"]["message"],
        "type": "authentication_error",
        "code": code,
        "param": None,
    }
    assert stats(upstream)["requests"] == before


def test_key_from_environment_maps_to_its_tenant(one_upstream):
    gw, _ = one_upstream  # its second key is read from TEAM_ENV_KEY
    ok = http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"x-api-key": "sk-from-env"})
    assert ok.status_code == 200
    entry = gw.access_log(ok.headers["x-request-id"])
    assert entry["tenant"] == "team-env" and entry["status"] == 200


@pytest.mark.parametrize(
    "content, status, code",
    [
        (b"x" * 2048, 413, "request_too_large"),
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(), 400, None),
        (json.dumps({"model": "m", "messages": []}).encode(), 400, None),
        (json.dumps({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, None),
        (json.dumps({**chat_body(), "max_tokens": -1}).encode(), 400, None),
        (json.dumps({**chat_body(), "stream": "yes"}).encode(), 400, None),
    ],
)
def test_bad_bodies_get_4xx_openai_errors(small_bodies, upstream, content, status, code):
    gw, before = small_bodies, stats(upstream)["requests"]
    response = http.post(gw.url + "/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if code:
        assert error["code"] == code
    assert stats(upstream)["requests"] == before


@pytest.mark.parametrize("encoding", ["gzip", "br", "deflate, gzip"])
def test_a_compressed_body_is_refused_as_unsupported(small_bodies, upstream, encoding):
    """Read as JSON, a gzip body was an invalid_json "surrogates not allowed": say what is wrong instead."""
    gw, before = small_bodies, stats(upstream)["requests"]
    response = http.post(
        gw.url + "/v1/chat/completions",
        content=gzip.compress(json.dumps(chat_body()).encode()),
        headers={"content-type": "application/json", "content-encoding": encoding},
    )
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_content_encoding"
    plain = http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"content-encoding": "identity"})
    assert plain.status_code == 200
    assert stats(upstream)["requests"] == before + 1


def test_oversized_chunked_body_is_cut_off(one_upstream):
    gw, _ = one_upstream

    def body():
        for _ in range(8):
            yield b"x" * (1024 * 1024)

    response = httpx.post(gw.url + "/v1/chat/completions", content=body(), headers=HEADERS)
    assert response.status_code == 413


def test_unknown_paths_and_methods_answer_in_openai_shape(one_upstream):
    gw, _ = one_upstream
    missing = http.get(gw.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = http.get(gw.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"


def test_openai_client_works_unchanged(one_upstream):
    gw, _ = one_upstream
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    completion = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content == "w0 w1 w2 "
    assert completion.usage.completion_tokens == 3
    pieces = [
        c.choices[0].delta.content
        for c in client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        if c.choices
    ]
    assert "".join(p or "" for p in pieces) == "w0 w1 w2 "
    text = client.completions.create(model="test-model", prompt="once upon")
    assert text.choices[0].text == "w0 w1 w2 "
    streamed = [c.choices[0].text for c in client.completions.create(model="test-model", prompt=[1, 2, 3], stream=True)]
    assert "".join(streamed) == "w0 w1 w2 "
    assert [m.id for m in client.models.list()] == ["up-model"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-bad", max_retries=0).models.list()


def test_models_are_aggregated_across_pools(gateway, upstream, second_upstream):
    gw = gateway({"pools": [pool("a", upstream.url), pool("b", second_upstream.url, models=["pinned"])]})
    ids = {m["id"] for m in http.get(gw.url + "/v1/models").json()["data"]}
    assert ids == {"up-model", "beta-model", "pinned"}


def test_readiness_follows_the_upstreams(fake_upstream, gateway, one_upstream):
    upstream = fake_upstream()
    gw = gateway({"pools": [pool("live", upstream.url), pool("gone", "http://127.0.0.1:9", models=["x"])]})
    assert http.get(gw.url + "/healthz").status_code == 200
    assert http.get(gw.url + "/readyz").json() == {"status": "not_ready"}  # the public port names no replica
    ready = gw.admin.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["pools"]["live"][0]["up"] is True and ready.json()["pools"]["gone"][0]["up"] is False
    upstream.stop()
    every_pool_up, _ = one_upstream  # a gateway whose one pool's replica is up
    assert http.get(every_pool_up.url + "/readyz").status_code == 200


def test_access_log_is_json_with_trace_ids(one_upstream):
    gw, _ = one_upstream
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    response = http.post(
        gw.url + "/v1/chat/completions", json=chat_body(), headers={**HEADERS, "traceparent": traceparent}
    )
    entry = gw.access_log(response.headers["x-request-id"])
    # the gateway starts its own trace at the edge: a client cannot pick the id it is logged under
    assert len(entry["trace_id"]) == 32 and entry["trace_id"] not in ("0" * 32, "0af7651916cd43dd8448eb211c80319c")
    assert entry["status"] == 200 and entry["tenant"] == "team-a" and entry["completion_tokens"] == 3
    assert entry["upstream"].startswith("http://127.0.0.1:")


def test_a_client_cannot_choose_a_cache_salt(one_upstream):
    gw, upstream = one_upstream
    assert (
        http.post(gw.url + "/v1/chat/completions", json=chat_body(cache_salt="tenant-b"), headers=HEADERS).status_code
        == 200
    )
    assert "cache_salt" not in stats(upstream)["last_body"]  # shared cache: no salt reaches the upstream


def test_a_cookie_an_upstream_sets_is_not_sent_on_later_requests(gateway, upstream):
    """The gateway's connections to a pool serve every client: a session cookie one answer sets must not ride on the
    next request, whoever sends it. (The pool is named by host name: a cookie jar keeps no cookie of an IP address.)
    Each request goes from a client of its own (httpx.post), so no client-side jar carries the cookie either."""
    before = stats(upstream)["requests"]
    gw = gateway({"pools": [pool("main", upstream.url.replace("127.0.0.1", "localhost"))], "auth": AUTH})
    first = httpx.post(
        gw.url + "/v1/chat/completions", json=chat_body(fake={"set_cookie": "a-secret"}), headers=HEADERS
    )
    assert first.status_code == 200
    assert httpx.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=HEADERS).status_code == 200
    assert stats(upstream)["requests"] - before == 2
    assert "cookie" not in stats(upstream)["last_headers"]


def test_every_rewrite_of_the_payload_reaches_the_upstream_together(one_upstream):
    """Three stages and the relay rewrite one request (max_tokens filled, the client's cache salt dropped, usage
    asked for): the upstream gets one body that carries all of them, and the client's other fields unchanged."""
    gw, upstream = one_upstream
    body = chat_body(stream=True, cache_salt="tenant-b", temperature=0.5, fake={"chunks": 2})
    response = http.post(gw.url + "/v1/chat/completions", json=body, headers=HEADERS)
    assert response.status_code == 200 and sse_data(response.text)[-1] == "[DONE]"
    sent = stats(upstream)["last_body"]
    assert sent["max_tokens"] == 1024  # the policy's default, for a request that named none
    assert "cache_salt" not in sent
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == body["messages"] and sent["temperature"] == 0.5


def test_passthrough_routes_reach_the_pool_that_opted_in(gateway, upstream):
    pools = [pool("main", upstream.url, passthrough=["/v1/files*"], api_key_env="FILES_POOL_KEY")]
    gw = gateway({"pools": pools, "auth": AUTH}, env={"FILES_POOL_KEY": "sk-pool"})
    upload = b"line one\nline two\n" * 100
    response = http.post(
        gw.url + "/v1/files?purpose=batch", files={"file": ("data.jsonl", upload)}, headers=HEADERS, timeout=30
    )
    assert response.status_code == 201, response.text
    echoed = response.json()
    assert echoed["path"] == "/v1/files" and echoed["query"] == "purpose=batch" and echoed["method"] == "POST"
    assert echoed["content_type"].startswith("multipart/form-data; boundary=")
    assert echoed["authorization"] == "Bearer sk-pool", "the pool's key goes upstream, never the client's"
    assert response.headers["x-request-id"]
    # a file the tenant did not make through the gateway is no one's to delete (tests/hostile/test_tenant_objects.py)
    deleted = http.delete(gw.url + "/v1/files/file-1", headers=HEADERS)
    assert deleted.status_code == 404 and deleted.json()["error"]["code"] == "file_not_found"
    assert http.get(gw.url + "/v1/files").status_code == 401, "auth applies to passthrough routes"
    other = http.post(gw.url + "/v1/audio/speech", json={}, headers=HEADERS)
    assert other.status_code == 404 and "/v1/responses" in other.json()["error"]["message"]


def test_spend_is_priced_from_reconciled_usage_per_tenant_and_model(gateway, upstream, tmp_path):
    policies = tmp_path / "priced-policies"
    policies.mkdir()
    prices = {"models": {"test-model": {"input": 2.0, "cached_input": 0.5, "output": 10.0}}, "default": {"input": 1.0}}
    base = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "p"}, "spec": {"prices": prices}}
    (policies / "base.yaml").write_text(yaml.safe_dump(base))
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "auth": AUTH,
            "models": [{"name": "test-model"}],
            "policy_dir": str(policies),
        }
    )
    cached = http.post(
        gw.url + "/v1/chat/completions", json=chat_body(fake={"chunks": 4, "cached": 5}), headers=HEADERS
    )
    streamed = http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True), headers=HEADERS)
    unpriced = http.post(gw.url + "/v1/chat/completions", json=chat_body(model="new-model"), headers=HEADERS)
    assert cached.status_code == streamed.status_code == unpriced.status_code == 200
    # 7 prompt tokens (5 from the cache) and 4 completion; then 7 and 3; then 7 at the default input price
    expected = [(2 * 2 + 5 * 0.5 + 4 * 10) / 1e6, (7 * 2 + 3 * 10) / 1e6, 7 * 1.0 / 1e6]
    logged = [gw.access_log(r.headers["x-request-id"])["cost"] for r in (cached, streamed, unpriced)]
    assert logged == pytest.approx(expected)
    metrics = gw.admin.get("/metrics").text

    def sample(name: str, **labels: str) -> float:
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        line = next(line for line in metrics.splitlines() if line.startswith(f"{name}{{{wanted}}}"))
        return float(line.rsplit(" ", 1)[1])

    assert sample("portcullis_spend_total", currency="USD", model="test-model", tenant="team-a") == pytest.approx(
        sum(expected[:2])
    )
    assert sample("portcullis_spend_total", currency="USD", model="other", tenant="team-a") == pytest.approx(7e-6)
    assert sample("portcullis_billed_tokens_total", kind="cached_prompt", model="test-model", tenant="team-a") == 5
    assert sample("portcullis_billed_tokens_total", kind="prompt", model="test-model", tenant="team-a") == 9
    assert sample("portcullis_billed_tokens_total", kind="completion", model="test-model", tenant="team-a") == 7
    assert sample("portcullis_billed_requests_total", model="test-model", tenant="team-a") == 2
