"""A request's `model` is held to visible ASCII of at most 256 characters at parse, on every route: a NUL, a DEL,
another script or an overlong name gets a 400 in the route's own shape before anything routes, sends or charges it.
(The operator's config is held to the same rule at start: tests/unit/test_config.py.)

The module runs one gateway: a catch-all pool in front of the hostile upstream, which records every request's tag, so
a request that reached it shows. Each test reads its own tags and access-log lines.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import Launcher, Process, pool
from tests.hostile.conftest import upstream_seen

BAD_NAMES = [
    ("a NUL", "test\x00model"),
    ("a DEL", "test\x7fmodel"),
    ("CJK", "千问"),
    ("a Latin-1 letter", "mod\u00e8le"),
    ("a space", "test model"),
    ("257 characters", "m" * 257),
]
GOOD_NAMES = [
    "ft:gpt-4o-mini-2024-07-18:my-org:custom_suffix:9abcDEF0",
    "meta-llama/Llama-3.1-8B-Instruct",
    "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.anthropic.claude-3-5-sonnet-20241022-v2:0",
    "m" * 256,
]


@pytest.fixture(scope="module")
def upstreams(module_launcher: Launcher, module_hostile_upstream) -> dict[str, Process]:
    return {"hostile": module_hostile_upstream()}


@pytest.fixture(scope="module")
def gw(module_launcher: Launcher, upstreams: dict[str, Process]) -> Process:
    return module_launcher.gateway(
        {
            "pools": [pool("main", upstreams["hostile"].url, max_attempts=1)],
        }
    )


# every route with a model, streaming where it streams; count_tokens is answered by the gateway (no upstream is
# asked), so only its answer is the point
ROUTES = [
    ("chat", False),
    ("chat", True),
    ("completions", False),
    ("completions", True),
    ("responses", False),
    ("responses", True),
    ("embeddings", False),
    ("messages", False),
    ("messages", True),
    ("count_tokens", False),
]
ANTHROPIC_ROUTES = ("messages", "count_tokens")


def ask(gw: Process, route: str, model: str, tag: str, stream: bool = False) -> httpx.Response:
    """A request on `route` for `model`, tagged so the hostile upstream records it if it arrives."""
    spec = {"behaviour": "ok", "tag": tag}
    messages = [{"role": "user", "content": "hello"}]
    paths = {
        "chat": "/v1/chat/completions",
        "completions": "/v1/completions",
        "responses": "/v1/responses",
        "embeddings": "/v1/embeddings",
        "messages": "/v1/messages",
        "count_tokens": "/v1/messages/count_tokens",
    }
    body: dict = {"model": model, "hostile": spec}
    if route == "chat":
        body["messages"] = messages
    elif route == "completions":
        body.update(prompt="hello", max_tokens=8)
    elif route in ("responses", "embeddings"):
        body["input"] = "hello"
    elif route == "messages":  # translated for the chat pool, which keeps no `hostile`: it rides in metadata.user_id
        body = {"model": model, "max_tokens": 8, "messages": messages, "metadata": {"user_id": json.dumps(spec)}}
    else:
        body = {"model": model, "messages": messages}
    if stream:
        body["stream"] = True
    return httpx.post(gw.url + paths[route], json=body, timeout=30)


@pytest.mark.parametrize(("route", "stream"), ROUTES, ids=[f"{r}{'-stream' if s else ''}" for r, s in ROUTES])
@pytest.mark.parametrize(("what", "model"), BAD_NAMES, ids=[w for w, _ in BAD_NAMES])
def test_a_model_no_header_or_label_carries_as_it_is_is_refused_before_anything_is_sent(
    upstreams, gw, route, stream, what, model
):
    tag = f"{route} {stream} {what}"
    response = ask(gw, route, model, tag, stream)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"  # an answer, not a stream that started
    body = response.json()
    if route in ANTHROPIC_ROUTES:  # Anthropic's shape, the field named in its message
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert "'model'" in body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "code", "param"} and body["error"]["param"] == "model", body
    assert upstream_seen(upstreams["hostile"], tag) is None, "the request reached the upstream"
    line = gw.access_log(response.headers["x-request-id"])
    assert (line["status"], line["model"], line["prompt_tokens"], line["completion_tokens"]) == (400, None, None, None)
    assert not line["cost"] and line["pool"] is None, line  # nothing placed, nothing charged


@pytest.mark.parametrize("model", GOOD_NAMES, ids=lambda m: m[:40])
def test_the_ids_providers_issue_are_served_and_named_as_they_are(upstreams, gw, model):
    tag = f"good {model[:40]}"
    response = ask(gw, "chat", model, tag)
    assert response.status_code == 200, response.text
    assert response.headers["x-portcullis-model"] == model
    assert upstream_seen(upstreams["hostile"], tag)["answered"]
