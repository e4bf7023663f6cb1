"""The MCP relay between a hostile client and a hostile server, through the real gateway.

A client's message that is not one JSON-RPC object, or whose headers say another call than its body, is refused with
its 4xx and a JSON-RPC error before any server sees it. A server that breaks the protocol: every message it sends is
bounded, read as JSON-RPC and judged before the client gets it; what it should not send is dropped, and what cannot
be read ends the exchange with a JSON-RPC error the client's request can be paired with."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.conftest import ROOT, Launcher, Process

KEY = "sk-hostile-mcp"
META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


@pytest.fixture(scope="module")
def gateway(module_launcher: Launcher) -> Iterator[Process]:
    server = module_launcher.spawn(
        lambda port: [sys.executable, str(ROOT / "tests" / "hostile" / "hostile_mcp_server.py"), "--port", str(port)],
        "hostile-mcp",
        ready_path="/healthz",
    )
    policies = module_launcher.directory / "policies"
    policies.mkdir()
    base = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "Policy",
        "metadata": {"name": "hostile-mcp"},
        "spec": {"mcp": {"pin": "learn", "servers": {"bad": {"tools": ["*"]}}}},
    }
    (policies / "base.yaml").write_text(yaml.safe_dump(base))
    yield module_launcher.gateway(
        {
            "policy_dir": str(policies),
            "pools": [{"name": "unused", "replicas": [{"url": "http://127.0.0.1:9"}]}],
            "auth": {"keys": [{"tenant": "team-a", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
            "mcp_servers": [
                {"name": "bad", "url": f"{server.url}/mcp", "max_message_bytes": 4096, "idle_timeout": 0.5}
            ],
        }
    )


def call(gateway: Process, tool: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/mcp/bad",
        json={"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": tool, "_meta": META}},
        headers={"authorization": f"Bearer {KEY}", "accept": "application/json, text/event-stream"},
        timeout=30,
    )


def events(answer: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in answer.text.splitlines() if line.startswith("data:") and line[5:].strip()]


def test_an_event_past_the_servers_message_bound_ends_the_stream_with_an_error_for_the_call(gateway):
    answer = call(gateway, "huge")
    (message,) = events(answer)
    assert message["id"] == 5 and message["error"]["data"]["code"] == "upstream_error"
    assert "xxxx" not in answer.text


@pytest.mark.parametrize("tool", ["garbage", "wrong_type", "stray"])
def test_an_answer_that_is_no_json_rpc_is_a_502_in_json_rpc(gateway, tool):
    answer = call(gateway, tool)
    assert answer.status_code == 502
    assert answer.json()["id"] == 5 and answer.json()["error"]["data"]["code"] == "upstream_error"
    assert "oops" not in answer.text


def test_what_the_server_should_not_send_is_dropped_and_the_calls_answer_relayed(gateway):
    relayed = events(call(gateway, "chatty"))
    assert [m.get("method") for m in relayed if "method" in m] == ["notifications/progress"]  # no sampling request
    answers = [m for m in relayed if "method" not in m]
    assert answers == [{"jsonrpc": "2.0", "id": 5, "result": {"content": [{"type": "text", "text": "done"}]}}]


def test_a_silent_server_ends_the_stream_after_its_idle_timeout(gateway):
    answer = call(gateway, "silent")
    (message,) = events(answer)
    assert message["id"] == 5 and message["error"]["data"]["code"] == "upstream_error"
    assert answer.elapsed.total_seconds() < 5


def post(gateway: Process, body: bytes, path: str = "/mcp/bad", **headers: str) -> httpx.Response:
    sent = {"authorization": f"Bearer {KEY}", "content-type": "application/json", **headers}
    return httpx.post(f"{gateway.url}{path}", content=body, headers=sent, timeout=30)


TOOLS_CALL = json.dumps({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "chatty"}}).encode()


@pytest.mark.parametrize(
    ("body", "headers", "status", "code"),
    [
        (b"{not json", {}, 400, "invalid_json"),
        (b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', {}, 400, "invalid_json"),  # a batch
        (b'{"jsonrpc": "2.0", "method": "tools/call", "params": {"name": "chatty"}}', {}, 400, "invalid_jsonrpc"),
        (TOOLS_CALL, {"content-type": "text/plain"}, 415, "unsupported_media_type"),
        (TOOLS_CALL, {"mcp-name": "huge"}, 400, "header_mismatch"),  # the server would route on the header
        (TOOLS_CALL, {"mcp-method": "tools/list"}, 400, "header_mismatch"),
        (b'{"jsonrpc": "2.0", "id": 4, "method": "sampling/createMessage"}', {}, 403, "method_not_relayed"),
        (TOOLS_CALL, {"mcp-session-id": "forged.session"}, 404, "session_not_found"),
        (TOOLS_CALL, {"authorization": "Bearer sk-not-a-key"}, 401, "invalid_api_key"),
    ],
)
def test_a_message_the_gateway_will_not_relay_gets_its_status_and_a_json_rpc_error(
    gateway, body, headers, status, code
):
    answer = post(gateway, body, **headers)
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert error["jsonrpc"] == "2.0" and error["error"]["data"]["code"] == code
    assert isinstance(error["error"]["code"], int) and error["error"]["message"]


def test_a_server_the_gateway_does_not_serve_and_a_method_mcp_does_not_use_are_refused(gateway):
    assert post(gateway, TOOLS_CALL, path="/mcp/nobody").status_code == 404
    answer = httpx.put(f"{gateway.url}/mcp/bad", content=TOOLS_CALL, headers={"authorization": f"Bearer {KEY}"})
    assert answer.status_code == 405 and "POST" in answer.headers["allow"]


def test_a_message_with_very_many_values_is_judged_out_of_process_and_refused_in_json_rpc(gateway):
    numbers = ",".join("1" for _ in range(200_000))  # past limits.max_json_values, and past the gate's commas
    body = (
        '{"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "chatty", "arguments": {"n": ['
        + numbers
        + "]}}}"
    ).encode()
    answer = post(gateway, body)
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["data"]["code"] == "too_many_json_values"


def test_a_message_with_many_values_within_the_limits_is_relayed_after_the_out_of_process_check(gateway):
    numbers = ",".join("1" for _ in range(6_000))  # past the gate's commas, within the JSON limits
    body = (
        '{"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "chatty", "arguments": {"n": ['
        + numbers
        + "]}}}"
    ).encode()
    answer = post(gateway, body, accept="application/json, text/event-stream")
    assert answer.status_code == 200, answer.text
    assert events(answer)[-1]["result"]["content"][0]["text"] == "done"
