"""The micro-batcher: concurrent callers share batches, each gets its own scores, buckets bound padding."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from gateway.guard.batcher import MicroBatcher, _Item, buckets


class Recorder:
    """A scorer whose score is a function of the window (its first id / 1000), recording each batch."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[list[int]]] = []
        self.delay = delay
        self.threads: set[int] = set()

    def __call__(self, batch: list[list[int]]) -> np.ndarray:
        self.batches.append(batch)
        self.threads.add(threading.get_ident())
        time.sleep(self.delay)
        return np.array([ids[0] / 1000 for ids in batch])


def run(coro):
    return asyncio.run(coro)


def test_each_caller_gets_its_own_scores_in_order() -> None:
    scorer = Recorder(delay=0.005)
    batcher = MicroBatcher(scorer, max_batch=16, max_wait_us=5000)

    async def main():
        calls = [[[i, 1, 2]] if i % 3 else [[i, 1], [i + 500, 1, 2, 3]] for i in range(1, 60)]
        results = await asyncio.gather(*(batcher.score(c) for c in calls))
        for call, result in zip(calls, results):
            assert result == pytest.approx([w[0] / 1000 for w in call])
        await batcher.aclose()

    run(main())
    assert len(scorer.batches) < 59, "concurrent requests must share batches"
    assert max(len(b) for b in scorer.batches) <= 16


def test_a_lone_request_waits_at_most_max_wait() -> None:
    batcher = MicroBatcher(Recorder(), max_batch=64, max_wait_us=2000)

    async def main():
        started = time.perf_counter()
        assert await batcher.score([[250, 1]]) == [0.25]
        return time.perf_counter() - started

    assert run(main()) < 0.5


def test_full_batch_does_not_wait() -> None:
    scorer = Recorder()
    batcher = MicroBatcher(scorer, max_batch=4, max_wait_us=10_000_000)

    async def main():
        return await asyncio.wait_for(batcher.score([[1], [2], [3], [4]]), 2.0)

    assert run(main()) == pytest.approx([0.001, 0.002, 0.003, 0.004])


def test_length_buckets_bound_padding() -> None:
    loop = asyncio.new_event_loop()
    items = [_Item([1] * n, loop.create_future()) for n in (5, 300, 12, 40, 17, 500, 31)]
    groups = buckets(items)
    assert [sorted(len(i.ids) for i in g) for g in groups] == [[5, 12], [17, 31], [40], [300, 500]]
    loop.close()


def test_scorer_failure_reaches_every_caller_and_the_batcher_recovers() -> None:
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return np.zeros(len(batch))

    batcher = MicroBatcher(flaky, max_batch=8, max_wait_us=1000)

    async def main():
        with pytest.raises(RuntimeError):
            await batcher.score([[1], [2]])
        assert await batcher.score([[3]]) == [0.0]

    run(main())


def test_cancelled_caller_does_not_break_others() -> None:
    batcher = MicroBatcher(Recorder(delay=0.02), max_batch=2, max_wait_us=0)

    async def main():
        first = asyncio.create_task(batcher.score([[100]]))
        await asyncio.sleep(0)
        second = asyncio.create_task(batcher.score([[200], [300], [400]]))
        await asyncio.sleep(0)
        first.cancel()
        assert await second == pytest.approx([0.2, 0.3, 0.4])

    run(main())


def test_one_batcher_serves_one_event_loop_after_another() -> None:
    batcher = MicroBatcher(Recorder(), max_batch=4, max_wait_us=0)

    async def scores(first: int) -> list[float]:
        try:
            return await batcher.score([[first], [first + 1]])
        finally:
            await batcher.aclose()

    assert run(scores(100)) == pytest.approx([0.1, 0.101])
    assert run(scores(200)) == pytest.approx([0.2, 0.201])


class PerWindow(Recorder):
    """A scorer that takes `delay` seconds per window of a call, as a CPU does."""

    def __call__(self, batch: list[list[int]]) -> np.ndarray:
        self.batches.append(batch)
        time.sleep(self.delay * len(batch))
        return np.array([ids[0] / 1000 for ids in batch])


@pytest.mark.parametrize("max_wait_us", [0, 2000])
def test_a_short_request_waits_behind_one_long_scan_call_not_the_whole_scan(max_wait_us: int) -> None:
    """400 windows of a long scan (0.8 s of scoring) queued first: a short request sent after them is scored after at
    most one of the long scan's calls of 8 windows, while the long scan is still going, and the long scan goes on
    to the end once the short request has waited for company (or not)."""
    scorer = PerWindow(delay=0.002)
    batcher = MicroBatcher(scorer, max_batch=32, max_wait_us=max_wait_us, long_batch=8)

    async def main() -> tuple[float, bool]:
        long = asyncio.gather(*batcher.submit([[500 + k % 400, k] for k in range(400)], long=True))
        await asyncio.sleep(0.05)
        started = time.perf_counter()
        assert await batcher.score([[7]]) == [0.007]
        waited = time.perf_counter() - started
        still_going = not long.done()
        results = await asyncio.wait_for(long, 10)
        assert [margin for margin, _ in results] == pytest.approx([(500 + k % 400) / 1000 for k in range(400)])
        await batcher.aclose()
        return waited, still_going

    waited, still_going = run(main())
    assert still_going and waited < 0.25, waited
    assert max(len(b) for b in scorer.batches) <= 8


def test_a_long_scan_progresses_under_a_steady_stream_of_short_requests() -> None:
    """Short requests always waiting must not starve a long scan: the lanes take turns."""
    batcher = MicroBatcher(PerWindow(delay=0.001), max_batch=4, max_wait_us=0, long_batch=4)

    async def main() -> None:
        stop = asyncio.Event()

        async def short_traffic() -> None:
            while not stop.is_set():
                await asyncio.gather(*(batcher.score([[k]]) for k in range(8)))

        traffic = [asyncio.create_task(short_traffic()) for _ in range(4)]
        await asyncio.sleep(0.05)
        results = await asyncio.wait_for(asyncio.gather(*batcher.submit([[k] for k in range(40)], long=True)), 5)
        assert len(results) == 40 and all(seconds > 0 for _, seconds in results)
        stop.set()
        await asyncio.gather(*traffic)
        await batcher.aclose()

    run(main())


def busy(seconds: float) -> None:
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_each_window_is_charged_its_share_of_its_calls_cpu_time() -> None:
    """A call that computes 40 ms and then waits 200 ms (another process's turn on a busy machine) charges its four
    windows 10 ms of CPU each, times the scorer's threads."""

    def scorer(batch: list[list[int]]) -> np.ndarray:
        busy(0.04)
        time.sleep(0.2)
        return np.zeros(len(batch))

    async def shares(threads: int) -> list[float]:
        batcher = MicroBatcher(scorer, max_batch=4, max_wait_us=0, threads=threads)
        return [seconds for _, seconds in await asyncio.gather(*batcher.submit([[1], [2], [3], [4]]))]

    one, two = run(shares(1)), run(shares(2))
    assert len(set(one)) == 1 and 0.01 <= one[0] < 0.02, one
    assert two[0] == pytest.approx(2 * one[0], rel=0.3)


def test_long_scan_calls_run_side_by_side_on_the_cores_a_call_leaves_idle() -> None:
    running, most = [0], [0]
    lock = threading.Lock()

    def scorer(batch: list[list[int]]) -> np.ndarray:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.02)
        with lock:
            running[0] -= 1
        return np.zeros(len(batch))

    async def main(long_calls: int) -> None:
        batcher = MicroBatcher(scorer, max_batch=4, max_wait_us=0, long_batch=4, long_calls=long_calls)
        await asyncio.gather(*batcher.submit([[k] for k in range(32)], long=True))
        await batcher.aclose()

    run(main(1))
    assert most[0] == 1
    run(main(2))
    assert most[0] == 2
