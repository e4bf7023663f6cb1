"""The Redis backend on a real redis-server: concurrent decisions travel as one batch, admissions stay all-or-nothing
and exact, settlements apply without being awaited, and a stalled store fails the batch within its timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from gateway.ratelimit.checks import BackendError, RateCheck, Settlement, SlotCheck
from gateway.ratelimit.redis_backend import RedisBackend


def script_calls(redis_server) -> int:
    return redis_server.client().info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


async def settled(backend: RedisBackend) -> None:
    """Settlements are fire-and-forget: a later admission rides in the same batch or a later one, after them."""
    await backend.acquire([])


def test_concurrent_admissions_share_one_round_trip_and_stay_exact(redis_server):
    async def main() -> list[bool]:
        backend = RedisBackend(redis_server.url, timeout=5.0)
        await backend.acquire([RateCheck("warm", 1.0, 1.0, 0)])  # connect and load the script
        redis_server.client().config_resetstat()
        check = RateCheck("portcullis:rl:{hundred:x}", interval=60.0, tolerance=60.0 * 100, cost=1)
        outcomes = await asyncio.gather(*(backend.acquire([check]) for _ in range(250)))
        await backend.aclose()
        return [o[0].allowed for o in outcomes]

    allowed = asyncio.run(main())
    assert allowed.count(True) == 100 and allowed[:100] == [True] * 100  # decided in arrival order
    assert script_calls(redis_server) == 1


def test_one_batch_decides_as_if_one_request_came_after_another(redis_server):
    async def main() -> None:
        backend = RedisBackend(redis_server.url, timeout=5.0)
        await backend.acquire([RateCheck("warm", 1.0, 1.0, 0)])
        redis_server.client().config_resetstat()
        slots = [SlotCheck("portcullis:rl:{three:x}", 3, 30, f"r{i}") for i in range(5)]
        tokens = RateCheck("portcullis:rl:{tpm:y}", interval=0.01, tolerance=1.0, cost=60)  # 100-token burst
        first = await asyncio.gather(*(backend.acquire([check, tokens]) for check in slots[:2]))
        # the second request would need 120 of 100 tokens: refused, so it takes no slot either
        assert [[o.allowed for o in pair] for pair in first] == [[True, True], [True, False]]
        # one batch: a release and a refund, then admissions that need what they gave back
        backend.settle(Settlement(adjustments=((tokens, -60),), releases=(slots[0],)))
        second = await asyncio.gather(*(backend.acquire([check]) for check in slots[1:]))
        assert [o[0].allowed for o in second] == [True, True, True, False]
        assert [o[0].remaining for o in second] == [2, 1, 0, 0]
        assert 29 < second[3][0].retry_after <= 30
        assert (await backend.acquire([tokens]))[0].remaining == 40  # the refund came back
        await backend.aclose()

    asyncio.run(main())
    assert script_calls(redis_server) == 3
    assert sorted(redis_server.client().zrange("portcullis:rl:{three:x}", 0, -1)) == [b"r1", b"r2", b"r3"]


def test_a_burst_arriving_together_gets_all_of_it_whatever_the_interval(redis_server):
    """3 per 2 s: an interval of 666,666.67 µs. A double holds µs since the epoch only to a quarter of one, so
    summing TATs there rounded the third request's exact fit into a refusal."""

    async def main() -> list[bool]:
        backend = RedisBackend(redis_server.url, timeout=5.0)
        check = RateCheck("portcullis:rl:{three:y}", interval=2 / 3, tolerance=2 / 3 * 3, cost=1)
        outcomes = await asyncio.gather(*(backend.acquire([check]) for _ in range(4)))
        await backend.aclose()
        return [o[0].allowed for o in outcomes]

    assert asyncio.run(main()) == [True, True, True, False]


def test_an_admission_denied_by_one_limit_consumes_none_of_the_others(redis_server):
    async def main() -> None:
        backend = RedisBackend(redis_server.url, timeout=5.0)
        requests = RateCheck("portcullis:rl:{rpm:x}", interval=1.0, tolerance=5.0, cost=1)
        assert (await backend.acquire([SlotCheck("portcullis:rl:{slots:x}", 1, 30, "holder")]))[0].allowed
        outcomes = await backend.acquire([requests, SlotCheck("portcullis:rl:{slots:x}", 1, 30, "r1")])
        assert [o.allowed for o in outcomes] == [True, False]
        assert 29 < outcomes[1].retry_after <= 30
        burst = [(await backend.acquire([requests]))[0].allowed for _ in range(6)]
        assert burst == [True] * 5 + [False]  # the whole burst of 5 was still there
        await backend.aclose()

    asyncio.run(main())


def test_settlements_apply_without_being_awaited(redis_server):
    async def main() -> None:
        backend = RedisBackend(redis_server.url, timeout=5.0)
        slot = SlotCheck("portcullis:rl:{one:x}", 1, 30, "r1")
        tokens = RateCheck("portcullis:rl:{tpm:x}", interval=0.01, tolerance=1.0, cost=80)  # 100-token burst
        assert all(o.allowed for o in await backend.acquire([slot, tokens]))
        backend.settle(Settlement(adjustments=((tokens, -50),), releases=(slot,)))  # used 30 of 80
        outcomes = await backend.acquire([SlotCheck(slot.key, 1, 30, "r2"), RateCheck(tokens.key, 0.01, 1.0, 70)])
        assert [o.allowed for o in outcomes] == [True, True]
        assert outcomes[1].remaining == 0
        await backend.aclose()

    asyncio.run(main())
    assert redis_server.client().zrange("portcullis:rl:{one:x}", 0, -1) == [b"r2"]


def test_a_stalled_store_fails_the_batch_within_the_timeout_then_recovers(redis_server):
    async def main() -> None:
        backend = RedisBackend(redis_server.url, timeout=0.3)
        check = RateCheck("portcullis:rl:{rpm:y}", interval=100.0, tolerance=1000.0, cost=1)  # burst 10
        assert (await backend.acquire([check]))[0].allowed
        redis_server.client().execute_command("CLIENT", "PAUSE", 1000, "ALL")
        started = time.monotonic()
        results = await asyncio.gather(*(backend.acquire([check]) for _ in range(5)), return_exceptions=True)
        assert time.monotonic() - started < 0.9
        assert all(isinstance(r, BackendError) for r in results)
        await asyncio.sleep(1.0)  # the pause ends; the late reply must not be taken for the next batch's
        outcome = (await backend.acquire([check]))[0]
        # 1 before and this one; Redis may still have run the abandoned batch of 5 when the pause ended
        assert outcome.allowed and outcome.remaining in (8, 3)
        await backend.aclose()

    asyncio.run(main())


FROZEN_TIMEOUT = 0.5  # seconds: redis.timeout while the store is frozen


def test_an_admission_queued_behind_settlements_a_frozen_store_holds_fails_within_one_timeout(redis_server):
    """Redis freezes (SIGSTOP) as 700 requests end: their releases fill three batches, each of which would wait out
    the whole timeout. An admission queued behind them fails (and its caller fails open or closed) when the first
    does, not after all of them; the releases are kept, and reach Redis once it wakes."""
    key = "portcullis:rl:{slots:frozen}"
    held = [SlotCheck(key, 1000, 600, f"r{i}") for i in range(700)]

    async def main() -> float:
        backend = RedisBackend(redis_server.url, timeout=FROZEN_TIMEOUT)
        assert all(o[0].allowed for o in await asyncio.gather(*(backend.acquire([slot]) for slot in held)))
        assert redis_server.proc is not None
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            for slot in held:
                backend.settle(Settlement(releases=(slot,)))
            started = time.monotonic()
            with pytest.raises(BackendError):
                await backend.acquire([SlotCheck(key, 1000, 600, "late")])
            waited = time.monotonic() - started
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(backend.settlements):
            await asyncio.sleep(0.05)
        await settled(backend)
        await backend.aclose()
        return waited

    waited = asyncio.run(main())
    # about one timeout; queued behind each batch in turn it was three (a loaded machine gets a second one's slack)
    assert waited < 2 * FROZEN_TIMEOUT, f"waited {waited:.2f}s with a timeout of {FROZEN_TIMEOUT}s"
    assert redis_server.client().zcard(key) == 0


def test_script_is_reloaded_after_redis_forgets_it(redis_server):
    async def main() -> None:
        backend = RedisBackend(redis_server.url, timeout=5.0)
        check = RateCheck("portcullis:rl:{rph:z}", interval=1800.0, tolerance=3600.0, cost=1)
        assert (await backend.acquire([check]))[0].allowed
        redis_server.client().script_flush()
        assert [(await backend.acquire([check]))[0].allowed for _ in range(2)] == [True, False]
        await backend.aclose()

    asyncio.run(main())


def test_an_unreachable_store_raises_backend_error(redis_server):
    redis_server.kill()

    async def main() -> None:
        backend = RedisBackend(redis_server.url, timeout=0.5)
        with pytest.raises(BackendError):
            await backend.acquire([RateCheck("k", 1.0, 1.0, 1)])
        await backend.aclose()

    asyncio.run(main())


def test_a_lone_settlement_goes_within_the_linger_and_closing_sends_what_is_queued(redis_server):
    slots = "portcullis:rl:{two:x}"
    held = redis_server.client().zcard

    async def main() -> None:
        backend = RedisBackend(redis_server.url, timeout=5.0)
        first, second = SlotCheck(slots, 2, 30, "r1"), SlotCheck(slots, 2, 30, "r2")
        assert all(o[0].allowed for o in await asyncio.gather(backend.acquire([first]), backend.acquire([second])))
        backend.settle(Settlement(releases=(first,)))  # nothing else comes to ride with
        await asyncio.sleep(0.1)
        assert held(slots) == 1
        backend.settle(Settlement(releases=(second,)))
        await backend.aclose()  # at once: the release is still queued

    asyncio.run(main())
    assert held(slots) == 0


def test_a_key_left_of_another_kind_fails_no_batch(redis_server):
    """A rule that changed kind under the same id finds its counter of the old type: it starts over, and the other
    requests of the batch are decided as usual."""
    client = redis_server.client()
    client.set("portcullis:rl:{changed:x}", "123")  # was a GCRA TAT, now a concurrency rule
    client.zadd("portcullis:rl:{changed:y}", {"r0": 1})  # was a slot set, now a requests rule

    async def main() -> list:
        backend = RedisBackend(redis_server.url, timeout=5.0)
        other = RateCheck("portcullis:rl:{other:x}", interval=1.0, tolerance=5.0, cost=1)
        outcomes = await asyncio.gather(
            backend.acquire([SlotCheck("portcullis:rl:{changed:x}", 1, 30, "r1")]),
            backend.acquire([RateCheck("portcullis:rl:{changed:y}", interval=1.0, tolerance=5.0, cost=1)]),
            backend.acquire([other]),
        )
        backend.settle(Settlement(releases=(SlotCheck("portcullis:rl:{changed:y}", 1, 30, "r9"),)))
        await backend.aclose()
        return [o[0] for o in outcomes]

    slot, rate, other = asyncio.run(main())
    assert slot.allowed and slot.remaining == 0 and rate.allowed and rate.remaining == 4 and other.allowed
    assert (
        client.zrange("portcullis:rl:{changed:x}", 0, -1) == [b"r1"]
        and client.type("portcullis:rl:{changed:y}") == b"string"
    )


def test_a_settlement_the_store_may_have_applied_is_retried_for_its_release_only(redis_server):
    """A batch that timed out after it was sent whole may have run: its slot release is sent again (freeing a slot
    twice is harmless), its token refund is not (twice would grant tokens nobody gave back)."""
    slot = SlotCheck("portcullis:rl:{one:p}", 1, 30, "r1")
    tokens = RateCheck("portcullis:rl:{tpm:p}", interval=10.0, tolerance=1000.0, cost=80)  # 100-token burst

    async def main() -> tuple[int, dict]:
        backend = RedisBackend(redis_server.url, timeout=0.3)
        assert all(o.allowed for o in await backend.acquire([slot, tokens]))
        redis_server.client().execute_command("CLIENT", "PAUSE", 1000, "ALL")
        backend.settle(Settlement(adjustments=((tokens, -50),), releases=(slot,)))
        await asyncio.sleep(1.5)  # the settlement times out, the pause ends, the retry goes through
        outcome = (await backend.acquire([RateCheck(tokens.key, 10.0, 1000.0, 0)]))[0]
        dropped = dict(backend.settlements.dropped)
        await backend.aclose()
        return outcome.remaining, dropped

    remaining, dropped = asyncio.run(main())
    assert remaining in (20, 70)  # refunded once (Redis ran the timed-out batch) or not at all; never twice (100)
    assert dropped == {"correction_maybe_applied": 1}
    assert redis_server.client().zcard(slot.key) == 0
