"""A request's trace where no span records: its span made as the SDK's tracer makes it, and the trace an upstream call
carries written directly, exactly as the propagators write it."""

from __future__ import annotations

import pytest
from opentelemetry import propagate
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import INVALID_SPAN, SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.observability.telemetry import trace_headers, unsampled_span

CALLER = {
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
}


def propagated(span) -> dict[str, str]:
    headers: dict[str, str] = {}
    propagate.inject(headers, context=set_span_in_context(span))
    return headers


@pytest.mark.parametrize("parent", [{}, CALLER], ids=["root", "trusted caller with tracestate"])
def test_an_unrecorded_spans_headers_are_the_propagators_own(parent: dict[str, str]) -> None:
    tracer = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    span = tracer.start_span("POST /v1/chat/completions", context=propagate.extract(parent), kind=SpanKind.SERVER)
    written: dict[str, str] = {}
    trace_headers(recording=False)(written, span)
    assert written == propagated(span)
    assert written["traceparent"].split("-")[1] == f"{span.get_span_context().trace_id:032x}"


def test_no_trace_writes_no_header() -> None:
    written: dict[str, str] = {}
    trace_headers(recording=False)(written, INVALID_SPAN)
    assert written == {} == propagated(INVALID_SPAN)


def test_other_propagators_write_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployment's OTEL_PROPAGATORS (here W3C trace context alone, without baggage) are used as they are."""

    class Marked(TraceContextTextMapPropagator):
        def inject(self, carrier, context=None, setter=None) -> None:  # type: ignore[no-untyped-def,override]
            carrier["x-marked"] = "1"

    monkeypatch.setattr(propagate, "get_global_textmap", lambda: CompositePropagator([Marked()]))
    span = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test").start_span("x", context=Context())
    written: dict[str, str] = {}
    trace_headers(recording=False)(written, span)
    assert written == {"x-marked": "1"}


@pytest.mark.parametrize(
    "parent",
    [{}, CALLER, {**CALLER, "traceparent": CALLER["traceparent"][:-2] + "02"}, {"traceparent": "00-0-0-01"}],
    ids=["root", "trusted caller with tracestate", "caller with a random trace id", "invalid traceparent"],
)
def test_an_unsampled_span_is_the_one_the_sdk_starts(parent: dict[str, str]) -> None:
    """The same trace, flags and trace state as the SDK's tracer under the always-off sampler; a new span id."""
    provider = TracerProvider(sampler=ALWAYS_OFF)
    context = propagate.extract(parent)
    ours = unsampled_span(provider.id_generator, context).get_span_context()
    sdks = provider.get_tracer("test").start_span("x", context=context, kind=SpanKind.SERVER).get_span_context()
    assert ours.is_valid and not ours.is_remote and ours.span_id != sdks.span_id
    assert (ours.trace_flags, ours.trace_state, ours.is_remote) == (sdks.trace_flags, sdks.trace_state, sdks.is_remote)
    if "00-0af7" in parent.get("traceparent", ""):
        assert ours.trace_id == sdks.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    else:  # a trace of its own, new for each span
        assert ours.trace_id != sdks.trace_id
