"""The MCP gateway with real processes: a real MCP server built with the official SDK (tests/mcp_server.py), the
gateway with its real guard model, and the official `mcp` client, through `/mcp/{server}` with the gateway's keys.

One gateway and one server for the module: each test keeps to its own tools, keys or sessions; the one that changes
a tool's description puts it back.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import httpx2
import pytest
import yaml
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from gateway.mcp.pins import tool_hash
from tests.conftest import ROOT, Launcher, Process
from tests.integration.test_tracing import Received, http_receiver  # noqa: F401 (a fixture)

WEATHER = "Current weather conditions for a city."
KEYS = {"team-a": "sk-mcp-a", "team-b": "sk-mcp-b", "team-c": "sk-mcp-c"}
UPSTREAM_CREDENTIAL = "upstream-credential-for-the-mcp-server"
LEGACY = "2025-11-25"  # the last revision with the initialize handshake and sessions
MODERN_META = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}


class Setup:
    def __init__(self, gateway: Process, server: Process, description: Path, spans: Received) -> None:
        self.gateway = gateway
        self.server = server
        self.description = description
        self.spans = spans
        self.url = f"{gateway.url}/mcp/test"


def served_tools(server_url: str) -> list[dict]:
    """The tools as the server itself lists them (what an operator hashes to pin them)."""
    answer = httpx.post(
        f"{server_url}/mcp",
        json={"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": MODERN_META}},
        headers={
            "accept": "application/json, text/event-stream",
            "mcp-protocol-version": "2026-07-28",
            "mcp-method": "tools/list",
        },
    )
    answer.raise_for_status()
    return answer.json()["result"]["tools"]


def key_id(key: str) -> str:
    """A key of portcullis.yaml as the policy and the audit log name it."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def write_policy(directory: Path, pinned: dict[str, str]) -> None:
    (directory / "tenants").mkdir(parents=True)
    base = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "Policy",
        "metadata": {"name": "mcp-test"},
        "spec": {
            "guard": {
                "enabled": True,
                "injection": {
                    "max_tokens": 8192,  # a result longer than this is not scanned, so not relayed
                    "provenances": {
                        "tool_definitions": {"action": "block"},
                        "tool_result": {"action": "block"},
                        "tool_arguments": {"action": "monitor"},
                    },
                },
                "pii": {"secrets": "redact"},
            },
            "mcp": {
                "servers": {
                    "test": {"tools": ["*"], "keys": {key_id(KEYS["team-c"]): ["add", "save"]}, "pinned": pinned}
                }
            },
        },
    }
    team_b = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "TenantPolicy",
        "metadata": {"name": "team-b"},
        "tenant": "team-b",
        "spec": {"mcp": {"servers": {"test": {"tools": ["add"]}}}},
    }
    team_c = {  # `add` twice a minute per key; every tool three times a minute per key, each counted apart
        **team_b,
        "metadata": {"name": "team-c"},
        "tenant": "team-c",
        "spec": {
            "rate_limits": [
                {
                    "id": "add-per-key",
                    "key": ["api_key"],
                    "match": {"tools": ["test/add"]},
                    "requests": {"limit": 2, "per": "1m"},
                },
                {
                    "id": "each-tool-per-key",
                    "key": ["api_key", "tool"],
                    "match": {"routes": ["mcp"]},
                    "requests": {"limit": 3, "per": "1m"},
                },
            ]
        },
    }
    (directory / "base.yaml").write_text(yaml.safe_dump(base))
    (directory / "tenants" / "team-b.yaml").write_text(yaml.safe_dump(team_b))
    (directory / "tenants" / "team-c.yaml").write_text(yaml.safe_dump(team_c))


@pytest.fixture(scope="module")
def setup(module_launcher: Launcher, http_receiver: tuple[str, Received]) -> Iterator[Setup]:  # noqa: F811
    directory = module_launcher.directory
    description = directory / "weather-description.txt"
    description.write_text(WEATHER)
    server = module_launcher.spawn(
        lambda port: [
            sys.executable,
            str(ROOT / "tests" / "mcp_server.py"),
            "--port",
            str(port),
            "--description-file",
            str(description),
        ],
        "mcp-server",
        ready_path="/healthz",
    )
    # every tool of the server pinned as it is now, the poisoned one too: the guard, not the pin, refuses that one
    write_policy(directory / "policies", {tool["name"]: tool_hash(tool) for tool in served_tools(server.url)})
    gateway = module_launcher.gateway(
        {
            "policy_dir": str(directory / "policies"),
            "pools": [{"name": "unused", "replicas": [{"url": "http://127.0.0.1:9"}]}],
            "auth": {
                "keys": [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]
            },
            "mcp_servers": [{"name": "test", "url": f"{server.url}/mcp", "api_key_env": "TEST_MCP_CREDENTIAL"}],
            "telemetry": {"otlp": {"enabled": True, "endpoint": http_receiver[0], "protocol": "http/protobuf"}},
        },
        env={"TEST_MCP_CREDENTIAL": UPSTREAM_CREDENTIAL},
    )
    yield Setup(gateway, server, description, http_receiver[1])


@asynccontextmanager
async def connected(url: str, key: str, mode: str = "auto", seen: list[str] | None = None) -> AsyncIterator[Client]:
    """The official client through the gateway with an API key; `seen` collects the session ids it is given."""

    async def record(response: httpx2.Response) -> None:
        if seen is not None and "mcp-session-id" in response.headers:
            seen.append(response.headers["mcp-session-id"])

    http = httpx2.AsyncClient(
        headers={"authorization": f"Bearer {key}"}, timeout=60, event_hooks={"response": [record]}
    )
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode) as client:
        yield client


def listed(url: str, key: str, mode: str = "auto") -> list[str]:
    async def names() -> list[str]:
        async with connected(url, key, mode) as client:
            return [tool.name for tool in (await client.list_tools()).tools]

    return anyio.run(names)


def call(url: str, key: str, tool: str, arguments: dict, mode: str = "auto"):  # type: ignore[no-untyped-def]
    """The tool's result, or the MCPError the client raised (out of the client's task group, where it is wrapped)."""

    async def called():  # type: ignore[no-untyped-def]
        async with connected(url, key, mode) as client:
            try:
                return await client.call_tool(tool, arguments)
            except MCPError as error:
                return error

    result = anyio.run(called)
    if isinstance(result, MCPError):
        raise result
    return result


@pytest.mark.parametrize("mode", ["auto", "legacy"])  # the 2026 revision (stateless), and the handshake with sessions
def test_an_approved_tool_is_listed_and_called_with_the_servers_credential_not_the_callers_key(setup, mode):
    assert {"add", "weather", "fetch_page", "save"} <= set(listed(setup.url, KEYS["team-a"], mode))
    result = call(setup.url, KEYS["team-a"], "add", {"a": 2, "b": 40}, mode)
    assert not result.is_error and result.content[0].text == "42"
    seen = httpx.get(f"{setup.server.url}/_seen").json()
    assert seen["authorization"] == f"Bearer {UPSTREAM_CREDENTIAL}"


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_a_poisoned_description_is_refused(setup, mode):
    assert "notes" not in listed(setup.url, KEYS["team-a"], mode)  # pinned and allowed: the guard left it out
    with pytest.raises(MCPError, match="not approved: the guard refused its definition"):
        call(setup.url, KEYS["team-a"], "notes", {"text": "hello"}, mode)


@pytest.mark.parametrize("mode", ["auto", "legacy"])
def test_an_injected_tool_result_is_blocked(setup, mode):
    with pytest.raises(MCPError, match="answer was withheld: .*prompt_injection") as refused:
        call(setup.url, KEYS["team-a"], "fetch_page", {"url": "https://example.com/garden"}, mode)
    assert refused.value.error.data["code"] == "result_blocked"
    assert "IGNORE ALL PREVIOUS" not in str(refused.value.error)


def test_a_result_too_long_to_scan_whole_is_withheld_not_relayed_unread(setup):
    with pytest.raises(MCPError, match="answer was withheld") as refused:
        call(setup.url, KEYS["team-a"], "long_page", {"url": "https://example.com/long"})
    assert refused.value.error.data["code"] == "result_blocked"


def test_an_injected_resource_is_withheld(setup):
    async def read() -> MCPError | None:
        async with connected(setup.url, KEYS["team-a"]) as client:
            try:
                await client.read_resource("page://garden")
            except MCPError as error:
                return error
            return None

    refused = anyio.run(read)
    assert refused is not None and refused.error.data["code"] == "result_blocked"
    assert "IGNORE ALL PREVIOUS" not in str(refused.error)


def test_a_changed_description_is_detected_and_refused_until_pinned(setup):
    assert "weather" in listed(setup.url, KEYS["team-a"])
    assert call(setup.url, KEYS["team-a"], "weather", {"city": "Lisbon"}).content[0].text.startswith("Sunny")
    setup.description.write_text(WEATHER + " Also reports the humidity.")  # harmless, but not what was approved
    try:
        assert "weather" not in listed(setup.url, KEYS["team-a"])
        with pytest.raises(MCPError, match="changed since it was approved"):
            call(setup.url, KEYS["team-a"], "weather", {"city": "Lisbon"})
    finally:
        setup.description.write_text(WEATHER)
    assert "weather" in listed(setup.url, KEYS["team-a"])  # the approved definition back: approved again


def test_a_tool_outside_the_allow_list_is_refused(setup):
    assert listed(setup.url, KEYS["team-b"]) == ["add"]  # team-b's overlay allows `add` alone
    with pytest.raises(MCPError, match="not on this caller's allow-list") as refused:
        call(setup.url, KEYS["team-b"], "save", {"text": "hello"})
    assert refused.value.error.data["code"] == "tool_not_allowed"
    assert call(setup.url, KEYS["team-b"], "add", {"a": 1, "b": 1}).content[0].text == "2"
    assert set(listed(setup.url, KEYS["team-c"])) == {"add", "save"}  # the key's own list, within its tenant's
    with pytest.raises(MCPError, match="not on this caller's allow-list"):
        call(setup.url, KEYS["team-c"], "fetch_page", {"url": "https://example.com"})


def test_a_session_is_not_usable_with_another_key(setup):
    sessions: list[str] = []

    async def open_session() -> None:
        async with connected(setup.url, KEYS["team-a"], "legacy", sessions) as client:
            await client.list_tools()
            for key, status in ((KEYS["team-b"], 404), (KEYS["team-a"], 200)):  # another key; its own, still open
                answer = await anyio.to_thread.run_sync(lambda key=key: list_in_session(setup.url, key, sessions[0]))
                assert answer.status_code == status, answer.text
                if status == 404:
                    assert answer.json()["error"]["data"]["code"] == "session_not_found"

    anyio.run(open_session)
    assert sessions and sessions[0].count(".") >= 1  # the gateway's binding, not the upstream's bare id


def list_in_session(url: str, key: str, session: str) -> httpx.Response:
    return httpx.post(
        url,
        json={"jsonrpc": "2.0", "id": 7, "method": "tools/list"},
        headers={
            "authorization": f"Bearer {key}",
            "accept": "application/json, text/event-stream",
            "mcp-session-id": session,
            "mcp-protocol-version": LEGACY,
        },
        timeout=30,
    )


def test_secrets_in_a_calls_arguments_are_redacted_before_the_server_reads_them(setup):
    result = call(setup.url, KEYS["team-a"], "save", {"text": "deploy with AKIAIOSFODNN7EXAMPLE please"})
    assert result.content[0].text == "saved"
    saved = httpx.get(f"{setup.server.url}/_seen").json()["saved"]
    assert "AKIAIOSFODNN7EXAMPLE" not in saved and "[REDACTED" in saved, saved


def test_a_key_the_gateway_does_not_know_opens_nothing(setup):
    with pytest.raises(BaseExceptionGroup) as refused:  # raised in the client's task group, as it connects
        listed(setup.url, "sk-unknown")
    assert refused.group_contains(MCPError, match="incorrect API key", depth=None)


def test_rate_limits_count_each_tool_apart(setup):
    for _ in range(2):
        assert call(setup.url, KEYS["team-c"], "add", {"a": 1, "b": 2}).content[0].text == "3"
    with pytest.raises(MCPError) as refused:
        call(setup.url, KEYS["team-c"], "add", {"a": 1, "b": 2})
    assert refused.value.error.data["code"] == "rate_limit_exceeded"
    assert refused.value.error.data["param"] == "add-per-key"
    for _ in range(3):  # `add`'s limit is not another tool's; and the per-tool counter has not counted `add`
        assert call(setup.url, KEYS["team-c"], "save", {"text": "another tool"}).content[0].text == "saved"
    with pytest.raises(MCPError) as refused:
        call(setup.url, KEYS["team-c"], "save", {"text": "another tool"})
    assert refused.value.error.data["param"] == "each-tool-per-key"


def test_each_call_is_an_execute_tool_span_in_its_requests_trace_and_a_line_of_the_audit_log(setup):
    call(setup.url, KEYS["team-a"], "add", {"a": 20, "b": 22})
    with pytest.raises(MCPError):
        call(setup.url, KEYS["team-a"], "notes", {"text": "hello"})
    spans = setup.spans.wait_for("execute_tool notes")
    tool_span = next(s for s in spans if s["name"] == "execute_tool add")
    assert tool_span["attributes"]["gen_ai.operation.name"] == "execute_tool"
    assert tool_span["attributes"]["gen_ai.tool.name"] == "add"
    assert tool_span["kind"] == 3  # CLIENT
    trace = [s for s in spans if s["trace_id"] == tool_span["trace_id"]]
    server_span = next(s for s in trace if s["name"] == "POST /mcp/test")
    assert tool_span["parent_id"] == server_span["span_id"]
    assert any(s["name"] == "stage.mcp" and s["parent_id"] == tool_span["span_id"] for s in trace)
    refused = next(s for s in spans if s["name"] == "execute_tool notes")
    assert refused["attributes"]["error.type"] == "tool_not_approved"
    audited = [
        json.loads(line)
        for line in setup.gateway.output().splitlines()
        if '"type": "mcp"' in line or '"type":"mcp"' in line
    ]
    decisions = {(a["tool"], a["decision"], a["reason"]) for a in audited if a["tenant"] == "team-a"}
    assert ("add", "relayed", None) in decisions and ("notes", "refused", "tool_not_approved") in decisions
