"""docs/metrics.md lists every metric the gateway and the engine register, and nothing else: dashboards and alert
rules are written from it, so a metric added, renamed or dropped without it fails here."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from backend_engine.metrics import EngineMetrics
from gateway.guard.runtime import Guard
from gateway.observability.telemetry import Metrics
from gateway.ratelimit.outbox import SettlementOutbox

REFERENCE = Path(__file__).parents[2] / "docs" / "metrics.md"


def _exposed(registry: CollectorRegistry) -> dict[str, str]:
    """Each family's name as /metrics shows it (a counter's with `_total`; a histogram's series add suffixes), and
    its type."""
    return {family.name + ("_total" if family.type == "counter" else ""): family.type for family in registry.collect()}


def _everything_the_gateway_registers() -> dict[str, str]:
    metrics = Metrics()
    metrics.count_per_key()  # telemetry.per_key_metrics
    metrics.watch_policy(lambda: "sha256:0")
    metrics.watch_config(lambda: "0")
    metrics.watch_settlements(SettlementOutbox(lambda settlement: None, 1))  # with a rate-limit store
    Guard(metrics.registry)
    return _exposed(metrics.registry)


def _documented() -> dict[str, str]:
    """The reference's table rows: `| `name` | type | labels | what |`."""
    rows = re.findall(r"^\| `([a-z0-9_:]+)` \| ([a-z]+) \|", REFERENCE.read_text(), flags=re.MULTILINE)
    return dict(rows)


def test_every_registered_metric_is_documented_and_every_documented_one_registered() -> None:
    registered = _everything_the_gateway_registers() | _exposed(EngineMetrics("model").registry)
    documented = _documented()
    assert registered.keys() - documented.keys() == set(), "registered but not in docs/metrics.md"
    assert documented.keys() - registered.keys() == set(), "in docs/metrics.md but registered nowhere"
    assert documented == registered, "a metric's type in docs/metrics.md is not the one registered"
