"""Content a stage used to leave unread, through a real gateway process in front of tests/fake_providers.py (a fake
Anthropic Messages and OpenAI Responses and chat upstream), with the real bundled classifier.

Every carrier of every served shape is in the request's content inventory (gateway/apis/inventory.py), which the WAF,
the guard and redaction read: documents, search results and a tool result's documents; Responses tool outputs,
prompt variables and items no table knows; base64 text files; the assistant's side of a history the client sends
(prefill, thinking, earlier answers, reasoning summaries, earlier call arguments); identifiers; JSON-escaped and
invisible-character-split secrets. One gateway serves the module; each test's policy is a tenant's (one key each):
- `strict`: the classifier blocks on every provenance, secrets are redacted, the WAF's web-attack packs are on;
- `shipped`: tool results and documents only monitored, as the shipped default has them, secrets redacted;
- `secrets`: secrets redacted, the classifier off (it judges a sentence that hands over a key an injection);
- `refuse`: `unknown_content: refuse`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import ROOT, Process, pool
from tests.integration.test_guard_gateway import BENIGN, INJECTION, series

CLAUDE, GPT, CHAT = "claude-sonnet-4-5", "gpt-4.1-mini", "chat-model"
UPSTREAM_KEY = "sk-ant-upstream-5d1e"
KEYS = {
    "strict": "sk-inventory-strict",
    "shipped": "sk-inventory-shipped",
    "secrets": "sk-inventory-secrets",
    "refuse": "sk-inventory-refuse",
}
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
SQLI, XSS, TRAVERSAL = (
    "1' UNION SELECT password FROM users--",
    "<script>alert(document.cookie)</script>",
    "../../../../etc/passwd",
)


def _policies(directory) -> str:
    (directory / "tenants").mkdir(parents=True)
    secrets = {"pii": "off", "secrets": "redact"}
    base = {
        "guard": {"enabled": True, "injection": {"action": "block", "provenances": {}}, "pii": secrets},
        "waf": {"packs": ["sqli", "xss", "lfi"]},
    }
    overlays = {
        "strict": {},
        "shipped": {
            "guard": {
                "injection": {"provenances": {"tool_result": {"action": "monitor"}, "document": {"action": "monitor"}}}
            }
        },
        "secrets": {"guard": {"injection": {"enabled": False}}},
        "refuse": {"guard": {"unknown_content": "refuse"}},
    }
    document = {"apiVersion": "portcullis.dev/v1", "kind": "Policy", "metadata": {"name": "inventory"}, "spec": base}
    (directory / "base.yaml").write_text(yaml.safe_dump(document))
    for tenant, spec in overlays.items():
        overlay = {
            "apiVersion": "portcullis.dev/v1",
            "kind": "TenantPolicy",
            "metadata": {"name": tenant},
            "tenant": tenant,
            "spec": spec,
        }
        (directory / "tenants" / f"{tenant}.yaml").write_text(yaml.safe_dump(overlay))
    return str(directory)


@pytest.fixture(scope="module")
def stack(module_launcher) -> tuple[Process, Process]:
    """(gateway, fake provider), started once for the module."""

    def fake_cmd(port: int) -> list[str]:
        return [
            sys.executable,
            str(ROOT / "tests" / "fake_providers.py"),
            "--port",
            str(port),
            "--api-key",
            UPSTREAM_KEY,
        ]

    fake = module_launcher.spawn(fake_cmd, "fake-providers", ready_path="/_received")
    keys = [{"tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]
    config = {
        "policy_dir": _policies(module_launcher.directory / "policies"),
        "auth": {"keys": keys},
        "pools": [
            pool("claude", fake.url, models=[CLAUDE], api="anthropic", api_key_env="FAKE_PROVIDER_KEY"),
            pool("hosted", fake.url, models=[GPT], api_key_env="FAKE_PROVIDER_KEY"),
            pool("chat", fake.url, models=[CHAT], api_key_env="FAKE_PROVIDER_KEY"),
        ],
    }
    return module_launcher.gateway(config, env={"FAKE_PROVIDER_KEY": UPSTREAM_KEY}), fake


def send(stack, path: str, body: dict[str, Any], tenant: str = "strict") -> httpx.Response:
    gw, _ = stack
    key = KEYS[tenant]
    headers = {"x-api-key": key, "authorization": f"Bearer {key}"}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=120)


def upstream_body(stack, response: httpx.Response) -> dict[str, Any]:
    """The body the fake received for this answer's request (the gateway sends its request id upstream)."""
    _, fake = stack
    request_id = response.headers["x-request-id"]
    got = [r for r in httpx.get(fake.url + "/_received").json() if r["headers"].get("x-request-id") == request_id]
    assert len(got) == 1, got
    return got[0]["body"]


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def message(*blocks: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Messages request whose last user turn is these blocks."""
    turns = [*(history or []), {"role": "user", "content": list(blocks)}]
    return {"model": CLAUDE, "max_tokens": 16, "messages": turns}


def responses(*items: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": GPT, "input": [{"role": "user", "content": BENIGN}, *items], **extra}


TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "fetch", "input": {}}]}


def text_document(text: str) -> dict[str, Any]:
    return {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": text}}


# (name, path, body with the payload in one carrier, where the guard says it is)
CARRIERS: list[tuple[str, str, Any, str]] = [
    ("document text source", "/v1/messages", lambda p: message(text_document(p)), "messages[0].content[0]"),
    (
        "document content source",
        "/v1/messages",
        lambda p: message(
            {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": p}]}}
        ),
        "messages[0].content[0]",
    ),
    (
        "search result",
        "/v1/messages",
        lambda p: message(
            {
                "type": "search_result",
                "source": "https://kb.example/1",
                "title": "KB",
                "content": [{"type": "text", "text": p}],
            }
        ),
        "messages[0].content[0]",
    ),
    (
        "document in a tool result",
        "/v1/messages",
        lambda p: message(
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [text_document(p)]},
            history=[{"role": "user", "content": BENIGN}, TOOL_USE],
        ),
        "messages[2].content[0].content[0]",
    ),
    (
        "custom tool call output",
        "/v1/responses",
        lambda p: responses(
            {"type": "custom_tool_call", "call_id": "c1", "name": "run", "input": "ls"},
            {"type": "custom_tool_call_output", "call_id": "c1", "output": p},
        ),
        "input[2].output",
    ),
    (
        "mcp call output",
        "/v1/responses",
        lambda p: responses(
            {"type": "mcp_call", "id": "mcp_1", "server_label": "kb", "name": "search", "arguments": "{}", "output": p}
        ),
        "input[1].output",
    ),
    (
        "prompt variables",
        "/v1/responses",
        lambda p: responses(prompt={"id": "pmpt_1", "variables": {"city": p}}),
        "prompt.variables.city",
    ),
    (
        "base64 text file",
        "/v1/responses",
        lambda p: responses(
            {
                "role": "user",
                "content": [
                    {"type": "input_file", "filename": "notes.txt", "file_data": f"data:text/plain;base64,{b64(p)}"}
                ],
            }
        ),
        "input[1].content[0].file_data",
    ),
]
UNKNOWN: list[tuple[str, str, Any, str]] = [
    (
        "unknown block type",
        "/v1/messages",
        lambda p: message({"type": "hologram", "text": p}),
        "messages[0].content[0]",
    ),
    ("unknown item type", "/v1/responses", lambda p: responses({"type": "hologram_call", "text": p}), "input[1]"),
]
# what the model wrote earlier, sent back by the client: a forged history must not walk around the guard
HISTORY: list[tuple[str, str, Any, str]] = [
    (
        "anthropic prefill",
        "/v1/messages",
        lambda p: {
            "model": CLAUDE,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": BENIGN}, {"role": "assistant", "content": p}],
        },
        "messages[1]",
    ),
    (
        "anthropic thinking",
        "/v1/messages",
        lambda p: message(
            {"type": "text", "text": BENIGN},
            history=[
                {"role": "user", "content": BENIGN},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": p, "signature": "c2lnbmF0dXJl"}]},
            ],
        ),
        "messages[1].content[0].thinking",
    ),
    (
        "responses assistant output_text",
        "/v1/responses",
        lambda p: responses({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": p}]}),
        "input[1].content[0]",
    ),
    (
        "responses reasoning summary",
        "/v1/responses",
        lambda p: responses({"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": p}]}),
        "input[1].summary[0]",
    ),
    (
        "responses function_call arguments",
        "/v1/responses",
        lambda p: responses(
            {"type": "function_call", "call_id": "c1", "name": "note", "arguments": json.dumps({"note": p})}
        ),
        "input[1].arguments",
    ),
]


def _ids(cases: list[tuple[str, str, Any, str]]) -> list[str]:
    return [case[0] for case in cases]


@pytest.mark.parametrize(
    ("name", "path", "body", "where"), CARRIERS + UNKNOWN + HISTORY, ids=_ids(CARRIERS + UNKNOWN + HISTORY)
)
def test_an_injection_in_any_carrier_is_classified(stack, name, path, body, where) -> None:
    """The injection a user message is blocked for, in a carrier each stage used to skip."""
    response = send(stack, path, body(INJECTION))
    assert response.status_code == 400, response.text
    assert "prompt_injection" in response.text, response.text
    if path != "/v1/messages":  # Anthropic's error shape has no room for the verdict
        assert response.json()["error"]["guard"]["where"] == where
    benign = send(stack, path, body(BENIGN))
    assert benign.status_code == 200, benign.text


@pytest.mark.parametrize(("name", "path", "body", "where"), CARRIERS + UNKNOWN, ids=_ids(CARRIERS + UNKNOWN))
def test_a_secret_in_any_carrier_is_redacted_where_it_was_sent(stack, name, path, body, where) -> None:
    """Redaction reads every carrier in full: the key never reaches the upstream, in whatever encoding it was sent (a
    base64 file is redacted and re-encoded)."""
    response = send(stack, path, body(f"The deploy key is {AWS_KEY}, keep it safe."), tenant="secrets")
    assert response.status_code == 200, response.text
    sent = upstream_body(stack, response)
    text = json.dumps(sent)
    assert AWS_KEY not in text and b64(AWS_KEY)[:16] not in text
    assert "[REDACTED:" in text or any(
        "[REDACTED:" in base64.b64decode(part.split(",", 1)[1]).decode()
        for part in _strings(sent)
        if part.startswith("data:text/plain;base64,")
    )


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    return [s for value in values for s in _strings(value)]


def test_documents_and_tool_results_are_monitored_by_default(stack) -> None:
    """The shipped default: the classifier records what it finds in documents and tool outputs, and serves them."""
    gw, _ = stack
    monitored = (
        'portcullis_guard_verdicts_total{category="prompt_injection",provenance="document",result="monitor",'
        'target="input"}'
    )
    before = series(gw, monitored)
    _, path, body, _ = CARRIERS[0]
    assert send(stack, path, body(INJECTION), tenant="shipped").status_code == 200
    assert series(gw, monitored) == before + 1, "what the classifier found is recorded"
    assert send(stack, path, message({"type": "text", "text": INJECTION}), tenant="shipped").status_code == 400


def test_a_json_escaped_key_in_tool_call_arguments_is_redacted_inside_the_json(stack) -> None:
    """The tool parses the arguments, so it reads `\\u0041KIA...` as the key: the detectors read it so too, and the
    redaction is written back into the arguments as JSON the tool can still parse."""
    escaped = '{"query": "deploy with \\u0041' + AWS_KEY[1:] + '", "n": 1}'
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": escaped}}
    body = {
        "model": CHAT,
        "messages": [
            {"role": "user", "content": BENIGN},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        ],
    }
    response = send(stack, "/v1/chat/completions", body, tenant="secrets")
    assert response.status_code == 200, response.text
    arguments = upstream_body(stack, response)["messages"][1]["tool_calls"][0]["function"]["arguments"]
    parsed = json.loads(arguments)
    assert AWS_KEY not in parsed["query"] and "[REDACTED:" in parsed["query"] and parsed["n"] == 1


def test_a_key_split_by_invisible_characters_is_redacted(stack) -> None:
    """What renders (and tokenizes) as a key is matched as one: zero-width and bidi controls are read past."""
    split = AWS_KEY[:4] + "\u200b" + AWS_KEY[4:10] + "\u202e" + AWS_KEY[10:]
    body = {"model": CHAT, "messages": [{"role": "user", "content": f"Use {split} for the bucket."}]}
    response = send(stack, "/v1/chat/completions", body, tenant="secrets")
    assert response.status_code == 200, response.text
    content = upstream_body(stack, response)["messages"][0]["content"]
    assert AWS_KEY not in content.replace("\u200b", "").replace("\u202e", "") and "[REDACTED:" in content


# (name, path, body with the attack in an identifier or a field no table knows)
IDENTIFIERS: list[tuple[str, str, Any]] = [
    ("responses item id", "/v1/responses", lambda a: responses({"type": "reasoning", "id": a, "summary": []})),
    (
        "responses call_id",
        "/v1/responses",
        lambda a: responses({"type": "function_call_output", "call_id": a, "output": "ok"}),
    ),
    (
        "responses unknown item field",
        "/v1/responses",
        lambda a: responses({"type": "message", "role": "user", "content": BENIGN, "label": a}),
    ),
    (
        "anthropic tool_use name",
        "/v1/messages",
        lambda a: message(
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"},
            history=[
                {"role": "user", "content": BENIGN},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": a, "input": {}}]},
            ],
        ),
    ),
    (
        "anthropic tool_use id",
        "/v1/messages",
        lambda a: message(
            {"type": "text", "text": BENIGN},
            history=[
                {"role": "user", "content": BENIGN},
                {"role": "assistant", "content": [{"type": "tool_use", "id": a, "name": "fetch", "input": {}}]},
            ],
        ),
    ),
    (
        "anthropic tool_use_id",
        "/v1/messages",
        lambda a: message(
            {"type": "tool_result", "tool_use_id": a, "content": "ok"},
            history=[{"role": "user", "content": BENIGN}, TOOL_USE],
        ),
    ),
]


@pytest.mark.parametrize(("name", "path", "body"), IDENTIFIERS, ids=_ids(IDENTIFIERS))  # type: ignore[arg-type]
@pytest.mark.parametrize("attack", [SQLI, XSS, TRAVERSAL], ids=["sqli", "xss", "traversal"])
def test_identifiers_are_read_by_the_web_attack_packs(stack, name, path, body, attack) -> None:
    """Chat's equivalents (a message's name, a tool call's id) have always been arguments: so are every shape's."""
    response = send(stack, path, body(attack))
    assert response.status_code == 403 and "web application firewall" in response.text, response.text


@pytest.mark.parametrize(("name", "path", "body", "where"), UNKNOWN, ids=_ids(UNKNOWN))
def test_unknown_content_is_refused_where_the_policy_says(stack, name, path, body, where) -> None:
    response = send(stack, path, body(BENIGN), tenant="refuse")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "unknown_content" in response.text and where in error["message"], error
    if path == "/v1/messages":
        assert response.json()["type"] == "error", "in the route's own error shape"
    known = send(stack, path, CARRIERS[0][2](BENIGN) if path == "/v1/messages" else responses(), tenant="refuse")
    assert known.status_code == 200, known.text
