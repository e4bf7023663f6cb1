"""What a finished request cost, counted per tenant and model (and per key, where enabled) and written to the spend
ledger: the tokens it is charged (the reconciliation token limits and budgets settle on, gateway/spend/charge.py)
priced by the policy's price table (`spec.prices`).

Labels stay bounded: tenants come from the configured and stored keys, models are the configured ones or `other`
(`Metrics.model_label`), key ids are labelled only when `telemetry.per_key_metrics` is on, the first
`telemetry.max_metric_keys` of them, the rest as `other`. A request refused before auth has no tenant and is not
billed.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.config import TelemetryConfig
from gateway.context import RequestContext
from gateway.policy.loader import PolicySet
from gateway.spend.charge import charge
from gateway.spend.ledger import SpendLedger
from gateway.spend.store import NANOS
from gateway.telemetry import Metrics, cached_labels

_KINDS = ("prompt", "cached_prompt", "completion")
OTHER_KEYS = "other"  # the key label of keys beyond `telemetry.max_metric_keys`


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
        if self._key_labels is not None:
            metrics.count_per_key()
            self._key_requests = cached_labels(metrics.key_billed_requests)
            self._key_tokens = cached_labels(metrics.key_billed_tokens)
            self._key_spend = cached_labels(metrics.key_spend)

    def record(self, ctx: RequestContext) -> float | None:
        """Count the request's tokens and spend; its cost, or None for a request no tenant sent."""
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
        )
        model = self._metrics.model_label(ctx.model)
        tokens = (charged.prompt - charged.cached, charged.cached, charged.completion)
        cost = charged.cost_nanos / NANOS
        self._count(self._requests, self._tokens, self._spend, ctx.tenant, model, tokens, cost, prices.currency)
        if self._key_labels is not None:
            key = self._key_label(ctx.key_id or "")
            self._count(
                self._key_requests, self._key_tokens, self._key_spend, key, model, tokens, cost, prices.currency
            )
        return cost

    @staticmethod
    def _count(
        requests: Callable,
        tokens_of: Callable,
        spend: Callable,
        who: str,
        model: str,
        tokens: tuple,
        cost: float,
        currency: str,
    ) -> None:
        requests(who, model).inc()
        for kind, count in zip(_KINDS, tokens):
            if count:
                tokens_of(who, model, kind).inc(count)
        if cost:
            spend(who, model, currency).inc(cost)

    def _key_label(self, key_id: str) -> str:
        labels = self._key_labels
        assert labels is not None
        if key_id in labels:
            return key_id
        if len(labels) < self._max_key_labels and key_id:
            labels.add(key_id)
            return key_id
        return OTHER_KEYS
