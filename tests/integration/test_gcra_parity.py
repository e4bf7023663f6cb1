"""The two rate-limit backends are one algorithm: driven through the same sequence of admissions, settlements and
clock advances, the in-memory backend and the Redis one (lua/batch.lua on a real redis-server) decide alike.

Both read one test clock, in whole milliseconds (Redis keeps slot leases to the millisecond). Requests of a step
arrive at the same instant; the Redis backend gets them concurrently, so they share batches as under load.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.ratelimit.checks import Check, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.gcra import Outcome
from gateway.ratelimit.memory import MemoryBackend
from gateway.ratelimit.redis_backend import RedisBackend

EPOCH_MS = 2_000_000_000_000  # May 2033: the Redis backend's clock must not run behind Redis's own
WIRE_US = 1e-6 + 1e-9  # Redis answers waits in whole microseconds, rounded up


@dataclass
class Clock:
    ms: int = 0

    def seconds(self) -> float:
        return self.ms / 1000

    def epoch_us(self) -> int:
        return (EPOCH_MS + self.ms) * 1000


@st.composite
def rate_limits(draw: st.DrawFn, key: str) -> RateCheck:
    """A request or token rate as the limiter builds it: `limit` per `per` seconds, `burst` deep (cost 0 here)."""
    per = draw(st.sampled_from([1, 2, 3, 7, 10, 60, 3600, 86400]))
    limit = draw(st.integers(1, 1000))
    burst = draw(st.integers(1, 50))
    return RateCheck(key, per / limit, per / limit * burst, 0)


@st.composite
def slot_limits(draw: st.DrawFn, key: str) -> SlotCheck:
    return SlotCheck(key, draw(st.integers(1, 4)), draw(st.integers(1, 120_000)) / 1000, "")


@dataclass
class Admitted:
    checks: list[Check]
    settled: bool = False


class Backends:
    """The same operations on both backends; each step's answers side by side."""

    def __init__(self, redis_url: str, clock: Clock) -> None:
        self.memory = MemoryBackend(clock.seconds)
        self.redis = RedisBackend(redis_url, timeout=5.0, clock=clock.epoch_us)

    async def step(self, operations: list[list[Check] | Settlement]) -> list[tuple[list[Outcome], list[Outcome]]]:
        expected = [await self._on(self.memory, op) for op in operations]
        got = await asyncio.gather(*(self._on(self.redis, op) for op in operations))
        await self.redis.acquire([])  # settlements are not awaited: this one is answered after them
        return list(zip(expected, got))

    @staticmethod
    async def _on(backend: MemoryBackend | RedisBackend, operation: list[Check] | Settlement) -> list[Outcome]:
        if isinstance(operation, Settlement):
            backend.settle(operation)
            return []
        return await backend.acquire(operation)


def same(memory: Outcome, redis: Outcome) -> bool:
    return (
        memory.allowed == redis.allowed
        and memory.remaining == redis.remaining
        and abs(memory.retry_after - redis.retry_after) <= WIRE_US
        and abs(memory.reset - redis.reset) <= WIRE_US
    )


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_memory_and_redis_backends_decide_alike(redis_server, data):
    redis_server.client().flushall()
    rates = [data.draw(rate_limits(f"rate{i}"), label=f"rate{i}") for i in range(3)]
    slots = [data.draw(slot_limits(f"slot{i}"), label=f"slot{i}") for i in range(2)]
    members = (f"request{i}" for i in itertools.count())
    clock = Clock()
    admitted: list[Admitted] = []
    horizons: set[int] = set()  # ms from now at which an outcome said something changes

    def admission() -> list[Check]:
        limits = data.draw(st.lists(st.sampled_from(rates + slots), min_size=1, max_size=3, unique=True))
        return [
            RateCheck(c.key, c.interval, c.tolerance, data.draw(st.integers(0, round(c.tolerance / c.interval) + 2)))
            if isinstance(c, RateCheck)
            else SlotCheck(c.key, c.limit, c.lease, next(members))
            for c in limits
        ]

    def settlement() -> Settlement | None:
        open_ones = [a for a in admitted if not a.settled]
        if not open_ones:
            return None
        chosen = data.draw(st.sampled_from(open_ones))
        chosen.settled = True
        return Settlement(
            tuple(
                (c, data.draw(st.integers(-int(c.cost), 3 * int(c.cost) + 1)))
                for c in chosen.checks
                if isinstance(c, RateCheck)
            ),
            tuple(c for c in chosen.checks if isinstance(c, SlotCheck)),
        )

    async def scenario() -> None:
        backends = Backends(redis_server.url, clock)
        try:
            for _ in range(data.draw(st.integers(1, 25), label="steps")):
                advances = [st.just(0), st.integers(1, 2_000), st.integers(0, 600_000)]
                if horizons:  # to just before, at or after an instant the backends named: where decisions flip
                    advances.append(st.sampled_from(sorted(horizons)))
                clock.ms += data.draw(st.one_of(advances))
                horizons.clear()
                operations: list[list[Check] | Settlement] = []
                for _ in range(data.draw(st.integers(1, 4))):
                    settle = admitted and data.draw(st.booleans())
                    operation = settlement() if settle else admission()
                    if operation is not None:
                        operations.append(operation)
                for operation, (expected, got) in zip(operations, await backends.step(operations)):
                    assert len(expected) == len(got)
                    assert all(same(m, r) for m, r in zip(expected, got)), (clock.ms, operation, expected, got)
                    if isinstance(operation, list) and all(o.allowed for o in expected):
                        admitted.append(Admitted(operation))
                    for outcome in expected:
                        for seconds in (outcome.retry_after, outcome.reset):
                            horizons.update(
                                {math.floor(seconds * 1000) - 1, math.floor(seconds * 1000), math.ceil(seconds * 1000)}
                                - {-1}
                            )
        finally:
            await backends.redis.aclose()

    asyncio.run(scenario())


def test_a_lease_ends_at_the_same_millisecond_on_both_backends(redis_server):
    """1.001 s is 1000.999... ms in binary: the Redis backend must not cut a lease short by truncating it."""
    clock = Clock()

    async def scenario() -> list[tuple[list[Outcome], list[Outcome]]]:
        backends = Backends(redis_server.url, clock)
        try:
            await backends.step([[SlotCheck("slot", 1, 1.001, "first")]])
            clock.ms = 1000
            return await backends.step([[SlotCheck("slot", 1, 1.001, "second")]])
        finally:
            await backends.redis.aclose()

    [(memory, redis)] = asyncio.run(scenario())
    assert not memory[0].allowed and same(memory[0], redis[0])
