"""Exact accounting under faults: a Redis outage leaves no slot held once Redis is back, a request the upstream failed
costs no tokens, a reservation covers what a request may really generate (the larger of max_tokens and
max_completion_tokens, times n), and spend is written where a restart reads it even after its file is moved away.

Token budgets are read from `x-ratelimit-remaining-tokens`: a fresh key answers `limit - reservation`, and a later
request shows what the earlier ones were charged. Token limits here run per week, so the refill over a test is far
below one token.

The module starts its fake upstreams once, and one gateway under the weekly token limit that the tests reading only
their own tenants' budgets share (each test its own tenants, fresh when it starts); a test that kills, freezes or
restarts something, configures the gateway otherwise or reads the spend ledger whole starts its own."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import time

import httpx
import pytest

from gateway.ratelimit.checks import Settlement, SlotCheck
from gateway.ratelimit.redis_backend import RedisBackend
from tests.conftest import ROOT, Launcher, Process, chat_body, free_port, policy_dir, pool

SMALL_TENANTS = ("small1", "small2", "small3")  # limited to 5,000 tokens a week by their overlays
SHARED_TENANTS = ("failed", "cut", "window", *(f"fresh{i}" for i in range(1, 6)), *SMALL_TENANTS)
KEYS = {f"sk-acct-{t}": t for t in ("t1", "t2", "t3", "t4", "t5", "t6", *SHARED_TENANTS)}
AUTH = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for k, t in KEYS.items()]}
CHAT = "/v1/chat/completions"
TOKENS = [{"id": "tenant-tokens", "key": ["tenant"], "tokens": {"limit": 100_000, "per": "7d"}}]
SMALL = [{"id": "tenant-tokens", "key": ["tenant"], "tokens": {"limit": 5000, "per": "7d"}}]
USED = 7 + 3  # what the fake upstream reports for a three-chunk answer


def post(gw, tenant: str, **fields) -> httpx.Response:
    return httpx.post(
        gw.url + CHAT, json=chat_body(**fields), headers={"authorization": f"Bearer sk-acct-{tenant}"}, timeout=30
    )


def remaining(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return int(response.headers["x-ratelimit-remaining-tokens"])


def settled() -> None:
    """Settlements run once the response has gone out: give them a moment before the next admission reads them."""
    time.sleep(0.3)


@pytest.fixture(scope="module")
def upstreams(module_launcher: Launcher) -> dict[str, Process]:
    """Fake upstreams for the module: one that serves, one that fails every request with 502, one for slow answers."""
    return {
        "good": module_launcher.fake_upstream("good"),
        "failing": module_launcher.fake_upstream("failing", fail_status=502),
        "slow": module_launcher.fake_upstream("slow"),
    }


def token_limited(upstreams: dict[str, Process], policies: str) -> dict:
    """A gateway under the weekly token limit: failing-model's pool answers 502, dead-model's is not listening,
    slow-model's gives up reading after 0.5 s, every other model is served."""
    return {
        "pools": [
            pool("failing", upstreams["failing"].url, models=["failing-model"]),
            pool("dead", f"http://127.0.0.1:{free_port()}", models=["dead-model"]),
            pool("slow", upstreams["slow"].url, models=["slow-model"], timeouts={"connect": 3, "read": 0.5}),
            pool("good", upstreams["good"].url),
        ],
        "auth": AUTH,
        "policy_dir": policies,
    }


@pytest.fixture(scope="module")
def shared(module_launcher: Launcher, upstreams: dict[str, Process], tmp_path_factory: pytest.TempPathFactory):
    """The module's gateway under the weekly token limit (100,000 tokens, 5,000 for SMALL_TENANTS), test-model's
    context window 4096 tokens; the tests that use it use tenants of their own (SHARED_TENANTS)."""
    overlays = {tenant: SMALL for tenant in SMALL_TENANTS}
    config = token_limited(upstreams, policy_dir(tmp_path_factory.mktemp("tokens"), TOKENS, overlays))
    return module_launcher.gateway({**config, "models": [{"name": "test-model", "context_window": 4096}]})


@pytest.fixture(scope="module")
def misbehaving(module_hostile_upstream) -> Process:
    """The module's hostile upstream: it counts nothing a test here reads."""
    return module_hostile_upstream()


def upstream_requests(upstream: Process) -> int:
    return httpx.get(upstream.url + "/_stats").json()["requests"]


def test_slots_held_in_redis_are_freed_within_seconds_of_it_coming_back(upstreams, gateway, tmp_path, redis_server):
    """Redis restarts from its snapshot while two streams hold the tenant's only slots; they end during the outage.
    Their releases must reach Redis once it is back, not wait for the slots' ten-minute lease."""
    upstream = upstreams["good"]
    rules = [{"id": "two-at-once", "key": ["tenant"], "concurrency": {"limit": 2}}]
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "auth": AUTH,
            "policy_dir": policy_dir(tmp_path, rules),
            "redis": {
                "url": redis_server.url,
                "timeout": 0.3,
                "on_failure": "fail_closed",
                "breaker_failures": 1,
                "breaker_cooldown": 0.5,
            },
        }
    )
    slow = chat_body(stream=True, fake={"chunks": 20, "delay": 0.1})
    client = httpx.Client(timeout=30)
    streams = [
        client.stream("POST", gw.url + CHAT, json=slow, headers={"authorization": "Bearer sk-acct-t1"})
        for _ in range(2)
    ]
    responses = [stream.__enter__() for stream in streams]
    assert [r.status_code for r in responses] == [200, 200]
    assert post(gw, "t1").status_code == 429  # both slots held, in Redis

    redis = redis_server.client()
    assert redis.save()  # the slots survive the restart, as with any persistent Redis
    redis_server.kill()
    for response, stream in zip(responses, streams):
        assert b"[DONE]" in response.read()  # the streams end while Redis is down: their releases cannot go
        stream.__exit__(None, None, None)
    client.close()
    time.sleep(1.0)
    redis_server.start()

    back = time.monotonic()
    statuses = []
    while time.monotonic() - back < 8:
        statuses.append(post(gw, "t1").status_code)  # 503 while the breaker is open, 429 while the slots are held
        if statuses[-1] == 200:
            break
        time.sleep(0.2)
    assert statuses[-1] == 200, f"still refused {time.monotonic() - back:.1f}s after Redis came back: {statuses}"
    settled()
    assert sum(redis.zcard(key) for key in redis.keys("portcullis:rl:*")) == 0
    assert "portcullis_ratelimit_settlements_pending 0.0" in gw.admin.get("/metrics").text


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_a_request_the_upstream_failed_costs_no_tokens(upstreams, gateway, tmp_path, request, store):
    """A 502 from the upstream, an upstream nobody answers at, and one that times out: no tokens charged. A served
    request is charged exactly what the upstream reported. In memory: the module's gateway, this test's tenant."""
    if store == "redis":
        redis = {"url": request.getfixturevalue("redis_server").url, "timeout": 5.0, "on_failure": "fail_closed"}
        gw = gateway({**token_limited(upstreams, policy_dir(tmp_path, TOKENS)), "redis": redis})
    else:
        gw = request.getfixturevalue("shared")

    before = remaining(post(gw, "failed", max_tokens=500))
    settled()
    assert post(gw, "failed", model="failing-model", max_tokens=5000).status_code == 502
    assert post(gw, "failed", model="dead-model", max_tokens=5000).status_code in (502, 503)
    assert post(gw, "failed", model="slow-model", max_tokens=5000, fake={"header_delay": 3}).status_code == 504
    settled()
    after = remaining(post(gw, "failed", max_tokens=500))
    assert before - after == USED  # the first request's usage; the failed ones cost nothing


def test_a_stream_that_ends_before_any_token_is_charged_its_prompt_only(shared):
    """Accepted (200) but cut before any output: the upstream read the prompt, generated nothing. Cut after output
    with no usage reported: the whole reservation stays charged, so hanging up early never skips the bill."""
    gw = shared
    first = remaining(post(gw, "cut", max_tokens=100))
    prompt = 100_000 - first - 100  # what the gateway counted for the prompt
    settled()
    reservation_left = remaining(post(gw, "cut", max_tokens=100))
    assert first - reservation_left == USED

    cut = post(gw, "cut", max_tokens=100, stream=True, fake={"chunks": 3, "abort_after": 0})
    assert cut.status_code == 200 and "error" in cut.text
    settled()
    after_cut = remaining(post(gw, "cut", max_tokens=100))
    assert reservation_left - after_cut == USED + prompt

    late = post(gw, "cut", max_tokens=100, stream=True, fake={"chunks": 3, "abort_after": 2, "delay": 0.1})
    assert late.status_code == 200 and "w1" in late.text
    settled()
    assert after_cut - remaining(post(gw, "cut", max_tokens=100)) == USED + prompt + 100


def test_reservations_cover_every_choice_and_the_larger_token_field(shared):
    """Fresh tenants answer `limit - reservation`: the difference between two of them is the difference between
    their reservations."""
    gw = shared
    single = remaining(post(gw, "fresh1", max_tokens=100))
    assert single - remaining(post(gw, "fresh2", max_tokens=100, n=4)) == 300
    # the upstream honours max_completion_tokens; another may honour max_tokens: the larger one is reserved
    assert single - remaining(post(gw, "fresh3", max_tokens=2000, max_completion_tokens=100)) == 1900
    assert single - remaining(post(gw, "fresh4", max_tokens=100, max_completion_tokens=2000)) == 1900
    # the policy's default max_tokens (1024) for each of n choices
    assert single - remaining(post(gw, "fresh5", n=3)) == 3 * 1024 - 100


def test_a_token_field_beyond_the_window_is_refused_even_when_the_other_fits(shared, upstreams):
    gw = shared
    served = upstream_requests(upstreams["good"])
    refused = post(gw, "window", max_completion_tokens=1, max_tokens=90_000)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert upstream_requests(upstreams["good"]) == served


def test_n_is_bounded_and_multiplies_what_a_token_limit_admits(shared, upstreams):
    """Tenants whose overlay limits them to 5,000 tokens a week."""
    gw, upstream = shared, upstreams["good"]
    served = upstream_requests(upstream)
    too_many = post(gw, "small1", n=50, max_tokens=10)
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "n" and too_many.json()["error"]["code"] == "integer_above_max_value"
    assert post(gw, "small2", n=1, max_tokens=1000).status_code == 200
    refused = post(gw, "small3", n=8, max_tokens=1000)  # 8000 tokens it may generate: more than the whole budget
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
    assert upstream_requests(upstream) - served == 1


def test_settlements_kept_during_an_outage_are_bounded_and_delivered_oldest_first(redis_server):
    """At the cap the oldest kept settlement is dropped; the rest reach Redis once it is back."""
    key = "portcullis:rl:{slots:acct}"
    held = [SlotCheck(key, 10, 600, f"r{i}") for i in range(5)]

    async def main() -> dict:
        backend = RedisBackend(redis_server.url, timeout=0.5, max_pending_settlements=3)
        assert all(o[0].allowed for o in await asyncio.gather(*(backend.acquire([slot]) for slot in held)))
        redis_server.client().save()
        redis_server.kill()
        for slot in held:
            backend.settle(Settlement(releases=(slot,)))
            await asyncio.sleep(0.05)
        redis_server.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(backend.settlements):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        dropped = dict(backend.settlements.dropped)
        await backend.aclose()
        return dropped

    assert asyncio.run(main()) == {"outbox_full": 2}
    assert sorted(redis_server.client().zrange(key, 0, -1)) == [b"r0", b"r1"]


def test_a_count_no_request_can_reach_is_not_charged_and_spend_keeps_being_written(misbehaving, gateway):
    """An upstream reports 2^64 - 1 prompt tokens (valid JSON; no context window comes near it). The request is
    charged the prompt the gateway counted, and the spend ledger, whose store holds 64-bit integers, keeps writing
    every tenant's spend instead of failing each flush on that one row."""
    upstream = misbehaving
    gw = gateway({"pools": [pool("main", upstream.url, max_attempts=1)], "auth": AUTH})
    answer = {
        "id": "cmpl-hostile",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 2**64 - 1, "completion_tokens": 1},
    }
    hostile = {"behaviour": "garbage", "status": 200, "body": json.dumps(answer), "content_type": "application/json"}
    assert post(gw, "t1", hostile=hostile).status_code == 200
    assert post(gw, "t2").status_code == 200
    settled()
    report = gw.admin.get("/admin/spend", params={"group_by": "tenant"}, timeout=10).json()["data"]
    rows = {row["tenant"]: row for row in report}
    assert set(rows) == {"t1", "t2"} and rows["t1"]["requests"] == 1, report
    assert 0 < rows["t1"]["prompt_tokens"] < 100 and rows["t1"]["completion_tokens"] == 1
    assert "spend ledger" not in gw.output()


def test_a_count_that_is_not_a_number_settles_a_fair_queue_like_an_unreported_one(misbehaving, gateway):
    """A pool with KV-budget admission charges its fair queue the output a request really generated, as the upstream
    reported it; a report of "3" (a string) is no count, so nothing fails to settle."""
    upstream = misbehaving
    gw = gateway({"pools": [pool("main", upstream.url, max_attempts=1, admission={"enabled": True})], "auth": AUTH})
    answer = {
        "id": "cmpl-hostile",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": "3"},
    }
    hostile = {"behaviour": "garbage", "status": 200, "body": json.dumps(answer), "content_type": "application/json"}
    assert post(gw, "t1", hostile=hostile).status_code == 200
    assert post(gw, "t1").status_code == 200
    settled()
    assert "failed to settle" not in gw.output()


FAULT = '''"""Injected into the gateway: an answer event carrying `portcullis_fault` raises, as a defect would."""
from gateway.apis import answers

_record = answers.AnswerFormat.record


def record(self, usage, body):
    if "portcullis_fault" in body:
        raise RuntimeError("injected fault")
    return _record(self, usage, body)


answers.AnswerFormat.record = record
'''


def test_a_defect_mid_stream_ends_it_in_the_routes_shape_and_the_request_is_still_settled(
    misbehaving, gateway, tmp_path
):
    """A defect of the gateway's own while it relays a stream (injected: no known input causes one; this guards the
    net under them): the client hears the stream end with an error event, and the request is still logged, billed
    and its concurrency slot freed, as on every other exit path."""
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    upstream = misbehaving
    rules = [{"id": "one-at-once", "key": ["tenant"], "concurrency": {"limit": 1}}]
    config = {"pools": [pool("main", upstream.url, max_attempts=1)], "auth": AUTH}
    gw = gateway(
        {**config, "policy_dir": policy_dir(tmp_path, rules)},
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )
    events = [
        {"choices": [{"index": 0, "delta": {"content": "w0"}}]},
        {"choices": [], "portcullis_fault": True},
    ]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    hostile = {"behaviour": "garbage", "status": 200, "body": body, "content_type": "text/event-stream"}
    streamed = post(gw, "t1", stream=True, hostile=hostile)
    assert streamed.status_code == 200
    data = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "internal_error", streamed.text
    assert gw.access_log(streamed.headers["x-request-id"])["stream_error"] == "internal_error"
    assert "injected fault" in gw.output()  # logged with its traceback
    assert post(gw, "t1").status_code == 200  # the tenant's one slot was given back
    settled()
    report = gw.admin.get("/admin/spend", params={"group_by": "tenant"}, timeout=10).json()["data"]
    assert [(row["tenant"], row["requests"]) for row in report] == [("t1", 2)], report


def test_spend_written_after_its_file_is_moved_away_lands_where_a_restart_reads_it(upstreams, gateway, tmp_path):
    """The SQLite file is renamed while the gateway serves: the gateway says so and writes from then on to a new file
    at the configured path, the one a restart opens, not to the file it no longer names."""
    path = tmp_path / "spend.db"
    gw = gateway({"pools": [pool("main", upstreams["good"].url)], "auth": AUTH, "store": {"sqlite_path": str(path)}})
    assert post(gw, "t1").status_code == 200
    assert spend_at(path, "t1") == 1  # flushed to the file the gateway opened
    path.rename(tmp_path / "moved.db")
    for _ in range(3):
        assert post(gw, "t2").status_code == 200
    assert spend_at(path, "t2") == 3
    with contextlib.closing(sqlite3.connect(path)) as db:  # the old file's WAL was not read into the new one
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    moved = [line for line in gw.output().splitlines() if "was moved or deleted while open" in line]
    assert 1 <= len(moved) <= 2, moved  # once by each store that had the file open (keys, spend), not per flush


def spend_at(path, tenant: str) -> int | None:
    """Requests the SQLite file at `path` counts for `tenant`, once a flush has written them (None if it never
    does); a path with no file is not opened, so the test creates none."""
    deadline = time.monotonic() + 10
    found = None
    while found is None and time.monotonic() < deadline:
        time.sleep(0.2)
        if path.exists():
            with contextlib.closing(sqlite3.connect(path, timeout=5)) as db:
                with contextlib.suppress(sqlite3.OperationalError):  # no spend table yet
                    found = db.execute("SELECT SUM(requests) FROM spend WHERE tenant = ?", (tenant,)).fetchone()[0]
    return found


def test_a_stream_the_shutdown_cuts_is_still_billed(upstreams, gateway, tmp_path):
    """SIGTERM while a stream runs longer than the graceful-shutdown wait: the server cancels the request. Its
    upstream read the prompt and sent output, so it is billed (written to the spend ledger a restart reads budgets
    back from) and logged, as on every other exit path."""
    path = tmp_path / "spend.db"
    gw = gateway({"pools": [pool("main", upstreams["good"].url)], "auth": AUTH, "store": {"sqlite_path": str(path)}})
    body = chat_body(stream=True, max_tokens=100, fake={"chunks": 60, "delay": 0.5})
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", gw.url + CHAT, json=body, headers={"authorization": "Bearer sk-acct-t1"}) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            lines = r.iter_lines()
            assert any(line.startswith("data: ") for line in lines)  # output reached the client
            gw.proc.terminate()
            with contextlib.suppress(httpx.HTTPError):
                for _ in lines:  # the rest, until the shutdown cuts it (after its 10 s of grace)
                    pass
    gw.proc.wait(timeout=30)  # (uvicorn ends on the signal it caught, once shut down)
    assert spend_at(path, "t1") == 1, gw.output()[-3000:]
    assert gw.access_log(request_id)["status"] == 200


def test_spend_a_frozen_redis_applies_after_its_flush_gave_up_is_counted_once(upstreams, gateway, redis_server):
    """Redis freezes (SIGSTOP) while the ledger flushes: the flush times out after sending its whole transaction on
    the connection it already had, and Redis runs it once it wakes. The rows the gateway kept for the next flush
    must not be added a second time."""
    upstream = upstreams["good"]
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "auth": AUTH,
            "redis": {"url": redis_server.url, "timeout": 0.3},
            "store": {"backend": "redis", "flush_interval": 0.2},
        }
    )
    assert post(gw, "t1").status_code == 200
    time.sleep(0.6)  # written: the ledger holds a connection to Redis
    assert redis_server.proc is not None
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        assert [post(gw, "t1").status_code for _ in range(3)] == [200] * 3
        time.sleep(1.5)  # several flushes give up on it, each sent whole
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    time.sleep(1.5)  # Redis runs what it was sent; the next flush writes what the gateway kept
    redis = redis_server.client()
    written = [redis.hgetall(key) for key in redis.keys("portcullis:spend:*")]
    requests = sum(int(v) for fields in written for f, v in fields.items() if f.endswith(b"\x1frequests"))
    assert requests == 4
