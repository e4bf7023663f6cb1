"""Bad input never costs a 500: each malformed body, wrong type, odd path or vanished client gets the gateway's own
OpenAI-shaped 4xx (or, for a client that left, nothing at all), and the gateway log holds no traceback.

The gateway runs the WAF (every pack) and an exact tokenizer, so the payload reaches the stages that walk it. The
module's tests share it and its upstream: each counts the upstream's requests as a change over the test, and reads
the access log from where it stood when the test began."""

from __future__ import annotations

import hashlib
import json
import time

import httpx
import pytest
import yaml

from tests.conftest import Launcher, chat_body, pool
from tests.hostile.conftest import log_mark
from tests.hostile.raw_http import connect, send_ignoring_reset

KEY = "sk-hostile-input"
HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
CHAT = "/v1/chat/completions"
HELLO = b'"messages": [{"role": "user", "content": "hello"}]'


def raw(fragment: bytes) -> bytes:
    """A chat body with `fragment` (raw JSON text, as no encoder would write it) as one more member."""
    return b'{"model": "test-model", ' + HELLO + b", " + fragment + b"}"


def body(**fields) -> bytes:
    return json.dumps(chat_body(**fields)).encode()


def message(**fields) -> bytes:
    return json.dumps(chat_body(messages=[{"role": "user", **fields}])).encode()


# (what, path, body, expected status, expected `param` or None)
CASES = [
    ("a 5,000-digit integer", CHAT, raw(b'"max_tokens": ' + b"7" * 5000), 400, None),
    ("a 5,000-digit integer where nothing reads it", CHAT, raw(b'"seed": ' + b"7" * 5000), 400, None),
    ("100k nested arrays", CHAT, raw(b'"metadata": ' + b"[" * 100_000 + b"]" * 100_000), 400, None),
    ("100k unclosed arrays", CHAT, raw(b'"metadata": ' + b"[" * 100_000), 400, None),
    ("a number too big for a double", CHAT, raw(b'"temperature": 1e999'), 400, None),
    ("NaN", CHAT, raw(b'"seed": NaN'), 400, None),
    ("Infinity", CHAT, raw(b'"presence_penalty": -Infinity'), 400, None),
    (
        "a lone surrogate escape in a message",
        CHAT,
        b'{"model": "test-model", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}',
        400,
        None,
    ),
    ("a lone surrogate escape in an unread field", CHAT, raw(b'"user": "\\udc00"'), 400, None),
    (
        "UTF-8-encoded surrogate bytes",
        CHAT,
        b'{"model": "test-model", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        400,
        None,
    ),
    (
        "a non-string text part",
        CHAT,
        message(content=[{"type": "text", "text": 5}]),
        400,
        "messages[0].content[0].text",
    ),
    ("a text part without text", CHAT, message(content=[{"type": "text"}]), 400, "messages[0].content[0].text"),
    ("a content part that is not an object", CHAT, message(content=["hi"]), 400, "messages[0].content[0]"),
    ("a numeric message name", CHAT, message(content="hi", name=5), 400, "messages[0].name"),
    (
        "tool-call arguments as an object",
        CHAT,
        json.dumps(
            chat_body(
                messages=[
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
                        ],
                    }
                ]
            )
        ).encode(),
        400,
        "messages[0].tool_calls[0].function.arguments",
    ),
    ("stop as a number", CHAT, body(stop=5), 400, "stop"),
    ("stop with a number inside", CHAT, body(stop=["a", 5]), 400, "stop"),
    ("tools as a string", CHAT, body(tools="all of them"), 400, "tools"),
    (
        "a tool without a name",
        CHAT,
        body(tools=[{"type": "function", "function": {"description": "x"}}]),
        400,
        "tools[0].function.name",
    ),
    (
        "a Responses function tool without a name",
        "/v1/responses",
        json.dumps({"model": "test-model", "input": "hello", "tools": [{"type": "function"}]}).encode(),
        400,
        "tools[0].name",
    ),
    (
        "a tool description as a number",
        CHAT,
        body(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
        400,
        "tools[0].function.description",
    ),
    ("tool_choice as a number", CHAT, body(tool_choice=5), 400, "tool_choice"),
    ("logit_bias as a list", CHAT, body(logit_bias=[1, 2]), 400, "logit_bias"),
    ("logit_bias with a string bias", CHAT, body(logit_bias={"50256": "ban"}), 400, "logit_bias"),
    ("n as a string", CHAT, body(n="2"), 400, "n"),
    ("n as a float", CHAT, body(n=2.5), 400, "n"),
    ("seed as a string", CHAT, body(seed="7"), 400, "seed"),
    (
        "a completions prompt with a lone surrogate",
        "/v1/completions",
        b'{"model": "test-model", "prompt": "\\ud800"}',
        400,
        None,
    ),
    (
        "a completions prompt of mixed types",
        "/v1/completions",
        json.dumps({"model": "test-model", "prompt": ["a", 1]}).encode(),
        400,
        "prompt",
    ),
    (
        "an unknown member shaped like a part, naming a file",
        CHAT,
        raw(b'"extra": {"type": ["text"], "file_id": "file-1"}'),
        404,
        "extra.file_id",
    ),
    ("a trailing slash", CHAT + "/", body(), 404, None),
]


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, tmp_path_factory: pytest.TempPathFactory):
    policies = tmp_path_factory.mktemp("waf") / "policies"
    policies.mkdir()
    (policies / "base.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "portcullis.dev/v1",
                "kind": "Policy",
                "metadata": {"name": "t"},
                "spec": {"waf": {"packs": ["protocol", "scanners", "sqli", "xss", "lfi", "rce", "llm"]}},
            }
        )
    )
    upstream = module_launcher.fake_upstream()
    process = module_launcher.gateway(
        {
            "pools": [pool("main", upstream.url)],
            "policy_dir": str(policies),
            "models": [{"name": "test-model", "tokenizer": "tiktoken:cl100k_base"}],
            "auth": {"keys": [{"tenant": "t", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
        }
    )
    return process, upstream


def access_log(process, since: int, wait: float = 10.0) -> list[dict]:
    """The gateway's JSON access-log entries after `since` in its log, once there is one (a line is written after
    the request ended)."""
    deadline = time.monotonic() + wait
    while True:
        entries = [json.loads(line) for line in process.output()[since:].splitlines() if '"request_id"' in line]
        if entries or time.monotonic() > deadline:
            return entries
        time.sleep(0.1)


def requests_seen(upstream) -> int:
    return httpx.get(upstream.url + "/_stats").json()["requests"]


def test_every_bad_body_gets_an_openai_shaped_4xx_and_no_traceback(gw):
    process, upstream = gw
    before = requests_seen(upstream)
    wrong = []
    for what, path, content, status, param in CASES:
        # a Host of the client's choosing must never come back as a redirect target
        response = httpx.post(
            process.url + path, content=content, headers={**HEADERS, "host": "evil.example"}, timeout=30
        )
        try:
            error = response.json()["error"]
            shaped = set(error) == {"message", "type", "code", "param"} and error["message"]
        except (ValueError, KeyError, TypeError):
            error, shaped = None, False
        if (
            response.status_code != status
            or not shaped
            or (param and error["param"] != param)
            or "location" in response.headers
        ):
            wrong.append(f"{what}: {response.status_code} {response.text[:200]!r}")
    assert not wrong, "\n".join(wrong)
    assert requests_seen(upstream) == before
    assert "Traceback" not in process.output()


def test_a_client_that_leaves_mid_body_is_a_logged_disconnect_not_an_error(gw):
    process, _ = gw
    mark = log_mark(process)  # the earlier tests' lines are all written
    sock = connect(process.url)
    send_ignoring_reset(
        sock,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
        b"authorization: Bearer "
        + KEY.encode()
        + b"\r\ncontent-length: 100000\r\n\r\n"
        + b'{"model": "test-model", "messages": ['
        + b" " * 1000,
    )
    time.sleep(0.3)  # the gateway is reading the body now
    sock.close()
    entries = access_log(process, since=mark)
    log = process.output()
    assert "Traceback" not in log and "unhandled error" not in log
    assert "disconnected" in log[mark:]
    assert [e["status"] for e in entries] == [499]
    assert httpx.get(process.url + "/healthz", timeout=5).status_code == 200


def test_a_non_text_part_with_a_non_string_text_field_is_counted_without_it(gw):
    """Parts other than text parts are the upstream's to judge, stray fields included: the exact (tiktoken) count
    reads the string texts every other stage reads, and never feeds the tokenizer a number or a null."""
    process, upstream = gw
    before = requests_seen(upstream)
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    for stray in (5, None, ["a"]):
        content = [{"type": "text", "text": "What is this?"}, {**image, "text": stray}]
        response = httpx.post(process.url + CHAT, content=message(content=content), headers=HEADERS, timeout=30)
        assert response.status_code == 200, (stray, response.text)
    assert requests_seen(upstream) - before == 3
    assert "Traceback" not in process.output()


def test_an_unserved_route_under_messages_answers_in_anthropics_shape(gw):
    """Message Batches and other Anthropic routes the gateway does not serve: an Anthropic client hears a 404 in its
    own API's shape, naming the routes served."""
    process, upstream = gw
    before = requests_seen(upstream)
    for method, path in (("POST", "/v1/messages/batches"), ("GET", "/v1/messages/batches/msgbatch_1/results")):
        response = httpx.request(method, process.url + path, headers=HEADERS, content=b"{}", timeout=30)
        assert response.status_code == 404, response.text
        body = response.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error", body
        assert "/v1/messages" in body["error"]["message"]
    assert requests_seen(upstream) == before
