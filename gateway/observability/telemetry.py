"""OpenTelemetry tracing and Prometheus metrics, built per app (no global providers or registries).

With `listen.workers` above 1 each worker process writes its samples to files in the directory the supervisor names in
PROMETHEUS_MULTIPROC_DIR (prometheus_client's multiprocess mode), and the one worker serving /metrics sums them.

With OTLP export off, spans are created by an always-off sampler: trace ids still exist (for the access log and the
`traceparent` sent upstream) but nothing is recorded, so tracing costs next to nothing until an operator enables it.
With it on, every span is recorded and `telemetry.sampling_ratio` chooses the traces exported, a failed or refused
request's always (gateway/observability/trace_sampling.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    TraceFlags,
    Tracer,
    format_span_id,
    format_trace_id,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.config import GatewayConfig, OtlpConfig, TelemetryConfig
from gateway.observability.metric_tallies import Tallies
from gateway.observability.otel_env import with_environment
from gateway.observability.trace_sampling import ExportSampledOrFailed, RatioOrParent
from gateway.observability.version import VERSION

if TYPE_CHECKING:
    from gateway.ratelimit.outbox import SettlementOutbox

ACCESS_LOGGER = "portcullis.access"
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when first imported
OTHER_MODEL = "other"  # the model label of every model the config does not name

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_STAGE_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.1)


def cached_labels(metric: Counter | Histogram | Gauge) -> Callable[..., Any]:
    """`metric.labels`, remembered per label values: labels() builds a tuple and takes a lock each call (~2 µs), and a
    request looks up several children. Label values are positional."""
    return functools.lru_cache(maxsize=4096)(metric.labels)


class Metrics:
    """The gateway's Prometheus metrics, in a registry of its own.

    Every label value is the gateway's own (routes, stages, pools, replicas, policy rule ids, error codes, status
    codes) except the model, which the client names: `model_label` keeps that one to the configured models.
    """

    def __init__(self, known_models: frozenset[str] = frozenset()) -> None:
        self.known_models = known_models
        self.registry = CollectorRegistry()
        self.tallies = Tallies()  # per-request updates, published once a second and before a scrape
        self._all_workers: CollectorRegistry | None = None  # with workers: every worker's samples, read from files
        if directory := os.environ.get(MULTIPROCESS_DIR_ENV):
            self._all_workers = CollectorRegistry()
            MultiProcessCollector(self._all_workers, directory)
        r = self.registry
        self.requests = Counter("portcullis_requests", "Requests by route and status", ["route", "status"], registry=r)
        self.request_duration = Histogram(
            "portcullis_request_duration_seconds",
            "Whole request, first byte in to last byte out",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stage_duration = Histogram(
            "portcullis_stage_duration_seconds",
            "Time spent in each pipeline stage",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        self.upstream_ttft = Histogram(
            "portcullis_upstream_ttft_seconds",
            "Upstream time to first response chunk",
            ["pool"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_duration = Histogram(
            "portcullis_upstream_duration_seconds",
            "Upstream call, request sent to last chunk",
            ["pool"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "portcullis_upstream_errors", "Failed upstream attempts by kind", ["pool", "kind"], registry=r
        )
        self.upstream_outstanding = Gauge(
            "portcullis_upstream_outstanding_requests",
            "Requests in flight per replica (with workers: those of the worker serving /metrics)",
            ["pool", "replica"],
            registry=r,
            multiprocess_mode="livesum",  # a restarted worker's old value leaves with it
        )
        self.key_store_synced = Gauge(
            "portcullis_key_store_synced_timestamp_seconds",
            "Unix time this process last read the key store; with workers, the stalest live worker's",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.tokens = Counter(
            "portcullis_tokens", "Tokens reported by upstreams", ["pool", "model", "kind"], registry=r
        )
        self.billed_requests = Counter(
            "portcullis_billed_requests",
            "Requests per tenant and model, whatever their outcome",
            ["tenant", "model"],
            registry=r,
        )
        self.billed_tokens = Counter(
            "portcullis_billed_tokens",
            "Tokens charged per tenant and model after reconciliation (prompt, cached_prompt, completion, cache_hit)",
            ["tenant", "model", "kind"],
            registry=r,
        )
        self.spend = Counter(
            "portcullis_spend",
            "Spend per tenant and model, priced by the policy's price table",
            ["tenant", "model", "currency"],
            registry=r,
        )
        self.usage_over_reservation = Counter(
            "portcullis_usage_over_reservation",
            "Requests an upstream reported more completion tokens for than they reserved (max_tokens x n): charged as "
            "reported, and so past what their budgets admitted",
            ["tenant", "model"],
            registry=r,
        )
        self.budgets_exceeded = Counter(
            "portcullis_budget_exceeded",
            "Requests refused for a budget (policy rule id, or 'key' for a key's own)",
            ["budget", "backend"],
            registry=r,
        )
        self.budget_thresholds = Counter(
            "portcullis_budget_soft_threshold_crossings",
            "Soft budget thresholds crossed (once per budget period, payer and gateway process)",
            ["budget", "threshold"],
            registry=r,
        )
        self.policy_reloads = Counter(
            "portcullis_policy_reload",
            "Reloads of the policy directory, by result: applied, unchanged, refused (invalid: the running policy set "
            "serves on)",
            ["result"],
            registry=r,
        )
        self.config_reloads = Counter(
            "portcullis_config_reload",
            "Reloads of portcullis.yaml, by result: applied, unchanged, refused (invalid, or a change that needs a "
            "restart; the running config serves on)",
            ["result"],
            registry=r,
        )
        self.fallbacks = Counter(
            "portcullis_fallbacks",
            "Requests moved to a fallback target, by requested model, target (model or pool) and trigger",
            ["model", "to", "trigger"],
            registry=r,
        )
        self.cache_requests = Counter(
            "portcullis_cache_requests",
            "Requests the response cache policy covers, by route and result (hit, miss, bypass: not cacheable)",
            ["route", "result"],
            registry=r,
        )
        self.admission_queue_wait = Histogram(
            "portcullis_admission_queue_wait_seconds",
            "Time requests waited for KV capacity",
            ["pool"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ratelimit_decisions = Counter(
            "portcullis_ratelimit_decisions",
            "Rate-limit decisions per limit",
            ["limit", "result", "backend"],
            registry=r,
        )
        self.ratelimit_backend_errors = Counter(
            "portcullis_ratelimit_backend_errors", "Rate-limit store failures", ["backend"], registry=r
        )
        self.ratelimit_tokens_charged = Counter(
            "portcullis_ratelimit_tokens_charged",
            "Tokens charged to token limits after reconciliation",
            ["limit"],
            registry=r,
        )
        self.waf_requests = Counter(
            "portcullis_waf_requests",
            "Requests the WAF judged, by verdict: allow, log (only monitor rules matched), monitor (would have been "
            "refused, in monitor mode), block",
            ["action"],
            registry=r,
        )
        self.waf_rule_matches = Counter(
            "portcullis_waf_rule_matches",
            "WAF rule matches by pack ('policy' for the policy's own rules), rule id and what the match did (block, "
            "monitor, score, redact, tag)",
            ["pack", "rule", "action"],
            registry=r,
        )
        self._register_read_at_scrape(_BuildInfo())

    def count_per_key(self) -> None:
        """Billing counters per API key id as well (`telemetry.per_key_metrics`)."""
        r = self.registry
        self.key_billed_requests = Counter(
            "portcullis_key_billed_requests", "Requests per API key id and model", ["key_id", "model"], registry=r
        )
        self.key_billed_tokens = Counter(
            "portcullis_key_billed_tokens",
            "Tokens charged per API key id and model (prompt, cached_prompt, completion, cache_hit)",
            ["key_id", "model", "kind"],
            registry=r,
        )
        self.key_spend = Counter(
            "portcullis_key_spend", "Spend per API key id and model", ["key_id", "model", "currency"], registry=r
        )

    def watch_policy(self, version: Callable[[], str]) -> None:
        """Report, at each scrape, the version of the policy set this process enforces (with workers: the worker
        serving /metrics; each reloads on its own)."""
        self._register_read_at_scrape(
            _VersionInfo(
                "portcullis_policy_info",
                "The policy set enforced (its version: a hash of the policy files), always 1",
                version,
            )
        )

    def watch_config(self, version: Callable[[], str]) -> None:
        """Report, at each scrape, the version of portcullis.yaml this process serves (a hash of it as validated)."""
        self._register_read_at_scrape(
            _VersionInfo(
                "portcullis_config_info",
                "The portcullis.yaml served (its version: a hash of the config as validated), always 1",
                version,
            )
        )

    def watch_settlements(self, outbox: SettlementOutbox) -> None:
        """Report, at each scrape, the settlements kept for the rate-limit store and those it never got (with
        workers: those of the worker serving /metrics)."""
        self._register_read_at_scrape(_SettlementsCollector(outbox))

    def _register_read_at_scrape(self, collector: Collector) -> None:
        """A collector that reads this process's state when scraped; no file holds it for other workers to sum."""
        self.registry.register(collector)
        if self._all_workers is not None:
            self._all_workers.register(collector)

    def exposition(self) -> bytes:
        """The /metrics text: this process's metrics, or with workers every worker's, summed."""
        return generate_latest(self._all_workers if self._all_workers is not None else self.registry)

    def model_label(self, model: str) -> str:
        """The model as a label value: a configured model's name, else `other`. A label per name a client sends
        would let any client grow /metrics (and Prometheus) without bound: 3,000 made-up names made it 3.5 MB."""
        return model if model in self.known_models else OTHER_MODEL


class _BuildInfo:
    def collect(self):
        info = GaugeMetricFamily(
            "portcullis_build_info", "The running release, always 1", labels=["version", "python_version"]
        )
        info.add_metric([VERSION, platform.python_version()], 1)
        yield info


class _VersionInfo:
    """An info gauge read at each scrape: `name{version=...} 1`, the version a callable gives now."""

    def __init__(self, name: str, documentation: str, version: Callable[[], str]) -> None:
        self._name, self._documentation, self._version = name, documentation, version

    def collect(self):
        info = GaugeMetricFamily(self._name, self._documentation, labels=["version"])
        info.add_metric([self._version()], 1)
        yield info


class _SettlementsCollector:
    def __init__(self, outbox: SettlementOutbox) -> None:
        self._outbox = outbox

    def collect(self):
        yield GaugeMetricFamily(
            "portcullis_ratelimit_settlements_pending",
            "Settlements kept for the rate-limit store until it takes them",
            value=len(self._outbox),
        )
        dropped = CounterMetricFamily(
            "portcullis_ratelimit_settlements_dropped",
            "Settlements (or their token corrections) the rate-limit store never got",
            labels=["reason"],
        )
        for reason, count in self._outbox.dropped.items():
            dropped.add_metric([reason], count)
        yield dropped


def configured_models(config: GatewayConfig) -> frozenset[str]:
    """The models the operator named: `models` and every pool's `models`."""
    return frozenset(m.name for m in config.models) | frozenset(n for p in config.pools for n in p.models)


def build_tracer_provider(
    config: TelemetryConfig, exporter: SpanExporter | None = None, environ: Mapping[str, str] = os.environ
) -> TracerProvider:
    """A provider that exports over OTLP when enabled (or to `exporter`), else samples nothing. The config's keys
    override the standard OTEL_* variables (gateway/observability/otel_env.py); which traces are exported:
    gateway/observability/trace_sampling.py.
    """
    config = with_environment(config, environ)
    resource = Resource.create({"service.name": config.service_name, "service.version": VERSION})
    if exporter is None and config.otlp.enabled:
        exporter = _otlp_exporter(config.otlp)
    if exporter is None:
        return TracerProvider(resource=resource, sampler=ALWAYS_OFF)
    provider = TracerProvider(resource=resource, sampler=RatioOrParent(config.sampling_ratio))
    provider.add_span_processor(ExportSampledOrFailed(BatchSpanProcessor(exporter, schedule_delay_millis=500)))
    return provider


def records_spans(provider: TracerProvider) -> bool:
    """Whether any span can be recorded: not while export is off (the always-off sampler)."""
    return provider.sampler is not ALWAYS_OFF


def _otlp_exporter(otlp: OtlpConfig) -> SpanExporter:
    headers = _parse_headers(os.environ.get(otlp.headers_env, "")) if otlp.headers_env else None
    if otlp.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        endpoint = otlp.endpoint.removeprefix("http://").removeprefix("https://")
        return GrpcExporter(endpoint=endpoint, insecure=otlp.endpoint.startswith("http://"), headers=headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=otlp.endpoint.rstrip("/") + "/v1/traces", headers=headers)


def _parse_headers(raw: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
    return {k.strip(): v.strip() for k, v in pairs}


def incoming_trace(headers: Mapping[str, str], trust_client: bool) -> tuple[Context, list[Link]]:
    """The parent context and links of a request's SERVER span.

    Trusted, the client's traceparent is continued. At an edge it is not (the default): each request starts its own
    root, so its sampling follows this gateway's sampler, not a flag the client set, and a client cannot choose its
    trace id; a link to the client's context keeps the two traces joinable.
    """
    if "traceparent" not in headers:  # most requests: nothing to continue or link
        return Context(), []
    client = propagate.extract(headers)
    if trust_client:
        return client, []
    sent = trace.get_current_span(client).get_span_context()
    return Context(), [Link(sent)] if sent.is_valid else []


def server_span(
    tracer: Tracer,
    recording: bool,
    ids: IdGenerator,
    name: str,
    parent: Context,
    links: list[Link],
    attributes: Callable[[], dict[str, str]],
) -> AbstractContextManager[Span]:
    """A request's SERVER span: current while the request runs, so its stages' spans are its children. With
    `recording` off (the provider samples nothing) only its ids are used (the access log, the upstream's
    traceparent): made from `ids` (the provider's), not made current, a fraction of a span's cost per request."""
    if recording:
        return tracer.start_as_current_span(
            name, context=parent, links=links, kind=SpanKind.SERVER, attributes=attributes()
        )
    return contextlib.nullcontext(unsampled_span(ids, parent))


def unsampled_span(ids: IdGenerator, parent: Context) -> Span:
    """The span the SDK's tracer starts under a provider that samples nothing (build_tracer_provider's ALWAYS_OFF),
    without the tracer's and the sampler's calls: the parent's trace (a trusted caller's) with its trace state and
    its random-trace-id flag, or a new trace; a new span id; not sampled."""
    context = trace.get_current_span(parent).get_span_context()
    if context.is_valid:
        trace_id, random, state = context.trace_id, context.trace_flags.random_trace_id, context.trace_state
    else:
        trace_id, random, state = ids.generate_trace_id(), ids.is_trace_id_random(), None
    flags = TraceFlags(TraceFlags.RANDOM_TRACE_ID if random else TraceFlags.DEFAULT)
    return NonRecordingSpan(SpanContext(trace_id, ids.generate_span_id(), False, flags, state))


TraceHeaders = Callable[[dict[str, str], Span], None]


def trace_headers(recording: bool) -> TraceHeaders:
    """How an upstream call's headers carry its span's trace: through the global propagators (OTEL_PROPAGATORS).
    Where no span can record and those are the default ones (W3C trace context and baggage), `traceparent` (and
    `tracestate`, where the trace has one) is written directly, as they write it: with no span current, a request's
    context holds no baggage, and the propagators' calls cost more than the header. Decided once, at start."""
    if recording or not _default_propagators(propagate.get_global_textmap()):
        return _propagated
    return _trace_context


def _default_propagators(textmap: object) -> bool:
    propagators = getattr(textmap, "_propagators", None)
    kinds = [type(p) for p in propagators] if isinstance(textmap, CompositePropagator) and propagators else []
    return kinds == [TraceContextTextMapPropagator, W3CBaggagePropagator]


def _propagated(headers: dict[str, str], span: Span) -> None:
    propagate.inject(headers, context=set_span_in_context(span))


def _trace_context(headers: dict[str, str], span: Span) -> None:
    context = span.get_span_context()
    if context == INVALID_SPAN_CONTEXT:
        return
    headers["traceparent"] = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    if context.trace_state:
        headers["tracestate"] = context.trace_state.to_header()


def trace_ids(span: Span) -> tuple[str, str]:
    ctx = span.get_span_context()
    return format_trace_id(ctx.trace_id), format_span_id(ctx.span_id)
