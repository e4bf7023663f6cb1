"""Which traces leave the gateway: the sampled ones, and a failed request's whatever the ratio."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from gateway.observability.trace_sampling import ExportSampledOrFailed, RatioOrParent


def _tracing(ratio: float) -> tuple[TracerProvider, InMemorySpanExporter, ExportSampledOrFailed]:
    exported = InMemorySpanExporter()
    keep = ExportSampledOrFailed(SimpleSpanProcessor(exported))
    provider = TracerProvider(sampler=RatioOrParent(ratio))
    provider.add_span_processor(keep)
    return provider, exported, keep


def _request(provider: TracerProvider, failed: bool = False, refused: bool = False) -> None:
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("POST /v1/chat/completions") as root:
        with tracer.start_as_current_span("stage.parse"):
            pass
        if refused:
            root.set_attribute("error.type", "waf_blocked")
        if failed:
            root.set_status(Status(StatusCode.ERROR, "502"))


def test_at_ratio_zero_only_failed_and_refused_requests_are_exported_each_whole() -> None:
    provider, exported, keep = _tracing(0.0)
    _request(provider)
    assert exported.get_finished_spans() == ()
    _request(provider, failed=True)
    _request(provider, refused=True)
    spans = exported.get_finished_spans()
    assert [s.name for s in spans] == ["stage.parse", "POST /v1/chat/completions"] * 2
    assert len({s.context.trace_id for s in spans}) == 2
    assert keep._held == {}, "nothing is held once its request ended"


def test_at_ratio_one_every_trace_is_exported_as_it_ends() -> None:
    provider, exported, keep = _tracing(1.0)
    _request(provider)
    assert [s.name for s in exported.get_finished_spans()] == ["stage.parse", "POST /v1/chat/completions"]


def test_a_span_ending_after_its_unsampled_request_is_not_held() -> None:
    provider, exported, keep = _tracing(0.0)
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("POST /v1/chat/completions"):
        late = tracer.start_span("late")
    late.end()
    assert keep._held == {} and exported.get_finished_spans() == ()


def test_unsampled_spans_are_recorded_and_say_so_in_their_flags() -> None:
    provider, _, _ = _tracing(0.0)
    with provider.get_tracer("test").start_as_current_span("root") as span:
        assert span.is_recording() and not span.get_span_context().trace_flags.sampled
