"""Fallbacks across pools, end to end: the real gateway in front of real upstream processes (tests/fake_upstream.py)
that fail the ways upstreams fail: 429, 503, too slow, down, too long a prompt, a stream broken after its start.

Each upstream is started once for the module and shared by the tests that ask for it, which count what it saw as a
change over the test. A pool that failed cools down for its model (30 s by default) in the gateway that saw it fail,
so every test whose primary fails has a gateway of its own; the tests whose primary serves share one.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import openai
import pytest

from tests.conftest import ROOT, Launcher, Process, chat_body, free_port, pool
from tests.integration.test_tracing import http_receiver  # noqa: F401  (a fixture: the in-test OTLP receiver)

PRIMARY, BACKUP = "big-model", "backup-model"


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher):
    """A fake upstream broken as asked: upstream(name, "--fail-status", "429"); started the first time a test of the
    module asks for that name and those flags, the same process after."""
    started: dict[tuple[str, ...], Process] = {}

    def start(name: str, *flags: str) -> Process:
        if (name, *flags) not in started:
            started[(name, *flags)] = module_launcher.spawn(
                lambda port: [
                    sys.executable,
                    str(ROOT / "tests" / "fake_upstream.py"),
                    *("--port", str(port), "--name", name, *flags),
                ],
                f"upstream-{name}",
                ready_path="/_stats",
            )
        return started[(name, *flags)]

    return start


def requests_seen(process: Process) -> int:
    return httpx.get(process.url + "/_stats").json()["requests"]


class Seen:
    """Requests each of these upstreams has seen since this was made: what this test sent them."""

    def __init__(self, *upstreams: Process) -> None:
        self.before = {p.url: requests_seen(p) for p in upstreams}

    def __call__(self, *upstreams: Process) -> tuple[int, ...] | int:
        seen = tuple(requests_seen(p) - self.before[p.url] for p in upstreams)
        return seen[0] if len(seen) == 1 else seen


@pytest.fixture(scope="module")
def serving(module_launcher: Launcher, upstream) -> tuple[Process, Process, Process]:
    """A gateway whose primary serves (no fallback is taken, nothing cools): (gateway, primary, backup)."""
    primary, backup = upstream("primary"), upstream("backup")
    return module_launcher.gateway(config([primary.url], backup.url)), primary, backup


def config(primary_urls: list[str], backup_url: str, **fallback) -> dict:
    """Two pools, one model each; the primary model falls back to the backup model."""
    return {
        "pools": [
            pool("primary", *primary_urls, models=[PRIMARY], timeouts={"read": 1.0, "connect": 1.0}),
            pool("backup", backup_url, models=[BACKUP]),
        ],
        "models": [{"name": PRIMARY}, {"name": BACKUP}],
        "fallbacks": [{"model": PRIMARY, "to": [{"model": BACKUP}], **fallback}],
    }


def chat(gw: Process, **extra) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json=chat_body(model=PRIMARY, **extra), timeout=20)


def metric(gw: Process, trigger: str) -> float:
    wanted = f'portcullis_fallbacks_total{{model="{PRIMARY}",to="{BACKUP}",trigger="{trigger}"}}'
    for line in gw.admin.get("/metrics").text.splitlines():
        if line.startswith(wanted):
            return float(line.split()[-1])
    return 0.0


def test_a_429_from_the_primary_is_served_by_the_fallback_model_through_the_openai_client(upstream, gateway):
    primary, backup = upstream("primary", "--fail-status", "429"), upstream("backup")
    seen = Seen(primary, backup)
    gw = gateway(config([primary.url], backup.url))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=PRIMARY, messages=[{"role": "user", "content": "hello"}]
    )
    completion = raw.parse()
    assert raw.headers["x-portcullis-model"] == BACKUP
    assert completion.model == BACKUP  # the backup was sent the backup model's name, not the one asked for
    assert completion.choices[0].message.content == "w0 w1 w2 "
    assert seen(primary, backup) == (1, 1)
    assert metric(gw, "429") == 1
    logged = gw.access_log(raw.headers["x-request-id"])
    assert (logged["model"], logged["fallback_from"], logged["pool"]) == (BACKUP, PRIMARY, "backup")


def test_each_attempt_is_one_span_and_the_fallback_says_its_step_model_and_pool(
    upstream,
    gateway,
    http_receiver,  # noqa: F811
):
    endpoint, received = http_receiver
    primary, backup = upstream("primary", "--fail-status", "503"), upstream("backup")
    traced = {"telemetry": {"otlp": {"enabled": True, "endpoint": endpoint, "protocol": "http/protobuf"}}}
    gw = gateway({**config([primary.url], backup.url), **traced})
    assert chat(gw).status_code == 200
    spans = received.wait_for(f"chat {BACKUP}")
    attempts = [s for s in spans if s["kind"] == 3]  # SPAN_KIND_CLIENT
    assert [(s["name"], s["attributes"]["portcullis.pool"]) for s in attempts] == [
        (f"chat {PRIMARY}", "primary"),
        (f"chat {BACKUP}", "backup"),
    ]
    first, fallback = (a["attributes"] for a in attempts)
    assert "portcullis.fallback.step" not in first
    assert (fallback["portcullis.fallback.step"], fallback["portcullis.fallback.from"]) == (1, PRIMARY)
    assert fallback["gen_ai.request.model"] == BACKUP


def test_an_answer_without_fallback_names_its_own_model(serving):
    gw, primary, backup = serving
    seen = Seen(primary, backup)
    response = chat(gw)
    assert response.status_code == 200
    assert response.headers["x-portcullis-model"] == PRIMARY
    assert seen(primary, backup) == (1, 0)
    assert gw.access_log(response.headers["x-request-id"])["fallback_from"] is None


def test_a_503_on_every_primary_replica_falls_back_once_the_retries_are_spent(upstream, gateway):
    first, second = upstream("p1", "--fail-status", "503"), upstream("p2", "--fail-status", "503")
    backup = upstream("backup")
    seen = Seen(first, second, backup)
    gw = gateway(config([first.url, second.url], backup.url))
    response = chat(gw)
    assert response.status_code == 200, response.text
    assert response.headers["x-portcullis-model"] == BACKUP
    assert seen(first, second, backup) == (1, 1, 1)
    assert metric(gw, "5xx") == 1


def test_a_primary_slower_than_its_read_timeout_falls_back(upstream, gateway):
    primary, backup = upstream("primary", "--slow", "5"), upstream("backup")
    gw = gateway(config([primary.url], backup.url))
    started = time.monotonic()
    response = chat(gw)
    assert response.status_code == 200, response.text
    assert response.headers["x-portcullis-model"] == BACKUP
    assert time.monotonic() - started < 4  # the read timeout (1 s) gave up on it, not the upstream's answer
    assert metric(gw, "timeout") == 1


def test_a_primary_nothing_listens_for_falls_back(upstream, gateway):
    backup = upstream("backup")
    gw = gateway(config([f"http://127.0.0.1:{free_port()}"], backup.url))
    response = chat(gw)
    assert response.status_code == 200, response.text
    assert response.headers["x-portcullis-model"] == BACKUP
    assert metric(gw, "connection_error") == 1


def test_a_trigger_the_model_does_not_list_is_answered_as_it_failed(upstream, gateway):
    primary, backup = upstream("primary", "--fail-status", "429"), upstream("backup")
    seen = Seen(backup)
    gw = gateway(config([primary.url], backup.url, on=["5xx"]))
    response = chat(gw)
    assert response.status_code == 429
    assert response.json()["error"]["message"] == "primary forced failure"
    assert seen(backup) == 0


def test_a_stream_broken_after_its_first_byte_ends_with_its_error_event_and_no_fallback(serving):
    gw, primary, backup = serving
    seen = Seen(backup)
    body = chat_body(model=PRIMARY, stream=True, fake={"chunks": 5, "abort_after": 2})
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=20) as response:
        assert response.status_code == 200
        assert response.headers["x-portcullis-model"] == PRIMARY
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:2]] == ["w0 ", "w1 "]
    assert "error" in json.loads(events[-2]) and events[-1] == "[DONE]"
    assert seen(backup) == 0


def test_a_stream_whose_primary_fails_before_its_start_is_served_by_the_fallback_without_a_usage_chunk(
    upstream, gateway
):
    primary, backup = upstream("primary", "--fail-status", "503"), upstream("backup")
    gw = gateway(config([primary.url], backup.url))
    body = chat_body(model=PRIMARY, stream=True)
    with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=20) as response:
        assert response.status_code == 200
        assert response.headers["x-portcullis-model"] == BACKUP
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "w0 w1 w2 "
    # the gateway asked both pools for usage; the client, which did not, gets no usage chunk from either
    assert all(c["choices"] for c in chunks)
    assert httpx.get(backup.url + "/_stats").json()["last_body"]["stream_options"] == {"include_usage": True}


def test_a_failed_pool_cools_down_for_the_model_then_is_tried_again(upstream, gateway):
    primary, backup = upstream("primary", "--fail-status", "503"), upstream("backup")
    seen = Seen(primary, backup)
    gw = gateway(config([primary.url], backup.url, cooldown=1.0))
    assert chat(gw).headers["x-portcullis-model"] == BACKUP
    assert seen(primary) == 1
    cooled = chat(gw)  # straight to the fallback: the primary is not asked while it cools
    assert cooled.headers["x-portcullis-model"] == BACKUP
    assert seen(primary, backup) == (1, 2)
    assert metric(gw, "cooldown") == 1
    time.sleep(1.2)
    assert chat(gw).headers["x-portcullis-model"] == BACKUP
    assert seen(primary) == 2  # cooled off: tried again first


def test_a_pool_target_keeps_the_model(upstream, gateway):
    primary, other = upstream("primary", "--fail-status", "502"), upstream("other")
    gw = gateway(
        {
            "pools": [pool("primary", primary.url, models=[PRIMARY]), pool("other", other.url, models=[PRIMARY])],
            "models": [{"name": PRIMARY}],
            "fallbacks": [{"model": PRIMARY, "to": [{"pool": "other"}]}],
        }
    )
    response = chat(gw)
    assert response.status_code == 200, response.text
    assert response.headers["x-portcullis-model"] == PRIMARY
    assert httpx.get(other.url + "/_stats").json()["last_body"]["model"] == PRIMARY
    assert gw.access_log(response.headers["x-request-id"])["pool"] == "other"


def test_an_upstream_context_length_error_goes_to_the_larger_model(upstream, gateway):
    primary = upstream("primary", "--fail-status", "400", "--fail-code", "context_length_exceeded")
    backup = upstream("backup")
    seen = Seen(primary)
    gw = gateway(config([primary.url], backup.url))
    response = chat(gw)
    assert response.status_code == 200, response.text
    assert response.headers["x-portcullis-model"] == BACKUP
    assert metric(gw, "context_length_exceeded") == 1
    # nothing cools: it was the request's length, not the pool
    assert chat(gw).status_code == 200 and seen(primary) == 2


def test_another_upstream_400_is_the_clients_and_falls_back_nowhere(upstream, gateway):
    primary = upstream("primary", "--fail-status", "400", "--fail-code", "invalid_value")
    backup = upstream("backup")
    seen = Seen(backup)
    gw = gateway(config([primary.url], backup.url))
    response = chat(gw)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_value"
    assert seen(backup) == 0


def test_a_prompt_too_long_for_the_models_window_goes_straight_to_a_model_whose_window_fits(upstream, gateway):
    small, large = upstream("small"), upstream("large")
    seen = Seen(small, large)
    gw = gateway(
        {
            "pools": [
                pool("small", small.url, models=["small-model"]),
                pool("large", large.url, models=["large-model"]),
            ],
            "models": [{"name": "small-model", "context_window": 256}, {"name": "large-model", "context_window": 8192}],
            "fallbacks": [{"model": "small-model", "to": [{"model": "large-model"}]}],
        }
    )
    long_prompt = [{"role": "user", "content": "word " * 400}]
    response = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "small-model", "messages": long_prompt, "max_tokens": 50},
        timeout=20,
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-portcullis-model"] == "large-model"
    assert seen(small) == 0  # the gateway knew: the small model was never asked
    assert httpx.get(large.url + "/_stats").json()["last_body"]["model"] == "large-model"
    # a prompt too long for every window is still refused, as the requested model's
    refused = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": "small-model", "messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 50},
        timeout=20,
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert seen(large) == 1
