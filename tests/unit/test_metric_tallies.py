"""Tallied metrics: once published, the exposition is what prometheus_client's own observe() and inc() make."""

from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.observability.metric_tallies import Tallies

BUCKETS = (0.00001, 0.0001, 0.001, 0.01, 0.1, 1.0)


def metrics(registry: CollectorRegistry) -> tuple[Histogram, Counter]:
    histogram = Histogram("stage_seconds", "per stage", ["stage"], buckets=BUCKETS, registry=registry)
    counter = Counter("requests", "by route and status", ["route", "status"], registry=registry)
    return histogram, counter


def test_published_tallies_expose_what_direct_updates_do():
    direct, tallied = CollectorRegistry(), CollectorRegistry()
    direct_histogram, direct_counter = metrics(direct)
    histogram, counter = metrics(tallied)
    tallies = Tallies()
    stage, requests = tallies.histogram(histogram), tallies.counter(counter)
    rng = random.Random(3)
    # values on the bucket bounds themselves (a bound counts in its own bucket), between them, past the last one
    values = [*BUCKETS, 0.0, 2.5, *(rng.uniform(0, 0.2) for _ in range(500))]
    for round_ in range(3):  # publishing twice adds nothing twice
        for value in values:
            name = rng.choice(["parse", "auth"])
            direct_histogram.labels(name).observe(value)
            stage(name).observe(value)
            status = rng.choice(["200", "429"])
            direct_counter.labels("chat", status).inc()
            requests("chat", status).inc()
        tallies.publish()
        tallies.publish()
        assert _samples(tallied) == _samples(direct), round_


def test_what_publishes_with_the_tallies_runs_on_stop():
    published = []
    tallies = Tallies()
    tallies.also_publish(lambda: published.append(True))

    async def run() -> None:
        tallies.start()
        await tallies.aclose()

    asyncio.run(run())
    assert published == [True]


def test_a_tally_prometheus_refuses_spares_the_others():
    registry = CollectorRegistry()
    histogram, counter = metrics(registry)
    tallies = Tallies()
    counter_labels = tallies.counter(counter)
    counter_labels("chat", "200").inc(-5)  # a counter cannot go back: prometheus_client raises on publish
    counter_labels("chat", "429").inc(2)
    tallies.histogram(histogram)("parse").observe(0.003)
    tallies.publish()
    assert registry.get_sample_value("requests_total", {"route": "chat", "status": "429"}) == 2
    assert registry.get_sample_value("stage_seconds_count", {"stage": "parse"}) == 1
    tallies.publish()  # the refused amount is dropped, not offered again every second
    assert registry.get_sample_value("requests_total", {"route": "chat", "status": "200"}) == 0


def _samples(registry: CollectorRegistry) -> list[str]:
    """The exposition, less the creation times (the two registries were made at different instants), values to 12
    significant digits (a sum added up in another order differs in the last ones)."""
    lines = []
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("#"):
            lines.append(line)
        elif "_created" not in line:
            name, value = line.rsplit(" ", 1)
            lines.append(f"{name} {float(value):.12g}")
    return lines
