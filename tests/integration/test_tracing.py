"""One trace per request, received on the wire: an in-test OTLP receiver decodes what the gateway exports."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest
import yaml
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
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            {
                                "service": resource["service.name"],
                                "resource": resource,
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
    answer = {"cached": 4, "reasoning": 2, "answer_model": "test-model-2026-01-01"}
    response = http.post(gw.url + "/v1/chat/completions", json=chat_body(stream=True, max_tokens=5, fake=answer))
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
    assert attrs["gen_ai.provider.name"] == "openai"
    assert attrs["gen_ai.request.model"] == "test-model"
    assert attrs["gen_ai.request.stream"] is True
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.response.model"] == "test-model-2026-01-01"  # the answer's, not the request's
    assert attrs["gen_ai.response.id"] == "cmpl-fake"
    assert attrs["gen_ai.usage.input_tokens"] == 7 and attrs["gen_ai.usage.output_tokens"] == 3
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 4
    assert attrs["gen_ai.usage.reasoning.output_tokens"] == 2
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < attrs["gen_ai.response.time_to_first_chunk"] < 5
    assert (attrs["server.address"], attrs["server.port"]) == ("127.0.0.1", int(upstream.url.rsplit(":", 1)[1]))
    assert "error.type" not in attrs
    assert root["attributes"]["http.response.status_code"] == 200

    sent = http.get(upstream.url + "/_stats").json()["last_headers"]["traceparent"]
    _, trace_id, parent_id, _ = sent.split("-")
    assert trace_id == root["trace_id"] and parent_id == client["span_id"]


def test_a_whole_answer_has_no_time_to_first_chunk_and_says_it_was_not_streamed(http_traced):
    gw, received = http_traced
    response = http.post(gw.url + "/v1/chat/completions", json=chat_body())
    assert response.status_code == 200
    trace_id = gw.access_log(response.headers["x-request-id"])["trace_id"]
    client = next(s for s in received.wait_for("chat test-model", trace_id=trace_id) if s["name"] == "chat test-model")
    assert client["attributes"]["gen_ai.request.stream"] is False
    assert client["attributes"]["gen_ai.response.id"] == "cmpl-fake"
    assert "gen_ai.response.time_to_first_chunk" not in client["attributes"]  # the spec's is a stream's


def test_a_failed_attempt_names_its_error_type(module_launcher, http_receiver):
    endpoint, received = http_receiver
    broken = module_launcher.fake_upstream("broken", fail_status=503)
    gw = traced_gateway(module_launcher.gateway, broken, endpoint, "http/protobuf")
    response = http.post(gw.url + "/v1/chat/completions", json=chat_body())
    assert response.status_code == 503
    trace_id = gw.access_log(response.headers["x-request-id"])["trace_id"]
    client = next(s for s in received.wait_for("chat test-model", trace_id=trace_id) if s["name"] == "chat test-model")
    assert client["attributes"]["http.response.status_code"] == 503
    assert client["attributes"]["error.type"] == "503"
    assert client["attributes"]["gen_ai.provider.name"] == "openai"


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


def _trace_of(gw, response) -> str:
    return gw.access_log(response.headers["x-request-id"])["trace_id"]


def _exported(received: Received, trace_id: str) -> list[dict]:
    with received.lock:
        return [s for s in received.spans if s["trace_id"] == trace_id]


def test_otel_variables_set_the_endpoint_service_resource_and_sampler(upstream, gateway, http_receiver):
    """With no `telemetry` keys in the file, the standard variables configure export: the endpoint (which turns it
    on), the service name, resource attributes and a sampler at ratio 0, which still exports a refused request."""
    endpoint, received = http_receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_SERVICE_NAME": "svc-from-env",
        "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=staging",
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0",
    }
    gw = gateway({"pools": [pool("main", upstream.url)]}, env=env)
    served = http.post(gw.url + "/v1/chat/completions", json=chat_body())
    assert served.status_code == 200
    sent = http.get(upstream.url + "/_stats").json()["last_headers"]["traceparent"]
    assert not int(sent.rsplit("-", 1)[1], 16) & 1, "outside the ratio: the upstream is told it is not sampled"
    refused = http.post(gw.url + "/v1/chat/completions", content=b"{bad")
    assert refused.status_code == 400
    spans = received.wait_for("POST /v1/chat/completions", trace_id=_trace_of(gw, refused))
    root = next(s for s in spans if s["name"] == "POST /v1/chat/completions")
    assert root["service"] == "svc-from-env"
    assert root["resource"]["deployment.environment"] == "staging"
    assert root["attributes"]["error.type"] == "invalid_json"
    # spans are exported in the order they end: the served request's would have come first
    assert _exported(received, _trace_of(gw, served)) == []


def test_the_config_file_overrides_the_otel_variables(upstream, gateway, http_receiver):
    endpoint, received = http_receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "OTEL_SERVICE_NAME": "svc-from-env",
        "OTEL_TRACES_SAMPLER": "always_off",
    }
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "telemetry": {
                "service_name": "svc-from-file",
                "sampling_ratio": 1.0,
                "otlp": {"enabled": True, "endpoint": endpoint},
            },
        },
        env=env,
    )
    served = http.post(gw.url + "/v1/chat/completions", json=chat_body())
    assert served.status_code == 200
    spans = received.wait_for("POST /v1/chat/completions", trace_id=_trace_of(gw, served))
    assert {s["service"] for s in spans} == {"svc-from-file"}


def test_a_bad_otel_variable_stops_the_gateway_naming_it(upstream, launcher):
    with pytest.raises(RuntimeError, match="OTEL_TRACES_SAMPLER_ARG: 'half'"):
        launcher.gateway(
            {"pools": [pool("main", upstream.url)]},
            env={"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"},
        )


def test_at_ratio_zero_a_blocked_request_and_a_failed_one_are_exported_whole(
    module_launcher, upstream, gateway, http_receiver, tmp_path
):
    endpoint, received = http_receiver
    policy = tmp_path / "policies"
    policy.mkdir()
    rule = {"id": "no-banned-model", "action": "block", "when": {"target": "model", "equals": "banned-model"}}
    doc = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "Policy",
        "metadata": {"name": "t"},
        "spec": {"waf": {"rules": [rule]}},
    }
    (policy / "base.yaml").write_text(yaml.safe_dump(doc))
    broken = module_launcher.fake_upstream("broken-too", fail_status=500)
    gw = gateway(
        {
            "pools": [pool("broken", broken.url, models=["broken-model"]), pool("main", upstream.url)],
            "policy_dir": str(policy),
            "telemetry": {"sampling_ratio": 0, "otlp": {"enabled": True, "endpoint": endpoint}},
        }
    )
    served = http.post(gw.url + "/v1/chat/completions", json=chat_body())
    blocked = http.post(gw.url + "/v1/chat/completions", json=chat_body(model="banned-model"))
    failed = http.post(gw.url + "/v1/chat/completions", json=chat_body(model="broken-model"))
    assert (served.status_code, blocked.status_code, failed.status_code) == (200, 403, 502)

    spans = received.wait_for("POST /v1/chat/completions", trace_id=_trace_of(gw, blocked))
    root = next(s for s in spans if s["name"] == "POST /v1/chat/completions")
    assert root["attributes"]["portcullis.waf.action"] == "block"
    assert root["attributes"]["portcullis.waf.rules"] == ["no-banned-model"]
    assert "stage.waf" in {s["name"] for s in spans}
    spans = received.wait_for("POST /v1/chat/completions", trace_id=_trace_of(gw, failed))
    assert {"stage.parse", "stage.route", "chat broken-model"} <= {s["name"] for s in spans}, "the whole trace"
    assert _exported(received, _trace_of(gw, served)) == []


def test_a_cache_hit_says_so_on_its_span_and_asks_no_upstream(upstream, gateway, http_receiver, tmp_path):
    endpoint, received = http_receiver
    directory = tmp_path / "policies"
    directory.mkdir()
    policy = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "t"}}
    guard = {"enabled": True, "injection": {"enabled": False}}  # PII only: a hit passes the input guard too
    (directory / "base.yaml").write_text(json.dumps({**policy, "spec": {"cache": {"enabled": True}, "guard": guard}}))
    key = "sk-traced-cache"
    gw = gateway(
        {
            "pools": [pool("main", upstream.url)],
            "policy_dir": str(directory),
            "auth": {"keys": [{"tenant": "t", "sha256": hashlib.sha256(key.encode()).hexdigest()}]},
            "telemetry": {"otlp": {"enabled": True, "endpoint": endpoint, "protocol": "http/protobuf"}},
        }
    )
    body = chat_body(temperature=0, messages=[{"role": "user", "content": "traced cache"}])
    results = []
    for _ in range(2):
        response = http.post(gw.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
        trace_id = gw.access_log(response.headers["x-request-id"])["trace_id"]
        trace = received.wait_for("POST /v1/chat/completions", trace_id=trace_id)
        root = next(s for s in trace if s["name"] == "POST /v1/chat/completions")
        results.append((root["attributes"]["portcullis.cache.result"], {s["name"] for s in trace}))
    (miss, missed), (hit, hit_spans) = results
    assert (miss, hit) == ("miss", "hit")
    assert "chat test-model" in missed and "chat test-model" not in hit_spans, "a hit asks no upstream"
    assert {"stage.guard", "stage.cache"} <= hit_spans and "stage.route" not in hit_spans
