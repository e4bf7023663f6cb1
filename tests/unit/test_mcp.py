"""The MCP gateway's pure parts: session binding, definition hashes and pins, the policy section and its overlays,
the operator's mcp_servers, and JSON-RPC messages read within bounds."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from gateway import cli
from gateway.config import ConfigError, GatewayConfig, LimitsConfig, McpServerConfig
from gateway.errors import GatewayError
from gateway.mcp import messages
from gateway.mcp.pins import Catalog, tool_hash
from gateway.mcp.service import warn_unsafe
from gateway.mcp.sessions import SessionBinder, caller_of
from gateway.mcp.spec import McpSpec
from gateway.policy.loader import PolicyError, load_policy_dir

TOOL = {"name": "add", "description": "Sum of two integers.", "inputSchema": {"type": "object", "properties": {}}}


def test_a_session_id_opens_the_session_for_the_caller_it_was_given_to_only():
    binder = SessionBinder(b"secret")
    given = binder.outward("github", caller_of("key-a", "team-a"), "upstream-session-1")
    assert binder.inward("github", caller_of("key-a", "team-a"), given) == "upstream-session-1"
    assert binder.inward("github", caller_of("key-b", "team-a"), given) is None  # another key of the same tenant
    assert binder.inward("gitlab", caller_of("key-a", "team-a"), given) is None  # another server
    forged = given.split(".", 1)[0] + ".upstream-session-2"
    assert binder.inward("github", caller_of("key-a", "team-a"), forged) is None
    assert binder.inward("github", caller_of("key-a", "team-a"), "upstream-session-1") is None  # the bare id
    assert SessionBinder(b"other").inward("github", caller_of("key-a", "team-a"), given) is None


def test_a_definitions_hash_is_of_all_of_it_in_any_key_order():
    assert tool_hash(TOOL) == tool_hash(dict(reversed(TOOL.items())))
    for changed in ({**TOOL, "description": "Sum of two integers!"}, {**TOOL, "title": "Add"}):
        assert tool_hash(changed) != tool_hash(TOOL)


def test_required_pins_approve_only_the_pinned_hash_and_learn_only_the_first_seen():
    required = McpSpec.model_validate({"servers": {"s": {"tools": ["*"], "pinned": {"add": tool_hash(TOOL)}}}})
    catalog = Catalog()
    assert catalog.judge(required, "s", "add", tool_hash(TOOL)) == "approved"
    assert catalog.judge(required, "s", "add", tool_hash({**TOOL, "title": "x"})) == "changed"
    assert catalog.judge(required, "s", "other", tool_hash(TOOL)) == "unpinned"
    catalog.record("team-a", "s", "add", "approved")  # as listed to one tenant, under its guard policy
    assert catalog.of("team-a", "s", "add") == "approved" and catalog.of("team-b", "s", "add") is None
    learn = McpSpec(pin="learn")
    assert catalog.judge(learn, "s", "add", "sha256:" + "1" * 64) == "approved"
    assert catalog.judge(learn, "s", "add", "sha256:" + "2" * 64) == "changed"


def _policies(tmp_path: Path, base_mcp: dict, overlay_mcp: dict | None) -> Path:
    (tmp_path / "tenants").mkdir()
    base = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "b"}, "spec": {"mcp": base_mcp}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    if overlay_mcp is not None:
        overlay = {
            "apiVersion": "portcullis.dev/v1",
            "kind": "TenantPolicy",
            "metadata": {"name": "t"},
            "tenant": "team-b",
            "spec": {"mcp": overlay_mcp},
        }
        (tmp_path / "tenants" / "team-b.yaml").write_text(yaml.safe_dump(overlay))
    return tmp_path


def test_an_overlay_gives_its_tenant_its_own_allow_list_and_keeps_the_base_pins(tmp_path):
    pinned = {"add": tool_hash(TOOL)}
    base = {"servers": {"s": {"tools": ["*"], "pinned": pinned}}}
    policies = load_policy_dir(_policies(tmp_path, base, {"servers": {"s": {"tools": ["add"]}}}))
    assert policies.mcp_for(None).allowed("s", "delete_repo", None)
    tenant = policies.mcp_for("team-b")
    assert tenant.allowed("s", "add", None) and not tenant.allowed("s", "delete_repo", None)
    assert tenant.servers["s"].pinned == pinned
    assert not policies.mcp_for(None).allowed("unknown-server", "add", None)  # a server the policy names not: none


def test_a_keys_own_list_narrows_its_tenants_and_stays_narrow_under_an_overlay(tmp_path):
    base = {"servers": {"s": {"tools": ["*"], "keys": {"0123456789ab": ["add", "delete_repo"]}}}}
    policies = load_policy_dir(_policies(tmp_path, base, {"servers": {"s": {"tools": ["add", "search"]}}}))
    anyone = policies.mcp_for(None)
    assert anyone.allowed("s", "delete_repo", "0123456789ab") and not anyone.allowed("s", "search", "0123456789ab")
    assert anyone.allowed("s", "search", "ba9876543210")  # another key: the tenant's list
    tenant = policies.mcp_for("team-b")
    assert tenant.allowed("s", "add", "0123456789ab")
    assert not tenant.allowed("s", "delete_repo", "0123456789ab")  # its own list names it, its tenant's not
    assert not tenant.allowed("s", "search", "0123456789ab")  # its tenant's names it, its own not


@pytest.mark.parametrize(
    "overlay",
    [
        {"pin": "learn"},
        {"relay": ["sampling/createMessage"]},
        {"servers": {"s": {"pinned": {"x": "sha256:" + "0" * 64}}}},
    ],
)
def test_an_overlay_cannot_pin_or_relay(tmp_path, overlay):
    with pytest.raises(PolicyError, match="belong to the base policy"):
        load_policy_dir(_policies(tmp_path, {}, overlay))


def test_a_pin_that_is_no_hash_is_refused_naming_it(tmp_path):
    with pytest.raises(PolicyError, match=r"spec\.mcp\.servers\.s\.pinned\.add"):
        load_policy_dir(_policies(tmp_path, {"servers": {"s": {"pinned": {"add": "abc"}}}}, None))


def test_mcp_servers_are_named_once_with_http_urls_and_their_credentials_set(monkeypatch):
    server = {"name": "github", "url": "https://mcp.example.com/mcp"}
    with pytest.raises(ValueError, match="MCP server names must be unique"):
        GatewayConfig.model_validate({"mcp_servers": [server, server]})
    with pytest.raises(ValueError, match="must start with http"):
        GatewayConfig.model_validate({"mcp_servers": [{**server, "url": "ftp://x"}]})
    monkeypatch.delenv("NO_SUCH_MCP_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"mcp_servers\[github\]\.api_key_env: environment variable NO_SUCH_MCP_KEY"):
        McpServerConfig.model_validate({**server, "api_key_env": "NO_SUCH_MCP_KEY"}).credential()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"[]", "invalid_json"),  # a batch
        (b'{"jsonrpc": "1.0", "method": "ping", "id": 1}', "invalid_jsonrpc"),
        (b'{"jsonrpc": "2.0", "method": "ping", "id": true}', "invalid_jsonrpc"),
        (b'{"jsonrpc": "2.0", "method": "ping", "id": 1, "params": []}', "invalid_jsonrpc"),
        (b'{"jsonrpc": "2.0", "id": 1, "result": {}, "error": {}}', "invalid_jsonrpc"),
        (b'{"jsonrpc": "2.0", "method": "ping", "method": "tools/call"}', "duplicate_json_key"),
    ],
)
def test_a_message_that_is_not_one_json_rpc_object_is_a_400_naming_why(body, code):
    with pytest.raises(GatewayError) as refused:
        messages.read(body, LimitsConfig())
    assert refused.value.status == 400 and refused.value.code == code


def test_messages_are_requests_notifications_or_answers():
    limits = LimitsConfig()
    assert messages.kind_of(messages.read(b'{"jsonrpc": "2.0", "method": "ping", "id": "a"}', limits)) == "request"
    assert messages.kind_of(messages.read(b'{"jsonrpc": "2.0", "method": "notifications/x"}', limits)) == "notification"
    assert messages.kind_of(messages.read(b'{"jsonrpc": "2.0", "id": 3, "result": {}}', limits)) == "answer"


def test_a_message_past_the_json_limits_is_refused():
    with pytest.raises(GatewayError, match="depth|deep"):
        messages.read(
            b'{"jsonrpc": "2.0", "method": "x", "params": ' + b'{"a": ' * 10 + b"1" + b"}" * 11,
            LimitsConfig(max_json_depth=5),
        )


def test_the_start_says_where_mcp_content_reaches_models_unguarded(tmp_path, caplog):
    config = GatewayConfig.model_validate(
        {"mcp_servers": [{"name": "s", "url": "http://mcp.example.com/mcp", "api_key_env": "S_KEY"}]}
    )
    learn = load_policy_dir(_policies(tmp_path, {"pin": "learn"}, None))
    with caplog.at_level(logging.INFO, logger="gateway.mcp.service"):
        warn_unsafe(config, learn)
    said = caplog.text
    assert "mcp.pin: learn" in said
    assert "classifier is off" in said  # the guard is off by default
    assert "names no tools for it" in said
    assert "crosses the network unencrypted" in said
    caplog.clear()
    provenances = {"tool_result": {"action": "block"}, "tool_definitions": {"action": "monitor"}, "document": {}}
    guarded = {"enabled": True, "injection": {"action": "flag", "provenances": provenances}}
    (tmp_path / "base.yaml").write_text(
        yaml.safe_dump(
            {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "b"}, "spec": {"guard": guarded}}
        )
    )
    with caplog.at_level(logging.INFO, logger="gateway.mcp.service"):
        warn_unsafe(config, load_policy_dir(tmp_path))
    assert "only records what it finds in tool_definitions, document" in caplog.text


@pytest.mark.parametrize("form", ["message", "result", "sse"])
def test_pins_are_printed_for_each_listed_tool_ready_for_the_policy(tmp_path, capsys, form):
    tools = [TOOL, {**TOOL, "name": "bad: name"}]
    message = {"jsonrpc": "2.0", "id": 1, "result": {"tools": tools}}
    text = {
        "message": json.dumps(message),
        "result": json.dumps(message["result"]),
        "sse": ": comment\r\n\r\nevent: message\r\ndata: " + json.dumps(message) + "\r\n\r\n",
    }[form]
    (tmp_path / "answer").write_text(text)
    assert cli.main(["mcp", "pins", str(tmp_path / "answer")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"add: {tool_hash(TOOL)}"
    assert yaml.safe_load("\n".join(lines)) == {"add": tool_hash(TOOL)}  # the refused name is a comment


def test_pins_of_what_is_no_tools_list_is_an_error(tmp_path, capsys):
    (tmp_path / "answer").write_text('{"jsonrpc": "2.0", "id": 1, "result": {}}')
    assert cli.main(["mcp", "pins", str(tmp_path / "answer")]) == 1
    assert "no list of named tools" in capsys.readouterr().err
