"""Which traces are exported: a ratio of them, and every one whose request failed or was refused.

Whether a request fails is known only at its end, so with export on every span is recorded, and the choice is made
when the request's SERVER span (the trace's local root) ends:

- `RatioOrParent` decides the sampled flag as a trace starts: a `telemetry.sampling_ratio` share of the traces this
  gateway starts (by trace id, as the SDK's TraceIdRatioBased does), a trusted parent's own choice for a trace it
  continues. Spans outside that share are still recorded (RECORD_ONLY), so their flag travels unsampled in the
  `traceparent` an upstream gets: the bundled engine, and any OpenTelemetry-instrumented server, follows it.
- `ExportSampledOrFailed` hands a sampled span to the exporter at once; it holds an unsampled one until its trace's
  local root ends, and exports the trace's held spans when that root ended in error (status ERROR, or an
  `error.type`: every refusal, the WAF's and the guard's blocks included), dropping them otherwise. Spans are held
  only while their root is open (in-flight requests), so nothing accumulates.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult, TraceIdRatioBased
from opentelemetry.trace import Link, SpanContext, SpanKind, StatusCode, TraceFlags, TraceState, get_current_span
from opentelemetry.util.types import Attributes


class RatioOrParent(Sampler):
    """Records every span; samples a trusted parent's choice, else `ratio` of the traces by id."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self._by_id = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        parent = get_current_span(parent_context).get_span_context()
        if parent.is_valid:
            sampled, state = parent.trace_flags.sampled, parent.trace_state
        else:
            sampled, state = self._by_id.should_sample(parent_context, trace_id, name).decision.is_sampled(), None
        # the span gets the attributes a sampler returns, not those it was started with: both decisions record
        return SamplingResult(Decision.RECORD_AND_SAMPLE if sampled else Decision.RECORD_ONLY, attributes, state)

    def get_description(self) -> str:
        return f"RatioOrParent{{{self.ratio}}}"


@dataclass(slots=True)
class _HeldTrace:
    open_roots: int = 0
    failed: bool = False
    spans: list[ReadableSpan] = field(default_factory=list)


class ExportSampledOrFailed(SpanProcessor):
    """Sampled spans to `export` as they end; an unsampled trace's spans too when its request failed."""

    def __init__(self, export: SpanProcessor) -> None:
        self._export = export
        self._held: dict[int, _HeldTrace] = {}
        self._lock = threading.Lock()

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if not span.context.trace_flags.sampled and _is_local_root(span):
            with self._lock:
                self._held.setdefault(span.context.trace_id, _HeldTrace()).open_roots += 1

    def on_end(self, span: ReadableSpan) -> None:
        context = span.context
        if context is None:
            return
        if context.trace_flags.sampled:
            self._export.on_end(span)
            return
        with self._lock:
            held = self._held.get(context.trace_id)
            if held is None:  # its root already ended (or never was this gateway's): not kept
                return
            held.spans.append(span)
            if not _is_local_root(span):
                return
            held.open_roots -= 1
            held.failed = held.failed or _failed(span)
            if held.open_roots:
                return
            del self._held[context.trace_id]
        if held.failed:
            for kept in held.spans:
                self._export.on_end(_marked_sampled(kept))

    def shutdown(self) -> None:
        self._export.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._export.force_flush(timeout_millis)


def _is_local_root(span: ReadableSpan) -> bool:
    return span.parent is None or span.parent.is_remote


def _failed(span: ReadableSpan) -> bool:
    return span.status.status_code is StatusCode.ERROR or "error.type" in (span.attributes or {})


def _marked_sampled(span: ReadableSpan) -> ReadableSpan:
    """A copy of a kept span that says it is sampled, as the exporting processor wants of what it exports."""
    old = span.context
    assert old is not None
    context = SpanContext(old.trace_id, old.span_id, old.is_remote, TraceFlags(TraceFlags.SAMPLED), old.trace_state)
    return ReadableSpan(
        name=span.name,
        context=context,
        parent=span.parent,
        resource=span.resource,
        attributes=span.attributes,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )
