"""An MCP server that breaks the protocol, through the real gateway: every message it sends is bounded, read as
JSON-RPC and judged before the client gets it; what it should not send is dropped, and what cannot be read ends the
exchange with a JSON-RPC error the client's request can be paired with."""

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


@pytest.mark.parametrize("tool", ["garbage", "wrong_type"])
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
