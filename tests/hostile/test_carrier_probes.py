"""Carriers and encodings probed the way a hostile client would, through the real gateway process and fake providers
of tests/hostile/test_content_inventory.py (its `secrets` tenant redacts keys).

A body's meaning must be the same for the gateway and for the upstream: a key sent twice in one object is read by
orjson as its last value and by other parsers as its first, so the gateway refuses it rather than judge one value
while the model reads the other.
"""

from __future__ import annotations

import base64
import html
import json
import re
from typing import Any
from urllib.parse import quote, unquote

import httpx
import pytest

from tests.hostile.test_content_inventory import (
    AWS_KEY,
    CHAT,
    CLAUDE,
    GPT,
    KEYS,
    _strings,
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


def chat_parts(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": CHAT, "messages": [{"role": "user", "content": list(parts)}]}


# (name, route, a body with the secret in a carrier or encoding nobody named)
PROBES: list[tuple[str, str, dict[str, Any]]] = [
    (
        "percent-encoded data: URL in a chat file part",
        "/v1/chat/completions",
        chat_parts({"type": "file", "file": {"filename": "a.txt", "file_data": "data:text/plain," + quote(SECRET)}}),
    ),
    (
        "text data: URL in a chat image_url part",
        "/v1/chat/completions",
        chat_parts(
            {
                "type": "image_url",
                "image_url": {"url": "data:text/plain;base64," + base64.b64encode(SECRET.encode()).decode()},
            }
        ),
    ),
    (
        "text data: URL in a Responses input_image",
        "/v1/responses",
        {
            "model": GPT,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_image",
                            "image_url": "data:text/plain;base64," + base64.b64encode(SECRET.encode()).decode(),
                        }
                    ],
                }
            ],
        },
    ),
    (
        "JSON-in-JSON tool arguments",
        "/v1/chat/completions",
        {
            "model": CHAT,
            "messages": [
                {"role": "user", "content": "hello"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "f", "arguments": json.dumps({"inner": json.dumps({"k": SECRET})})},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "done"},
            ],
        },
    ),
    (
        "Responses text.format schema description",
        "/v1/responses",
        {
            "model": GPT,
            "input": "hello",
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "out",
                    "schema": {"type": "object", "description": SECRET, "properties": {}},
                }
            },
        },
    ),
    (
        "base64url text file",
        "/v1/chat/completions",
        chat_parts(
            {
                "type": "file",
                "file": {
                    "filename": "a.txt",
                    "file_data": base64.urlsafe_b64encode(("??>" + SECRET).encode()).decode(),
                },
            }
        ),
    ),
    (
        "base64 in plain text",
        "/v1/chat/completions",
        chat_parts({"type": "text", "text": "decode: " + base64.b64encode(SECRET.encode()).decode()}),
    ),
    (
        "hex in plain text",
        "/v1/chat/completions",
        chat_parts({"type": "text", "text": "decode: " + SECRET.encode().hex()}),
    ),
    (
        "decimal character references in a chat text part",
        "/v1/chat/completions",
        chat_parts({"type": "text", "text": SECRET.replace("AKIA", "&#65;&#75;IA")}),
    ),
    (
        "hex and named character references in a Responses input_text",
        "/v1/responses",
        {
            "model": GPT,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "Tom &amp; Jerry: " + SECRET.replace("AK", "&#x41;&#x4b;")}
                    ],
                }
            ],
        },
    ),
    (
        "percent-encoding in plain text",
        "/v1/chat/completions",
        chat_parts(
            {
                "type": "text",
                "text": "see https://x.example/?k=" + quote(AWS_KEY[:4], safe="").replace("A", "%41") + AWS_KEY[4:],
            }
        ),
    ),
    (
        "string escapes in plain text",
        "/v1/messages",
        {
            "model": CLAUDE,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": SECRET.replace("AKIA", "\\x41\\u004bIA")}],
        },
    ),
    (
        "a \\u escape in JSON inside a JSON string of tool arguments",
        "/v1/chat/completions",
        tool_call_with(json.dumps({"inner": '{"k": "\\u0041' + AWS_KEY[1:] + '"}'})),
    ),
    (
        "an application/json data: URL in a chat image_url part",
        "/v1/chat/completions",
        chat_parts(
            {
                "type": "image_url",
                "image_url": {
                    "url": "data:application/json;base64,"
                    + base64.b64encode(json.dumps({"k": SECRET}).encode()).decode()
                },
            }
        ),
    ),
    (
        "a text/html data: URL in a Responses input_file",
        "/v1/responses",
        {
            "model": GPT,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_file",
                            "filename": "page.bin",
                            "file_data": "data:text/html;base64,"
                            + base64.b64encode(f"<p>{SECRET}</p>".encode()).decode(),
                        }
                    ],
                }
            ],
        },
    ),
    (
        "Anthropic text block with cache_control",
        "/v1/messages",
        {
            "model": CLAUDE,
            "max_tokens": 16,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": SECRET, "cache_control": {"type": "ephemeral"}}]}
            ],
        },
    ),
    (
        "Anthropic document with citations on",
        "/v1/messages",
        {
            "model": CLAUDE,
            "max_tokens": 16,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "document",
                            "source": {"type": "text", "media_type": "text/plain", "data": SECRET},
                            "citations": {"enabled": True},
                        }
                    ],
                }
            ],
        },
    ),
]


def model_reads(sent: dict[str, Any]) -> list[str]:
    """What a model could read out of the body it got: its strings (and those of JSON written inside them, at any
    depth), text files decoded, and the text as a reader undoes
    entities, percent-encoding, string escapes, base64 (standard and URL-safe) and hex."""
    strings = _nested_strings(_strings(sent))
    files = [s.split(",", 1)[1] for s in strings if s.startswith("data:") and ";base64," in s]
    text = "\n".join([*strings, *(base64.b64decode(data).decode(errors="replace") for data in files)])
    views = [text, html.unescape(text), unquote(text), _escapes_undone(text)]
    for word in re.findall(r"[A-Za-z0-9+/=_-]{24,}", text):
        padded = word + "=" * (-len(word) % 4)
        for decoded in (
            _try(base64.b64decode, padded),
            _try(base64.urlsafe_b64decode, padded),
            _try(bytes.fromhex, word),
        ):
            views.append(decoded.decode(errors="replace"))
    return views


def _nested_strings(strings: list[str]) -> list[str]:
    out = []
    for string in strings:
        out.append(string)
        try:
            inner = json.loads(string)
        except ValueError:
            continue
        if isinstance(inner, (dict, list)):
            out += _nested_strings(_strings(inner))
    return out


def _escapes_undone(text: str) -> str:
    """`\\u0041` and `\\x41` as Python reads them (any other backslash kept as it is)."""
    return re.sub(r"\\(u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2})", lambda m: chr(int(m.group(1)[1:], 16)), text)


def _try(decode: Any, word: str) -> bytes:
    try:
        return decode(word)
    except ValueError:
        return b""


@pytest.mark.parametrize(("name", "path", "body"), PROBES, ids=[name for name, _, _ in PROBES])
def test_a_secret_in_a_carrier_nobody_named_is_redacted(stack, name, path, body) -> None:
    """Carriers and encodings no other test names: what the upstream gets holds the key in no form its model
    reads (files decoded, entities, percent-encoding, base64 and hex undone)."""
    response = send(stack, path, body, tenant="secrets")
    assert response.status_code == 200, response.text
    leaks = [view for view in model_reads(upstream_body(stack, response)) if AWS_KEY in view]
    assert not leaks


OTHER_MODELS = {
    "server-side fallbacks": {"fallbacks": [{"model": "claude-opus-4-1", "max_tokens": 4096}]},
    "the provider's default fallbacks": {"fallbacks": "default"},
    "an advisor tool": {"tools": [{"type": "advisor_20260301", "name": "advisor", "model": "claude-opus-4-1"}]},
}


@pytest.mark.parametrize("extra", OTHER_MODELS.values(), ids=OTHER_MODELS)
def test_a_model_the_provider_would_run_besides_the_requests_own_is_refused(stack, extra) -> None:
    """Beta fields name other models for the provider to run (and bill) on the request's behalf; the gateway
    authorises, limits and charges the one model each attempt names, so such a request never reaches a provider."""
    body = {"model": CLAUDE, "max_tokens": 16, "messages": [{"role": "user", "content": "hello"}], **extra}
    gw, _ = stack
    headers = {"x-api-key": KEYS["secrets"], "anthropic-beta": "server-side-fallback-2026-07-01"}
    response = httpx.post(gw.url + "/v1/messages", json=body, headers=headers, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert "model" in response.json()["error"]["message"]
    assert not received(stack, response), "nothing goes upstream"


def _texts(parts: list[dict[str, Any]]) -> str:
    return "".join(part["text"] for part in parts)


# (name, route, a body with the secret split across adjacent parts of one message, what the model reads of them)
SPLIT = [
    (
        "two chat text parts",
        "/v1/chat/completions",
        chat_parts({"type": "text", "text": SECRET[:22]}, {"type": "text", "text": SECRET[22:]}),
        lambda sent: _texts(sent["messages"][0]["content"]),
    ),
    (
        "three Anthropic text blocks",
        "/v1/messages",
        {
            "model": CLAUDE,
            "max_tokens": 16,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": SECRET[:20]},
                        {"type": "text", "text": SECRET[20:27]},
                        {"type": "text", "text": SECRET[27:]},
                    ],
                }
            ],
        },
        lambda sent: _texts(sent["messages"][0]["content"]),
    ),
    (
        "Responses input_text parts",
        "/v1/responses",
        {
            "model": GPT,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": SECRET[:25]},
                        {"type": "input_text", "text": SECRET[25:]},
                    ],
                }
            ],
        },
        lambda sent: _texts(sent["input"][0]["content"]),
    ),
    (
        "Anthropic system blocks",
        "/v1/messages",
        {
            "model": CLAUDE,
            "max_tokens": 16,
            "system": [{"type": "text", "text": SECRET[:19]}, {"type": "text", "text": SECRET[19:]}],
            "messages": [{"role": "user", "content": "hello"}],
        },
        lambda sent: _texts(sent["system"]),
    ),
]


@pytest.mark.parametrize(("name", "path", "body", "read"), SPLIT, ids=[name for name, _, _, _ in SPLIT])
def test_a_key_split_across_adjacent_parts_of_one_message_is_redacted(stack, name, path, body, read) -> None:
    """A model reads a message's content parts one after another: a key split across them is whole to it, so the
    detectors read the parts joined too, and each part's piece of the key is redacted where it was sent."""
    response = send(stack, path, body, tenant="secrets")
    assert response.status_code == 200, response.text
    joined = read(upstream_body(stack, response))
    assert AWS_KEY not in joined and "[REDACTED:AWS_ACCESS_KEY]" in joined
