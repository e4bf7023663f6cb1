"""One trace per request, received on the wire: an in-test OTLP receiver decodes what the gateway exports."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.conftest import chat_body, free_port, pool


class Received:
    """Spans decoded from ExportTraceServiceRequest messages, flattened to dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            {
                                "service": service,
                                "name": span.name,
                                "kind": span.kind,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_id": span.parent_span_id.hex(),
                                "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                            }
                        )

    def wait_for(self, name: str, timeout: float = 10.0, trace_id: str | None = None) -> list[dict]:
        """Every span received once one named `name` has been (of trace `trace_id`, when given: that trace's)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                spans = [s for s in self.spans if trace_id is None or s["trace_id"] == trace_id]
                if any(s["name"] == name for s in spans):
                    return spans
            time.sleep(0.1)
        raise AssertionError(f"no span {name!r} exported; got {[s['name'] for s in self.spans]}")


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture(scope="module")
def http_receiver() -> Iterator[tuple[str, Received]]:
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["content-length"]))
            assert self.path == "/v1/traces" and self.headers["content-type"] == "application/x-protobuf"
            received.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", received
    server.shutdown()


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    received = Received()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.add(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield f"http://127.0.0.1:{port}", received
    server.stop(grace=None)


# One client for the module's requests: a bare httpx.post builds a client, and its TLS context, per call.
http = httpx.Client()


@pytest.fixture(scope="module")
def upstream(module_launcher):
    return module_launcher.fake_upstream()


@pytest.fixture(scope="module")
def http_traced(module_launcher, upstream, http_receiver):
    """A gateway exporting over OTLP/HTTP, shared by the tests that find their own request's trace (by the trace id
    its access-log line names), and its receiver."""
    endpoint, received = http_receiver
    return traced_gateway(module_launcher.gateway, upstream, endpoint, "http/protobuf"), received


def traced_gateway(gateway, upstream, endpoint: str, protocol: str, **telemetry):
    return gateway(
        {
            "pools": [pool("main", upstream.url)],
            "telemetry": {
                "service_name": "gw-under-test",
                "otlp": {"enabled": True, "endpoint": endpoint, "protocol": protocol},
                **telemetry,
            },
        }
    )


def test_one_trace_covers_stages_upstream_span_and_upstream_traceparent(http_traced, upstream):
    gw, received = http_traced
    response = http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True, max_tokens=5))
    assert response.status_code == 200

    trace_id = gw.access_log(response.headers["x-request-id"])["trace_id"]
    trace = received.wait_for("POST /v1/chat/completions", trace_id=trace_id)
    root = next(s for s in trace if s["name"] == "POST /v1/chat/completions")
    by_name = {s["name"]: s for s in trace}
    assert {"stage.parse", "stage.auth", "stage.route", "chat test-model"} <= set(by_name)
    for stage in ("stage.parse", "stage.auth", "stage.authority", "stage.route", "chat test-model"):
        assert by_name[stage]["parent_id"] == root["span_id"]
    for part in ("tokenize", "ratelimit"):  # an attempt's authorisation, read part by part
        assert by_name[part]["parent_id"] == by_name["stage.authority"]["span_id"]
        assert by_name[part]["attributes"]["gen_ai.request.model"] == "test-model"
    assert all(s["service"] == "gw-under-test" for s in trace)

    client = by_name["chat test-model"]
    assert client["kind"] == 3  # SPAN_KIND_CLIENT
    attrs = client["attributes"]
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "test-model"
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.usage.input_tokens"] == 7 and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < attrs["portcullis.upstream.time_to_first_chunk"] < 5
    assert root["attributes"]["http.response.status_code"] == 200

    sent = http.get(upstream.url + "/_stats").json()["last_headers"]["traceparent"]
    _, trace_id, parent_id, _ = sent.split("-")
    assert trace_id == root["trace_id"] and parent_id == client["span_id"]


def test_a_trusted_incoming_traceparent_is_continued_over_grpc_export(upstream, gateway, grpc_receiver):
    endpoint, received = grpc_receiver
    gw = traced_gateway(gateway, upstream, endpoint, "grpc", trust_client_trace=True)
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers={"traceparent": caller})
    root = next(s for s in received.wait_for("POST /v1/chat/completions") if s["name"] == "POST /v1/chat/completions")
    assert root["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert root["parent_id"] == "00f067aa0ba902b7"


def test_rejected_request_marks_its_stage_span(http_traced):
    gw, received = http_traced
    rejected = http.post(gw.url + "/v1/chat/completions", content=b"{bad")
    assert rejected.status_code == 400
    trace_id = gw.access_log(rejected.headers["x-request-id"])["trace_id"]
    spans = received.wait_for("stage.parse", trace_id=trace_id)
    parse = next(s for s in spans if s["name"] == "stage.parse")
    assert parse["attributes"]["portcullis.verdict"] == "reject"
    assert parse["attributes"]["portcullis.reject.code"] == "invalid_json"
    assert not any(s["name"] == "stage.auth" for s in spans)


@pytest.mark.parametrize("trusted", [False, True])
def test_with_export_off_the_upstream_and_the_access_log_name_the_same_trace(upstream, gateway, trusted):
    """Tracing off (no OTLP), nothing is recorded, but every request still has ids: the access log's trace and span
    ids are the ones the upstream's traceparent carries (not sampled); a trusted caller's trace and tracestate are
    continued, an untrusted caller's are not."""
    gw = gateway({"pools": [pool("main", upstream.url)], "telemetry": {"trust_client_trace": trusted}})
    caller = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    sent_ids = []
    for headers in ({}, {"traceparent": caller, "tracestate": "vendor=abc"}):
        response = http.post(gw.url + "/v1/chat/completions", json=chat_body(), headers=headers)
        assert response.status_code == 200
        upstream_saw = http.get(upstream.url + "/_stats").json()["last_headers"]
        version, trace_id, span_id, flags = upstream_saw["traceparent"].split("-")
        assert version == "00" and not int(flags, 16) & 1, "not sampled: nothing is recorded"
        entry = gw.access_log(response.headers["x-request-id"])
        assert (entry["trace_id"], entry["span_id"]) == (trace_id, span_id)
        assert span_id != "b7ad6b7169203331" and int(span_id, 16) and int(trace_id, 16)
        sent_ids.append(trace_id)
        if headers:
            continued = trace_id == "0af7651916cd43dd8448eb211c80319c"
            assert continued == trusted
            assert (upstream_saw.get("tracestate") == "vendor=abc") == trusted
    assert sent_ids[0] != sent_ids[1]
