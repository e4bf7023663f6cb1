"""GCRA and the in-memory backend: the rate bound holds for any arrival sequence, and capacity really is there."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.ratelimit.checks import RateCheck, Settlement, SlotCheck
from gateway.ratelimit.gcra import gcra
from gateway.ratelimit.memory import MemoryBackend


@settings(max_examples=300, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0, max_value=3, allow_nan=False), min_size=1, max_size=60),
    limit=st.integers(min_value=1, max_value=20),
    per=st.floats(min_value=0.1, max_value=10),
    burst=st.integers(min_value=1, max_value=20),
)
def test_allowed_never_exceeds_burst_plus_rate_times_elapsed(gaps, limit, per, burst):
    interval = per / limit
    now, tat, allowed_at = 0.0, 0.0, []
    for gap in gaps:
        now += gap
        outcome, tat = gcra(tat, now, interval, interval * burst, 1)
        if outcome.allowed:
            allowed_at.append(now)
    # every window [allowed_at[i], allowed_at[j]] holds at most burst + elapsed / interval admissions
    for i in range(len(allowed_at)):
        for j in range(i, len(allowed_at)):
            assert j - i + 1 <= burst + (allowed_at[j] - allowed_at[i]) / interval + 1e-9


@given(limit=st.integers(min_value=1, max_value=50), burst=st.integers(min_value=1, max_value=50))
def test_a_full_burst_is_admitted_then_exactly_one_per_interval(limit, burst):
    interval = 60 / limit
    tat, results = 0.0, []
    for _ in range(burst + 3):
        outcome, tat = gcra(tat, 100.0, interval, interval * burst, 1)
        results.append(outcome.allowed)
    assert results == [True] * burst + [False] * 3
    outcome, _ = gcra(tat, 100.0 + interval, interval, interval * burst, 1)
    assert outcome.allowed and outcome.remaining == 0


def test_denial_reports_when_to_retry_and_remaining():
    interval = 1.0
    tat = 0.0
    for _ in range(3):
        _, tat = gcra(tat, 10.0, interval, 3.0, 1)
    outcome, kept = gcra(tat, 10.0, interval, 3.0, 1)
    assert not outcome.allowed and kept == tat
    assert outcome.retry_after == pytest.approx(1.0) and outcome.remaining == 0 and outcome.reset == pytest.approx(3)
    token, _ = gcra(0.0, 10.0, 0.01, 1.0, 150)  # 150 tokens against a 100-token bucket
    assert not token.allowed and token.remaining == 100


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_memory_slots_are_leased_and_released():
    clock = Clock()
    backend = MemoryBackend(clock)
    checks = [SlotCheck("k", 2, lease=30, member=f"r{i}") for i in range(3)]
    outcomes = [asyncio.run(backend.acquire([check]))[0] for check in checks]
    assert [o.allowed for o in outcomes] == [True, True, False]
    assert outcomes[2].retry_after == pytest.approx(30)
    backend.settle(Settlement(releases=(checks[0],)))
    assert asyncio.run(backend.acquire([checks[2]]))[0].allowed
    clock.now += 31  # a holder that never released (crashed gateway) loses its slot with its lease
    assert [asyncio.run(backend.acquire([SlotCheck("k", 2, 30, f"r{i}")]))[0].allowed for i in (9, 10, 11)] == [
        True,
        True,
        False,
    ]


def test_memory_admission_is_all_or_nothing():
    backend = MemoryBackend(Clock())
    requests = RateCheck("rpm", interval=1.0, tolerance=5.0, cost=1)
    full = SlotCheck("slots", 1, lease=30, member="holder")
    assert asyncio.run(backend.acquire([full]))[0].allowed
    outcomes = asyncio.run(backend.acquire([requests, SlotCheck("slots", 1, 30, "r1")]))
    assert [o.allowed for o in outcomes] == [True, False]
    # the refused request took none of the requests limit: a whole burst of 5 is still there
    assert [asyncio.run(backend.acquire([requests]))[0].allowed for _ in range(6)] == [True] * 5 + [False]


def test_memory_token_reservation_is_refunded_and_overcharged():
    clock = Clock()
    backend = MemoryBackend(clock)
    reserve = RateCheck("t", interval=0.01, tolerance=1.0, cost=80)  # 100 tokens of burst
    assert asyncio.run(backend.acquire([reserve]))[0].remaining == 20
    backend.settle(Settlement(adjustments=((reserve, -50),)))  # used 30 of 80
    assert asyncio.run(backend.acquire([RateCheck("t", 0.01, 1.0, 70)]))[0].allowed
    backend.settle(Settlement(adjustments=((reserve, 5),)))  # 5 more than reserved
    outcome = asyncio.run(backend.acquire([RateCheck("t", 0.01, 1.0, 1)]))[0]
    assert not outcome.allowed and outcome.retry_after == pytest.approx(0.06)
