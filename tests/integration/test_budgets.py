"""Budgets: spend reserved before a request and settled on its cost, exact across gateway instances.

Real parts throughout: redis-server, gateway processes, a fake OpenAI-compatible upstream process (tests/
fake_upstream.py, which reports 7 prompt tokens and one completion token per chunk). Each test fills a budget or
reads every budget counter in its Redis, so each has its own gateways and redis-server; the upstream, which none
counts, is the module's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import random
import socket
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml
from opentelemetry.trace import INVALID_SPAN

from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.observability.telemetry import Metrics
from gateway.policy.loader import PolicySet
from gateway.policy.model import Policy
from gateway.ratelimit.checks import BudgetCheck, Settlement
from gateway.ratelimit.failover import CircuitBreaker, FailoverBackend
from gateway.ratelimit.limiter import RateLimiter
from gateway.ratelimit.memory import MemoryBackend
from gateway.ratelimit.redis_backend import RedisBackend
from gateway.routing.replica import Replica
from gateway.spend.sqlite_budgets import SqliteBudgets
from gateway.stages.ratelimit import RateLimitStage
from tests.conftest import Launcher, Process, chat_body, pool

KEY = "sk-budget-test"
AUTH = {"keys": [{"tenant": "team-a", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
HEADERS = {"authorization": f"Bearer {KEY}"}
# 1 per million input tokens and 2 per million output tokens: 1,000 and 2,000 nanos a token
PRICES = {"models": {"test-model": {"input": 1.0, "output": 2.0}}}
NANOS = 1_000_000_000
UPSTREAM = Replica("http://127.0.0.1:9")
POLICY_HEAD = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "b"}}


@pytest.fixture(scope="module")
def upstream(module_launcher: Launcher) -> Process:
    return module_launcher.fake_upstream("spend")


def budget_policies(tmp_path, limit: float, period: str = "day", prices: dict = PRICES) -> str:
    directory = tmp_path / "budget-policies"
    directory.mkdir(exist_ok=True)
    spec = {"prices": prices, "budgets": [{"id": "team-spend", "key": "tenant", "limit": limit, "period": period}]}
    base = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "b"}, "spec": spec}
    (directory / "base.yaml").write_text(yaml.safe_dump(base))
    return str(directory)


def gateway_config(upstream_url: str, policies: str, **extra) -> dict:
    return {
        "pools": [pool("main", upstream_url)],
        "auth": AUTH,
        "models": [{"name": "test-model"}],
        "policy_dir": policies,
        "telemetry": {"access_log": True},
        **extra,
    }


def ask(url: str, max_tokens: int = 10, **fields) -> httpx.Response:
    body = chat_body(max_tokens=max_tokens, **fields)
    return httpx.post(url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=30)


def nanos(gw, response: httpx.Response) -> int:
    return round(gw.access_log(response.headers["x-request-id"])["cost"] * NANOS)


def test_budget_backends_decide_alike(redis_server, tmp_path):
    """The same reservations and settlements, in the same order, get the same answers from every store that keeps
    budgets: Redis, the SQLite file (without Redis) and this process's memory (the fallback while a store is down)."""

    async def run() -> None:
        memory, shared = MemoryBackend(), RedisBackend(redis_server.url, 2.0)
        embedded = SqliteBudgets(tmp_path / "budgets.db")
        resets_at = time.time() + 3600
        rng = random.Random(7)
        held: list[tuple[BudgetCheck, int]] = []
        try:
            for step in range(300):
                if held and rng.random() < 0.4:
                    check, cost = held.pop(rng.randrange(len(held)))
                    settlement = Settlement(spend=((check, cost),))
                    memory.settle(settlement)
                    shared.settle(settlement)
                    embedded.settle(settlement)
                    assert not len(shared.settlements), "sent at once, ahead of the next admission"
                    continue
                check = BudgetCheck(f"parity:{step % 2}", 50_000, rng.randrange(1, 9_000), resets_at, f"r{step}")
                [mine], [theirs], [its] = await asyncio.gather(
                    memory.acquire([check]), shared.acquire([check]), embedded.acquire([check])
                )
                assert (mine.allowed, mine.remaining) == (theirs.allowed, theirs.remaining), step
                assert (its.allowed, its.remaining) == (theirs.allowed, theirs.remaining), step
                if mine.allowed:
                    held.append((check, rng.randrange(0, check.cost + 1)))
                    if rng.random() < 0.1:  # a settlement sent twice (its answer was lost) applies once
                        held.append(held[-1])
        finally:
            await shared.aclose()
            await embedded.aclose()

    asyncio.run(run())


def test_budgets_without_redis_and_on_redis_admit_alike(redis_server, tmp_path):
    """The same requests, in the same order, through the rate limiter without Redis (limits in this process's
    memory, budgets reserved on slices of the SQLite file's) and on Redis (one script decides every limit): the same
    ones are admitted, refused for the rate limit or for the budget, with the same budget left; neither consumes
    anything for a request it refused; and the budget ends at the same spend."""
    spec = {
        "prices": PRICES,
        "budgets": [{"id": "team-spend", "key": "tenant", "limit": 0.0005, "period": "day"}],
        "rate_limits": [{"id": "team-rph", "key": ["tenant"], "requests": {"limit": 12, "per": "1h"}}],
    }
    policies = PolicySet(Policy.model_validate({**POLICY_HEAD, "spec": spec}), {}, "parity")

    async def run() -> None:
        metrics = Metrics()
        shared = RedisBackend(redis_server.url, 2.0)
        embedded = SqliteBudgets(tmp_path / "budgets.db")
        local = RateLimiter(_failover(MemoryBackend(), metrics), metrics, _failover(embedded, metrics), embedded.expect)
        stages = [
            RateLimitStage(lambda: policies, local),
            RateLimitStage(lambda: policies, RateLimiter(_failover(shared, metrics), metrics)),
        ]
        rng = random.Random(5)
        held: list[list[RequestContext]] = []
        answers: list[str | None] = []
        try:
            for step in range(120):
                if held and rng.random() < 0.45:
                    ended = held.pop(rng.randrange(len(held)))
                    prompt, completion = rng.randrange(0, 40), rng.randrange(0, (ended[0].max_tokens or 0) + 1)
                    for stage, ctx in zip(stages, ended):
                        ctx.status, ctx.replica = 200, UPSTREAM  # the upstream took it, and reported its usage
                        ctx.usage.prompt_tokens, ctx.usage.completion_tokens = prompt, completion
                        stage.settle(ctx)
                    continue
                prompt_tokens, max_tokens = rng.randrange(1, 60), rng.choice([5, 20, 80, 400])
                pair: list[RequestContext] = []
                decided: list[tuple[str | None, ...]] = []
                for stage in stages:
                    ctx = RequestContext(request=None, route="chat", span=INVALID_SPAN)  # type: ignore[arg-type]
                    ctx.tenant, ctx.model = "team-a", "test-model"
                    ctx.prompt_tokens, ctx.max_tokens = prompt_tokens, max_tokens
                    try:
                        await stage(ctx)
                        decided.append(("admitted", _budget_left(ctx.response_headers)))
                        pair.append(ctx)
                    except GatewayError as refused:
                        decided.append((refused.code, refused.param, _budget_left(refused.headers)))
                assert decided[0] == decided[1], step
                answers.append(decided[0][0])
                if len(pair) == 2:
                    held.append(pair)
            for pair in held:  # the rest end without reaching an upstream: their reservations are given back
                for stage, ctx in zip(stages, pair):
                    stage.settle(ctx)
            await local.aclose()  # its slices go back to the file, settled at what their requests cost
        finally:
            await shared.aclose()
            await embedded.aclose()
        assert {"admitted", "rate_limit_exceeded", "budget_exceeded"} <= set(answers), collections.Counter(answers)
        [key] = redis_server.client().keys("portcullis:budget:*")
        with contextlib.closing(sqlite3.connect(tmp_path / "budgets.db")) as db:
            [(used,)] = db.execute("SELECT used FROM budget WHERE key = ?", (key.decode(),)).fetchall()
        assert used == int(redis_server.client().get(key)) > 0

    asyncio.run(run())


def _failover(primary: MemoryBackend | RedisBackend | SqliteBudgets, metrics: Metrics) -> FailoverBackend:
    return FailoverBackend(primary, MemoryBackend(), False, CircuitBreaker(3, 1.0), metrics)


def _budget_left(headers: dict[str, str]) -> str | None:
    """What the budget header says is left (not when it resets: the two backends read different clocks)."""
    found = headers.get("x-portcullis-budget")
    return None if found is None else found.split("; ")[2]


def test_far_from_its_limit_no_request_waits_for_a_slice(redis_server):
    """With Redis 50 ms away (a delaying TCP relay in between), only the first requests under a large budget wait
    for the store: each next slice is taken while the current one still has room, so the requests that fill one
    move on to the next without a round trip. Once the slices are given back, the counter is the sum of the
    settled costs."""
    spec = {"prices": PRICES, "budgets": [{"id": "team-spend", "key": "tenant", "limit": 10.0, "period": "day"}]}
    policies = PolicySet(Policy.model_validate({**POLICY_HEAD, "spec": spec}), {}, "ahead")

    async def run() -> tuple[list[float], int]:
        relay = DelayingRelay(redis_server.port, 0.05)
        await relay.start()
        limiter, stage, _ = _started_on_redis(f"redis://127.0.0.1:{relay.port}", 5.0, policies)
        waits, spent = [], 0
        try:
            for _ in range(600):  # several slices' worth (each holds at most 128 reservations)
                ctx = _chat(max_tokens=10)
                started = time.monotonic()
                await stage(ctx)
                waits.append(time.monotonic() - started)
                _served(ctx, completion=3)
                stage.settle(ctx)
                spent += 7 * 1000 + 3 * 2000
                await asyncio.sleep(0.004)  # requests a few milliseconds apart: a slice lasts far longer than a take
        finally:
            await _stopped(limiter)
            await relay.aclose()
        return waits, spent

    waits, spent = asyncio.run(run())
    slow = [i for i, wait in enumerate(waits) if wait >= 0.04]
    # the first requests wait: the store has not said yet how much is left (the first slice holds one request)
    assert slow and slow[0] == 0 and all(i < 50 for i in slow), f"requests that waited for the store: {slow}"
    client = redis_server.client()
    counters = [int(client.get(k)) for k in client.scan_iter("portcullis:budget:*") if not k.endswith(b":held")]
    assert counters == [spent]


def test_far_from_its_limit_requests_in_flight_do_not_wait_for_the_next_slice(redis_server):
    """32 requests in flight, each held 70 ms (about 450 a second), with Redis 50 ms away each way: the next slice
    is asked for early enough that it is in hand before the requests in flight fill the current one, so after the
    first slices hardly any request waits for the store (asked for with a quarter of a slice left, one in four
    did)."""
    spec = {"prices": PRICES, "budgets": [{"id": "team-spend", "key": "tenant", "limit": 10.0, "period": "day"}]}
    policies = PolicySet(Policy.model_validate({**POLICY_HEAD, "spec": spec}), {}, "in-flight")

    async def run() -> list[float]:
        relay = DelayingRelay(redis_server.port, 0.05)
        await relay.start()
        limiter, stage, _ = _started_on_redis(f"redis://127.0.0.1:{relay.port}", 5.0, policies)
        waits: list[float] = []

        async def client(n: int) -> None:
            await asyncio.sleep(n * 0.07 / 32)  # steady arrivals, not bursts of 32
            for _ in range(32):
                ctx = _chat(max_tokens=10)
                started = time.monotonic()
                await stage(ctx)
                waits.append(time.monotonic() - started)
                await asyncio.sleep(0.07)
                _served(ctx, completion=10)  # all it reserved: no room comes back to the slice
                stage.settle(ctx)

        try:
            await asyncio.gather(*(client(n) for n in range(32)))
        finally:
            await _stopped(limiter)
            await relay.aclose()
        return waits

    waits = asyncio.run(run())
    settled = waits[256:]  # after the first slices, which are taken while the store's word on what is left comes
    slow = sum(wait >= 0.01 for wait in settled)  # a request on a slice in hand takes well under a millisecond
    assert slow <= len(settled) // 50, f"{slow} of {len(settled)} requests waited for the store"


def test_a_request_that_leaves_while_redis_decides_holds_no_budget(redis_server):
    """A request cancelled (its client gone) while its budget is being decided in Redis, 50 ms away: whatever the
    store granted it (here a slice of the budget) is given back, so the budget's counter returns to nothing spent
    rather than holding the reservation until the period ends."""
    spec = {"prices": PRICES, "budgets": [{"id": "team-spend", "key": "tenant", "limit": 10.0, "period": "day"}]}
    policies = PolicySet(Policy.model_validate({**POLICY_HEAD, "spec": spec}), {}, "gone")
    client = redis_server.client()

    def counters() -> list[int]:
        return [int(client.get(k)) for k in client.scan_iter("portcullis:budget:*") if not k.endswith(b":held")]

    async def run() -> list[int]:
        relay = DelayingRelay(redis_server.port, 0.05)
        await relay.start()
        limiter, stage, _ = _started_on_redis(f"redis://127.0.0.1:{relay.port}", 5.0, policies)
        try:
            ctx = _chat(max_tokens=10)
            admission = asyncio.create_task(stage(ctx))
            await asyncio.sleep(0.07)  # the script has run in Redis; its answer is still on its way back
            admission.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await admission
            stage.settle(ctx)  # the settle phase runs for every request, also one cancelled in a stage
            deadline = time.monotonic() + 20
            while counters() != [0] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return counters()
        finally:
            await _stopped(limiter)
            await relay.aclose()

    assert asyncio.run(run()) == [0]


def test_a_held_slice_keeps_serving_while_redis_is_down(redis_server):
    """Redis dies while this process holds a slice of a budget (failing closed): the requests the slice still holds
    are served without the store; the first that needs a new slice gets 503, as every request did without slices;
    and stopping does not wait on the dead store."""
    spec = {"prices": PRICES, "budgets": [{"id": "team-spend", "key": "tenant", "limit": 10.0, "period": "day"}]}
    policies = PolicySet(Policy.model_validate({**POLICY_HEAD, "spec": spec}), {}, "outage")

    async def run() -> list[str]:
        limiter, stage, _ = _started_on_redis(redis_server.url, 1.0, policies)
        try:
            answers = await _answers(stage, 150, completion=3)
            redis_server.kill()
            answers += await _answers(stage, 550, completion=3)
        finally:
            stopping = time.monotonic()
            await _stopped(limiter)
            assert time.monotonic() - stopping < 5
        return answers

    answers = asyncio.run(run())
    assert answers[:150] == ["admitted"] * 150
    after = answers[150:]
    held = after.index("503 rate_limiter_unavailable") if "503 rate_limiter_unavailable" in after else len(after)
    assert held >= 1 and after[:held] == ["admitted"] * held, "the held slice serves without the store"
    assert set(after[held:]) == {"503 rate_limiter_unavailable"}, collections.Counter(after)


def test_once_redis_is_back_no_slice_the_outage_granted_in_memory_keeps_deciding(redis_server):
    """Failing open, a budget 10 requests from its limit: while Redis is down the instance decides alone (slices of
    its own memory); once Redis is back (with its data) the budget is decided in Redis again, so no more than the 10
    requests it had left are admitted, not the rest of a large slice the fallback granted during the outage.

    2,500 requests' worth: the fallback, which starts the outage knowing nothing spent, is as far from the limit as
    a slice of a whole 128 requests needs (16 x 128 = 2,048), and its 300 requests still leave it more than that."""
    cost = 7 * 1000 + 10 * 2000  # each request reserves and is settled at 7 prompt and 10 output tokens
    spec = {"prices": PRICES, "budgets": [{"id": "team-spend", "key": "tenant", "limit": 2500 * cost / NANOS}]}
    policies = PolicySet(Policy.model_validate({**POLICY_HEAD, "spec": spec}), {}, "reopen")

    async def run() -> list[str]:
        metrics = Metrics()
        breaker = CircuitBreaker(1, 0.3)
        limiter = RateLimiter(
            FailoverBackend(RedisBackend(redis_server.url, 0.5), MemoryBackend(), True, breaker, metrics), metrics
        )
        limiter.start()
        stage = RateLimitStage(lambda: policies, limiter)
        try:
            assert await _answers(stage, 2490, completion=10) == ["admitted"] * 2490
            await asyncio.sleep(1.5)  # idle: the slices go back to Redis
            redis_server.client().save()
            redis_server.kill()
            assert set(await _answers(stage, 300, completion=10)) == {
                "admitted"
            }  # failing open: decided in this process
            redis_server.start()
            await asyncio.sleep(1.0)  # past the breaker's cooldown
            return await _answers(stage, 200, completion=10)
        finally:
            await _stopped(limiter)

    after = asyncio.run(run())
    assert after.count("admitted") <= 10, collections.Counter(after)


def test_on_slices_answers_say_what_is_left_once_past_a_soft_threshold(redis_server):
    """Budgets on Redis slices, far from the limit when the soft threshold is crossed (the slices then are large
    and long-lived): no answer names the budget before it, every one after does, and the crossing is counted once
    for the period."""
    # 10,000 reservations of 7 * 1000 + 100 * 2000 nanos, each settled at the whole reservation
    cost = 7 * 1000 + 100 * 2000
    spec = {
        "prices": PRICES,
        "budgets": [
            {"id": "team-spend", "key": "tenant", "limit": 10_000 * cost / NANOS, "period": "day", "soft": [0.5]}
        ],
    }
    policies = PolicySet(Policy.model_validate({**POLICY_HEAD, "spec": spec}), {}, "soft")

    async def run() -> tuple[list[bool], Metrics]:
        limiter, stage, metrics = _started_on_redis(redis_server.url, 5.0, policies)
        named = []
        try:
            while True:
                ctx = _chat(max_tokens=100)
                try:
                    await stage(ctx)
                except GatewayError as refused:
                    assert refused.code == "budget_exceeded"
                    break
                named.append("x-portcullis-budget" in ctx.response_headers)
                _served(ctx, completion=100)
                stage.settle(ctx)
        finally:
            await _stopped(limiter)
        return named, metrics

    named, metrics = asyncio.run(run())
    assert len(named) == 10_000, "the whole budget is spent"
    first = named.index(True)  # the 5,000th request leaves half: no later (a slice may count what is left short)
    assert 4_000 <= first <= 4_999 and all(named[first:]), f"first named at {first}"
    crossings = metrics.registry.get_sample_value(
        "portcullis_budget_soft_threshold_crossings_total", {"budget": "team-spend", "threshold": "0.5"}
    )
    assert crossings == 1


async def _answers(stage: RateLimitStage, count: int, completion: int) -> list[str]:
    """Ask `count` requests of 10 output tokens one after another, each served with `completion` and settled:
    'admitted', or the refusal's status and code."""
    answers = []
    for _ in range(count):
        ctx = _chat(max_tokens=10)
        try:
            await stage(ctx)
        except GatewayError as refused:
            answers.append(f"{refused.status} {refused.code}")
        else:
            answers.append("admitted")
            _served(ctx, completion=completion)
        stage.settle(ctx)
        await asyncio.sleep(0.001)
    return answers


def _started_on_redis(url: str, timeout: float, policies: PolicySet) -> tuple[RateLimiter, RateLimitStage, Metrics]:
    """A rate limiter deciding in Redis (failing closed), started (its budget slices are swept), and its stage."""
    metrics = Metrics()
    limiter = RateLimiter(_failover(RedisBackend(url, timeout), metrics), metrics)
    limiter.start()
    return limiter, RateLimitStage(lambda: policies, limiter), metrics


async def _stopped(limiter: RateLimiter) -> None:
    await limiter.aclose()
    await limiter.backend.primary.aclose()


def _chat(max_tokens: int) -> RequestContext:
    """A tenant's chat request as the stages before the rate limits leave it: 7 prompt tokens counted."""
    ctx = RequestContext(request=None, route="chat", span=INVALID_SPAN)  # type: ignore[arg-type]
    ctx.tenant, ctx.model, ctx.prompt_tokens, ctx.max_tokens = "team-a", "test-model", 7, max_tokens
    return ctx


def _served(ctx: RequestContext, completion: int) -> None:
    """The upstream took the request and reported its usage."""
    ctx.status, ctx.replica = 200, UPSTREAM
    ctx.usage.prompt_tokens, ctx.usage.completion_tokens = 7, completion


class DelayingRelay:
    """A TCP relay to 127.0.0.1:`port` that holds each chunk back `delay` seconds, each way (in order)."""

    def __init__(self, port: int, delay: float) -> None:
        self._port, self._delay = port, delay
        self._connections: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def aclose(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._connections:
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self._connections.add(asyncio.current_task())  # type: ignore[arg-type]
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self._port)
        try:
            await asyncio.gather(self._pipe(client_reader, server_writer), self._pipe(server_reader, client_writer))
        except asyncio.CancelledError:
            pass

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, chunk = await queue.get()
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                writer.write(chunk)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((time.monotonic() + self._delay, chunk))
        finally:
            sender.cancel()
            writer.close()


def test_two_gateways_share_a_budget_exactly(upstream, gateway, redis_server, tmp_path):
    limit_nanos = 1_000_000  # 0.001: about 70 requests of 13,000 nanos, 200 sent at once
    config = gateway_config(
        upstream.url,
        budget_policies(tmp_path, limit_nanos / NANOS),
        # a timeout this 2-core machine's 200 concurrent requests do not trip: failing open would leave Redis
        redis={"url": redis_server.url, "timeout": 2.0},
        store={"backend": "redis"},
    )
    gateways = [gateway(config), gateway(config)]
    start = threading.Barrier(200)

    def one(i: int) -> tuple[int, httpx.Response]:
        start.wait()
        return i % 2, ask(gateways[i % 2].url)

    with ThreadPoolExecutor(200) as pool_:
        answers = list(pool_.map(one, range(200)))
    served = [(g, r) for g, r in answers if r.status_code == 200]
    refused = [r for _, r in answers if r.status_code != 200]
    reservation = 7 * 1000 + 10 * 2000  # about: the prompt counted by estimate may differ from the upstream's 7
    assert served and refused, "a budget of ~70 requests lets some of 200 through and refuses others"
    for response in refused:
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "budget_exceeded"
        assert float(response.headers["retry-after"]) >= 1
        budget = dict(part.split("=") for part in response.headers["x-portcullis-budget"].split("; ")[1:])
        assert budget["currency"] == "USD" and float(budget["remaining"]) < 2 * reservation / NANOS
    # spend up to the end: the budget is used until less than one request's reservation is left
    while (last := ask(gateways[0].url)).status_code == 200:
        served.append((0, last))
    assert last.json()["error"]["code"] == "budget_exceeded"
    costs = [nanos(gateways[g], r) for g, r in served]
    assert all(cost == 7 * 1000 + 3 * 2000 for cost in costs), "each request settles on the upstream's usage"
    spent = sum(costs)
    assert limit_nanos - 2 * reservation < spent <= limit_nanos
    # the budget's counter in Redis is exactly the sum of the settled costs (reservations all replaced)
    deadline = time.monotonic() + 20
    client = redis_server.client()
    while True:
        counters = [int(client.get(k)) for k in client.scan_iter("portcullis:budget:*") if not k.endswith(b":held")]
        if counters == [spent] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counters == [spent]


# Output tokens only, at 1 per million: a request of 10 output tokens that the upstream answers with 10 chunks costs
# exactly what it reserved, 10,000 nanos, whatever the gateway counts for its prompt.
OUTPUT_PRICES = {"models": {"test-model": {"input": 0.0, "output": 1.0}}}
WHOLE = {"max_tokens": 10, "fake": {"chunks": 10, "header_delay": 1.0}}  # in flight together for 1 s
WHOLE_COST = 10_000


def test_near_the_limit_a_burst_over_two_gateways_serves_exactly_what_the_budget_allows(
    upstream, gateway, redis_server, tmp_path
):
    """docs/keys-and-spend.md, budgets on Redis: what is admitted never sums past the limit, and an instance near the
    limit holds back no more than its requests in flight. 60 requests at once over two gateways against a tenant's
    budget of exactly 20 requests' cost: exactly 20 are served, the other 40 refused for the budget, and the counter
    ends at the limit. Four tenants in turn, each burst on a budget of its own: a slice that held back a fragment
    would lose a request in some of them."""
    tenants = [f"burst{i}" for i in range(4)]
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(f"sk-{t}".encode()).hexdigest()} for t in tenants]}
    config = gateway_config(
        upstream.url,
        budget_policies(tmp_path, 20 * WHOLE_COST / NANOS, prices=OUTPUT_PRICES),
        auth=auth,
        redis={"url": redis_server.url, "timeout": 2.0},
        store={"backend": "redis"},
    )
    gateways = [gateway(config), gateway(config)]
    served = {}
    for tenant in tenants:
        start = threading.Barrier(60)

        def one(i: int, tenant: str = tenant, start: threading.Barrier = start) -> httpx.Response:
            start.wait()
            return httpx.post(
                gateways[i % 2].url + "/v1/chat/completions",
                json=chat_body(**WHOLE),
                headers={"authorization": f"Bearer sk-{tenant}"},
                timeout=30,
            )

        with ThreadPoolExecutor(60) as threads:
            answers = list(threads.map(one, range(60)))
        assert {r.json()["error"]["code"] for r in answers if r.status_code != 200} == {"budget_exceeded"}
        served[tenant] = sum(r.status_code == 200 for r in answers)
        spent = sum(nanos(gateways[i % 2], r) for i, r in enumerate(answers) if r.status_code == 200)
        assert spent == served[tenant] * WHOLE_COST
    assert served == dict.fromkeys(tenants, 20)
    client = redis_server.client()
    deadline = time.monotonic() + 20
    while True:
        counters = [int(client.get(k)) for k in client.scan_iter("portcullis:budget:*") if not k.endswith(b":held")]
        if counters == [20 * WHOLE_COST] * 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counters == [20 * WHOLE_COST] * 4


def test_a_budget_far_from_its_limit_is_decided_on_slices_and_settles_exactly(
    upstream, gateway, redis_server, tmp_path
):
    """Far from the limit a gateway reserves on a slice of the budget it took from Redis, not a round trip a request;
    once it is idle, the slice goes back and the counter is the sum of the settled costs."""
    config = gateway_config(
        upstream.url,
        budget_policies(tmp_path, 1.0),  # a dollar: tens of thousands of these requests
        redis={"url": redis_server.url, "timeout": 2.0},
        store={"backend": "redis"},
    )
    gw = gateway(config)
    client = redis_server.client()
    scripts_before = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    with ThreadPoolExecutor(4) as threads:
        answers = list(threads.map(lambda _: ask(gw.url), range(80)))
    assert [r.status_code for r in answers] == [200] * 80
    scripts = client.info("commandstats")["cmdstat_evalsha"]["calls"] - scripts_before
    assert scripts < 20, f"{scripts} script calls for 80 requests: a round trip (or more) a request"
    spent = sum(nanos(gw, r) for r in answers)
    deadline = time.monotonic() + 20  # a slice left idle for a second is settled
    while True:
        counters = [int(client.get(k)) for k in client.scan_iter("portcullis:budget:*") if not k.endswith(b":held")]
        if counters == [spent] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert counters == [spent] == [80 * 13_000]


def test_a_budget_survives_a_restart_with_the_embedded_store(upstream, gateway, tmp_path, processes):
    config = gateway_config(
        upstream.url, budget_policies(tmp_path, 0.0001), store={"sqlite_path": str(tmp_path / "spend.db")}
    )
    first = gateway(config)
    spent, named = 0, []  # per served answer, in order: whether it named the budget
    while (response := ask(first.url)).status_code == 200:
        named.append("x-portcullis-budget" in response.headers)
        spent += nanos(first, response)
    assert response.json()["error"]["code"] == "budget_exceeded"
    assert 0 < spent <= 100_000
    # answers name the budget only once it is past its soft threshold (0.8): the first say nothing, the last do
    assert not named[0] and named[-1], named
    assert named == sorted(named), "once past the threshold, every answer says what is left"
    soft = [json.loads(line) for line in first.output().splitlines() if '"budget_soft_threshold"' in line]
    assert [(event["budget"], event["threshold"]) for event in soft] == [("team-spend", 0.8)], "once per period"
    assert 'portcullis_budget_soft_threshold_crossings_total{budget="team-spend",threshold="0.8"} 1.0' in (
        first.admin.get("/metrics").text
    )
    first.stop()  # a clean stop writes the ledger
    processes.remove(first)
    second = gateway(config)
    report = second.admin.get("/admin/spend", params={"group_by": "tenant"}).json()["data"]
    assert [(row["tenant"], row["cost_nanos"]) for row in report] == [("team-a", spent)], "the ledger kept the spend"
    again = ask(second.url)
    assert again.status_code == 429, "the restarted gateway reads the period's spend back from the ledger"
    name, *fields = again.headers["x-portcullis-budget"].split("; ")
    budget = dict(field.split("=") for field in fields)
    assert name == "team-spend" and float(budget["limit"]) == 0.0001
    remaining = float(budget["remaining"])
    assert remaining * NANOS == pytest.approx(100_000 - spent, abs=1)


def test_the_spend_report_counts_served_and_refused_requests_apart(upstream, gateway, tmp_path):
    """Ten requests against a budget two of them fill (50,000 nanos: each reserves up to 27,000 and costs 13,000):
    the report, and its CSV export, count the two served as `requests` and the eight refused for the budget as
    `refused_requests`, with the cost of the served alone."""
    gw = gateway(gateway_config(upstream.url, budget_policies(tmp_path, 0.00005)))
    statuses = [ask(gw.url).status_code for _ in range(10)]
    assert statuses == [200] * 2 + [429] * 8
    params = {"group_by": "tenant"}
    deadline = time.monotonic() + 20  # the ledger is written once a second
    while True:
        [row] = gw.admin.get("/admin/spend", params=params).json()["data"] or [{"requests": 0}]
        if row["requests"] + row.get("refused_requests", 0) >= 10 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (row["tenant"], row["requests"], row["refused_requests"], row["cost_nanos"]) == ("team-a", 2, 8, 26_000)
    export = gw.admin.get("/admin/spend", params={**params, "format": "csv"}).text.splitlines()
    header, line = export[0].split(","), export[1].split(",")
    assert dict(zip(header, line))["requests"] == "2" and dict(zip(header, line))["refused_requests"] == "8", export


def test_usage_an_upstream_reports_above_the_reservation_is_charged_flagged_and_held_against_the_next(
    upstream, gateway, tmp_path
):
    """An upstream that answers a request of 10 output tokens with 100 (one a chunk, and it says so): the request
    reserved 10,000 nanos of a 50,000 budget and is charged the 100,000 its usage costs, flagged in the access log
    (90 tokens over) and by `portcullis_usage_over_reservation_total`; the budget's spend holds the overshoot, so
    the next request, which would have fitted before it, is refused."""
    gw = gateway(gateway_config(upstream.url, budget_policies(tmp_path, 0.00005, prices=OUTPUT_PRICES)))
    over = ask(gw.url, max_tokens=10, fake={"chunks": 100})
    assert over.status_code == 200
    line = gw.access_log(over.headers["x-request-id"])
    assert (line["completion_tokens"], line["over_reservation_tokens"], line["cost"]) == (100, 90, 100_000 / NANOS)
    metrics = gw.admin.get("/metrics").text
    flagged = 'portcullis_usage_over_reservation_total{model="test-model",tenant="team-a"} 1.0'
    assert flagged in metrics, [m for m in metrics.splitlines() if "over_reservation" in m]
    within = ask(gw.url, max_tokens=10)
    assert within.status_code == 429 and within.json()["error"]["code"] == "budget_exceeded"
    assert gw.access_log(within.headers["x-request-id"])["over_reservation_tokens"] is None
    deadline = time.monotonic() + 20  # the ledger is written once a second
    while not (rows := gw.admin.get("/admin/spend", params={"group_by": "tenant"}).json()["data"]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert (rows[0]["completion_tokens"], rows[0]["cost_nanos"]) == (100, 100_000)


def test_the_official_client_sees_budget_exhaustion_as_a_rate_limit_error(upstream, gateway, tmp_path):
    gw = gateway(gateway_config(upstream.url, budget_policies(tmp_path, 0.00003)))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=10)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": "hi"}], max_tokens=10)
    assert refused.value.code == "budget_exceeded"
    assert "team-spend" in refused.value.message


def test_a_stored_key_has_its_own_budget_and_limits(upstream, gateway, tmp_path):
    """Keys made through the admin API: one with a budget of its own and its own limit for a per-key policy rule,
    one without; the per-key billing counters name each."""
    directory = tmp_path / "key-policies"
    directory.mkdir()
    per_key = {"id": "per-key-rpm", "key": ["api_key"], "requests": {"limit": 1, "per": "1h"}}
    spec = {"prices": PRICES, "rate_limits": [per_key]}
    (directory / "base.yaml").write_text(
        yaml.safe_dump({"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "k"}, "spec": spec})
    )
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "models": [{"name": "test-model"}],
            "policy_dir": str(directory),
            "auth": AUTH,  # a static key too: the gateway is never anonymous while the stored keys load
            "telemetry": {"per_key_metrics": True},
        }
    )
    own = gw.admin.post(
        "/admin/keys",
        json={"tenant": "acme", "limits": {"per-key-rpm": 100}, "budget": {"limit": 0.00004, "period": "day"}},
    ).json()
    plain = gw.admin.post("/admin/keys", json={"tenant": "acme"}).json()

    def ask_with(secret: str) -> httpx.Response:
        return httpx.post(
            gw.url + "/v1/chat/completions",
            json=chat_body(max_tokens=10),
            headers={"authorization": f"Bearer {secret}"},
            timeout=30,
        )

    deadline = time.monotonic() + 20
    while (first := ask_with(own["secret"])).status_code == 401 and time.monotonic() < deadline:
        time.sleep(0.05)  # the key reaches the gateway's key ring by its poll
    assert first.status_code == 200
    outcomes = [first] + [ask_with(own["secret"]) for _ in range(4)]
    codes = [r.status_code for r in outcomes]
    # 40,000 nanos: two requests of 13,000 settle, a third's reservation (up to 27,000) no longer fits
    assert codes[:2] == [200, 200] and 429 in codes[2:], codes
    refused = next(r for r in outcomes if r.status_code == 429).json()["error"]
    assert (refused["code"], refused["param"]) == ("budget_exceeded", "key"), "its own budget, not its rate limit"
    assert ask_with(plain["secret"]).status_code == 200
    limited = ask_with(plain["secret"]).json()["error"]
    assert (limited["code"], limited["param"]) == ("rate_limit_exceeded", "per-key-rpm"), "the policy's 1 an hour"
    metrics = gw.admin.get("/metrics").text
    served_by_own = sum(r.status_code == 200 for r in outcomes)

    def sample(name: str, key_id: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith(name + "{") and f'key_id="{key_id}"' in line
        )

    assert sample("portcullis_key_billed_requests_total", own["id"]) == len(outcomes), "refused ones count too"
    assert sample("portcullis_key_spend_total", own["id"]) == pytest.approx(served_by_own * 13_000 / NANOS)
    assert sample("portcullis_key_billed_requests_total", plain["id"]) == 2


def test_a_client_that_leaves_while_its_budget_is_decided_fails_no_other_request(upstream, gateway, tmp_path):
    """Without Redis, a budget period's first request takes a slice of it in the SQLite file (its row opened from
    the ledger there), and the next ones wait for that slice. The request that began the take leaves while it runs
    (slow here: another writer holds the file): the requests waiting on it are still decided and served, never
    answered 500."""
    path = tmp_path / "spend.db"
    keys = {"sk-budget-a": "team-a", "sk-budget-b": "team-b"}
    auth = {"keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for k, t in keys.items()]}
    config = gateway_config(upstream.url, budget_policies(tmp_path, 1.0))
    gw = gateway({**config, "auth": auth, "store": {"sqlite_path": str(path), "flush_interval": 60}})
    url = gw.url + "/v1/chat/completions"
    # another tenant's budget is decided in the file first: the gateway has it open, and team-a's period is new
    assert httpx.post(url, json=chat_body(), headers={"authorization": "Bearer sk-budget-b"}).status_code == 200
    payload = json.dumps(chat_body()).encode()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as db:
        db.execute("BEGIN IMMEDIATE")  # another writer holds the file (for less than the budget store's 5 s busy wait)
        host, port = gw.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as leader:  # team-a's first: takes a slice
            leader.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n"
                b"authorization: Bearer sk-budget-a\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload)
            )
            time.sleep(0.5)
            with ThreadPoolExecutor(1) as pool_:
                waiting = pool_.submit(
                    httpx.post, url, json=chat_body(), headers={"authorization": "Bearer sk-budget-a"}, timeout=30
                )
                time.sleep(0.5)  # it waits for the leader's slice
                leader.close()  # the leader leaves while the file decides
                time.sleep(0.5)
                db.execute("ROLLBACK")
                follower = waiting.result()
    assert follower.status_code == 200, follower.text
    assert "Traceback" not in gw.output(), gw.output()[-3000:]
