"""Per-request metric updates counted in plain numbers, added to the Prometheus metrics once a second.

A request makes about a dozen histogram observations (each pipeline stage, the upstream's first byte and whole
answer, the request) and a few counter increments. In prometheus_client each takes a lock and several calls; here
an observation is a bisect and two additions. `Tallies.publish` adds what was counted to the metrics: every
PUBLISH_INTERVAL, before this process answers a scrape of /metrics, and on stop. So a scrape this process answers
is exact; with workers, another worker's last second may wait for its next publish (as its billing counters do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, TypeVar, cast

from prometheus_client import Counter, Histogram

PUBLISH_INTERVAL = 1.0  # seconds

log = logging.getLogger(__name__)


class HistogramTally:
    """Observations of one labelled histogram, counted per bucket until published."""

    __slots__ = ("_child", "_bounds", "_counts", "_sum")

    def __init__(self, child: Any) -> None:  # a Histogram's labelled child
        self._child = child
        self._bounds = tuple(child._upper_bounds)  # ends with +Inf: every value has a bucket
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # the first bucket whose bound is >= value, as observe()
        self._sum += value

    def publish(self) -> None:
        counts, self._counts = self._counts, [0] * len(self._bounds)
        if not any(counts):
            return
        # prometheus_client keeps a histogram as one value per bucket (not cumulative) and a sum: add to them, as
        # many observe() calls would
        self._child._sum.inc(self._sum)
        self._sum = 0.0
        for bucket, count in zip(self._child._buckets, counts):
            if count:
                bucket.inc(count)


class CounterTally:
    """Increments of one labelled counter, summed until published."""

    __slots__ = ("_child", "_amount")

    def __init__(self, child: Any) -> None:  # a Counter's labelled child
        self._child = child
        self._amount: float = 0

    def inc(self, amount: float = 1) -> None:
        self._amount += amount

    def publish(self) -> None:
        if self._amount:
            amount, self._amount = self._amount, 0
            self._child.inc(amount)


T = TypeVar("T", HistogramTally, CounterTally)


class Tallies:
    """The tallies of one metrics registry, and what else publishes with them (billing's totals)."""

    def __init__(self) -> None:
        self._tallies: dict[tuple[int, tuple[str, ...]], HistogramTally | CounterTally] = {}  # (metric, labels)
        self._publishers: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None

    def histogram(self, metric: Histogram) -> Callable[..., HistogramTally]:
        """Like `metric.labels` (label values positional), for the tally of that child."""
        return self._labels(metric, HistogramTally)

    def counter(self, metric: Counter) -> Callable[..., CounterTally]:
        """Like `metric.labels` (label values positional), for the tally of that child."""
        return self._labels(metric, CounterTally)

    def _labels(self, metric: Histogram | Counter, kind: type[T]) -> Callable[..., T]:
        def labels(*values: str) -> T:
            found = self._tallies.get((id(metric), values))
            if found is None:
                found = self._tallies[id(metric), values] = kind(metric.labels(*values))
            return cast(T, found)

        return labels

    def also_publish(self, publish: Callable[[], None]) -> None:
        self._publishers.append(publish)

    def publish(self) -> None:
        """Add what was counted to the metrics; one that fails (a value prometheus_client refuses) spares the rest."""
        for publish in [*(tally.publish for tally in list(self._tallies.values())), *self._publishers]:
            try:
                publish()
            except Exception:
                log.exception("metrics: a tally could not be published")

    def start(self) -> None:
        self._task = asyncio.create_task(self._publish_forever(), name="metrics-publish")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.publish()

    async def _publish_forever(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL)
            self.publish()
