"""Rate-limit decision cost: latency of one decision (admit + settle) and decisions/s, memory vs Redis backends.

    .venv/bin/python -m bench.ratelimit_bench [--iterations 20000] [--concurrency 64]

Each decision checks three limits at once, as a typical policy would (requests per minute per key, tokens per
minute per tenant, concurrency per tenant), then settles them as the end of a response does. The Redis backend
runs against a real redis-server started here on a free loopback port. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import tempfile
import time

from opentelemetry import trace
from starlette.requests import Request

from gateway.context import Demand, RequestContext, Usage
from gateway.observability.telemetry import Metrics
from gateway.policy.model import RateLimitRule
from gateway.ratelimit.failover import CircuitBreaker, FailoverBackend
from gateway.ratelimit.limiter import RateLimiter
from gateway.ratelimit.memory import MemoryBackend
from gateway.ratelimit.redis_backend import RedisBackend

RULES = [
    RateLimitRule(id="key-rpm", key=["api_key"], requests={"limit": 10**9, "per": 60}),
    RateLimitRule(id="tenant-tpm", key=["tenant"], tokens={"limit": 10**12, "per": 60}),
    RateLimitRule(id="tenant-slots", key=["tenant"], concurrency={"limit": 10**6}),
]
SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}


def context(i: int) -> RequestContext:
    ctx = RequestContext(request=Request(SCOPE), route="chat", span=trace.INVALID_SPAN, client_ip="127.0.0.1")
    ctx.tenant, ctx.key_id, ctx.model = f"tenant-{i % 8}", f"key{i % 32}", "m"
    ctx.payload = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 128}
    ctx.usage = Usage(prompt_tokens=90, completion_tokens=64)
    return ctx


async def decide(limiter: RateLimiter, i: int) -> float:
    ctx = context(i)
    started = time.perf_counter()
    grant = await limiter.admit(ctx, Demand(ctx.model, 0, None, 0), RULES)
    limiter.settle(grant, ctx)
    return time.perf_counter() - started


async def measure(limiter: RateLimiter, iterations: int, concurrency: int) -> dict:
    for i in range(200):  # warm up: scripts loaded, connections open
        await decide(limiter, i)
    latencies = sorted([await decide(limiter, i) for i in range(iterations)])
    started = time.perf_counter()
    per_task = iterations // concurrency

    async def worker(w: int) -> None:
        for i in range(per_task):
            await decide(limiter, w * per_task + i)

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "p50_us": round(latencies[len(latencies) // 2] * 1e6, 1),
        "p99_us": round(latencies[int(len(latencies) * 0.99)] * 1e6, 1),
        "mean_us": round(statistics.fmean(latencies) * 1e6, 1),
        "decisions_per_s": round(per_task * concurrency / elapsed),
    }


def limiter_over(backend) -> RateLimiter:
    metrics = Metrics()
    failover = FailoverBackend(backend, MemoryBackend(), True, CircuitBreaker(3, 5.0), metrics)
    return RateLimiter(failover, metrics)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    results = {"memory": await measure(limiter_over(MemoryBackend()), args.iterations, args.concurrency)}
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        server = subprocess.Popen(
            [shutil.which("redis-server"), "--port", str(port), "--save", "", "--appendonly", "no", "--dir", directory],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.5)
            redis = RedisBackend(f"redis://127.0.0.1:{port}/0", timeout=1.0)
            results["redis"] = await measure(limiter_over(redis), args.iterations, args.concurrency)
            await redis.aclose()
        finally:
            server.terminate()
            server.wait()
    print(f"{'backend':<8} {'p50 µs':>8} {'p99 µs':>8} {'mean µs':>8} {'decisions/s':>12}")
    for name, r in results.items():
        print(f"{name:<8} {r['p50_us']:>8} {r['p99_us']:>8} {r['mean_us']:>8} {r['decisions_per_s']:>12}")
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main())
