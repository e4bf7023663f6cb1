"""Liveness under abuse: while hostile clients push big pre-auth bodies, huge prompts and slowloris connections, the
gateway keeps answering /healthz promptly and keeps serving a normal authenticated client.

The bounds are generous sanity checks (the figures measured on a quiet machine are in docs/benchmarks.md); what
fails this test is the event loop stalling for a big body, or connections starving the listener.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import chat_body, pool
from tests.hostile.raw_http import connect, send_ignoring_reset

pytestmark = pytest.mark.eval

KEY = "sk-liveness-test"
AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"  # counted with the bundled tokenizer, exactly, as a real deployment would
LOAD_SECONDS = 12.0


def big_pre_auth_body() -> bytes:
    """~3 MB of 100k short messages, sent without a key: everything the gateway does before auth."""
    messages = [{"role": "user", "content": f"m{i}"} for i in range(100_000)]
    return json.dumps({"model": MODEL, "messages": messages}).encode()


def huge_prompt_body() -> bytes:
    """A ~4 MB prompt with a valid key, in four messages within the string limit: parse, WAF and the tokenizer
    all see every byte before the context window refuses it."""
    words = " ".join(f"word{i % 997}" for i in range(100_000))[:950_000]
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": words}] * 4}).encode()


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_healthz_and_normal_requests_stay_fast_under_abuse(fake_upstream, gateway):
    gw = gateway(
        {
            "pools": [pool("main", fake_upstream().url)],
            "models": [{"name": MODEL, "tokenizer": "bundled", "context_window": 8192}],
            "auth": {"keys": [{"tenant": "team-a", "key_env": "LIVENESS_KEY"}]},
        },
        env={"LIVENESS_KEY": KEY},
    )
    normal = chat_body(model=MODEL, max_tokens=8)
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        for _ in range(3):
            client.post("/v1/chat/completions", json=normal, headers=AUTH)  # warm up
        quiet = [_timed(lambda: client.post("/v1/chat/completions", json=normal, headers=AUTH)) for _ in range(10)]

    # The hostile clients run in a process of their own: their threads must not hold this one's GIL while it times.
    context = multiprocessing.get_context("spawn")
    stop, statuses = context.Event(), context.Queue()
    hostile = context.Process(target=_hostile_clients, args=(gw.url, stop, statuses))
    hostile.start()
    health: list[float] = []
    loaded: list[float] = []
    try:
        time.sleep(3.0)  # let the floods reach the gateway
        with httpx.Client(base_url=gw.url, timeout=30) as client:
            deadline = time.monotonic() + LOAD_SECONDS
            while time.monotonic() < deadline:
                health.append(_timed(lambda: _ok(client.get("/healthz"))))
                if len(health) % 10 == 0:
                    loaded.append(_timed(lambda: _ok(client.post("/v1/chat/completions", json=normal, headers=AUTH))))
                time.sleep(0.02)
    finally:
        stop.set()
        hostile.join(timeout=60)
    statuses = statuses.get(timeout=10)
    assert statuses, "the hostile bodies never got an answer"
    assert not [s for s in statuses if s >= 500], f"hostile bodies got server errors: {sorted(set(statuses))}"
    assert loaded, "no normal request was answered while the abuse ran"
    p99 = percentile(health, 0.99)
    added = statistics.median(loaded) - statistics.median(quiet)
    print(
        f"\nliveness: /healthz n={len(health)} p50={percentile(health, 0.5) * 1000:.1f} ms "
        f"p99={p99 * 1000:.1f} ms; normal request p50 quiet={statistics.median(quiet) * 1000:.1f} ms "
        f"loaded={statistics.median(loaded) * 1000:.1f} ms (n={len(loaded)}); hostile answers={len(statuses)}"
    )
    # alone on this 2-core VM p99 is 16-35 ms; amid the whole suite (an engine test spinning on the other core) it
    # has reached 157 ms: a stall for a big body is seconds
    assert p99 < 0.300, f"/healthz p99 {p99 * 1000:.0f} ms under abuse"
    assert added < 0.100, f"a normal request took {added * 1000:.0f} ms longer under abuse"


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _ok(response: httpx.Response) -> None:
    assert response.status_code == 200, response.text


def _hostile_clients(url: str, stop: threading.Event, answers) -> None:
    """8 floods of 3 MB pre-auth bodies, 4 of 4 MB prompts, 60 slowloris connections; reports the statuses seen."""
    statuses: list[int] = []
    pre_auth, prompt = big_pre_auth_body(), huge_prompt_body()
    threads = [threading.Thread(target=_flood, args=(url, pre_auth, {}, stop, statuses)) for _ in range(8)]
    threads += [threading.Thread(target=_flood, args=(url, prompt, AUTH, stop, statuses)) for _ in range(4)]
    threads += [threading.Thread(target=_slowloris, args=(url, stop)) for _ in range(60)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answers.put(statuses)


def _flood(url: str, body: bytes, headers: dict, stop: threading.Event, statuses: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            try:
                statuses.append(
                    client.post(
                        "/v1/chat/completions", content=body, headers={**headers, "content-type": "application/json"}
                    ).status_code
                )
            except httpx.HTTPError:
                statuses.append(0)


def _slowloris(url: str, stop: threading.Event) -> None:
    """A request head that never completes, a byte a second; reconnects when the gateway cuts it off."""
    while not stop.is_set():
        sock = connect(url)
        alive = send_ignoring_reset(sock, b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n")
        while alive and not stop.wait(1.0):
            alive = send_ignoring_reset(sock, b"x")
        sock.close()


def test_the_body_checking_workers_never_outlive_the_gateway(fake_upstream, gateway):
    """The gateway's worker processes leave with it, even when it is killed before it can stop them."""
    gw = gateway({"pools": [pool("main", fake_upstream().url)]})
    deadline = time.monotonic() + 30
    while not (workers := _children(gw.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workers, "no worker process found"
    gw.proc.kill()
    gw.proc.wait()
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in workers if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive, f"worker processes {alive} outlived the gateway"


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
