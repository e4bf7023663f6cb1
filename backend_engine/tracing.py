"""OpenTelemetry spans for one request, continuing the caller's traceparent.

Spans are written when the request finishes, from the timestamps the engine recorded, so the step
loop never blocks on telemetry: `engine.request` with children `engine.queue` (arrival to first
scheduled), `engine.prefill` (tokens computed vs cached) and `engine.decode` (tokens, time per
output token). With no tracer provider configured these are no-ops.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("portcullis.engine")


def extract_context(headers: Mapping[str, str]) -> Any:
    """The incoming W3C traceparent/tracestate as an OpenTelemetry context (None without one)."""
    carrier = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
    return _propagator.extract(carrier) if carrier else None


def _ns(mono: float, offset: float) -> int:
    return int((mono + offset) * 1e9)


def record_request(seq: Any, model_name: str) -> None:
    """Emit the request's spans (called once, when it finishes)."""
    offset = time.time() - time.monotonic()  # monotonic -> wall clock
    end = seq.finished_time or time.monotonic()
    root = _tracer.start_span(
        "engine.request",
        context=seq.trace_context,
        kind=trace.SpanKind.SERVER,
        start_time=_ns(seq.arrival_time, offset),
        attributes={
            "gen_ai.request.model": model_name,
            "gen_ai.usage.input_tokens": seq.num_prompt_tokens,
            "gen_ai.usage.output_tokens": seq.num_output_tokens,
            "engine.request_id": seq.request_id,
            "engine.finish_reason": str(seq.finish_reason),
            "engine.preemptions": seq.num_preemptions,
        },
    )
    ctx = trace.set_span_in_context(root)
    sched = seq.first_scheduled_time or end
    _tracer.start_span("engine.queue", context=ctx, start_time=_ns(seq.arrival_time, offset)).end(_ns(sched, offset))
    first = seq.first_token_time or end
    cached = max(seq.num_cached_tokens, 0)
    _tracer.start_span(
        "engine.prefill",
        context=ctx,
        start_time=_ns(sched, offset),
        attributes={
            "engine.prefill.tokens_computed": seq.num_prompt_tokens - cached,
            "engine.prefill.tokens_cached": cached,
            "engine.prefill.compute_seconds": seq.prefill_compute_s,
        },
    ).end(_ns(first, offset))
    n = seq.num_output_tokens
    dec = _tracer.start_span(
        "engine.decode",
        context=ctx,
        start_time=_ns(first, offset),
        attributes={
            "engine.decode.tokens": n,
            "engine.decode.time_per_output_token_s": (end - first) / (n - 1) if n > 1 else 0.0,
        },
    )
    dec.end(_ns(end, offset))
    root.end(_ns(end, offset))


def configure_from_env(service_name: str = "portcullis-engine") -> bool:
    """Install an SDK tracer provider with an OTLP/HTTP exporter when OTEL_EXPORTER_OTLP_ENDPOINT is set. The SDK reads
    the other standard variables: its sampler follows the parent's sampled flag (OTEL_TRACES_SAMPLER's default), and
    the service is named `service_name` unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES name it."""
    if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") and not os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    # the SDK reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; an attribute given here would override them
    provider = TracerProvider(resource=Resource.create({} if named else {"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True
