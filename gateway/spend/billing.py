"""What a finished request cost, counted per tenant and model (and per key, where enabled) and written to the spend
ledger: the tokens it is charged (the reconciliation token limits and budgets settle on, gateway/spend/charge.py)
priced by the policy's price table (`spec.prices`).

Labels stay bounded: tenants come from the configured and stored keys, models are the configured ones or `other`
(`Metrics.model_label`), key ids are labelled only when `telemetry.per_key_metrics` is on, the first
`telemetry.max_metric_keys` of them, the rest as `other`. A request refused before auth has no tenant and is not
billed.

A request adds to plain totals; they reach the Prometheus counters with the other per-request tallies
(gateway/observability/metric_tallies.py): once a second and before this process answers a scrape of /metrics (with
workers, another worker's last second may wait for its next publish). A counter increment takes a lock and three calls
in prometheus_client, and a request made four or five of them.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config import TelemetryConfig
from gateway.context import RequestContext
from gateway.observability.telemetry import Metrics, cached_labels
from gateway.policy.loader import PolicySet
from gateway.spend.charge import Charge, charge
from gateway.spend.ledger import SpendLedger
from gateway.spend.store import NANOS

_KINDS = ("prompt", "cached_prompt", "completion", "cache_hit")  # cache_hit: answered from the response cache
OTHER_KEYS = "other"  # the key label of keys beyond `telemetry.max_metric_keys`

# (per key?, tenant or key label, model label, currency) → [requests, prompt, cached prompt, completion, cache hit
# tokens, nanos]
Totals = dict[tuple[bool, str, str, str], list[int]]


class Billing:
    def __init__(
        self, metrics: Metrics, policies: Callable[[], PolicySet], ledger: SpendLedger, telemetry: TelemetryConfig
    ) -> None:
        self._metrics = metrics
        self._policies = policies
        self._ledger = ledger
        self._requests = cached_labels(metrics.billed_requests)
        self._tokens = cached_labels(metrics.billed_tokens)
        self._spend = cached_labels(metrics.spend)
        self._key_labels: set[str] | None = set() if telemetry.per_key_metrics else None
        self._max_key_labels = telemetry.max_metric_keys
        self._pending: Totals = {}
        metrics.tallies.also_publish(self.publish)
        if self._key_labels is not None:
            metrics.count_per_key()
            self._key_requests = cached_labels(metrics.key_billed_requests)
            self._key_tokens = cached_labels(metrics.key_billed_tokens)
            self._key_spend = cached_labels(metrics.key_spend)

    def record(self, ctx: RequestContext) -> Charge | None:
        """Count the request's tokens and spend; what it was charged, or None for a request no tenant sent. Usage
        an upstream reported above the request's reservation is counted apart (`portcullis_usage_over_reservation`)."""
        if ctx.tenant is None:
            return None
        prices = self._policies().base.spec.prices
        charged = charge(ctx, prices)
        self._ledger.record(
            ctx.key_id or "",
            ctx.tenant,
            ctx.model,
            charged.prompt,
            charged.cached,
            charged.completion,
            charged.cost_nanos,
            served=ctx.replica is not None and ctx.status == 200,  # else refused, by the gateway or upstream
            cache_hit=charged.cache_hit,
        )
        model = self._metrics.model_label(ctx.model)
        if charged.over_reservation:  # rare: a counter of its own, incremented at once
            self._metrics.usage_over_reservation.labels(ctx.tenant, model).inc()
        self._add((False, ctx.tenant, model, prices.currency), charged)
        if self._key_labels is not None:
            self._add((True, self._key_label(ctx.key_id or ""), model, prices.currency), charged)
        return charged

    def _add(self, series: tuple[bool, str, str, str], charged: Charge) -> None:
        totals = self._pending.get(series)
        if totals is None:
            totals = self._pending[series] = [0, 0, 0, 0, 0, 0]
        totals[0] += 1
        if charged.cache_hit:
            totals[4] += charged.prompt + charged.completion
        else:
            totals[1] += charged.prompt - charged.cached
            totals[2] += charged.cached
            totals[3] += charged.completion
        totals[5] += charged.cost_nanos

    def publish(self) -> None:
        """Add what was counted since the last publish to the Prometheus counters."""
        pending, self._pending = self._pending, {}
        for (per_key, who, model, currency), (requests, *tokens, nanos) in pending.items():
            if per_key:
                counters = self._key_requests, self._key_tokens, self._key_spend
            else:
                counters = self._requests, self._tokens, self._spend
            counters[0](who, model).inc(requests)
            for kind, count in zip(_KINDS, tokens):
                if count:
                    counters[1](who, model, kind).inc(count)
            if nanos:
                counters[2](who, model, currency).inc(nanos / NANOS)

    def _key_label(self, key_id: str) -> str:
        labels = self._key_labels
        assert labels is not None
        if key_id in labels:
            return key_id
        if len(labels) < self._max_key_labels and key_id:
            labels.add(key_id)
            return key_id
        return OTHER_KEYS
