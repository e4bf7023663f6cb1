"""portcullis bench: the runner against an in-process mock target (multi-turn history, keys, concurrency, failures,
max duration, arrival times, oracle vs measured hit rate)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest

from gateway.bench.runner import BenchConfig, run_benchmark_async
from gateway.bench.workload import build_plan


class Target:
    """A mock OpenAI chat endpoint: replies "reply-N" in 3 chunks after `delay` s; records what it saw."""

    def __init__(self, delay: float = 0.01, fail_every: int = 0, hang_every: int = 0) -> None:
        self.delay, self.fail_every, self.hang_every = delay, fail_every, hang_every
        self.requests: list[dict] = []  # body, headers, received, finished, reply
        self.in_flight = self.max_in_flight = 0
        self.resets: list[tuple[str, int]] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/reset_prefix_cache":
            self.resets.append((str(request.url), len(self.requests)))
            return httpx.Response(200 if request.url.host == "engine-a" else 404)
        n = len(self.requests)
        entry = {
            "body": json.loads(request.content),
            "headers": dict(request.headers),
            "received": time.perf_counter(),
            "finished": None,
            "reply": f"reply-{n} ",
        }
        self.requests.append(entry)
        if self.fail_every and n % self.fail_every == self.fail_every - 1:
            return httpx.Response(500, json={"error": {"message": f"boom {n}"}})
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream", "x-portcullis-replica": f"r{n % 2}"},
            content=self.stream(n, entry),
        )

    async def stream(self, n: int, entry: dict):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(60 if self.hang_every and n % self.hang_every == 0 else self.delay)
            for piece in ("reply-", f"{n}", " "):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': piece}}]})}\n\n".encode()
                await asyncio.sleep(0.001)
            usage = {"prompt_tokens": 100, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 25}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
        except BaseException:
            self.in_flight -= 1
            raise
        # done before the last event: a client stops reading at [DONE], so code after it may run late
        entry["finished"] = time.perf_counter()
        self.in_flight -= 1
        yield b"data: [DONE]\n\n"


def bench(target: Target, **kw) -> dict:
    config = BenchConfig(**{"base_url": "http://target", "model": "m", "output_len": 3, **kw})
    return asyncio.run(run_benchmark_async(config, transport=httpx.MockTransport(target.handle)))


def test_multi_turn_history_carries_the_replies_and_turns_run_in_order():
    target = Target(delay=0.02)
    config = dict(
        workload="shared-prefix",
        tenants=3,
        system_prompt_len=30,
        conversations=3,
        turns=3,
        user_len=5,
        concurrency=8,
        api_keys=("k0", "k1"),
        seed=5,
    )
    result = bench(target, **config)
    assert result["completed"] == 9 and result["failed"] == 0 and len(target.requests) == 9
    plan = build_plan(BenchConfig(**config).workload_spec())
    tenant_of = {p.system: p.tenant for p in plan}
    reply_to = {}  # the last user message -> the reply the target gave
    for entry in sorted(target.requests, key=lambda e: e["received"]):
        messages = entry["body"]["messages"]
        assert entry["body"]["stream"] is True and entry["body"]["stream_options"] == {"include_usage": True}
        assert entry["body"]["max_tokens"] == 3 and entry["body"]["temperature"] == 0.0
        assert messages[0]["role"] == "system"
        tenant = tenant_of[messages[0]["content"]]
        assert entry["headers"]["authorization"] == f"Bearer k{tenant % 2}"
        for i in range(1, len(messages) - 1, 2):  # every earlier turn, answered with what the target returned
            user, assistant = messages[i], messages[i + 1]
            assert assistant == {"role": "assistant", "content": reply_to[user["content"]]["reply"]}
            assert reply_to[user["content"]]["finished"] <= entry["received"]  # sent after that turn ended
        reply_to[messages[-1]["content"]] = entry
    assert max(len(e["body"]["messages"]) for e in target.requests) == 1 + 2 * 3 - 1
    assert result["replica_share"] == {"r0": {"requests": 5, "share": 5 / 9}, "r1": {"requests": 4, "share": 4 / 9}}
    assert result["prefix_cache"]["measured_hit_rate"] == pytest.approx(0.25)
    assert result["prefix_cache"]["oracle_hit_rate"] is None  # no tokenizer given
    assert len(result["requests"]) == 9 and result["ttft_ms"]["p50"] >= 20


def test_concurrency_caps_requests_in_flight():
    target = Target(delay=0.05)
    result = bench(target, workload="random", num_requests=12, input_len=8, concurrency=3)
    assert result["completed"] == 12
    assert target.max_in_flight == 3


def test_failures_are_counted_and_the_run_goes_on():
    target = Target(fail_every=3)
    result = bench(target, workload="random", num_requests=9, input_len=8, concurrency=1)
    assert (result["completed"], result["failed"], result["cancelled"]) == (6, 3, 0)
    assert result["errors"] == {"HTTP 500: boom 2": 1, "HTTP 500: boom 5": 1, "HTTP 500: boom 8": 1}
    assert sum(not row["success"] for row in result["requests"]) == 3


def test_max_duration_cancels_what_is_in_flight_and_stops_dispatching():
    target = Target(delay=0.01, hang_every=4)  # requests 0, 4, 8, ... never finish on their own
    start = time.perf_counter()
    result = bench(target, workload="random", num_requests=1000, input_len=8, concurrency=4, max_duration_s=0.6)
    assert time.perf_counter() - start < 5
    assert result["cancelled"] >= 1 and result["completed"] >= 1
    assert result["plan"]["num_requests"] == 1000 and result["plan"]["sent"] < 1000
    assert result["duration_s"] == pytest.approx(0.6, abs=0.3)


def test_request_rate_follows_the_planned_arrival_times():
    target = Target(delay=0.001)
    config = dict(workload="random", num_requests=10, input_len=8, request_rate=25.0, concurrency=None, seed=3)
    result = bench(target, **config)
    arrivals = [p.arrival_s for p in build_plan(BenchConfig(**config).workload_spec())]
    starts = [row["start_s"] for row in result["requests"]]
    assert all(a - 0.005 <= s <= a + 0.1 for a, s in zip(arrivals, starts))
    assert result["duration_s"] >= arrivals[-1]


def test_prefix_caches_are_reset_before_the_first_request():
    target = Target()
    result = bench(
        target,
        workload="random",
        num_requests=2,
        input_len=8,
        reset_prefix_cache=("http://engine-a:8000", "http://engine-b:8000/v1"),
    )
    assert target.resets == [
        ("http://engine-a:8000/reset_prefix_cache", 0),
        ("http://engine-b:8000/reset_prefix_cache", 0),
    ]
    assert result["reset_prefix_cache"] == {"http://engine-a:8000": "ok", "http://engine-b:8000/v1": "HTTP 404: "}
    assert result["completed"] == 2
    assert bench(Target(), workload="random", num_requests=1, input_len=8)["reset_prefix_cache"] is None


def test_bench_config_validation():
    with pytest.raises(ValueError):
        BenchConfig(concurrency=None, request_rate=None)
    with pytest.raises(ValueError):
        BenchConfig(concurrency=0)
    assert dataclasses.replace(BenchConfig(), name="x").name == "x"
