"""Carriers and encodings probed the way a hostile client would, through the real gateway process and fake providers
of tests/hostile/test_content_inventory.py (its `secrets` tenant redacts keys).

A body's meaning must be the same for the gateway and for the upstream: a key sent twice in one object is read by
orjson as its last value and by other parsers as its first, so the gateway refuses it rather than judge one value
while the model reads the other.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.hostile.test_content_inventory import (
    AWS_KEY,
    CHAT,
    CLAUDE,
    GPT,
    KEYS,
    send,
    stack,
    upstream_body,
)

__all__ = ["stack"]  # the module's gateway and fake providers, shared with the inventory tests' fixture

SECRET = f"The deploy key is {AWS_KEY}, keep it safe."


def raw(stack, path: str, body: bytes, tenant: str = "secrets") -> httpx.Response:
    gw, _ = stack
    key = KEYS[tenant]
    headers = {"x-api-key": key, "authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(gw.url + path, content=body, headers=headers, timeout=120)


def received(stack, response: httpx.Response) -> list[dict[str, Any]]:
    _, fake = stack
    request_id = response.headers["x-request-id"]
    return [r for r in httpx.get(fake.url + "/_received").json() if r["headers"].get("x-request-id") == request_id]


def filled(template: str, model: str) -> str:
    return template.replace("MODEL", model).replace("SECRET", SECRET)


# (route, a body whose one object names a key twice: the secret first, as a first-wins upstream reads it)
TWICE = [
    (
        "/v1/chat/completions",
        filled('{"model": "MODEL", "messages": [{"role": "user", "content": "SECRET", "content": "hello"}]}', CHAT),
    ),
    (
        "/v1/messages",
        filled(
            '{"model": "MODEL", "max_tokens": 16,'
            ' "messages": [{"role": "user", "content": "SECRET", "content": "hi"}]}',
            CLAUDE,
        ),
    ),
    ("/v1/responses", filled('{"model": "MODEL", "input": "SECRET", "input": "hello"}', GPT)),
]


@pytest.mark.parametrize(("path", "body"), TWICE, ids=[path for path, _ in TWICE])
def test_a_key_sent_twice_in_one_object_is_refused_in_the_routes_shape(stack, path, body) -> None:
    response = raw(stack, path, body.encode())
    assert response.status_code == 400, response.text
    assert not received(stack, response), "nothing goes upstream"
    error = response.json()["error"]
    if path == "/v1/messages":
        assert response.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["code"] == "duplicate_json_key"
    assert "same key twice" in error["message"] and AWS_KEY not in response.text


def test_the_same_key_in_different_objects_and_colons_in_strings_pass(stack) -> None:
    """Keys repeat across objects (every message has a role) and strings hold colons, quotes and escapes."""
    body = (
        '{"model": "MODEL", "messages": [{"role": "system", "content": "a:b \\":\\" \\\\\\\\\\": c"},'
        ' {"role": "user", "content": "https://x.example/\\u003a"}]}'.replace("MODEL", CHAT)
    )
    response = raw(stack, "/v1/chat/completions", body.encode())
    assert response.status_code == 200, response.text


def tool_call_with(arguments: str) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": arguments}}
    return {
        "model": CHAT,
        "messages": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"},
        ],
    }


def sent_arguments(stack, arguments: str) -> str:
    response = send(stack, "/v1/chat/completions", tool_call_with(arguments), tenant="secrets")
    assert response.status_code == 200, response.text
    return upstream_body(stack, response)["messages"][1]["tool_calls"][0]["function"]["arguments"]


def test_a_key_sent_twice_inside_tool_call_arguments_is_read_whole(stack) -> None:
    """Arguments are JSON text the model reads as sent: both values of a key written twice are read."""
    sent = sent_arguments(stack, '{"query": "%s", "query": "weather"}'.replace("%s", AWS_KEY))
    assert AWS_KEY not in sent and "[REDACTED:" in sent


def test_a_secret_in_a_key_of_tool_call_arguments_is_redacted_and_the_json_stays_valid(stack) -> None:
    sent = sent_arguments(stack, json.dumps({"q": {f"use {AWS_KEY} here": "x", "n": [1, {"k": AWS_KEY}]}}))
    parsed = json.loads(sent)
    assert AWS_KEY not in sent and "[REDACTED:" in sent
    inner = parsed["q"]
    assert len(inner) == 2 and inner["n"][0] == 1 and "[REDACTED:" in inner["n"][1]["k"]
    assert any("[REDACTED:" in key and value == "x" for key, value in inner.items())


@pytest.mark.parametrize("glued", [f"deploy_{AWS_KEY}", f"x{AWS_KEY}x", f"9{AWS_KEY}"])
def test_a_key_glued_to_a_word_is_redacted(stack, glued: str) -> None:
    """A key's reader finds it inside `deploy_AKIA…` as surely as between spaces."""
    body = {"model": CHAT, "messages": [{"role": "user", "content": f"Use {glued} for the bucket."}]}
    response = send(stack, "/v1/chat/completions", body, tenant="secrets")
    assert response.status_code == 200, response.text
    content = upstream_body(stack, response)["messages"][0]["content"]
    assert AWS_KEY not in content and "[REDACTED:" in content
